#!/usr/bin/env bash
# Where a replicated quorum queue's time and CPU go (docs/cluster.md, "Performance of quorum
# queues"): a 3-node cluster (scripts/cluster.sh), a quorum queue declared on n1, PerfTest
# (1 producer, 1 consumer, 1 KB, 100 confirms outstanding, prefetch 200) on the queue's
# leader for SECS; from the 3rd second, for 5 s, MODE attaches to the leader and one follower:
#   strace  syscall counts (strace -c -f): fdatasyncs, futex wakeups, socket calls
#   perf    call graphs (perf record -g), read with `perf report -i OUT/perf-leader.data`
#   none    nothing (the CPU figures are then the clean ones)
# Prints msg/s, broker CPU per message (all nodes, the leader, one follower), and how many
# log entries the queue's group appended meanwhile (messages per entry: the group commit).
#   bench/qq-profile.sh [SECS=10] [MODE=none]
# Needs root and ip netns; run it under `flock /tmp/warren-netns.lock` where others share
# the machine. WARREN_BIN (default target/release/warren), PERFTEST_LIB (default
# target/perftest/lib), WARREN_CLUSTER_BRIDGE/NET (default wbp0, 10.91.0), OUT
# (default target/bench/qq-profile).
set -uo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
mode=${2:-none}
export WARREN_BIN=${WARREN_BIN:-target/release/warren}
export WARREN_CLUSTER_BRIDGE=${WARREN_CLUSTER_BRIDGE:-wbp0}
export WARREN_CLUSTER_NET=${WARREN_CLUSTER_NET:-10.91.0}
lib=${PERFTEST_LIB:-target/perftest/lib}
out=${OUT:-target/bench/qq-profile}
[ -x "$WARREN_BIN" ] || { echo "$WARREN_BIN not found: cargo build --release -p warren-cli"; exit 2; }
ls "$lib"/perf-test-*.jar >/dev/null 2>&1 || { echo "no PerfTest in $lib: scripts/perftest.sh fetches it"; exit 2; }
rm -rf "$out" && mkdir -p "$out"
scratch=$(mktemp -d /tmp/warren-qq-profile.XXXXXX)
export WARREN_CLUSTER_DIR=$scratch/cluster
trap 'scripts/cluster.sh down >/dev/null 2>&1; rm -rf "$scratch"' EXIT
up=$(scripts/cluster.sh up 3) || exit 1
n1http=$(awk '$1 == "n1" { sub("http=", "", $4); print $4 }' <<<"$up")
curl -sf -u warren:warren -X PUT -H 'content-type: application/json' \
  -d '{"durable":true,"arguments":{"x-queue-type":"quorum"}}' "http://$n1http/api/queues/%2f/qq-profile"
leader=$(curl -sf -u warren:warren "http://$n1http/api/queues/%2f/qq-profile" |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["leader"])')
lead=$(awk -v n="n$leader" '$1 == n { sub("amqp=", "", $2); print $2 }' <<<"$up")
fol=$((leader % 3 + 1))
lpid=$(cat "$WARREN_CLUSTER_DIR/n$leader/pid")
fpid=$(cat "$WARREN_CLUSTER_DIR/n$fol/pid")
pids=$(cat "$WARREN_CLUSTER_DIR"/n*/pid | tr '\n' ' ')
echo "leader n$leader (pid $lpid), follower n$fol (pid $fpid)"
ticks() { local p s=0; for p in "$@"; do s=$((s + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo "$s"; }
entries() {
  "$WARREN_BIN" ctl --format json --data-dir "$WARREN_CLUSTER_DIR/n$leader/data" cluster-status |
    python3 -c 'import json, sys; d = json.load(sys.stdin); print([g for g in d["groups"] if g.get("queue") == "qq-profile"][0]["status"]["last_log_index"])'
}
# shellcheck disable=SC2086
t0=$(ticks $pids) tl0=$(ticks "$lpid") tf0=$(ticks "$fpid") e0=$(entries)
java -cp "$lib/*" com.rabbitmq.perf.PerfTest --uri "amqp://warren:warren@$lead" -z "$secs" \
  -x 1 -y 1 -s 1000 -c 100 -q 200 --quorum-queue --queue qq-profile >"$out/perftest.log" 2>&1 &
jp=$!
sleep 3
case $mode in
  strace)
    timeout 5 strace -c -f -p "$lpid" -o "$out/strace-leader.txt" &
    timeout 5 strace -c -f -p "$fpid" -o "$out/strace-follower.txt" & ;;
  perf)
    perf record -F 499 -g -p "$lpid" -o "$out/perf-leader.data" -- sleep 5 >/dev/null 2>&1 &
    perf record -F 499 -g -p "$fpid" -o "$out/perf-follower.data" -- sleep 5 >/dev/null 2>&1 & ;;
esac
wait
# shellcheck disable=SC2086
t1=$(ticks $pids) tl1=$(ticks "$lpid") tf1=$(ticks "$fpid") e1=$(entries)
recv=$(sed -n 's/.*receiving rate avg: \([0-9]*\) msg\/s.*/\1/p' "$out/perftest.log" | tail -1)
awk -v r="${recv:-0}" -v s="$secs" -v hz="$(getconf CLK_TCK)" -v a=$((t1 - t0)) -v l=$((tl1 - tl0)) \
  -v f=$((tf1 - tf0)) -v e=$((e1 - e0)) 'BEGIN {
    n = r * s; if (n == 0) { print "no messages received"; exit 1 }
    printf "%d msg/s; CPU us/msg: all nodes %.1f, leader %.1f, follower %.1f; %d log entries (%.1f messages each)\n",
      r, a / hz * 1e6 / n, l / hz * 1e6 / n, f / hz * 1e6 / n, e, (e > 0 ? n / e : 0) }'
[ "$mode" = none ] || echo "traces in $out"
