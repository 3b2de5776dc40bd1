/*
 * obx-bench: outboxd against the limits of the systems it sits between,
 * measured side by side in one run on one machine (issue 4). Prints one
 * Markdown table. Run it through bench/run, which starts a throwaway
 * PostgreSQL and the mock broker (topics bench:12 and lat:12).
 *
 *   obx-bench --conninfo C --bootstrap B --outboxd PATH [--malloc-count LIB]
 *             [--rows N] [--latency-seconds S]
 *
 * 0. The job's limit: the cheapest statement pair that does the job
 *    (SELECT the unsent rows in id order, LIMIT 1000; UPDATE ... SET
 *    sent_at, or DELETE, WHERE id = ANY), pipelined on one connection, no
 *    Kafka. The drain is measured against it.
 * 1. Postgres-side cost of outboxd's own fetch and mark statements (taken
 *    from its code), one connection, batches of 1000, no Kafka.
 *    For 0, 1 and 3: Postgres WAL bytes per row and the backend's CPU per
 *    1,000 rows.
 * 2. Kafka-side limit: a bare idempotent producer with the same records.
 * 3. outboxd drain: N pre-filled rows relayed by the real binary.
 * 4. Latency: one event per transaction at fixed rates; commit -> record
 *    read by a consumer in this process, on one clock.
 * 5. Footprint of the outboxd process.
 * Then the three modes side by side (relay.on_sent = mark, delete, log):
 *    drain against its mode's job (log mode's is the minimal keyset SELECT
 *    alone), the machine's CPU per row of the two halves alone over the
 *    drain's (/proc/stat: every process), WAL bytes and dead row versions
 *    per row, the relay's backend CPU, p99 at 1,000 rows/s, and a held
 *    xmin horizon of OBX_BENCH_TABLE_HORIZON seconds (120) at 1,000 rows/s.
 *
 * Each outboxd started here serves /metrics on a port of its own (not
 * http.listen's default), so a second benchmark on the machine can neither
 * block it nor answer for it.
 *
 * What the application's database does to the relay, each run alone
 * instead of the table above (bench/run passes the environment through):
 *
 * OBX_BENCH_HORIZON=mark|delete|log [OBX_BENCH_HORIZON_SECONDS=300]
 *    A held xmin horizon: one more session keeps a REPEATABLE READ snapshot
 *    (BEGIN; SELECT count(*) FROM outbox.kafka_offsets) for the whole run,
 *    as a report or pg_dump does, while writers commit 1,000 rows/s with
 *    outbox.enqueue and the real outboxd relays them. Prints the latency of
 *    4. for the first 10 s and every minute of commits, last minute's p99
 *    over the first's, n_dead_tup of outbox.events at the end, and the
 *    relay's backend CPU per 1,000 rows (each minute and over the run).
 *    Minute N goes to topic lat-N (bench/run creates them): on one topic
 *    the mock broker's fetches slow down as its log grows, and latency
 *    grew over two minutes with no horizon held at all.
 *    OBX_BENCH_HORIZON_HOLD=0: the same run with nothing held (control).
 *    OBX_BENCH_SAMPLES=FILE: every sample to FILE, "seconds latency-ms".
 * OBX_BENCH_PLOT=DIR (bench/run sets it)
 *    The first drain of each mode over time with the job's limit
 *    (drain-MODE.dat, limit-MODE.dat) and the latency distribution of each
 *    rate (latency-RATE.dat), for bench/plot.gp.
 * OBX_BENCH_LATENCY_ONLY=N
 *    Only the latency rows of the table (100, 1,000 and 5,000 rows/s), N s each.
 * OBX_BENCH_HELD=N,N,...
 *    What N keys held back behind refused rows cost outboxd's fetches and
 *    the relay's lookups (held.c).
 * OBX_BENCH_OPEN_WRITER=mark|delete (--rows N)
 *    One writing transaction open during a drain: the drain of 3. without
 *    (a) and with (b) a session that took an xid before the prefill
 *    (BEGIN; SELECT pg_current_xact_id()) and rolls back only after the
 *    drain, PAIRS pairs in alternating order. Prints rates, their ratio
 *    (b)/(a) and the CPU per row of the relay's backend and of outboxd
 *    (steadier than rates on a few shared cores).
 * OBX_BENCH_REAL=ROUNDS (--rows N), against a real Apache Kafka cluster
 * (bench/run --kafka real; OBX_BENCH_BROKER_PIDS: its JVMs)
 *    ROUNDS rounds of the Kafka-side limit (2.) and outboxd's drain in mark
 *    mode (3.), idempotent and with relay.transactions (alternating), each
 *    with its rate and CPU per row: the relay, its Postgres backend, the
 *    brokers, the whole machine, and the transactions a second; then
 *    ROUNDS rounds of the bare producer's latency at 1,000 rows/s and
 *    outboxd's, both ways. OBX_BENCH_X=relay.transaction_rows=N sets the
 *    transactions' size.
 * OBX_BENCH_SHARDS=ROUNDS (--rows N) [OBX_BENCH_SHARDS_MODE=mark|delete|log]
 *    Several active relays (relay.shards, mark mode by default): the drain of N rows
 *    by a single relay (relay.shards = 1), and by 1, 2 and 4 relays
 *    sharing 8 slots, in a rotating order each round; the median rate and
 *    machine CPU per row of each over ROUNDS rounds. Then 20 handovers
 *    under a writer (2 relays; one leaves by SIGTERM and comes back, ten
 *    times): from the signal, and from the restart, until the slots are
 *    spread again and no relay is still recovering them.
 */
#include "bench.h"
#include "outboxd/buf.h"
#include "outboxd/config.h"
#include "outboxd/maint.h"
#include "outboxd/pg.h"
#include "outboxd/store.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <time.h>
#include <unistd.h>

#include <libpq-fe.h>
#include <librdkafka/rdkafka.h>

double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* The outboxd we started and have not stopped: an error or a signal here
 * stops it too, or it would live on holding its port. */
volatile sig_atomic_t live_relay;

_Noreturn void die(const char *what, const char *detail)
{
    fprintf(stderr, "obx-bench: %s: %s\n", what, detail ? detail : "");
    if (live_relay > 0)
        kill((pid_t)live_relay, SIGTERM);
    exit(1);
}

static void on_fatal_signal(int sig)
{
    if (live_relay > 0)
        kill((pid_t)live_relay, SIGTERM);
    signal(sig, SIG_DFL);
    raise(sig);
}

PGconn *connect_db(const struct opts *o)
{
    /* Named from the start, so that peer.c tells it from the relays' sessions. */
    const char *keys[] = {"dbname", "application_name", NULL};
    const char *values[] = {o->conninfo, "obx-bench", NULL};
    PGconn *c = PQconnectdbParams(keys, values, 1);
    if (PQstatus(c) != CONNECTION_OK)
        die("connect", PQerrorMessage(c));
    /* The benchmark's looks at the outbox (is it drained?) read by index, as
     * the relay's sessions do: by sequential scan, outbox.unpublished on a
     * table log mode has grown took up to a second a look, charged to the
     * drain it was timing. */
    PGresult *r = PQexec(c, OBX_STORE_SQL_READ_BY_INDEX);
    if (PQresultStatus(r) != PGRES_COMMAND_OK)
        die("connect", PQresultErrorMessage(r));
    PQclear(r);
    return c;
}

void exec_ok(PGconn *c, const char *sql)
{
    PGresult *r = PQexec(c, sql);
    if (PQresultStatus(r) != PGRES_COMMAND_OK && PQresultStatus(r) != PGRES_TUPLES_OK)
        die(sql, PQresultErrorMessage(r));
    PQclear(r);
}

long long query_int(PGconn *c, const char *sql)
{
    PGresult *r = PQexec(c, sql);
    if (PQresultStatus(r) != PGRES_TUPLES_OK)
        die(sql, PQresultErrorMessage(r));
    long long v = strtoll(PQgetvalue(r, 0, 0), NULL, 10);
    PQclear(r);
    return v;
}

/* N rows like the issue's workload: 200-byte payloads (or `payload` bytes),
 * 3 headers counting outbox-id, 300 keys. */
static void prefill(PGconn *c, int rows, int payload)
{
    char sql[1024];
    snprintf(sql, sizeof(sql),
             "INSERT INTO outbox.events (topic, key, payload, headers)"
             " SELECT 'bench', 'key-' || (g %% %d), convert_to(rpad(g::text, %d, 'x'), 'UTF8'),"
             " jsonb_build_object('traceparent', '00-' || md5(g::text) || '-' ||"
             "   left(md5('s' || g), 16) || '-01', 'source', 'bench')"
             " FROM generate_series(1, %d) g",
             KEYS, payload, rows);
    exec_ok(c, sql);
}

/* Each measurement starts from a clean table and no vacuum or checkpoint
 * debt left by the one before. */
void settle(PGconn *c)
{
    exec_ok(c, "TRUNCATE outbox.events, outbox.kafka_offsets, outbox.log_cursor");
    exec_ok(c, "VACUUM ANALYZE outbox.events");
    exec_ok(c, "CHECKPOINT");
}

/* What a run cost Postgres: WAL written and the serving backend's CPU. */
struct pg_cost {
    double rows_per_s;
    double wal_per_row;   /* bytes */
    double cpu_ms_per_1k; /* backend CPU per 1,000 rows */
    double machine_us;    /* the whole machine's CPU per row (all processes) */
};

/* The whole machine's busy CPU time so far, in seconds (/proc/stat: every
 * process on every core, Postgres, the mock broker and us included). */
double machine_cpu_s(void)
{
    FILE *f = fopen("/proc/stat", "r");
    unsigned long long v[8] = {0};
    if (!f || fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3],
                     &v[4], &v[5], &v[6], &v[7]) != 8) {
        if (f)
            fclose(f);
        return 0;
    }
    fclose(f);
    /* user nice system (idle iowait) irq softirq steal */
    return (double)(v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / (double)sysconf(_SC_CLK_TCK);
}

/* The mode's name. */
const char *mode_name(int on_sent)
{
    return on_sent == OBX_ON_SENT_DELETE ? "delete" : on_sent == OBX_ON_SENT_LOG ? "log" : "mark";
}

char *wal_lsn(PGconn *c, char *buf, size_t len)
{
    /* The insert position, not pg_current_wal_lsn() (what is written out):
     * a big INSERT's last few MB can still wait in the WAL buffers, and a
     * drain measured from the written position counted them (21 bytes a
     * row of a prefill of 200,000 rows, in every mode). */
    PGresult *r = PQexec(c, "SELECT pg_current_wal_insert_lsn()");
    if (PQresultStatus(r) != PGRES_TUPLES_OK)
        die("pg_current_wal_insert_lsn", PQresultErrorMessage(r));
    snprintf(buf, len, "%s", PQgetvalue(r, 0, 0));
    PQclear(r);
    return buf;
}

double wal_since(PGconn *c, const char *lsn)
{
    char sql[160];
    snprintf(sql, sizeof(sql), "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '%s')::bigint",
             lsn);
    return (double)query_int(c, sql);
}

/* A Postgres-side run: a prefilled, analyzed table, and the starting WAL
 * position and backend CPU of the connection that will drain it. */
static double cost_machine0; /* machine_cpu_s() when the measurement began */

static PGconn *cost_start(const struct opts *o, int payload, char *lsn, size_t lsn_len,
                          double *cpu0)
{
    PGconn *c = connect_db(o);
    settle(c);
    prefill(c, o->rows, payload);
    exec_ok(c, "VACUUM ANALYZE outbox.events");
    wal_lsn(c, lsn, lsn_len);
    *cpu0 = backend_cpu_s(PQbackendPID(c));
    cost_machine0 = machine_cpu_s();
    return c;
}

static struct pg_cost cost_finish(PGconn *c, long done, double t0, const char *lsn, double cpu0,
                                  struct obx_pg_array *ids)
{
    double t = now_s() - t0;
    struct pg_cost cost = {.rows_per_s = (double)done / t};
    cost.machine_us = (machine_cpu_s() - cost_machine0) * 1e6 / (double)done;
    cost.cpu_ms_per_1k = (backend_cpu_s(PQbackendPID(c)) - cpu0) * 1e6 / (double)done;
    cost.wal_per_row = wal_since(c, lsn) / (double)done;
    obx_pg_array_free(ids);
    exec_ok(c, "TRUNCATE outbox.events, outbox.kafka_offsets, outbox.log_cursor");
    PQfinish(c);
    return cost;
}

/* A binary int8 value. */
static int64_t int8_at(const char *v)
{
    const unsigned char *p = (const unsigned char *)v;
    uint64_t id = 0;
    for (int b = 0; b < 8; b++)
        id = (id << 8) | p[b];
    return (int64_t)id;
}

/* The ids (binary int8, column 0) of a fetch result into `list` (room for
 * BATCH); outboxd's fetches also bring a row without an id that carries
 * their snapshot (copied into `snap` if given). Returns the number of ids,
 * and the highest one in *top (if given). */
static int collect_ids_top(PGresult *r, int64_t *list, char *snap, size_t snap_len, int64_t *top)
{
    int n = PQntuples(r), got = 0;
    for (int i = 0; i < n && got < BATCH; i++) {
        if (PQgetisnull(r, i, 0)) {
            if (snap && PQnfields(r) > 7)
                snprintf(snap, snap_len, "%s", PQgetvalue(r, i, 7));
            continue;
        }
        int64_t id = int8_at(PQgetvalue(r, i, 0));
        list[got++] = id;
        if (top && id > *top)
            *top = id;
    }
    return got;
}

static int collect_ids(PGresult *r, int64_t *list)
{
    return collect_ids_top(r, list, NULL, 0, NULL);
}

/* ---- 0. the job's limit: the minimal statement pair ---- */

static PGresult *next_result(PGconn *c)
{
    PGresult *r;
    while (!(r = PQgetResult(c)))
        ; /* pipeline: NULL separates the results of two statements */
    return r;
}

