#!/usr/bin/env bash
# The marker table and the server under the seed's transaction, side by side in one run: what an
# operator's knobs (commit_delay, an effect table's fillfactor, the host's marker age index) and
# a pipelining client (BEGIN and the claim in one flight; the whole transaction in one) are worth
# on this machine. pgbench only: no broker, no host, so each figure is the database's ceiling.
#
# Each variant runs on freshly created tables (the seed's schema plus what the variant says),
# ROUNDS times alternating with the others, T seconds at C clients over loopback TCP without
# TLS (as the host connects in `idemhost bench`). Prints tps per round, the median's ratio to
# the host's own schema, and the share of HOT updates on the effect table. Not a test: figures
# vary ±10% run to run here.
#
#   DB_HOST=127.0.0.1 C=16 T=10 ROUNDS=2 scripts/bench-database.sh
set -euo pipefail
cd "$(dirname "$0")/.."
C=${C:-16}
T=${T:-10}
ROUNDS=${ROUNDS:-2}
PEERS=${PEERS:-../shared/peers}
DB=idemhost_bench_database
CONN="host=${DB_HOST:-127.0.0.1} port=${DB_PORT:-5432} dbname=$DB sslmode=disable"
ADMIN="host=${DB_HOST:-127.0.0.1} port=${DB_PORT:-5432} dbname=postgres sslmode=disable"
sql() { PGOPTIONS='-c client_min_messages=warning' psql -q -v ON_ERROR_STOP=1 "$@"; }
work=$(mktemp -d)
trap 'rm -rf "$work"; sql "$ADMIN" -c "DROP DATABASE IF EXISTS $DB" >/dev/null 2>&1 || true' EXIT

sql "$ADMIN" -c "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB" >/dev/null

# The seed's transaction (its peer script: claim a fresh marker, reserve one unit of a random
# SKU, commit) as is, and with pipeline marks around BEGIN and the claim, or around all of it.
seed_tx=$PEERS/pgbench/seed_tx.sql
cp "$seed_tx" "$work/flights4.sql"
awk '/^BEGIN;/ { print "\\startpipeline" } { print } /^INSERT INTO processed_message/ { print "\\endpipeline" }' \
  "$seed_tx" >"$work/flights3.sql"
awk '/^BEGIN;/ { print "\\startpipeline" } { print } /^COMMIT;/ { print "\\endpipeline" }' \
  "$seed_tx" >"$work/flights1.sql"

# name | script | schema additions | PGOPTIONS
variants=(
  "host schema (PK + age index)|flights4|age|"
  "seed schema (PK only)|flights4||"
  "inventory fillfactor 80|flights4|age ff80|"
  "commit_delay 100us|flights4|age|-c commit_delay=100 -c commit_siblings=5"
  "commit_delay 1ms|flights4|age|-c commit_delay=1000 -c commit_siblings=5"
  "BEGIN+claim in one flight (3 flights)|flights3|age|"
  "whole transaction in one flight|flights1|age|"
)

prepare() {
  local adds=$1
  # The seed's tables (its peer's reset), then what the variant adds.
  sql "$CONN" -f "$PEERS/node-seed/reset.sql" >/dev/null
  if [[ " $adds " == *" age "* ]]; then
    sql "$CONN" -f migrations/0003_processed_message_age.sql >/dev/null
  fi
  if [[ " $adds " == *" ff80 "* ]]; then
    sql "$CONN" -c "ALTER TABLE inventory SET (fillfactor = 80)" -c "VACUUM FULL inventory" >/dev/null
  fi
  sql "$CONN" -c "VACUUM ANALYZE" -c "CHECKPOINT" >/dev/null
}

: >"$work/results"
for round in $(seq 1 "$ROUNDS"); do
  for v in "${variants[@]}"; do
    IFS='|' read -r name script adds options <<<"$v"
    prepare "$adds"
    tps=$(PGOPTIONS="$options" pgbench -n -M prepared -c "$C" -j 2 -T "$T" -f "$work/$script.sql" "$CONN" 2>/dev/null |
      sed -n 's/^tps = \([0-9.]*\).*/\1/p' | head -1)
    hot=$(sql -At "$CONN" -c "SELECT round(100.0 * n_tup_hot_upd / greatest(n_tup_upd, 1)) FROM pg_stat_user_tables WHERE relname = 'inventory'")
    printf '%s|%s|%s|%s\n' "$round" "$name" "${tps:-0}" "$hot" | tee -a "$work/results"
  done
done

python3 - "$work/results" "$C" "$T" <<'PY'
import statistics, sys
rows = [l.rstrip("\n").split("|") for l in open(sys.argv[1]) if l.strip()]
names = list(dict.fromkeys(r[1] for r in rows))
tps = {n: [float(r[2]) for r in rows if r[1] == n] for n in names}
hot = {n: [r[3] for r in rows if r[1] == n] for n in names}
base = statistics.median(tps[names[0]])
print(f"\n{sys.argv[2]} clients, {sys.argv[3]} s per round, loopback TCP without TLS")
print("| variant | tps per round | median / host schema | HOT updates on inventory |")
print("|---|---|---|---|")
for n in names:
    m = statistics.median(tps[n])
    print(f"| {n} | {', '.join(f'{t:,.0f}' for t in tps[n])} | {m / base:.2f} | {', '.join(h + ' %' for h in hot[n])} |")
PY
