#!/usr/bin/env bash
# RabbitMQ's 14-workload performance suite (../shared/brief.md), run with RabbitMQ PerfTest
# against one broker. Every workload is bounded in time; the script fails if PerfTest reports
# an error or a workload moved no messages, and prints a table of rates.
#
#   bench/suite.sh [SECONDS] [URI]
#
# Environment:
#   SIZE   message size in bytes (default 1000; the brief uses 12, 100, 1000 and 5000)
#   SCALE  multiplies the big counts (7000 producers, 1000 queues) and the 150 s consumer
#          start delay; 1 is the suite as RabbitMQ runs it, CI uses 0.1 (default 1)
#   CTL    a command that sets a policy as `warren ctl set-policy` does, used by
#          publish_only_ttl (e.g. "target/release/warren ctl --data-dir ./warren-data");
#          unset: that workload sets the dead-letter exchange with a queue argument instead
#   ONLY   a space-separated list of workload names to run (default: all)
# Logs: target/perftest/suite/<workload>.log.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-30}
uri=${2:-amqp://guest:guest@127.0.0.1:5672}
size=${SIZE:-1000}
scale=${SCALE:-1}
lib=target/perftest/lib
logs=target/perftest/suite
if ! ls "$lib"/perf-test-*.jar >/dev/null 2>&1; then
  echo "fetching RabbitMQ PerfTest from Maven Central..."
  mvn -q -B -Dstyle.color=never -f scripts/perftest/pom.xml dependency:copy-dependencies \
    -DoutputDirectory="$PWD/$lib"
fi
rm -rf "$logs" && mkdir -p "$logs"

scaled() { awk -v n="$1" -v s="$scale" 'BEGIN { v = int(n * s); print (v < 1 ? 1 : v) }'; }
producers_7000=$(scaled 7000)
queues_1000=$(scaled 1000)
# Consumers join at most halfway through the run, so they have time to catch up.
delay=$(awk -v s="$scale" -v t="$secs" 'BEGIN { d = int(150 * s); h = int(t / 2); print (d > h ? h : d) }')
common=(-s "$size" -f persistent -ad false -z "$secs")

failed=0
rows=()
# run NAME EXPECT_SENT EXPECT_RECEIVED PerfTest-flags...
run() {
  local name=$1 want_sent=$2 want_received=$3
  shift 3
  if [ -n "${ONLY:-}" ] && ! grep -qw "$name" <<<"$ONLY"; then
    return 0
  fi
  local log="$logs/$name.log"
  printf '%-32s ' "$name"
  # The JVM gets the run time plus time to start and to close thousands of connections.
  timeout $((secs + 120)) java -Xss512k -cp "$lib/*" com.rabbitmq.perf.PerfTest --uri "$uri" \
    --id "$name" "${common[@]}" "$@" >"$log" 2>&1 || true
  local sent received problem=""
  sent=$(sed -n 's/.*sending rate avg: \([0-9]*\) msg\/s.*/\1/p' "$log" | tail -1)
  received=$(sed -n 's/.*receiving rate avg: \([0-9]*\) msg\/s.*/\1/p' "$log" | tail -1)
  if grep -qE "ERROR|[Ee]xception|Error in producer|Error while" "$log"; then
    problem="PerfTest reported errors"
  elif ! grep -q "test stopped" "$log"; then
    problem="PerfTest did not finish"
  elif [ "$want_sent" = 1 ] && [ "${sent:-0}" = 0 ]; then
    problem="nothing sent"
  elif [ "$want_received" = 1 ] && [ "${received:-0}" = 0 ]; then
    problem="nothing received"
  fi
  if [ -n "$problem" ]; then
    failed=$((failed + 1))
    echo "FAILED: $problem (log: $log)"
    grep -E "ERROR|[Ee]xception" "$log" | head -5 || true
  else
    echo "ok"
  fi
  rows+=("$(printf '%-32s %12s %12s  %s' "$name" "${sent:-0}" "${received:-0}" "${problem:-ok}")")
}

echo "PerfTest suite: ${secs}s per workload, ${size}-byte persistent messages, scale $scale, $uri"
run one_fast 1 1 -x 1 -y 1 -c 3000 -u suite-one-fast -qa x-max-length=5000000
run two_publishers_no_consumers 1 0 -x 2 -y 0 -c 700 -u suite-backlog
run one_consumer_no_publishers 0 1 -x 0 -y 1 -q 300 -u suite-backlog
run fivers 1 1 -x 5 -y 5 -r 10000 -c 500 -qp 'suite-fivers-%d' -qpf 1 -qpt 5
run fanout10 1 1 -x 1 -y 10 -c 100 -e amq.fanout -t fanout -qp 'suite-fanout-%d' -qpf 1 -qpt 10
run one_one_one 1 1 -x 1 -y 1 -c 1 -u suite-one-one-one
run seven_thousand_slow_one_queue 1 1 -x "$producers_7000" -y 7 -P 1 -c 1 -u suite-slow-one
run thousand_slow_thousand_queues 1 1 -x "$queues_1000" -y "$queues_1000" -P 0.1 -c 1 \
  -qp 'suite-slow-%d' -qpf 1 -qpt "$queues_1000"
run consumers_join_late 1 1 -x 1 -c 100 -y 10 -q 300 -r 10000 -csd "$delay" -u suite-join-late
run consumers_join_late_sac 1 1 -x 1 -c 100 -y 50 -q 300 -r 10000 -csd "$delay" \
  -u suite-join-late-sac -qa x-single-active-consumer=true
run one_fast_multiack 1 1 -x 1 -y 1 -c 3000 -A 1000 -u suite-one-fast-multiack \
  -qa x-max-length=5000000
# Dead letters go to amq.headers, which nothing binds: they are routed and dropped. (Not
# amq.fanout: fanout10's queues stay bound to it and would collect every dead letter.)
# Messages expire after 10 s on a queue nobody consumes, dead-lettered by a policy.
if [ -n "${CTL:-}" ]; then
  $CTL set-policy suite-ttl '^suite-ttl$' '{"dead-letter-exchange": "amq.headers"}' \
    --apply-to queues >/dev/null
  run publish_only_ttl 1 0 -x 1 -y 0 -c 100 -u suite-ttl -mp expiration=10000
else
  run publish_only_ttl 1 0 -x 1 -y 0 -c 100 -u suite-ttl -mp expiration=10000 \
    -qa x-dead-letter-exchange=amq.headers
fi
run publish_to_nack 1 1 -x 1 -y 1 -c 100 -na -re false -u suite-nack \
  -qa x-dead-letter-exchange=amq.headers
# A backlog first, then a consumer that nacks it into the dead-letter exchange.
secs_backlog=$((secs / 2 > 1 ? secs / 2 : 1))
if [ -z "${ONLY:-}" ] || grep -qw nack_published <<<"$ONLY"; then
  timeout $((secs + 60)) java -cp "$lib/*" com.rabbitmq.perf.PerfTest --uri "$uri" \
    --id nack-backlog -s "$size" -f persistent -ad false -z "$secs_backlog" -x 1 -y 0 -c 100 \
    -u suite-nack-backlog -qa x-dead-letter-exchange=amq.headers >"$logs/nack-backlog.log" 2>&1 ||
    true
fi
run nack_published 0 1 -x 0 -y 1 -na -re false -u suite-nack-backlog \
  -qa x-dead-letter-exchange=amq.headers

echo
printf '%-32s %12s %12s  %s\n' workload "sent msg/s" "recv msg/s" result
printf '%s\n' "${rows[@]}"
if [ "$failed" -gt 0 ]; then
  echo "suite: $failed workload(s) failed"
  exit 1
fi
echo "suite: all workloads completed without errors"
