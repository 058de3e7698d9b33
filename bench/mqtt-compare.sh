#!/usr/bin/env bash
# Warren vs rumqttd 0.20 and Mosquitto 2.0 on issue 22's MQTT table, in one run: QoS 0 1 -> 1,
# QoS 1 1 -> 1 and QoS 0 fan-in 100 -> 1, 64-byte payloads (`warren-bench`'s lean client).
# Each broker is started alone (so an idle one does not share the cores), runs the three
# workloads and is stopped; the brokers take turns for ROUNDS rounds (interleaved: a
# machine shared with other work changes speed over minutes, and each broker then gets
# each phase). Prints, per workload and round: received msg/s, broker RSS peak (MB) and the
# broker's CPU microseconds per delivered message (utime+stime from /proc/PID/stat at the
# run's start and end), and Warren's ratio to each peer.
#   bench/mqtt-compare.sh [SECONDS]      (default 10)
# Env:
#   BROKERS  default "warren rumqttd mosquitto" (rumqttd: `cargo install rumqttd --version
#            0.20.0`; `--locked` fails to build its pinned `metrics` on this rustc)
#   ROUNDS   default 2;  FAN publishers of fan-in, default 100;  SIZE default 64
#   LEAD     publishers stay at most this many messages ahead of what the subscriber
#            received (default 10000; 0: unbounded, which measures a backlog's growth in a
#            broker that takes faster than it delivers: bench/README.md, "MQTT: a fair
#            harness")
#   WARREN, BENCH  binaries (default target/release/warren, target/release/warren-bench)
#   OUT      JSON results and logs (default target/bench/mqtt-compare)
#   WARREN_MQTT_PORT 1892, MOSQUITTO_PORT 1893, RUMQTTD_PORT 1894
# Warren runs `--in-memory` (the peers keep nothing on disk either); Mosquitto with
# max_inflight_messages 1000 and max_queued_messages 100000 (the defaults, 20 and 1000,
# throttle QoS 1 and drop what a slow subscriber has not taken); rumqttd with
# bench/rumqttd.toml (its port rewritten).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
warren=${WARREN:-target/release/warren}
bench=${BENCH:-target/release/warren-bench}
brokers=${BROKERS:-warren rumqttd mosquitto}
rounds=${ROUNDS:-2}
fan=${FAN:-100}
size=${SIZE:-64}
lead=${LEAD:-10000}
out=${OUT:-target/bench/mqtt-compare}
wm=${WARREN_MQTT_PORT:-1892}; mp=${MOSQUITTO_PORT:-1893}; qp=${RUMQTTD_PORT:-1894}
[ -x "$warren" ] || { echo "$warren not found: cargo build --release -p warren-cli"; exit 2; }
[ -x "$bench" ] || { echo "$bench not found: cargo build --release -p warren-bench"; exit 2; }
rm -rf "$out" && mkdir -p "$out"
scratch=$(mktemp -d /tmp/warren-mqtt-compare.XXXXXX)
pid=""
stop() {
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    timeout 20 tail --pid="$pid" -f /dev/null || kill -KILL "$pid" 2>/dev/null || true
  fi
  pid=""
}
cleanup() { stop; rm -rf "$scratch"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_port() { # port log
  local t=$((SECONDS + 60))
  until (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; do
    if [ "$SECONDS" -ge "$t" ]; then
      echo "nothing accepts connections on 127.0.0.1:$1 after 60s; log:"; tail -20 "$2"
      return 1
    fi
    sleep 0.2
  done
}

for round in $(seq 1 "$rounds"); do
  for b in $brokers; do
    log="$out/$b-$round.log"
    case $b in
      warren)
        "$warren" serve --in-memory --data-dir "$scratch/warren-data" --amqp none --mqtt "127.0.0.1:$wm" \
          --management none --prometheus none --stream none > "$log" 2>&1 &
        pid=$!; port=$wm ;;
      mosquitto)
        printf 'listener %s 127.0.0.1\nallow_anonymous true\nmax_inflight_messages 1000\nmax_queued_messages 100000\n' \
          "$mp" > "$scratch/mosquitto.conf"
        mosquitto -c "$scratch/mosquitto.conf" > "$log" 2>&1 &
        pid=$!; port=$mp ;;
      rumqttd)
        sed "s/127.0.0.1:1894/127.0.0.1:$qp/" bench/rumqttd.toml > "$scratch/rumqttd.toml"
        rumqttd -q -c "$scratch/rumqttd.toml" > "$log" 2>&1 &
        pid=$!; port=$qp ;;
      *) echo "unknown broker $b"; exit 2 ;;
    esac
    wait_port "$port" "$log"
    for w in mqtt-qos0 mqtt-qos1 mqtt-fan-in; do
      echo "== round $round, $b: $w (${secs}s), load $(cut -d' ' -f1-3 /proc/loadavg)"
      cut -d' ' -f1 /proc/loadavg > "$out/$b-$round-$w.load"
      # Serialised with other engineers' measurements (as conns-compare.sh).
      flock /tmp/warren-measure.lock "$bench" "$w" --mqtt "127.0.0.1:$port" --seconds "$secs" --size "$size" --qos 0 \
        --fan "$fan" --lead "$lead" --broker-pid "$pid" --format json > "$out/$b-$round-$w.json"
    done
    stop
  done
done

python3 - "$out" "$rounds" $brokers <<'PY'
import json, os, sys
out, rounds, brokers = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def load(b, r, w):
    rows = json.load(open(os.path.join(out, "%s-%d-%s.json" % (b, r, w))))
    return rows[0]
def loadavg(b, r, w):
    try:
        return open(os.path.join(out, "%s-%d-%s.load" % (b, r, w))).read().strip()
    except OSError:
        return "-"
def cpu_us(r):
    if r.get("broker_cpu_pct") is None or not r["received"]:
        return "-"
    return "%.2f" % (r["broker_cpu_pct"] / 100 * r["seconds"] * 1e6 / r["received"])
def rss(r):
    v = r.get("broker_rss_bytes")
    return "-" if v is None else "%.0f" % (v / 1048576)
bad = []
print("\nreceived msg/s | broker RSS peak MB | broker CPU us per delivered message | 1-min load average at the start")
print("| workload | round | " + " | ".join(brokers) + " | "
      + " | ".join("warren / %s" % b for b in brokers if b != "warren") + " |")
print("|---" * (2 + len(brokers) + len([b for b in brokers if b != "warren"])) + "|")
for w in ("mqtt-qos0", "mqtt-qos1", "mqtt-fan-in"):
    for r in range(1, rounds + 1):
        res = {b: load(b, r, w) for b in brokers}
        for b, x in res.items():
            if x["errors"] or not x["received"]:
                bad.append("%s round %d %s: %s" % (b, r, w, x["errors"] or "nothing received"))
        cells = ["%.0f / %s / %s / %s" % (x["received_per_sec"], rss(x), cpu_us(x), loadavg(b, r, w))
                 for b, x in res.items()]
        ratios = []
        for b in brokers:
            if b == "warren":
                continue
            o = res[b]["received_per_sec"]
            ratios.append("%.2fx" % (res["warren"]["received_per_sec"] / o) if o and "warren" in res else "-")
        print("| %s | %d | %s | %s |" % (res[brokers[0]]["workload"], r, " | ".join(cells), " | ".join(ratios)))
if bad:
    print("\nFAILED:")
    for b in bad:
        print("  " + b)
    sys.exit(1)
PY
