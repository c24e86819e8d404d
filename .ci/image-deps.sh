#!/usr/bin/env bash
# The Debian packages `make image` and `make test-image` need: podman with runc (this kind of machine's
# cgroups v1/v2 hybrid is refused by crun) and debootstrap for the base image; only those that are missing.
set -euo pipefail
. "$(dirname "$0")/apt-install.sh"
need=()
command -v podman >/dev/null 2>&1 || need+=(podman)
command -v runc >/dev/null 2>&1 || need+=(runc)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
apt_install "${need[@]}"
