#!/usr/bin/env bash
# Idle MQTT connections, one subscription each, against Warren, Mosquitto and RabbitMQ (with
# rabbitmq_mqtt) in one run: `warren-bench conns` against each broker in turn, started here
# on loopback and stopped afterwards; prints RSS per connection, connects/s, idle CPU and
# publish -> deliver latency side by side.
#   bench/conns-compare.sh [N] [RABBITMQ_N] [HOLD_SECONDS]
# Defaults: 18000 connections (Warren, Mosquitto), 5000 for RabbitMQ (~240 KiB each; its
# handshakes time out with 256 in flight, so it gets 32), 30 s idle hold, keep-alive 30 s.
# Ports: Warren MQTT 1992 / AMQP 5882, Mosquitto 1993, RabbitMQ MQTT 1994 / AMQP 5883 (node
# rabbit-i7@localhost, dist port 25883); with PORT_BASE=P: Warren MQTT P / AMQP P+1, Mosquitto
# P+2, RabbitMQ MQTT P+3 / AMQP P+4 / dist P+5. LATENCY_SECS (default 10): the live pair's
# run. BROKERS (default "warren mosquitto"): which of warren, mosquitto run. WARREN: the
# broker binary (default target/release/warren). Needs target/release/warren and warren-bench (cargo
# build --release -p warren-cli -p warren-bench), mosquitto, rabbitmq-server 3.10; set
# SKIP_RABBITMQ=1 to leave it out. CONNS_ARGS: more `warren-bench conns` options for every
# broker, e.g. "--qos 0", "--no-subscribe", "--mqtt-version 5", "--persistent" (clean
# session 0: issue 42's density case). ROUNDS (default 1): Warren and Mosquitto measured
# in turn that many times (interleaved, for a noisy machine).
# Measurements are serialised with other engineers' through /tmp/warren-measure.lock.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-18000}
rn=${2:-5000}
hold=${3:-30}
latency=${LATENCY_SECS:-10}
brokers=" ${BROKERS:-warren mosquitto} "
if [ -n "${PORT_BASE:-}" ]; then
  p=$PORT_BASE
  w_mqtt=$p w_amqp=$((p + 1)) m_mqtt=$((p + 2)) r_mqtt=$((p + 3)) r_amqp=$((p + 4)) r_dist=$((p + 5))
else
  w_mqtt=1992 w_amqp=5882 m_mqtt=1993 r_mqtt=1994 r_amqp=5883 r_dist=25883
fi
warren=${WARREN:-target/release/warren}
bench=target/release/warren-bench
[ -x "$warren" ] && [ -x "$bench" ] ||
  { echo "build first: cargo build --release -p warren-cli -p warren-bench" >&2; exit 2; }
