#!/usr/bin/env bash
# The Debezium peer (bench/debezium, issue 38) still builds and runs: it is
# started once so that its slot exists, 100 rows are written, outboxd
# publishes them, then the peer streams the same rows from its slot; every
# keyed row's two records must be byte for byte the same (key, partition,
# value, headers but outbox-history, which Debezium's lack), keyless rows'
# but for the partition (each producer picks its own).
#
#   debezium_smoke.sh SOURCE_DIR OUTBOXD KAFKA_CLUSTER PEER_BUILD_DIR
set -euo pipefail
src=$1 outboxd=$2 cluster=$3 out=$4
cd "$src"
"$src/bench/debezium/build.sh" "$out" >/dev/null
. scripts/sandbox.sh
port=$((20000 + RANDOM % 20000))
SANDBOX_PG_OPTS="-c wal_level=logical -c listen_addresses=127.0.0.1 -c port=$port"
SANDBOX_KAFKA=real SANDBOX_KAFKA_NODES=1 SANDBOX_KAFKA_BINARY=$cluster
export PGPORT=$port
trap sandbox_stop EXIT
sandbox_start smoke.a:3
ci="host=127.0.0.1 port=$port user=postgres dbname=postgres"
mkdir -p "$work/dbz"
fail() { echo "debezium_smoke: $*" >&2; tail -n 20 "$work/dbz.err" >&2 || true; exit 1; }
peer() {
  java -cp "$(cat "$out/classpath")" outboxd.bench.DebeziumPeer --host 127.0.0.1 --port "$port" \
    --user postgres --dbname postgres --bootstrap "$bootstrap" --dir "$work/dbz" --tuned "$@" \
    >>"$work/dbz.out" 2>>"$work/dbz.err" &
  dbz=$!
  sandbox_track $dbz
}
# Its slot first: rows written before it are never streamed.
peer
for _ in $(seq 240); do grep -q '^ready' "$work/dbz.out" && break; sleep 0.5; done
grep -q '^ready' "$work/dbz.out" || fail "the peer did not start streaming"
kill -TERM $dbz
wait $dbz || true
psql -X -q -d "$ci" -c "SELECT outbox.enqueue('smoke.a',
    CASE WHEN g % 10 = 0 THEN NULL ELSE 'k' || (g % 7) END, convert_to('row ' || g, 'UTF8'),
    jsonb_build_object('traceparent', 'tp-' || g, 'n', g, 'zz', NULL::text,
                       'obj', jsonb_build_object('bb', 1.50, 'a', 'x'),
                       'arr', jsonb_build_array(1, 'two', true)))
  FROM generate_series(1, 100) g" >/dev/null
"$outboxd" -X "postgres.conninfo=$ci" -X "kafka.bootstrap.servers=$bootstrap" -X http.listen= \
  >"$work/relay.log" 2>&1 &
relay=$!
sandbox_track $relay
for _ in $(seq 120); do
  [ "$(psql -X -At -d "$ci" -c 'SELECT count(*) FROM outbox.unpublished')" = 0 ] && break
  sleep 0.5
done
kill -TERM $relay
wait $relay || true
peer --count 100
for _ in $(seq 120); do kill -0 $dbz 2>/dev/null || break; sleep 1; done
kill -0 $dbz 2>/dev/null && fail "the peer did not produce 100 records within 120 s"
grep -q '^produced 100$' "$work/dbz.out" || fail "the peer says: $(tail -n 1 "$work/dbz.out")"
kcat -C -b "$bootstrap" -t smoke.a -e -q -f '%k|%p|%h|%s\n' >"$work/records.txt"
psql -X -q -d "$ci" -c "SELECT pg_drop_replication_slot('dbz_outbox')" >/dev/null
python3 - "$work/records.txt" <<'PY'
import collections, sys
recs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    key, part, hdrs, value = line.rstrip('\n').split('|', 3)
    hdrs = [h for h in hdrs.split(',') if not h.startswith('outbox-history=')]
    ident = [h for h in hdrs if h.startswith('outbox-id=')][0]
    recs[ident].append((key, part, ','.join(hdrs), value))
pairs = [v for v in recs.values() if len(v) == 2]
keyed = [v for v in pairs if v[0][0]]
same = sum(v[0] == v[1] for v in keyed)
keyless = sum(v[0][0] == v[1][0] and v[0][2:] == v[1][2:] for v in pairs if not v[0][0])
print(f"debezium_smoke: {len(recs)} rows, {len(pairs)} published by both; keyed: {same} of "
      f"{len(keyed)} the same record; keyless: {keyless} of {len(pairs) - len(keyed)} the same "
      f"but the partition")
bad = [v for v in keyed if v[0] != v[1]]
if len(recs) != 100 or len(pairs) != 100 or bad or keyless != len(pairs) - len(keyed):
    print("differ:", bad[:1], file=sys.stderr)
    sys.exit(1)
PY
