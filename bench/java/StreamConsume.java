// Stream PerfTest's consumer, as seed 003 runs it (`--producers 0 --consumers 1 --offset first
// --initial-credits 50 --no-latency --cmessages N`), for the streams `warren-bench stream fill`
// made: Stream PerfTest itself is not on Maven Central, its client is. Same client (RabbitMQ's
// Java stream client), same settings: offset first, 50 initial credits, no offset tracking,
// messages counted, nothing parsed. One JVM for all streams (the JIT warms up on the first).
// With -Dbroker.pid=PID it also prints the broker's CPU time per message over each consume
// (BrokerCpu.java).
// Usage (compiled with BrokerCpu.java): java -cp "LIB/*:CLASSES" StreamConsume HOST PORT COUNT LABEL STREAM...
import com.rabbitmq.stream.Consumer;
import com.rabbitmq.stream.Environment;
import com.rabbitmq.stream.OffsetSpecification;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;

public class StreamConsume {
  public static void main(String[] args) throws Exception {
    String host = args[0];
    int port = Integer.parseInt(args[1]);
    long count = Long.parseLong(args[2]);
    String label = args[3];
    try (Environment env = Environment.builder().host(host).port(port).build()) {
      for (int i = 4; i < args.length; i++) {
        String stream = args[i];
        CountDownLatch done = new CountDownLatch(1);
        AtomicLong got = new AtomicLong();
        BrokerCpu cpu0 = BrokerCpu.read();
        long start = System.nanoTime();
        Consumer consumer =
            env.consumerBuilder()
                .stream(stream)
                .offset(OffsetSpecification.first())
                .noTrackingStrategy()
                .flow()
                .initialCredits(50)
                .builder()
                .messageHandler(
                    (ctx, msg) -> {
                      if (got.incrementAndGet() == count) done.countDown();
                    })
                .build();
        boolean all = done.await(300, TimeUnit.SECONDS);
        double secs = (System.nanoTime() - start) / 1e9;
        BrokerCpu cpu1 = BrokerCpu.read();
        consumer.close();
        if (!all) {
          System.err.printf("%s: %d of %d within 300 s%n", stream, got.get(), count);
          System.exit(1);
        }
        System.out.printf(
            "java    %-20s %10.0f msg/s %s%n", stream, count / secs, label);
        BrokerCpu.print("java", stream, cpu0, cpu1, count, label);
      }
    }
  }
}
