/*
 * maint: see include/outboxd/maint.h.
 */
#include "outboxd/maint.h"
#include "outboxd/pgconn.h"
#include "outboxd/alloc.h"
#include "outboxd/log.h"
#include "outboxd/metrics.h"
#include "outboxd/store.h"

#include <libpq-fe.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct obx_maint {
    uv_loop_t *loop;
    uint64_t rows_purged; /* by retention, since start */
    uv_work_t work;
    char *conninfo; /* secret: never logged */
    int64_t statement_timeout_ms;
    int64_t retention_ms; /* 0 = off (or delete mode) */
    int64_t retention_interval_ms;
    int retention_batch;
    int partition_rows;
    int64_t reclaim_ms; /* partitions log mode's cursor covers reclaimed past this age; 0 = never */
    bool log_mode;

    bool with_stats; /* count the backlog (for /metrics) */
    bool busy;
    bool closing;
    atomic_bool stop; /* read by the worker between statements */
    int64_t stats_due, purge_due, parts_due, reclaim_due;
    int64_t stats_spacing_ms;

    /* The job: inputs set on the loop thread, outputs by the worker. */
    bool job_stats, job_purge, job_parts, job_reclaim;
    int64_t parts_made, parts_reclaimed;
    PGconn *conn; /* used only by the worker (and freed after the last job) */
    uv_mutex_t cancel_lock;
    PGcancel *cancel; /* for conn; lets close() interrupt a long statement */
    int64_t cursor;   /* purge position; 0 = start a new round */
    bool round_done;
    int64_t purged, batches;
    int64_t backlog_out;
    double lag_out;
    /* Where the next backlog count starts (store.c, backlog_since): the
     * lowest unsent id the last one saw and its snapshot's xmin. */
    int64_t count_floor;
    char count_xmin[24];
    int64_t stats_ms; /* how long the count took */
    char error[256];
    char last_error[256]; /* last one logged, and when */
    int64_t last_error_at;

    /* relay.shards above 1: the count by slot too (a backlog and a lag for
     * each of `shards` slots; slots with no unsent row have 0 and 0). */
    int shards;
    int64_t *slot_rows_out, *slot_lag_ms_out; /* the worker's (one allocation, all four) */
    int64_t *slot_rows, *slot_lag_ms;         /* published; valid while slots_known */
    bool slots_ok_out;                        /* the worker read them */
    bool slots_known, slots_warned;

    int64_t backlog; /* published on the loop thread */
    double lag;
    int64_t round_purged;
    int64_t round_batches;
};

static void count_from_start(struct obx_maint *m);

int obx_maint_new(uv_loop_t *loop, const struct obx_config *cfg, bool with_stats,
                  struct obx_maint **out)
{
    struct obx_maint *m = obx_calloc(1, sizeof(*m));
    if (!m || !(m->conninfo = obx_strdup(cfg->pg_conninfo))) {
        obx_free(m);
        return -1;
    }
    m->loop = loop;
    m->statement_timeout_ms = cfg->pg_statement_timeout_ms;
    m->retention_ms = cfg->on_sent == OBX_ON_SENT_MARK ? cfg->retention_ms : 0;
    m->retention_interval_ms = cfg->retention_interval_ms;
    m->retention_batch = cfg->retention_batch;
    m->partition_rows = cfg->partition_rows;
    /* In every mode: after log mode, mark and delete mode leave the rows
     * its cursor covers (sent_at NULL) to this too. Without a cursor row
     * it is one look at an empty table. */
    m->reclaim_ms = cfg->retention_ms;
    m->log_mode = cfg->on_sent == OBX_ON_SENT_LOG;
    m->stats_spacing_ms = OBX_MAINT_STATS_MS;
    m->shards = cfg->shards;
    if (m->shards > 1) {
        size_t n = (size_t)m->shards;
        if (!(m->slot_rows_out = obx_calloc(4 * n, sizeof(int64_t)))) {
            obx_free(m->conninfo);
            obx_free(m);
            return -1;
        }
        m->slot_lag_ms_out = m->slot_rows_out + n;
        m->slot_rows = m->slot_rows_out + 2 * n;
        m->slot_lag_ms = m->slot_rows_out + 3 * n;
    }
    count_from_start(m);
    m->with_stats = with_stats;
    m->backlog = -1;
    m->lag = -1;
    m->work.data = m;
    atomic_init(&m->stop, false);
    if (uv_mutex_init(&m->cancel_lock) != 0) {
        obx_free(m->slot_rows_out);
        obx_free(m->conninfo);
        obx_free(m);
        return -1;
    }
    *out = m;
    return 0;
}

