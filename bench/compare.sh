#!/usr/bin/env bash
# Runs `warren bench all` against Warren and then RabbitMQ on this machine and prints both
# received rates, latencies and the ratio per workload.
#   bench/compare.sh [SECONDS] [-- extra warren bench flags]
# Expects both brokers running (the numbers in docs/benchmarks.md used):
#   target/release/warren serve --amqp 127.0.0.1:5682 --mqtt none --data-dir /tmp/wb-data
#   RABBITMQ_NODE_PORT=5683 RABBITMQ_NODENAME=rabbit-bench@localhost RABBITMQ_DIST_PORT=25683 \
#     RABBITMQ_MNESIA_BASE=/tmp/rmq-bench RABBITMQ_LOG_BASE=/tmp/rmq-bench-log rabbitmq-server
# Env: WARREN_URI, RABBIT_URI (defaults: ports 5682 and 5683), WARREN_PID and RABBIT_PID
# (optional: broker RSS and CPU), BENCH (default target/release/warren).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}; shift || true
[ "${1:-}" = "--" ] && shift
extra=("$@")
bench=${BENCH:-target/release/warren}
mkdir -p target/bench
run() { # name uri pid
  local pid=()
  [ -n "$3" ] && pid=(--broker-pid "$3")
  "$bench" bench all --seconds "$secs" --uri "$2" "${pid[@]}" "${extra[@]}" --format json \
    > "target/bench/$1.json"
}
run warren "${WARREN_URI:-amqp://guest:guest@127.0.0.1:5682}" "${WARREN_PID:-}"
run rabbitmq "${RABBIT_URI:-amqp://guest:guest@127.0.0.1:5683}" "${RABBIT_PID:-}"
python3 - target/bench/warren.json target/bench/rabbitmq.json <<'PY'
import json, sys
w = {r["workload"]: r for r in json.load(open(sys.argv[1]))}
r = {x["workload"]: x for x in json.load(open(sys.argv[2]))}
def rate(x):
    return x["received_per_sec"] if x["received"] else x["sent_per_sec"]
def p50(x):
    v = x["latency_us"]["p50"]
    return "-" if v is None else "%.2f" % (v / 1000)
print("%-26s %14s %14s %7s %12s" % ("workload", "warren msg/s", "rabbitmq msg/s", "ratio",
                                     "p50 ms w/r"))
for name, a in w.items():
    b = r.get(name)
    if b is None:
        continue
    ratio = rate(a) / rate(b) if rate(b) else float("nan")
    print("%-26s %14.0f %14.0f %6.2fx %12s" % (name, rate(a), rate(b), ratio,
                                                 p50(a) + " / " + p50(b)))
    for e in a["errors"] + b["errors"]:
        print("  error:", e)
PY
