#!/usr/bin/env bash
# The inventory handler in every language, side by side in one run on this machine: component
# size, compile time (cold and from the compile cache), instantiate and handle() p50 per
# delivery, and end-to-end msg/s draining N OrderPlaced events through NATS at max_in_flight 16
# (native Rust handler beside them). Not a test: figures vary ±15% run to run here.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/ensure-build-deps.sh
TARGET=$(scripts/target-dir.sh)
N=${N:-20000}
scripts/build-plugins.sh >/dev/null
cargo build --quiet --release -p idemhost-bench --example throughput
out=$(mktemp)
"$TARGET"/release/examples/throughput --n "$N" --in-flight 16 --languages \
  --handler wasm:inventory,wasm:inventory-py,wasm:inventory-js,wasm:inventory-c,native | tee "$out"
python3 - "$out" <<'PY'
import json, sys
report = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
rate = {r["handler"].removeprefix("wasm:"): r["per_second"] for r in report["runs"]}
names = {"inventory": "Rust", "inventory-py": "Python", "inventory-js": "JavaScript", "inventory-c": "C"}
print("| language | component | compile (cold / cached) | instantiate p50 | handle() p50 | msg/s at 16 | WASI imports |")
print("|---|---|---|---|---|---|---|")
for l in report["languages"]:
    c = l["component"]
    wasi = ", ".join(l["wasi_imports"]) or "none"
    print(f"| {names[c]} | {l['bytes']:,} B | {l['compile_ms']:,.0f} ms / {l['cached_load_ms']:,.0f} ms "
          f"| {l['instantiate_p50_us']:,.0f} µs | {l['handle_p50_us']:,.0f} µs | {rate.get(c, 0):,.0f} | {wasi} |")
print(f"| native Rust (no WASM) | - | - | - | - | {rate.get('native', 0):,.0f} | - |")
PY