/* First line of the last libpq error (no conninfo values in it). */
static void set_error(struct obx_maint *m, const char *what)
{
    const char *msg = m->conn ? PQerrorMessage(m->conn) : "out of memory";
    size_t n = strcspn(msg, "\n");
    snprintf(m->error, sizeof(m->error), "%s: %.*s", what, (int)n, msg);
}

static void disconnect(struct obx_maint *m)
{
    uv_mutex_lock(&m->cancel_lock);
    PQfreeCancel(m->cancel);
    m->cancel = NULL;
    uv_mutex_unlock(&m->cancel_lock);
    PQfinish(m->conn);
    m->conn = NULL;
}

static bool connect_if_needed(struct obx_maint *m)
{
    char timeout[32];
    if (m->conn && PQstatus(m->conn) == CONNECTION_OK)
        return true;
    disconnect(m);
    /* A primary, as the relay's own session: retention deletes. */
    m->conn = obx_pg_connect(m->conninfo, "outboxd", 10);
    if (!m->conn || PQstatus(m->conn) != CONNECTION_OK) {
        set_error(m, "cannot connect");
        disconnect(m);
        return false;
    }
    uv_mutex_lock(&m->cancel_lock);
    m->cancel = PQgetCancel(m->conn); /* NULL on no memory: close just waits */
    uv_mutex_unlock(&m->cancel_lock);
    snprintf(timeout, sizeof(timeout), "%lld", (long long)m->statement_timeout_ms);
    const char *param[] = {timeout};
    /* "<application_name>-maintenance": the relay's own session keeps the
     * name the operator chose, and this one is told apart from it (say,
     * by whoever terminates backends by name). Its statements read by
     * index too: with stale statistics the backlog count scanned the whole
     * table, sent rows and all, every few seconds. */
    PGresult *res = PQexecParams(
        m->conn,
        "SELECT set_config('statement_timeout', $1, false),"
        " set_config('application_name',"
        "            left(current_setting('application_name'), 50) || '-maintenance', false)",
        1, NULL, param, NULL, NULL, 0);
    bool ok = PQresultStatus(res) == PGRES_TUPLES_OK;
    PQclear(res);
    if (ok) { /* and no sort where an index gives the order: see backlog_since */
        res = PQexec(m->conn, OBX_STORE_SQL_READ_BY_INDEX "; SET enable_sort = off");
        ok = PQresultStatus(res) == PGRES_COMMAND_OK;
        PQclear(res);
    }
    if (!ok)
        set_error(m, "cannot set up the session (statement_timeout, planner settings)");
    return ok;
}

/* The first count, and the one after a failure, reads from the start. */
static void count_from_start(struct obx_maint *m)
{
    m->count_floor = INT64_MIN;
    snprintf(m->count_xmin, sizeof(m->count_xmin), "0");
}

static bool read_by_slot(struct obx_maint *m, const char *text);

/* Log mode: the stored cursor bounds the count (outbox.unpublished). */
static void run_log_stats(struct obx_maint *m)
{
    char shards[16];
    snprintf(shards, sizeof(shards), "%d", m->shards);
    const char *params[1] = {shards};
    PGresult *res =
        PQexecParams(m->conn, obx_store_sql_backlog_log(), 1, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1) {
        set_error(m, "backlog query failed");
    } else {
        m->backlog_out = strtoll(obx_store_col(res, 0, "rows"), NULL, 10);
        m->lag_out = strtod(obx_store_col(res, 0, "oldest_seconds"), NULL);
        m->slots_ok_out = m->shards > 1 && read_by_slot(m, obx_store_col(res, 0, "by_slot"));
    }
    PQclear(res);
}

/* by_slot of the backlog count: "slot rows oldest-ms", comma-separated
 * (store.c). False if it does not parse or names a slot out of range. */
