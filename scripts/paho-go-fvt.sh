#!/usr/bin/env bash
# Runs eclipse/paho.mqtt.golang's functional tests (fvt_client_test.go, MQTT 3.1.1 against a
# real broker, with the package's unit tests) against one `warren serve`, twice, with a
# kill -9 restart on the same data dir between the runs. Not in CI (the suite is another
# project's checkout, brought by hand); docs/status.md has the last counts and Mosquitto
# 2.0.11's beside them.
#
#   scripts/paho-go-fvt.sh PAHO_MQTT_GOLANG_DIR
#
# Port 1900 unless MQTT_PORT says otherwise; target/release/warren unless WARREN_BIN does.
# The suite is edited in place, idempotently: its broker port (1883, fixed in fvt_test.go)
# comes from TEST_FVT_PORT. Its SSL and WebSocket tests need listeners it sets up itself.
set -euo pipefail
dir=$(cd "${1:?usage: $0 PAHO_MQTT_GOLANG_DIR}" && pwd)
port=${MQTT_PORT:-1900}
bin=$(readlink -f "${WARREN_BIN:-$(dirname "$0")/../target/release/warren}")
data=$(mktemp -d)
pid=

start() {
  "$bin" serve --data-dir "$data" --amqp none --mqtt "127.0.0.1:$port" --stream none \
    --management none --prometheus none >>"$data/serve.log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && return
    sleep 0.1
  done
  echo "warren did not listen on $port; see $data/serve.log" >&2
  exit 1
}
trap 'kill "$pid" 2>/dev/null || true; echo "logs in $data"' EXIT

sed -i 's|FVTTCP = "tcp://" + FVTAddr + ":1883"|FVTTCP = "tcp://" + FVTAddr + ":" + os.Getenv("TEST_FVT_PORT")|' \
  "$dir/fvt_test.go"
start
for run in 1 2; do
  (cd "$dir" && TEST_FVT_PORT=$port timeout 600 go test -count=1 -timeout 550s -v -run Test . \
    >"$data/run-$run.log" 2>&1) || true
  echo "run $run: $(grep -cE '^\s*--- PASS' "$data/run-$run.log") pass," \
    "$(grep -cE '^\s*--- FAIL' "$data/run-$run.log") fail; $(tail -1 "$data/run-$run.log")"
  grep -E '^\s*--- FAIL' "$data/run-$run.log" || true
  kill -9 "$pid"
  wait "$pid" 2>/dev/null || true
  start
done
