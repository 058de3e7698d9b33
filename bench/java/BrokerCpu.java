// The broker's CPU time for the stream benchmarks (StreamFill, StreamConsume): with
// -Dbroker.pid=PID, user + system time of that process from /proc/PID/stat, so a run reports
// what each cell cost the broker besides its rate (on a small machine the clients, not the
// broker, bound the rates). Compiled with the others (bench/stream-compare.sh runs javac).
/** The broker's CPU time so far in ns: the sum over its threads of /proc/PID/task/T/schedstat's
 * first field (ns precision; /proc/PID/stat counts 10 ms ticks, too coarse for 50k messages of
 * 1 us each). A thread that ends between two readings takes its time with it: the runtimes
 * measured here keep their threads. */
public class BrokerCpu {
  static long nanos() {
    String pid = System.getProperty("broker.pid");
    if (pid == null) return -1;
    long sum = 0;
    try (java.nio.file.DirectoryStream<java.nio.file.Path> tasks =
        java.nio.file.Files.newDirectoryStream(java.nio.file.Paths.get("/proc", pid, "task"))) {
      for (java.nio.file.Path t : tasks) {
        try {
          String s = new String(java.nio.file.Files.readAllBytes(t.resolve("schedstat")));
          sum += Long.parseLong(s.trim().split(" ")[0]);
        } catch (java.io.IOException e) {
          // The thread ended meanwhile.
        }
      }
      return sum;
    } catch (Exception e) {
      return -1;
    }
  }

  static void print(String what, String stream, long t0, long t1, long count, String label) {
    if (t0 < 0 || t1 < 0) return;
    System.out.printf(
        "cpu     %-8s %-20s %8.3f us/msg broker %s%n", what, stream, (t1 - t0) / 1000.0 / count, label);
  }
}