/* Log mode's job: the minimal keyset SELECT alone, nothing written. */
static struct pg_cost job_limit_log(const struct opts *o, int payload)
{
    static const char fetch[] = "SELECT id, topic, key, payload, headers, created_at"
                                " FROM outbox.events WHERE id > $1::bigint ORDER BY id LIMIT 1000";
    char lsn[64], after[24];
    double cpu0;
    PGconn *c = cost_start(o, payload, lsn, sizeof(lsn), &cpu0);
    exec_ok(c, "SET enable_seqscan = off; SET enable_bitmapscan = off; SET jit = off");
    struct obx_pg_array ids = {0};
    long done = 0;
    int64_t top = INT64_MIN;
    double t0 = now_s();
    for (;;) {
        snprintf(after, sizeof(after), "%lld", (long long)top);
        const char *v[1] = {after};
        PGresult *r = PQexecParams(c, fetch, 1, NULL, v, NULL, NULL, 1);
        if (PQresultStatus(r) != PGRES_TUPLES_OK)
            die("minimal keyset fetch", PQresultErrorMessage(r));
        int64_t list[BATCH];
        int n = collect_ids(r, list);
        PQclear(r);
        if (n == 0)
            break;
        top = list[n - 1];
        done += n;
    }
    return cost_finish(c, done, t0, lsn, cpu0, &ids);
}

static struct pg_cost job_limit(const struct opts *o, int on_sent, int payload)
{
    if (on_sent == OBX_ON_SENT_LOG)
        return job_limit_log(o, payload);
    static const char fetch[] = "SELECT id, topic, key, payload, headers, created_at"
                                " FROM outbox.events WHERE sent_at IS NULL ORDER BY id LIMIT 1000";
    const char *confirm = on_sent == OBX_ON_SENT_DELETE
                              ? "DELETE FROM outbox.events WHERE id = ANY ($1::bigint[])"
                              : "UPDATE outbox.events SET sent_at = now()"
                                " WHERE id = ANY ($1::bigint[])";
    char lsn[64];
    double cpu0;
    PGconn *c = cost_start(o, payload, lsn, sizeof(lsn), &cpu0);
    struct obx_pg_array ids = {0};
    long done = 0;
    double t0 = now_s();
    if (PQenterPipelineMode(c) != 1)
        die("pipeline mode", PQerrorMessage(c));
    /* One round trip a batch: the mark of batch k and the fetch of k+1. */
    PQsendQueryParams(c, fetch, 0, NULL, NULL, NULL, NULL, 1);
    PQpipelineSync(c);
    for (;;) {
        PGresult *r = next_result(c);
        if (PQresultStatus(r) != PGRES_TUPLES_OK)
            die("minimal fetch", PQresultErrorMessage(r));
        int64_t list[BATCH];
        int n = collect_ids(r, list);
        PQclear(r);
        obx_pg_array_reset(&ids);
        for (int i = 0; i < n; i++)
            obx_pg_array_add_int(&ids, list[i]);
        r = next_result(c); /* the sync */
        PQclear(r);
        if (n == 0)
            break;
        const char *v[1] = {obx_pg_array_finish(&ids)};
        PQsendQueryParams(c, "BEGIN", 0, NULL, NULL, NULL, NULL, 0);
        PQsendQueryParams(c, confirm, 1, NULL, v, NULL, NULL, 0);
        PQsendQueryParams(c, "COMMIT", 0, NULL, NULL, NULL, NULL, 0);
        PQsendQueryParams(c, fetch, 0, NULL, NULL, NULL, NULL, 1);
        PQpipelineSync(c);
        for (int k = 0; k < 3; k++) {
            r = next_result(c);
            if (PQresultStatus(r) != PGRES_COMMAND_OK)
                die("minimal mark", PQresultErrorMessage(r));
            PQclear(r);
        }
        done += n;
    }
    PQexitPipelineMode(c);
    return cost_finish(c, done, t0, lsn, cpu0, &ids);
}

/* ---- 1. Postgres-side cost of outboxd's statements ---- */

static void prepare_ok(PGconn *c, const char *name, const char *sql)
{
    PGresult *r = PQprepare(c, name, sql, 0, NULL);
    if (PQresultStatus(r) != PGRES_COMMAND_OK)
        die("prepare", PQresultErrorMessage(r));
    PQclear(r);
}

static struct pg_cost pg_limit(const struct opts *o, int on_sent, int payload)
{
    char mark_sql[OBX_STORE_MARK_SQL_LEN]; /* the plain mark, or the cursor row */
    obx_store_sql_mark_plain(on_sent, mark_sql, sizeof(mark_sql)); /* no dead letters here */
    bool log = on_sent == OBX_ON_SENT_LOG;
    if (log) /* a cursor row a batch */
        snprintf(mark_sql, sizeof(mark_sql), "%s", obx_store_sql_log_write());
    char lsn[64];
    double cpu0;
    PGconn *c = cost_start(o, payload, lsn, sizeof(lsn), &cpu0);
    /* Prepared, with the relay session's planner settings, as the relay runs them. */
    exec_ok(c, OBX_STORE_SQL_PLANNER_SETTINGS);
    struct obx_buf full = {0};
    const char *full_sql = obx_store_sql_fetch(&full, "{}");
    if (!full_sql)
        die("fetch", "out of memory");
    prepare_ok(c, "k", obx_store_sql_fetch_keyset());
    prepare_ok(c, "m", mark_sql);
    struct obx_pg_array ids = {0};
    char row_cap[24]; /* relay.fetch_max_bytes's default over the batch, as the relay asks */
    snprintf(row_cap, sizeof(row_cap), "%d", 8388608 / BATCH);
    char limit[16];
    snprintf(limit, sizeof(limit), "%d", BATCH);
    long done = 0;
    double t0 = now_s();
    /* A full fetch first, then keyset fetches from its cursor, as the relay
     * does while nothing comes back unsent. */
    char snap[4096] = "", after[24];
    int64_t hwm = 0;
    for (;;) {
        snprintf(after, sizeof(after), "%lld", (long long)hwm);
        const char *fv[OBX_FETCH_NPARAMS] = {
            [OBX_FETCH_AFTER] = after, /* the keyset fetch's; the full one starts at LIMIT */
            [OBX_FETCH_LIMIT] = limit,       [OBX_FETCH_HELD_TOPICS] = "{}",
            [OBX_FETCH_HELD_KEYS] = "{}",    [OBX_FETCH_HELD_IDS] = "{}",
            [OBX_FETCH_MAX_BYTES] = row_cap, [OBX_FETCH_SNAPSHOT] = snap};
        PGresult *r = hwm > 0 ? PQexecPrepared(c, "k", OBX_FETCH_NPARAMS, fv, NULL, NULL, 1)
                              : PQexecParams(c, full_sql, OBX_FETCH_FULL_NPARAMS, NULL,
                                             fv + OBX_FETCH_FULL_FIRST, NULL, NULL, 1);
        if (PQresultStatus(r) != PGRES_TUPLES_OK)
            die("fetch", PQresultErrorMessage(r));
        int64_t list[BATCH];
        int n = collect_ids_top(r, list, snap, sizeof(snap), &hwm);
        PQclear(r);
        /* The mark takes them as ranges, as the relay sends them. */
        obx_pg_array_reset(&ids);
        obx_pg_array_add_ranges(&ids, list, (size_t)n);
        if (n == 0)
            break;
        /* One offset per partition, as outboxd stores them. */
        static const char topics[] = "{bench,bench,bench,bench,bench,bench,bench,bench,bench,"
                                     "bench,bench,bench}";
        const char *mv[OBX_MARK_PLAIN_NPARAMS] = {
            [OBX_MARK_RANGES] = obx_pg_array_finish(&ids),
            [OBX_MARK_OFFSETS + OBX_OFFSETS_TOPICS] = topics,
            [OBX_MARK_OFFSETS + OBX_OFFSETS_PARTITIONS] = "{0,1,2,3,4,5,6,7,8,9,10,11}",
            [OBX_MARK_OFFSETS + OBX_OFFSETS_OFFSETS] = "{1,1,1,1,1,1,1,1,1,1,1,1}"};
        char batch_no[24], hwm_text[24];
        snprintf(batch_no, sizeof(batch_no), "%ld", done / BATCH + 1);
        snprintf(hwm_text, sizeof(hwm_text), "%lld", (long long)hwm);
        const char *lv[OBX_CURSOR_NPARAMS] = {[OBX_CURSOR_BATCH] = batch_no,
                                              [OBX_CURSOR_HWM] = hwm_text,
                                              [OBX_CURSOR_SNAPSHOT] = snap,
                                              [OBX_CURSOR_HELD + OBX_HELD_TOPICS] = "{}",
                                              [OBX_CURSOR_HELD + OBX_HELD_KEYS] = "{}",
                                              [OBX_CURSOR_HELD + OBX_HELD_FROM] = "{}",
                                              [OBX_CURSOR_HELD + OBX_HELD_ALSO_SENT] = "{}",
                                              [OBX_CURSOR_OFFSETS + OBX_OFFSETS_TOPICS] = "{bench}",
                                              [OBX_CURSOR_OFFSETS + OBX_OFFSETS_PARTITIONS] = "{0}",
                                              [OBX_CURSOR_OFFSETS + OBX_OFFSETS_OFFSETS] = "{1}",
                                              [OBX_CURSOR_RESTART] = "false",
                                              [OBX_CURSOR_DEAD + OBX_DEAD_IDS] = "{}",
                                              [OBX_CURSOR_DEAD + OBX_DEAD_REASONS] = "{}"};
        /* One statement: one transaction. */
        r = log ? PQexecPrepared(c, "m", OBX_CURSOR_NPARAMS, lv, NULL, NULL, 0)
                : PQexecPrepared(c, "m", OBX_MARK_PLAIN_NPARAMS, mv, NULL, NULL, 0);
        if (PQresultStatus(r) != (log ? PGRES_TUPLES_OK : PGRES_COMMAND_OK))
            die("mark", PQresultErrorMessage(r));
        PQclear(r);
        done += n;
    }
    obx_buf_free(&full);
    return cost_finish(c, done, t0, lsn, cpu0, &ids);
}

/* Retention: sent rows (2 days old) deleted by the purge statement outboxd
 * runs, in batches of `batch`, the way a round walks the table. */
static double purge_rate(const struct opts *o, int batch)
{
    PGconn *c = connect_db(o);
    settle(c);
    prefill(c, o->rows, 200);
    exec_ok(c, "UPDATE outbox.events SET created_at = now() - interval '3 days',"
               " sent_at = now() - interval '2 days'");
    exec_ok(c, "VACUUM ANALYZE outbox.events");
    char cursor[32] = "0", limit[16], period[] = "86400000";
    snprintf(limit, sizeof(limit), "%d", batch);
    long deleted = 0;
    double t0 = now_s();
    for (;;) {
        const char *v[OBX_PURGE_NPARAMS] = {
            [OBX_PURGE_AFTER] = cursor, [OBX_PURGE_BATCH] = limit, [OBX_PURGE_PERIOD_MS] = period};
        PGresult *r =
            PQexecParams(c, obx_store_sql_purge(), OBX_PURGE_NPARAMS, NULL, v, NULL, NULL, 0);
        if (PQresultStatus(r) != PGRES_TUPLES_OK)
            die("purge", PQresultErrorMessage(r));
        bool done = obx_store_col_null(r, 0, "last_id") || atol(obx_store_col(r, 0, "recent")) > 0;
        if (!obx_store_col_null(r, 0, "last_id"))
            snprintf(cursor, sizeof(cursor), "%s", obx_store_col(r, 0, "last_id"));
        deleted += atol(obx_store_col(r, 0, "deleted"));
        PQclear(r);
        if (done)
            break;
    }
    double t = now_s() - t0;
    if (deleted != o->rows)
        die("purge", "did not delete every row");
    PQfinish(c);
    return (double)deleted / t;
}

/* ---- 2. Kafka-side limit ---- */

static atomic_long delivered;

static void on_dr(rd_kafka_t *rk, const rd_kafka_message_t *m, void *opaque)
{
    (void)rk;
    (void)opaque;
    if (m->err)
        die("delivery", rd_kafka_err2str(m->err));
    atomic_fetch_add(&delivered, 1);
}

/* A bare idempotent producer's settings as outboxd's (murmur2_random,
 * linger.ms 1), with one more setting. */
static rd_kafka_conf_t *producer_conf(const struct opts *o, const char *key, const char *value)
{
    char err[512];
    rd_kafka_conf_t *conf = rd_kafka_conf_new();
    const char *settings[][2] = {{"bootstrap.servers", o->bootstrap},
                                 {"enable.idempotence", "true"},
                                 {"partitioner", "murmur2_random"},
                                 {"linger.ms", "1"},
                                 {key, value}};
    for (size_t i = 0; i < sizeof(settings) / sizeof(settings[0]); i++)
        if (rd_kafka_conf_set(conf, settings[i][0], settings[i][1], err, sizeof(err)))
            die("producer conf", err);
    return conf;
}

/* The bare producer's rate; *machine_us (if given): the whole machine's
 * CPU per record, the mock broker's included. */
static double kafka_limit(const struct opts *o, size_t payload_len, double *machine_us)
{
    static char payload[4096];
    char err[512], key[32], id[24], trace[64];
    rd_kafka_conf_t *conf = producer_conf(o, "message.timeout.ms", "0");
    rd_kafka_conf_set_dr_msg_cb(conf, on_dr);
    rd_kafka_t *rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, err, sizeof(err));
    if (!rk)
        die("producer", err);
    memset(payload, 'x', sizeof(payload));
    /* Warm up: metadata and producer id, as outboxd has them after start-up. */
    rd_kafka_producev(rk, RD_KAFKA_V_TOPIC("kbench"), RD_KAFKA_V_VALUE(payload, 10),
                      RD_KAFKA_V_END);
    rd_kafka_flush(rk, 10000);
    atomic_store(&delivered, 0);
    double t0 = now_s(), m0 = machine_cpu_s();
    for (int i = 0; i < o->rows; i++) {
        int kl = snprintf(key, sizeof(key), "key-%d", i % KEYS);
        int il = snprintf(id, sizeof(id), "%d", i + 1);
        snprintf(trace, sizeof(trace), "00-%032x-%016x-01", i, i);
        rd_kafka_headers_t *h = rd_kafka_headers_new(3);
        rd_kafka_header_add(h, "outbox-id", -1, id, il);
        rd_kafka_header_add(h, "traceparent", -1, trace, -1);
        rd_kafka_header_add(h, "source", -1, "bench", -1);
        for (;;) {
            rd_kafka_resp_err_t e =
                rd_kafka_producev(rk, RD_KAFKA_V_TOPIC("bench"), RD_KAFKA_V_KEY(key, (size_t)kl),
                                  RD_KAFKA_V_VALUE(payload, payload_len), RD_KAFKA_V_HEADERS(h),
                                  RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY), RD_KAFKA_V_END);
            if (e == RD_KAFKA_RESP_ERR_NO_ERROR)
                break;
            if (e != RD_KAFKA_RESP_ERR__QUEUE_FULL)
                die("produce", rd_kafka_err2str(e));
            rd_kafka_poll(rk, 10);
        }
        rd_kafka_poll(rk, 0);
    }
    while (atomic_load(&delivered) < o->rows)
        rd_kafka_poll(rk, 50);
    double t = now_s() - t0;
    if (machine_us)
        *machine_us = (machine_cpu_s() - m0) * 1e6 / o->rows;
    rd_kafka_destroy(rk);
    return o->rows / t;
}

