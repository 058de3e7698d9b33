#!/usr/bin/env bash
# Warren vs RabbitMQ 3.10 (AMQP) and Warren vs Mosquitto 2.0 and rumqttd 0.20 (MQTT) with
# `warren-bench`, in
# one run: starts each broker itself on side ports (one at a time, so an idle broker does
# not share the cores with the one under load), runs the workloads, stops it, and prints the
# rates and ratios. Fails if any workload reports an error or moved no messages.
#   bench/compare.sh [SECONDS] [-- extra warren-bench flags]
# Env:
#   BROKERS   which brokers to run (default "warren rabbitmq mosquitto", plus rumqttd when
#             installed: `cargo install rumqttd --version 0.20.0`)
#   WARREN    the broker binary (default target/release/warren; CI passes target/debug/warren)
#   BENCH     the load generator (default target/release/warren-bench; CI: target/debug/...)
#   OUT       where JSON results, logs and SVG plots go (default target/bench/compare)
#   WARREN_AMQP_PORT 5782, WARREN_MQTT_PORT 1892, RABBIT_PORT 5783, MOSQUITTO_PORT 1893,
#   RUMQTTD_PORT 1894
#   MQTT_ONLY=1   Warren runs only the MQTT workloads (mqtt-all), as the MQTT peers do
#   STARTUP_TIMEOUT   seconds a broker may take to accept connections (default 60)
# Mosquitto runs with max_inflight_messages 1000 (Warren's outbound window is 1024; the
# default 20 would throttle QoS 1/2 deliveries) and max_queued_messages 100000 (the default
# 1000 drops QoS 1 messages a slow subscriber has not taken yet). rumqttd runs with
# bench/rumqttd.toml (its port rewritten). The MQTT table adds each broker's RSS peak and its
# CPU time per delivered message (utime+stime from /proc/PID/stat over the run).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}; shift || true
[ "${1:-}" = "--" ] && shift
extra=("$@")
warren=${WARREN:-target/release/warren}
bench=${BENCH:-target/release/warren-bench}
default_brokers="warren rabbitmq mosquitto"
command -v rumqttd >/dev/null && default_brokers="$default_brokers rumqttd"
brokers=${BROKERS:-$default_brokers}
out=${OUT:-target/bench/compare}
wa=${WARREN_AMQP_PORT:-5782}; wm=${WARREN_MQTT_PORT:-1892}
rp=${RABBIT_PORT:-5783}; mp=${MOSQUITTO_PORT:-1893}; qp=${RUMQTTD_PORT:-1894}
startup=${STARTUP_TIMEOUT:-60}
node="rabbit-compare-$rp@localhost"
[ -x "$warren" ] || { echo "$warren not found: cargo build --release -p warren-cli"; exit 2; }
[ -x "$bench" ] || { echo "$bench not found: cargo build --release -p warren-bench"; exit 2; }
rm -rf "$out" && mkdir -p "$out"
# RabbitMQ's start script drops to the rabbitmq user: its directories must be writable.
scratch=$(mktemp -d /tmp/warren-compare.XXXXXX)
chmod 777 "$scratch"

pid=""
rabbit_up=""
stop() {
  if [ -n "$rabbit_up" ]; then
    rabbitmqctl -n "$node" stop >/dev/null 2>&1 || true
    rabbit_up=""
  fi
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
  local t=$((SECONDS + startup))
  until (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; do
    if [ "$SECONDS" -ge "$t" ]; then
      echo "nothing accepts connections on 127.0.0.1:$1 after ${startup}s; log:"
      tail -20 "$2"
      return 1
    fi
    sleep 0.2
  done
}

run() { # name args...
  local name=$1; shift
  echo "== $name: warren-bench $* (${secs}s per workload)"
  "$bench" "$@" --seconds "$secs" "${extra[@]}" --broker-pid "$pid" --format json \
    --svg "$out/svg-$name" > "$out/$name.json"
}

for b in $brokers; do
  case $b in
    warren)
      "$warren" serve --amqp "127.0.0.1:$wa" --mqtt "127.0.0.1:$wm" --management none --prometheus none --stream none \
        --data-dir "$scratch/warren-data" > "$out/warren.log" 2>&1 &
      pid=$!
      wait_port "$wa" "$out/warren.log" && wait_port "$wm" "$out/warren.log"
      if [ -n "${MQTT_ONLY:-}" ]; then
        run warren mqtt-all --mqtt "127.0.0.1:$wm"
      else
        run warren all --uri "amqp://guest:guest@127.0.0.1:$wa" --mqtt "127.0.0.1:$wm"
      fi
      ;;
    rabbitmq)
      echo '[].' > "$scratch/plugins"  # no management listener to clash with another node
      chmod 666 "$scratch/plugins"
      RABBITMQ_NODE_PORT=$rp RABBITMQ_NODENAME=$node RABBITMQ_DIST_PORT=$((rp + 20000)) \
        RABBITMQ_MNESIA_BASE=$scratch/rmq RABBITMQ_LOG_BASE=$scratch/rmq-log \
        RABBITMQ_PID_FILE=$scratch/rmq.pid RABBITMQ_ENABLED_PLUGINS_FILE=$scratch/plugins \
        rabbitmq-server > "$out/rabbitmq.log" 2>&1 &
      rabbit_up=1
      wait_port "$rp" "$out/rabbitmq.log"
      pid=$(cat "$scratch/rmq.pid")
      run rabbitmq all --uri "amqp://guest:guest@127.0.0.1:$rp"
      ;;
    mosquitto)
      printf 'listener %s 127.0.0.1\nallow_anonymous true\nmax_inflight_messages 1000\nmax_queued_messages 100000\n' \
        "$mp" > "$scratch/mosquitto.conf"
      mosquitto -c "$scratch/mosquitto.conf" > "$out/mosquitto.log" 2>&1 &
      pid=$!
      wait_port "$mp" "$out/mosquitto.log"
      run mosquitto mqtt-all --mqtt "127.0.0.1:$mp"
      ;;
    rumqttd)
      sed "s/127.0.0.1:1894/127.0.0.1:$qp/" bench/rumqttd.toml > "$scratch/rumqttd.toml"
      rumqttd -q -c "$scratch/rumqttd.toml" > "$out/rumqttd.log" 2>&1 &
      pid=$!
      wait_port "$qp" "$out/rumqttd.log"
      run rumqttd mqtt-all --mqtt "127.0.0.1:$qp"
      ;;
    *) echo "unknown broker $b"; exit 2 ;;
  esac
  stop
