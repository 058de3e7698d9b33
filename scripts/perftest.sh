#!/usr/bin/env bash
# Runs RabbitMQ PerfTest (the Java client's benchmark tool, pinned in scripts/perftest/pom.xml,
# fetched from Maven Central into target/perftest/lib) against a broker for a bounded run:
# 1 producer, 1 consumer, publisher confirms (at most 100 outstanding), consumer acks (no -a),
# a fixed message count. Fails unless PerfTest finished without an error, every published
# message was confirmed (none nacked, none outstanding) and the consumer received exactly as
# many messages as were confirmed. Prints the rates.
#   scripts/perftest.sh [URI] [MESSAGES]
# PERFTEST_JAVA_OPTS and PERFTEST_ARGS add JVM options and PerfTest flags, e.g. for amqps://
# with a CA the JVM trusts: PERFTEST_JAVA_OPTS="-Djavax.net.ssl.trustStore=ca.p12
# -Djavax.net.ssl.trustStorePassword=..." PERFTEST_ARGS=--use-default-ssl-context (without
# it PerfTest trusts any certificate and warns, which fails this script).
set -euo pipefail
cd "$(dirname "$0")/.."
uri=${1:-amqp://guest:guest@127.0.0.1:5672}
count=${2:-50000}
lib=target/perftest/lib
if ! ls "$lib"/perf-test-*.jar >/dev/null 2>&1; then
  echo "fetching RabbitMQ PerfTest and its dependencies from Maven Central..."
  mvn -q -B -Dstyle.color=never -f scripts/perftest/pom.xml dependency:copy-dependencies \
    -DoutputDirectory="$PWD/$lib"
fi
mkdir -p target/perftest
log=target/perftest/ci-run.log
# -C/-D bound the run by count, -z by time (a stuck broker fails instead of hanging). The
# producer's debug log says how many confirms were still outstanding when it stopped.
RABBITMQ_PERF_TEST_LOGGERS=com.rabbitmq.perf.Producer=debug \
  java ${PERFTEST_JAVA_OPTS:-} -cp "$lib/*" com.rabbitmq.perf.PerfTest --uri "$uri" ${PERFTEST_ARGS:-} \
  -x 1 -y 1 -s 100 -c 100 -q 0 -C "$count" -D "$count" -z 120 --confirm-timeout 20 --id ci \
  2>&1 | tee "$log"

fail() {
  echo "perftest: FAILED: $* (full output in $log)" >&2
  exit 1
}
if grep -E "ERROR|WARN|[Ee]xception|Error in producer|Error while" "$log"; then
  fail "PerfTest reported errors"
fi
grep -q "test stopped (Producer reached message limit, Consumer reached message limit)" "$log" ||
  fail "producer and consumer did not both stop on their $count-message limits"
published=$(sed -n 's/.*Producer reached message limit of \([0-9]*\).*/\1/p' "$log" | tail -1)
unconfirmed=$(sed -n 's/.*Unconfirmed message(s): \([0-9]*\).*/\1/p' "$log" | tail -1)
[ "${published:-}" = "$count" ] || fail "producer published ${published:-?} messages, expected $count"
[ "${unconfirmed:-}" = "0" ] || fail "${unconfirmed:-?} publishes still unconfirmed when the producer stopped"
if grep -oE "nacked: [0-9.]+ msg/s" "$log" | grep -vqE "nacked: 0 msg/s"; then
  fail "the broker nacked publishes"
fi
confirmed=$((published - unconfirmed))
# The consumer stops after exactly -D deliveries, each acked.
received=$count
[ "$received" = "$confirmed" ] || fail "received $received != confirmed $confirmed"
sent_rate=$(sed -n 's/.*sending rate avg: \([0-9]*\) msg\/s.*/\1/p' "$log" | tail -1)
recv_rate=$(sed -n 's/.*receiving rate avg: \([0-9]*\) msg\/s.*/\1/p' "$log" | tail -1)
echo "perftest: ok: published $published, confirmed $confirmed, received $received (acked), 0 errors; avg sent ${sent_rate:-?} msg/s, avg received ${recv_rate:-?} msg/s"
