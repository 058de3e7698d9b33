// Fills the streams of seed 003's grid with RabbitMQ's Java stream client (works with RabbitMQ
// 3.10, which the Rust client 0.11 cannot talk to): for each size and chunk size, stream
// `bench-SIZE-CHUNK` (deleted first if it exists) gets COUNT messages of SIZE bytes from a
// producer whose batch size is the chunk size (a full batch is one Publish frame, one chunk),
// at most 20,000 unconfirmed; prints the rate until the last confirm. With EXACT (a 7th
// argument `exact`) at most one batch is unconfirmed: a broker that forms chunks from what its
// writer has queued (RabbitMQ's osiris) then also writes one chunk per batch (Warren writes one
// per Publish frame either way).
// With -Dbroker.pid=PID it also prints the broker's CPU time per message over each fill (user +
// system from /proc/PID/stat: the clients, not the broker, bound the rates on a small machine).
// With -Dfill.delete=true each stream is deleted after its cell (as `warren-bench stream
// publish` does): the next cell writes into the page-cache pages it freed, not into pages this
// VM may have returned to the host (bench/stream-publish.sh, WARM, says why that matters).
// With -Dfill.warmup=N, N messages of the first size and chunk go to stream `bench-warmup`
// (deleted after) before the grid, unreported: without it the first cell also measures the
// JVM compiling the client (at 12 B x 1 a warm client publishes 2-3x faster, and a broker
// idling between a slow client's writes costs more per message).
// Usage (compiled with BrokerCpu.java): java -cp "LIB/*:CLASSES" StreamFill HOST PORT COUNT LABEL SIZES CHUNKS [exact]
import com.rabbitmq.stream.Environment;
import com.rabbitmq.stream.Producer;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;

public class StreamFill {
  public static void main(String[] args) throws Exception {
    String host = args[0];
    int port = Integer.parseInt(args[1]);
    int count = Integer.parseInt(args[2]);
    String label = args[3];
    boolean exact = args.length > 6 && args[6].equals("exact");
    try (Environment env = Environment.builder().host(host).port(port).build()) {
      int warmup = Integer.getInteger("fill.warmup", 0);
      if (warmup > 0) {
        try {
          env.deleteStream("bench-warmup");
        } catch (Exception e) {
          // not there
        }
        env.streamCreator().stream("bench-warmup").create();
        Producer p =
            env.producerBuilder()
                .stream("bench-warmup")
                .batchSize(Integer.parseInt(args[5].split(",")[0]))
                .maxUnconfirmedMessages(20_000)
                .build();
        byte[] b = new byte[Integer.parseInt(args[4].split(",")[0])];
        CountDownLatch done = new CountDownLatch(warmup);
        for (int i = 0; i < warmup; i++) {
          p.send(p.messageBuilder().addData(b).build(), s -> done.countDown());
        }
        if (!done.await(300, TimeUnit.SECONDS)) {
          System.err.println("bench-warmup: not all confirmed");
          System.exit(1);
        }
        p.close();
        env.deleteStream("bench-warmup");
      }
      for (String size : args[4].split(",")) {
        for (String chunk : args[5].split(",")) {
          String stream = "bench-" + size + "-" + chunk;
          try {
            env.deleteStream(stream);
          } catch (Exception e) {
            // not there
          }
          env.streamCreator().stream(stream).create();
          Producer producer =
              env.producerBuilder()
                  .stream(stream)
                  .batchSize(Integer.parseInt(chunk))
                  .maxUnconfirmedMessages(exact ? Integer.parseInt(chunk) : 20_000)
                  .build();
          byte[] body = new byte[Integer.parseInt(size)];
          CountDownLatch confirmed = new CountDownLatch(count);
          AtomicLong failed = new AtomicLong();
          BrokerCpu cpu0 = BrokerCpu.read();
          long start = System.nanoTime();
          for (int i = 0; i < count; i++) {
            producer.send(
                producer.messageBuilder().addData(body).build(),
                s -> {
                  if (!s.isConfirmed()) failed.incrementAndGet();
                  confirmed.countDown();
                });
          }
          if (!confirmed.await(300, TimeUnit.SECONDS) || failed.get() > 0) {
            System.err.printf("%s: not all confirmed (%d failed)%n", stream, failed.get());
            System.exit(1);
          }
          double secs = (System.nanoTime() - start) / 1e9;
          BrokerCpu cpu1 = BrokerCpu.read();
          producer.close();
          System.out.printf(
              "fill    %-20s %10.0f msg/s published with confirms %s%n", stream, count / secs, label);
          BrokerCpu.print("fill", stream, cpu0, cpu1, count, label);
          if (Boolean.getBoolean("fill.delete")) env.deleteStream(stream);
        }
      }
    }
  }
}

