#!/usr/bin/env bash
# Prints cargo's target directory for a manifest (default: the workspace's), honouring
# CARGO_TARGET_DIR and .cargo/config — scripts must not assume `target/`.
#   scripts/target-dir.sh [path/to/Cargo.toml]
set -euo pipefail
cargo metadata --format-version 1 --no-deps --manifest-path "${1:-Cargo.toml}" |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])'
