# shellcheck shell=bash
# A PostgreSQL server for the storage tests, from Debian's packages.
#
#   source .ci/postgres.sh        # installs if absent, starts a cluster, exports RLPROXY_TEST_PG_URL
#   bash .ci/postgres.sh          # the same, and prints the URL
#
# Idempotent: an installed package, a running cluster, an existing role/database are left as they
# are. Runs as root (apt-get, then the server as the `postgres` user) or as a user with sudo.
# The role may create databases: the tests make fresh databases and drop them after.
# With CI=true (or RLPROXY_PG_FAST=1) the server is set to skip fsync: only for throwaway servers.

rlproxy_pg_setup() {
  local user="${RLPROXY_PG_USER:-rlproxy}" pass="${RLPROXY_PG_PASSWORD:-rlproxy}"
  local db="${RLPROXY_PG_DB:-rlproxy_test}" port="${RLPROXY_PG_PORT:-5432}"
  local sudo="" ver as_pg=(runuser -u postgres --)
  [ "$(id -u)" = 0 ] || { sudo="sudo"; as_pg=(sudo -u postgres); }

  if ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
    echo "postgres.sh: installing PostgreSQL from Debian's packages" >&2
    $sudo apt-get update -qq >&2 || return 1
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq postgresql >&2 || return 1
  fi
  ver="$(ls /usr/lib/postgresql | sort -n | tail -1)"

  if command -v pg_lsclusters >/dev/null 2>&1; then
    # Debian's wrapper: one cluster "main" per version (the package creates it).
    if ! pg_lsclusters -h | awk -v v="$ver" '$1 == v && $2 == "main"' | grep -q .; then
      $sudo pg_createcluster --port "$port" "$ver" main >&2 || return 1
    fi
    port="$(pg_lsclusters -h | awk -v v="$ver" '$1 == v && $2 == "main" {print $3}')"
    if ! pg_lsclusters -h | awk -v v="$ver" '$1 == v && $2 == "main" {print $4}' | grep -q online; then
      $sudo pg_ctlcluster "$ver" main start >&2 || return 1
    fi
  else
    # No wrapper: a cluster of our own under /var/tmp, run by the postgres user.
    local bin="/usr/lib/postgresql/$ver/bin" data="/var/tmp/rlproxy-pg-$ver"
    if [ ! -s "$data/PG_VERSION" ]; then
      $sudo mkdir -p "$data" && $sudo chown postgres: "$data" || return 1
      "${as_pg[@]}" "$bin/initdb" -D "$data" -A trust >&2 || return 1
    fi
    if ! "${as_pg[@]}" "$bin/pg_ctl" -D "$data" status >/dev/null 2>&1; then
      "${as_pg[@]}" "$bin/pg_ctl" -D "$data" -l "$data/server.log" -w \
        -o "-p $port -k /tmp" start >&2 || return 1
    fi
  fi

  local i
  for i in $(seq 1 30); do
    pg_isready -q -h 127.0.0.1 -p "$port" && break
    sleep 1
  done
  pg_isready -q -h 127.0.0.1 -p "$port" || { echo "postgres.sh: server not ready" >&2; return 1; }

  local psql=(psql -w -h 127.0.0.1 -p "$port" -U postgres -v ON_ERROR_STOP=1 -qtA)
  # Connect as the superuser over the local socket (peer auth) when TCP needs a password.
  if ! PGCONNECT_TIMEOUT=5 "${psql[@]}" -c 'SELECT 1' >/dev/null 2>&1; then
    psql=("${as_pg[@]}" psql -p "$port" -v ON_ERROR_STOP=1 -qtA)
  fi
  if [ "$("${psql[@]}" -c "SELECT 1 FROM pg_roles WHERE rolname = '$user'")" != 1 ]; then
    "${psql[@]}" -c "CREATE ROLE \"$user\" LOGIN CREATEDB PASSWORD '$pass'" >&2 || return 1
  fi
  if [ "$("${psql[@]}" -c "SELECT 1 FROM pg_database WHERE datname = '$db'")" != 1 ]; then
    "${psql[@]}" -c "CREATE DATABASE \"$db\" OWNER \"$user\"" >&2 || return 1
  fi
  if [ "${CI:-}" = true ] || [ "${RLPROXY_PG_FAST:-}" = 1 ]; then
    # A throwaway test server: skip the fsyncs (each CREATE DATABASE and commit waits on the disk).
    "${psql[@]}" -c "ALTER SYSTEM SET fsync = off" -c "ALTER SYSTEM SET synchronous_commit = off" \
      -c "ALTER SYSTEM SET full_page_writes = off" -c "SELECT pg_reload_conf()" >/dev/null || return 1
  fi
  export RLPROXY_TEST_PG_URL="postgresql+asyncpg://$user:$pass@127.0.0.1:$port/$db"
  echo "postgres.sh: RLPROXY_TEST_PG_URL=$RLPROXY_TEST_PG_URL" >&2
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  rlproxy_pg_setup || exit 1
  echo "$RLPROXY_TEST_PG_URL"
else
  rlproxy_pg_setup
fi
