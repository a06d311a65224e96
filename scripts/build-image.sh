#!/usr/bin/env bash
# Builds the idemhost container image with podman: the static binary
# (x86_64-unknown-linux-musl, release unless IDEMHOST_IMAGE_PROFILE names another profile), the
# Rust inventory plugin, then the FROM scratch image of ./Containerfile. Installs what it needs
# (podman + runc, musl-tools, the Rust target) when missing. Prints the image's size.
#   IMAGE=name:tag                   the tag (default localhost/idemhost:latest)
#   IDEMHOST_IMAGE_BINARY=path       package this static binary instead of building one
#                                    (scripts/test.sh: the very binary its suite ran)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/ensure-build-deps.sh
IMAGE=${IMAGE:-localhost/idemhost:latest}

missing=()
command -v podman >/dev/null || missing+=(podman)
command -v runc >/dev/null || missing+=(runc)
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing ${missing[*]}"
  scripts/apt-install.sh "${missing[@]}"
fi

start=$SECONDS
if [ -n "${IDEMHOST_IMAGE_BINARY:-}" ]; then
  built=$IDEMHOST_IMAGE_BINARY
  echo "== static binary $built (prebuilt)"
else
  scripts/ensure-musl.sh
  # IDEMHOST_IMAGE_PROFILE: the cargo profile (default release). IDEMHOST_IMAGE_TARGET_DIR: a
  # target directory for this build alone; else cargo's own.
  profile=${IDEMHOST_IMAGE_PROFILE:-release}
  target=${IDEMHOST_IMAGE_TARGET_DIR:-$(scripts/target-dir.sh)}
  echo "== static binary (x86_64-unknown-linux-musl, $profile)"
  CARGO_TARGET_DIR=$target cargo build --quiet --profile "$profile" --target x86_64-unknown-linux-musl \
    -p idemhost-cli --bin idemhost
  built="$target"/x86_64-unknown-linux-musl/$( [ "$profile" = dev ] && echo debug || echo "$profile")/idemhost
fi
# The image gets a copy without symbols (a third of the size); the build keeps its own.
mkdir -p target/image
strip -o target/image/idemhost "$built"
bin=target/image/idemhost
echo "   built in $((SECONDS - start))s: $(stat -c %s "$bin") bytes stripped, $(file -b "$bin" | grep -o 'static[-a-z]* linked')"
scripts/build-plugins.sh rust >/dev/null

echo "== image $IMAGE"
podman build --quiet --format docker -t "$IMAGE" -f Containerfile . >/dev/null
podman image inspect "$IMAGE" --format '   {{.Id}} {{.Size}} bytes, user {{.Config.User}}' 2>/dev/null \
  || podman image ls "$IMAGE"
