#!/usr/bin/env bash
# System packages the test suite drives for real: Debian's docker.io and mmdebstrap (the image test)
# and postgresql (the async queue's shared store); openssl, iproute2 and util-linux for the docs'
# blocks (docs/tls.md makes a CA; each document's blocks run in a network namespace of their own).
# Installs only what is missing; needs root and apt.
set -euo pipefail

wanted=()
command -v dockerd >/dev/null 2>&1 || wanted+=(docker.io)
command -v mmdebstrap >/dev/null 2>&1 || wanted+=(mmdebstrap)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || wanted+=(postgresql)
command -v openssl >/dev/null 2>&1 || wanted+=(openssl)
command -v ip >/dev/null 2>&1 || wanted+=(iproute2)
command -v unshare >/dev/null 2>&1 || wanted+=(util-linux)

if [ ${#wanted[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: missing ${wanted[*]}; install them with your package manager (apt-get as root here)" >&2
  exit 1
fi
echo "system-deps: installing ${wanted[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${wanted[@]}"