/* ---- the outboxd process ---- */

/* The port of the relay's /metrics: one of our own, not http.listen's
 * default, so that another benchmark on this machine neither takes it nor
 * answers for our relay. */
int http_port;

static int free_port(void)
{
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &len) != 0)
        die("a port for /metrics", strerror(errno));
    close(fd);
    return ntohs(a.sin_port);
}

/* An outboxd in mode on_sent serving /metrics on `port`, with one more
 * setting `more` (or none); counting its allocations into count_file. */
pid_t spawn_relay(const struct opts *o, int on_sent, const char *count_file, int port,
                  const char *more)
{
    char conninfo[1024], bootstrap[600], listen[64];
    snprintf(listen, sizeof(listen), "http.listen=127.0.0.1:%d", port);
    snprintf(conninfo, sizeof(conninfo), "postgres.conninfo=%s", o->conninfo);
    snprintf(bootstrap, sizeof(bootstrap), "kafka.bootstrap.servers=%s", o->bootstrap);
    pid_t pid = fork();
    if (pid < 0)
        die("fork", strerror(errno));
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlives the benchmark */
        int fd = open("/dev/null", O_WRONLY);
        dup2(fd, 2);
        char preload[600], countvar[600];
        char *envp[4] = {NULL};
        int n = 0;
        if (count_file && o->malloc_lib) {
            snprintf(preload, sizeof(preload), "LD_PRELOAD=%s", o->malloc_lib);
            snprintf(countvar, sizeof(countvar), "OBX_MALLOC_COUNT_FILE=%s", count_file);
            envp[n++] = preload;
            envp[n++] = countvar;
        }
        char *argv[] = {(char *)o->outboxd,
                        "-X",
                        conninfo,
                        "-X",
                        bootstrap,
                        "-X",
                        on_sent == OBX_ON_SENT_DELETE ? "relay.on_sent=delete"
                        : on_sent == OBX_ON_SENT_LOG  ? "relay.on_sent=log"
                                                      : "relay.on_sent=mark",
                        "-X",
                        "log.level=warn",
                        "-X",
                        listen,
                        NULL,
                        NULL,
                        NULL,
                        NULL,
                        NULL};
        int n_argv = 11;
        /* OBX_BENCH_X=key=value: one extra setting, for trying alternatives. */
        const char *extra = getenv("OBX_BENCH_X");
        if (extra && *extra) {
            argv[n_argv++] = "-X";
            argv[n_argv++] = (char *)extra;
        }
        if (more) {
            argv[n_argv++] = "-X";
            argv[n_argv++] = (char *)more;
        }
        execve(o->outboxd, argv, envp);
        _exit(127);
    }
    return pid;
}

/* One more setting of every outboxd spawn_outboxd starts (NULL: none): the
 * real-cluster table's transactional runs set relay.transactions. */
static const char *relay_more;

pid_t spawn_outboxd(const struct opts *o, int on_sent, const char *count_file)
{
    live_relay = spawn_relay(o, on_sent, count_file, http_port, relay_more);
    return live_relay;
}

void proc_stats(pid_t pid, struct proc_stats *st)
{
    char path[64], buf[4096];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (f && fgets(buf, sizeof(buf), f)) {
        const char *p = strrchr(buf, ')');
        unsigned long ut = 0, stt = 0;
        /* fields after ")": state ppid pgrp session tty tpgid flags minflt
         * cminflt majflt cmajflt utime stime */
        if (p &&
            sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &stt) == 2)
            st->cpu_s = (double)(ut + stt) / (double)sysconf(_SC_CLK_TCK);
    }
    if (f)
        fclose(f);
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    f = fopen(path, "r");
    while (f && fgets(buf, sizeof(buf), f))
        if (strncmp(buf, "VmHWM:", 6) == 0)
            st->peak_kb = strtol(buf + 6, NULL, 10);
    if (f)
        fclose(f);
}

double backend_cpu_s(int pid)
{
    struct proc_stats st = {0};
    proc_stats((pid_t)pid, &st);
    return st.cpu_s;
}

void stop_outboxd(pid_t pid)
{
    int status;
    kill(pid, SIGTERM);
    waitpid(pid, &status, 0);
    live_relay = 0;
}

struct drain_result {
    double rows_per_s;
    double machine_us;       /* the whole machine's CPU per row */
    double dead_per_row;     /* row versions the relay left dead in outbox.events */
    double pg_cpu_ms_per_1k; /* the relay's Postgres backend */
    double wal_per_row;
    double cpu_per_100k;
    long peak_kb;
    double idle_cpu_s; /* over 10 s */
    long long txns;    /* relay.transactions: transactions committed */
};

static long read_count(const char *path)
{
    FILE *f = fopen(path, "rb");
    unsigned long v = 0;
    long r = -1;
    if (f) {
        if (fread(&v, sizeof(v), 1, f) == 1)
            r = (long)v;
        fclose(f);
    }
    return r;
}

/* Waits until `sql` (an EXISTS probe) says nothing is left. The probe is
 * cheap and rare enough not to compete with the relay for Postgres: a
 * count(*) every few ms slowed the drain in proportion to the backlog. */
void wait_drained(PGconn *c, const char *sql, pid_t relay)
{
    while (query_int(c, sql) > 0) {
        int status;
        if (waitpid(relay, &status, WNOHANG) == relay) { /* else it would wait for ever */
            live_relay = 0;
            die("outboxd", "exited while rows were waiting (its stderr goes to /dev/null)");
        }
        usleep(20000);
    }
}

/* A sample of the relay's /metrics (at http_port), e.g.
 * "outboxd_rows_marked_total", or -1 if it cannot be read. */
long long relay_metric(const char *sample)
{
    static char buf[1 << 16];
    char needle[128];
    snprintf(needle, sizeof(needle), "\n%s ", sample);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)http_port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    long long v = -1;
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0) {
        static const char req[] = "GET /metrics HTTP/1.0\r\n\r\n";
        size_t got = 0;
        ssize_t n = write(fd, req, sizeof(req) - 1);
        while (n > 0 && got < sizeof(buf) - 1 &&
               (n = read(fd, buf + got, sizeof(buf) - 1 - got)) > 0)
            got += (size_t)n;
        buf[got] = 0;
        const char *p = strstr(buf, needle);
        if (p)
            v = strtoll(p + strlen(needle), NULL, 10);
    }
    if (fd >= 0)
        close(fd);
    return v;
}

static long long marked_total(void)
{
    return relay_metric("outboxd_rows_marked_total");
}

/* OBX_BENCH_PLOT=DIR: series for bench/plot.gp. While plot_drain is open,
 * wait_marked() writes "seconds-since-commit rows-confirmed" every 20 ms. */
static FILE *plot_drain;
static double plot_drain_t0;
static long long plot_drain_base;

static FILE *plot_open(const char *name)
{
    const char *dir = getenv("OBX_BENCH_PLOT");
    char path[512];
    if (!dir || !*dir)
        return NULL;
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    if (!f)
        die(path, strerror(errno));
    return f;
}

/* Waits until the relay has confirmed `target` rows in all, asking it and
 * not Postgres: a probe of the table, even a cheap EXISTS every 20 ms,
 * competes with the drain it measures (in delete mode each probe also
 * prunes the pages deleted since the one before). Falls back to the
 * probe if /metrics cannot be read. */
static void wait_marked(PGconn *c, const char *sql, long long target, pid_t relay)
{
    long long v;
    double next = 0;
    while ((v = marked_total()) >= 0 && v < target) {
        if (plot_drain && now_s() >= next) {
            fprintf(plot_drain, "%.3f %lld\n", now_s() - plot_drain_t0, v - plot_drain_base);
            next = now_s() + 0.02;
        }
        usleep(2000);
    }
    if (plot_drain && v >= 0)
        fprintf(plot_drain, "%.3f %lld\n", now_s() - plot_drain_t0, v - plot_drain_base);
    if (v < 0)
        wait_drained(c, sql, relay);
}

/* The probe for "is anything left to relay" in each mode. */
const char *left_sql_for(int on_sent)
{
    return on_sent == OBX_ON_SENT_DELETE ? "SELECT EXISTS (SELECT FROM outbox.events)::int"
           : on_sent == OBX_ON_SENT_LOG  ? "SELECT EXISTS (SELECT FROM outbox.unpublished)::int"
                                         : "SELECT EXISTS (SELECT FROM outbox.events"
                                           " WHERE sent_at IS NULL)::int";
}

/* Row versions the relay made dead in outbox.events so far (updates and
 * deletes counted by the statistics, summed over the partitions). */
static long long events_dead_made(PGconn *c)
{
    return query_int(c, "SELECT coalesce(sum(n_tup_upd + n_tup_del), 0) FROM pg_stat_user_tables"
                        " WHERE relid IN " OBX_STORE_SQL_EVENTS_PARTITIONS);
}

/* The relay's own Postgres backend (its maintenance session has another
 * application_name), or 0 if it is not connected. */
static int relay_backend_pid(PGconn *c)
{
    return (int)query_int(c, "SELECT coalesce(max(pid), 0) FROM pg_stat_activity"
                             " WHERE application_name = 'outboxd'");
}

/* The relay's fetches so far (keyset and full: each look is one) and its
 * Postgres backend's CPU, at a moment. */
struct look_cost {
    double at, cpu_s;
    long long fetches;
};

/* With lat_cost_backend set, lat_run takes a look_cost as its writers
 * start and once every record has arrived: what the looks cost at the
 * rate, without the consumer's set-up around it. */
static int lat_cost_backend;
static struct look_cost lat_cost[2];

static struct look_cost look_cost_now(int backend_pid)
{
    struct look_cost c = {now_s(), backend_pid ? backend_cpu_s(backend_pid) : 0, 0};
    long long k = relay_metric("outboxd_fetches_total{kind=\"keyset\"}");
    long long f = relay_metric("outboxd_fetches_total{kind=\"full\"}");
    c.fetches = (k > 0 ? k : 0) + (f > 0 ? f : 0);
    return c;
}

/* What another session does around a drain: before_prefill runs before
 * the rows are written, after_drain once the last one is confirmed and
 * measured. */
struct drain_hook {
    void (*before_prefill)(void *arg);
    void (*after_drain)(void *arg);
    void *arg;
};

/* A warm relay (recovered, producer connected) is handed N rows committed
 * in one transaction with NOTIFY; the clock runs from that commit until the
 * last row is confirmed. */
static void drain(const struct opts *o, int on_sent, int rows, int payload, bool idle,
                  struct drain_result *res, long *allocs, const struct drain_hook *hook)
{
    PGconn *c = connect_db(o);
    const char *left_sql = left_sql_for(on_sent);
    const char *count_file = allocs ? "/tmp/obx-bench-allocs" : NULL;
    settle(c);
    pid_t pid = spawn_outboxd(o, on_sent, count_file);
    exec_ok(c, "SELECT outbox.enqueue('bench', 'warm-up', 'x'::bytea)");
    wait_drained(c, left_sql, pid);
    sleep(1);
    struct proc_stats s0 = {0}, s1 = {0}, s2 = {0};
    int relay_backend = relay_backend_pid(c);
    char lsn[64];
    if (hook && hook->before_prefill)
        hook->before_prefill(hook->arg);
    exec_ok(c, "BEGIN");
    prefill(c, rows, payload);
    exec_ok(c, "NOTIFY outboxd");
    wal_lsn(c, lsn, sizeof(lsn)); /* after the rows' own WAL */
    proc_stats(pid, &s0);
    long a0 = count_file ? read_count(count_file) : 0;
    double b0 = backend_cpu_s(relay_backend);
    long long dead0 = events_dead_made(c);
    double m0 = machine_cpu_s();
    double t0 = now_s();
    plot_drain_t0 = t0;
    plot_drain_base = 1; /* the warm-up row */
    exec_ok(c, "COMMIT");
    wait_marked(c, left_sql, rows + 1LL, pid); /* and the warm-up row */
    double t1 = now_s();
    res->machine_us = (machine_cpu_s() - m0) * 1e6 / rows;
    wait_drained(c, left_sql, pid); /* what the relay says, Postgres confirms */
    proc_stats(pid, &s1);
    res->pg_cpu_ms_per_1k = (backend_cpu_s(relay_backend) - b0) * 1e6 / rows;
    res->wal_per_row = wal_since(c, lsn) / rows;
    if (getenv("OBX_BENCH_WAL_DETAIL")) { /* what the drain's WAL is, by record type */
        char sql[512];
        snprintf(sql, sizeof(sql),
                 "SELECT string_agg(format('%%s: %%s records, %%s bytes', "
                 "\"resource_manager/record_type\","
                 " count, combined_size), '; ' ORDER BY combined_size DESC)"
                 " FROM pg_get_wal_stats('%s', pg_current_wal_insert_lsn(), true)"
                 " WHERE count > 0",
                 lsn);
        exec_ok(c, "CREATE EXTENSION IF NOT EXISTS pg_walinspect");
        PGresult *r = PQexec(c, sql);
        if (PQresultStatus(r) == PGRES_TUPLES_OK)
            fprintf(stderr, "obx-bench: drain WAL, %s mode: %s\n", mode_name(on_sent),
                    PQgetvalue(r, 0, 0));
        PQclear(r);
    }
    if (allocs)
        *allocs = read_count(count_file) - a0;
    res->rows_per_s = rows / (t1 - t0);
    res->cpu_per_100k = (s1.cpu_s - s0.cpu_s) / rows * 100000.0;
    res->txns = relay_metric("outboxd_kafka_transactions_total{result=\"committed\"}");
    res->peak_kb = s1.peak_kb;
    if (hook && hook->after_drain)
        hook->after_drain(hook->arg);
    if (idle) {
        sleep(10);
        proc_stats(pid, &s2);
        res->idle_cpu_s = s2.cpu_s - s1.cpu_s;
    }
    stop_outboxd(pid);
    /* The relay's backend reports its counts as it ends. */
    long long dead1 = dead0;
    for (int i = 0; i < 30 && dead1 == dead0 && on_sent != OBX_ON_SENT_LOG; i++) {
        usleep(100000);
        dead1 = events_dead_made(c);
    }
    if (on_sent == OBX_ON_SENT_LOG) {
        sleep(1);
        dead1 = events_dead_made(c);
    }
    res->dead_per_row = (double)(dead1 - dead0) / rows;
    exec_ok(c, "TRUNCATE outbox.events, outbox.kafka_offsets, outbox.log_cursor");
    PQfinish(c);
}

