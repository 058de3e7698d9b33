#!/usr/bin/env bash
# The test command: installs what the tests need (idempotent), then runs every check and test
# suite. Works on a fresh machine with rustup, python3, Java 17, Maven and Node 18+ (root, for
# apt-get install chromium).
#   scripts/test.sh
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
passed=0
broker_pid=""
port=${WARREN_TEST_PORT:-0} # 0: the broker picks a free port and logs it
mqtt_port=${WARREN_TEST_MQTT_PORT:-0}
python=target/venv/bin/python

lane_pid=""

cleanup() {
  if [ -n "$broker_pid" ] && kill -0 "$broker_pid" 2>/dev/null; then
    kill -TERM "$broker_pid" 2>/dev/null
    wait "$broker_pid" 2>/dev/null
  fi
  # A lane still running when a step in front failed: its process group goes with us.
  if [ -n "$lane_pid" ] && kill -0 "$lane_pid" 2>/dev/null; then
    kill -TERM -- "-$lane_pid" 2>/dev/null
  fi
}
trap cleanup EXIT

# Free space where the build and the tests' data dirs live: below a broker's 50 MB
# disk_free_limit its alarm blocks publishers, so a nearly full disk shows up here.
free_disk() {
  df -h --output=avail "$root/target" "${TMPDIR:-/tmp}" 2>/dev/null | tail -n +2 | tr -s ' \n' ' ' | sed 's/^ //; s/ $//'
}

step() { # name command...
  local name=$1; shift
  printf '\n=== %s ===\n' "$name"
  local start=$SECONDS
  if "$@"; then
    passed=$((passed + 1))
    printf -- '--- ok: %s (%ss, %s free on disk)\n' "$name" $((SECONDS - start)) "$(free_disk)"
  else
    printf -- '--- FAILED: %s (%ss, %s free on disk)\n' "$name" $((SECONDS - start)) "$(free_disk)"
    echo "steps: $passed passed, 1 failed"
    exit 1
  fi
}

# A lane: steps run in order in the background, into a log of their own, while the steps in
# front go on. Mostly-waiting steps (the netns clusters: elections, timeouts, restarts) then
# overlap CPU-bound ones (clippy, the Java and wasm checks) on this 2-core machine. A lane
# stops at its first failure; `lane_join` prints the log and fails if the lane did.
lane_step() { # name command...
  local name=$1; shift
  printf '\n=== %s ===\n' "$name"
  local start=$SECONDS
  if "$@"; then
    printf -- '--- ok: %s (%ss, %s free on disk)\n' "$name" $((SECONDS - start)) "$(free_disk)"
  else
    printf -- '--- FAILED: %s (%ss, %s free on disk)\n' "$name" $((SECONDS - start)) "$(free_disk)"
    return 1
  fi
}

lane_start() { # log function
  set -m # the lane gets a process group of its own, so cleanup can end all of it
  "$2" >"$1" 2>&1 &
  lane_pid=$!
  set +m
  lane_log=$1
  echo "started in the background (pid $lane_pid), log: $1"
}

lane_join() {
  local rc=0
  wait "$lane_pid" || rc=$?
  lane_pid=""
  cat "$lane_log"
  passed=$((passed + $(grep -c '^--- ok: ' "$lane_log")))
  return "$rc"
}

setup_toolchain() {
  rustup component add rustfmt clippy && rustup target add wasm32-unknown-unknown
}

setup_python() {
  local pkgs=('pika==1.3.2' 'pytest==8.3.4' 'pytest-timeout==2.4.0' 'paho-mqtt==2.1.0'
    'python-qpid-proton==0.40.0' 'rabbitmq-amqp-python-client==1.0.1')
  if [ -x target/venv/bin/python ] || python3 -m venv target/venv; then
    target/venv/bin/python -m pip install -q --disable-pip-version-check "${pkgs[@]}"
  else
    # No venv module (Debian without python3-venv): install into a folder of our own.
    echo "python3 -m venv unavailable; installing into target/pydeps instead"
    rm -rf target/venv
    python3 -m pip install -q --disable-pip-version-check --target target/pydeps "${pkgs[@]}" ||
      return 1
    python=python3
    export PYTHONPATH="$root/target/pydeps${PYTHONPATH:+:$PYTHONPATH}"
  fi
  "$python" -m pytest --version
}

setup_mosquitto_clients() {
  command -v mosquitto_pub >/dev/null && command -v mosquitto_sub >/dev/null &&
    command -v mosquitto >/dev/null && command -v openssl >/dev/null && return 0
  # Debian's mosquitto-clients (the reference MQTT command-line clients) and mosquitto (the
  # broker bench/compare.sh measures against); openssl makes tests/python/test_tls.py's
  # certificates. We run as root in CI.
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -q &&
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q mosquitto mosquitto-clients openssl ||
    return 1
  # The package may start its own daemon on 1883; compare.sh runs its own on a side port.
  $sudo service mosquitto stop >/dev/null 2>&1 || true
}

