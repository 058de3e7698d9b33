// The broker's CPU time for the stream benchmarks (StreamFill, StreamConsume): with
// -Dbroker.pid=PID they print what each cell cost the broker besides its rate (on a small
// machine the clients, not the broker, bound the rates). Compiled with the others
// (bench/stream-compare.sh runs javac).
import java.nio.file.DirectoryStream;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.HashMap;
import java.util.Map;

/**
 * A reading of the broker's CPU time: per thread from /proc/PID/task/T/schedstat (ns; the
 * process's /proc/PID/stat counts 10 ms ticks, too coarse for 50k messages of 1 us each), and
 * those ticks, used when a thread ended between two readings (its time left with it; runtimes
 * end idle pool threads, e.g. tokio's blocking threads after 10 s).
 */
public class BrokerCpu {
  final Map<String, Long> threads = new HashMap<>();
  long ticks = -1;

  static BrokerCpu read() {
    String pid = System.getProperty("broker.pid");
    if (pid == null || pid.isEmpty()) return null;
    BrokerCpu r = new BrokerCpu();
    try (DirectoryStream<Path> tasks = Files.newDirectoryStream(Paths.get("/proc", pid, "task"))) {
      for (Path t : tasks) {
        try {
          String s = new String(Files.readAllBytes(t.resolve("schedstat"))).trim();
          r.threads.put(t.getFileName().toString(), Long.parseLong(s.split(" ")[0]));
        } catch (Exception e) {
          // The thread ended meanwhile.
        }
      }
      String stat = new String(Files.readAllBytes(Paths.get("/proc", pid, "stat")));
      // Fields after the command name, which is in parentheses and may hold spaces.
      String[] f = stat.substring(stat.lastIndexOf(')') + 2).split(" ");
      r.ticks = Long.parseLong(f[11]) + Long.parseLong(f[12]);
      return r;
    } catch (Exception e) {
      return null;
    }
  }

  /** CPU ns from `a` to `b`. */
  static long between(BrokerCpu a, BrokerCpu b) {
    long ns = 0;
    for (Map.Entry<String, Long> e : b.threads.entrySet()) {
      Long before = a.threads.get(e.getKey());
      ns += e.getValue() - (before == null ? 0 : before);
    }
    for (String t : a.threads.keySet()) {
      if (!b.threads.containsKey(t)) return (b.ticks - a.ticks) * 10_000_000L;
    }
    return ns;
  }

  static void print(String what, String stream, BrokerCpu a, BrokerCpu b, long count, String label) {
    if (a == null || b == null) return;
    System.out.printf(
        "cpu     %-8s %-20s %8.3f us/msg broker %s%n",
        what, stream, between(a, b) / 1000.0 / count, label);
  }
}
