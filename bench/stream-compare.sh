#!/usr/bin/env bash
# Seed 003's stream table on this machine: fill streams of MESSAGES messages at each message
# size and chunk size (warren-bench stream fill, with confirms), then consume each from
# `first` with read-ahead off and on (two broker starts on the same data dir), and, with
# RABBITMQ=1, the same against Debian's RabbitMQ (rabbitmq_stream plugin) on side ports.
# Usage: bench/stream-compare.sh [MESSAGES] [SIZES] [CHUNKS]   (defaults 1000000 12,1024 1,8,64)
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-1000000}
sizes=${2:-12,1024}
chunks=${3:-1,8,64}
port=
cargo build --release -p warren-cli -p warren-bench >/dev/null
warren=target/release/warren
bench=target/release/warren-bench
export RUST_LOG=${RUST_LOG:-error}  # the client warns at every close
data=$(mktemp -d /tmp/warren-stream-bench.XXXXXX)
pid=
stop() { [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; pid=; }
trap 'stop; rm -rf "$data" "$data.log"' EXIT
start() {
  : > "$data.log"
  RUST_LOG=info "$warren" serve --amqp none --mqtt none --management none --prometheus none \
    --stream "127.0.0.1:${STREAM_PORT:-0}" --stream-read-ahead "$1" --data-dir "$data" >> "$data.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 100); do
    port=$(grep -o 'listening on 127.0.0.1:[0-9]* (stream)' "$data.log" | grep -o ':[0-9]*' | tr -d :) || true
    [ -n "$port" ] && return 0
    sleep 0.1
  done
  echo "warren did not start: $(cat "$data.log")" >&2; return 1
}
common=(--messages "$n" --sizes "$sizes" --chunks "$chunks")
start 0
"$bench" stream fill --port "$port" "${common[@]}"
"$bench" stream consume --port "$port" "${common[@]}" --label "warren read-ahead off"
stop
start 4096
"$bench" stream consume --port "$port" "${common[@]}" --label "warren read-ahead 4096"
stop
if [ "${RABBITMQ:-0}" = 1 ]; then
  # Debian's RabbitMQ on side ports, its own state in a temporary directory.
  rmq=$(mktemp -d /tmp/rmq-stream-bench.XXXXXX)
  export RABBITMQ_MNESIA_BASE=$rmq/mnesia RABBITMQ_LOG_BASE=$rmq/log \
    RABBITMQ_NODE_PORT=15673 RABBITMQ_DIST_PORT=25673 RABBITMQ_NODENAME=bench@localhost \
    RABBITMQ_ENABLED_PLUGINS_FILE=$rmq/plugins RABBITMQ_CONFIG_FILE=$rmq/rabbitmq \
    ERL_EPMD_PORT=14369
  echo "[rabbitmq_stream]." > "$rmq/plugins"
  port=${RABBITMQ_STREAM_PORT:-15552}
  echo "stream.listeners.tcp.1 = 127.0.0.1:$port" > "$rmq/rabbitmq.conf"
  rabbitmq-server > "$rmq/out.log" 2>&1 &
  for _ in $(seq 1 300); do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
    sleep 0.2
  done
  "$bench" stream both --port "$port" "${common[@]}" --label "RabbitMQ $(dpkg-query -W -f '${Version}' rabbitmq-server 2>/dev/null)"
  rabbitmqctl -n bench@localhost stop >/dev/null 2>&1 || true
  rm -rf "$rmq"
fi
