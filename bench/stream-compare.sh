#!/usr/bin/env bash
# Seed 003's stream table on this machine, in one run: fill streams of MESSAGES messages at each
# message size and chunk size (bench/java/StreamFill.java: RabbitMQ's Java stream client,
# publish with confirms, the producer's batch being the chunk), then consume each from `first`:
#   - bench/java/StreamConsume.java: Stream PerfTest's consumer settings (offset first,
#     --initial-credits 50, no tracking, no latency) on RabbitMQ's Java stream client (Stream
#     PerfTest itself is not on Maven Central; the client is, see scripts/test.sh for its jars),
#   - warren-bench stream consume (the Rust rabbitmq-stream-client 0.11, credit 1 per chunk;
#     Warren only: it cannot talk to RabbitMQ 3.10, which lacks ExchangeCommandVersions),
#   - with PERFTEST=1, PerfTest over AMQP 0.9.1 as seed 003 runs it,
# against Warren with read-ahead off and on (two starts on the same data dir), and with
# RABBITMQ=1 against Debian's RabbitMQ (rabbitmq_stream enabled) under a private node name,
# state directory and ports. Every fill and consume by the Java tools and PerfTest also prints
# the broker's CPU time per message (`cpu ... us/msg broker`, bench/java/BrokerCpu.java): on a
# small machine the clients bound the rates, the broker's cost is what read-ahead changes.
# SENDFILE=1 adds the sendfile on/off measurement on the largest cell (broker CPU with perf
# stat, system calls with strace -c).
#
# Usage: bench/stream-compare.sh [--log FILE] [--svg DIR] [MESSAGES] [SIZES] [CHUNKS]
#   defaults: 300000 12,48,256,512,1024 1,2,4,8,16,64,128,384
#   --log FILE: also write the output there (bench/stream-table.py reads it); --svg DIR: at the
#   end, the tables of this run (bench/stream-table.py) and seed 003's plots as SVG in DIR.
# Env: RABBITMQ=1, SKIP_WARREN=1 (RabbitMQ only), RAW=1 (also consume each stream with `warren-bench stream raw-consume`, a
#   raw-frame consumer that counts records from chunk headers and parses nothing else, on
#   every broker, RabbitMQ 3.10 included: rate and the broker's CPU per message with a client
#   too lean to bound it), EXACT=1 (both brokers' streams filled again one batch at a time before they
#   are consumed, so that their chunks are the batches: both merge what is queued), SENDFILE=1, PERFTEST=1 (also
#   consume each stream over AMQP 0.9.1 with PerfTest as seed 003: --producers 0 --consumers 1
#   --predeclared --qos 200 --stream-consumer-offset first; jars in PERFTEST_LIB, default
#   target/perftest/lib), JAVA_LIB (default target/stream-java/lib), SKIP_BUILD=1, WARREN and
#   BENCH (the binaries; default target/release/warren and warren-bench),
#   PORT_BASE (default 22500): Warren's stream port; Warren's AMQP PORT_BASE+1; RabbitMQ's
#   stream +2, AMQP +3, distribution +4, epmd +5.
set -euo pipefail
cd "$(dirname "$0")/.."
log= svg=
while [ $# -gt 0 ]; do
  case $1 in
    --log) log=$2; shift 2 ;;
    --svg) svg=$2; shift 2 ;;
    *) break ;;
  esac
