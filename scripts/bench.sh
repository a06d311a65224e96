#!/usr/bin/env bash
# The side-by-side benchmark: builds the host (release) and the plugins, then runs
# `idemhost bench` against the local PostgreSQL and NATS — the host with the WASM plugin, the
# native handler and group commit at 1, 4 and 16, pgbench with the seed's transaction at the same
# client counts, the seed's Node consumer when `node` is installed, a paced latency run and 8
# consumers for memory. Every host run is verified by SQL. Options pass through
# (`scripts/bench.sh --n 5000 --duplicates 0.2`; `--help` lists them). A few minutes here.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/ensure-build-deps.sh
TARGET=$(scripts/target-dir.sh)
scripts/build-plugins.sh rust >/dev/null
cargo build --quiet --release -p idemhost-cli --features bench
exec "$TARGET"/release/idemhost bench "$@"
