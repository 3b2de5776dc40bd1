/*
 * OBX_BENCH_HELD=N,N,...: what rows held back behind refused ones
 * (relay.on_reject = retry) cost a fetch, for each number N of keys held
 * (issue 37, item 8). Log mode holds a refused topic key by key, so a
 * topic refused for minutes can hold thousands.
 *
 * The outbox gets --rows rows over HELD_KEYS keys of one topic; the first
 * N keys are held from their first row, as the relay holds a key behind
 * its refused row. Postgres: outboxd's own full and keyset fetches (taken
 * from its code, prepared, with the relay session's planner settings),
 * LIMIT 1000, each run HELD_RUNS times: the median time, and the backend's
 * CPU per statement. The keyset fetch runs twice: from the first row, and
 * from the middle of the outbox, where 4 rows in 10 are of held keys and
 * are passed over. Log mode's full fetch, from a stored cursor in the
 * middle of the outbox whose rules hold the same keys (its rows of held
 * keys below the cursor are read and tested). The relay: relay_held with
 * the same N entries, and the
 * lookups a fetch's 1,000 rows and the walk of the entries before a full
 * fetch make (held_holds, held_find, held_behind_another).
 */
#include "bench.h"

#include "outboxd/buf.h"
#include "outboxd/store.h"
#include "relay_held.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define HELD_KEYS 50000
#define HELD_RUNS 5

static int by_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(*v), by_double);
    return v[n / 2];
}

/* A one-value query's text, copied into buf ("" for NULL). */
static void query_text(PGconn *c, const char *sql, char **buf)
{
    PGresult *r = PQexec(c, sql);
    if (PQresultStatus(r) != PGRES_TUPLES_OK || PQntuples(r) != 1)
        die(sql, PQresultErrorMessage(r));
    free(*buf);
    *buf = strdup(PQgetisnull(r, 0, 0) ? "" : PQgetvalue(r, 0, 0));
    PQclear(r);
    if (!*buf)
        die("held", "out of memory");
}

struct fetch_cost {
    double ms, cpu_ms;
};

/* One fetch statement HELD_RUNS times: median time and backend CPU. */
static struct fetch_cost time_fetch(PGconn *c, const char *stmt, int nparams,
                                    const char *const *values)
{
    double t[HELD_RUNS], cpu[HELD_RUNS];
    for (int i = 0; i < HELD_RUNS; i++) {
        double cpu0 = backend_cpu_s(PQbackendPID(c)), t0 = now_s();
        PGresult *r = PQexecPrepared(c, stmt, nparams, values, NULL, NULL, 1);
        if (PQresultStatus(r) != PGRES_TUPLES_OK)
            die(stmt, PQresultErrorMessage(r));
        PQclear(r);
        t[i] = (now_s() - t0) * 1e3;
        cpu[i] = (backend_cpu_s(PQbackendPID(c)) - cpu0) * 1e3;
    }
    return (struct fetch_cost){median(t, HELD_RUNS), median(cpu, HELD_RUNS)};
}

/* The relay's side: N entries, then a fetch's lookups, HELD_RUNS times;
 * the median in microseconds. */
static double relay_side(long n, int64_t first_id, long rows)
{
    struct held h = {.retry_backoff_ms = 100};
    struct held_fx fx;
    char key[32];
    for (long k = 1; k <= n; k++) {
        fx = (struct held_fx){0};
        int len = snprintf(key, sizeof(key), "hk-%ld", k);
        held_hold_back(&h, first_id + k - 1, 0, key, (size_t)len, 0, &fx);
    }
    double t[HELD_RUNS];
    volatile long held_rows = 0;
    for (int i = 0; i < HELD_RUNS; i++) {
        double t0 = now_s();
        for (size_t e = 0; e < h.n; e++) /* before a full fetch (relay.c) */
            h.entry[e].behind_at_fetch = held_behind_another(&h, &h.entry[e]);
        for (long g = rows / 2; g < rows / 2 + BATCH; g++) { /* its answer's rows */
            int len = snprintf(key, sizeof(key), "hk-%ld", g % HELD_KEYS);
            held_rows += held_find(&h, first_id + g - 1) != NULL;
            held_rows += held_holds(&h, first_id + g - 1, 0, key, (size_t)len);
        }
        t[i] = (now_s() - t0) * 1e6;
    }
    (void)held_rows; /* kept so that the lookups are not optimized away */
    held_free(&h);
    return median(t, HELD_RUNS);
}

