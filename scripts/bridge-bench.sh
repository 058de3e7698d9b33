#!/usr/bin/env bash
# QoS 1 forwarding rate of an MQTT bridge, side by side on the same pair: a publisher on
# broker A, a subscriber on Mosquitto B, A's bridge moving `bench/#` out with QoS 1.
#   A = warren serve (its [[bridge]]; fsync on, then --fsync off)
#   A = mosquitto   (its own `connection` block, no persistence)
#   B alone  (the publisher on B: what the clients and B do without a bridge)
# Clients: mosquitto_pub (-l: one message per stdin line, -M in flight) and mosquitto_sub
# (-C N), so every A sees the same load. Prints messages/s per setup. (mosquitto_pub -l
# drops its connection on large inputs with a large -M: N 50,000 and -M 100 work.)
#
#   [INFLIGHT=100] [KEEP=1] scripts/bridge-bench.sh [WARREN_BIN] [N] [SIZE]
# WARREN_BIN defaults to target/release/warren (cargo build --release -p warren-cli); KEEP
# keeps the work directory (the brokers' logs).
set -euo pipefail
bin=${1:-target/release/warren}
n=${2:-50000}
size=${3:-100}
inflight=${INFLIGHT:-100}
mosq=$(command -v mosquitto || echo /usr/sbin/mosquitto)
[ -x "$mosq" ] || { echo "mosquitto is not installed" >&2; exit 1; }
[ -x "$bin" ] || { echo "no warren binary at $bin" >&2; exit 1; }
work=$(mktemp -d)
echo "work dir $work" >&2
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  [ -n "${KEEP:-}" ] || rm -rf "$work"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 200); do (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return; sleep 0.05; done; echo "port $1 not up" >&2; exit 1; }
payload=$(head -c "$size" /dev/zero | tr '\0' x)
for _ in $(seq "$n"); do echo "$payload"; done > "$work/lines"

pb=$(free_port)
printf 'listener %s 127.0.0.1\nallow_anonymous true\nmax_queued_messages 0\n' "$pb" > "$work/b.conf"
"$mosq" -c "$work/b.conf" >/dev/null 2>&1 & pids+=($!)
wait_port "$pb"

# measure NAME PORT_A: N QoS 1 messages published on A, the time until B's subscriber has them.
measure() {
  local name=$1 pa=$2 t0 t1
  mosquitto_sub -h 127.0.0.1 -p "$pb" -t 'bench/#' -q 1 -C "$n" -i "sub-$name" > /dev/null &
  local sub=$!
  sleep 0.5
  t0=$(date +%s.%N)
  mosquitto_pub -h 127.0.0.1 -p "$pa" -t bench/x -q 1 -M "$inflight" -l < "$work/lines"
  wait "$sub"
  t1=$(date +%s.%N)
  python3 -c "import sys; e=$t1-$t0; print(f'{sys.argv[1]:32} {$n} x {$size} B QoS 1: {e:6.2f} s, {$n/e:8.0f} msg/s')" "$name"
}

# 1. Warren's bridge (fsync on, the default; then off).
for fsync in on off; do
  pa=$(free_port)
  mkdir -p "$work/w-$fsync"
  printf '[[bridge]]\nname = "bench"\naddress = ["127.0.0.1:%s"]\ntopic = ["bench/# out 1"]\nnotifications = false\n' "$pb" > "$work/w-$fsync/warren.toml"
  "$bin" serve --config "$work/w-$fsync/warren.toml" --data-dir "$work/w-$fsync" --fsync "$fsync" \
    --amqp none --mqtt "127.0.0.1:$pa" --management none --prometheus none --stream none \
    > "$work/w-$fsync.log" 2>&1 & wpid=$!; pids+=($wpid)
  wait_port "$pa"
  for _ in $(seq 100); do grep -q "bridge running" "$work/w-$fsync.log" && break; sleep 0.1; done
  measure "warren bridge (fsync $fsync)" "$pa"
  kill -9 "$wpid"; wait "$wpid" 2>/dev/null || true
done

# 2. Mosquitto's bridge.
pa=$(free_port)
printf 'listener %s 127.0.0.1\nallow_anonymous true\nmax_queued_messages 0\nconnection bench\naddress 127.0.0.1:%s\ntopic bench/# out 1\nnotifications false\ncleansession true\n' "$pa" "$pb" > "$work/a.conf"
"$mosq" -c "$work/a.conf" >/dev/null 2>&1 & pids+=($!)
wait_port "$pa"
sleep 2
measure "mosquitto bridge" "$pa"

# 3. No bridge: the publisher on B itself (what the clients and B do alone).
measure "no bridge (publisher on B)" "$pb"
