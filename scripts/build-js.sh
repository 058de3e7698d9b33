#!/usr/bin/env bash
# Builds the npm package in wasm/js: the warren-wasm crate for wasm32 (size-optimised
# profile), then the JS glue and TypeScript types with wasm-bindgen-cli (whose version must
# equal the wasm-bindgen crate's, pinned in wasm/Cargo.toml). Fails if the .wasm exceeds
# 480 KB, issue 39's budget (473,531 bytes on 2026-12-01 with runtime parameters and
# sub-batch-aware streams in the core; 460 KB until then, 400 KB until stream and quorum queues and the AMQP 1.0 codec of stream messages
# came into the core on 2026-11-24; the node link's code is left out of it by the core's
# `nodes`, `topic-permissions` and `notices` features, off here: 470,994 bytes on 2026-11-25,
# docs/status.md; 502,398 with delayed delivery and the AMQP 1.0 type system in the core, and
# 479,768 on 2026-12-03 with the core's `delayed` feature off here too; 510,057 with the
# browser store (wasm/src/idb_store.rs), 474,997 with it and the core's `streams` and
# `quorum` features off here as well). wasm-opt is used when it is on PATH
# (optional).
#   scripts/build-js.sh
set -euo pipefail
cd "$(dirname "$0")/.."
want=$(grep -o 'wasm-bindgen = "=[0-9.]*"' wasm/Cargo.toml | grep -o '[0-9][0-9.]*')
have=$(wasm-bindgen --version 2>/dev/null | awk '{print $2}' || true)
if [ "$have" != "$want" ]; then
  echo "wasm-bindgen-cli $want needed (found: ${have:-none}): cargo install wasm-bindgen-cli --version $want" >&2
  exit 1
fi
cargo build -p warren-wasm --target wasm32-unknown-unknown --profile wasm-release
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
module="$target_dir/wasm32-unknown-unknown/wasm-release/warren_wasm.wasm"
if command -v wasm-opt >/dev/null; then
  # Before wasm-bindgen, not after: Debian's binaryen 108 breaks the table of the glue's
  # output (Node: "WebAssembly.Table.set(): Argument 1 is invalid for table").
  mkdir -p "$target_dir/wasm-opt"
  wasm-opt -Oz --enable-reference-types --enable-bulk-memory --enable-nontrapping-float-to-int \
    --enable-sign-ext --enable-mutable-globals -o "$target_dir/wasm-opt/warren_wasm.wasm" "$module"
  module="$target_dir/wasm-opt/warren_wasm.wasm"
fi
rm -rf wasm/js/dist
wasm-bindgen --target web --remove-name-section --remove-producers-section --out-dir wasm/js/dist \
  "$module"
wasm=wasm/js/dist/warren_wasm_bg.wasm
raw=$(wc -c < "$wasm")
gz=$(gzip -9c "$wasm" | wc -c)
echo "warren_wasm_bg.wasm: $raw bytes raw, $gz bytes gzipped"
if [ "$raw" -gt 491520 ]; then
  echo "the .wasm exceeds 480 KB" >&2
  exit 1
fi
