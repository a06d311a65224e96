#!/usr/bin/env bash
# The whole test suite: unit tests, and integration tests against the machine's PostgreSQL
# (127.0.0.1:5432) and NATS JetStream (127.0.0.1:4222) — the core suites then again against
# nats-server 2.15 and PostgreSQL 18 (scripts/test-matrix.sh) —, including the crash tests (built with
# the `failpoints` feature), the conformance suite over every plugin language and the container
# test. Installs what it needs (plugin toolchains, podman, the musl target); exits non-zero on
# any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/ensure-build-deps.sh

pg_url=${IDEMHOST_TEST_PG:-postgres://root@127.0.0.1:5432/test}
psql -q -X "$pg_url" -c 'SELECT 1' >/dev/null 2>&1 \
  || { echo "test.sh: PostgreSQL is not reachable at $pg_url" >&2; exit 1; }
(exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null \
  || { echo "test.sh: NATS is not reachable at 127.0.0.1:4222" >&2; exit 1; }

# A clean CI clone builds once: incremental caches there only cost disk (~1 GB).
if [ "${CI:-}" = true ]; then export CARGO_INCREMENTAL=0; fi
# The suite needs ~8 GB for target/ and the toolchains; a full disk shows up late and obscurely
# (the linker dies with SIGBUS), so say it first.
free_kb=$(df -Pk . | awk 'NR==2 {print $4}')
if [ "${free_kb:-0}" -lt $((8 * 1024 * 1024)) ]; then
  echo "test.sh: warning: only $((free_kb / 1024)) MiB free here; the suite needs ~8 GB" >&2
fi

cargo fmt --all -- --check
scripts/build-plugins.sh
# The container test runs the image built here; it is skipped only where podman is absent and
# cannot be installed.
if command -v podman >/dev/null || command -v apt-get >/dev/null; then
  scripts/build-image.sh
else
  echo "test.sh: neither podman nor apt-get: the container test will be skipped" >&2
fi
# failpoints: the crash tests' kill points; otlp: the OTLP export test (both off in releases).
cargo test --workspace --features idemhost-cli/failpoints,idemhost-cli/otlp "$@"
# The server matrix: the core suites again against nats-server 2.15 and PostgreSQL 18 (private
# instances; see the script for what runs on both and why). Not when a filter was given.
if [ $# -eq 0 ]; then
  scripts/test-matrix.sh
fi