static bool read_by_slot(struct obx_maint *m, const char *text)
{
    memset(m->slot_rows_out, 0, (size_t)m->shards * sizeof(int64_t));
    memset(m->slot_lag_ms_out, 0, (size_t)m->shards * sizeof(int64_t));
    const char *p = text;
    while (*p) {
        char *end;
        long long slot = strtoll(p, &end, 10);
        if (end == p || *end != ' ' || slot < 0 || slot >= m->shards)
            return false;
        p = end + 1;
        long long rows = strtoll(p, &end, 10);
        if (end == p || *end != ' ')
            return false;
        p = end + 1;
        long long lag_ms = strtoll(p, &end, 10);
        if (end == p || (*end != ',' && *end != '\0'))
            return false;
        m->slot_rows_out[slot] = rows;
        m->slot_lag_ms_out[slot] = lag_ms;
        p = *end ? end + 1 : end;
    }
    return true;
}

static void run_stats(struct obx_maint *m)
{
    uint64_t t0 = uv_hrtime();
    if (m->log_mode) {
        run_log_stats(m);
        m->stats_ms = (int64_t)((uv_hrtime() - t0) / 1000000);
        return;
    }
    char floor[24], shards[16];
    snprintf(floor, sizeof(floor), "%lld", (long long)m->count_floor);
    snprintf(shards, sizeof(shards), "%d", m->shards);
    const char *params[OBX_BACKLOG_NPARAMS] = {[OBX_BACKLOG_FLOOR] = floor,
                                               [OBX_BACKLOG_XMIN] = m->count_xmin,
                                               [OBX_BACKLOG_SHARDS] = shards};
    PGresult *res = PQexecParams(m->conn, obx_store_sql_backlog_since(), OBX_BACKLOG_NPARAMS, NULL,
                                 params, NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1 ||
        strlen(obx_store_col(res, 0, "next_xmin")) >= sizeof(m->count_xmin)) {
        set_error(m, "backlog query failed");
        count_from_start(m);
    } else {
        m->backlog_out = strtoll(obx_store_col(res, 0, "rows"), NULL, 10);
        m->lag_out = strtod(obx_store_col(res, 0, "oldest_seconds"), NULL);
        m->count_floor = strtoll(obx_store_col(res, 0, "next_floor"), NULL, 10);
        snprintf(m->count_xmin, sizeof(m->count_xmin), "%s", obx_store_col(res, 0, "next_xmin"));
        /* Not m->error: the totals hold, and retention must go on. */
        m->slots_ok_out = m->shards > 1 && read_by_slot(m, obx_store_col(res, 0, "by_slot"));
    }
    PQclear(res);
    m->stats_ms = (int64_t)((uv_hrtime() - t0) / 1000000);
}

static void run_purge(struct obx_maint *m)
{
    char cursor[32], batch[16], period[32];
    snprintf(batch, sizeof(batch), "%d", m->retention_batch);
    snprintf(period, sizeof(period), "%lld", (long long)m->retention_ms);
    for (int i = 0; i < OBX_MAINT_BATCHES_PER_JOB && !atomic_load(&m->stop); i++) {
        snprintf(cursor, sizeof(cursor), "%lld", (long long)m->cursor);
        const char *params[OBX_PURGE_NPARAMS] = {
            [OBX_PURGE_AFTER] = cursor, [OBX_PURGE_BATCH] = batch, [OBX_PURGE_PERIOD_MS] = period};
        PGresult *res = PQexecParams(m->conn, obx_store_sql_purge(), OBX_PURGE_NPARAMS, NULL,
                                     params, NULL, NULL, 0);
        if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1) {
            set_error(m, "retention purge failed");
            PQclear(res);
            return;
        }
        m->batches++;
        m->purged += strtoll(obx_store_col(res, 0, "deleted"), NULL, 10);
        bool empty = obx_store_col_null(res, 0, "last_id");
        if (!empty)
            m->cursor = strtoll(obx_store_col(res, 0, "last_id"), NULL, 10);
        bool reached_recent = strtoll(obx_store_col(res, 0, "recent"), NULL, 10) > 0;
        PQclear(res);
        if (empty || reached_recent) {
            m->round_done = true;
            return;
        }
    }
}

