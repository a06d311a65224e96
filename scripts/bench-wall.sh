#!/usr/bin/env bash
# What the plugin wall's statements cost PostgreSQL, one by one, beside the seed's transaction:
# the CPU time of the server's processes (the postmaster and every backend, exited ones
# included, read from /proc) per transaction or statement, and pgbench's tps, in one run.
# pgbench only: no broker, no host. The server must run on this machine (its CPU is read from
# /proc); the host's migrations are applied to a database of the script's own.
#
# Each item is a pgbench script run T seconds at C clients over loopback TCP, ROUNDS times,
# alternating with the others; the median is printed. Scripts run in the simple protocol (as
# the host sends its BEGIN, COMMIT and session reset) unless the item says `prepared`. Not a
# test: figures vary ±10% run to run here.
#
#   C=16 T=5 ROUNDS=2 scripts/bench-wall.sh
set -euo pipefail
cd "$(dirname "$0")/.."
C=${C:-16}
T=${T:-5}
ROUNDS=${ROUNDS:-2}
HOST=${DB_HOST:-127.0.0.1}
PORT=${DB_PORT:-5432}
DB=idemhost_bench_wall
CONN="host=$HOST port=$PORT dbname=$DB sslmode=disable"
ADMIN="host=$HOST port=$PORT dbname=postgres sslmode=disable"
sql() { PGOPTIONS='-c client_min_messages=warning' psql -q -v ON_ERROR_STOP=1 "$@"; }
work=$(mktemp -d)
trap 'rm -rf "$work"; sql "$ADMIN" -c "DROP DATABASE IF EXISTS $DB" >/dev/null 2>&1 || true' EXIT

