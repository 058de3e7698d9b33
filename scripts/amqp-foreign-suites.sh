#!/usr/bin/env bash
# Runs two other projects' AMQP test suites against one long-running `warren serve`,
# restarting it between runs (SIGTERM, then kill -9) on the same data dir:
# rabbitmq/amqp091-go's integration tests (`go test -tags integration`) and pika's acceptance
# tests (`pytest tests/acceptance`). Not in CI (the suites are other projects' checkouts,
# brought by hand); docs/status.md has the last counts and RabbitMQ 3.10.8's beside them.
#
#   scripts/amqp-foreign-suites.sh AMQP091_GO_DIR PIKA_DIR
#
# Ports 5700 (AMQP) and 15700 (HTTP API) unless AMQP_PORT / MGMT_PORT say otherwise. Uses
# target/release/warren unless WARREN_BIN says otherwise. pika's tests need pytest,
# pytest-timeout, gevent, tornado and twisted.
#
# The suites are edited in place, idempotently, only where they assume RabbitMQ on its
# default ports or by product name:
# - pika: the hard-coded 5672 comes from $AMQP_PORT;
# - amqp091-go: the management port 15672 comes from $MGMT_PORT; the three
#   `product == "RabbitMQ"` guards also take "Warren" and close their connection otherwise
#   (it leaked, and goleak failed the run); TestIntegrationConsumeFlow checks the error of
#   channel.flow(false) for nil before its type (it panicked: RabbitMQ answers 540, Warren
#   implements client flow).
set -euo pipefail
go_dir=$(cd "${1:?usage: $0 AMQP091_GO_DIR PIKA_DIR}" && pwd)
pika_dir=$(cd "${2:?usage: $0 AMQP091_GO_DIR PIKA_DIR}" && pwd)
amqp_port=${AMQP_PORT:-5700}
mgmt_port=${MGMT_PORT:-15700}
bin=$(readlink -f "${WARREN_BIN:-$(dirname "$0")/../target/release/warren}")
data=$(mktemp -d)
log=$data/serve.log
pid=

start() {
  "$bin" serve --data-dir "$data" --amqp "127.0.0.1:$amqp_port" --mqtt none --stream none \
    --management "127.0.0.1:$mgmt_port" --prometheus none >>"$log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$amqp_port") 2>/dev/null && return
    sleep 0.1
  done
  echo "warren did not listen on $amqp_port; see $log" >&2
  exit 1
}
stop() { # SIGNAL
  kill "-$1" "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}
trap 'stop TERM; echo "broker log: $log"' EXIT

patch_suites() {
  grep -rl "port=5672\|{'port': 5672}" "$pika_dir/tests/acceptance" "$pika_dir/tests/base" |
    xargs -r sed -i "s/port=5672/port=int(__import__('os').environ.get('AMQP_PORT','5672'))/;
      s/{'port': 5672}/{'port': int(__import__('os').environ.get('AMQP_PORT','5672'))}/"
  local http=$go_dir/internal/utils/http.go
  if ! grep -q MgmtPort "$http"; then
    sed -i 's|"http://localhost:15672/api/connections/"|"http://localhost:"+MgmtPort()+"/api/connections/"|
      s|^\t"net/http"|\t"net/http"\n\t"os"|' "$http"
    printf '\nfunc MgmtPort() string {\n\tif p := os.Getenv("MGMT_PORT"); p != "" {\n\t\treturn p\n\t}\n\treturn "15672"\n}\n' >>"$http"
  fi
  sed -i 's|"15672")|utils.MgmtPort())|' "$go_dir/recovery_test.go"
  python3 - "$go_dir/integration_test.go" <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
for old, new in [
    ('if err := sub.Flow(false); err.(*Error).Code == NotImplemented {',
     'if err := sub.Flow(false); err != nil && err.(*Error).Code == NotImplemented {'),
    ('''		if server, ok := conn.Properties["product"]; ok && server == "RabbitMQ" {
			return conn
		}
''', '''		if server, ok := conn.Properties["product"]; ok && (server == "RabbitMQ" || server == "Warren") {
			return conn
		}
		_ = conn.Close()
'''),
    ('''		if product, ok := c.Properties["product"]; ok && product.(string) == "RabbitMQ" {''',
     '''		defer c.Close()
		if product, ok := c.Properties["product"]; ok && (product.(string) == "RabbitMQ" || product.(string) == "Warren") {'''),
]:
    s = s.replace(old, new)
open(p, "w").write(s)
PY
}

go_suite() {
  (cd "$go_dir" && AMQP_URL="amqp://guest:guest@127.0.0.1:$amqp_port/" MGMT_PORT=$mgmt_port \
    timeout 900 go test -tags integration -count=1 -timeout 850s -v . >"$data/go-$1.log" 2>&1) || true
  echo "amqp091-go run $1: $(grep -cE '^\s*--- PASS' "$data/go-$1.log") pass," \
    "$(grep -cE '^\s*--- FAIL' "$data/go-$1.log") fail, $(grep -cE '^\s*--- SKIP' "$data/go-$1.log") skip;" \
    "goleak: $(grep -c 'goleak: Errors' "$data/go-$1.log"); $(tail -1 "$data/go-$1.log")"
  grep -E '^\s*--- FAIL' "$data/go-$1.log" || true
}

pika_suite() {
  (cd "$pika_dir" && AMQP_PORT=$amqp_port timeout 900 python3 -m pytest -p no:cacheprovider \
    tests/acceptance --timeout 60 >"$data/pika-$1.log" 2>&1) || true
  echo "pika run $1: $(tail -1 "$data/pika-$1.log")"
  grep '^FAILED' "$data/pika-$1.log" || true
}

patch_suites
start
go_suite 1
stop TERM; start
pika_suite 1
stop KILL; start
go_suite 2
stop TERM; start
pika_suite 2
echo "logs in $data"
