#!/usr/bin/env bash
# Quorum queues and the cost of clustering, in one run on this machine (docs/benchmarks.md,
# "Clusters and quorum queues"):
#  1. RabbitMQ PerfTest, 1 producer, 1 consumer, 1 KB messages, publisher confirms (100
#     outstanding), consumer acks, prefetch 200, `--quorum-queue`: RabbitMQ 3.10 on one node
#     against Warren on one node, then against the leader of the queue's group in a 3-node
#     Warren cluster (replicated: a confirm after a majority of the 3 has it on disk). Broker CPU
#     per message from /proc/PID/stat (utime + stime over the run, every node of a cluster
#     summed) divided by the messages received.
#  2. one_fast (PerfTest -x 1 -y 1 -s 12 -a, its own transient queue) on one Warren node
#     against n1 of the 3-node cluster.
#   bench/cluster-compare.sh [SECS=10]
# The single nodes listen on loopback (WARREN_PORT 29271, RABBIT_PORT 29272); the cluster
# is scripts/cluster.sh's (needs root and ip netns; bridge WARREN_CLUSTER_BRIDGE, default
# wbj0, subnet WARREN_CLUSTER_NET, default 10.85.0): its clients cross a veth pair and a
# bridge instead of loopback. SKIP_CLUSTER=1 leaves the cluster out. Where several people
# share the machine's namespaces, run it under `flock /tmp/warren-netns.lock`.
# WARREN_BIN (default target/release/warren), PerfTest jars from scripts/perftest.sh
# (target/perftest/lib, or PERFTEST_LIB). Output: a table, logs in OUT
# (target/bench/cluster-compare).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
warren=${WARREN_BIN:-target/release/warren}
lib=${PERFTEST_LIB:-target/perftest/lib}
wp=${WARREN_PORT:-29271}
rp=${RABBIT_PORT:-29272}
out=${OUT:-target/bench/cluster-compare}
export WARREN_BIN=$warren
export WARREN_CLUSTER_BRIDGE=${WARREN_CLUSTER_BRIDGE:-wbj0}
export WARREN_CLUSTER_NET=${WARREN_CLUSTER_NET:-10.85.0}
[ -x "$warren" ] || { echo "$warren not found: cargo build --release -p warren-cli"; exit 2; }
ls "$lib"/perf-test-*.jar >/dev/null 2>&1 || { echo "no PerfTest in $lib: scripts/perftest.sh fetches it"; exit 2; }
rm -rf "$out" && mkdir -p "$out"
scratch=$(mktemp -d /tmp/warren-cluster-compare.XXXXXX)
chmod 777 "$scratch" # RabbitMQ's start script drops to the rabbitmq user
export WARREN_CLUSTER_DIR=$scratch/cluster
node="rabbit-cc-$rp@localhost"
wpid="" rabbit_up="" cluster_up=""
cleanup() {
  [ -n "$rabbit_up" ] && { rabbitmqctl -n "$node" stop >/dev/null 2>&1 || true; }
  if [ -n "$wpid" ] && kill -0 "$wpid" 2>/dev/null; then
    kill -TERM "$wpid"; timeout 20 tail --pid="$wpid" -f /dev/null || kill -KILL "$wpid"
  fi
  [ -n "$cluster_up" ] && scripts/cluster.sh down >/dev/null 2>&1
  rm -rf "$scratch"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_port() { # host port log
  local t=$((SECONDS + 60))
  until (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; do
    [ "$SECONDS" -lt "$t" ] || { echo "nothing on $1:$2 after 60 s:"; tail -20 "$3"; return 1; }
    sleep 0.2
  done
}

ticks() { # pids...: utime + stime, clock ticks, summed
  local p s=0
  for p in "$@"; do s=$((s + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done
  echo "$s"
}

hz=$(getconf CLK_TCK)
results=$out/results.txt
: >"$results"

run() { # label uri "pids" perftest-args...
  local label=$1 uri=$2 pids=$3; shift 3
  local log=$out/${label// /_}.log t0 t1
  # shellcheck disable=SC2086
  t0=$(ticks $pids)
  java -cp "$lib/*" com.rabbitmq.perf.PerfTest --uri "$uri" -z "$secs" "$@" >"$log" 2>&1 || true
  # shellcheck disable=SC2086
  t1=$(ticks $pids)
  local sent recv lat
  sent=$(sed -n 's/.*sending rate avg: \([0-9]*\) msg\/s.*/\1/p' "$log" | tail -1)
  recv=$(sed -n 's/.*receiving rate avg: \([0-9]*\) msg\/s.*/\1/p' "$log" | tail -1)
  lat=$(sed -n 's/.*consumer latency min\/median\/75th\/95th\/99th \(.*\) µs.*/\1/p' "$log" | tail -1)
  awk -v l="$label" -v s="${sent:-0}" -v r="${recv:-0}" -v dt=$((t1 - t0)) -v hz="$hz" \
    -v secs="$secs" -v lat="${lat:--}" 'BEGIN {
      msgs = r * secs
      cpu = msgs > 0 ? dt / hz * 1e6 / msgs : 0
      printf "%-44s %10d %10d %10.1f %8.2f  %s\n", l, s, r, cpu, dt / hz / secs, lat }' |
    tee -a "$results"
}

qq=(-x 1 -y 1 -s 1000 -c 100 -q 200 --quorum-queue --queue cc-qq)
one_fast=(-x 1 -y 1 -s 12 -a)
printf '%-44s %10s %10s %10s %8s  %s\n' run "sent/s" "recv/s" "cpu us/msg" "cores" \
  "latency min/median/75th/95th/99th us" | tee -a "$results"

# RabbitMQ 3.10 on one node.
echo '[].' >"$scratch/plugins"
chmod 666 "$scratch/plugins"
RABBITMQ_NODE_PORT=$rp RABBITMQ_NODENAME=$node RABBITMQ_DIST_PORT=$((rp + 1)) \
  RABBITMQ_MNESIA_BASE=$scratch/rmq RABBITMQ_LOG_BASE=$scratch/rmq-log \
  RABBITMQ_PID_FILE=$scratch/rmq.pid RABBITMQ_ENABLED_PLUGINS_FILE=$scratch/plugins \
  rabbitmq-server >"$out/rabbitmq.log" 2>&1 &
rabbit_up=1
wait_port 127.0.0.1 "$rp" "$out/rabbitmq.log"
run "rabbitmq 3.10, 1 node, quorum queue" "amqp://guest:guest@127.0.0.1:$rp" "$(cat "$scratch/rmq.pid")" "${qq[@]}"
rabbitmqctl -n "$node" stop >/dev/null 2>&1 || true
rabbit_up=""

# Warren on one node (no cluster flags).
"$warren" serve --amqp "127.0.0.1:$wp" --mqtt none --management none --prometheus none --stream none \
  --data-dir "$scratch/warren-data" >"$out/warren.log" 2>&1 &
wpid=$!
wait_port 127.0.0.1 "$wp" "$out/warren.log"
run "warren, 1 node, quorum queue" "amqp://guest:guest@127.0.0.1:$wp" "$wpid" "${qq[@]}"
run "warren, 1 node, one_fast" "amqp://guest:guest@127.0.0.1:$wp" "$wpid" "${one_fast[@]}"
kill -TERM "$wpid"; timeout 20 tail --pid="$wpid" -f /dev/null || kill -KILL "$wpid"
wpid=""

if [ -z "${SKIP_CLUSTER:-}" ]; then
  cluster_up=1
  up=$(scripts/cluster.sh up 3)
  n1=$(awk '$1 == "n1" { sub("amqp=", "", $2); print $2 }' <<<"$up")
  n1http=$(awk '$1 == "n1" { sub("http=", "", $4); print $4 }' <<<"$up")
  pids=$(cat "$WARREN_CLUSTER_DIR"/n*/pid | tr '\n' ' ')
  # The quorum queue is replicated over the 3 nodes and served by its group's leader
  # (consumers on other nodes get nothing yet): declared on n1 (its declare-ok comes once
  # the group has a leader), then PerfTest runs against the node that leads it.
  curl -sf -u warren:warren -X PUT -H 'content-type: application/json' \
    -d '{"durable":true,"arguments":{"x-queue-type":"quorum"}}' "http://$n1http/api/queues/%2f/cc-qq"
  leader=$(curl -sf -u warren:warren "http://$n1http/api/queues/%2f/cc-qq" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["leader"])')
  lead=$(awk -v n="n$leader" '$1 == n { sub("amqp=", "", $2); print $2 }' <<<"$up")
  run "warren, 3 nodes (leader n$leader), replicated quorum queue" "amqp://warren:warren@$lead" "$pids" "${qq[@]}"
  run "warren, 3-node cluster (n1), one_fast" "amqp://warren:warren@$n1" "$pids" "${one_fast[@]}"
fi
echo "results in $results; PerfTest logs in $out"