/* ---- relay.shards: several active relays ---- */

#define SHARD_SLOTS      8
#define MAX_SHARD_RELAYS 4

/* The mode of the relays sharing slots (OBX_BENCH_SHARDS_MODE). */
static int shard_on_sent = OBX_ON_SENT_MARK;

/* A relay with relay.shards = `shards`, /metrics on `port`. */
static pid_t spawn_shard_relay(const struct opts *o, int shards, int port)
{
    char sh[32];
    snprintf(sh, sizeof(sh), "relay.shards=%d", shards);
    return spawn_relay(o, shard_on_sent, NULL, port, sh);
}

/* Each relay's outboxd_slots_owned and outboxd_recovering: true once the
 * relays (ports[0..n)) own `slots` between them, each its fair share, and
 * none is recovering. */
static bool slots_spread(const int *ports, int n, int slots)
{
    int total = 0, saved = http_port;
    bool fair = true;
    for (int i = 0; i < n && fair; i++) {
        http_port = ports[i];
        long long owned = relay_metric("outboxd_slots_owned");
        long long recovering = relay_metric("outboxd_recovering");
        fair = (owned == slots / n || owned == slots / n + 1) && recovering == 0;
        total += (int)owned;
    }
    http_port = saved;
    return fair && total == slots;
}

static double wait_spread(const int *ports, int n, int slots, double timeout_s)
{
    double t0 = now_s();
    while (!slots_spread(ports, n, slots)) {
        if (now_s() - t0 > timeout_s)
            die("relay.shards", "the slots were not spread in time");
        usleep(2000);
    }
    return now_s() - t0;
}

/* The CPU so far of the relays' Postgres backends (every session named
 * outboxd) and of the relay processes pids[0..n). */
static void shard_cpu(PGconn *c, const pid_t *pids, int n, double *backends, double *relays)
{
    PGresult *r = PQexec(c, "SELECT pid FROM pg_stat_activity WHERE application_name = 'outboxd'");
    *backends = *relays = 0;
    for (int i = 0; PQresultStatus(r) == PGRES_TUPLES_OK && i < PQntuples(r); i++)
        *backends += backend_cpu_s((int)strtol(PQgetvalue(r, i, 0), NULL, 10));
    PQclear(r);
    for (int i = 0; i < n; i++) {
        struct proc_stats st = {0};
        proc_stats(pids[i], &st);
        *relays += st.cpu_s;
    }
}

struct shard_result {
    double rows_per_s;
    double machine_us, backends_us, relays_us; /* CPU per row: all, Postgres, outboxd */
};

/* N rows drained by n relays sharing `shards` slots (1: a single relay). */
static void shard_drain(const struct opts *o, int n, int shards, struct shard_result *res)
{
    PGconn *c = connect_db(o);
    const char *left_sql = left_sql_for(shard_on_sent);
    settle(c);
    exec_ok(c, "TRUNCATE outbox.slot_owners, outbox.kafka_slot_offsets");
    pid_t pids[MAX_SHARD_RELAYS];
    int ports[MAX_SHARD_RELAYS];
    for (int i = 0; i < n; i++) {
        ports[i] = free_port();
        pids[i] = spawn_shard_relay(o, shards, ports[i]);
    }
    exec_ok(c, "SELECT outbox.enqueue('bench', 'warm-up', 'x'::bytea)");
    wait_drained(c, left_sql, pids[0]);
    wait_spread(ports, n, shards, 30);
    sleep(1);
    exec_ok(c, "BEGIN");
    prefill(c, o->rows, 200);
    double b0, r0, b1, r1;
    shard_cpu(c, pids, n, &b0, &r0);
    double m0 = machine_cpu_s(), t0 = now_s();
    exec_ok(c, "COMMIT");
    while (query_int(c, left_sql) > 0)
        usleep(5000);
    double t1 = now_s();
    res->machine_us = (machine_cpu_s() - m0) * 1e6 / o->rows;
    shard_cpu(c, pids, n, &b1, &r1);
    res->backends_us = (b1 - b0) * 1e6 / o->rows;
    res->relays_us = (r1 - r0) * 1e6 / o->rows;
    res->rows_per_s = o->rows / (t1 - t0);
    for (int i = 0; i < n; i++)
        stop_outboxd(pids[i]);
    PQfinish(c);
}

struct shard_writer {
    const struct opts *o;
    atomic_int stop;
    long written;
};

static void *shard_writer_main(void *arg)
{
    struct shard_writer *w = arg;
    PGconn *c = connect_db(w->o);
    for (long i = 0; !atomic_load(&w->stop); i++) {
        char sql[160];
        snprintf(sql, sizeof(sql), "SELECT outbox.enqueue('bench', 'key-%ld', 'x'::bytea)",
                 i % KEYS);
        exec_ok(c, sql);
        w->written++;
        usleep(2000);
    }
    PQfinish(c);
    return NULL;
}

static int compare_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Handovers under a writer: relay B leaves (SIGTERM) and comes back, ten
 * times; each move timed until the slots are spread and recovered. */
static void shard_handovers(const struct opts *o, double *times, int n_times)
{
    PGconn *c = connect_db(o);
    settle(c);
    int ports[2] = {free_port(), free_port()};
    pid_t a = spawn_shard_relay(o, SHARD_SLOTS, ports[0]);
    pid_t b = spawn_shard_relay(o, SHARD_SLOTS, ports[1]);
    wait_spread(ports, 2, SHARD_SLOTS, 30);
    struct shard_writer w = {.o = o};
    pthread_t t;
    if (pthread_create(&t, NULL, shard_writer_main, &w) != 0)
        die("pthread_create", "writer");
    for (int i = 0; i + 1 < n_times; i += 2) {
        usleep(300000);
        double t0 = now_s();
        stop_outboxd(b);
        wait_spread(ports, 1, SHARD_SLOTS, 30);
        times[i] = now_s() - t0;
        usleep(300000);
        t0 = now_s();
        b = spawn_shard_relay(o, SHARD_SLOTS, ports[1]);
        wait_spread(ports, 2, SHARD_SLOTS, 30);
        times[i + 1] = now_s() - t0; /* includes the new process's start */
    }
    atomic_store(&w.stop, 1);
    pthread_join(t, NULL);
    while (query_int(c, left_sql_for(shard_on_sent)) > 0)
        usleep(5000);
    stop_outboxd(a);
    stop_outboxd(b);
    PQfinish(c);
}

static void shard_table(const struct opts *o, int rounds)
{
    static const struct {
        int relays, shards;
    } runs[] = {{1, 1}, {1, SHARD_SLOTS}, {2, SHARD_SLOTS}, {4, SHARD_SLOTS}};
    enum { N_RUNS = sizeof(runs) / sizeof(runs[0]) };
    enum { MAX_ROUNDS = 16 };
    double rate[N_RUNS][MAX_ROUNDS], cpu[N_RUNS][MAX_ROUNDS], pg[N_RUNS][MAX_ROUNDS],
        relays[N_RUNS][MAX_ROUNDS];
    if (rounds > MAX_ROUNDS)
        rounds = MAX_ROUNDS;
    for (int r = 0; r < rounds; r++) {
        for (int k = 0; k < N_RUNS; k++) {
            int i = (k + r) % N_RUNS; /* each round starts with another one */
            struct shard_result d;
            shard_drain(o, runs[i].relays, runs[i].shards, &d);
            rate[i][r] = d.rows_per_s;
            cpu[i][r] = d.machine_us;
            pg[i][r] = d.backends_us;
            relays[i][r] = d.relays_us;
            fprintf(stderr,
                    "obx-bench: %d relays, relay.shards = %d: %.0f rows/s, %.1f us/row (Postgres "
                    "backends %.1f, outboxd %.1f)\n",
                    runs[i].relays, runs[i].shards, d.rows_per_s, d.machine_us, d.backends_us,
                    d.relays_us);
        }
    }
    printf("%s mode\n\n| relays | relay.shards | drain (median of %d) | vs a single relay | "
           "machine CPU per row | its relays' backends | outboxd processes |\n"
           "| --- | --- | --- | --- | --- | --- | --- |\n",
           mode_name(shard_on_sent), rounds);
    double base = 0;
    for (int i = 0; i < N_RUNS; i++) {
        qsort(rate[i], (size_t)rounds, sizeof(double), compare_double);
        qsort(cpu[i], (size_t)rounds, sizeof(double), compare_double);
        qsort(pg[i], (size_t)rounds, sizeof(double), compare_double);
        qsort(relays[i], (size_t)rounds, sizeof(double), compare_double);
        double med = rate[i][rounds / 2];
        if (i == 0)
            base = med;
        printf("| %d | %d | %.0f rows/s (%.0f–%.0f) | %.2f | %.1f µs | %.1f µs | %.1f µs |\n",
               runs[i].relays, runs[i].shards, med, rate[i][0], rate[i][rounds - 1], med / base,
               cpu[i][rounds / 2], pg[i][rounds / 2], relays[i][rounds / 2]);
    }
    double times[20];
    shard_handovers(o, times, 20);
    double leave[10], join[10];
    for (int i = 0; i < 10; i++)
        leave[i] = times[2 * i] * 1000, join[i] = times[2 * i + 1] * 1000;
    qsort(leave, 10, sizeof(double), compare_double);
    qsort(join, 10, sizeof(double), compare_double);
    printf("\nHandovers (2 relays, %d slots, a writer at ~400 rows/s): a relay leaves (SIGTERM): "
           "slots moved and recovered in median %.0f ms, max %.0f ms; it comes back (a new "
           "process): median %.0f ms, max %.0f ms; 20 moves, p99 = max %.0f ms\n",
           SHARD_SLOTS, leave[4], leave[9], join[4], join[9],
           leave[9] > join[9] ? leave[9] : join[9]);
}

/* ---- 4. latency ---- */

/* The limit and the drain, measured back to back PAIRS times. This machine's
 * speed drifts by +-15 % between runs; a ratio taken within one pair drifts
 * much less, so the table reports the median of the pairs' ratios. */
#define PAIRS 3
struct paired {
    double job, own, drain, ratio;     /* medians; ratio = drain / the job's limit */
    double ratio_min, ratio_max;       /* spread of the pairs' ratios */
    struct pg_cost job_cost, own_cost; /* of the first pair */
    struct drain_result first;         /* footprint figures of the first drain */
};

static double median3(double a, double b, double c)
{
    return a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
}

static void paired(const struct opts *o, int on_sent, int payload, bool idle, struct paired *p)
{
    double limit[PAIRS], own[PAIRS], drained[PAIRS], ratio[PAIRS];
    for (int i = 0; i < PAIRS; i++) {
        struct drain_result d;
        struct pg_cost job = job_limit(o, on_sent, payload);
        struct pg_cost mine = pg_limit(o, on_sent, payload);
        /* The first pair's drain, over time, beside the job's limit. */
        const char *mode = mode_name(on_sent);
        char name[64];
        snprintf(name, sizeof(name), "drain-%s.dat", mode);
        plot_drain = i == 0 ? plot_open(name) : NULL;
        drain(o, on_sent, o->rows, payload, idle && i == 0, &d, NULL, NULL);
        if (plot_drain) {
            fclose(plot_drain);
            plot_drain = NULL;
            snprintf(name, sizeof(name), "limit-%s.dat", mode);
            FILE *f = plot_open(name);
            fprintf(f, "%.0f %.0f\n", job.rows_per_s, d.rows_per_s);
            fclose(f);
        }
        if (i == 0) {
            p->first = d;
            p->job_cost = job;
            p->own_cost = mine;
        }
        limit[i] = job.rows_per_s;
        own[i] = mine.rows_per_s;
        drained[i] = d.rows_per_s;
        ratio[i] = drained[i] / limit[i];
        fprintf(stderr,
                "obx-bench:   pair %d: job's limit %.0f, outboxd's statements %.0f, drain %.0f "
                "rows/s = %.2f\n",
                i + 1, limit[i], own[i], drained[i], ratio[i]);
    }
    p->job = median3(limit[0], limit[1], limit[2]);
    p->own = median3(own[0], own[1], own[2]);
    p->drain = median3(drained[0], drained[1], drained[2]);
    p->ratio = median3(ratio[0], ratio[1], ratio[2]);
    p->ratio_min = p->ratio_max = ratio[0];
    for (int i = 1; i < PAIRS; i++) {
        if (ratio[i] < p->ratio_min)
            p->ratio_min = ratio[i];
        if (ratio[i] > p->ratio_max)
            p->ratio_max = ratio[i];
    }
}

double *commit_at; /* by outbox id - id_base: when the writer sent the commit */
void (*lat_tick)(double elapsed);
long lat_duplicates, lat_missing;
const char *lat_topic_name;
int lat_threads;
double lat_quiet_s = 10.0;
long long id_base; /* ids keep growing over the runs (TRUNCATE keeps the identity) */
static atomic_int writers_done;
static atomic_long written; /* rows the writers of the current run committed */