# The postmaster: the process listening on the server's port.
postmaster=$(ss -ltnpH "sport = :$PORT" 2>/dev/null | grep -o 'pid=[0-9]*' | head -1 | cut -d= -f2)
[ -n "$postmaster" ] && [ -r "/proc/$postmaster/stat" ] || {
  echo "bench-wall: the server on port $PORT is not a process of this machine" >&2
  exit 1
}
# CPU µs of the postmaster, its reaped children and its live children.
server_cpu() {
  python3 - "$postmaster" <<'PY'
import os, sys
root = int(sys.argv[1])
def stat(pid):
    try:
        s = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    return [int(x) if x.lstrip("-").isdigit() else 0 for x in s.rsplit(")", 1)[1].split()]
ticks = sum(stat(root)[11:15])
for p in os.listdir("/proc"):
    if p.isdigit() and int(p) != root:
        f = stat(p)
        if f and f[1] == root:
            ticks += f[11] + f[12]
print(ticks * 1_000_000 // os.sysconf("SC_CLK_TCK"))
PY
}

sql "$ADMIN" -c "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB" >/dev/null
for m in migrations/*.sql examples/order-flow/migrations/0001_inventory.sql; do
  sql "$CONN" -f "$m" >/dev/null
done
sql "$CONN" -c "INSERT INTO inventory SELECT 'sku-' || g, 1000000000, 0 FROM generate_series(1, 1000) g" \
  -c "VACUUM ANALYZE" >/dev/null
KEY=$(sql -At "$CONN" -c "SELECT key FROM idemhost_key")

# The host's statements, as `Wall::load` writes them (synchronous_commit = on, READ COMMITTED).
BEGIN_SQL="BEGIN ISOLATION LEVEL READ COMMITTED READ WRITE\\; SET LOCAL synchronous_commit = 'on'\\; SET LOCAL statement_timeout = '30000'"
CLEAR_CALL="SELECT public.idemhost_session_clear(ARRAY['synchronous_commit'], ARRAY['on'], false)"
# The clearing as statements (a schema migrated before 0010), and as it was sent before 0010:
# after the COMMIT, the check through the view.
CLEAR_STATEMENTS="RESET ALL\\; DISCARD TEMP\\; CLOSE ALL\\; UNLISTEN *\\; SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_prepared_statement() AS p WHERE p.from_sql) FROM (SELECT pg_catalog.pg_advisory_unlock_all(), pg_catalog.set_config('synchronous_commit', 'on', true)) AS host"
OLD_RESET="RESET ALL\\; DISCARD TEMP\\; CLOSE ALL\\; UNLISTEN *\\; SELECT pg_advisory_unlock_all()\\; SELECT EXISTS (SELECT 1 FROM pg_prepared_statements WHERE from_sql)"
CLAIM="SELECT public.idemhost_claim('$KEY', 'inventory-reservation-v1', 'pgb-' || :client_id || '-' || :i || '-' || random(), 'sha256:bench'), pg_catalog.pg_backend_pid(), COALESCE(pg_catalog.pg_current_xact_id_if_assigned()::pg_catalog.text, '') AS xid \\gset"
# The commit's check that the transaction is still the claim's: inside the clearing (migration
# 0012), or a statement of its own before it (a schema before 0012), the claim's id written in.
CLEAR_CHECKING="SELECT public.idemhost_session_clear(ARRAY['synchronous_commit'], ARRAY['on'], false, ':xid')"
XID_CHECK="SELECT CASE WHEN COALESCE(pg_catalog.pg_current_xact_id_if_assigned()::pg_catalog.text, '') OPERATOR(pg_catalog.=) ':xid' THEN 0 ELSE ('idemhost: not the claim''s transaction, backend ' OPERATOR(pg_catalog.||) pg_catalog.pg_backend_pid()::pg_catalog.text)::pg_catalog.int4 END"
# Between two deliveries of a group: the clearing and the group's settings again.
BETWEEN="SELECT public.idemhost_session_clear(ARRAY['synchronous_commit', 'statement_timeout', 'lock_timeout'], ARRAY['on', '30000', '50'], true)"
RESERVE="UPDATE inventory SET available = available - 1, reserved = reserved + 1 WHERE sku = 'sku-' || :s AND available >= 1;"
SEED_CLAIM="INSERT INTO processed_message (consumer_name, message_id) VALUES ('inventory-reservation-v1', 'pgb-' || :client_id || '-' || :i || '-' || random()) ON CONFLICT DO NOTHING RETURNING message_id;"
VARS=$'\\set i random(1, 1000000000)\n\\set s random(1, 1000)'

item() { # name mode body
  local file=$work/item$(wc -l <"$work/items").sql
  printf '%s\n%s\n' "$VARS" "$3" >"$file"
  echo "$1|$2|$file" >>"$work/items"
}
: >"$work/items"
item "seed transaction" prepared "BEGIN;
$SEED_CLAIM
$RESERVE
COMMIT;"
item "seed transaction, simple protocol" simple "BEGIN;
$SEED_CLAIM
$RESERVE
COMMIT;"
item "host transaction per message (simple protocol)" simple "$BEGIN_SQL;
$CLAIM
$RESERVE
$CLEAR_CHECKING\\; COMMIT;"
item "  the claim's check as a statement (schema before 0012)" simple "$BEGIN_SQL;
$CLAIM
$RESERVE
$XID_CHECK\\; $CLEAR_CALL\\; COMMIT;"
item "  its clearing as statements (schema before 0010)" simple "$BEGIN_SQL;
$CLAIM
$RESERVE
$CLEAR_STATEMENTS\\; COMMIT;"
item "  its reset as before 0010 (after the COMMIT)" simple "$BEGIN_SQL;
$CLAIM
$RESERVE
SET LOCAL synchronous_commit = 'on'\\; COMMIT\\; $OLD_RESET;"
item "  without any clearing" simple "$BEGIN_SQL;
$CLAIM
$RESERVE
SET LOCAL synchronous_commit = 'on'\\; COMMIT;"
item "  with the seed's claim instead of the host's function" simple "$BEGIN_SQL;
$SEED_CLAIM
$RESERVE
$CLEAR_CALL\\; COMMIT;"
item "statement: SELECT 1 (a round trip)" simple "SELECT 1;"
item "statement: BEGIN + SET LOCALs, COMMIT" simple "$BEGIN_SQL;
COMMIT;"
item "statement: the clearing, one call" simple "$CLEAR_CALL;"
item "statement: a group's clearing between deliveries, simple protocol" simple "$BETWEEN;"
item "statement: a group's clearing between deliveries, prepared" prepared "$BETWEEN;"
item "statement: the clearing as statements" simple "$CLEAR_STATEMENTS;"
item "statement: the reset before 0010" simple "$OLD_RESET;"
item "statement: prepared-statement check, the view" simple "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_prepared_statements WHERE from_sql);"
item "statement: prepared-statement check, the function" simple "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_prepared_statement() AS p WHERE p.from_sql);"

: >"$work/results"
for round in $(seq 1 "$ROUNDS"); do
  while IFS='|' read -r name mode file; do
    before=$(server_cpu)
    out=$(pgbench -n -M "$mode" -c "$C" -j 2 -T "$T" -f "$file" "$CONN" 2>&1) || true
    after=$(server_cpu)
    n=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' <<<"$out")
    tps=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' <<<"$out" | head -1)
    if [ -z "$n" ] || [ "$n" = 0 ]; then
      echo "bench-wall: $name failed: $(grep -m1 -iE 'error|abort' <<<"$out")" >&2
      exit 1
    fi
    printf '%s|%s|%s|%s\n' "$round" "$name" "$tps" $(((after - before) / n)) | tee -a "$work/results"
  done <"$work/items"
done

python3 - "$work/results" "$C" "$T" <<'PY'
import statistics, sys
rows = [l.rstrip("\n").split("|") for l in open(sys.argv[1]) if l.strip()]
names = list(dict.fromkeys(r[1] for r in rows))
tps = {n: statistics.median(float(r[2]) for r in rows if r[1] == n) for n in names}
cpu = {n: statistics.median(float(r[3]) for r in rows if r[1] == n) for n in names}
base = cpu[names[0]]
print(f"\n| item ({sys.argv[2]} clients, {sys.argv[3]} s) | tps | server CPU µs per transaction | × seed |")
print("|---|---|---|---|")
for n in names:
    print(f"| {n} | {tps[n]:.0f} | {cpu[n]:.0f} | {cpu[n] / base:.2f} |")
PY