/* Runs `sql` (one row, one number) into *out; on failure the job's error
 * says `what` failed. */
static void run_count(struct obx_maint *m, const char *sql, int nparams, const char *const *params,
                      const char *what, int64_t *out)
{
    PGresult *res = PQexecParams(m->conn, sql, nparams, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1)
        set_error(m, what);
    else
        *out = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
    PQclear(res);
}

/* Partitions ahead of the ids. An error is logged and tried again at the
 * next round: meanwhile rows land in the DEFAULT partition, never refused. */
static void run_partitions(struct obx_maint *m)
{
    char rows[24], ahead[8];
    snprintf(rows, sizeof(rows), "%d", m->partition_rows);
    snprintf(ahead, sizeof(ahead), "%d", OBX_STORE_PARTITIONS_AHEAD);
    const char *params[OBX_UPKEEP_NPARAMS] = {[OBX_UPKEEP_ROWS] = rows, [OBX_UPKEEP_AHEAD] = ahead};
    run_count(m, OBX_STORE_SQL_UPKEEP_PARTITIONS, OBX_UPKEEP_NPARAMS, params,
              "partition upkeep failed", &m->parts_made);
}

/* Whole partitions the stored cursor of log mode covers, past retention. */
static void run_reclaim(struct obx_maint *m)
{
    char keep[32];
    snprintf(keep, sizeof(keep), "%lld", (long long)m->reclaim_ms);
    const char *params[OBX_RECLAIM_NPARAMS] = {[OBX_RECLAIM_KEEP_MS] = keep};
    run_count(m, OBX_STORE_SQL_RECLAIM_PARTITIONS, OBX_RECLAIM_NPARAMS, params,
              "partition reclaim failed", &m->parts_reclaimed);
}

/* Worker thread: only the job's fields and m->conn are touched here. */
static void work_cb(uv_work_t *w)
{
    struct obx_maint *m = w->data;
    if (!connect_if_needed(m))
        return;
    if (m->job_stats)
        run_stats(m);
    if (m->job_purge && !m->error[0])
        run_purge(m);
    if (m->job_reclaim && !m->error[0])
        run_reclaim(m);
    if (m->job_parts && !m->error[0]) /* last: a lock it waits out delays nothing else */
        run_partitions(m);
    if (m->conn && PQstatus(m->conn) != CONNECTION_OK)
        disconnect(m);
}

static void free_maint(struct obx_maint *m)
{
    disconnect(m);
    uv_mutex_destroy(&m->cancel_lock);
    obx_free(m->slot_rows_out);
    obx_free(m->conninfo);
    obx_free(m);
}

