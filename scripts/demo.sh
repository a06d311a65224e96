#!/usr/bin/env bash
# The order-flow demo, end to end: builds the plugins, the host and the fake payment provider,
# migrates a fresh schema, seeds stock, runs the host (five consumers,
# examples/order-flow/idemhost.toml) and the provider (its own process, provider.toml),
# publishes a few orders — with a producer retry, a replay, a semantic duplicate, one that
# cannot be served and a cancellation that arrives before its order — then stops both with
# SIGTERM and prints, per order, the chain of effects, each delivery's outcome, and the
# operator's view (marker + effect proof, marker growth, dead letters).
#
#   scripts/demo.sh
#
# PostgreSQL and NATS: the ones at IDEMHOST_POSTGRES__URL / IDEMHOST_NATS__URL when set, else
# the ones answering at 127.0.0.1:5432 / 127.0.0.1:4222; where nothing answers, private servers
# are started on free loopback ports for the demo and removed at its end, Ctrl-C included
# (scripts/private-servers.sh says where their binaries come from).
# IDEMHOST_DEMO_PREBUILT=DIR uses DIR/idemhost and DIR/examples/order_flow_provider and the plugins
# already in plugins/dist instead of building (the test suite, which has built them).
set -euo pipefail
cd "$(dirname "$0")/.."
export PGOPTIONS="-c client_min_messages=warning"
CONFIG=examples/order-flow/idemhost.toml
PROVIDER_CONFIG=examples/order-flow/provider.toml
SCHEMA=order_demo