done
if [ -n "$svg" ] && [ -z "$log" ]; then log=$(mktemp /tmp/stream-compare.XXXXXX.log); fi
if [ -n "$log" ]; then exec > >(tee "$log") 2>&1; fi
n=${1:-300000}
sizes=${2:-12,48,256,512,1024}
chunks=${3:-1,2,4,8,16,64,128,384}
base=${PORT_BASE:-22500}
[ "${SKIP_BUILD:-0}" = 1 ] || cargo build --release -p warren-cli -p warren-bench >/dev/null
warren=${WARREN:-target/release/warren}
bench=${BENCH:-target/release/warren-bench}
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
trap 'stop; stop_rmq; rm -rf "$data" "$data".*' EXIT
start() {  # start READ_AHEAD [extra serve flags]
  : > "$data.log"
  local ra=$1; shift
  local amqp=none
  [ "${PERFTEST:-0}" = 1 ] && amqp=127.0.0.1:$((base + 1))
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
javac -nowarn -cp "$lib/*" -d "$data.classes" bench/java/StreamFill.java \
  bench/java/StreamConsume.java bench/java/BrokerCpu.java
java=(java -Dorg.slf4j.simpleLogger.defaultLogLevel=warn -cp "$lib/*:$data.classes")
bpid=  # the broker being measured
java_fill() {  # PORT LABEL [exact]
  "${java[@]}" -Dbroker.pid="$bpid" StreamFill 127.0.0.1 "$1" "$n" "$2" "$sizes" "$chunks" ${3:-}
}
java_consume() {  # PORT LABEL
  "${java[@]}" -Dbroker.pid="$bpid" StreamConsume 127.0.0.1 "$1" "$n" "$2" "${names[@]}"
}
# A reading of the broker's CPU time, as BrokerCpu.java takes it: "TID NS" per thread
# (schedstat) and "ticks N" (user + system, 10 ms each, for when a thread ended meanwhile).
cpu_read() {
  local f tid ns
  for f in /proc/"$bpid"/task/*/schedstat; do
    tid=${f%/schedstat}; tid=${tid##*/}
    read -r ns _ < "$f" 2>/dev/null && echo "$tid $ns"
  done
  sed 's/.*) //' /proc/"$bpid"/stat | awk '{print "ticks", $12 + $13}'
}
cpu_between() {  # READING_FILE_BEFORE READING_FILE_AFTER: CPU ns
  awk 'NR == FNR {a[$1] = $2; next} {b[$1] = $2}
    END {for (t in a) if (t != "ticks" && !(t in b)) {printf "%.0f", (b["ticks"] - a["ticks"]) * 1e7; exit}
         for (t in b) if (t != "ticks") s += b[t] - a[t]; printf "%.0f", s}' "$1" "$2"
}
common=(--messages "$n" --sizes "$sizes" --chunks "$chunks")
raw_consume() {  # PORT LABEL
  [ "${RAW:-0}" = 1 ] || return 0
  "$bench" stream raw-consume --port "$1" "${common[@]}" --label "$2" --broker-pid "$bpid"
}
perftest() {  # AMQP_PORT LABEL
  [ "${PERFTEST:-0}" = 1 ] || return 0
  # The same reads with warren-bench's client, which costs less CPU than PerfTest's: on a
  # small machine PerfTest, not the broker, bounds the rate.
  "$bench" stream amqp-consume --uri "amqp://guest:guest@127.0.0.1:$1" "${common[@]}" \
    --label "$2" --broker-pid "$bpid"
  for q in "${names[@]}"; do
    cpu_read > "$data.cpu0"
    rate=$(java -cp "${PERFTEST_LIB:-target/perftest/lib}/*" com.rabbitmq.perf.PerfTest \
      --uri "amqp://guest:guest@127.0.0.1:$1" --producers 0 --consumers 1 --predeclared \
      --qos 200 --stream-consumer-offset first --cmessages "$n" --queue "$q" 2>&1 \
      | grep -o 'receiving rate avg: [0-9]*' | grep -o '[0-9]*$')
    cpu_read > "$data.cpu1"
    echo "perftest $q ${rate:-?} msg/s $2"
    awk -v d="$(cpu_between "$data.cpu0" "$data.cpu1")" -v n="$n" -v q="$q" -v l="$2" \
      'BEGIN {printf "cpu     perftest %-20s %8.3f us/msg broker %s\n", q, d / 1000 / n, l}' 
  done
}
echo "# $(date -u +%FT%TZ) $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $n messages per cell"
if [ "${SKIP_WARREN:-0}" != 1 ]; then
start 0
bpid=$pid
# The fill lines' broker CPU is not a publish cost: these streams are kept (the consumers
# read them), so every cell writes into page cache pages this VM faults in afresh, ~2.5 us
# per 1 KB message whichever client publishes (bench/stream-publish.sh, CLIENT=java for this
# client, measures publishing; docs/benchmarks.md, "Method").
# Publish with confirms, 20,000 in flight: since 2026-11-24 Warren's writer merges what is
# queued into one chunk per write, as osiris does, so these streams hold merged chunks. With
# EXACT=1 they are filled again one batch at a time (the batch is the chunk, as in seed 003)
# before they are read; without it the read-ahead grid reads merged chunks on both brokers.
java_fill "$base" "warren"
[ "${EXACT:-0}" = 1 ] && java_fill "$base" "warren (exact fill)" exact
for s in "${names[@]}"; do
  # Chunks each stream got (index: 24-byte header, 32 bytes per chunk; less its snapshot).
  bytes=$(cat "$data/streams/%2F/$s/"*.si | wc -c); files=$(ls "$data/streams/%2F/$s/"*.si | wc -l)
  echo "warren-chunks $s $(( (bytes - 24 * files) / 32 - files ))"