/* Windows of WINDOW_S seconds (the horizon run), each on a topic of its
 * own, "lat-1" ... "lat-<MAX_WINDOWS>" (bench/run creates them): the mock
 * broker walks a partition's whole log on every fetch that returns data,
 * so on one topic the latency would grow with the run whatever the relay
 * did. */
#define WINDOW_S    60
#define MAX_WINDOWS 60

/* The topic of window w (from 0) of a run with `windows` windows, or "lat"
 * for a run without. */
/* The held-horizon runs of the three-mode table, one after the other, each
 * on topics of its own ("lat<series>-N"): on topics an earlier run filled,
 * the mock broker's fetches are slower, and the third run's p99 was 141 ms
 * whatever its mode. 0: "lat-N". */
static int lat_series;

static void lat_topic(char *buf, size_t len, int windows, int w)
{
    if (windows == 0)
        snprintf(buf, len, "%s", lat_topic_name ? lat_topic_name : "lat");
    else if (lat_series > 0)
        snprintf(buf, len, "lat%d-%d", lat_series, (w < windows ? w : windows - 1) + 1);
    else
        snprintf(buf, len, "lat-%d", (w < windows ? w : windows - 1) + 1);
}

struct lat_writer {
    const struct opts *o;
    double rate; /* events/s for this thread */
    double seconds;
    double start; /* the run's clock, for the windows */
    int windows;  /* 0: one topic */
    int threads;
    atomic_int started; /* each thread's place among them */
};

/* The Kafka-side floor of the latency: records produced straight to 'lat'
 * by a producer with outboxd's settings (idempotent, linger.ms 1, one
 * request in flight a connection), no Postgres and no relay, read back by
 * the same consumer. NULL: the writers commit rows with outbox.enqueue. */
static rd_kafka_t *direct_producer;
static atomic_long direct_next;

static void *lat_writer_main(void *arg)
{
    struct lat_writer *w = arg;
    PGconn *c = connect_db(w->o);
    double period = 1.0 / w->rate, start = now_s(), next = start;
    /* The threads' keys spread over KEYS: started together on the same key
     * they would wait for each other's commit (enqueue's per-key lock). */
    int k = atomic_fetch_add(&w->started, 1) * KEYS / w->threads;
    while (now_s() - start < w->seconds) {
        double wait = next - now_s();
        if (wait > 0)
            usleep((useconds_t)(wait * 1e6));
        char key[32], topic[32];
        snprintf(key, sizeof(key), "key-%d", k++ % KEYS);
        double t = now_s(); /* one statement = one transaction: commit at its end */
        lat_topic(topic, sizeof(topic), w->windows, (int)((t - w->start) / WINDOW_S));
        if (direct_producer) {
            long long id = id_base + 1 + atomic_fetch_add(&direct_next, 1);
            char idtext[24];
            int il = snprintf(idtext, sizeof(idtext), "%lld", id);
            rd_kafka_headers_t *h = rd_kafka_headers_new(1);
            rd_kafka_header_add(h, "outbox-id", -1, idtext, il);
            if (id - id_base < MAX_IDS)
                commit_at[id - id_base] = t;
            rd_kafka_resp_err_t e = rd_kafka_producev(
                direct_producer, RD_KAFKA_V_TOPIC(topic), RD_KAFKA_V_KEY(key, strlen(key)),
                RD_KAFKA_V_VALUE((void *)"{\"event\": \"latency probe\"}", 27),
                RD_KAFKA_V_HEADERS(h), RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY), RD_KAFKA_V_END);
            if (e != RD_KAFKA_RESP_ERR_NO_ERROR)
                die("produce", rd_kafka_err2str(e));
            atomic_fetch_add(&written, 1);
            next += period;
            continue;
        }
        const char *v[3] = {key, "{\"event\": \"latency probe\"}", topic};
        PGresult *r =
            PQexecParams(c, "SELECT outbox.enqueue($3, $1, $2::jsonb)", 3, NULL, v, NULL, NULL, 0);
        if (PQresultStatus(r) != PGRES_TUPLES_OK)
            die("enqueue", PQresultErrorMessage(r));
        long long id = strtoll(PQgetvalue(r, 0, 0), NULL, 10);
        PQclear(r);
        if (id > id_base && id - id_base < MAX_IDS)
            commit_at[id - id_base] = t;
        atomic_fetch_add(&written, 1);
        next += period;
    }
    PQfinish(c);
    atomic_fetch_add(&writers_done, 1);
    return NULL;
}

int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The horizon run's windows of wall time: the relay backend's CPU at each
 * window's start (and at the end of the run), and the records that arrived
 * in each (the last window runs on until the backlog is read). */
struct lat_probe {
    int backend_pid;
    int windows;
    double *cpu;   /* [windows + 1] */
    long *arrived; /* [windows] */
};

/* Writers commit `rate` events/s on 'lat' for `seconds`, one event per
 * transaction; a consumer in this process reads the records back until
 * every committed row has arrived (or nothing came for 10 s: a relay that
 * merely falls behind still delivers in that time) and matches each by its
 * outbox-id to the commit, on one clock. Returns the samples (*n of them,
 * in arrival order; the caller frees them). */
struct lat_sample *lat_run(const struct opts *o, int rate, int seconds, struct lat_probe *probe,
                           size_t *n_out)
{
    char err[512];
    int threads = rate < 1000 ? 1 : lat_threads > 0 ? lat_threads : 4;
    rd_kafka_conf_t *conf = rd_kafka_conf_new();
    rd_kafka_conf_set(conf, "bootstrap.servers", o->bootstrap, err, sizeof(err));
    rd_kafka_conf_set(conf, "group.id", "obx-bench", err, sizeof(err));
    rd_kafka_conf_set(conf, "fetch.wait.max.ms", "1", err, sizeof(err));
    rd_kafka_conf_set(conf, "fetch.error.backoff.ms", "5", err, sizeof(err));
    rd_kafka_t *rk = rd_kafka_new(RD_KAFKA_CONSUMER, conf, err, sizeof(err));
    if (!rk)
        die("consumer", err);
    rd_kafka_poll_set_consumer(rk);
    int windows = probe ? probe->windows : 0;
    rd_kafka_topic_partition_list_t *parts =
        rd_kafka_topic_partition_list_new(PARTITIONS * (windows ? windows : 1));
    for (int w = 0; w < (windows ? windows : 1); w++) {
        char topic[32];
        lat_topic(topic, sizeof(topic), windows, w);
        for (int p = 0; p < PARTITIONS; p++)
            rd_kafka_topic_partition_list_add(parts, topic, p)->offset = RD_KAFKA_OFFSET_END;
    }
    rd_kafka_assign(rk, parts);
    rd_kafka_topic_partition_list_destroy(parts);
    for (int i = 0; i < 20; i++) { /* let the assignment settle */
        rd_kafka_message_t *m = rd_kafka_consumer_poll(rk, 50);
        if (m)
            rd_kafka_message_destroy(m);
    }

    /* Each writer commits at most rate / threads x seconds rows, + 1. */
    size_t cap = (size_t)rate * (size_t)seconds + 1024, n = 0, matched = 0;
    struct lat_sample *samples = malloc(cap * sizeof(*samples));
    if (!samples)
        die("latency samples", "out of memory");
    pthread_t t[MAX_LAT_THREADS];
    atomic_store(&writers_done, 0);
    atomic_store(&written, 0);
    long arrived = 0; /* this run's ids read back, sampled or not, each once */
    unsigned char *seen = calloc((size_t)MAX_IDS / 8, 1);
    if (!seen)
        die("latency run", "out of memory");
    lat_duplicates = 0;
    int window = 0;
    double start = now_s();
    struct lat_writer w = {o, (double)rate / threads, seconds, start, windows, threads, 0};
    if (probe)
        probe->cpu[0] = backend_cpu_s(probe->backend_pid);
    if (lat_cost_backend)
        lat_cost[0] = look_cost_now(lat_cost_backend);
    for (int i = 0; i < threads; i++)
        if (pthread_create(&t[i], NULL, lat_writer_main, &w) != 0)
            die("pthread_create", "latency writer");
    double quiet_since = 0;
    for (;;) {
        rd_kafka_message_t *m = rd_kafka_consumer_poll(rk, 10);
        double now = now_s();
        if (lat_tick)
            lat_tick(now - start);
        while (probe && window < probe->windows - 1 && now - start >= (window + 1) * WINDOW_S)
            probe->cpu[++window] = backend_cpu_s(probe->backend_pid);
        if (m) {
            rd_kafka_headers_t *h;
            const void *val;
            size_t len;
            if (!m->err && rd_kafka_message_headers(m, &h) == 0 &&
                rd_kafka_header_get_last(h, "outbox-id", &val, &len) == 0 && len < 20) {
                char buf[24];
                memcpy(buf, val, len);
                buf[len] = '\0';
                long long id = strtoll(buf, NULL, 10);
                long long at = id - id_base;
                if (at > 0 && at < MAX_IDS && (seen[at / 8] & (1u << (at % 8)))) {
                    lat_duplicates++;
                } else if (at > 0 && at < MAX_IDS) {
                    seen[at / 8] |= (unsigned char)(1u << (at % 8));
                    arrived++;
                    if (probe)
                        probe->arrived[window]++;
                    /* Matched to the commit once the writers are done: a
                     * record can arrive before its writer noted the time. */
                    if (n < cap)
                        samples[n++] = (struct lat_sample){id, 0, now};
                }
            }
            rd_kafka_message_destroy(m);
            quiet_since = 0;
        } else if (atomic_load(&writers_done) == threads) {
            if (arrived >= atomic_load(&written))
                break;
            if (quiet_since == 0)
                quiet_since = now;
            else if (now - quiet_since > lat_quiet_s)
                break;
        }
    }
    free(seen);
    lat_missing = atomic_load(&written) - arrived;
    if (probe)
        probe->cpu[probe->windows] = backend_cpu_s(probe->backend_pid);
    if (lat_cost_backend)
        lat_cost[1] = look_cost_now(lat_cost_backend);
    for (int i = 0; i < threads; i++)
        pthread_join(t[i], NULL);
    rd_kafka_consumer_close(rk);
    rd_kafka_destroy(rk);
    for (size_t i = 0; i < n; i++) {
        double at = commit_at[samples[i].id - id_base];
        if (at > 0)
            samples[matched++] =
                (struct lat_sample){samples[i].id, at - start, samples[i].lat - at};
    }
    *n_out = matched;
    return samples;
}

/* Percentiles of the samples whose commit came in [from, to) seconds. */
void lat_summary(const struct lat_sample *s, size_t n, double from, double to,
                 struct lat_result *res)
{
    double *lat = malloc((n ? n : 1) * sizeof(double));
    if (!lat)
        die("latency summary", "out of memory");
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (s[i].at >= from && s[i].at < to)
            lat[k++] = s[i].lat;
    qsort(lat, k, sizeof(double), cmp_double);
    res->n = (long)k;
    res->p50 = k ? lat[k / 2] * 1e3 : 0;
    res->p99 = k ? lat[(size_t)((double)k * 0.99)] * 1e3 : 0;
    res->p999 = k ? lat[(size_t)((double)k * 0.999)] * 1e3 : 0;
    res->max = k ? lat[k - 1] * 1e3 : 0;
    free(lat);
}

static void latency(const struct opts *o, int rate, struct lat_result *res)
{
    size_t n;
    struct lat_sample *s = lat_run(o, rate, o->latency_seconds, NULL, &n);
    lat_summary(s, n, -1e9, 1e9, res);
    res->achieved = (double)n / o->latency_seconds;
    char name[64];
    snprintf(name, sizeof(name), "latency-%d.dat", rate);
    FILE *f = plot_open(name); /* the distribution: "ms fraction-at-or-below" */
    if (f) {
        double *lat = malloc((n ? n : 1) * sizeof(double));
        if (!lat)
            die("latency plot", "out of memory");
        for (size_t i = 0; i < n; i++)
            lat[i] = s[i].lat * 1e3;
        qsort(lat, n, sizeof(double), cmp_double);
        for (size_t i = 0; i < n; i++)
            fprintf(f, "%.3f %.5f\n", lat[i], (double)(i + 1) / (double)n);
        free(lat);
        fclose(f);
    }
    free(s);
}

/* The Kafka-side floor at `rate` (see direct_producer). */
static void kafka_floor(const struct opts *o, int rate, struct lat_result *res)
{
    char err[512];
    rd_kafka_conf_t *conf = producer_conf(o, "max.in.flight.requests.per.connection", "1");
    direct_producer = rd_kafka_new(RD_KAFKA_PRODUCER, conf, err, sizeof(err));
    if (!direct_producer)
        die("producer", err);
    rd_kafka_producev(direct_producer, RD_KAFKA_V_TOPIC("lat"), RD_KAFKA_V_VALUE("x", 1),
                      RD_KAFKA_V_END);
    rd_kafka_flush(direct_producer, 10000);
    /* Ids of our own, above any the relay ever gave: the consumer matches by them. */
    id_base += 100000000;
    atomic_store(&direct_next, 0);
    size_t n;
    struct lat_sample *s = lat_run(o, rate, o->latency_seconds, NULL, &n);
    lat_summary(s, n, -1e9, 1e9, res);
    res->achieved = (double)n / o->latency_seconds;
    free(s);
    rd_kafka_flush(direct_producer, 10000);
    rd_kafka_destroy(direct_producer);
    direct_producer = NULL;
}

/* ---- against a real cluster (OBX_BENCH_REAL) ---- */

/* The brokers' CPU so far (OBX_BENCH_BROKER_PIDS, comma-separated), s. */
double brokers_cpu_s(void)
{
    const char *pids = getenv("OBX_BENCH_BROKER_PIDS");
    double total = 0;
    for (const char *p = pids; p && *p;) {
        char *end;
        long pid = strtol(p, &end, 10);
        if (end == p || pid <= 0)
            die("OBX_BENCH_BROKER_PIDS", "want process ids separated by commas");
        struct proc_stats st = {0};
        proc_stats((pid_t)pid, &st);
        total += st.cpu_s;
        p = *end == ',' ? end + 1 : end;
    }
    return total;
}

