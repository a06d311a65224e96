# Sourced by scripts/bench-replicas.sh when CLUSTER is set: starts a private 3-node JetStream
# cluster on loopback (stopped when the script exits) and sets CLUSTER_URLS and NATS_SERVER.
# The machine's nats-server, or with SERVERS=new nats-server 2.15 (scripts/servers.sh).
NATS_SERVER=${NATS_SERVER:-/usr/sbin/nats-server}
if [ "${SERVERS:-}" = new ]; then
  while IFS= read -r line; do export "${line?}"; done < <(scripts/servers.sh)
  NATS_SERVER=$IDEMHOST_TEST_NATS_SERVER
fi
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
CLUSTER_DIR=$(mktemp -d /tmp/idemhost-bench-cluster.XXXXXX)
CLUSTER_PIDS=()
stop_cluster() {
  for pid in "${CLUSTER_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$CLUSTER_DIR"
}
trap stop_cluster EXIT
ports=() routes=()
for i in 0 1 2; do
  ports+=("$(free_port)")
  routes+=("nats://127.0.0.1:$(free_port)")
done
all_routes=$(IFS=,; echo "${routes[*]}")
for i in 0 1 2; do
  "$NATS_SERVER" -a 127.0.0.1 -p "${ports[$i]}" -n "bench-$i" -js --cluster_name idemhost-bench \
    -cluster "${routes[$i]}" -routes "$all_routes" -sd "$CLUSTER_DIR/n$i" >"$CLUSTER_DIR/n$i.log" 2>&1 &
  CLUSTER_PIDS+=($!)
done
CLUSTER_URLS=$(printf 'nats://127.0.0.1:%s,' "${ports[@]}")
CLUSTER_URLS=${CLUSTER_URLS%,}
# JetStream takes streams once the cluster has a metadata leader.
for _ in $(seq 100); do
  grep -q "metadata leader" "$CLUSTER_DIR"/n*.log && break
  sleep 0.2
done
