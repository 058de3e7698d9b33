#!/usr/bin/env bash
# Seed 003's stream table on this machine, in one run: fill streams of MESSAGES messages at each
# message size and chunk size (bench/java/StreamFill.java: RabbitMQ's Java stream client,
# publish with confirms, the producer's batch being the chunk), then consume each from `first`:
#   - bench/java/StreamConsume.java: Stream PerfTest's consumer settings (offset first,
#     --initial-credits 50, no tracking, no latency) on RabbitMQ's Java stream client (Stream
#     PerfTest itself is not on Maven Central; the client is, see scripts/test.sh for its jars),
#   - warren-bench stream consume (the Rust rabbitmq-stream-client 0.11, credit 1 per chunk;
#     Warren only: it cannot talk to RabbitMQ 3.10, which lacks ExchangeCommandVersions),
# against Warren with read-ahead off and on (two starts on the same data dir), and with
# RABBITMQ=1 against Debian's RabbitMQ (rabbitmq_stream enabled) under a private node name,
# state directory and ports. SENDFILE=1 adds the sendfile on/off measurement on the largest
# cell (broker CPU with perf stat, system calls with strace -c).
#
# Usage: bench/stream-compare.sh [MESSAGES] [SIZES] [CHUNKS]
#   defaults: 300000 12,48,256,512,1024 1,2,4,8,16,64,128,384
# Env: RABBITMQ=1, EXACT=1 (RabbitMQ filled one batch at a time), SENDFILE=1, PERFTEST=1 (also
#   consume each stream over AMQP 0.9.1 with PerfTest as seed 003: --producers 0 --consumers 1
#   --predeclared --qos 200 --stream-consumer-offset first; jars in PERFTEST_LIB, default
#   target/perftest/lib; Warren's AMQP port PORT_BASE+72), JAVA_LIB (default target/stream-java/lib), SKIP_BUILD=1,
#   PORT_BASE (default 22500: Warren's stream port; RabbitMQ uses PORT_BASE+52 for streams,
#   +172 AMQP, +173 distribution, +369 epmd).
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-300000}
sizes=${2:-12,48,256,512,1024}
chunks=${3:-1,2,4,8,16,64,128,384}
base=${PORT_BASE:-22500}
[ "${SKIP_BUILD:-0}" = 1 ] || cargo build --release -p warren-cli -p warren-bench >/dev/null
warren=target/release/warren
bench=target/release/warren-bench
lib=${JAVA_LIB:-target/stream-java/lib}
export RUST_LOG=${RUST_LOG:-error}  # the client warns at every close
data=$(mktemp -d /tmp/warren-stream-bench.XXXXXX)
pid=
stop() { [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; pid=; }
rmq=
stop_rmq() {
  [ -n "$rmq" ] || return 0
  /usr/lib/rabbitmq/bin/rabbitmqctl -n "$RABBITMQ_NODENAME" stop >/dev/null 2>&1 || true
  # The node started its own epmd on ERL_EPMD_PORT: it outlives the node.
  "$(ls /usr/lib/erlang/erts-*/bin/epmd | head -1)" -kill >/dev/null 2>&1 || true
  rm -rf "$rmq"; rmq=
}
trap 'stop; stop_rmq; rm -rf "$data" "$data.log"' EXIT
start() {  # start READ_AHEAD [extra serve flags]
  : > "$data.log"
  local ra=$1; shift
  local amqp=none
  [ "${PERFTEST:-0}" = 1 ] && amqp=127.0.0.1:$((base + 72))
  RUST_LOG=info "$warren" serve --amqp "$amqp" --mqtt none --management none --prometheus none \
    --stream "127.0.0.1:$base" --stream-read-ahead "$ra" --data-dir "$data" "$@" >> "$data.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 100); do
    grep -q 'listening on .* (stream)' "$data.log" && return 0
    sleep 0.1
  done
  echo "warren did not start: $(cat "$data.log")" >&2; return 1
}
IFS=, read -ra size_list <<< "$sizes"
IFS=, read -ra chunk_list <<< "$chunks"
names=()
for s in "${size_list[@]}"; do for c in "${chunk_list[@]}"; do names+=("bench-$s-$c"); done; done
[ -d "$lib" ] || { echo "$lib missing: mvn -f gateway-stream/tests/java/pom.xml dependency:copy-dependencies -DoutputDirectory=$PWD/$lib" >&2; exit 1; }
java=(java -Dorg.slf4j.simpleLogger.defaultLogLevel=warn -cp "$lib/*")
java_fill() {  # PORT LABEL
  "${java[@]}" bench/java/StreamFill.java 127.0.0.1 "$1" "$n" "$2" "$sizes" "$chunks" ${3:-}
}
java_consume() {  # PORT LABEL
  "${java[@]}" bench/java/StreamConsume.java 127.0.0.1 "$1" "$n" "$2" "${names[@]}"
}
common=(--messages "$n" --sizes "$sizes" --chunks "$chunks")
perftest() {  # AMQP_PORT LABEL
  [ "${PERFTEST:-0}" = 1 ] || return 0
  for q in "${names[@]}"; do
    rate=$(java -cp "${PERFTEST_LIB:-target/perftest/lib}/*" com.rabbitmq.perf.PerfTest \
      --uri "amqp://guest:guest@127.0.0.1:$1" --producers 0 --consumers 1 --predeclared \
      --qos 200 --stream-consumer-offset first --cmessages "$n" --queue "$q" 2>&1 \
      | grep -o 'receiving rate avg: [0-9]*' | grep -o '[0-9]*$')
    echo "perftest $q ${rate:-?} msg/s $2"
  done
}
echo "# $(date -u +%FT%TZ) $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $n messages per cell"
start 0
java_fill "$base" "warren"
"$bench" stream consume --port "$base" "${common[@]}" --label "warren read-ahead off"
java_consume "$base" "warren read-ahead off"
perftest $((base + 72)) "warren read-ahead off"
stop
start 4096
"$bench" stream consume --port "$base" "${common[@]}" --label "warren read-ahead 4096"
java_consume "$base" "warren read-ahead 4096"
perftest $((base + 72)) "warren read-ahead 4096"
stop
if [ "${SENDFILE:-0}" = 1 ]; then
  # The largest cell, read-ahead on, sendfile on then off: broker CPU (perf stat) and its
  # system calls (strace -c, a separate run: tracing slows everything).
  big="--sizes ${size_list[-1]} --chunks ${chunk_list[-1]} --messages $n"
  for sf in true false; do
    start 4096 "--stream-sendfile=$sf"
    perf stat -e task-clock -p "$pid" -o "$data.perf" &
    perfpid=$!
    # shellcheck disable=SC2086
    "$bench" stream consume --port "$base" $big --label "sendfile=$sf"
    kill -INT "$perfpid"; wait "$perfpid" 2>/dev/null || true
    echo "sendfile=$sf broker $(grep -E 'task-clock' "$data.perf" | awk '{print $1, $2}')"
    strace -c -f -p "$pid" -o "$data.strace" 2>/dev/null &
    spid=$!
    sleep 0.5
    # shellcheck disable=SC2086
    "$bench" stream consume --port "$base" $big --label "sendfile=$sf (under strace)" >/dev/null
    kill -INT "$spid"; wait "$spid" 2>/dev/null || true
    echo "sendfile=$sf syscalls: $(awk '$NF ~ /^(sendfile|write|writev|pread64|sendto)$/ {printf "%s %s; ", $NF, $4}' "$data.strace")all $(awk '$NF == "total" {print $4}' "$data.strace")"
    stop
  done
fi
if [ "${RABBITMQ:-0}" = 1 ]; then
  # Debian's RabbitMQ, run directly (not through the service wrapper that switches user), with
  # its own cookie, state, node name, epmd and ports.
  rmq=$(mktemp -d /tmp/rmq-stream-bench.XXXXXX)
  export HOME=$rmq RABBITMQ_MNESIA_BASE=$rmq/mnesia RABBITMQ_LOG_BASE=$rmq/log \
    RABBITMQ_NODE_PORT=$((base + 172)) RABBITMQ_DIST_PORT=$((base + 173)) \
    RABBITMQ_NODENAME=streambench$$@localhost \
    RABBITMQ_ENABLED_PLUGINS_FILE=$rmq/enabled_plugins RABBITMQ_CONFIG_FILE=$rmq/rabbitmq \
    ERL_EPMD_PORT=$((base + 369))
  rport=$((base + 52))
  printf 'stream.listeners.tcp.1 = 127.0.0.1:%s\nstream.advertised_host = localhost\nstream.advertised_port = %s\nlisteners.tcp.1 = 127.0.0.1:%s\nloopback_users = none\n' \
    "$rport" "$rport" "$RABBITMQ_NODE_PORT" > "$rmq/rabbitmq.conf"
  /usr/lib/rabbitmq/bin/rabbitmq-plugins --offline enable rabbitmq_stream >/dev/null
  /usr/lib/rabbitmq/bin/rabbitmq-server > "$rmq/out.log" 2>&1 &
  for _ in $(seq 1 300); do
    (exec 3<>"/dev/tcp/127.0.0.1/$rport") 2>/dev/null && { sleep 2; break; }
    sleep 0.5
  done
  v="RabbitMQ $(dpkg-query -W -f '${Version}' rabbitmq-server 2>/dev/null)"
  # EXACT=1: one batch in flight, so that RabbitMQ's chunks are the batches (slow: a round
  # trip per chunk); otherwise its writer merges what is queued into larger chunks.
  java_fill "$rport" "$v" "$([ "${EXACT:-0}" = 1 ] && echo exact)"
  # osiris forms chunks from what its writer has queued, not from Publish frames: count the
  # chunks each stream really got from its index files (8-byte header, 29 bytes per chunk).
  for d in "$RABBITMQ_MNESIA_BASE"/*/stream/*/; do
    s=$(basename "$d" | sed 's/^__//; s/_[0-9]*$//')
    bytes=$(cat "$d"*.index | wc -c); files=$(ls "$d"*.index | wc -l)
    echo "rmq-chunks $s $(( (bytes - 8 * files) / 29 ))"
  done
  java_consume "$rport" "$v"
  perftest "$RABBITMQ_NODE_PORT" "$v"
  stop_rmq
fi
