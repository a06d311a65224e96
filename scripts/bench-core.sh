#!/usr/bin/env bash
# Side by side in one run on this machine: the seed's transaction straight through pgbench
# (../shared/peers/pgbench/run.sh: 1, 4, 16 clients), then the host draining N OrderPlaced
# events with the WASM inventory plugin and the native handler at max_in_flight 1 and 16.
# Prints both and the host/pgbench ratios. Not a test: figures vary ±15% run to run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/ensure-build-deps.sh
TARGET=$(scripts/target-dir.sh)
N=${N:-20000}
PEERS=${PEERS:-../shared/peers}
scripts/build-plugins.sh >/dev/null
cargo build --quiet --release -p idemhost-bench --example throughput
out=$(mktemp -d)
echo "== pgbench, seed transaction (T=${T:-10}s per client count)"
bash "$PEERS/pgbench/run.sh" | tee "$out/pgbench.txt"
echo "== idemhost, N=$N"
"$TARGET"/release/examples/throughput --n "$N" --in-flight 1,16 | tee "$out/host.txt"
python3 - "$out/pgbench.txt" "$out/host.txt" <<'PY'
import json, re, sys
tps = {}
for line in open(sys.argv[1]):
    m = re.match(r"clients=(\d+) tps = ([\d.]+)", line)
    if m: tps[int(m.group(1))] = float(m.group(2))
report = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
rows = []
for r in report["runs"]:
    c = r["max_in_flight"]
    ratio = r["per_second"] / tps[c] if c in tps else None
    rows.append({**r, "pgbench_tps": tps.get(c), "host_over_pgbench": ratio})
    print(f"{r['handler']:<7} in_flight={c:<3} {r['per_second']:>7.0f} msg/s  pgbench {tps.get(c, 0):>7.0f} tps  ratio {ratio:.2f}")
by = {(r["handler"], r["max_in_flight"]): r["per_second"] for r in report["runs"]}
for c in sorted({r["max_in_flight"] for r in report["runs"]}):
    if ("wasm", c) in by and ("native", c) in by:
        print(f"wasm/native at {c}: {by[('wasm', c)] / by[('native', c)]:.2f}")
print(json.dumps({"rows": rows, "overhead": report["overhead"], "peak_rss_mib": report["peak_rss_mib"]}))
PY
