/*
 * Shared scenario building blocks: see scenario.h.
 */
#include "scenario.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <setjmp.h>
#include <cmocka.h>

/* ---- deterministic rows: writer w, sequence s ---- */

void s_gen(int w, int s, struct s_row *g)
{
    memset(g, 0, sizeof(*g));
    snprintf(g->topic, sizeof(g->topic), "%s", S_TOPICS[(w + s) % 3]);
    g->key_null = s % 10 == 3;
    snprintf(g->key, sizeof(g->key), "key-%d", (w * 7 + s) % 40);
    g->payload_null = s % 13 == 5;
    g->payload_len = g->payload_null ? 0 : (size_t)(s % 50); /* includes empty */
    for (size_t i = 0; i < g->payload_len; i++)
        g->payload[i] = (unsigned char)((w * 31 + s * 17 + (int)i) & 0xff); /* NULs too */
    snprintf(g->traceparent, sizeof(g->traceparent), "00-%032x-%016x-01", w * 100000 + s,
             s * 7 + 1);
    snprintf(g->headers, sizeof(g->headers),
             "{\"w\": \"%d\", \"s\": \"%d\", \"traceparent\": \"%s\", \"n\": %d, \"ok\": true}", w,
             s, g->traceparent, s);
}

static bool exec_ok(PGconn *c, const char *sql)
{
    PGresult *r = PQexec(c, sql);
    bool ok = PQresultStatus(r) == PGRES_COMMAND_OK;
    PQclear(r);
    return ok;
}

/* Writes rows of (w, s) in transactions; survives lost connections when
 * running until `stop` (the restart scenarios). */
void *s_writer_main(void *arg)
{
    struct s_writer *wr = arg;
    PGconn *c = NULL;
    int s = 0;
    while ((wr->count == 0 || s < wr->count) && !(wr->stop && atomic_load(wr->stop))) {
        if (!c || PQstatus(c) != CONNECTION_OK) {
            PQfinish(c);
            c = PQconnectdb(wr->env->conninfo);
            if (PQstatus(c) != CONNECTION_OK) {
                wr->failures++;
                h_sleep_ms(50);
                continue;
            }
        }
        bool ok = exec_ok(c, "BEGIN");
        int n = 0;
        for (; ok && n < wr->rows_per_tx && (wr->count == 0 || s + n < wr->count); n++) {
            struct s_row g;
            s_gen(wr->w, s + n, &g);
            if (wr->hot_keys > 0) {
                snprintf(g.topic, sizeof(g.topic), "it.race");
                snprintf(g.key, sizeof(g.key), "hot-%d", (s + n) % wr->hot_keys);
                g.key_null = false;
            }
            const char *values[4] = {g.topic, g.key_null ? NULL : g.key,
                                     g.payload_null ? NULL : (const char *)g.payload, g.headers};
            int lengths[4] = {0, 0, (int)g.payload_len, 0};
            int formats[4] = {0, 0, 1, 0};
            PGresult *r = PQexecParams(c, "SELECT outbox.enqueue($1, $2, $3::bytea, $4::jsonb)", 4,
                                       NULL, values, lengths, formats, 0);
            ok = PQresultStatus(r) == PGRES_TUPLES_OK;
            if (!ok)
                snprintf(wr->error, sizeof(wr->error), "%s", PQresultErrorMessage(r));
            PQclear(r);
        }
        if (ok && exec_ok(c, "COMMIT")) {
            s += n;
            wr->written += n;
            if (wr->pace_ms > 0)
                h_sleep_ms(wr->pace_ms);
        } else {
            wr->failures++;
            if (!wr->stop)
                break; /* a plain run must not fail */
            h_sleep_ms(20);
        }
    }
    PQfinish(c);
    return NULL;
}

void s_run_writers(struct s_writer *ws, int n)
{
    pthread_t t[32];
    for (int i = 0; i < n; i++)
        assert_int_equal(pthread_create(&t[i], NULL, s_writer_main, &ws[i]), 0);
    for (int i = 0; i < n; i++)
        pthread_join(t[i], NULL);
}

void s_wait_drained(struct h_env *e, int timeout_ms)
{
    if (!h_wait_drained(e, timeout_ms))
        fail_msg("rows still unsent after %d ms (see relay.log in %s)", timeout_ms, e->dir);
}

/* Counts rows in outbox.events that are published (any mode). */
int64_t s_sent_count(struct h_env *e)
{
    PGconn *c = h_connect(e);
    int64_t n = h_sql_int(c, "SELECT (SELECT count(*) FROM outbox.events)"
                             " - (SELECT count(*) FROM outbox.unpublished)");
    PQfinish(c);
    return n;
}

void s_prefill(struct h_env *e, const char *topic, int rows)
{
    PGconn *c = h_connect(e);
    h_sql(c,
          "INSERT INTO outbox.events (topic, key, payload, headers)"
          " SELECT '%s', 'k' || (g %% 50), convert_to('row ' || g, 'UTF8'),"
          " jsonb_build_object('g', g::text) FROM generate_series(1, %d) g",
          topic, rows);
    PQfinish(c);
}

void s_kill_loop_settings(int default_kills, int *kills, unsigned *seed)
{
    const char *k = getenv("OBX_KILLS"), *sv = getenv("OBX_SEED");
    *kills = k ? atoi(k) : default_kills;
    *seed = sv ? (unsigned)atoi(sv) : (unsigned)time(NULL);
    srand(*seed);
}

void s_wait_sent(struct h_env *e, int64_t n, int timeout_ms)
{
    int64_t deadline = h_now_ms() + timeout_ms;
    while (s_sent_count(e) < n) {
        if (h_now_ms() > deadline)
            fail_msg("fewer than %lld rows sent after %d ms", (long long)n, timeout_ms);
        h_sleep_ms(50);
    }
}