static void after_work_cb(uv_work_t *w, int status)
{
    struct obx_maint *m = w->data;
    int64_t now = (int64_t)uv_now(m->loop);
    m->busy = false;
    if (m->closing) {
        free_maint(m);
        return;
    }
    if (status != 0 || m->error[0]) {
        const char *why = status != 0 ? uv_strerror(status) : m->error;
        /* During an outage this fails every few seconds, as the relay's own
         * connection does: say it once a minute, or when the reason changes. */
        if (strcmp(why, m->last_error) != 0 || now - m->last_error_at >= 60000) {
            obx_warn("maintenance: %s", why);
            snprintf(m->last_error, sizeof(m->last_error), "%s", why);
            m->last_error_at = now;
        }
        if (m->job_stats) { /* unknown rather than stale */
            m->backlog = -1;
            m->lag = -1;
            m->slots_known = false;
        }
        m->stats_due = now + m->stats_spacing_ms;
        if (m->job_purge)
            m->purge_due = now + m->retention_interval_ms;
        if (m->job_parts)
            m->parts_due = now + OBX_MAINT_PARTITIONS_MS;
        if (m->job_reclaim)
            m->reclaim_due = now + m->retention_interval_ms;
        return;
    }
    if (m->last_error[0]) {
        obx_info("maintenance: working again");
        m->last_error[0] = '\0';
    }
    if (m->job_parts) {
        if (m->parts_made > 0)
            obx_info("partitions: created %lld of outbox.events (%d ids each) ahead of its ids",
                     (long long)m->parts_made, m->partition_rows);
        m->parts_due = now + OBX_MAINT_PARTITIONS_MS;
    }
    if (m->job_reclaim) {
        if (m->parts_reclaimed > 0)
            obx_event(OBX_LOG_INFO, "partitions_reclaimed",
                      "retention: dropped or emptied %lld partitions of outbox.events, every row "
                      "in them published and written more than %llds ago",
                      (long long)m->parts_reclaimed, (long long)(m->reclaim_ms / 1000));
        m->reclaim_due = now + m->retention_interval_ms;
    }
    if (m->job_stats) {
        m->backlog = m->backlog_out;
        m->lag = m->lag_out;
        if (m->shards > 1 && m->slots_ok_out) {
            memcpy(m->slot_rows, m->slot_rows_out, (size_t)m->shards * sizeof(int64_t));
            memcpy(m->slot_lag_ms, m->slot_lag_ms_out, (size_t)m->shards * sizeof(int64_t));
            m->slots_known = true;
            m->slots_warned = false;
        } else if (m->shards > 1) {
            m->slots_known = false;
            if (!m->slots_warned)
                obx_warn("maintenance: the backlog by slot did not parse; "
                         "outboxd_slot_backlog_rows and outboxd_slot_lag_seconds are left out");
            m->slots_warned = true;
        }
        int64_t spacing = 20 * m->stats_ms;
        m->stats_spacing_ms = spacing > OBX_MAINT_STATS_MS ? spacing : OBX_MAINT_STATS_MS;
        m->stats_due = now + m->stats_spacing_ms;
    }
    if (m->job_purge) {
        m->rows_purged += (uint64_t)m->purged;
        m->round_purged += m->purged;
        m->round_batches += m->batches;
        if (m->round_done) {
            if (m->round_purged > 0)
                obx_info("retention: deleted %lld rows sent more than %llds ago (%lld batches)",
                         (long long)m->round_purged, (long long)(m->retention_ms / 1000),
                         (long long)m->round_batches);
            m->round_purged = 0;
            m->round_batches = 0;
            m->cursor = 0;
            m->purge_due = now + m->retention_interval_ms;
        }
        /* else: the round goes on with the next job, right away */
    }
}

void obx_maint_tick(struct obx_maint *m, int64_t now)
{
    if (m->busy || m->closing)
        return;
    m->job_stats = m->with_stats && now >= m->stats_due;
    m->job_purge = m->retention_ms > 0 && now >= m->purge_due;
    m->job_parts = now >= m->parts_due;
    m->job_reclaim = m->reclaim_ms > 0 && now >= m->reclaim_due;
    if (!m->job_stats && !m->job_purge && !m->job_parts && !m->job_reclaim)
        return;
    m->error[0] = '\0';
    m->purged = m->batches = m->parts_made = m->parts_reclaimed = 0;
    m->round_done = false;
    if (uv_queue_work(m->loop, &m->work, work_cb, after_work_cb) == 0)
        m->busy = true;
}

int64_t obx_maint_backlog(const struct obx_maint *m)
{
    return m->backlog;
}

double obx_maint_lag_seconds(const struct obx_maint *m)
{
    return m->lag;
}

void obx_maint_forget_stats(struct obx_maint *m)
{
    m->backlog = -1;
    m->lag = -1;
    m->slots_known = false;
    m->stats_due = 0; /* count at once if the job comes back */
}

int obx_maint_slot_backlog(const struct obx_maint *m, const int64_t **rows, const int64_t **lag_ms)
{
    if (!m->slots_known)
        return 0;
    *rows = m->slot_rows;
    *lag_ms = m->slot_lag_ms;
    return m->shards;
}

void obx_maint_close(struct obx_maint *m)
{
    if (!m || m->closing)
        return;
    m->closing = true;
    atomic_store(&m->stop, true);
    if (!m->busy) {
        free_maint(m);
        return;
    }
    /* Do not let shutdown wait for a long count or purge statement. */
    char why[256];
    uv_mutex_lock(&m->cancel_lock);
    if (m->cancel && !PQcancel(m->cancel, why, sizeof(why)))
        obx_debug("maintenance: cancel failed: %s", why);
    uv_mutex_unlock(&m->cancel_lock);
}

uint64_t obx_maint_rows_purged(const struct obx_maint *m)
{
    return m->rows_purged;
}
