#!/usr/bin/env bash
# Runs RabbitMQ PerfTest (Java client, from Maven Central) against a broker for a bounded run:
# 1 producer, 1 consumer, publisher confirms, consumer acks, a fixed message count. Fails unless
# PerfTest finished without error and the consumer received every confirmed message.
#   scripts/perftest.sh [URI] [MESSAGES]
set -euo pipefail
cd "$(dirname "$0")/.."
uri=${1:-amqp://guest:guest@127.0.0.1:5672}
count=${2:-20000}
lib=target/perftest/lib
if ! ls "$lib"/perf-test-*.jar >/dev/null 2>&1; then
  echo "fetching RabbitMQ PerfTest and its dependencies from Maven Central..."
  mvn -q -B -Dstyle.color=never -f scripts/perftest/pom.xml dependency:copy-dependencies -DoutputDirectory="$PWD/$lib"
fi
log=target/perftest/ci-run.log
# -C/-D bound the run by count, -z by time (a stuck broker fails instead of hanging).
java -cp "$lib/*" com.rabbitmq.perf.PerfTest --uri "$uri" \
  -x 1 -y 1 -s 100 -c 100 -q 0 -C "$count" -D "$count" -z 120 --confirm-timeout 20 --id ci 2>&1 | tee "$log"
if grep -qiE "exception|error" "$log"; then
  echo "perftest: errors in the PerfTest output (see $log)" >&2
  exit 1
fi
# Both sides must stop on their count: the producer after $count confirmed publishes (a
# missing confirm fails the run through --confirm-timeout), the consumer after $count
# deliveries.
grep -q "Producer reached message limit" "$log" && grep -q "Consumer reached message limit" "$log" || {
  echo "perftest: producer and consumer did not both reach $count messages (see $log)" >&2
  exit 1
}
sent=$(grep "sending rate avg" "$log" | grep -o "[0-9]* msg/s" | grep -o "[0-9]*")
recv=$(grep "receiving rate avg" "$log" | grep -o "[0-9]* msg/s" | grep -o "[0-9]*")
echo "perftest: $count messages published with confirms and consumed with acks; avg sent $sent msg/s, received $recv msg/s"
