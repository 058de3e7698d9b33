#!/usr/bin/env bash
# Runs Eclipse paho.mqtt.testing's interoperability suites (client_test.py, MQTT 3.1.1, and
# client_test5.py, MQTT 5) against a fresh `warren serve`, with the topic permission the
# suites expect of their broker: `test/nosubscribe` may not be subscribed to. Not in CI (the
# suite is not on PyPI); docs/status.md has the last counts.
#
#   scripts/paho-interop.sh PATH/TO/paho.mqtt.testing/interoperability [PORT]
#
# Uses target/debug/warren (cargo build -p warren-cli) unless WARREN_BIN says otherwise.
set -euo pipefail
suite=${1:?usage: $0 INTEROPERABILITY_DIR [PORT]}
port=${2:-1883}
bin=${WARREN_BIN:-$(dirname "$0")/../target/debug/warren}
dir=$(mktemp -d)
"$bin" serve --data-dir "$dir" --amqp 127.0.0.1:0 --mqtt "127.0.0.1:$port" --management none \
  --prometheus none --stream none --mqtt-server-keep-alive 60 >"$dir/serve.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 50); do [ -S "$dir/warren.sock" ] && break; sleep 0.1; done
# Every key but `test.nosubscribe` (the filter's AMQP form): Warren's regexes have no
# look-ahead, so the pattern is its proper prefixes, each divergence, and its extensions.
read=$(python3 - <<'PY'
import re
s = "test.nosubscribe"
e = lambda x: re.sub(r"([.^$*+?()\[\]{}|\\])", r"\\\1", x)
parts = ["^$"] + ["^" + e(s[:i]) + "$" for i in range(1, len(s))]
parts += ["^" + e(s[:i]) + "[^" + e(s[i]) + "]" for i in range(len(s))] + ["^" + e(s) + "."]
print("|".join(parts))
PY
)
# The suites connect without credentials: as guest.
"$bin" ctl --data-dir "$dir" set-topic-permissions guest amq.topic '.*' "$read"
cd "$suite"
# client_test.py's own option parsing takes -h for --help, and unittest then reads argv.
python3 - "$port" <<'PY' || true
import os, runpy, sys, unittest
sys.path.insert(0, os.getcwd())
run = unittest.main
unittest.main = lambda *a, **k: run(*a, argv=["client_test.py"], exit=False, **k)
sys.argv = ["client_test.py", "--hostname=127.0.0.1", "--port=" + sys.argv[1]]
runpy.run_path("client_test.py", run_name="__main__")
PY
python3 client_test5.py -p "$port" || true
