#!/usr/bin/env bash
# What a hot swap costs under load (release build): the host drains N OrderPlaced events and,
# a third of the way in, swaps its inventory plugin through the admin API — Rust to Rust (a
# different build: the cheapest swap) and Rust to Python (18 MB, compiled cold). Prints the
# validation time, the swap latency and the throughput before, during and after each swap,
# with every message's effect verified by SQL. Not a test: figures vary run to run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/ensure-build-deps.sh
TARGET=$(scripts/target-dir.sh)
N=${N:-20000}
scripts/build-plugins.sh rust py c >/dev/null
cargo build --quiet --release -p idemhost-bench --example swap
"$TARGET"/release/examples/swap --n "$N" --from inventory --to inventory-c
# Python compiles for seconds: enough messages must remain to see the swap land.
"$TARGET"/release/examples/swap --n "${N_PY:-60000}" --from inventory --to inventory-py
"$TARGET"/release/examples/swap --n "$N" --from inventory --to inventory-py --cached