done

python3 - "$out" $brokers <<'PY'
import json, os, sys
out, brokers = sys.argv[1], sys.argv[2:]
res = {b: {r["workload"]: r for r in json.load(open(os.path.join(out, b + ".json")))}
       for b in brokers}
bad = []
for b, rows in res.items():
    for name, r in rows.items():
        moved = r["sent"] if name == "two-publishers" else r["received"]
        if r["errors"] or not moved:
            bad.append("%s %s: %s" % (b, name, r["errors"] or "no messages moved"))
def rate(r):
    return r["sent_per_sec"] if r["workload"] == "two-publishers" else r["received_per_sec"]
def ms(r):
    v = r["latency_us"]["p50"]
    return "-" if v is None else "%.2f" % (v / 1000)
w = res.get("warren", {})
other_names = [b for b in brokers if b != "warren"]
print("\nreceived msg/s (two-publishers: sent), p50 latency ms")
print("%-28s %12s %12s %12s %8s  %s" % ("workload", "warren", "rabbitmq", "mosquitto", "ratio",
                                         "p50 warren/other"))
names = list(w) or [n for b in other_names for n in res[b]]
for name in names:
    cells, ratio, lat = [], "", ""
    a = w.get(name)
    other = None
    for b in ("rabbitmq", "mosquitto"):
        r = res.get(b, {}).get(name)
        cells.append("%12.0f" % rate(r) if r else "%12s" % "-")
        other = other or r
    if a and other:
        ratio = "%7.2fx" % (rate(a) / rate(other)) if rate(other) else "    inf"
        lat = ms(a) + " / " + ms(other)
    print("%-28s %12s %s %8s  %s" % (name, "%.0f" % rate(a) if a else "-", " ".join(cells),
                                     ratio, lat))
mqtt_brokers = [b for b in ("warren", "mosquitto", "rumqttd") if b in res]
mqtt_names = [n for n in dict.fromkeys(n for b in mqtt_brokers for n in res[b])
              if n.startswith("mqtt")]
def cpu_us(r):
    # The broker's utime+stime over the run (the bench samples /proc/PID/stat at its start
    # and end) per delivered message.
    if r.get("broker_cpu_pct") is None or not r["received"]:
        return "-"
    return "%.2f" % (r["broker_cpu_pct"] / 100 * r["seconds"] * 1e6 / r["received"])
def rss(r):
    v = r.get("broker_rss_bytes")
    return "-" if v is None else "%.0f" % (v / 1048576)
if mqtt_names and len(mqtt_brokers) > 1:
    print("\nMQTT: received msg/s | broker RSS peak MB | broker CPU us per delivered message")
    print("%-16s" % "workload" + "".join(" %30s" % b for b in mqtt_brokers)
          + "".join("  warren/%s" % b for b in mqtt_brokers[1:]))
    for name in mqtt_names:
        cells, rates = [], {}
        for b in mqtt_brokers:
            r = res[b].get(name)
            if r:
                rates[b] = r["received_per_sec"]
                cells.append(" %30s" % ("%.0f | %s | %s" % (r["received_per_sec"], rss(r), cpu_us(r))))
            else:
                cells.append(" %30s" % "-")
        ratios = ["  %9s" % ("%.2fx" % (rates["warren"] / rates[b])
                            if "warren" in rates and rates.get(b) else "-")
                  for b in mqtt_brokers[1:]]
        print("%-16s" % name + "".join(cells) + "".join(ratios))
if bad:
    print("\nFAILED:")
    for b in bad:
        print("  " + b)
    sys.exit(1)
PY
