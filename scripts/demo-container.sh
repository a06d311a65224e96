#!/usr/bin/env bash
# The order demo inside the container: builds the image (scripts/build-image.sh), prepares the
# schema on the machine's PostgreSQL, runs the image with podman against the machine's
# PostgreSQL and NATS, publishes OrderPlaced events (one of them twice past the broker), waits for
# /readyz and the outcomes, stops the container with SIGTERM (it drains and exits 0) and prints
# the markers and the inventory.
#
# Here podman runs only as `podman --runtime runc run --network=host --ulimit nofile=1024:1024
# --ulimit nproc=1000:1000 ...` (crun fails on this cgroup setup; higher ulimits are refused).
# Elsewhere the plain equivalent is
#   docker run --rm --network=host --read-only localhost/idemhost:latest
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-localhost/idemhost:latest}
NAME=idemhost-demo
PORT=${PORT:-19464}
export PGOPTIONS="-c client_min_messages=warning"
scripts/build-image.sh

echo "== schema container_demo: the example's inventory and stock (the host migrates its own table)"
psql -q -X -h 127.0.0.1 -d test -c "DROP SCHEMA IF EXISTS container_demo CASCADE"
psql -q -X -h 127.0.0.1 -d test -v ON_ERROR_STOP=1 -f examples/container/init.sql

podman rm -f "$NAME" >/dev/null 2>&1 || true
start=$(date +%s%N)
# Without systemd podman cannot schedule the image's HEALTHCHECK timer and says so on stderr;
# the check itself runs below with `podman healthcheck run`.
podman --runtime runc run -d --name "$NAME" --network=host --read-only \
  --ulimit nofile=1024:1024 --ulimit nproc=1000:1000 \
  -e IDEMHOST_ADMIN__LISTEN="127.0.0.1:$PORT" \
  "$IMAGE" >/dev/null 2>&1
trap 'podman rm -f "$NAME" >/dev/null 2>&1 || true' EXIT
BIN=target/image/idemhost
until "$BIN" health --url "http://127.0.0.1:$PORT/readyz" --timeout 1s >/dev/null 2>&1; do
  [ $(( ($(date +%s%N) - start) / 1000000000 )) -lt 60 ] || { podman logs "$NAME"; exit 1; }
  sleep 0.05
done
echo "== ready after $(( ($(date +%s%N) - start) / 1000000 )) ms (podman run to /readyz 200)"
echo "   HEALTHCHECK: $(podman healthcheck run "$NAME" 2>/dev/null && echo healthy)"

run=$(date +%s)
pub() { "$BIN" publish --subject container.orders.placed --event-type OrderPlaced "$@" >/dev/null; }
pub --id "c-$run-1" "{\"id\":\"c-$run-1\",\"orderId\":\"o-1\",\"sku\":\"sku-1\",\"quantity\":2}"
pub --id "c-$run-2" "{\"id\":\"c-$run-2\",\"orderId\":\"o-2\",\"sku\":\"sku-2\",\"quantity\":1}"
pub --id "replay-$run-1" --header "Idemhost-Message-Id: c-$run-1" \
  "{\"id\":\"c-$run-1\",\"orderId\":\"o-1\",\"sku\":\"sku-1\",\"quantity\":2}"
pub --id "c-$run-3" "{\"id\":\"c-$run-3\",\"orderId\":\"o-3\",\"sku\":\"sku-3\",\"quantity\":5}"
for _ in $(seq 200); do
  [ "$(podman logs "$NAME" 2>&1 | grep -c '"outcome"')" -ge 4 ] && break
  sleep 0.1
done

echo "== podman stop (SIGTERM): drain, exit code"
podman stop -t 30 "$NAME" >/dev/null 2>&1
echo "   exit code $(podman inspect "$NAME" --format '{{.State.ExitCode}}'), runs as uid $(podman inspect "$NAME" --format '{{.Config.User}}')"
echo "== outcomes"
podman logs "$NAME" 2>&1 | python3 -c "$(cat <<'PY'
import json, sys
for line in sys.stdin:
    try:
        v = json.loads(line)
    except ValueError:
        continue
    if "outcome" in v:
        mid = v.get("span", {}).get("message_id", "")
        print(f"  {mid:<22} {v['outcome']:<18} {v.get('reason', '')}")
PY
)"
echo "== markers and inventory"
PGOPTIONS="$PGOPTIONS -c search_path=container_demo" psql -X -h 127.0.0.1 -d test \
  -c "SELECT consumer_name, message_id FROM processed_message ORDER BY message_id" \
  -c "SELECT sku, available, reserved FROM inventory ORDER BY sku"