struct broker_meter {
    double cpu0, cpu_s;
};

static void broker_meter_start(void *arg)
{
    struct broker_meter *m = arg;
    m->cpu0 = brokers_cpu_s();
}

static void broker_meter_stop(void *arg)
{
    struct broker_meter *m = arg;
    m->cpu_s = brokers_cpu_s() - m->cpu0;
}

/* After a relay started: the topic warmed up (its first record waits for
 * metadata), and id_base set to the next id, for the latency run. */
static void warm_up_latency(const struct opts *o)
{
    sleep(2);
    PGconn *c = connect_db(o);
    exec_ok(c, "SELECT outbox.enqueue('lat', 'warm-up', 'x'::bytea)");
    PQfinish(c);
    sleep(2);
    c = connect_db(o);
    id_base = query_int(c, "SELECT nextval(pg_get_serial_sequence('outbox.events', 'id'))");
    PQfinish(c);
}

/* relay.transactions in the real-cluster table: off, then on (with
 * OBX_BENCH_TXN_ROWS as relay.transaction_rows, else its default). */
static const char *const txn_settings[2] = {NULL, "relay.transactions=on"};
static const char *const txn_names[2] = {"idempotent", "transactions"};

static void real_kafka_table(const struct opts *o, int rounds)
{
    printf("| round | run | rows/s | relay CPU us/row | relay backend CPU us/row | brokers CPU "
           "us/row | machine CPU us/row | transactions/s |\n"
           "| --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for (int r = 1; r <= rounds; r++) {
        double machine_us, b0 = brokers_cpu_s();
        double rate = kafka_limit(o, 200, &machine_us);
        printf("| %d | bare idempotent producer | %.0f | | | %.1f | %.1f | |\n", r, rate,
               (brokers_cpu_s() - b0) * 1e6 / o->rows, machine_us);
        /* Both relays in each round, in alternating order. */
        for (int k = 0; k < 2; k++) {
            int t = (k + r) % 2;
            relay_more = txn_settings[t];
            struct broker_meter m = {0};
            struct drain_hook hook = {broker_meter_start, broker_meter_stop, &m};
            struct drain_result d;
            drain(o, OBX_ON_SENT_MARK, o->rows, 200, false, &d, NULL, &hook);
            char txns[32] = "";
            if (t == 1)
                snprintf(txns, sizeof(txns), "%.0f", d.txns * d.rows_per_s / o->rows);
            printf("| %d | outboxd drain, mark mode, %s | %.0f | %.1f | %.1f | %.1f | %.1f | %s "
                   "|\n",
                   r, txn_names[t], d.rows_per_s, d.cpu_per_100k * 10, d.pg_cpu_ms_per_1k,
                   m.cpu_s * 1e6 / o->rows, d.machine_us, txns);
            fflush(stdout);
        }
        relay_more = NULL;
    }
    printf("\n| 1,000 rows/s, commit to record read | round | achieved/s | p50 ms | p99 ms | "
           "p99.9 ms | max ms |\n| --- | --- | --- | --- | --- | --- | --- |\n");
    /* Alternating, the bare producer first: the brokers' JIT warms up
     * over the run, which would otherwise favour whoever goes last. */
    for (int r = 1; r <= rounds; r++) {
        struct lat_result lat, floor;
        kafka_floor(o, 1000, &floor);
        printf("| bare idempotent producer (from send) | %d | %.0f | %.1f | %.1f | %.1f | %.1f |\n",
               r, floor.achieved, floor.p50, floor.p99, floor.p999, floor.max);
        for (int k = 0; k < 2; k++) {
            int t = (k + r) % 2;
            relay_more = txn_settings[t];
            pid_t relay = spawn_outboxd(o, OBX_ON_SENT_MARK, NULL);
            warm_up_latency(o);
            latency(o, 1000, &lat);
            stop_outboxd(relay);
            printf("| outboxd, %s | %d | %.0f | %.1f | %.1f | %.1f | %.1f |\n", txn_names[t], r,
                   lat.achieved, lat.p50, lat.p99, lat.p999, lat.max);
            fflush(stdout);
        }
        relay_more = NULL;
    }
}

/* ---- what the application's database does to the relay ---- */

static double per_1k_ms(double cpu_s, long rows)
{
    return rows > 0 ? cpu_s * 1e6 / (double)rows : 0;
}

/* A held xmin horizon: a read-only REPEATABLE READ transaction keeps its
 * snapshot for the whole run while writers commit 1,000 rows/s and the
 * relay publishes them. Without `hold`, the same run with no snapshot held:
 * the control. */
/* A horizon run's figures for the three-mode table: p99 and the relay's
 * backend CPU per 1k rows in the first and the last minute, and the row
 * versions left dead in outbox.events at the end. */
struct horizon_result {
    double p99_first, p99_last, cpu_first, cpu_last;
    long long dead;
};

/* With `out`, nothing is printed: the figures go there. */
static void horizon(const struct opts *o, int on_sent, int seconds, bool hold, const char *context,
                    struct horizon_result *out)
{
    const int rate = 1000;
    int windows = (seconds + WINDOW_S - 1) / WINDOW_S;
    /* commit_at is indexed by id: the run's rows, the warm-ups and a margin */
    if ((long long)rate * seconds + 10000 > MAX_IDS || windows > MAX_WINDOWS)
        die("OBX_BENCH_HORIZON_SECONDS", "more than MAX_WINDOWS minutes");
    PGconn *c = connect_db(o);
    settle(c);
    pid_t relay = spawn_outboxd(o, on_sent, NULL);
    /* A warm relay and topics: a topic's first record waits for metadata. */
    for (int w = 0; w < windows; w++) {
        char topic[32];
        lat_topic(topic, sizeof(topic), windows, w);
        const char *v[1] = {topic};
        PGresult *r = PQexecParams(c, "SELECT outbox.enqueue($1, 'warm-up', 'x'::bytea)", 1, NULL,
                                   v, NULL, NULL, 0);
        if (PQresultStatus(r) != PGRES_TUPLES_OK)
            die("warm-up", PQresultErrorMessage(r));
        PQclear(r);
    }
    wait_drained(c, left_sql_for(on_sent), relay);
    sleep(1);
    id_base = query_int(c, "SELECT nextval(pg_get_serial_sequence('outbox.events', 'id'))");

    struct lat_probe probe = {.backend_pid = relay_backend_pid(c), .windows = windows};
    if (probe.backend_pid == 0)
        die("horizon", "the relay has no Postgres session");
    probe.cpu = calloc((size_t)windows + 1, sizeof(double));
    probe.arrived = calloc((size_t)windows, sizeof(long));
    if (!probe.cpu || !probe.arrived)
        die("horizon windows", "out of memory");

    /* The horizon, held as a report or pg_dump holds it: no xid, one
     * snapshot kept to the end of the transaction. */
    PGconn *h = connect_db(o);
    if (hold) {
        exec_ok(h, "BEGIN ISOLATION LEVEL REPEATABLE READ");
        exec_ok(h, "SELECT count(*) FROM outbox.kafka_offsets");
    }

    /* How often the relay asked: a fetch's cost is what the horizon grows. */
    static const char full_fetches[] = "outboxd_fetches_total{kind=\"full\"}",
                      keyset_fetches[] = "outboxd_fetches_total{kind=\"keyset\"}";
    long long full0 = relay_metric(full_fetches), keyset0 = relay_metric(keyset_fetches);
    /* The relay's other session (backlog and purge) reads the same table. */
    int maint_pid = (int)query_int(c, "SELECT coalesce(max(pid), 0) FROM pg_stat_activity"
                                      " WHERE application_name = 'outboxd-maintenance'");
    double maint0 = backend_cpu_s(maint_pid);
    struct proc_stats s0 = {0}, s1 = {0};
    proc_stats(relay, &s0);
    const char *mode = mode_name(on_sent);
    fprintf(stderr, "obx-bench: %s, %s mode, %d s at %d rows/s...\n",
            hold ? "held xmin horizon" : "control, no horizon held", mode, seconds, rate);
    size_t n;
    struct lat_sample *s = lat_run(o, rate, seconds, &probe, &n);
    proc_stats(relay, &s1);
    double maint1 = backend_cpu_s(maint_pid);
    long long full1 = relay_metric(full_fetches), keyset1 = relay_metric(keyset_fetches);
    long rows = atomic_load(&written);

    /* Backends publish their statistics at most once a second: wait, then
     * read them in a fresh session (no cached stats snapshot), the horizon
     * still held. */
    sleep(2);
    PGconn *f = connect_db(o);
    char sql[256];
    snprintf(sql, sizeof(sql),
             "SELECT coalesce(age(backend_xmin), 0) FROM pg_stat_activity WHERE pid = %d",
             PQbackendPID(h));
    long long xmin_age = query_int(f, sql);
    long long dead = query_int(f, "SELECT sum(n_dead_tup) FROM pg_stat_user_tables"
                                  " WHERE relid IN " OBX_STORE_SQL_EVENTS_PARTITIONS);
    long long live = query_int(f, "SELECT sum(n_live_tup) FROM pg_stat_user_tables"
                                  " WHERE relid IN " OBX_STORE_SQL_EVENTS_PARTITIONS);
    long long bytes = query_int(f, "SELECT sum(pg_total_relation_size(relid))"
                                   " FROM pg_partition_tree('outbox.events')");
    PQfinish(f);
    if (hold)
        exec_ok(h, "ROLLBACK");
    PQfinish(h);
    stop_outboxd(relay);
    exec_ok(c, "TRUNCATE outbox.events, outbox.kafka_offsets, outbox.log_cursor");
    PQfinish(c);

    /* OBX_BENCH_SAMPLES=FILE: every sample, "seconds-after-start latency-ms" a line, for
     * finding when the slow ones came. */
    const char *dump = getenv("OBX_BENCH_SAMPLES");
    if (dump && *dump) {
        FILE *samples = fopen(dump, "w");
        if (!samples)
            die(dump, strerror(errno));
        for (size_t i = 0; i < n; i++)
            fprintf(samples, "%.3f %.3f\n", s[i].at, s[i].lat * 1e3);
        if (fclose(samples) != 0)
            die(dump, strerror(errno));
    }
    if (out) {
        struct lat_result r0, r1;
        int last_from = (windows - 1) * WINDOW_S;
        lat_summary(s, n, 0, windows == 1 ? 1e9 : WINDOW_S, &r0);
        lat_summary(s, n, last_from, 1e9, &r1);
        *out = (struct horizon_result){
            .p99_first = r0.p99,
            .p99_last = r1.p99,
            .cpu_first = per_1k_ms(probe.cpu[1] - probe.cpu[0], probe.arrived[0]),
            .cpu_last =
                per_1k_ms(probe.cpu[windows] - probe.cpu[windows - 1], probe.arrived[windows - 1]),
            .dead = dead,
        };
        free(s);
        free(probe.cpu);
        free(probe.arrived);
        return;
    }
    if (hold)
        printf("outboxd under a held xmin horizon, %s mode: %s. One session holds a REPEATABLE "
               "READ snapshot (BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM "
               "outbox.kafka_offsets) for the whole run",
               mode, context);
    else
        printf("outboxd, control run for the held xmin horizon (no snapshot held), %s mode: %s. "
               "Nothing holds the horizon",
               mode, context);
    printf(" while 4 writers commit %d rows/s with outbox.enqueue for %d s, minute N on topic "
           "lat-N (%d partitions, %d keys; a fresh topic a minute: the mock broker's fetch walks a "
           "partition's whole log). Latency: commit -> record read by a consumer in this process, "
           "by the minute of the commit.\n\n",
           rate, seconds, PARTITIONS, KEYS);
    printf("| minute | rows committed | p50 | p99 | max | relay's backend CPU per 1k rows "
           "delivered in that minute |\n| --- | --- | --- | --- | --- | --- |\n");
    /* The damage builds up within the first minute: its first seconds are
     * the relay before it. */
    struct lat_result early;
    lat_summary(s, n, 0, 10, &early);
    printf("| first 10 s of 1 | %ld | %.2f ms | %.2f ms | %.2f ms | |\n", early.n, early.p50,
           early.p99, early.max);
    struct lat_result first = {0}, last = {0};
    for (int w = 0; w < windows; w++) {
        struct lat_result r;
        int from = w * WINDOW_S, to = w == windows - 1 ? seconds : from + WINDOW_S;
        /* The writers' clocks start a little after this one: the last
         * window takes every commit after its start. */
        lat_summary(s, n, from, w == windows - 1 ? 1e9 : to, &r);
        if (w == 0)
            first = r;
        last = r;
        printf("| %d (%d-%d s) | %ld | %.2f ms | %.2f ms | %.2f ms | %.1f ms |\n", w + 1, from, to,
               r.n, r.p50, r.p99, r.max,
               per_1k_ms(probe.cpu[w + 1] - probe.cpu[w], probe.arrived[w]));
    }
    long arrived = 0;
    for (int w = 0; w < windows; w++)
        arrived += probe.arrived[w];
    printf("\n| over the run | |\n| --- | --- |\n");
    printf("| p99, last minute / first minute | **%.1f x** (%.2f ms / %.2f ms) |\n",
           first.p99 > 0 ? last.p99 / first.p99 : 0, last.p99, first.p99);
    printf("| n_dead_tup of outbox.events at the end%s | %lld (n_live_tup %lld) |\n",
           hold ? ", horizon held" : "", dead, live);
    printf("| outbox.events with its indexes at the end | %.1f MB |\n", (double)bytes / 1048576.0);
    if (hold)
        printf("| age of the held snapshot's xmin at the end | %lld xids |\n", xmin_age);
    printf("| the relay's backend CPU per 1k rows, whole run | %.1f ms |\n",
           per_1k_ms(probe.cpu[windows] - probe.cpu[0], arrived));
    printf("| outboxd CPU per 1k rows, whole run | %.1f ms |\n",
           per_1k_ms(s1.cpu_s - s0.cpu_s, arrived));
    if (maint_pid)
        printf("| its maintenance session's backend CPU per 1k rows, whole run | %.1f ms |\n",
               per_1k_ms(maint1 - maint0, arrived));
    if (full0 >= 0 && keyset0 >= 0 && full1 >= 0 && keyset1 >= 0 && arrived > 0)
        printf("| the relay's fetches per 1k rows, whole run | %.0f full, %.0f keyset |\n",
               (double)(full1 - full0) * 1000.0 / (double)arrived,
               (double)(keyset1 - keyset0) * 1000.0 / (double)arrived);
    printf("| rows committed / records read back / matched to a commit | %ld / %ld / %zu |\n", rows,
           arrived, n);
    free(s);
    free(probe.cpu);
    free(probe.arrived);
}

