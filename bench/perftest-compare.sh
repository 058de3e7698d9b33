#!/usr/bin/env bash
# Runs the same RabbitMQ PerfTest workload against Warren and RabbitMQ, one after the other on
# this machine, and prints both averages and the ratio.
#   bench/perftest-compare.sh [SECONDS] [-- extra PerfTest flags]
# Expects Warren on 127.0.0.1:5672 and RabbitMQ on 127.0.0.1:5673 (RABBITMQ_NODE_PORT=5673
# rabbitmq-server); PerfTest jars from scripts/perftest.sh (target/perftest/lib).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-15}; shift || true
[ "${1:-}" = "--" ] && shift
extra=("$@")
[ ${#extra[@]} -eq 0 ] && extra=(-x 1 -y 1 -s 12)
run() { # name uri
  java -cp 'target/perftest/lib/*' com.rabbitmq.perf.PerfTest --uri "$2" -z "$secs" "${extra[@]}" 2>&1 \
    | tee "target/perftest/$1.log" | grep -E "sending rate avg|receiving rate avg|consumer latency min" || true
}
mkdir -p target/perftest
echo "workload: PerfTest ${extra[*]} for ${secs}s"
w=$(run warren amqp://guest:guest@127.0.0.1:5672)
r=$(run rabbitmq amqp://guest:guest@127.0.0.1:5673)
rate() { echo "$1" | grep "$2 rate avg" | grep -o "[0-9]* msg/s" | grep -o "[0-9]*"; }
printf '%-10s %14s %14s\n' broker "sent msg/s" "received msg/s"
printf '%-10s %14s %14s\n' warren "$(rate "$w" sending)" "$(rate "$w" receiving)"
printf '%-10s %14s %14s\n' rabbitmq "$(rate "$r" sending)" "$(rate "$r" receiving)"
ws=$(rate "$w" receiving); rs=$(rate "$r" receiving)
[ -n "$ws" ] && [ -n "$rs" ] && [ "$rs" -gt 0 ] && awk -v a="$ws" -v b="$rs" 'BEGIN{printf "received ratio warren/rabbitmq: %.2fx\n", a/b}'
echo "$w" | grep "consumer latency" | sed 's/^/warren   /'
echo "$r" | grep "consumer latency" | sed 's/^/rabbitmq /'