setup_rabbitmq() {
  # RabbitMQ itself (Debian's 3.10), the peer of tests/python/test_shovel_rabbitmq.py (the
  # migration case of issue 38). The test starts its own node on side ports; the package's
  # own service is kept from starting (policy-rc.d) so it holds no default port.
  command -v rabbitmq-server >/dev/null && return 0
  local sudo="" added=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee /usr/sbin/policy-rc.d >/dev/null &&
      $sudo chmod +x /usr/sbin/policy-rc.d && added=1
  fi
  $sudo apt-get update -q &&
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q rabbitmq-server
  local rc=$?
  [ -z "$added" ] || $sudo rm -f /usr/sbin/policy-rc.d
  $sudo service rabbitmq-server stop >/dev/null 2>&1 || true
  return "$rc"
}

setup_perftest() {
  ls target/perftest/lib/perf-test-*.jar >/dev/null 2>&1 && return 0
  mvn -q -B -Dstyle.color=never -f scripts/perftest/pom.xml dependency:copy-dependencies \
    -DoutputDirectory="$root/target/perftest/lib"
}

setup_stream_java() {
  # RabbitMQ's Java stream client 0.20.0 and its dependencies, for the stream-protocol check.
  ls target/stream-java/lib/stream-client-*.jar >/dev/null 2>&1 && return 0
  mvn -q -B -Dstyle.color=never -f gateway-stream/tests/java/pom.xml dependency:copy-dependencies \
    -DoutputDirectory="$root/target/stream-java/lib"
}

# One build of every target, with dependency features unified over the whole workspace. A
# later `cargo build -p X` or `cargo test -p X --test Y` would resolve features for X's graph
# alone and recompile 30-60 dependencies each time (measured 2026-12-02: six steps, about 6
# minutes of a fresh run), so the steps below run what this built and never build again.
build_all() {
  cargo build --workspace --all-targets &&
    cargo test --workspace --no-run --message-format=json >target/test-executables.jsonl
}

