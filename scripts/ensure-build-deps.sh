#!/usr/bin/env bash
# Installs what building the host and the plugins needs beyond Rust, when missing (idempotent):
# libclang for bindgen and a C compiler for libpg_query (the `pg_query` crate: PostgreSQL's own
# parser, used by the SQL gate); Python with venv and pip (the Python plugin toolchain, and the
# pinned server wheels of scripts/servers.sh) and npm (the JavaScript plugin toolchain). The C
# plugin toolchain is installed by scripts/build-plugins.sh. Called by the scripts that build.
set -euo pipefail
missing=()
command -v cc >/dev/null || missing+=(build-essential)
# bindgen loads libclang at build time.
ls /usr/lib/llvm-*/lib/libclang.so* /usr/lib/*/libclang-[0-9]*.so* >/dev/null 2>&1 \
  || missing+=(libclang-dev)
command -v python3 >/dev/null || missing+=(python3)
python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
command -v npm >/dev/null || missing+=(npm)
[ ${#missing[@]} -eq 0 ] && exit 0
command -v apt-get >/dev/null || {
  echo "ensure-build-deps: missing ${missing[*]} and no apt-get: install them (libclang, a C compiler, python3 with venv and pip, npm)" >&2
  exit 1
}
echo "== installing ${missing[*]} (to build the host's SQL parser and the plugins)"
"$(dirname "$0")/apt-install.sh" "${missing[@]}"
