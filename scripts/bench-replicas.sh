#!/usr/bin/env bash
# Replica scaling, side by side in one run: N events drained by 1, 2 and 3 `idemhost run`
# processes on one durable consumer (bench/examples/replicas.rs), then pgbench's seed transaction
# (../shared/peers/pgbench) at the same total concurrency, and the ratios. Not a test: figures
# vary ±15% run to run on this 2-core machine, where replicas share the CPUs with PostgreSQL
# and NATS.
#
#   scripts/bench-replicas.sh                    # N=20000, IN_FLIGHT=8, replicas 1,2,3
#   CLUSTER=1 scripts/bench-replicas.sh          # against a private 3-node JetStream cluster on
#                                                # loopback, the streams at R3 (the machine's
#                                                # nats-server; SERVERS=new: 2.15 from servers.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/ensure-build-deps.sh
TARGET=$(scripts/target-dir.sh)
N=${N:-20000}
IN_FLIGHT=${IN_FLIGHT:-8}
PEERS=${PEERS:-../shared/peers}
scripts/build-plugins.sh rust >/dev/null
cargo build --quiet --release -p idemhost-cli --bin idemhost && cargo build --quiet --release -p idemhost-bench --example replicas
out=$(mktemp -d)
cluster=()
if [ -n "${CLUSTER:-}" ]; then
  source scripts/bench-cluster.sh
  cluster=(--nats "$CLUSTER_URLS" --stream-replicas 3)
  echo "== $("$NATS_SERVER" --version): 3 nodes on loopback, streams at R3"
fi
echo "== idemhost replicas, N=$N, max_in_flight $IN_FLIGHT each"
"$TARGET"/release/examples/replicas --n "$N" --in-flight "$IN_FLIGHT" --replicas "${REPLICAS:-1,2,3}" \
  "${cluster[@]}" | tee "$out/host.txt"
echo "== pgbench, seed transaction at the same total concurrency (T=${T:-10}s)"
(cd "$PEERS/pgbench" && psql -q -d "${DB:-test}" -f ../node-seed/reset.sql)
for r in 1 2 3; do
  c=$((r * IN_FLIGHT))
  printf 'clients=%s ' "$c" | tee -a "$out/pgbench.txt"
  (cd "$PEERS/pgbench" && pgbench -n -M prepared -c "$c" -j 2 -T "${T:-10}" -f seed_tx.sql "${DB:-test}" 2>/dev/null) |
    grep -E '^tps' | head -1 | tee -a "$out/pgbench.txt"
done
python3 - "$out/host.txt" "$out/pgbench.txt" <<'PY'
import json, re, sys
report = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
tps = {}
for line in open(sys.argv[2]):
    m = re.match(r"clients=(\d+) tps = ([\d.]+)", line)
    if m: tps[int(m.group(1))] = float(m.group(2))
one = report["runs"][0]["per_second"]
for r in report["runs"]:
    c = r["total_concurrency"]
    ratio = r["per_second"] / tps[c] if c in tps else float("nan")
    print(f"replicas={r['replicas']} concurrency={c:<3} {r['per_second']:>7.0f} msg/s  x{r['per_second'] / one:.2f} of one replica  pgbench {tps.get(c, 0):>7.0f} tps  ratio {ratio:.2f}")
PY
