// RabbitMQ's Java stream client (com.rabbitmq:stream-client 0.20.0) against `warren serve`'s
// stream TLS listener: args HOST TLS_PORT CA_PEM. Over TLS (CA-verified, hostname checked):
// a super stream routed by key (Route) and by hash (Partitions), read whole by a super stream
// consumer; a filtered consumer that gets the chunks of its value only. Exits 0 when every
// check holds, 1 with a message otherwise. Run by cli/tests/streams.rs
// (java_client_over_tls_super_streams_and_filtering, ignored by default; scripts/test.sh).
import com.rabbitmq.stream.ConfirmationStatus;
import com.rabbitmq.stream.Consumer;
import com.rabbitmq.stream.Environment;
import com.rabbitmq.stream.Message;
import com.rabbitmq.stream.OffsetSpecification;
import com.rabbitmq.stream.Producer;
import io.netty.handler.ssl.SslContext;
import io.netty.handler.ssl.SslContextBuilder;
import java.io.File;
import java.nio.charset.StandardCharsets;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;

public class StreamFeatures {
  static void check(boolean ok, String what) {
    if (!ok) {
      System.err.println("FAILED: " + what);
      System.exit(1);
    }
  }

  static String text(Message m) {
    return new String(m.getBodyAsBinary(), StandardCharsets.UTF_8);
  }

  /// Sends `n` messages made by `make` and waits for every confirm.
  static void sendAll(Producer p, int from, int n, java.util.function.IntFunction<Message> make)
      throws Exception {
    CountDownLatch confirmed = new CountDownLatch(n);
    AtomicLong failed = new AtomicLong();
    for (int i = from; i < from + n; i++) {
      p.send(
          make.apply(i),
          (ConfirmationStatus s) -> {
            if (!s.isConfirmed()) failed.incrementAndGet();
            confirmed.countDown();
          });
    }
    check(confirmed.await(60, TimeUnit.SECONDS), "confirms within 60 s");
    check(failed.get() == 0, failed.get() + " publishes not confirmed");
  }

  public static void main(String[] args) throws Exception {
    String host = args[0];
    int port = Integer.parseInt(args[1]);
    SslContext ssl = SslContextBuilder.forClient().trustManager(new File(args[2])).build();
    try (Environment env =
        Environment.builder()
            .host(host)
            .port(port)
            .tls()
            .sslContext(ssl)
            .environmentBuilder()
            .build()) {
      // Super stream: 3 partitions (keys "0", "1", "2"), routed by key.
      env.streamCreator().name("invoices").superStream().partitions(3).creator().create();
      Producer byKey =
          env.producerBuilder()
              .superStream("invoices")
              .routing(m -> m.getProperties().getMessageIdAsString())
              .key()
              .producerBuilder()
              .build();
      sendAll(
          byKey,
          0,
          300,
          i ->
              byKey
                  .messageBuilder()
                  .properties()
                  .messageId(String.valueOf(i % 3))
                  .messageBuilder()
                  .addData(("inv-" + i).getBytes(StandardCharsets.UTF_8))
                  .build());
      byKey.close();
      // By hash: every message lands in some partition (Partitions lists them).
      Producer byHash =
          env.producerBuilder()
              .superStream("invoices")
              .routing(m -> m.getProperties().getMessageIdAsString())
              .producerBuilder()
              .build();
      sendAll(
          byHash,
          300,
          30,
          i ->
              byHash
                  .messageBuilder()
                  .properties()
                  .messageId("h" + i)
                  .messageBuilder()
                  .addData(("inv-" + i).getBytes(StandardCharsets.UTF_8))
                  .build());
      byHash.close();
      Map<String, String> where = new ConcurrentHashMap<>();
      CountDownLatch all = new CountDownLatch(330);
      Consumer sc =
          env.consumerBuilder()
              .superStream("invoices")
              .offset(OffsetSpecification.first())
              .messageHandler(
                  (ctx, m) -> {
                    where.put(text(m), ctx.stream());
                    all.countDown();
                  })
              .build();
      check(all.await(60, TimeUnit.SECONDS), "330 super stream messages, got " + where.size());
      for (int i = 0; i < 300; i++) {
        check(
            ("invoices-" + (i % 3)).equals(where.get("inv-" + i)),
            "inv-" + i + " in partition " + where.get("inv-" + i));
      }
      sc.close();
      env.deleteSuperStream("invoices");

      // Filtering: all "california" first, then all "texas" (separate chunks).
      env.streamCreator().stream("states").create();
      Producer states =
          env.producerBuilder()
              .stream("states")
              .filterValue(m -> (String) m.getApplicationProperties().get("state"))
              .build();
      for (String state : new String[] {"california", "texas"}) {
        sendAll(
            states,
            0,
            100,
            i ->
                states
                    .messageBuilder()
                    .applicationProperties()
                    .entry("state", state)
                    .messageBuilder()
                    .addData((state + "-" + i).getBytes(StandardCharsets.UTF_8))
                    .build());
      }
      states.close();
      AtomicLong seen = new AtomicLong();
      AtomicLong kept = new AtomicLong();
      CountDownLatch hundred = new CountDownLatch(100);
      Consumer fc =
          env.consumerBuilder()
              .stream("states")
              .offset(OffsetSpecification.first())
              .filter()
              .values("california")
              .postFilter(
                  m -> {
                    seen.incrementAndGet();
                    return "california".equals(m.getApplicationProperties().get("state"));
                  })
              .builder()
              .messageHandler(
                  (ctx, m) -> {
                    check(text(m).startsWith("california-"), "filtered: " + text(m));
                    kept.incrementAndGet();
                    hundred.countDown();
                  })
              .build();
      check(hundred.await(60, TimeUnit.SECONDS), "100 california messages");
      Thread.sleep(500);
      check(kept.get() == 100, kept.get() + " messages passed the filter");
      check(seen.get() < 200, "the server skipped texas chunks: " + seen.get() + " seen");
      fc.close();
      env.deleteStream("states");
      System.out.println(
          "super stream: 330 routed and consumed; filter: " + seen.get() + " seen, 100 kept");
    }
  }
}
