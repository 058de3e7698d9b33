#!/usr/bin/env bash
# The one_fast stall check (issue 21, item 7): N consecutive PerfTest `-x 1 -y 1 -s 12 -a` runs
# of SECS seconds against a broker already listening, with every per-second rate PerfTest
# prints. Per run: median received msg/s, the lowest second (sent and received), and the
# seconds below half the run's median (the first second, PerfTest's ramp-up, counted apart).
#   bench/one-fast-runs.sh URI [RUNS=20] [SECS=10] [OUTDIR=target/one-fast]
# With WARREN_DATA_DIR set, `warren ctl list-connections/list-queues` are sampled twice a
# second during each run (in_flight, queue depth) into OUTDIR/run-N.ctl, so a stall can be
# told apart: a full write window with a stalled socket, or an empty one with nothing sent.
# PerfTest jars from scripts/perftest.sh (target/perftest/lib, or PERFTEST_LIB).
set -euo pipefail
cd "$(dirname "$0")/.."
uri=${1:?usage: bench/one-fast-runs.sh URI [RUNS] [SECS] [OUTDIR]}
runs=${2:-20}
secs=${3:-10}
out=${4:-target/one-fast}
lib=${PERFTEST_LIB:-target/perftest/lib}
warren=${WARREN_BIN:-target/release/warren}
mkdir -p "$out"
sample() { # file: samples the broker until killed
  while :; do
    {
      date +%s.%N
      "$warren" ctl --data-dir "$WARREN_DATA_DIR" --format json list-connections 2>&1 || true
      "$warren" ctl --data-dir "$WARREN_DATA_DIR" list-queues name messages consumers 2>&1 || true
    } >>"$1"
    sleep 0.5
  done
}
summary=$out/summary.txt
: >"$summary"
for i in $(seq 1 "$runs"); do
  log=$out/run-$i.log
  sampler=
  if [ -n "${WARREN_DATA_DIR:-}" ]; then
    : >"$out/run-$i.ctl"
    sample "$out/run-$i.ctl" &
    sampler=$!
  fi
  java -cp "$lib/*" com.rabbitmq.perf.PerfTest --uri "$uri" -x 1 -y 1 -s 12 -a -z "$secs" >"$log" 2>&1 || true
  [ -n "$sampler" ] && kill "$sampler" 2>/dev/null && wait "$sampler" 2>/dev/null || true
  # The consumer connection's in_flight in each sample: a leaked write window shows as a
  # floor that never returns to 0 (the issue's stall: in_flight stuck just under 2048).
  floor=-
  if [ -n "$sampler" ]; then
    floor=$(grep -A8 '"client_name": "perf-test-consumer' "$out/run-$i.ctl" | awk '/in_flight/ { gsub(",", "", $2); v[n++] = $2 }
      END { if (n == 0) { print "-"; exit } m = v[n - 1]; for (k = n - 3; k < n; k++) if (k >= 0 && v[k] < m) m = v[k]; print m }')
  fi
  # Per-second lines: "time 3.000 s, sent: N msg/s, received: M msg/s, ..."
  awk -v run="$i" -v floor="$floor" '
    BEGIN { n = 0 }
    /time [0-9.]+ s, sent:/ {
      for (f = 1; f <= NF; f++) {
        if ($f == "sent:") s[n] = $(f + 1) + 0
        if ($f == "received:") r[n] = $(f + 1) + 0
      }
      n++
    }
    END {
      if (n == 0) { printf "run %2d: no per-second lines\n", run; exit }
      # median of received, all seconds
      for (k = 0; k < n; k++) v[k] = r[k]
      for (a = 0; a < n; a++) for (b = a + 1; b < n; b++) if (v[b] < v[a]) { t = v[a]; v[a] = v[b]; v[b] = t }
      med = (n % 2) ? v[int(n / 2)] : (v[n / 2 - 1] + v[n / 2]) / 2
      minr = r[0]; mins = s[0]; minr2 = -1; mins2 = -1; low = 0; low2 = 0
      for (k = 0; k < n; k++) {
        if (r[k] < minr) minr = r[k]
        if (s[k] < mins) mins = s[k]
        if (r[k] < med / 2 || s[k] < med / 2) low++
        if (k > 0) {
          if (minr2 < 0 || r[k] < minr2) minr2 = r[k]
          if (mins2 < 0 || s[k] < mins2) mins2 = s[k]
          if (r[k] < med / 2 || s[k] < med / 2) low2++
        }
      }
      stall = 0
      for (k = 1; k < n; k++) if (s[k] < med / 10 && r[k] > 0) stall++
      printf "run %2d: median recv %7d  first second sent/recv %7d/%7d  lowest later second sent %7d recv %7d  publisher-stalled seconds %d  in_flight floor %s  seconds < median/2: %d (after the first: %d)\n", run, med, s[0], r[0], mins2, minr2, stall, floor, low, low2
    }' "$log" | tee -a "$summary"
done
echo "all runs:"
awk '
  function after(word,   k) { for (k = 1; k < NF; k++) if ($k == word) return $(k + 1) + 0; return -1 }
  {
    med[NR] = after("recv")
    ms = after("sent"); mr = $0; sub(/.*lowest later second sent +[0-9]+ recv +/, "", mr); mr += 0
    if (NR == 1 || ms < ws) ws = ms
    if (NR == 1 || mr < wr) wr = mr
    stalls += after("seconds")
    if ($0 ~ /after the first: [1-9]/) bad++
    f = $0; sub(/.*in_flight floor /, "", f); sub(/ .*/, "", f); if (f != "-" && f + 0 > 0) leaked++
  }
  END {
    n = NR; for (a = 1; a <= n; a++) for (b = a + 1; b <= n; b++) if (med[b] < med[a]) { t = med[a]; med[a] = med[b]; med[b] = t }
    printf "runs %d; run medians (recv msg/s) min %d, median %d; lowest second after the first: sent %d, recv %d\n", n, med[1], med[int((n + 1) / 2)], ws, wr
    printf "runs with a second after the first below half their median: %d; publisher-stalled seconds (sent < median/10, recv > 0): %d; runs ending with in_flight > 0: %d\n", bad + 0, stalls + 0, leaked + 0
  }' "$summary"
