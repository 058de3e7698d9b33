#!/usr/bin/env bash
# one_fast-like throughput (1 producer, 1 consumer, 12-byte transient messages, consumer
# auto-ack, no confirms) through a classic queue, docs/benchmarks.md "Routing between
# nodes": on one Warren node, on one node of a 3-node cluster (producer and consumer both on
# n2, where the queue lives), and across nodes (producer on n1, consumer on n2: every
# message forwarded n1 -> n2 over the cluster transport).
#   bench/xnode-one-fast.sh [SECS=10]
# Two PerfTest processes (producer only, consumer only) on a queue declared first (named,
# durable: cluster metadata, so its home is the node it was declared on). Needs root and
# ip netns (scripts/cluster.sh; bridge WARREN_CLUSTER_BRIDGE, default wbx0, subnet
# WARREN_CLUSTER_NET, default 10.83.0); run it under `flock /tmp/warren-netns.lock` where
# others share the machine. WARREN_BIN (default target/release/warren), PerfTest from
# target/perftest/lib (scripts/perftest.sh fetches it), WARREN_PORT (default 29110) for the
# single node.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
export WARREN_BIN=${WARREN_BIN:-target/release/warren}
export WARREN_CLUSTER_BRIDGE=${WARREN_CLUSTER_BRIDGE:-wbx0}
export WARREN_CLUSTER_NET=${WARREN_CLUSTER_NET:-10.83.0}
lib=${PERFTEST_LIB:-target/perftest/lib}
port=${WARREN_PORT:-29110}
scratch=$(mktemp -d /tmp/warren-xnode-bench.XXXXXX)
export WARREN_CLUSTER_DIR=$scratch/cluster
pid="" cluster_up=""
cleanup() {
  [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
  [ -n "$cluster_up" ] && scripts/cluster.sh down >/dev/null 2>&1 || true
  rm -rf "$scratch"
}
trap cleanup EXIT

perftest() { # uri args... -> the run's log on stdout
  java -cp "$lib/*" com.rabbitmq.perf.PerfTest --uri "$1" "${@:2}" -z "$secs" 2>&1
}
declare_queue() { # http-host:port user
  curl -sf -u "$2" -X PUT -H 'content-type: application/json' \
    -d '{"durable":true,"auto_delete":false,"arguments":{}}' "http://$1/api/queues/%2F/xbench" >/dev/null
}
run() { # label producer-uri consumer-uri
  local c p
  perftest "$3" -x 0 -y 1 -u xbench -p -a --id cons >"$scratch/cons.log" &
  c=$!
  sleep 1
  perftest "$2" -x 1 -y 0 -u xbench -p -s 12 --id prod >"$scratch/prod.log"
  wait "$c"
  printf '%-46s sent %s  received %s\n' "$1" \
    "$(grep -o 'sending rate avg: [0-9]* msg/s' "$scratch/prod.log" | grep -o '[0-9]*')" \
    "$(grep -o 'receiving rate avg: [0-9]* msg/s' "$scratch/cons.log" | grep -o '[0-9]*')"
}

# One node.
"$WARREN_BIN" serve --data-dir "$scratch/single" --amqp "127.0.0.1:$port" --management "127.0.0.1:$((port + 1))" \
  --mqtt "127.0.0.1:$((port + 2))" --prometheus none >"$scratch/single.log" 2>&1 &
pid=$!
for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
declare_queue "127.0.0.1:$((port + 1))" guest:guest
run "one node" "amqp://guest:guest@127.0.0.1:$port" "amqp://guest:guest@127.0.0.1:$port"
kill -TERM "$pid"; wait "$pid" 2>/dev/null || true; pid=""

# Three nodes.
nodes=$(scripts/cluster.sh up 3)
cluster_up=1
amqp() { echo "$nodes" | awk -v n="$1" '$1 == n { sub("amqp=", "", $2); print $2 }'; }
http() { echo "$nodes" | awk -v n="$1" '$1 == n { sub("http=", "", $4); print $4 }'; }
declare_queue "$(http n2)" warren:warren
run "3 nodes, producer and consumer on n2 (home)" "amqp://warren:warren@$(amqp n2)" "amqp://warren:warren@$(amqp n2)"
run "3 nodes, producer on n1, consumer on n2" "amqp://warren:warren@$(amqp n1)" "amqp://warren:warren@$(amqp n2)"