# run_test SECS DIR NAME [ARGS...]: the test executable of DIR/tests/NAME.rs as build_all made
# it (its list: target/test-executables.jsonl), run the way `cargo test` runs it (from the
# package's folder), bounded by SECS. No cargo here: no feature re-resolution, and no wait
# for the build lock a step in front (clippy) holds. Two packages may have a test of the
# same name, so the folder picks one.
run_test() {
  local secs=$1 dir=$2 name=$3 exe
  shift 3
  exe=$(python3 -c '
import json, os, sys
want = os.path.realpath(sys.argv[1])
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") \
            and m["target"]["name"] == sys.argv[2] and "test" in m["target"]["kind"] \
            and os.path.dirname(os.path.realpath(m["manifest_path"])) == want:
        print(m["executable"])' "$root/$dir" "$name" <"$root/target/test-executables.jsonl") ||
    return 1
  [ -n "$exe" ] || { echo "no test executable for $dir/tests/$name.rs"; return 1; }
  (cd "$root/$dir" && timeout -k 10 "$secs" "$exe" "$@")
}

stream_java() {
  # The Java stream client against warren_stream::serve: 1M messages with confirms, re-sent
  # publishing ids deduplicated, all consumed from `first` in order (Deliver v2), an offset
  # stored and read back.
  STREAM_JAVA_COUNT=1000000 run_test 400 gateway-stream java_client --ignored --nocapture
}

stream_java_features() {
  # The Java stream client against `warren serve --stream-tls` (cli/tests/java/
  # StreamFeatures.java): TLS with a verified certificate, a super stream routed by key and
  # by hash and read by a super stream consumer, a filtered consumer.
  run_test 300 cli streams --ignored --nocapture java_client_over_tls_super_streams_and_filtering
}

stream_compare_short() {
  # bench/stream-compare.sh in short mode, Warren only (debug build): streams filled by the
  # Java stream client, consumed from `first` over the stream protocol (Java and Rust clients)
  # and over AMQP (PerfTest and warren-bench), read-ahead off and on; every cell must have its
  # rate and the broker's CPU per message, and the tables and SVG plots must come out.
  local out=target/bench/stream-short
  rm -rf "$out" && mkdir -p "$out" || return 1
  SKIP_BUILD=1 PERFTEST=1 WARREN=target/debug/warren BENCH=target/debug/warren-bench \
    timeout 300 bench/stream-compare.sh --log "$out/run.log" --svg "$out" 2000 12 1,8 >/dev/null &&
    python3 bench/stream-table.py --check "$out/run.log" >/dev/null &&
    ls "$out/amqp091-12.svg" "$out/stream-12.svg"
}

# Every unit and integration test, bounded: a test that waits forever (a broker whose disk
# alarm blocks its publishers, say) ends here with what was running and the free disk,
# well inside CI's 90 minutes, instead of using them up silently.
workspace_tests() {
  local rc=0
  # The netns cluster tests run in steps of their own below, not twice.
  WARREN_CLUSTER_OWN_STEPS=1 timeout -k 30 50m cargo test --workspace || rc=$?
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "cargo test --workspace did not finish within 50 minutes; still running:"
    ps -eo pid,etime,args | grep -E 'warren|target/debug/deps' | grep -v grep | head -40
  fi
  return "$rc"
}

cluster_steps_cover_every_netns_test() {
  # `cargo test --workspace` skips the netns cluster tests (WARREN_CLUSTER_OWN_STEPS): every
  # cluster/tests file that starts a cluster must have a step below, or it would never run.
  local f name missing=0
  for f in cluster/tests/*.rs; do
    grep -q 'Cluster::prepare' "$f" || continue
    name=$(basename "$f" .rs)
    grep -qE -- "run_test [^ ]+ cluster $name\b" scripts/test.sh ||
      { echo "no scripts/test.sh step runs $f"; missing=1; }
  done
  return "$missing"
}

wasm_build() {
  cargo build -p warren-core --target wasm32-unknown-unknown &&
    cargo build -p warren-guest --target wasm32-unknown-unknown --release
}

# `cargo install` of a tool the tests run, built for a short build rather than a fast binary:
# rabbitmqadmin's own release profile asks for fat LTO and one codegen unit (308 s here, and
# 185 s for wasm-bindgen-cli at opt-level 3); config overrides the package's profile.
install_tool() { # crate version
  CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
    CARGO_PROFILE_RELEASE_OPT_LEVEL=1 CARGO_PROFILE_RELEASE_DEBUG=false \
    cargo install "$1" --version "$2"
}

setup_wasm_bindgen() {
  # The CLI must match the wasm-bindgen crate exactly (pinned in wasm/Cargo.toml).
  local want
  want=$(grep -o 'wasm-bindgen = "=[0-9.]*"' wasm/Cargo.toml | grep -o '[0-9][0-9.]*')
  if [ "$(wasm-bindgen --version 2>/dev/null)" = "wasm-bindgen $want" ]; then
    echo "wasm-bindgen $want already installed"
    return 0
  fi
  install_tool wasm-bindgen-cli "$want"
}

setup_rabbitmqadmin() {
  # RabbitMQ's HTTP API client, for cli/tests/rabbitmqadmin.rs: minutes to build here, so
  # installed once and kept (like wasm-bindgen-cli); pinned so its checks do not drift.
  local want=2.35.0
  if [ "$(rabbitmqadmin --version 2>/dev/null)" = "rabbitmqadmin $want" ]; then
    echo "rabbitmqadmin $want already installed"
    return 0
  fi
  install_tool rabbitmqadmin "$want"
}

setup_prometheus() {
  # promtool (`promtool check metrics`) for cli/tests/management.rs; Debian's package also
  # starts a Prometheus server on 9090, which we do not want.
  command -v promtool >/dev/null && { promtool --version | head -1; return 0; }
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -q &&
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q prometheus || return 1
  $sudo service prometheus stop >/dev/null 2>&1 || true
}

setup_binaryen() {
  # wasm-opt (Debian's binaryen): scripts/build-js.sh runs it on the JS package's .wasm
  # (412,947 -> 379,022 bytes on 2026-11-24), as wasm-pack does; the 480 KB gate counts the
  # optimised module, the one the package ships.
  command -v wasm-opt >/dev/null && { wasm-opt --version; return 0; }
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q binaryen
}

setup_chromium() {
  [ -x /usr/bin/chromium ] && { /usr/bin/chromium --version; return 0; }
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium
}

setup_npm() {
  # examples/browser's lockfile: playwright-core (no bundled browsers: it drives Debian's
  # chromium), typescript (checks the generated types), mqtt (MQTT.js: its browser build for
  # the WebSocket test, and a native client), amqplib and rhea (AMQP 1.0, tests/node),
  # fake-indexeddb (IndexedDB for wasm/js/test/persist.test.mjs under Node), ws (the tab
  # link's WebSocket under Node, wasm/js/test/link.test.mjs). npm ci
  # only when something differs.
  if (cd examples/browser && node -e '
    const lock = require("./package-lock.json").packages;
    for (const [path, { version }] of Object.entries(lock)) {
      if (!path) continue;
      let have;
      try { have = require("./" + path + "/package.json").version; } catch { process.exit(1); }
      if (have !== version) process.exit(1);
    }'); then
    echo "examples/browser: node_modules match package-lock.json"
    return 0
  fi
  (cd examples/browser && npm ci --no-audit --no-fund)
}

guest_wasm() {
  local dir
  dir=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])') || return 1
  echo "$dir/wasm32-unknown-unknown/release/warren_guest.wasm"
}

wasm_differential() {
  # Fails loudly (does not skip) when the guest .wasm is missing.
  WARREN_GUEST_WASM=$(guest_wasm) WARREN_DIFF_SEEDS=${WARREN_DIFF_SEEDS:-1000} \
    run_test 600 examples/wasmtime-host differential --ignored --nocapture
}

wasmtime_demo() {
  target/debug/warren-wasmtime-host "$(guest_wasm)"
}

node_tests() {
  # 60 s a test: a promise left pending behind a live handle fails that test by name, and
  # the others still run. link.test.mjs runs the tab link against warren serve (WARREN_BIN).
  local dir
  dir=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])') || return 1
  WARREN_BIN="$dir/debug/warren" node --test --test-timeout=60000 wasm/js/test/
}

ts_types() {
  examples/browser/node_modules/.bin/tsc -p wasm/js/test/tsconfig.json
}

browser_e2e() {
  (cd examples/browser && timeout 120 node e2e.mjs "$root/target/browser-e2e.png")
}

browser_persist_e2e() {
  # The durable broker (Broker.open, IndexedDB) in headless Chromium with a persistent
  # profile: 10,000 persistent messages across a reload (prints the publish rate), a second
  # tab locked out, the browser SIGKILLed mid-write keeps every confirmed publish.
  (cd examples/browser && timeout 300 node persist-e2e.mjs)
}

browser_ws_e2e() {
  # MQTT.js in headless Chromium over warren serve's ws and wss listeners.
  local dir
  dir=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])') || return 1
  (cd examples/browser && WARREN_BIN="$dir/debug/warren" timeout 120 node ws-e2e.mjs "$root/target/browser-ws-e2e.png")
}

browser_link_e2e() {
  # The tab link in headless Chromium: 10,000 messages published while the server is down,
  # forwarded exactly once in order after it starts; an inbox message across an offline drop.
  local dir
  dir=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])') || return 1
  (cd examples/browser && WARREN_BIN="$dir/debug/warren" timeout 180 node link-e2e.mjs "$root/target/browser-link-e2e.png") || return 1
  # Again with the durable store: the outbox is published into IndexedDB, the page reloaded,
  # then the server starts (issue 39's end-to-end check).
  (cd examples/browser && RELOAD=1 WARREN_BIN="$dir/debug/warren" timeout 240 node link-e2e.mjs "$root/target/browser-link-reload-e2e.png")
}

browser_ui_e2e() {
  # The management web UI in headless Chromium: log in, declare, publish, get, rate chart,
  # close a connection; screenshots target/ui-e2e-*.png.
  local dir
  dir=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])') || return 1
  (cd examples/browser && WARREN_BIN="$dir/debug/warren" timeout 120 node ui-e2e.mjs "$root/target/ui-e2e")
}

start_broker() {
  rm -rf target/ci-data
  target/debug/warren serve --amqp "127.0.0.1:$port" --mqtt "127.0.0.1:$mqtt_port" \
    --stream none --management none --prometheus none \
    --data-dir target/ci-data > target/ci-broker.log 2>&1 &
  broker_pid=$!
  local line mline
  for _ in $(seq 1 100); do
    line=$(grep -o "listening on 127.0.0.1:[0-9]* (AMQP" target/ci-broker.log) &&
      mline=$(grep -o "listening on 127.0.0.1:[0-9]* (MQTT" target/ci-broker.log) && {
      line=${line% (AMQP}
      mline=${mline% (MQTT}
      port=${line##*:}
      mqtt_port=${mline##*:}
      echo "warren serve (pid $broker_pid) listening on 127.0.0.1:$port (AMQP), 127.0.0.1:$mqtt_port (MQTT)"
      return 0
    }
    kill -0 "$broker_pid" 2>/dev/null || { cat target/ci-broker.log; return 1; }
    sleep 0.1
  done
  echo "broker did not start listening within 10s"; cat target/ci-broker.log; return 1
}

warren_bench() {
  # warren-bench's own AMQP client against the CI broker, with confirms and acks: messages
  # flow and no client reports an error (no timing thresholds).
  local out
  out=$(timeout 60 target/debug/warren-bench one-fast --seconds 2 --confirm 100 --format json \
    --uri "amqp://guest:guest@127.0.0.1:$port" --broker-pid "$broker_pid") || { echo "$out"; return 1; }
  echo "$out"
  python3 -c '
import json, sys
rows = json.load(sys.stdin)
assert rows, "no result rows"
for r in rows:
    assert r["sent"] > 0 and r["received"] > 0, r
    assert not r["errors"], r["errors"]
print("warren-bench: %d received, no errors" % sum(r["received"] for r in rows))' <<<"$out"
}

python_tests() {
  # test_tls.py starts brokers of its own (WARREN_BIN) with AMQPS/MQTTS and certificates it
  # makes: pika ssl_options, EXTERNAL, paho-mqtt and mosquitto_pub/sub with client certificates.
  # -v and a 60 s bound per test: a test that hangs is named, and the others still run.
  WARREN_AMQP="127.0.0.1:$port" WARREN_MQTT="127.0.0.1:$mqtt_port" \
    WARREN_CTL="$root/target/debug/warren ctl --data-dir $root/target/ci-data" \
    WARREN_BIN="$root/target/debug/warren" \
    timeout 300 "$python" -m pytest -v --timeout 60 tests/python
}

rhea_tests() {
  # rhea (npm, from examples/browser's lockfile), an AMQP 1.0 client, against the CI broker:
  # the management node's link pair, publish and consume within link credit.
  WARREN_AMQP="127.0.0.1:$port" timeout 120 node --test --test-timeout=60000 tests/node/
}

mosquitto_smoke() {
  # QoS 1 and a retained message with Debian's mosquitto_pub/mosquitto_sub, v3.1.1 and v5.
  local v out
  for v in mqttv311 mqttv5; do
    mosquitto_pub -h 127.0.0.1 -p "$mqtt_port" -V "$v" -q 1 -r -t "smoke/$v/retained" -m kept ||
      return 1
    out=$(timeout 10 mosquitto_sub -h 127.0.0.1 -p "$mqtt_port" -V "$v" -q 1 -t "smoke/$v/#" -C 2 -v \
      -W 10 & sleep 0.5; mosquitto_pub -h 127.0.0.1 -p "$mqtt_port" -V "$v" -q 1 -t "smoke/$v/live" -m hello; wait)
    echo "$out"
    grep -qx "smoke/$v/retained kept" <<<"$out" && grep -qx "smoke/$v/live hello" <<<"$out" || {
      echo "mosquitto_sub ($v) did not get both messages"; return 1; }
  done
}

perftest() {
  timeout 300 scripts/perftest.sh "amqp://guest:guest@127.0.0.1:$port" 50000
}

perftest_suite() {
  # RabbitMQ's 14-workload suite, scaled down (700 producers instead of 7000, 100 queues
  # instead of 1000, 5 s each): every workload must complete without errors.
  CTL="target/debug/warren ctl --data-dir target/ci-data" SCALE=0.1 \
    timeout 900 bench/suite.sh 5 "amqp://guest:guest@127.0.0.1:$port"
}

crash_test() {
  # The crash test starts, SIGKILLs and restarts its own broker (fresh data dir, free port);
  # `timeout` is the outer bound, the test's own deadline (CRASH_DEADLINE_SECS) the inner one.
  WARREN_BIN=target/debug/warren CRASH_CYCLES=${CRASH_CYCLES:-20} \
    timeout 180 target/debug/crash-test
}

crash_test_sharded() {
  # The same over two shards (queues spread by name over two message logs, publishers and
  # consumers on both shards).
  WARREN_BIN=target/debug/warren CRASH_CYCLES=${CRASH_CYCLES:-10} CRASH_SERVE_ARGS="--shards 2" \
    CRASH_DATA_DIR=target/crash-data-sharded timeout 180 target/debug/crash-test
}

idle_conns() {
  # Issue 7, bounded: 300 idle MQTT connections (one QoS 1 subscription each) held over
  # sockets through two keep-alive intervals while a live pair measures latency, then 10k
  # in-process connections through the real gateway; every connection must stay alive. No
  # memory or timing thresholds: the debug build on a shared CI machine is no measurement.
  timeout 120 target/debug/warren-bench conns --mqtt "127.0.0.1:$mqtt_port" --pid "$broker_pid" \
    -n 300 --keep-alive 2 --hold 5 --latency-secs 2 --rate 200 --prefix ci-idle- || return 1
  timeout 180 target/debug/warren-bench conns --socketless -n 10000 --keep-alive 600
}

bench_compare() {
  # bench/compare.sh in short mode: every `warren-bench` workload (AMQP and MQTT) against
  # Warren (debug build) and the MQTT ones against Mosquitto 2.0, both started by the script
  # on side ports and stopped after; 1 s each, producers paced at 1000 msg/s (unthrottled
  # publishers fill a debug broker's buffers and starve the next workload). Fails on a client
  # error or a workload that moved nothing; no rate thresholds. RabbitMQ is left out here:
  # with it the run took 91 s (its boot alone 13-30 s), too close to the 2-minute budget to
  # be reliable; `BROKERS="warren rabbitmq mosquitto"` runs it too.
  BROKERS="warren mosquitto" WARREN=target/debug/warren BENCH=target/debug/warren-bench OUT=target/bench/ci-compare \
    timeout 180 bench/compare.sh 1 -- --rate 1000
}

stop_broker() {
  kill -TERM "$broker_pid" || return 1
  # A clean shutdown exits 0 within the drain timeout.
  local code=0
  timeout 15 tail --pid="$broker_pid" -f /dev/null || { echo "broker did not stop on SIGTERM"; return 1; }
  wait "$broker_pid" || code=$?
  broker_pid=""
  grep -q "stopped" target/ci-broker.log || { echo "no clean stop logged"; return 1; }
  return "$code"
}

cluster_script() {
  # Needs root and `ip netns`; REQUIRE makes the test fail rather than skip without them.
  command -v ip >/dev/null || {
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2
  } || return 1
  WARREN_CLUSTER_REQUIRE=1 run_test 300 cluster script
}

cluster_metadata() {
  # The same needs as cluster_script (which installs iproute2 when missing).
  WARREN_CLUSTER_REQUIRE=1 run_test 180 cluster metadata
}

cluster_topic_permissions() {
  # The same needs as cluster_script. Topic permissions set on one node reach every node;
  # a refused bind is refused before it is proposed (cluster/tests/topic_permissions.rs).
  WARREN_CLUSTER_REQUIRE=1 run_test 180 cluster topic_permissions
}

cluster_quorum() {
  # The same needs as cluster_script. Quorum queues replicated over 3 nodes: kill -9 of the
  # leader loses no confirmed message, a member that was down catches up.
  WARREN_CLUSTER_REQUIRE=1 run_test 180 cluster quorum_queues --nocapture
}

cluster_quorum_dlx() {
  # The same needs as cluster_script. At-least-once dead-lettering of a quorum queue over 3
  # nodes (bridge wbd0, 10.90.0.x): dead letters held while unroutable survive a kill -9 of
  # the source's leader; messages expiring while the leader is killed all reach the target.
  WARREN_CLUSTER_REQUIRE=1 run_test 180 cluster quorum_dlx --nocapture
}

cluster_tls() {
  # The same needs as cluster_script. Mutual TLS on the cluster port (WARREN_CLUSTER_TLS_DIR):
  # a quorum queue over 3 nodes works, a plaintext peer is refused and logged.
  WARREN_CLUSTER_REQUIRE=1 run_test 180 cluster cluster_tls --nocapture
}

cluster_quorum_ops() {
  # The same needs as cluster_script. Quorum queues' operations on 3 nodes: declare-ok once
  # the group has a leader (publishes right after it acked), cluster-status and the HTTP API
  # show every group, add-member (snapshot catch-up) / delete-member / grow / shrink.
  WARREN_CLUSTER_REQUIRE=1 run_test 300 cluster quorum_ops --nocapture
}

cluster_routing() {
  # cluster/tests/routing.rs (docs/cluster.md, "Queues live on one node"): a queue on n2 gets
  # n1's and n3's confirmed publishes, MQTT subscribers get publishes from other nodes,
  # locations survive kill -9, a publish to a down node's queue is nacked.
  WARREN_CLUSTER_REQUIRE=1 run_test 180 cluster routing
}

cluster_remote_consumers() {
  # cluster/tests/remote_consumers.rs (docs/cluster.md, "Consumers on any node"): a consumer on
  # n3 of a queue on n2 gets n1's confirmed publishes within its prefetch, requeue, acks,
  # purge/get/passive declare on other nodes act on n2's queue, n3 killed: messages back on n2.
  WARREN_CLUSTER_REQUIRE=1 run_test 180 cluster remote_consumers
}

cluster_edges() {
  # cluster/tests/cluster_edges.rs (docs/cluster.md, "Failure modes users must know"): a
  # queue.delete with if-unused / if-empty on a stub's node is decided by the queue's home
  # (406 as in RabbitMQ, the queue stays everywhere); a classic queue's declare while its home
  # is down fails with 404.
  WARREN_CLUSTER_REQUIRE=1 run_test 180 cluster cluster_edges
}

cluster_quorum_reattach() {
  # cluster/tests/quorum_reattach.rs (bridge wbe1, 10.93.0.x; docs/cluster.md, "Consumers on
  # any node"): a quorum queue's consumer attached again after a partition heals, refused
  # where the queue is served (another exclusive consumer took it), gets basic.cancel.
  WARREN_CLUSTER_REQUIRE=1 run_test 180 cluster quorum_reattach
}

cluster_conditional_delete() {
  # cluster/tests/conditional_delete.rs (bridge wbe1, 10.93.0.x; docs/cluster.md, "Failure
  # modes"): a consumer attaching on the home between a conditional delete's check and its
  # commit (window widened by WARREN_TEST_CONDITIONAL_DELETE_DELAY_MS) does not split the
  # cluster: the queue goes on every node and the consumer gets basic.cancel.
  WARREN_CLUSTER_REQUIRE=1 run_test 180 cluster conditional_delete
}

cluster_quorum_partitions() {
  # cluster/tests/quorum_partitions.rs (bridge wbf0, 10.95.0.x; docs/cluster.md, "Quorum
  # queues", "A leader cut off"): the leader of a quorum queue partitioned away and healed, 5
  # rounds: a publish through the cut-off leader is nacked once its lease is lost, the
  # majority side confirms and delivers, and after the heal every node does, the old leader
  # included, each within a bound tied to the election timeout.
  WARREN_CLUSTER_REQUIRE=1 run_test 300 cluster quorum_partitions --nocapture
}

cluster_quorum_alarm() {
  # cluster/tests/quorum_alarm.rs (bridge wbf1, 10.96.0.x): a quorum queue's leader that
  # loses its leadership with a publish in flight nacks it and raises no store alarm: a
  # classic queue's publisher on that node is confirmed promptly throughout.
  WARREN_CLUSTER_REQUIRE=1 run_test 180 cluster quorum_alarm --nocapture
}

cluster_shovel_placement() {
  # cluster/tests/shovel_placement.rs (bridge wbp0, 10.97.0.x; docs/bridges.md, "Clusters"): a
  # dynamic shovel runs on the metadata leader only (each message moved once, only the leader
  # lists it); after a kill -9 of the leader it resumes on the new one, every confirmed message
  # arriving at least once, none invented.
  WARREN_CLUSTER_REQUIRE=1 run_test 180 cluster shovel_placement --nocapture
}

cluster_shards() {
  # cluster/tests/shards_across_nodes.rs (docs/cluster.md, "Not yet"): two nodes with --shards
  # 2: basic.get across nodes served when the queue, its copy and the connection are on shard
  # 0, refused at once with 540 NOT_IMPLEMENTED otherwise (never a silent wait).
  WARREN_CLUSTER_REQUIRE=1 run_test 180 cluster shards_across_nodes
}

cluster_mqtt_sessions() {
  # cluster/tests/mqtt_sessions.rs (docs/cluster.md, "MQTT sessions across nodes"): a persistent
  # session resumes on another node (session present, subscriptions, queued messages in order),
  # takeover across nodes (0x8E), SIGTERM and kill -9 restarts, expiry, retained messages.
  WARREN_CLUSTER_REQUIRE=1 run_test 180 cluster mqtt_sessions
}

cluster_mqtt_gone_node() {
  # cluster/tests/mqtt_gone_node.rs (bridge wbe1, 10.93.0.x; docs/cluster.md, "MQTT sessions
  # across nodes"): after a kill -9 of a node never restarted, a client that was connected
  # there resumes elsewhere without the 3 s handover wait, and the sessions it owned still
  # expire (the metadata leader ends them; their queues go).
  WARREN_CLUSTER_REQUIRE=1 run_test 180 cluster mqtt_gone_node
}

cluster_jepsen() {
  # cluster/tests/jepsen.rs (docs/cluster.md, "How we test"): confirmed publishers and acking
  # consumers while brokers are killed (-9), paused (SIGSTOP), partitioned and restarted; a
  # checker over the clients' histories (every confirmed message delivered, none invented,
  # per-publisher order). One node and three nodes, each with a durable classic and a quorum
  # queue, and metadata changed on both sides of a partition (about 2.5 min). Each run injects
  # faults for WARREN_JEPSEN_SECS (15 here); the minutes-of-faults run is
  # WARREN_JEPSEN_SECS=300 scripts/test.sh (the bound grows with it).
  local secs=${WARREN_JEPSEN_SECS:-15}
  local bound=$((240 + 6 * secs))
  WARREN_JEPSEN_SECS=$secs WARREN_CLUSTER_REQUIRE=1 run_test "$bound" cluster jepsen --nocapture
}

cluster_lane() {
  # Every netns cluster test, one after another (several share a bridge).
  lane_step "scripts/cluster.sh: 3 nodes in network namespaces, clients on each, kill/start/partition/heal/down" cluster_script || return 1
  lane_step "cluster metadata: declares, users, deletes on any node seen by all; kill -9, partition, restart all" cluster_metadata || return 1
  lane_step "cluster topic permissions: replicated, a refused bind never proposed" cluster_topic_permissions || return 1
  lane_step "cluster quorum queues: confirmed messages survive kill -9 of the leader; a returning member catches up" cluster_quorum || return 1
  lane_step "cluster quorum queues: at-least-once dead letters survive kill -9 of the source's leader" cluster_quorum_dlx || return 1
  lane_step "cluster TLS: a quorum queue over a mutual-TLS cluster port; a plaintext peer refused" cluster_tls || return 1
  lane_step "cluster quorum queue operations: declare-ok after a leader, every group in cluster-status, add/delete member, grow/shrink" cluster_quorum_ops || return 1
  lane_step "cluster routing: classic queues on one node, publishes and MQTT subscriptions across nodes, kill -9, node down" cluster_routing || return 1
  lane_step "cluster consumers on any node: deliveries, prefetch, acks, requeue, purge and get across nodes; consumer's node killed" cluster_remote_consumers || return 1
  lane_step "cluster edges: conditional queue.delete decided by the home node; declare while the home is down" cluster_edges || return 1
  lane_step "cluster quorum consumer attached again after a partition: refused there, cancelled (never silent)" cluster_quorum_reattach || return 1
  lane_step "cluster conditional delete: committed as decided, no split when a consumer attaches meanwhile" cluster_conditional_delete || return 1
  lane_step "cluster with --shards 2: consumers across nodes served on shard 0, refused (540) elsewhere" cluster_shards || return 1
  lane_step "cluster quorum leader partitioned and healed, 5 rounds: nacked when cut off, service back within bounds" cluster_quorum_partitions || return 1
  lane_step "cluster quorum leadership lost with a write in flight: nacked, no store alarm, other publishers unblocked" cluster_quorum_alarm || return 1
  lane_step "cluster dynamic shovel on the metadata leader only: moved once; resumes on the new leader after kill -9" cluster_shovel_placement || return 1
  lane_step "cluster MQTT sessions: one session per client id across nodes, takeover 0x8E, restarts, expiry, retained messages" cluster_mqtt_sessions || return 1
  lane_step "cluster MQTT sessions of a dead node: resumed elsewhere at once, expired on time by the metadata leader" cluster_mqtt_gone_node || return 1
  lane_step "jepsen-style: confirmed messages under kill -9, SIGSTOP, partitions, restarts (1 and 3 nodes); metadata converges after a partition" cluster_jepsen || return 1
}

step "install: rustfmt, clippy, wasm32 target" setup_toolchain
step "install: Python clients (pika, paho-mqtt, rabbitmq-amqp-python-client, pytest)" setup_python
step "install: mosquitto, mosquitto-clients, openssl (Debian)" setup_mosquitto_clients
step "install: RabbitMQ 3.10 (Debian), the shovel migration test's peer" setup_rabbitmq
step "install: RabbitMQ PerfTest (Maven Central)" setup_perftest
step "install: RabbitMQ Java stream client (Maven Central)" setup_stream_java
step "install: wasm-bindgen-cli (pinned to the crate)" setup_wasm_bindgen
step "install: rabbitmqadmin 2.x (RabbitMQ's HTTP API client, cached)" setup_rabbitmqadmin
step "install: promtool (Debian's prometheus)" setup_prometheus
step "install: wasm-opt (Debian's binaryen)" setup_binaryen
step "install: chromium (Debian)" setup_chromium
step "install: playwright-core, typescript (npm ci)" setup_npm
step "every netns cluster test has a step of its own" cluster_steps_cover_every_netns_test
step "cargo fmt --check" cargo fmt --all -- --check
step "cargo build --workspace --all-targets (every later step runs what it built)" build_all
step "cargo test --workspace" workspace_tests
step "cluster tests over network namespaces: started beside the next steps" lane_start target/cluster-lane.log cluster_lane
step "cargo clippy -D warnings" cargo clippy --workspace --all-targets -- -D warnings
step "core and guest module build for wasm32-unknown-unknown" wasm_build
step "stream protocol: RabbitMQ Java stream client, 1M messages" stream_java
step "stream protocol: Java client over TLS, super streams, filtering" stream_java_features
step "wasmtime: native vs wasm differential (seeded scenarios)" wasm_differential
step "wasmtime: host example" wasmtime_demo
step "JS package: wasm-bindgen build, size <= 480 KB" scripts/build-js.sh
step "JS package: Node tests" node_tests
step "JS package: TypeScript types check" ts_types
step "browser: end to end in headless Chromium (screenshot: target/browser-e2e.png)" browser_e2e
step "browser: the durable broker (IndexedDB) across a reload and a killed browser" browser_persist_e2e
step "browser: MQTT.js over ws and wss in headless Chromium (screenshot: target/browser-ws-e2e.png)" browser_ws_e2e
step "browser: the tab link to warren serve in headless Chromium (offline outbox, across a reload from IndexedDB; inbox across a network drop)" browser_link_e2e
step "browser: the management web UI in headless Chromium (screenshots: target/ui-e2e-*.png)" browser_ui_e2e
step "cluster tests over network namespaces (run beside the steps above; log: target/cluster-lane.log)" lane_join
step "bench/stream-compare.sh short: seed 003's grid on 2 cells, Warren over both protocols, tables and plots" stream_compare_short
step "start warren serve" start_broker
step "warren-bench one-fast (2 s, confirms): messages flow, no errors" warren_bench
step "Python tests (pika, paho-mqtt, RabbitMQ's AMQP 1.0 client; over TLS with mosquitto_pub/sub too)" python_tests
step "rhea (npm, AMQP 1.0) against warren serve" rhea_tests
step "mosquitto_pub/mosquitto_sub smoke test" mosquitto_smoke
step "RabbitMQ PerfTest: 1 producer, 1 consumer, confirms and acks" perftest
step "RabbitMQ PerfTest: the 14-workload suite (scaled down)" perftest_suite
step "idle connections: 300 over sockets, 10k socketless, all stay alive" idle_conns
step "clean shutdown on SIGTERM" stop_broker
step "bench/compare.sh short: warren-bench against Warren and Mosquitto, no errors" bench_compare
step "crash test: SIGKILL and restart under confirmed publishing, ${CRASH_CYCLES:-20} cycles" crash_test
step "crash test over two shards: SIGKILL and restart, ${CRASH_CYCLES:-10} cycles" crash_test_sharded
echo
echo "steps: $passed passed, 0 failed"
