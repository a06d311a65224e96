#!/usr/bin/env bash
# Installs what building the host needs beyond Rust, when missing (idempotent): libclang for
# bindgen and a C compiler for libpg_query (the `pg_query` crate: PostgreSQL's own parser, used
# by the SQL gate). Called by the scripts that build the host.
set -euo pipefail
missing=()
command -v cc >/dev/null || missing+=(build-essential)
# bindgen loads libclang at build time.
ls /usr/lib/llvm-*/lib/libclang.so* /usr/lib/*/libclang-[0-9]*.so* >/dev/null 2>&1 \
  || missing+=(libclang-dev)
[ ${#missing[@]} -eq 0 ] && exit 0
command -v apt-get >/dev/null || {
  echo "ensure-build-deps: missing ${missing[*]} and no apt-get: install them (libclang, a C compiler)" >&2
  exit 1
}
echo "== installing ${missing[*]} (to build the host's SQL parser)"
"$(dirname "$0")/apt-install.sh" "${missing[@]}"
