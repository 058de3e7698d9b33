// RabbitMQ's Java stream client (com.rabbitmq:stream-client 0.20.0) against a Warren stream
// listener: args HOST PORT COUNT. Exits 0 when every check holds, 1 with a message otherwise.
// Run by gateway-stream/tests/java_client.rs (ignored by default; scripts/test.sh runs it).
import com.rabbitmq.stream.ConfirmationStatus;
import com.rabbitmq.stream.Consumer;
import com.rabbitmq.stream.Environment;
import com.rabbitmq.stream.NoOffsetException;
import com.rabbitmq.stream.OffsetSpecification;
import com.rabbitmq.stream.Producer;
import java.nio.charset.StandardCharsets;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.AtomicReference;

public class StreamCheck {
  static void check(boolean ok, String what) {
    if (!ok) {
      System.err.println("FAILED: " + what);
      System.exit(1);
    }
  }

  static byte[] body(long i) {
    return ("java-" + i).getBytes(StandardCharsets.UTF_8);
  }

  public static void main(String[] args) throws Exception {
    String host = args[0];
    int port = Integer.parseInt(args[1]);
    int count = Integer.parseInt(args[2]);
    String stream = "java-check";
    try (Environment env = Environment.builder().host(host).port(port).build()) {
      env.streamCreator().stream(stream).create();

      // Publish with confirms; a named producer (deduplication) with explicit ids 1..count.
      Producer producer = env.producerBuilder().stream(stream).name("java-writer").build();
      CountDownLatch confirmed = new CountDownLatch(count);
      AtomicLong failed = new AtomicLong();
      long start = System.nanoTime();
      for (long i = 1; i <= count; i++) {
        producer.send(
            producer.messageBuilder().publishingId(i).addData(body(i)).build(),
            s -> {
              if (s.isConfirmed()) confirmed.countDown();
              else failed.incrementAndGet();
            });
      }
      check(confirmed.await(120, TimeUnit.SECONDS), "all " + count + " confirmed");
      double secs = (System.nanoTime() - start) / 1e9;
      System.out.printf("published %d with confirms in %.2f s (%.0f msg/s)%n", count, secs, count / secs);
      check(failed.get() == 0, "no negative confirm");
      check(producer.getLastPublishingId() == count, "last publishing id " + producer.getLastPublishingId());

      // Re-sent ids 1..100 are confirmed and not stored again.
      CountDownLatch again = new CountDownLatch(100);
      for (long i = 1; i <= 100; i++) {
        producer.send(
            producer.messageBuilder().publishingId(i).addData(body(-i)).build(),
            s -> {
              if (s.isConfirmed()) again.countDown();
            });
      }
      check(again.await(30, TimeUnit.SECONDS), "re-sent ids confirmed");
      producer.close();

      // Consume all from first, in order, with their offsets (Deliver v2: this client offers it).
      CountDownLatch received = new CountDownLatch(count);
      AtomicLong next = new AtomicLong();
      AtomicReference<String> bad = new AtomicReference<>();
      start = System.nanoTime();
      Consumer consumer =
          env.consumerBuilder()
              .stream(stream)
              .name("java-reader")
              .manualTrackingStrategy()
              .builder()
              .offset(OffsetSpecification.first())
              .messageHandler(
                  (ctx, msg) -> {
                    long expected = next.getAndIncrement();
                    String got = new String(msg.getBodyAsBinary(), StandardCharsets.UTF_8);
                    if (ctx.offset() != expected || !got.equals("java-" + (expected + 1))) {
                      bad.compareAndSet(null, "offset " + ctx.offset() + " body " + got + ", expected " + expected);
                    }
                    if (expected == count / 2) ctx.storeOffset();
                    received.countDown();
                  })
              .build();
      check(received.await(120, TimeUnit.SECONDS), "all " + count + " received, got " + next.get());
      secs = (System.nanoTime() - start) / 1e9;
      System.out.printf("consumed %d from first in %.2f s (%.0f msg/s)%n", count, secs, count / secs);
      Thread.sleep(500);
      check(bad.get() == null, "in order: " + bad.get());
      check(next.get() == count, "nothing stored twice: " + next.get() + " messages");
      long stored = -1;
      for (int i = 0; i < 50 && stored != count / 2; i++) {
        try {
          stored = consumer.storedOffset();
        } catch (NoOffsetException e) {
          Thread.sleep(100);
        }
      }
      check(stored == count / 2, "stored offset " + stored);
      consumer.close();

      // Sub-entry batching with compression: 100 gzip'd batches of 10 messages are stored as
      // sub-batch entries (10 records each) and read back as 1000 messages with offsets.
      Producer batching =
          env.producerBuilder()
              .stream(stream)
              .subEntrySize(10)
              .compression(com.rabbitmq.stream.compression.Compression.GZIP)
              .build();
      CountDownLatch batchConfirmed = new CountDownLatch(1000);
      for (int i = 0; i < 1000; i++) {
        batching.send(
            batching.messageBuilder().addData(("batched-" + i).getBytes(StandardCharsets.UTF_8)).build(),
            s -> {
              if (s.isConfirmed()) batchConfirmed.countDown();
            });
      }
      check(batchConfirmed.await(60, TimeUnit.SECONDS), "sub-entry batches confirmed");
      batching.close();
      CountDownLatch batchReceived = new CountDownLatch(1000);
      AtomicLong batchNext = new AtomicLong();
      Consumer batchReader =
          env.consumerBuilder()
              .stream(stream)
              .offset(OffsetSpecification.offset(count))
              .messageHandler(
                  (ctx, msg) -> {
                    long i = batchNext.getAndIncrement();
                    String got = new String(msg.getBodyAsBinary(), StandardCharsets.UTF_8);
                    if (ctx.offset() != count + i || !got.equals("batched-" + i)) {
                      bad.compareAndSet(null, "batched offset " + ctx.offset() + " body " + got);
                    }
                    batchReceived.countDown();
                  })
              .build();
      check(batchReceived.await(60, TimeUnit.SECONDS), "sub-entry messages received: " + batchNext.get());
      check(bad.get() == null, "sub-entry order: " + bad.get());
      batchReader.close();
      env.deleteStream(stream);
    }
    System.out.println("java stream client: ok");
  }
}
