#!/usr/bin/env bash
# TLS and WebSocket against plain, one broker with all six listeners (docs/benchmarks.md,
# "TLS and WebSocket against plain"): warren-bench one-fast over amqp/amqps, PerfTest plain
# and TLS, warren-bench mqtt-qos0/mqtt-qos1 over mqtt/mqtts/ws/wss, then handshakes per
# second. Certificates are made here (openssl: ECDSA P-256; keytool: PerfTest's trust store).
#   bench/tls-compare.sh [SECONDS]     (env: WARREN, BENCH, PORT (base, 6 ports), OUT)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-5}
warren=${WARREN:-target/release/warren}
bench=${BENCH:-target/release/warren-bench}
port=${PORT:-26001}
out=${OUT:-target/bench/tls-compare}
mkdir -p "$out"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
  -keyout "$out/server.key" -out "$out/server.pem" -subj /CN=localhost \
  -addext subjectAltName=DNS:localhost,IP:127.0.0.1 2>/dev/null
rm -f "$out/ca.p12"
keytool -importcert -noprompt -alias warren -file "$out/server.pem" -keystore "$out/ca.p12" \
  -storetype PKCS12 -storepass changeit >/dev/null 2>&1
p() { echo $((port + $1)); }
rm -rf "$out/data"
"$warren" serve --in-memory --data-dir "$out/data" --amqp "127.0.0.1:$(p 0)" \
  --amqps "127.0.0.1:$(p 1)" --mqtt "127.0.0.1:$(p 2)" --mqtts "127.0.0.1:$(p 3)" \
  --mqtt-ws "127.0.0.1:$(p 4)" --mqtt-wss "127.0.0.1:$(p 5)" \
  --management none --prometheus none --stream none \
  --tls-cert "$out/server.pem" --tls-key "$out/server.key" > "$out/broker.log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
sleep 1
echo "## warren-bench one-fast (AMQP, ${secs}s each)"
for u in "amqp://guest:guest@127.0.0.1:$(p 0)" "amqps://guest:guest@localhost:$(p 1)"; do
  echo "# $u"; "$bench" one-fast --seconds "$secs" --uri "$u" --broker-pid $pid | tail -1
done
echo "## PerfTest -x 1 -y 1 (${secs}s each)"
lib=target/perftest/lib
java -cp "$lib/*" com.rabbitmq.perf.PerfTest -h "amqp://guest:guest@127.0.0.1:$(p 0)" \
  -x 1 -y 1 -z "$secs" 2>&1 | grep -E "rate avg" | sed 's/^/plain /'
java -Djavax.net.ssl.trustStore="$out/ca.p12" -Djavax.net.ssl.trustStorePassword=changeit \
  -cp "$lib/*" com.rabbitmq.perf.PerfTest -h "amqp://guest:guest@localhost:$(p 1)" -udsc \
  -x 1 -y 1 -z "$secs" 2>&1 | grep -E "rate avg|rror" | sed 's/^/tls /'
echo "## MQTT (${secs}s each)"
for w in mqtt-qos0 mqtt-qos1; do
  for m in "mqtt://127.0.0.1:$(p 2)" "mqtts://localhost:$(p 3)" "ws://127.0.0.1:$(p 4)/mqtt" \
    "wss://localhost:$(p 5)/mqtt"; do
    echo "# $w $m"; "$bench" "$w" --seconds "$secs" --mqtt "$m" --broker-pid $pid | tail -1
  done
done
echo "## connections per second (3 s each, 4 clients)"
"$bench" handshakes --seconds 3 --concurrency 4 --broker-pid $pid \
  --uri "amqp://guest:guest@127.0.0.1:$(p 0)" --uri "amqps://guest:guest@localhost:$(p 1)" \
  --mqtt "mqtt://127.0.0.1:$(p 2)" --mqtt "mqtts://localhost:$(p 3)" \
  --mqtt "ws://127.0.0.1:$(p 4)/mqtt" --mqtt "wss://localhost:$(p 5)/mqtt"
