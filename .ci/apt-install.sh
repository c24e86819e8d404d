#!/usr/bin/env bash
# Sourced by the .ci/*-deps.sh scripts: `apt_install PACKAGE...` installs the Debian packages given (the ones
# a script found missing), or says how to when not run as root.
apt_install() {
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing Debian packages: $* (run as root, or install them: apt-get install $*)" >&2
    exit 1
  fi
  echo "installing Debian packages: $*"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}
