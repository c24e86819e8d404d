#!/bin/sh
# PostgreSQL for the compose file: a cluster made on the first start in $PGDATA (a volume), with the role and
# database of POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB (the official image's variables), password
# authentication from other containers, then the server in the foreground (SIGINT from `stop`: a fast shutdown).
set -eu
: "${POSTGRES_USER:=tokenpools}" "${POSTGRES_DB:=$POSTGRES_USER}"
: "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
  initdb -D "$PGDATA" --username="$POSTGRES_USER" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
    --encoding=UTF8 --locale=C.UTF-8 >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  if [ "$POSTGRES_DB" != "postgres" ]; then
    pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
    createdb --username="$POSTGRES_USER" "$POSTGRES_DB"
    pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
  fi
fi
exec postgres -D "$PGDATA" -c listen_addresses='*' -c unix_socket_directories=/run/postgresql
