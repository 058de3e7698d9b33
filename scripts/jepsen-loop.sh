#!/usr/bin/env bash
# Loops cluster/tests/jepsen.rs::three_nodes_quorum_queue_under_faults to reproduce a rare
# loss of a confirmed message; keeps the output and the three brokers' logs of every run
# that fails in $OUT/fail-N/. Each run takes the netns lock on its own (other tests share
# it). Usage: scripts/jepsen-loop.sh RUNS [OUT]   (env: WARREN_BIN, WARREN_JEPSEN_SECS,
# WARREN_JEPSEN_SEED, RUST_LOG passed through to the brokers by scripts/cluster.sh).
set -u
runs=${1:-10}
out=${2:-/tmp/jepsen-loop}
root=$(cd "$(dirname "$0")/.." && pwd)
test_bin=$(ls -t "$root"/target/debug/deps/jepsen-* | grep -v '\.d$' | head -1)
mkdir -p "$out"
pass=0 fail=0
for i in $(seq 1 "$runs"); do
    rm -rf "${TMPDIR:-/tmp}/warren-jepsen-logs"
    log="$out/run-$i.txt"
    WARREN_CLUSTER_REQUIRE=1 flock /tmp/warren-netns.lock \
        "$test_bin" --exact three_nodes_quorum_queue_under_faults --nocapture >"$log" 2>&1
    rc=$?
    summary=$(grep -o 'lost [0-9]*, invented [0-9]*' "$log" | tail -1)
    seed=$(grep -o 'seed [0-9]*' "$log" | head -1)
    if [ $rc -eq 0 ]; then
        pass=$((pass + 1))
    else
        fail=$((fail + 1))
        mkdir -p "$out/fail-$i"
        cp "$log" "$out/fail-$i/"
        cp "${TMPDIR:-/tmp}"/warren-jepsen-logs/n*.log "$out/fail-$i/" 2>/dev/null
    fi
    echo "run $i rc=$rc $seed $summary (pass $pass fail $fail)"
done
