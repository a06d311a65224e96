#!/usr/bin/env bash
# Installs what a static build (x86_64-unknown-linux-musl) needs, when missing (idempotent):
# musl-tools (musl-gcc, for ring's and libpg_query's C) and the Rust target. Used by
# scripts/build-image.sh and by scripts/test.sh, whose suite is built for that target.
set -euo pipefail
command -v musl-gcc >/dev/null || {
  echo "== installing musl-tools (static builds: the C of ring and libpg_query)"
  "$(dirname "$0")/apt-install.sh" musl-tools
}
# bindgen (libpg_query's bindings) asks the clang program for its own headers (stdbool.h); for
# the musl target libclang alone does not find them.
command -v clang >/dev/null || {
  echo "== installing clang (bindgen's headers for the static build)"
  "$(dirname "$0")/apt-install.sh" clang
}
rustup target list --installed | grep -qx x86_64-unknown-linux-musl \
  || rustup target add x86_64-unknown-linux-musl
