#!/usr/bin/env bash
# Installs the Debian packages the test suite starts for real (PostgreSQL, Redis, Chromium, wrk),
# only those that are missing, so a machine that has them pays nothing.
set -euo pipefail
. "$(dirname "$0")/apt-install.sh"
need=()
[ -x /usr/bin/redis-server ] || need+=(redis-server)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
[ -x /usr/bin/chromium ] || need+=(chromium)
command -v wrk >/dev/null 2>&1 || need+=(wrk)
[ -x /usr/sbin/nginx ] || need+=(nginx)
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
apt_install "${need[@]}"
# Debian's postgresql package starts a cluster of its own; the tests start their own servers instead.
if command -v pg_ctlcluster >/dev/null 2>&1; then service postgresql stop >/dev/null 2>&1 || true; fi
if command -v redis-cli >/dev/null 2>&1; then service redis-server stop >/dev/null 2>&1 || true; fi
if [ -x /usr/sbin/nginx ]; then service nginx stop >/dev/null 2>&1 || true; fi
