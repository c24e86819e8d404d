#!/usr/bin/env bash
# The image's base where no image registry can be reached: Debian bookworm from Debian's own packages
# (debootstrap, minbase variant) plus Python 3.11, its venv module and CA certificates, imported into podman as TAG.
# (python3-distutils by name: debootstrap does not resolve the virtual package python3.11-distutils.)
# Cached: does nothing when TAG already exists. Needs root (debootstrap) and podman.
set -euo pipefail
TAG=${1:-tokenpools-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if podman image exists "$TAG"; then
  echo "$TAG exists (podman rmi $TAG to rebuild it)"
  exit 0
fi
for tool in debootstrap podman; do
  command -v "$tool" >/dev/null || { echo "$tool not found: make image-deps" >&2; exit 1; }
done
root=$(mktemp -d /var/tmp/tokenpools-base.XXXXXX)
cleanup() {
  # debootstrap mounts proc and sys in the new root; a failed run may leave them mounted.
  for mnt in $(awk -v r="$root" 'index($2, r) == 1 {print $2}' /proc/self/mounts | sort -r); do
    umount -l "$mnt" || true
  done
  rm -rf --one-file-system "$root" "$root.log"
}
trap cleanup EXIT
debootstrap --variant=minbase --include=python3.11,python3-venv,python3-distutils,ca-certificates \
  bookworm "$root" "$MIRROR" >"$root.log" 2>&1 || { tail -30 "$root.log" >&2; exit 1; }
# What an image never needs: package lists and caches, documentation, manuals, translations.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/cache/debconf/*-old \
  "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* \
  "$root"/var/log/*.log "$root"/var/log/apt/*
tar -C "$root" --numeric-owner --one-file-system -c . | podman import \
  --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$TAG" >/dev/null
echo "$TAG built: $(podman image inspect --format '{{.Size}}' "$TAG") bytes"
