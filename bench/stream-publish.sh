#!/usr/bin/env bash
# Stream publish rate with confirms (issue 26's "3x RabbitMQ" goal), in one run: Warren with
# fsync on, Warren with --fsync off, and Debian's RabbitMQ 3.10.8 (rabbitmq_stream, one node:
# osiris confirms once its writer wrote, without fsync), each published to by
# `warren-bench stream publish` (bench/src/stream_publish.rs: raw frames, so the client costs
# little and RabbitMQ 3.10 can be measured; the Rust client 0.11 cannot talk to it). Every cell
# prints msg/s until the last confirm and the broker's CPU us per message.
#
# Usage: bench/stream-publish.sh [MESSAGES] [SIZES] [BATCHES] [PUBLISHERS]
#   defaults: 300000 12,1024 1,64,384 2
# Env: WARREN, BENCH (default target/release/warren and warren-bench), WARREN_BASE (another
#   warren binary, e.g. main's build, measured first in the same run: "base" cells), IN_FLIGHT (per
#   publisher, default 20000), PORT_BASE (default 22600): Warren's stream port; RabbitMQ's
#   stream +2, AMQP +3, distribution +4, epmd +5. SKIP_RABBITMQ=1. RABBITMQ_FIRST=1: RabbitMQ
#   before Warren (run a round each way). WARM (default 1): before each broker's run, write and
#   delete a file as large as its largest cell, so that every broker writes its streams into
#   page-cache pages freed a moment before; WARM=0 leaves them as the machine has them.
#   Why: on this VM (virtio_balloon with free page reporting) memory freed for ~15 s goes back
#   to the host, and the first write to such a page costs ~10x (dd into a new file: 0.37-0.49
#   GB/s; into pages freed just before: 3.5-5.6 GB/s, 2026-11-25). Without the warm-up the
#   broker that runs after another's deleted streams gets the cheap pages and the other the
#   dear ones: at 1 KB that alone moves a broker's rate by 2x or more.
#   CLIENT=java: RabbitMQ's Java stream client publishes instead (bench/java/StreamFill.java,
#   one producer per cell, batch size = BATCHES, 20,000 unconfirmed; PUBLISHERS is ignored;
#   jars in JAVA_LIB, default target/stream-java/lib): what users' clients cost the broker.
#   JAVA_WARMUP (default 200000): messages published, unreported, before the first cell.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-300000}
sizes=${2:-12,1024}
batches=${3:-1,64,384}
publishers=${4:-2}
base=${PORT_BASE:-22600}
warren=${WARREN:-target/release/warren}
bench=${BENCH:-target/release/warren-bench}
data=$(mktemp -d /tmp/warren-stream-publish.XXXXXX)
pid=
rmq=
stop() {
  [ -n "$pid" ] && { kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; }
  pid=
}
stop_rmq() {
  [ -n "$rmq" ] || return 0
  /usr/lib/rabbitmq/bin/rabbitmqctl -n "$RABBITMQ_NODENAME" stop >/dev/null 2>&1 || true
  ERL_EPMD_PORT=$((base + 5)) "$(ls /usr/lib/erlang/erts-*/bin/epmd | head -1)" -kill >/dev/null 2>&1 || true
  rm -rf "$rmq"; rmq=
}
trap 'stop; stop_rmq; rm -rf "$data" "$data".*' EXIT
lib=${JAVA_LIB:-target/stream-java/lib}
if [ "${CLIENT:-}" = java ]; then
  javac -nowarn -cp "$lib/*" -d "$data.classes" bench/java/StreamFill.java bench/java/BrokerCpu.java
fi
publish() {  # PORT BROKER_PID LABEL
  if [ "${CLIENT:-}" = java ]; then
    java -Dorg.slf4j.simpleLogger.defaultLogLevel=warn -Dbroker.pid="$2" -Dfill.delete=true -Dfill.warmup="${JAVA_WARMUP:-200000}" -cp "$lib/*:$data.classes" \
      StreamFill 127.0.0.1 "$1" "$n" "$3 (java)" "$sizes" "$batches"
    return
  fi
  "$bench" stream publish --port "$1" --broker-pid "$2" --messages "$n" --sizes "$sizes" \
    --chunks "$batches" --publishers "$publishers" --in-flight "${IN_FLIGHT:-20000}" --label "$3"
}
warm() {  # pages freed just before the run (see WARM above)
  [ "${WARM:-1}" = 1 ] || return 0
  local mib=$(( n * $(tr , '\n' <<< "$sizes" | sort -n | tail -1) / 1048576 + 64 ))
  dd if=/dev/zero of="$data.warm" bs=1M count="$mib" status=none
  rm -f "$data.warm"
}
warren_run() {  # LABEL [extra serve flags]
  local label=$1; shift
  rm -rf "$data"; mkdir -p "$data"
  warm
  RUST_LOG=info "${bin:-$warren}" serve --amqp none --mqtt none --management none --prometheus none \
    --stream "127.0.0.1:$base" --data-dir "$data" "$@" > "$data.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 100); do
    grep -q 'listening on .* (stream)' "$data.log" && break
    sleep 0.1
  done
  publish "$base" "$pid" "$label"
  stop
}
echo "# $(date -u +%FT%TZ) $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $n messages per cell, $publishers publishers"
if [ -n "${WARREN_BASE:-}" ]; then
  bin=$WARREN_BASE warren_run "base fsync on"
  bin=$WARREN_BASE warren_run "base fsync off" --fsync off
fi
rabbitmq_run() {
  [ "${SKIP_RABBITMQ:-0}" != 1 ] || return 0
  rmq=$(mktemp -d /tmp/rmq-stream-publish.XXXXXX)
  export HOME=$rmq RABBITMQ_MNESIA_BASE=$rmq/mnesia RABBITMQ_LOG_BASE=$rmq/log \
    RABBITMQ_NODE_PORT=$((base + 3)) RABBITMQ_DIST_PORT=$((base + 4)) \
    RABBITMQ_NODENAME=streampublish$$@localhost \
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
  warm
  publish "$rport" "$bpid" "RabbitMQ $(dpkg-query -W -f '${Version}' rabbitmq-server 2>/dev/null)"
  stop_rmq
}
[ "${RABBITMQ_FIRST:-0}" = 1 ] && rabbitmq_run
warren_run "warren fsync on"
warren_run "warren fsync off" --fsync off
[ "${RABBITMQ_FIRST:-0}" = 1 ] || rabbitmq_run
