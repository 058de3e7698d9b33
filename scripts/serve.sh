#!/usr/bin/env bash
# Builds and runs the broker with its defaults: AMQP on 127.0.0.1:5672, data in ./warren-data.
# Extra arguments go to `warren serve` (see `warren serve --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo run --release -p warren-cli -- serve "$@"