tmp=$(mktemp -d /tmp/conns-compare.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  if [ -n "${rmq_node:-}" ]; then
    /usr/lib/rabbitmq/bin/rabbitmqctl -n "$rmq_node" stop >/dev/null 2>&1 || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
# Each connection is a descriptor in the broker and in the client; 20,000 is the cap here.
ulimit -n 20000

wait_port() { # port seconds
  for _ in $(seq 1 "$(( $2 * 10 ))"); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.1
  done
  echo "nothing listens on 127.0.0.1:$1 after $2 s" >&2
  return 1
}

measure() { # name port pid count concurrency
  echo "== $1: $4 connections" >&2
  RUST_LOG=warn flock /tmp/warren-measure.lock "$bench" conns --mqtt "127.0.0.1:$2" \
    --pid "$3" -n "$4" --concurrency "$5" --keep-alive 30 --hold "$hold" \
    --latency-secs "$latency" --rate 1000 --prefix "cmp-$1-" ${CONNS_ARGS:-} 2>&1 | tee "$tmp/$1.out" >&2 ||
    echo "  ($1: the run failed; its row shows what was measured)" >&2
}

field() { # name label: the value column of that row of the bench's table
  sed -n "s#^  $2  *##p" "$tmp/$1.out" | head -1
}

run_warren() { # round
  RUST_LOG=warn "$warren" serve --amqp "127.0.0.1:$w_amqp" --mqtt "127.0.0.1:$w_mqtt" --management none --prometheus none --stream none \
    --data-dir "$tmp/warren-data-$1" >"$tmp/warren.log" 2>&1 &
  pids+=($!)
  wait_port "$w_mqtt" 30
  measure "warren$1" "$w_mqtt" "${pids[-1]}" "$n" 256
  kill "${pids[-1]}"
  wait "${pids[-1]}" 2>/dev/null || true
}

run_mosquitto() { # round
  cat >"$tmp/mosquitto.conf" <<EOF
listener $m_mqtt 127.0.0.1
allow_anonymous true
max_connections -1
persistence false
log_dest none
EOF
  mosquitto -c "$tmp/mosquitto.conf" >"$tmp/mosquitto.log" 2>&1 &
  pids+=($!)
  wait_port "$m_mqtt" 10
  measure "mosquitto$1" "$m_mqtt" "${pids[-1]}" "$n" 256
  kill "${pids[-1]}"
  wait "${pids[-1]}" 2>/dev/null || true
}

rounds=${ROUNDS:-1}
for r in $(seq 1 "$rounds"); do
  [[ $brokers != *" warren "* ]] || run_warren "$r"
  [[ $brokers != *" mosquitto "* ]] || run_mosquitto "$r"
done

# RabbitMQ with its MQTT plugin, a node of its own under $tmp. Debian's wrapper resets the
# descriptor limit to 1024 and runs the CLI as the rabbitmq user (another Erlang cookie), so
# the scripts under /usr/lib/rabbitmq/bin are run directly.
if [ -z "${SKIP_RABBITMQ:-}" ]; then
  rmq_node=rabbit-i7@localhost
  echo '[rabbitmq_mqtt].' >"$tmp/enabled_plugins"
  cat >"$tmp/rabbitmq.conf" <<EOF
listeners.tcp.default = $r_amqp
mqtt.listeners.tcp.default = $r_mqtt
mqtt.allow_anonymous = true
EOF
  RABBITMQ_NODENAME=$rmq_node RABBITMQ_DIST_PORT=$r_dist RABBITMQ_NODE_PORT=$r_amqp \
    RABBITMQ_MNESIA_BASE=$tmp/rmq RABBITMQ_LOG_BASE=$tmp/rmq-log \
    RABBITMQ_ENABLED_PLUGINS_FILE=$tmp/enabled_plugins RABBITMQ_CONFIG_FILE=$tmp/rabbitmq.conf \
    /usr/lib/rabbitmq/bin/rabbitmq-server >"$tmp/rabbitmq.log" 2>&1 &
  wait_port "$r_mqtt" 120
  rmq_pid=$(/usr/lib/rabbitmq/bin/rabbitmqctl -n "$rmq_node" eval 'list_to_integer(os:getpid()).')
  measure rabbitmq1 "$r_mqtt" "$rmq_pid" "$rn" 32
  /usr/lib/rabbitmq/bin/rabbitmqctl -n "$rmq_node" stop >/dev/null 2>&1 || true
  rmq_node=
fi

echo
echo "Idle MQTT connections, one QoS 1 subscription each unless ${CONNS_ARGS:-(nothing)} says otherwise, keep-alive 30 s, hold ${hold} s ($(date -u +%Y-%m-%dT%H:%MZ))"
echo
echo "| broker | connections | RSS per connection | kernel socket slabs per connection (both ends) | connects/s | idle CPU | publish -> deliver | alive |"
echo "|---|---:|---:|---:|---:|---:|---|---|"
for r in $(seq 1 "$rounds"); do
for broker in warren mosquitto rabbitmq; do
  b=$broker$r
  [ -f "$tmp/$b.out" ] || continue
  conns=$(field "$b" connections | cut -d' ' -f1)
  rss=$(field "$b" "broker RSS" | grep -o "[0-9]* bytes per connection" | cut -d" " -f1 || true)
  rate=$(field "$b" "connects/s" | cut -d' ' -f1)
  cpu=$(field "$b" "idle CPU" | grep -o "^[0-9.]* %" || true)
  lat=$(field "$b" "publish->deliver" | cut -d'(' -f1)
  alive=$(field "$b" "alive at the end")
  slabs=$(field "$b" "kernel slabs (sockets)" | cut -d' ' -f1 || true)
  echo "| $broker (round $r) | $conns | $rss B | $slabs B | $rate | $cpu | $lat | $alive |"
done
done