void held_bench(const struct opts *o, const char *list)
{
    PGconn *c = connect_db(o);
    settle(c);
    char sql[1024];
    snprintf(sql, sizeof(sql),
             "INSERT INTO outbox.events (topic, key, payload)"
             " SELECT 'bench', 'hk-' || (g %% %d), convert_to(rpad(g::text, 100, 'x'), 'UTF8')"
             " FROM generate_series(1, %d) g",
             HELD_KEYS, o->rows);
    exec_ok(c, sql);
    exec_ok(c, "VACUUM ANALYZE outbox.events");
    int64_t first = query_int(c, "SELECT min(id) FROM outbox.events");
    exec_ok(c, OBX_STORE_SQL_PLANNER_SETTINGS);
    struct obx_buf full = {0};
    const char *full_sql = obx_store_sql_fetch(&full, "{}");
    if (!full_sql)
        die("held", "out of memory");
    PGresult *r = PQprepare(c, "full", full_sql, 0, NULL);
    if (PQresultStatus(r) != PGRES_COMMAND_OK)
        die("prepare", PQresultErrorMessage(r));
    PQclear(r);
    r = PQprepare(c, "keyset", obx_store_sql_fetch_keyset(), 0, NULL);
    if (PQresultStatus(r) != PGRES_COMMAND_OK)
        die("prepare", PQresultErrorMessage(r));
    PQclear(r);
    struct obx_buf log = {0};
    const char *log_sql = obx_store_sql_fetch_log(&log, "{}");
    if (!log_sql)
        die("held", "out of memory");
    r = PQprepare(c, "log", log_sql, 0, NULL);
    if (PQresultStatus(r) != PGRES_COMMAND_OK)
        die("prepare", PQresultErrorMessage(r));
    PQclear(r);
    char *snap = NULL, *topics = NULL, *keys = NULL, *ids = NULL;
    query_text(c, "SELECT pg_current_snapshot()::text", &snap);

    printf("Rows held back (issue 37, item 8): %d rows over %d keys of one topic, the first N "
           "keys held from their first row; outboxd's fetches of %d rows, median of %d runs "
           "(ms, and the Postgres backend's CPU ms); the relay's lookups for one fetch (us).\n\n",
           o->rows, HELD_KEYS, BATCH, HELD_RUNS);
    printf("| keys held | full fetch | keyset, first rows | keyset, past held rows | log mode's "
           "full fetch | relay |\n");
    printf("|---:|---:|---:|---:|---:|---:|\n");
    for (const char *p = list; *p;) {
        char *end;
        long n = strtol(p, &end, 10);
        if (end == p || n < 0 || n > HELD_KEYS || (*end && *end != ','))
            die("OBX_BENCH_HELD", "want numbers of keys (0 to 50000) separated by commas");
        p = *end ? end + 1 : end;
        snprintf(sql, sizeof(sql),
                 "SELECT array_agg(k ORDER BY k)::text FROM (SELECT 'hk-' || n AS k"
                 " FROM generate_series(1, %ld) n) x",
                 n);
        query_text(c, sql, &keys);
        snprintf(sql, sizeof(sql),
                 "SELECT array_agg(id ORDER BY k)::text FROM (SELECT 'hk-' || n AS k,"
                 " %lld + n - 1 AS id FROM generate_series(1, %ld) n) x",
                 (long long)first, n);
        query_text(c, sql, &ids);
        snprintf(sql, sizeof(sql), "SELECT array_fill('bench'::text, ARRAY[%ld])::text", n);
        query_text(c, sql, &topics);
        char limit[16], after0[24], after_mid[24];
        snprintf(limit, sizeof(limit), "%d", BATCH);
        snprintf(after0, sizeof(after0), "%lld", (long long)first - 1);
        snprintf(after_mid, sizeof(after_mid), "%lld", (long long)(first + o->rows / 2));
        const char *fv[OBX_FETCH_LOG_NPARAMS] = {
            [OBX_FETCH_AFTER] = after0,
            [OBX_FETCH_LIMIT] = limit,
            [OBX_FETCH_HELD_TOPICS] = n ? topics : "{}",
            [OBX_FETCH_HELD_KEYS] = n ? keys : "{}",
            [OBX_FETCH_HELD_IDS] = n ? ids : "{}",
            [OBX_FETCH_MAX_BYTES] = "8388",
            [OBX_FETCH_SNAPSHOT] = snap,
            [OBX_FETCH_LOG_HELD + OBX_HELD_TOPICS] = n ? topics : "{}",
            [OBX_FETCH_LOG_HELD + OBX_HELD_KEYS] = n ? keys : "{}",
            [OBX_FETCH_LOG_HELD + OBX_HELD_FROM] = n ? ids : "{}",
            [OBX_FETCH_LOG_HELD + OBX_HELD_ALSO_SENT] = "{}"};
        struct fetch_cost f =
            time_fetch(c, "full", OBX_FETCH_FULL_NPARAMS, fv + OBX_FETCH_FULL_FIRST);
        struct fetch_cost k0 = time_fetch(c, "keyset", OBX_FETCH_NPARAMS, fv);
        fv[OBX_FETCH_AFTER] = after_mid;
        struct fetch_cost km = time_fetch(c, "keyset", OBX_FETCH_NPARAMS, fv);
        struct fetch_cost lg = time_fetch(c, "log", OBX_FETCH_LOG_NPARAMS, fv);
        double us = relay_side(n, first, o->rows);
        printf(
            "| %ld | %.1f ms (CPU %.0f) | %.1f ms (CPU %.0f) | %.1f ms (CPU %.0f) | %.1f ms (CPU "
            "%.0f) | %.0f us |\n",
            n, f.ms, f.cpu_ms, k0.ms, k0.cpu_ms, km.ms, km.cpu_ms, lg.ms, lg.cpu_ms, us);
        fflush(stdout);
    }
    free(snap);
    free(topics);
    free(keys);
    free(ids);
    obx_buf_free(&full);
    obx_buf_free(&log);
    exec_ok(c, "TRUNCATE outbox.events");
    PQfinish(c);
}
