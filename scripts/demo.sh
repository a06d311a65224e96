#!/usr/bin/env bash
# The order-flow demo, end to end against the local PostgreSQL and NATS: builds the plugins
# and the host, migrates, seeds stock, runs the host, publishes a few OrderPlaced events
# (including a duplicate delivery and one that cannot be served), prints each outcome and the
# resulting inventory, then stops the host with SIGTERM.
#
#   scripts/demo.sh            # the Rust inventory plugin
#   scripts/demo.sh py         # the same handler in Python (or js, c): only the config differs
set -euo pipefail
cd "$(dirname "$0")/.."
case ${1:-rust} in
  rust) PLUGIN=inventory ;;
  py | js | c) PLUGIN=inventory-$1 ;;
  *) echo "usage: scripts/demo.sh [rust|py|js|c]" >&2; exit 2 ;;
esac
# The env override of the consumer's `plugin` key: the config file stays the same.
export IDEMHOST_CONSUMER__0__PLUGIN=$PWD/plugins/dist/$PLUGIN.wasm
export PGDATABASE=${PGDATABASE:-test} PGOPTIONS="-c client_min_messages=warning"
CONFIG=examples/order-flow/idemhost.toml
SCHEMA=order_demo
NATS=${IDEMHOST_NATS__URL:-nats://127.0.0.1:4222}

echo "== building the plugins and the host (this consumer runs $PLUGIN.wasm)"
scripts/build-plugins.sh
cargo build --quiet -p idemhost
BIN=target/debug/idemhost

echo "== fresh schema $SCHEMA: host migrations, the example's inventory table, stock"
psql -q -X -h 127.0.0.1 -c "DROP SCHEMA IF EXISTS $SCHEMA CASCADE"
"$BIN" migrate --config "$CONFIG"
PGOPTIONS="$PGOPTIONS -c search_path=$SCHEMA" psql -q -X -h 127.0.0.1 -v ON_ERROR_STOP=1 \
  -f examples/order-flow/migrations/0001_inventory.sql \
  -c "INSERT INTO inventory VALUES ('sku-1', 10, 0), ('sku-2', 10, 0), ('sku-3', 1, 0)"

LOG=$(mktemp -t idemhost-demo.XXXXXX.log)
"$BIN" --log-format json run --config "$CONFIG" --no-migrate 2>"$LOG" &
HOST=$!
trap 'kill $HOST 2>/dev/null || true' EXIT
# A cold start compiles the plugin (seconds for Python or JavaScript); later starts use the cache.
for _ in $(seq 600); do grep -q '"idemhost running"' "$LOG" && break; sleep 0.1; done
grep -q '"idemhost running"' "$LOG" || { cat "$LOG"; echo "host did not start" >&2; exit 1; }

run=$(date +%s)
pub() { "$BIN" publish --nats-url "$NATS" --subject demo.orders.placed --event-type OrderPlaced "$@"; }
echo "== publishing (ids carry run $run)"
pub --id "evt-$run-1" "{\"id\":\"evt-$run-1\",\"orderId\":\"o-1\",\"sku\":\"sku-1\",\"quantity\":2}"
pub --id "evt-$run-2" "{\"id\":\"evt-$run-2\",\"orderId\":\"o-2\",\"sku\":\"sku-2\",\"quantity\":1}"
echo "-- the producer retries evt-$run-1: JetStream's duplicate window absorbs it"
pub --id "evt-$run-1" "{\"id\":\"evt-$run-1\",\"orderId\":\"o-1\",\"sku\":\"sku-1\",\"quantity\":2}"
echo "-- evt-$run-1 is delivered again past the broker (a replay): the marker decides"
pub --id "replay-$run-1" --header "Idemhost-Message-Id: evt-$run-1" \
  "{\"id\":\"evt-$run-1\",\"orderId\":\"o-1\",\"sku\":\"sku-1\",\"quantity\":2}"
echo "-- o-3 wants 5 units of sku-3, which has 1: a terminal failure, dead-lettered"
pub --id "evt-$run-3" "{\"id\":\"evt-$run-3\",\"orderId\":\"o-3\",\"sku\":\"sku-3\",\"quantity\":5}"

for _ in $(seq 200); do
  [ "$(grep -c '"outcome"' "$LOG")" -ge 4 ] && [ "$(grep -c '"dead-lettered"' "$LOG")" -ge 1 ] && break
  sleep 0.1
done
kill -TERM $HOST; wait $HOST; trap - EXIT

echo "== outcomes"
python3 - "$LOG" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try: v = json.loads(line)
    except ValueError: continue
    if "outcome" in v:
        s = v.get("span", {})
        print(f"  {s.get('message_id',''):<22} {v['outcome']:<18} {v.get('reason','')}")
PY
echo "== markers and inventory"
PGOPTIONS="$PGOPTIONS -c search_path=$SCHEMA" psql -X -h 127.0.0.1 \
  -c "SELECT consumer_name, message_id FROM processed_message ORDER BY message_id" \
  -c "SELECT sku, available, reserved FROM inventory ORDER BY sku"
echo "== operator view: prove a marker, marker growth, the dead letters"
"$BIN" check --config "$CONFIG" --consumer inventory-reservation-v1 --message-id "evt-$run-1"
"$BIN" markers stats --config "$CONFIG"
"$BIN" dlq list --config "$CONFIG" --consumer inventory-reservation-v1 --limit 5
echo "host log: $LOG"
