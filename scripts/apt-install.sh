#!/usr/bin/env bash
# Installs Debian packages (as root, or through sudo), refreshing the package lists only when
# the first attempt fails.
#   scripts/apt-install.sh PACKAGE...
set -euo pipefail
sudo=()
[ "$(id -u)" = 0 ] || sudo=(sudo)
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null \
  || { "${sudo[@]}" apt-get update -q >/dev/null &&
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null; }
