#!/usr/bin/env bash
# Compares plain and pinned Python and JavaScript plugin builds (docs/writing-plugins.md,
# "Reproducible builds"; `plugin build` pins them the same way, cli/plugin_repro.rs). Builds
# plugins/inventory-py and plugins/inventory-js twice each as plain builds, then twice each pinned: from a copy of the
# project at a fixed path (/tmp/idemhost-repro/stage) whose files get a different time per build,
# TMPDIR inside it, under pin.c (LD_PRELOAD: getrandom, clocks), tracer.c (file status under the
# build directory, wall clock, vDSO hidden) and, for JavaScript, pin.mjs (Math.random). Prints
# each build's time and digest, and whether the two builds of a kind are the same bytes.
# Needs a C compiler and the toolchains of scripts/build-plugins.sh (x86_64 Linux).
#   scripts/repro-builds/measure.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
here=$repo/cli/repro
work=/tmp/idemhost-repro
py=$repo/.cache/toolchain/py/bin/componentize-py
js=$repo/.cache/toolchain/js/node_modules/.bin/componentize-js
[ -x "$py" ] && [ -x "$js" ] || { echo "measure.sh: run scripts/build-plugins.sh first" >&2; exit 1; }
rm -rf "$work" && mkdir -p "$work/bin"
cc -O2 -Wall -shared -fPIC -o "$work/bin/pin.so" "$here/pin.c" -ldl
cc -O2 -Wall -o "$work/bin/tracer" "$here/tracer.c"
cp "$here/pin.mjs" "$work/bin/"

# stage <project dir> <seconds since the epoch>: a fresh copy at the fixed path, every file and
# directory at that time (and an empty virtual environment, so that componentize-py adds no
# site-packages of this machine's Python).
stage() {
  rm -rf "$work/stage" "$work/tmp" "$work/venv"
  mkdir -p "$work/stage/app" "$work/tmp" "$work/venv/lib/python3/site-packages"
  cp "$1"/*.py "$1"/*.js "$work/stage/app/" 2>/dev/null || true
  cp -r wit "$work/stage/"
  find "$work/stage" "$work/venv" -exec touch -h -d "@$2" {} +
}
py_build() { (cd "$work/stage" && "$@" "$py" -d wit -w handler componentize --stub-wasi -p app app -o "$out"); }
js_build() { (cd "$work/stage/app" && "$@" "$js" inventory.js --wit ../wit --world-name handler \
  -d stdio random clocks http fetch-event -o "$out"); }
run() { # label lang kind time
  local label=$1 lang=$2 kind=$3 at=$4 start
  out=$work/$label.wasm
  stage "plugins/inventory-$lang" "$at"
  start=$(date +%s%N)
  if [ "$kind" = plain ]; then
    "${lang}_build" env >"$work/$label.log" 2>&1 || { cat "$work/$label.log" >&2; exit 1; }
  else
    "${lang}_build" env TMPDIR="$work/tmp" IDEMHOST_BUILD_SEED="${SEED:-0123456789abcdef}" VIRTUAL_ENV="$work/venv" PIN_UNDER="$work/" \
      NODE_OPTIONS="--import $work/bin/pin.mjs" LD_PRELOAD="$work/bin/pin.so" "$work/bin/tracer" \
      >"$work/$label.log" 2>&1 || { cat "$work/$label.log" >&2; exit 1; }
  fi
  printf '%-12s %6d ms  %s\n' "$label" $((($(date +%s%N) - start) / 1000000)) \
    "$(sha256sum <"$out" | cut -c1-16)"
}
same() { # label label: the same bytes, or how many differ (sizes too)
  local a=$work/$1.wasm b=$work/$2.wasm
  if cmp -s "$a" "$b"; then echo "$1 = $2: same bytes"; return; fi
  echo "$1 ≠ $2: $(cmp -l "$a" "$b" 2>/dev/null | wc -l) of the common bytes differ;" \
    "sizes $(stat -c %s "$a") and $(stat -c %s "$b")"
}
# A warm-up build of each (caches filled), then plain and pinned builds alternating: the pinned
# ones from copies with different file times.
for lang in py js; do
  run "$lang-warm-up" "$lang" plain 978307200
  run "$lang-plain-1" "$lang" plain 978307200
  run "$lang-pinned-1" "$lang" pinned 978307201
  run "$lang-plain-2" "$lang" plain 978307200
  run "$lang-pinned-2" "$lang" pinned 1600000000
  same "$lang-plain-1" "$lang-plain-2"
  same "$lang-pinned-1" "$lang-pinned-2"
done
