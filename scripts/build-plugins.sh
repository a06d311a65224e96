#!/usr/bin/env bash
# Builds every guest plugin for wasm32-wasip2 (installing the target if needed) and prints
# where the components are. Used by the demo, the tests and CI.
set -euo pipefail
cd "$(dirname "$0")/.."
rustup target list --installed | grep -qx wasm32-wasip2 || rustup target add wasm32-wasip2
cargo build --quiet --release --target wasm32-wasip2 --manifest-path plugins/Cargo.toml
for w in plugins/target/wasm32-wasip2/release/*.wasm; do
  printf '%s %s bytes\n' "$w" "$(stat -c %s "$w")"
done