done
"$bench" stream consume --port "$base" "${common[@]}" --label "warren read-ahead off"
java_consume "$base" "warren read-ahead off"
raw_consume "$base" "warren read-ahead off"
perftest $((base + 1)) "warren read-ahead off"
stop
start 4096
bpid=$pid
"$bench" stream consume --port "$base" "${common[@]}" --label "warren read-ahead 4096"
java_consume "$base" "warren read-ahead 4096"
raw_consume "$base" "warren read-ahead 4096"
perftest $((base + 1)) "warren read-ahead 4096"
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
fi  # SKIP_WARREN
if [ "${RABBITMQ:-0}" = 1 ]; then
  # Debian's RabbitMQ, run directly (not through the service wrapper that switches user), with
  # its own cookie, state, node name, epmd and ports.
  rmq=$(mktemp -d /tmp/rmq-stream-bench.XXXXXX)
  export HOME=$rmq RABBITMQ_MNESIA_BASE=$rmq/mnesia RABBITMQ_LOG_BASE=$rmq/log \
    RABBITMQ_NODE_PORT=$((base + 3)) RABBITMQ_DIST_PORT=$((base + 4)) \
    RABBITMQ_NODENAME=streambench$$@localhost \
    RABBITMQ_ENABLED_PLUGINS_FILE=$rmq/enabled_plugins RABBITMQ_CONFIG_FILE=$rmq/rabbitmq \
    ERL_EPMD_PORT=$((base + 5))
  rport=$((base + 2))
  printf 'stream.listeners.tcp.1 = 127.0.0.1:%s\nstream.advertised_host = localhost\nstream.advertised_port = %s\nlisteners.tcp.1 = 127.0.0.1:%s\nloopback_users = none\n' \
    "$rport" "$rport" "$RABBITMQ_NODE_PORT" > "$rmq/rabbitmq.conf"
  /usr/lib/rabbitmq/bin/rabbitmq-plugins --offline enable rabbitmq_stream >/dev/null
  /usr/lib/rabbitmq/bin/rabbitmq-server > "$rmq/out.log" 2>&1 &
  for _ in $(seq 1 300); do
    (exec 3<>"/dev/tcp/127.0.0.1/$rport") 2>/dev/null && { sleep 2; break; }
    sleep 0.5
  done
  bpid=$(/usr/lib/rabbitmq/bin/rabbitmqctl -n "$RABBITMQ_NODENAME" eval 'os:getpid().' | tr -dc 0-9)
  v="RabbitMQ $(dpkg-query -W -f '${Version}' rabbitmq-server 2>/dev/null)"
  # Publish with confirms as Warren was filled (20,000 in flight): its writer merges what is
  # queued into larger chunks. With EXACT=1 the streams are then filled again with one batch in
  # flight, so that RabbitMQ's chunks are the batches, as seed 003's are (slow: a round trip
  # per chunk); that fill's rate is labelled "exact fill" and is not a publish rate to compare.
  java_fill "$rport" "$v"
  [ "${EXACT:-0}" = 1 ] && java_fill "$rport" "$v (exact fill)" exact
  # osiris forms chunks from what its writer has queued, not from Publish frames: count the
  # chunks each stream really got from its index files (8-byte header, 29 bytes per chunk).
  for d in "$RABBITMQ_MNESIA_BASE"/*/stream/*/; do
    s=$(basename "$d" | sed 's/^__//; s/_[0-9]*$//')
    bytes=$(cat "$d"*.index | wc -c); files=$(ls "$d"*.index | wc -l)
    echo "rmq-chunks $s $(( (bytes - 8 * files) / 29 ))"
  done
  java_consume "$rport" "$v"
  raw_consume "$rport" "$v"
  perftest "$RABBITMQ_NODE_PORT" "$v"
  stop_rmq
fi
if [ -n "$svg" ]; then
  python3 bench/stream-table.py --svg "$svg" "$log"
fi
