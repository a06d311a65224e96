#!/usr/bin/env bash
# Builds every guest plugin — Rust, Python, JavaScript and C — into plugins/dist/<name>.wasm,
# installing each language's toolchain idempotently at the versions pinned in plugins/toolchain/
# (requirements.txt with hashes, package-lock.json, apt-packages.txt; Rust crates by
# plugins/Cargo.lock). Used by the demo, the tests and CI.
#
#   scripts/build-plugins.sh             # every language
#   scripts/build-plugins.sh rust c      # some of them (rust, py, js, c)
#
# A component is rebuilt only when its inputs (sources, the WIT, the pinned toolchain) changed;
# each build's time and size is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DIST=${IDEMHOST_PLUGINS_DIST:-$ROOT/plugins/dist}
TOOLS=$ROOT/.cache/toolchain
mkdir -p "$DIST" "$TOOLS"
LANGS=${*:-rust py js c}
want() { [[ " $LANGS " == *" $1 "* ]]; }

say() { printf '== %s\n' "$*"; }
# Runs a build step and prints its wall time.
timed() {
  local what=$1 start=$SECONDS
  shift
  "$@" >/dev/null
  printf '   %-16s built in %ss\n' "$what" $((SECONDS - start))
}
# Whether dist/<name>.wasm is older than the digest of its input files (a stamp beside it).
stale() {
  local name=$1
  shift
  local digest
  digest=$(cat "$@" | sha256sum | cut -d' ' -f1)
  [ -f "$DIST/$name.wasm" ] && [ "$(cat "$DIST/$name.inputs" 2>/dev/null)" = "$digest" ] && return 1
  echo "$digest" >"$DIST/.$name.pending"
}
stamp() { mv "$DIST/.$1.pending" "$DIST/$1.inputs"; }
# Copies a built component into place by a rename: a test reading it meanwhile (the image build
# runs this beside the test suite) sees the old file or the new one, never half of one.
place() { cp "$1" "$2.partial.$$" && mv -f "$2.partial.$$" "$2"; }
# The examples, templates and conformance plugins target idemhost:consumer@0.2.0; the 0.1.0
# fixtures (tests/fixtures/wit-0.1.0: what components built before 0.2.0 look like) the WIT of
# wit/, which stays 0.1.0.
WIT=("$ROOT"/wit/0.2.0/*.wit)
WIT_0_1=("$ROOT"/wit/*.wit)
FIXTURES=tests/fixtures/wit-0.1.0

# -- Rust (wasm32-wasip2) -----------------------------------------------------------------------
if want rust; then
  say "rust: inventory, testkit (and testkit-0.2), template-rust, conformance-rust, versioned-a/b, order-flow (reservation, notification, analytics)"
  rustup target list --installed | grep -qx wasm32-wasip2 || rustup target add wasm32-wasip2
  out=$(scripts/target-dir.sh plugins/Cargo.toml)/wasm32-wasip2/release
  # The testkit against idemhost:consumer@0.2.0, for the suites that attack with its values;
  # first, so that the workspace build below leaves the 0.1.0 one in the target directory.
  cargo build --quiet --release --target wasm32-wasip2 --manifest-path plugins/Cargo.toml -p testkit --features wit-0-2
  place "$out/testkit.wasm" "$DIST/testkit-0.2.wasm"
  cargo build --quiet --release --target wasm32-wasip2 --manifest-path plugins/Cargo.toml
  place "$out/inventory.wasm" "$DIST/inventory.wasm"
  place "$out/testkit.wasm" "$DIST/testkit.wasm"
  place "$out/template_rust.wasm" "$DIST/template-rust.wasm"
  place "$out/conformance_rust.wasm" "$DIST/conformance-rust.wasm"
  for p in reservation notification analytics; do place "$out/order_$p.wasm" "$DIST/order-$p.wasm"; done
  # Two versions of one plugin for the hot-swap tests: the workspace build above is version a.
  place "$out/versioned.wasm" "$DIST/versioned-a.wasm"
  cargo build --quiet --release --target wasm32-wasip2 --manifest-path plugins/Cargo.toml -p versioned --features v2
  place "$out/versioned.wasm" "$DIST/versioned-b.wasm"
fi

# -- Python (componentize-py, from PyPI) --------------------------------------------------------
PY=$TOOLS/py
# venv <dir> <requirements> <what>: a virtual environment holding exactly the requirements (with
# hashes), made again when they change.
venv() {
  local dir=$1 req=$2
  if [ "$(cat "$dir/.requirements.sha256" 2>/dev/null)" != "$(sha256sum <"$req")" ]; then
    say "installing $3 ($req)"
    rm -rf "$dir"
    python3 -m venv "$dir"
    "$dir/bin/pip" install --quiet --disable-pip-version-check --require-hashes -r "$req"
    sha256sum <"$req" >"$dir/.requirements.sha256"
  fi
}
ensure_python_tools() { venv "$PY" plugins/toolchain/requirements.txt "the Python toolchain"; }
componentize_py() { # name app-dir [wit-dir]
  local name=$1 dir=$2 wit=${3:-wit/0.2.0}
  stale "$name" "$dir"/*.py "$wit"/*.wit plugins/toolchain/requirements.txt || return 0
  # --stub-wasi: the component imports no WASI at all (no filesystem, sockets, clocks).
  timed "$name" "$PY/bin/componentize-py" -d "$wit" -w handler componentize --stub-wasi \
    -p "$dir" app -o "$DIST/$name.wasm"
  stamp "$name"
}
# mypy, for the suite's check of a Python project's editor stubs (plugins/toolchain/checkers.txt).
ensure_python_checker() { venv "$TOOLS/mypy" plugins/toolchain/checkers.txt mypy; }
if want py; then
  say "python: inventory-py, template-py, conformance-py, order-payment-py, the 0.1.0 fixture"
  ensure_python_tools
  ensure_python_checker
  componentize_py inventory-py plugins/inventory-py
  componentize_py order-payment-py plugins/order-payment-py
  componentize_py template-py plugins/templates/python
  componentize_py conformance-py plugins/conformance/python
  componentize_py template-py-0.1 "$FIXTURES/python" wit
fi

# -- JavaScript (componentize-js, from npm) -----------------------------------------------------
# Installed where `idemhost plugin new` installs it (IDEMHOST_TOOLCHAIN_DIR's js/, same files,
# same stamp): pointed at .cache/toolchain, plugin new reuses this install and needs no registry.
NODE_TOOLS=$TOOLS/js
ensure_js_tools() {
  local lock=plugins/toolchain/package-lock.json
  if [ "$(cat "$NODE_TOOLS/node_modules/.lock.sha256" 2>/dev/null)" != "$(sha256sum <"$lock")" ]; then
    say "installing the JavaScript toolchain ($lock)"
    mkdir -p "$NODE_TOOLS"
    cp plugins/toolchain/package.json "$lock" "$NODE_TOOLS"/
    (cd "$NODE_TOOLS" && npm ci --prefer-offline --silent --no-audit --no-fund)
    sha256sum <"$lock" >"$NODE_TOOLS/node_modules/.lock.sha256"
  fi
}
componentize_js() { # name entry.js [wit-dir]
  local name=$1 entry=$2 wit=${3:-wit/0.2.0}
  stale "$name" "$(dirname "$entry")"/*.js "$wit"/*.wit plugins/toolchain/package-lock.json || return 0
  # -d ...: leave out every WASI feature of the engine (stdio, random, clocks, http), so the
  # component imports only the idemhost world.
  timed "$name" "$NODE_TOOLS/node_modules/.bin/componentize-js" "$entry" --wit "$wit" \
    --world-name handler -d stdio random clocks http fetch-event -o "$DIST/$name.wasm"
  stamp "$name"
}
if want js; then
  say "javascript: inventory-js, template-js, conformance-js, the 0.1.0 fixture"
  ensure_js_tools
  componentize_js inventory-js plugins/inventory-js/inventory.js
  componentize_js template-js plugins/templates/js/template.js
  componentize_js conformance-js plugins/conformance/js/conformance.js
  componentize_js template-js-0.1 "$FIXTURES/js/template.js" wit
fi

# -- C (clang for wasm32-wasi + wit-bindgen's C bindings + wasm-tools component new) -------------
BIND=plugins/c-bindings
ensure_c_tools() {
  local missing=()
  for p in $(cat plugins/toolchain/apt-packages.txt); do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing the C toolchain: ${missing[*]}"
    scripts/apt-install.sh "${missing[@]}"
  fi
  ensure_python_tools # wasm-tools comes with the Python toolchain
  # The bindings are committed (wit-bindgen-cli takes ~7 minutes to build here); they must be
  # the ones for this WIT. With wit-bindgen on the PATH, they are regenerated when it changed.
  local wit_sum
  wit_sum=$(cat "${WIT[@]}" | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$BIND/WIT.sha256")" != "$wit_sum" ]; then
    if command -v wit-bindgen >/dev/null; then
      wit-bindgen c wit/0.2.0 --world handler --out-dir "$BIND" >/dev/null
      echo "$wit_sum" >"$BIND/WIT.sha256"
    else
      echo "build-plugins: $BIND is stale for wit/0.2.0: install wit-bindgen-cli 0.61.1" \
        "(cargo install wit-bindgen-cli@0.61.1 --locked --no-default-features --features c)" >&2
      exit 1
    fi
  fi
}
build_c() { # name source...
  local name=$1
  shift
  stale "$name" "$@" plugins/c-common/* "$BIND"/* plugins/toolchain/apt-packages.txt || return 0
  local core
  core=$(mktemp -t "$name.XXXXXX.core.wasm")
  timed "$name" bash -c '
    clang-14 --target=wasm32-wasi --sysroot=/usr -mexec-model=reactor -fuse-ld=/usr/bin/wasm-ld-14 \
      -O2 -Wall -Wextra -Werror -Wl,--strip-all -I"$1" -Iplugins/c-common \
      "${@:4}" plugins/c-common/json_fields.c "$1/handler.c" "$1/handler_component_type.o" -o "$2"
    # The core module imports no WASI preview 1, so no adapter is needed.
    "$3" component new "$2" -o "$0"
  ' "$DIST/$name.wasm" "$BIND" "$core" "$PY/bin/wasm-tools" "$@"
  rm -f "$core"
  stamp "$name"
}
if want c; then
  say "c: inventory-c, template-c, conformance-c"
  ensure_c_tools
  build_c inventory-c plugins/inventory-c/inventory.c
  build_c template-c plugins/templates/c/template.c
  build_c conformance-c plugins/conformance/c/conformance.c
fi

# -- A component that traps while it is instantiated, for the hot-swap tests ----------------------
# versioned-a plus one more core instance whose start function is `unreachable` (appended at the
# end of the component, so no existing index moves): valid, fits the world, traps at start.
if want rust && stale versioned-trap "$DIST/versioned-a.wasm" "$0"; then
  ensure_python_tools
  "$PY/bin/wasm-tools" print "$DIST/versioned-a.wasm" | python3 -c '
import sys
wat = sys.stdin.read().rstrip()
assert wat.endswith(")"), "unexpected wasm-tools print output"
boom = "(core module $boom (func $trap unreachable) (start $trap)) (core instance (instantiate $boom))"
print(wat[:-1] + boom + ")")
' | "$PY/bin/wasm-tools" parse -o "$DIST/versioned-trap.wasm"
  stamp versioned-trap
fi

for w in "$DIST"/*.wasm; do
  printf '%-28s %10s bytes\n' "${w#"$ROOT"/}" "$(stat -c %s "$w")"
done
