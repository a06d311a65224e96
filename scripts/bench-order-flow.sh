#!/usr/bin/env bash
# The order flow's end-to-end rate and the outbox relay's lag (bench/examples/order_flow_bench.rs):
# N orders through the example's six consumers in one release-built host. Not a test: figures
# vary ±15% run to run on this machine.
#
#   scripts/bench-order-flow.sh                 # N=2000, IN_FLIGHT=8
#   N=5000 IN_FLIGHT=16 scripts/bench-order-flow.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/ensure-build-deps.sh
TARGET=$(scripts/target-dir.sh)
scripts/build-plugins.sh rust py >/dev/null
cargo build --quiet --release -p idemhost-bench --example order_flow_bench
"$TARGET"/release/examples/order_flow_bench --n "${N:-2000}" --in-flight "${IN_FLIGHT:-8}"