/* One writing transaction open during a drain: a session that took an xid
 * (as an application transaction that wrote something) before the rows. */
struct open_writer {
    const struct opts *o;
    PGconn *c;
};

static void open_writer_begin(void *arg)
{
    struct open_writer *w = arg;
    w->c = connect_db(w->o);
    exec_ok(w->c, "BEGIN");
    exec_ok(w->c, "SELECT pg_current_xact_id()");
}

static void open_writer_end(void *arg)
{
    struct open_writer *w = arg;
    exec_ok(w->c, "ROLLBACK");
    PQfinish(w->c);
    w->c = NULL;
}

/* The drain of 3. without (a) and with (b) the open writer, PAIRS pairs,
 * (a) first in odd pairs and (b) first in even ones so that drift on this
 * machine favours neither. */
static void open_writer_bench(const struct opts *o, int on_sent, const char *context)
{
    struct open_writer w = {.o = o};
    const struct drain_hook hook = {open_writer_begin, open_writer_end, &w};
    struct drain_result a[PAIRS], b[PAIRS];
    double rate[PAIRS], pg[PAIRS], own[PAIRS];
    const char *mode = on_sent == OBX_ON_SENT_DELETE ? "delete" : "mark";
    for (int i = 0; i < PAIRS; i++) {
        if (i % 2 == 0) {
            drain(o, on_sent, o->rows, 200, false, &a[i], NULL, NULL);
            drain(o, on_sent, o->rows, 200, false, &b[i], NULL, &hook);
        } else {
            drain(o, on_sent, o->rows, 200, false, &b[i], NULL, &hook);
            drain(o, on_sent, o->rows, 200, false, &a[i], NULL, NULL);
        }
        rate[i] = b[i].rows_per_s / a[i].rows_per_s;
        pg[i] = b[i].pg_cpu_ms_per_1k / a[i].pg_cpu_ms_per_1k;
        own[i] = b[i].cpu_per_100k / a[i].cpu_per_100k;
        fprintf(stderr, "obx-bench:   open writer, %s, pair %d: %.0f -> %.0f rows/s = %.2f\n", mode,
                i + 1, a[i].rows_per_s, b[i].rows_per_s, rate[i]);
    }

    printf("outboxd drain with one writing transaction open, %s mode: %s. (a) the drain of %d "
           "pre-filled rows (200-byte payloads, one transaction) by the real outboxd; (b) the "
           "same while another session, which ran BEGIN; SELECT pg_current_xact_id() before the "
           "rows were written, stays open until the drain has ended (then ROLLBACK). %d pairs, "
           "alternating order. CPU: the relay's Postgres backend per 1,000 rows, outboxd's "
           "process (all threads) per row.\n\n",
           mode, context, o->rows, PAIRS);
    printf("| pair (order) | (a) rows/s | (b) open writer, rows/s | (b)/(a) | backend CPU per 1k "
           "rows (a) -> (b) | outboxd CPU per row (a) -> (b) |\n"
           "| --- | --- | --- | --- | --- | --- |\n");
    for (int i = 0; i < PAIRS; i++)
        printf("| %d (%s) | %.0f | %.0f | %.2f | %.1f -> %.1f ms (%.2f x) | %.1f -> %.1f us "
               "(%.2f x) |\n",
               i + 1, i % 2 == 0 ? "a, b" : "b, a", a[i].rows_per_s, b[i].rows_per_s, rate[i],
               a[i].pg_cpu_ms_per_1k, b[i].pg_cpu_ms_per_1k, pg[i], a[i].cpu_per_100k * 10.0,
               b[i].cpu_per_100k * 10.0, own[i]);
    printf("| **median** | %.0f | %.0f | **%.2f** | %.1f -> %.1f ms (**%.2f x**) | %.1f -> %.1f "
           "us (%.2f x) |\n",
           median3(a[0].rows_per_s, a[1].rows_per_s, a[2].rows_per_s),
           median3(b[0].rows_per_s, b[1].rows_per_s, b[2].rows_per_s),
           median3(rate[0], rate[1], rate[2]),
           median3(a[0].pg_cpu_ms_per_1k, a[1].pg_cpu_ms_per_1k, a[2].pg_cpu_ms_per_1k),
           median3(b[0].pg_cpu_ms_per_1k, b[1].pg_cpu_ms_per_1k, b[2].pg_cpu_ms_per_1k),
           median3(pg[0], pg[1], pg[2]),
           median3(a[0].cpu_per_100k, a[1].cpu_per_100k, a[2].cpu_per_100k) * 10.0,
           median3(b[0].cpu_per_100k, b[1].cpu_per_100k, b[2].cpu_per_100k) * 10.0,
           median3(own[0], own[1], own[2]));
}

/* ---- main ---- */

static void machine(char *buf, size_t len)
{
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    snprintf(buf, len, "unknown CPU");
    while (f && fgets(line, sizeof(line), f)) {
        if (strncmp(line, "model name", 10) == 0) {
            char *p = strchr(line, ':');
            if (p) {
                p += 2;
                p[strcspn(p, "\n")] = '\0';
                snprintf(buf, len, "%s", p);
            }
            break;
        }
    }
    if (f)
        fclose(f);
}

/* OBX_BENCH_TABLE_HORIZON: seconds of each mode's held-horizon run in the
 * three-mode table (default 120; bench/run creates its topics). */
static int table_horizon_seconds(void)
{
    const char *env = getenv("OBX_BENCH_TABLE_HORIZON");
    char *end = NULL;
    long s = env ? strtol(env, &end, 10) : 120;
    if (env && (*env == '\0' || *end != '\0' || s < 10 || s > MAX_WINDOWS * WINDOW_S))
        die("OBX_BENCH_TABLE_HORIZON", "want 10 to 3600 seconds");
    return (int)s;
}

/* mark, delete or log, from the variable `name`. */
static int mode_of(const char *name, const char *value)
{
    if (strcmp(value, "mark") == 0)
        return OBX_ON_SENT_MARK;
    if (strcmp(value, "delete") == 0)
        return OBX_ON_SENT_DELETE;
    if (strcmp(value, "log") == 0)
        return OBX_ON_SENT_LOG;
    die(name, "want mark, delete or log");
}

/* One table row of a Postgres-side measurement and what it cost. */
static void cost_row(const char *num, const char *what, double rate, const struct pg_cost *c)
{
    printf("| %s | %s | %.0f rows/s; %.0f WAL bytes/row; %.1f ms backend CPU per 1k rows |\n", num,
           what, rate, c->wal_per_row, c->cpu_ms_per_1k);
}

