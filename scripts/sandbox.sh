# Sourced by scripts/demo and bench/: a throwaway PostgreSQL and the mock
# Kafka cluster in a temporary directory, stopped again by sandbox_stop (the
# callers run it from an EXIT trap, so Ctrl-C and errors clean up too).
#
# After sandbox_start: $work, $conninfo, $bootstrap are set. SANDBOX_BROKER
# names the mock broker binary (default: the test build's).
# SANDBOX_KAFKA=real starts a real Apache Kafka cluster instead (3 KRaft
# nodes, replication factor 3, min.insync.replicas 2: the test build's
# obx-kafka-cluster, or SANDBOX_KAFKA_BINARY; SANDBOX_KAFKA_NODES=1 for one
# node).

sandbox_pids=()
pg_bin=$(pg_config --bindir)

as_server() { # Postgres refuses to run as root; its user may not enter the checkout
  if [ "$(id -u)" -eq 0 ]; then (cd / && runuser -u postgres -- "$@"); else "$@"; fi
}

# sandbox_start TOPIC:PARTITIONS...
sandbox_start() {
  work=$(mktemp -d /tmp/outboxd-XXXXXX)
  chmod 755 "$work"
  [ "$(id -u)" -eq 0 ] && chown postgres "$work"
  as_server "$pg_bin/initdb" -D "$work/pgdata" -A trust -U postgres --no-sync >/dev/null
  as_server "$pg_bin/pg_ctl" -D "$work/pgdata" -l "$work/postgres.log" -w \
    -o "-k $work -c listen_addresses= -c fsync=off ${SANDBOX_PG_OPTS:-}" start >/dev/null
  conninfo="host=$work user=postgres dbname=postgres"
  local f t args=()
  for f in sql/*.sql; do
    psql -X -q -v ON_ERROR_STOP=1 -d "$conninfo" -f "$f"
  done
  for t in "$@"; do args+=(-t "$t"); done
  local broker=${SANDBOX_BROKER:-build/tests/obx-mock-broker} tries=100
  if [ "${SANDBOX_KAFKA:-mock}" = real ]; then
    broker=${SANDBOX_KAFKA_BINARY:-build/tests/obx-kafka-cluster} tries=1200
    args+=(-n "${SANDBOX_KAFKA_NODES:-3}" -d "$work/kafka")
  fi
  "$broker" ${SANDBOX_BROKER_OPTS:-} "${args[@]}" -f "$work/bootstrap" </dev/null \
    >"$work/broker.log" 2>&1 &
  sandbox_pids+=($!)
  for _ in $(seq "$tries"); do
    [ -s "$work/bootstrap" ] && break
    kill -0 "${sandbox_pids[-1]}" 2>/dev/null || break
    sleep 0.1
  done
  if [ ! -s "$work/bootstrap" ]; then
    echo "sandbox: $broker did not start; its log:" >&2
    tail -n 20 "$work/broker.log" >&2
    return 1
  fi
  bootstrap=$(cat "$work/bootstrap")
}

# Remembers a background process to stop in sandbox_stop.
sandbox_track() { sandbox_pids+=("$1"); }

sandbox_stop() {
  set +e
  local pid
  for pid in "${sandbox_pids[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${sandbox_pids[@]}"; do wait "$pid" 2>/dev/null; done
  if [ -n "${work:-}" ] && [ -f "$work/pgdata/postmaster.pid" ]; then
    as_server "$pg_bin/pg_ctl" -D "$work/pgdata" -m fast -w stop >/dev/null 2>&1
  fi
  [ -n "${work:-}" ] && rm -rf "$work"
}

q() { psql -X -At -d "$conninfo" -c "$1"; }
