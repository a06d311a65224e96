#!/usr/bin/env bash
# The server matrix: the core suites (seed, e2e, chaos, crash, ordering, replicas, cluster, and
# the order flow's run with duplicates at every hop) again, against the oldest servers idemhost
# supports — PostgreSQL 15 and NATS 2.9, as Debian 12 ships them. The main run (scripts/test.sh)
# uses the current releases, PostgreSQL 18 and nats-server 2.15; these suites are the ones whose
# outcome depends on the servers' behaviour (JetStream acks, redelivery, deduplication,
# durability, failures), so they run on both. The order flow's two other tests check the
# example's own rules (a semantic duplicate, a cancellation first), not the servers': once.
#
# Servers: a private PostgreSQL of the machine's oldest (/usr/lib/postgresql/<oldest>/bin) on a
# free loopback port, started as the suite's are (scripts/private-servers.sh: enough connections
# for four tests at a time; a server at 127.0.0.1:5432 keeps its own settings, and at the default
# 100 connections the suite's replicas test left another test's delivery unable to connect); the
# machine's NATS when it answers at 127.0.0.1:4222, else a private nats-server from the PATH.
# IDEMHOST_TEST_OLDEST_PG_URL / IDEMHOST_TEST_OLDEST_NATS_URL name servers to use instead. The
# tests' own private servers (chaos, crash, cluster) use those programs too.
#   scripts/test-matrix.sh [cargo test args…]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/private-servers.sh
trap servers_down EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

pg_bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | head -1)
nats=$(command -v nats-server || true)
if [ ! -x "$pg_bin/initdb" ] || [ -z "$nats" ]; then
  echo "test-matrix.sh: the oldest servers' programs are not installed here (Debian 12:" \
    "apt-get install postgresql-15 nats-server); the core suites ran only on the current releases" >&2
  [ "${CI:-}" = true ] && exit 1
  exit 0
fi
SERVERS_PG_BIN=$pg_bin
SERVERS_NATS=$nats
pg_url=${IDEMHOST_TEST_OLDEST_PG_URL:-}
nats_url=${IDEMHOST_TEST_OLDEST_NATS_URL:-}
if [ -z "$nats_url" ] && servers_answers 127.0.0.1 4222; then
  nats_url=nats://127.0.0.1:4222
  echo "== server matrix: the NATS answering at 127.0.0.1:4222"
fi
if [ -z "$pg_url" ]; then
  servers_start_postgres
  pg_url=$SERVERS_PG_URL
fi
if [ -z "$nats_url" ]; then
  servers_start_nats
  nats_url=$SERVERS_NATS_URL
fi
export IDEMHOST_TEST_PG_URL=$pg_url IDEMHOST_TEST_NATS_URL=$nats_url
export IDEMHOST_TEST_PG_BIN=$SERVERS_PG_BIN IDEMHOST_TEST_NATS_SERVER=$SERVERS_NATS

# What the suites reach, before and after: the servers' versions, and (to show the suites really
# ran against them) the transactions and the JetStream API requests they served.
psql=$SERVERS_PG_BIN/psql
pg_version=$(PGCONNECT_TIMEOUT=5 "$psql" -X -At "$pg_url" -c 'SHOW server_version')
commits() {
  "$psql" -X -At "$pg_url" -c "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
}
jetstream_requests() {
  python3 - "$nats_url" <<'PY'
import socket, sys, json, urllib.parse
u = urllib.parse.urlparse(sys.argv[1].split(",")[0])
s = socket.create_connection((u.hostname, u.port or 4222), timeout=5)
f = s.makefile("rwb")
info = json.loads(f.readline().decode().split(" ", 1)[1])
f.write(b'CONNECT {"verbose":false,"pedantic":false,"headers":true}\r\nSUB _r 1\r\nPUB $JS.API.INFO _r 0\r\n\r\nPING\r\n')
f.flush()
while True:
    line = f.readline().decode()
    if line.startswith("MSG"):
        n = int(line.split()[-1])
        body = json.loads(f.read(n + 2)[:n])
        print(info["version"], body["api"]["total"])
        break
PY
}
read -r nats_version api_before < <(jetstream_requests)
commits_before=$(commits)
echo "== server matrix: PostgreSQL $pg_version, nats-server $nats_version"
cargo test -p idemhost-cli --features failpoints,otlp,bench --test system -- \
  seed:: e2e:: chaos:: crash:: ordering:: replicas:: order_flow::five_hundred cluster:: "$@"
read -r _ api_after < <(jetstream_requests)
commits=$(($(commits) - commits_before))
api=$((api_after - api_before))
echo "== server matrix: $commits transactions on PostgreSQL $pg_version, $api JetStream API requests on nats-server $nats_version"
[ "$commits" -gt 10000 ] && [ "$api" -gt 100 ] \
  || { echo "test-matrix.sh: the suites did not use the matrix's servers" >&2; exit 1; }