/* The command line into `o`. */
static void parse_args(int argc, char **argv, struct opts *o)
{
    static const struct option longopts[] = {{"conninfo", required_argument, NULL, 'c'},
                                             {"bootstrap", required_argument, NULL, 'b'},
                                             {"outboxd", required_argument, NULL, 'o'},
                                             {"malloc-count", required_argument, NULL, 'm'},
                                             {"rows", required_argument, NULL, 'r'},
                                             {"latency-seconds", required_argument, NULL, 'l'},
                                             {NULL, 0, NULL, 0}};
    int opt;
    while ((opt = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        switch (opt) {
        case 'c':
            o->conninfo = optarg;
            break;
        case 'b':
            o->bootstrap = optarg;
            break;
        case 'o':
            o->outboxd = optarg;
            break;
        case 'm':
            o->malloc_lib = optarg;
            break;
        case 'r':
            o->rows = atoi(optarg);
            break;
        case 'l':
            o->latency_seconds = atoi(optarg);
            break;
        default:
            die("usage", "see bench/run");
        }
    }
    if (!o->conninfo || !o->bootstrap || !o->outboxd)
        die("usage", "--conninfo, --bootstrap and --outboxd are required");
}

/* What every table's first line says of the run. */
struct run_env {
    char cpu[256], date[32], pgver[64];
    char context[512];
};

static void run_env(const struct opts *o, struct run_env *e)
{
    machine(e->cpu, sizeof(e->cpu));
    time_t t = time(NULL);
    strftime(e->date, sizeof(e->date), "%Y-%m-%d", gmtime(&t));
    PGconn *c = connect_db(o);
    snprintf(e->pgver, sizeof(e->pgver), "%lld", query_int(c, "SHOW server_version_num"));
    PQfinish(c);
    snprintf(e->context, sizeof(e->context),
             "%s, %s, %ld cores; PostgreSQL %s (fsync=off), librdkafka %s mock cluster (3 "
             "brokers, TCP_NODELAY), all on this machine; outboxd defaults",
             e->date, e->cpu, sysconf(_SC_NPROCESSORS_ONLN), e->pgver, rd_kafka_version_str());
}

/* OBX_BENCH_LATENCY_ONLY: the latency rows alone, N s a rate, with what
 * the looks for new rows cost; and the Kafka side alone. */
static void latency_only(struct opts *o, const char *context)
{
    PGconn *c;
    char *end = NULL;
    long secs = strtol(getenv("OBX_BENCH_LATENCY_ONLY"), &end, 10);
    if (end == getenv("OBX_BENCH_LATENCY_ONLY") || *end != '\0' || secs < 1 || secs > 600)
        die("OBX_BENCH_LATENCY_ONLY", "want seconds a rate, 1 to 600");
    o->latency_seconds = (int)secs;
    /* OBX_BENCH_LATENCY_MODE=mark|delete|log: the relay's mode (mark). */
    const char *lm = getenv("OBX_BENCH_LATENCY_MODE");
    int lat_mode = lm ? mode_of("OBX_BENCH_LATENCY_MODE", lm) : OBX_ON_SENT_MARK;
    pid_t relay = spawn_outboxd(o, lat_mode, NULL);
    sleep(2);
    c = connect_db(o);
    exec_ok(c, "SELECT outbox.enqueue('lat', 'warm-up', 'x'::bytea)");
    sleep(2);
    id_base = query_int(c, "SELECT nextval(pg_get_serial_sequence('outbox.events', 'id'))");
    int backend = relay_backend_pid(c);
    PQfinish(c);
    printf("outboxd latency, %s: commit -> record read by a consumer in this process, "
           "4 writers, %s mode, outboxd defaults, %d s a rate; and the Kafka side alone: "
           "records produced straight to Kafka with outboxd's producer settings, no "
           "Postgres, read back by the same consumer. What the looks for new rows cost: "
           "the relay's fetches a second and its Postgres backend's CPU, idle (no writer, "
           "%d s) and at each rate.\n\n",
           context, mode_name(lat_mode), o->latency_seconds, o->latency_seconds);
    printf("| rate | achieved | samples | p50 | p99 | p99.9 | max | fetches/s | relay "
           "backend CPU |\n"
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    struct look_cost idle0 = look_cost_now(backend);
    sleep((unsigned)o->latency_seconds);
    struct look_cost idle1 = look_cost_now(backend);
    printf("| idle | - | - | - | - | - | - | %.0f | %.1f ms/s |\n",
           (double)(idle1.fetches - idle0.fetches) / (idle1.at - idle0.at),
           (idle1.cpu_s - idle0.cpu_s) * 1e3 / (idle1.at - idle0.at));
    static const int only_rates[3] = {100, 1000, 5000};
    lat_cost_backend = backend;
    for (int i = 0; i < 3; i++) {
        struct lat_result l;
        latency(o, only_rates[i], &l);
        struct look_cost c0 = lat_cost[0], c1 = lat_cost[1];
        printf("| %d/s | %.0f/s | %ld | %.2f ms | %.2f ms | %.2f ms | %.2f ms | %.0f | %.1f "
               "ms/s |\n",
               only_rates[i], l.achieved, l.n, l.p50, l.p99, l.p999, l.max,
               (double)(c1.fetches - c0.fetches) / (c1.at - c0.at),
               (c1.cpu_s - c0.cpu_s) * 1e3 / (c1.at - c0.at));
    }
    lat_cost_backend = 0;
    stop_outboxd(relay);
    for (int i = 0; i < 3; i++) {
        struct lat_result l;
        kafka_floor(o, only_rates[i], &l);
        printf("| %d/s, Kafka side alone | %.0f/s | %ld | %.2f ms | %.2f ms | %.2f ms | "
               "%.2f ms |\n",
               only_rates[i], l.achieved, l.n, l.p50, l.p99, l.p999, l.max);
    }
}

/* OBX_BENCH_DRAIN_ONLY=MODE: quick experiments, one drain against its
 * mode's limit. */
static void drain_only(const struct opts *o, const char *mode_text)
{
    int mode = mode_of("OBX_BENCH_DRAIN_ONLY", mode_text);
    struct pg_cost job = job_limit(o, mode, 200);
    struct drain_result d;
    drain(o, mode, o->rows, 200, false, &d, NULL, NULL);
    printf("%s: job's limit %.0f rows/s (%.1f ms backend CPU per 1k rows, %.1f us machine "
           "CPU per row, %.1f WAL bytes per row), drain %.0f rows/s = %.2f (%.1f ms backend "
           "CPU per 1k rows, %.1f us "
           "machine CPU per row, %.1f WAL bytes and %.3f dead versions per row), %.2f s "
           "outboxd CPU per 100k\n",
           mode_name(mode), job.rows_per_s, job.cpu_ms_per_1k, job.machine_us, job.wal_per_row,
           d.rows_per_s, d.rows_per_s / job.rows_per_s, d.pg_cpu_ms_per_1k, d.machine_us,
           d.wal_per_row, d.dead_per_row, d.cpu_per_100k);
}

/* The default run: every measurement first, then the tables. */
struct full_run {
    struct paired p_mark, p_delete, p_log;
    struct drain_result d_4k, d_alloc;
    struct pg_cost job_4k;
    double purge, kafka, kafka_4k, kafka_machine_us;
    long allocs;
    struct lat_result lat[3], lat_mode[3], floor_1k;
    struct horizon_result hz[3];
    int hz_seconds;
};

static const int full_rates[3] = {100, 1000, 5000};
static const int full_modes[3] = {OBX_ON_SENT_MARK, OBX_ON_SENT_DELETE, OBX_ON_SENT_LOG};

static void full_measure(const struct opts *o, struct full_run *f)
{
    PGconn *c;
    fprintf(stderr, "obx-bench: 1+3/5 Postgres-side limit and outboxd drain, paired...\n");
    paired(o, OBX_ON_SENT_MARK, 200, true, &f->p_mark);
    paired(o, OBX_ON_SENT_DELETE, 200, false, &f->p_delete);
    paired(o, OBX_ON_SENT_LOG, 200, false, &f->p_log);
    f->job_4k = job_limit(o, OBX_ON_SENT_MARK, 4096);
    drain(o, OBX_ON_SENT_MARK, o->rows, 4096, false, &f->d_4k, NULL, NULL);
    f->purge = purge_rate(o, 1000);
    f->allocs = -1;
    if (o->malloc_lib)
        drain(o, OBX_ON_SENT_MARK, o->rows, 200, false, &f->d_alloc, &f->allocs, NULL);
    fprintf(stderr, "obx-bench: 4/5 latency...\n");
    pid_t relay = spawn_outboxd(o, OBX_ON_SENT_MARK, NULL);
    warm_up_latency(o);
    for (int i = 0; i < 3; i++)
        latency(o, full_rates[i], &f->lat[i]);
    stop_outboxd(relay);
    /* Each mode at 1,000 rows/s, then under a held horizon (the three-mode
     * table). */
    f->hz_seconds = table_horizon_seconds();
    f->lat_mode[0] = f->lat[1];
    for (int m = 1; m < 3; m++) {
        relay = spawn_outboxd(o, full_modes[m], NULL);
        sleep(2);
        c = connect_db(o);
        id_base = query_int(c, "SELECT nextval(pg_get_serial_sequence('outbox.events', 'id'))");
        PQfinish(c);
        size_t n;
        struct lat_sample *s = lat_run(o, 1000, o->latency_seconds, NULL, &n);
        lat_summary(s, n, -1e9, 1e9, &f->lat_mode[m]);
        f->lat_mode[m].achieved = (double)n / o->latency_seconds;
        free(s);
        stop_outboxd(relay);
    }
    kafka_floor(o, 1000, &f->floor_1k);
    for (int m = 0; m < 3; m++) {
        lat_series = m + 1;
        horizon(o, full_modes[m], f->hz_seconds, true, "", &f->hz[m]);
    }
    lat_series = 0;
    /* Last, on a topic of its own: the volume it pushes through the mock
     * (about 1 GB) would slow whatever ran after it. */
    fprintf(stderr, "obx-bench: 2/5 Kafka-side limit...\n");
    f->kafka_machine_us = 0;
    f->kafka = kafka_limit(o, 200, &f->kafka_machine_us);
    f->kafka_4k = kafka_limit(o, 4096, NULL);
}

static void full_print(const struct opts *o, const struct run_env *e, const struct full_run *f)
{
    printf("outboxd benchmark, %s: %s, %ld cores; PostgreSQL %s (fsync=off), librdkafka %s "
           "mock cluster (3 brokers, TCP_NODELAY), all on this machine; outboxd defaults "
           "(batch %d, linger.ms 1); %d rows, 200-byte payloads, 3 headers, %d keys, %d "
           "partitions.\n\n",
           e->date, e->cpu, sysconf(_SC_NPROCESSORS_ONLN), e->pgver, rd_kafka_version_str(), BATCH,
           o->rows, KEYS, PARTITIONS);
    printf("| # | measurement | result |\n| --- | --- | --- |\n");
    cost_row("0",
             "**the job's limit**, mark (minimal SELECT + UPDATE ... WHERE id = ANY, pipelined, "
             "1 connection; median of 3)",
             f->p_mark.job, &f->p_mark.job_cost);
    cost_row("0", "the job's limit, delete (minimal SELECT + DELETE ... WHERE id = ANY)",
             f->p_delete.job, &f->p_delete.job_cost);
    printf("| 0 | the job's limit, mark, 4 KiB payloads (TOAST) | %.0f rows/s |\n",
           f->job_4k.rows_per_s);
    cost_row("1", "outboxd's own fetch + mark statements in a plain loop, mark (median of 3)",
             f->p_mark.own, &f->p_mark.own_cost);
    cost_row("1", "outboxd's own statements, delete", f->p_delete.own, &f->p_delete.own_cost);
    printf("| 1 | retention purge of sent rows (mark mode), batches of 1000 | %.0f rows/s |\n",
           f->purge);
    printf("| 2 | Kafka-side limit (bare idempotent producer, same records) | %.0f records/s |\n",
           f->kafka);
    printf("| 2 | Kafka-side limit, 4 KiB payloads | %.0f records/s |\n", f->kafka_4k);
    printf("| 3 | outboxd drain, mark (median of %d) | %.0f rows/s = **%.2f x the job's limit** "
           "(pairs %.2f-%.2f); %.0f WAL bytes/row; its backend %.1f ms CPU per 1k rows |\n",
           PAIRS, f->p_mark.drain, f->p_mark.ratio, f->p_mark.ratio_min, f->p_mark.ratio_max,
           f->p_mark.first.wal_per_row, f->p_mark.first.pg_cpu_ms_per_1k);
    printf("| 3 | outboxd drain, delete (median of %d) | %.0f rows/s = **%.2f x the job's "
           "limit** (pairs %.2f-%.2f); %.0f WAL bytes/row; its backend %.1f ms CPU per 1k rows |\n",
           PAIRS, f->p_delete.drain, f->p_delete.ratio, f->p_delete.ratio_min,
           f->p_delete.ratio_max, f->p_delete.first.wal_per_row,
           f->p_delete.first.pg_cpu_ms_per_1k);
    double limit_4k = f->job_4k.rows_per_s < f->kafka_4k ? f->job_4k.rows_per_s : f->kafka_4k;
    printf("| 3 | outboxd drain, mark, 4 KiB payloads | %.0f rows/s = **%.2f x the job's limit**; "
           "%.2f x the lower of it and Kafka's |\n",
           f->d_4k.rows_per_s, f->d_4k.rows_per_s / f->job_4k.rows_per_s,
           f->d_4k.rows_per_s / limit_4k);
    for (int i = 0; i < 3; i++)
        printf("| 4 | latency at %d events/s (achieved %.0f/s, %ld samples): commit -> consumer "
               "| p50 %.2f ms, p99 %.2f ms, p99.9 %.2f ms, max %.2f ms |\n",
               full_rates[i], f->lat[i].achieved, f->lat[i].n, f->lat[i].p50, f->lat[i].p99,
               f->lat[i].p999, f->lat[i].max);
    printf("| 5 | peak RSS of outboxd (drain, mark) | %.1f MB |\n",
           f->p_mark.first.peak_kb / 1024.0);
    printf("| 5 | CPU per 100k rows (drain, mark) | %.2f s |\n", f->p_mark.first.cpu_per_100k);
    if (f->allocs >= 0)
        printf("| 5 | allocations per row during the drain (malloc+calloc+realloc, all "
               "threads, librdkafka's included) | %.2f |\n",
               (double)f->allocs / o->rows);
    printf("| 5 | CPU while idle for 10 s | %.2f s |\n", f->p_mark.first.idle_cpu_s);

    /* The three modes side by side. */
    const struct paired *pm[3] = {&f->p_mark, &f->p_delete, &f->p_log};
    printf("\nThe three modes (relay.on_sent), same run. Drain: median of %d, x its mode's job's "
           "limit (log mode's: the minimal keyset SELECT alone). CPU efficiency: the machine's "
           "CPU per row of the job's limit plus the bare producer's, over the drain's (all "
           "processes; 1 = no overhead of its own). Dead versions: updates and deletes of "
           "outbox.events per row relayed. p99: commit -> consumer at 1,000 rows/s, %d s. Held "
           "horizon: %d s at 1,000 rows/s while a REPEATABLE READ snapshot is held; last minute "
           "over first.\n\n",
           PAIRS, o->latency_seconds, f->hz_seconds);
    printf("| mode | drain | x job's limit | CPU efficiency | WAL bytes/row | dead versions/row "
           "| relay backend CPU per 1k rows | p99 at 1,000/s | held horizon: p99 | held "
           "horizon: backend CPU per 1k rows | n_dead_tup at its end |\n"
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for (int m = 0; m < 3; m++) {
        const struct paired *q = pm[m];
        double eff = q->first.machine_us > 0
                         ? (q->job_cost.machine_us + f->kafka_machine_us) / q->first.machine_us
                         : 0;
        printf("| %s | %.0f rows/s | %.2f (pairs %.2f-%.2f) | %.2f (%.1f + %.1f / %.1f us) | %.1f "
               "| %.3f | %.1f ms | %.2f ms | %.2f -> %.2f ms (%.2f x) | %.1f -> %.1f ms (%.2f x) "
               "| %lld |\n",
               mode_name(full_modes[m]), q->drain, q->ratio, q->ratio_min, q->ratio_max, eff,
               q->job_cost.machine_us, f->kafka_machine_us, q->first.machine_us,
               q->first.wal_per_row, q->first.dead_per_row, q->first.pg_cpu_ms_per_1k,
               f->lat_mode[m].p99, f->hz[m].p99_first, f->hz[m].p99_last,
               f->hz[m].p99_first > 0 ? f->hz[m].p99_last / f->hz[m].p99_first : 0,
               f->hz[m].cpu_first, f->hz[m].cpu_last,
               f->hz[m].cpu_first > 0 ? f->hz[m].cpu_last / f->hz[m].cpu_first : 0, f->hz[m].dead);
    }
    printf("\nLog mode's relay backend CPU per row: %.2f of mark mode's; its drain %.2f x mark "
           "mode's. The Kafka side alone at 1,000 records/s (produced straight to the mock "
           "cluster with outboxd's producer settings, read back by the same consumer, no "
           "Postgres): p50 %.2f ms, p99 %.2f ms.\n",
           f->p_log.first.pg_cpu_ms_per_1k / f->p_mark.first.pg_cpu_ms_per_1k,
           f->p_log.drain / f->p_mark.drain, f->floor_1k.p50, f->floor_1k.p99);
}

int main(int argc, char **argv)
{
    struct opts o = {.rows = 200000, .latency_seconds = 5};
    parse_args(argc, argv, &o);
    http_port = free_port();
    signal(SIGTERM, on_fatal_signal);
    signal(SIGINT, on_fatal_signal);
    commit_at = calloc(MAX_IDS, sizeof(double));
    if (!commit_at)
        die("commit times", "out of memory");
    struct run_env e;
    run_env(&o, &e);

    /* The application's database against the relay: each alone. */
    const char *held = getenv("OBX_BENCH_HORIZON");
    if (held) {
        const char *env = getenv("OBX_BENCH_HORIZON_SECONDS");
        char *end = NULL;
        long seconds = env ? strtol(env, &end, 10) : 300;
        if (env &&
            (*env == '\0' || *end != '\0' || seconds <= 0 || seconds > MAX_WINDOWS * WINDOW_S))
            die("OBX_BENCH_HORIZON_SECONDS", "want a number of seconds");
        /* OBX_BENCH_HORIZON_HOLD=0: the same run with nothing held. */
        const char *hold = getenv("OBX_BENCH_HORIZON_HOLD");
        horizon(&o, mode_of("OBX_BENCH_HORIZON", held), (int)seconds,
                !hold || strcmp(hold, "0") != 0, e.context, NULL);
        return 0;
    }
    const char *open_writer = getenv("OBX_BENCH_OPEN_WRITER");
    if (open_writer) {
        open_writer_bench(&o, mode_of("OBX_BENCH_OPEN_WRITER", open_writer), e.context);
        return 0;
    }
    if (getenv("OBX_BENCH_LATENCY_ONLY")) {
        latency_only(&o, e.context);
        return 0;
    }
    if (getenv("OBX_BENCH_SHARDS")) {
        const char *mode = getenv("OBX_BENCH_SHARDS_MODE");
        if (mode && *mode)
            shard_on_sent = mode_of("OBX_BENCH_SHARDS_MODE", mode);
        long rounds = strtol(getenv("OBX_BENCH_SHARDS"), NULL, 10);
        shard_table(&o, rounds < 1 ? 3 : (int)rounds);
        return 0;
    }
    if (getenv("OBX_BENCH_PEER")) {
        long rounds = strtol(getenv("OBX_BENCH_PEER"), NULL, 10);
        printf("outboxd and Debezium, %s: %s, %ld cores; PostgreSQL %s (wal_level=logical, "
               "fsync and synchronous_commit on), one Apache Kafka broker (KRaft, replication "
               "factor 1, acks=all); Debezium 3.6.1.Final on the embedded engine with the "
               "Outbox Event Router (bench/debezium); outboxd defaults; 200-byte payloads, 3 "
               "headers, %d keys, %d partitions.\n",
               e.date, e.cpu, sysconf(_SC_NPROCESSORS_ONLN), e.pgver, KEYS, PARTITIONS);
        peer_table(&o, rounds < 1 ? 3 : (int)rounds);
        return 0;
    }
    if (getenv("OBX_BENCH_REAL")) {
        long rounds = strtol(getenv("OBX_BENCH_REAL"), NULL, 10);
        real_kafka_table(&o, rounds < 1 ? 3 : (int)rounds);
        return 0;
    }
    if (getenv("OBX_BENCH_DRAIN_ONLY")) {
        drain_only(&o, getenv("OBX_BENCH_DRAIN_ONLY"));
        return 0;
    }
    if (getenv("OBX_BENCH_HELD")) {
        held_bench(&o, getenv("OBX_BENCH_HELD"));
        return 0;
    }
    static struct full_run f; /* large: off the stack */
    full_measure(&o, &f);
    full_print(&o, &e, &f);
    return 0;
}
