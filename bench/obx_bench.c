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
 */
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

#define BATCH      1000
#define PARTITIONS 12
#define KEYS       300

struct opts {
    const char *conninfo, *bootstrap, *outboxd, *malloc_lib;
    int rows;
    int latency_seconds;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void die(const char *what, const char *detail)
{
    fprintf(stderr, "obx-bench: %s: %s\n", what, detail ? detail : "");
    exit(1);
}

static PGconn *connect_db(const struct opts *o)
{
    PGconn *c = PQconnectdb(o->conninfo);
    if (PQstatus(c) != CONNECTION_OK)
        die("connect", PQerrorMessage(c));
    return c;
}

static void exec_ok(PGconn *c, const char *sql)
{
    PGresult *r = PQexec(c, sql);
    if (PQresultStatus(r) != PGRES_COMMAND_OK && PQresultStatus(r) != PGRES_TUPLES_OK)
        die(sql, PQresultErrorMessage(r));
    PQclear(r);
}

static long long query_int(PGconn *c, const char *sql)
{
    PGresult *r = PQexec(c, sql);
    if (PQresultStatus(r) != PGRES_TUPLES_OK)
        die(sql, PQresultErrorMessage(r));
    long long v = strtoll(PQgetvalue(r, 0, 0), NULL, 10);
    PQclear(r);
    return v;
}

/* N rows like the workload: 200-byte payloads (or `payload` bytes),
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
static void settle(PGconn *c)
{
    exec_ok(c, "TRUNCATE outbox.events, outbox.kafka_offsets");
    exec_ok(c, "VACUUM ANALYZE outbox.events");
    exec_ok(c, "CHECKPOINT");
}

/* What a run cost Postgres: WAL written and the serving backend's CPU. */
struct pg_cost {
    double rows_per_s;
    double wal_per_row;   /* bytes */
    double cpu_ms_per_1k; /* backend CPU per 1,000 rows */
};

static double backend_cpu_s(int pid);

static char *wal_lsn(PGconn *c, char *buf, size_t len)
{
    PGresult *r = PQexec(c, "SELECT pg_current_wal_lsn()");
    if (PQresultStatus(r) != PGRES_TUPLES_OK)
        die("pg_current_wal_lsn", PQresultErrorMessage(r));
    snprintf(buf, len, "%s", PQgetvalue(r, 0, 0));
    PQclear(r);
    return buf;
}

static double wal_since(PGconn *c, const char *lsn)
{
    char sql[160];
    snprintf(sql, sizeof(sql), "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '%s')::bigint", lsn);
    return (double)query_int(c, sql);
}

/* A Postgres-side run: a prefilled, analyzed table, and the starting WAL
 * position and backend CPU of the connection that will drain it. */
static PGconn *cost_start(const struct opts *o, int payload, char *lsn, size_t lsn_len,
                          double *cpu0)
{
    PGconn *c = connect_db(o);
    settle(c);
    prefill(c, o->rows, payload);
    exec_ok(c, "VACUUM ANALYZE outbox.events");
    wal_lsn(c, lsn, lsn_len);
    *cpu0 = backend_cpu_s(PQbackendPID(c));
    return c;
}

static struct pg_cost cost_finish(PGconn *c, long done, double t0, const char *lsn, double cpu0,
                                  struct obx_pg_array *ids)
{
    double t = now_s() - t0;
    struct pg_cost cost = {.rows_per_s = (double)done / t};
    cost.cpu_ms_per_1k = (backend_cpu_s(PQbackendPID(c)) - cpu0) * 1e6 / (double)done;
    cost.wal_per_row = wal_since(c, lsn) / (double)done;
    obx_pg_array_free(ids);
    exec_ok(c, "TRUNCATE outbox.events, outbox.kafka_offsets");
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

static struct pg_cost job_limit(const struct opts *o, int on_sent, int payload)
{
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
    char mark_sql[2048];
    obx_store_sql_mark_plain(on_sent, mark_sql, sizeof(mark_sql)); /* no dead letters here */
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
        const char *fv[7] = {hwm > 0 ? after : "{}", limit, "{}", "{}", "{}", row_cap, snap};
        PGresult *r = hwm > 0 ? PQexecPrepared(c, "k", 7, fv, NULL, NULL, 1)
                              : PQexecParams(c, full_sql, 5, NULL, fv + 1, NULL, NULL, 1);
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
        const char *mv[6] = {obx_pg_array_finish(&ids),
                             "{bench,bench,bench,bench,bench,bench,bench,bench,bench,bench,bench,"
                             "bench}",
                             "{0,1,2,3,4,5,6,7,8,9,10,11}",
                             "{1,1,1,1,1,1,1,1,1,1,1,1}",
                             "{}",
                             "{}"};
        r = PQexecPrepared(c, "m", 4, mv, NULL, NULL, 0); /* one statement: its own transaction */
        if (PQresultStatus(r) != PGRES_COMMAND_OK)
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
        const char *v[3] = {cursor, limit, period};
        PGresult *r = PQexecParams(c, obx_store_sql_purge(), 3, NULL, v, NULL, NULL, 0);
        if (PQresultStatus(r) != PGRES_TUPLES_OK)
            die("purge", PQresultErrorMessage(r));
        bool done = PQgetisnull(r, 0, 0) || atol(PQgetvalue(r, 0, 2)) > 0;
        if (!PQgetisnull(r, 0, 0))
            snprintf(cursor, sizeof(cursor), "%s", PQgetvalue(r, 0, 0));
        deleted += atol(PQgetvalue(r, 0, 1));
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

static double kafka_limit(const struct opts *o, size_t payload_len)
{
    static char payload[4096];
    char err[512], key[32], id[24], trace[64];
    rd_kafka_conf_t *conf = rd_kafka_conf_new();
    const char *settings[][2] = {{"bootstrap.servers", o->bootstrap},
                                 {"enable.idempotence", "true"},
                                 {"message.timeout.ms", "0"},
                                 {"partitioner", "murmur2_random"},
                                 {"linger.ms", "1"}};
    for (size_t i = 0; i < sizeof(settings) / sizeof(settings[0]); i++)
        if (rd_kafka_conf_set(conf, settings[i][0], settings[i][1], err, sizeof(err)))
            die("producer conf", err);
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
    double t0 = now_s();
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
    rd_kafka_destroy(rk);
    return o->rows / t;
}

/* ---- the outboxd process ---- */

struct proc_stats {
    double cpu_s; /* user + system */
    long peak_kb; /* VmHWM */
};

static pid_t spawn_outboxd(const struct opts *o, int on_sent, const char *count_file)
{
    char conninfo[1024], bootstrap[600];
    snprintf(conninfo, sizeof(conninfo), "postgres.conninfo=%s", o->conninfo);
    snprintf(bootstrap, sizeof(bootstrap), "kafka.bootstrap.servers=%s", o->bootstrap);
    pid_t pid = fork();
    if (pid < 0)
        die("fork", strerror(errno));
    if (pid == 0) {
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
                                                      : "relay.on_sent=mark",
                        "-X",
                        "log.level=warn",
                        NULL,
                        NULL,
                        NULL};
        /* OBX_BENCH_X=key=value: one extra setting, for trying alternatives. */
        const char *extra = getenv("OBX_BENCH_X");
        if (extra && *extra) {
            argv[9] = "-X";
            argv[10] = (char *)extra;
        }
        execve(o->outboxd, argv, envp);
        _exit(127);
    }
    return pid;
}

static void proc_stats(pid_t pid, struct proc_stats *st)
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

static double backend_cpu_s(int pid)
{
    struct proc_stats st = {0};
    proc_stats((pid_t)pid, &st);
    return st.cpu_s;
}

static void stop_outboxd(pid_t pid)
{
    int status;
    kill(pid, SIGTERM);
    waitpid(pid, &status, 0);
}

struct drain_result {
    double rows_per_s;
    double pg_cpu_ms_per_1k; /* the relay's Postgres backend */
    double wal_per_row;
    double cpu_per_100k;
    long peak_kb;
    double idle_cpu_s; /* over 10 s */
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
static void wait_drained(PGconn *c, const char *sql)
{
    while (query_int(c, sql) > 0)
        usleep(20000);
}

/* outboxd_rows_marked_total from the relay's /metrics (http.listen's
 * default address), or -1 if it cannot be read. */
static long long marked_total(void)
{
    static char buf[1 << 16];
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(9187)};
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
        const char *p = strstr(buf, "\noutboxd_rows_marked_total ");
        if (p)
            v = strtoll(p + strlen("\noutboxd_rows_marked_total "), NULL, 10);
    }
    if (fd >= 0)
        close(fd);
    return v;
}

/* Waits until the relay has confirmed `target` rows in all, asking it and
 * not Postgres: a probe of the table, even a cheap EXISTS every 20 ms,
 * competes with the drain it measures (in delete mode each probe also
 * prunes the pages deleted since the one before). Falls back to the
 * probe if /metrics cannot be read. */
static void wait_marked(PGconn *c, const char *sql, long long target)
{
    long long v;
    while ((v = marked_total()) >= 0 && v < target)
        usleep(2000);
    if (v < 0)
        wait_drained(c, sql);
}

/* A warm relay (recovered, producer connected) is handed N rows committed
 * in one transaction with NOTIFY; the clock runs from that commit until the
 * last row is confirmed. */
static void drain(const struct opts *o, int on_sent, int rows, int payload, bool idle,
                  struct drain_result *res, long *allocs)
{
    PGconn *c = connect_db(o);
    const char *left_sql =
        on_sent == OBX_ON_SENT_DELETE
            ? "SELECT EXISTS (SELECT FROM outbox.events)::int"
            : "SELECT EXISTS (SELECT FROM outbox.events WHERE sent_at IS NULL)::int";
    const char *count_file = allocs ? "/tmp/obx-bench-allocs" : NULL;
    settle(c);
    pid_t pid = spawn_outboxd(o, on_sent, count_file);
    exec_ok(c, "SELECT outbox.enqueue('bench', 'warm-up', 'x'::bytea)");
    wait_drained(c, left_sql);
    sleep(1);
    struct proc_stats s0 = {0}, s1 = {0}, s2 = {0};
    int relay_backend = (int)query_int(c, "SELECT coalesce(max(pid), 0) FROM pg_stat_activity"
                                          " WHERE application_name = 'outboxd'");
    char lsn[64];
    exec_ok(c, "BEGIN");
    prefill(c, rows, payload);
    exec_ok(c, "NOTIFY outboxd");
    wal_lsn(c, lsn, sizeof(lsn)); /* after the rows' own WAL */
    proc_stats(pid, &s0);
    long a0 = count_file ? read_count(count_file) : 0;
    double b0 = backend_cpu_s(relay_backend);
    double t0 = now_s();
    exec_ok(c, "COMMIT");
    wait_marked(c, left_sql, rows + 1LL); /* and the warm-up row */
    double t1 = now_s();
    wait_drained(c, left_sql); /* what the relay says, Postgres confirms */
    proc_stats(pid, &s1);
    res->pg_cpu_ms_per_1k = (backend_cpu_s(relay_backend) - b0) * 1e6 / rows;
    res->wal_per_row = wal_since(c, lsn) / rows;
    if (allocs)
        *allocs = read_count(count_file) - a0;
    res->rows_per_s = rows / (t1 - t0);
    res->cpu_per_100k = (s1.cpu_s - s0.cpu_s) / rows * 100000.0;
    res->peak_kb = s1.peak_kb;
    if (idle) {
        sleep(10);
        proc_stats(pid, &s2);
        res->idle_cpu_s = s2.cpu_s - s1.cpu_s;
    }
    stop_outboxd(pid);
    exec_ok(c, "TRUNCATE outbox.events, outbox.kafka_offsets");
    PQfinish(c);
}

/* ---- 4. latency ---- */

#define MAX_IDS (1 << 22)
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
        drain(o, on_sent, o->rows, payload, idle && i == 0, &d, NULL);
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

static double *commit_at; /* by outbox id - id_base: when the writer sent the commit */
static long long id_base; /* ids keep growing over the runs (TRUNCATE keeps the identity) */
static atomic_int writers_done;

struct lat_writer {
    const struct opts *o;
    double rate; /* events/s for this thread */
    double seconds;
};

static void *lat_writer_main(void *arg)
{
    struct lat_writer *w = arg;
    PGconn *c = connect_db(w->o);
    double period = 1.0 / w->rate, start = now_s(), next = start;
    int k = 0;
    while (now_s() - start < w->seconds) {
        double wait = next - now_s();
        if (wait > 0)
            usleep((useconds_t)(wait * 1e6));
        char key[32];
        snprintf(key, sizeof(key), "key-%d", k++ % KEYS);
        const char *v[2] = {key, "{\"event\": \"latency probe\"}"};
        double t = now_s(); /* one statement = one transaction: commit at its end */
        PGresult *r = PQexecParams(c, "SELECT outbox.enqueue('lat', $1, $2::jsonb)", 2, NULL, v,
                                   NULL, NULL, 0);
        if (PQresultStatus(r) != PGRES_TUPLES_OK)
            die("enqueue", PQresultErrorMessage(r));
        long long id = strtoll(PQgetvalue(r, 0, 0), NULL, 10);
        PQclear(r);
        if (id > id_base && id - id_base < MAX_IDS)
            commit_at[id - id_base] = t;
        next += period;
    }
    PQfinish(c);
    atomic_fetch_add(&writers_done, 1);
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

struct lat_result {
    double achieved, p50, p99, p999, max;
    long n;
};

static void latency(const struct opts *o, int rate, struct lat_result *res)
{
    char err[512];
    int threads = rate >= 1000 ? 4 : 1;
    rd_kafka_conf_t *conf = rd_kafka_conf_new();
    rd_kafka_conf_set(conf, "bootstrap.servers", o->bootstrap, err, sizeof(err));
    rd_kafka_conf_set(conf, "group.id", "obx-bench", err, sizeof(err));
    rd_kafka_conf_set(conf, "fetch.wait.max.ms", "1", err, sizeof(err));
    rd_kafka_conf_set(conf, "fetch.error.backoff.ms", "5", err, sizeof(err));
    rd_kafka_t *rk = rd_kafka_new(RD_KAFKA_CONSUMER, conf, err, sizeof(err));
    if (!rk)
        die("consumer", err);
    rd_kafka_poll_set_consumer(rk);
    rd_kafka_topic_partition_list_t *parts = rd_kafka_topic_partition_list_new(PARTITIONS);
    for (int p = 0; p < PARTITIONS; p++)
        rd_kafka_topic_partition_list_add(parts, "lat", p)->offset = RD_KAFKA_OFFSET_END;
    rd_kafka_assign(rk, parts);
    rd_kafka_topic_partition_list_destroy(parts);
    for (int i = 0; i < 20; i++) { /* let the assignment settle */
        rd_kafka_message_t *m = rd_kafka_consumer_poll(rk, 50);
        if (m)
            rd_kafka_message_destroy(m);
    }

    size_t cap = (size_t)rate * (size_t)o->latency_seconds + 1024, n = 0;
    double *samples = malloc(cap * sizeof(double));
    struct lat_writer w = {o, (double)rate / threads, o->latency_seconds};
    pthread_t t[8];
    atomic_store(&writers_done, 0);
    double start = now_s();
    for (int i = 0; i < threads; i++)
        pthread_create(&t[i], NULL, lat_writer_main, &w);
    double quiet_since = 0;
    for (;;) {
        rd_kafka_message_t *m = rd_kafka_consumer_poll(rk, 10);
        double now = now_s();
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
                if (id > id_base && id - id_base < MAX_IDS && commit_at[id - id_base] > 0 &&
                    n < cap)
                    samples[n++] = now - commit_at[id - id_base];
            }
            rd_kafka_message_destroy(m);
            quiet_since = 0;
        } else if (atomic_load(&writers_done) == threads) {
            if (quiet_since == 0)
                quiet_since = now;
            else if (now - quiet_since > 2.0)
                break;
        }
    }
    double elapsed = o->latency_seconds;
    (void)start;
    for (int i = 0; i < threads; i++)
        pthread_join(t[i], NULL);
    rd_kafka_consumer_close(rk);
    rd_kafka_destroy(rk);
    qsort(samples, n, sizeof(double), cmp_double);
    res->n = (long)n;
    res->achieved = n / elapsed;
    res->p50 = n ? samples[n / 2] * 1e3 : 0;
    res->p99 = n ? samples[(size_t)(n * 0.99)] * 1e3 : 0;
    res->p999 = n ? samples[(size_t)(n * 0.999)] * 1e3 : 0;
    res->max = n ? samples[n - 1] * 1e3 : 0;
    free(samples);
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

/* One table row of a Postgres-side measurement and what it cost. */
static void cost_row(const char *num, const char *what, double rate, const struct pg_cost *c)
{
    printf("| %s | %s | %.0f rows/s; %.0f WAL bytes/row; %.1f ms backend CPU per 1k rows |\n", num,
           what, rate, c->wal_per_row, c->cpu_ms_per_1k);
}

int main(int argc, char **argv)
{
    struct opts o = {.rows = 200000, .latency_seconds = 5};
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
            o.conninfo = optarg;
            break;
        case 'b':
            o.bootstrap = optarg;
            break;
        case 'o':
            o.outboxd = optarg;
            break;
        case 'm':
            o.malloc_lib = optarg;
            break;
        case 'r':
            o.rows = atoi(optarg);
            break;
        case 'l':
            o.latency_seconds = atoi(optarg);
            break;
        default:
            die("usage", "see bench/run");
        }
    }
    if (!o.conninfo || !o.bootstrap || !o.outboxd)
        die("usage", "--conninfo, --bootstrap and --outboxd are required");
    commit_at = calloc(MAX_IDS, sizeof(double));

    char cpu[256], date[32];
    machine(cpu, sizeof(cpu));
    time_t t = time(NULL);
    strftime(date, sizeof(date), "%Y-%m-%d", gmtime(&t));
    PGconn *c = connect_db(&o);
    char pgver[64];
    snprintf(pgver, sizeof(pgver), "%lld", query_int(c, "SHOW server_version_num"));
    PQfinish(c);

    if (getenv("OBX_BENCH_DRAIN_ONLY")) { /* quick experiments: one drain vs its limit */
        /* OBX_BENCH_DRAIN_ONLY=delete: delete mode; anything else: mark mode. */
        int mode = strcmp(getenv("OBX_BENCH_DRAIN_ONLY"), "delete") == 0 ? OBX_ON_SENT_DELETE
                                                                         : OBX_ON_SENT_MARK;
        struct pg_cost job = job_limit(&o, mode, 200);
        struct drain_result d;
        drain(&o, mode, o.rows, 200, false, &d, NULL);
        printf("job's limit %.0f rows/s (%.1f ms backend CPU per 1k rows), drain %.0f rows/s = "
               "%.2f (%.1f ms backend CPU per 1k rows), %.2f s outboxd CPU per 100k\n",
               job.rows_per_s, job.cpu_ms_per_1k, d.rows_per_s, d.rows_per_s / job.rows_per_s,
               d.pg_cpu_ms_per_1k, d.cpu_per_100k);
        return 0;
    }
    fprintf(stderr, "obx-bench: 1+3/5 Postgres-side limit and outboxd drain, paired...\n");
    struct paired p_mark, p_delete;
    paired(&o, OBX_ON_SENT_MARK, 200, true, &p_mark);
    paired(&o, OBX_ON_SENT_DELETE, 200, false, &p_delete);
    struct drain_result d_mark = p_mark.first, d_4k, d_alloc;
    struct pg_cost job_4k = job_limit(&o, OBX_ON_SENT_MARK, 4096);
    drain(&o, OBX_ON_SENT_MARK, o.rows, 4096, false, &d_4k, NULL);
    double purge = purge_rate(&o, 1000);
    long allocs = -1;
    if (o.malloc_lib)
        drain(&o, OBX_ON_SENT_MARK, o.rows, 200, false, &d_alloc, &allocs);
    fprintf(stderr, "obx-bench: 4/5 latency...\n");
    pid_t relay = spawn_outboxd(&o, OBX_ON_SENT_MARK, NULL);
    sleep(2);
    struct lat_result lat[3];
    static const int rates[3] = {100, 1000, 5000};
    /* Warm the topic up: its first record waits for metadata. */
    c = connect_db(&o);
    exec_ok(c, "SELECT outbox.enqueue('lat', 'warm-up', 'x'::bytea)");
    PQfinish(c);
    sleep(2);
    c = connect_db(&o);
    id_base = query_int(c, "SELECT nextval(pg_get_serial_sequence('outbox.events', 'id'))");
    PQfinish(c);
    for (int i = 0; i < 3; i++)
        latency(&o, rates[i], &lat[i]);
    stop_outboxd(relay);
    /* Last, on a topic of its own: the volume it pushes through the mock
     * (about 1 GB) would slow whatever ran after it. */
    fprintf(stderr, "obx-bench: 2/5 Kafka-side limit...\n");
    double kafka = kafka_limit(&o, 200);
    double kafka_4k = kafka_limit(&o, 4096);

    printf("outboxd benchmark, %s: %s, %ld cores; PostgreSQL %s (fsync=off), librdkafka %s "
           "mock cluster (3 brokers, TCP_NODELAY), all on this machine; outboxd defaults "
           "(batch %d, linger.ms 1); %d rows, 200-byte payloads, 3 headers, %d keys, %d "
           "partitions.\n\n",
           date, cpu, sysconf(_SC_NPROCESSORS_ONLN), pgver, rd_kafka_version_str(), BATCH, o.rows,
           KEYS, PARTITIONS);
    printf("| # | measurement | result |\n| --- | --- | --- |\n");
    cost_row("0",
             "**the job's limit**, mark (minimal SELECT + UPDATE ... WHERE id = ANY, pipelined, "
             "1 connection; median of 3)",
             p_mark.job, &p_mark.job_cost);
    cost_row("0", "the job's limit, delete (minimal SELECT + DELETE ... WHERE id = ANY)",
             p_delete.job, &p_delete.job_cost);
    printf("| 0 | the job's limit, mark, 4 KiB payloads (TOAST) | %.0f rows/s |\n",
           job_4k.rows_per_s);
    cost_row("1", "outboxd's own fetch + mark statements in a plain loop, mark (median of 3)",
             p_mark.own, &p_mark.own_cost);
    cost_row("1", "outboxd's own statements, delete", p_delete.own, &p_delete.own_cost);
    printf("| 1 | retention purge of sent rows (mark mode), batches of 1000 | %.0f rows/s |\n",
           purge);
    printf("| 2 | Kafka-side limit (bare idempotent producer, same records) | %.0f records/s |\n",
           kafka);
    printf("| 2 | Kafka-side limit, 4 KiB payloads | %.0f records/s |\n", kafka_4k);
    printf("| 3 | outboxd drain, mark (median of %d) | %.0f rows/s = **%.2f x the job's limit** "
           "(pairs %.2f-%.2f); %.0f WAL bytes/row; its backend %.1f ms CPU per 1k rows |\n",
           PAIRS, p_mark.drain, p_mark.ratio, p_mark.ratio_min, p_mark.ratio_max,
           p_mark.first.wal_per_row, p_mark.first.pg_cpu_ms_per_1k);
    printf("| 3 | outboxd drain, delete (median of %d) | %.0f rows/s = **%.2f x the job's "
           "limit** (pairs %.2f-%.2f); %.0f WAL bytes/row; its backend %.1f ms CPU per 1k rows |\n",
           PAIRS, p_delete.drain, p_delete.ratio, p_delete.ratio_min, p_delete.ratio_max,
           p_delete.first.wal_per_row, p_delete.first.pg_cpu_ms_per_1k);
    double limit_4k = job_4k.rows_per_s < kafka_4k ? job_4k.rows_per_s : kafka_4k;
    printf("| 3 | outboxd drain, mark, 4 KiB payloads | %.0f rows/s = **%.2f x the job's limit**; "
           "%.2f x the lower of it and Kafka's |\n",
           d_4k.rows_per_s, d_4k.rows_per_s / job_4k.rows_per_s, d_4k.rows_per_s / limit_4k);
    for (int i = 0; i < 3; i++)
        printf("| 4 | latency at %d events/s (achieved %.0f/s, %ld samples): commit -> consumer "
               "| p50 %.2f ms, p99 %.2f ms, p99.9 %.2f ms, max %.2f ms |\n",
               rates[i], lat[i].achieved, lat[i].n, lat[i].p50, lat[i].p99, lat[i].p999,
               lat[i].max);
    printf("| 5 | peak RSS of outboxd (drain, mark) | %.1f MB |\n", d_mark.peak_kb / 1024.0);
    printf("| 5 | CPU per 100k rows (drain, mark) | %.2f s |\n", d_mark.cpu_per_100k);
    if (allocs >= 0)
        printf("| 5 | allocations per row during the drain (malloc+calloc+realloc, all "
               "threads, librdkafka's included) | %.2f |\n",
               (double)allocs / o.rows);
    printf("| 5 | CPU while idle for 10 s | %.2f s |\n", d_mark.idle_cpu_s);
    return 0;
}