source scripts/private-servers.sh
cleanup() {
  kill ${HOST:-} ${PROV:-} 2>/dev/null || true
  servers_down
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
# Before the servers: a fresh machine gets Python (the server wheels) here too.
[ -n "${IDEMHOST_DEMO_PREBUILT:-}" ] || scripts/ensure-build-deps.sh
servers_up
NATS=$IDEMHOST_NATS__URL

if [ -n "${IDEMHOST_DEMO_PREBUILT:-}" ]; then
  BIN=$IDEMHOST_DEMO_PREBUILT/idemhost
  PROVIDER=$IDEMHOST_DEMO_PREBUILT/examples/order_flow_provider
else
  echo "== building the plugins, the host and the fake payment provider"
  scripts/build-plugins.sh
  cargo build --quiet -p idemhost-cli --bin idemhost && cargo build --quiet -p idemhost-bench --example order_flow_provider
  TARGET=$(scripts/target-dir.sh)
  BIN=$TARGET/debug/idemhost
  PROVIDER=$TARGET/debug/examples/order_flow_provider
fi

echo "== fresh schema $SCHEMA: host migrations, the example's tables, stock"
servers_psql -q -c "DROP SCHEMA IF EXISTS $SCHEMA CASCADE"
"$BIN" migrate --config "$CONFIG"
PGOPTIONS="$PGOPTIONS -c search_path=$SCHEMA" servers_psql -q -v ON_ERROR_STOP=1 \
  -f examples/order-flow/migrations/0001_inventory.sql \
  -f examples/order-flow/migrations/0002_order_flow.sql \
  -c "INSERT INTO inventory VALUES ('sku-1', 10, 0), ('sku-2', 10, 0), ('sku-3', 1, 0)"

LOG=$(mktemp -t idemhost-demo.XXXXXX.log)
PLOG=$(mktemp -t idemhost-provider.XXXXXX.log)
wait_running() { # log
  for _ in $(seq 900); do grep -q '"idemhost running"' "$1" && break; sleep 0.1; done
  grep -q '"idemhost running"' "$1" || { cat "$1"; echo "a process did not start" >&2; exit 1; }
}
"$BIN" --log-format json run --config "$CONFIG" --no-migrate 2>"$LOG" &
HOST=$!
# A cold start compiles the plugins (seconds for Python); later starts use the compile cache.
wait_running "$LOG"
"$PROVIDER" --config "$PROVIDER_CONFIG" 2>"$PLOG" &
PROV=$!
wait_running "$PLOG"

run=$(date +%s)
pub() { "$BIN" publish --nats-url "$NATS" "$@" >/dev/null; }
order() { echo "{\"orderId\":\"$1-$run\",\"sku\":\"$2\",\"quantity\":$3}"; }
echo "== publishing (order and message ids carry run $run)"
echo "-- o-1 (2 × sku-1) and o-2 (1 × sku-2)"
pub --subject demo.orders.placed --event-type OrderPlaced --id "evt-$run-1" "$(order o-1 sku-1 2)"
pub --subject demo.orders.placed --event-type OrderPlaced --id "evt-$run-2" "$(order o-2 sku-2 1)"
echo "-- the producer retries evt-$run-1: JetStream's duplicate window absorbs it"
pub --subject demo.orders.placed --event-type OrderPlaced --id "evt-$run-1" "$(order o-1 sku-1 2)"
echo "-- evt-$run-1 is delivered again past the broker (a replay): the marker decides"
pub --subject demo.orders.placed --event-type OrderPlaced --id "replay-$run-1" \
  --header "Idemhost-Message-Id: evt-$run-1" "$(order o-1 sku-1 2)"
echo "-- o-1 again under a NEW message id (a semantic duplicate): the business key decides"
pub --subject demo.orders.placed --event-type OrderPlaced --id "evt-$run-1b" "$(order o-1 sku-1 2)"
echo "-- o-3 wants 5 × sku-3, which has 1: a terminal failure, dead-lettered"
pub --subject demo.orders.placed --event-type OrderPlaced --id "evt-$run-3" "$(order o-3 sku-3 5)"
echo "-- o-4 is cancelled before it is placed: the cancellation wins"
pub --subject demo.orders.cancelled --event-type OrderCancelled --id "cancel-$run-4" "{\"orderId\":\"o-4-$run\"}"
sleep 0.5
pub --subject demo.orders.placed --event-type OrderPlaced --id "evt-$run-4" "$(order o-4 sku-2 1)"

psql_demo() { PGOPTIONS="$PGOPTIONS -c search_path=$SCHEMA" servers_psql "$@"; }
for _ in $(seq 300); do
  done_=$(psql_demo -tAc "SELECT (SELECT count(*) FROM notification) = 2 AND (SELECT count(*) FROM payment_attempt WHERE status = 'authorized') = 2 AND (SELECT count(*) FROM outbox_message) = 0")
  [ "$done_" = t ] && break
  sleep 0.1
done
sleep 1
kill -TERM $HOST $PROV; wait $HOST; wait $PROV; HOST= PROV=

echo "== per order: the chain of effects"
psql_demo -c "
SELECT o.order_id,
       coalesce(s.status, '-') AS state,
       coalesce(r.sku || ' × ' || r.quantity || ' ' || r.status, '-') AS reservation,
       coalesce(p.idempotency_key || ' ' || p.status, '-') AS payment,
       coalesce(a.authorization_id, '-') AS provider,
       CASE WHEN n.order_id IS NULL THEN '-' ELSE 'sent' END AS notification,
       (SELECT count(*) FROM order_analytics x WHERE x.order_id = o.order_id) AS analytics
FROM (SELECT DISTINCT order_id FROM order_analytics UNION SELECT order_id FROM order_state) o
LEFT JOIN order_state s USING (order_id)
LEFT JOIN inventory_reservation r USING (order_id)
LEFT JOIN payment_attempt p USING (order_id)
LEFT JOIN provider_authorization a USING (order_id)
LEFT JOIN notification n USING (order_id)
ORDER BY o.order_id"
echo "== each delivery's outcome"
python3 - "$LOG" "$PLOG" <<'PY'
import json, sys
for path in sys.argv[1:]:
    for line in open(path):
        try: v = json.loads(line)
        except ValueError: continue
        if "outcome" in v and v.get("message") in ("delivery done", "delivery failed; dead-lettering"):
            s = v.get("span", {})
            print(f"  {s.get('consumer',''):<26} {s.get('message_id','')[:58]:<58} {v['outcome']:<17} {v.get('reason','')}")
PY
echo "== markers and inventory"
psql_demo -c "SELECT consumer_name, count(*) AS markers FROM processed_message GROUP BY 1 ORDER BY 1" \
  -c "SELECT sku, available, reserved FROM inventory ORDER BY sku"
echo "== operator view: prove marker and effect, marker growth, the dead letters"
"$BIN" check --config "$CONFIG" --consumer inventory-reservation-v1 --message-id "evt-$run-1" --effect-param "o-1-$run"
"$BIN" markers stats --config "$CONFIG"
"$BIN" dlq list --config "$CONFIG" --consumer inventory-reservation-v1 --limit 5
echo "host log: $LOG  provider log: $PLOG"
