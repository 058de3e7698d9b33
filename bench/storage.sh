#!/usr/bin/env bash
# Durable storage measurements (a benchmark, not a test): fills a durable queue with persistent
# messages under confirms (rate and broker RSS), then restarts Warren after a clean stop and after
# SIGKILL and measures how long until it listens and until a passive declare reports the queue's
# message count; then the same after declaring many durable queues. Prints a table.
#   bench/storage.sh [MESSAGES=1000000] [SIZE=1000] [QUEUES=10000]
# Environment: PROFILE=release|debug (default release: numbers from debug builds mean little),
# DATA_DIR (default target/bench-storage, wiped), WAIT_SECS (bound on each start and count, 900).
set -euo pipefail
cd "$(dirname "$0")/.."
msgs=${1:-1000000}
size=${2:-1000}
nqueues=${3:-10000}
profile=${PROFILE:-release}
data=${DATA_DIR:-target/bench-storage}
wait_secs=${WAIT_SECS:-900}
log=target/bench-storage.log
port=0 # the first start picks a free port; restarts reuse it
pid=""

if [ "$profile" = release ]; then build=(--release); else build=(); fi
cargo build "${build[@]}" -p warren-cli
cargo build "${build[@]}" -p warren-tests --bin storage-bench
warren=target/$profile/warren
bench=target/$profile/storage-bench

cleanup() {
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; wait "$pid" 2>/dev/null || true; fi
}
trap cleanup EXIT

now_ms() { echo $(($(date +%s%N) / 1000000)); }

rss() { # VmRSS of the broker, in MiB
  awk '/^VmRSS:/ { printf "%.1f MiB", $2 / 1024 }' "/proc/$pid/status" 2>/dev/null || echo "n/a"
}

started_ms=0
listen_ms=0
start_broker() {
  local from
  from=$(stat -c %s "$log" 2>/dev/null || echo 0)
  started_ms=$(now_ms)
  "$warren" serve --amqp "127.0.0.1:$port" --mqtt none --management none --prometheus none --stream none --data-dir "$data" >> "$log" 2>&1 &
  pid=$!
  local deadline=$((SECONDS + wait_secs)) line
  while [ $SECONDS -lt $deadline ]; do
    if line=$(tail -c +$((from + 1)) "$log" | grep -o "listening on 127.0.0.1:[0-9]*"); then
      listen_ms=$(($(now_ms) - started_ms))
      port=${line##*:}
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || { echo "warren exited before listening:"; tail -20 "$log"; exit 1; }
    sleep 0.01
  done
  echo "warren did not listen within ${wait_secs}s"; tail -20 "$log"; exit 1
}

stop_broker() { # TERM | KILL
  kill -"$1" "$pid"
  timeout "$wait_secs" tail --pid="$pid" -f /dev/null || { echo "warren did not stop on SIG$1"; exit 1; }
  { wait "$pid" || true; } 2>/dev/null # no "Killed" job notice in the output
  pid=""
}

rows=()
measure_restart() { # label, count arguments...
  local label=$1; shift
  start_broker
  local out code=0
  out=$("$bench" --amqp "127.0.0.1:$port" count --timeout-secs "$wait_secs" "$@") || code=$?
  local answered_ms=$(($(now_ms) - started_ms))
  echo "$out"
  local what
  case $code in
    0) what=$(echo "$out" | grep -o "holds [0-9]* messages\|all [0-9]* queues [^ ]* exist" || echo "$out") ;;
    3) what="MISSING ($(echo "$out" | sed 's/^count: //'))" ;;
    *) what="no answer (exit $code)" ;;
  esac
  rows+=("$(printf '| %s | %s | %s | %s | %s |' "$label" "$listen_ms" "$answered_ms" "$what" "$(rss)")")
}

rm -rf "$data" "$log"
echo "== fill: $msgs x $size B, persistent, confirms ($profile build)"
start_broker
fill_out=$("$bench" --amqp "127.0.0.1:$port" --pid "$pid" fill --count "$msgs" --size "$size")
echo "$fill_out"
echo "== restart after SIGTERM"
stop_broker TERM
measure_restart "$msgs x $size B, clean stop (SIGTERM)" --queue bench-fill
echo "== restart after SIGKILL"
stop_broker KILL
measure_restart "$msgs x $size B, SIGKILL" --queue bench-fill
stop_broker TERM

rm -rf "$data"
echo "== declare $nqueues durable queues"
start_broker
queues_out=$("$bench" --amqp "127.0.0.1:$port" --pid "$pid" queues --count "$nqueues")
echo "$queues_out"
stop_broker KILL
measure_restart "$nqueues durable queues, SIGKILL" --prefix bench-q- --queues "$nqueues"
stop_broker TERM

echo
echo "warren $(git rev-parse --short HEAD), $profile build, $(date -u +%Y-%m-%dT%H:%MZ)"
echo "$fill_out" | sed 's/^/  /'
echo "$queues_out" | sed 's/^/  /'
echo
echo "| restart scenario | listening after (ms) | passive declare answered after (ms) | reported | broker RSS after |"
echo "|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
