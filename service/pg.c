/*
 * pg: see include/outboxd/pg.h.
 */
#include "outboxd/pg.h"
#include "outboxd/failpoint.h"
#include "outboxd/log.h"
#include "outboxd/metrics.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

/* libpq ignores connect_timeout under PQconnectPoll: we time connect+setup. */
#define CONNECT_TIMEOUT_MS 10000

/* The fetch: committed unsent rows in id order, skipping rows in flight.
 * Postgres splits the headers object into two text[] (keys, values; string
 * values verbatim, other JSON values as JSON text), so C never parses JSON.
 * Rows of transactions that commit late (lower ids) are found by the next
 * fetch: nothing is skipped because a higher id was seen first. */
static const char SQL_FETCH[] =
    "SELECT e.id, e.topic, e.key, e.payload, h.keys, h.vals, e.created_at"
    " FROM outbox.events e"
    " LEFT JOIN LATERAL ("
    "   SELECT array_agg(j.k ORDER BY j.k COLLATE \"C\") AS keys,"
    "          array_agg(CASE jsonb_typeof(j.v) WHEN 'string' THEN j.v #>> '{}'"
    "                    ELSE j.v::text END ORDER BY j.k COLLATE \"C\") AS vals"
    "   FROM jsonb_each(CASE jsonb_typeof(e.headers) WHEN 'object' THEN e.headers END)"
    "        AS j(k, v)) h ON true"
    " WHERE e.sent_at IS NULL AND NOT (e.id = ANY ($1::bigint[]))"
    /* Rows of a key held back behind a refused row (relay.on_reject = retry). */
    "   AND (cardinality($3::text[]) = 0 OR e.key IS NULL OR NOT EXISTS ("
    "        SELECT FROM unnest($3::text[], $4::text[], $5::bigint[]) AS b(topic, key, id)"
    "        WHERE b.topic = e.topic AND b.key = e.key AND e.id > b.id))"
    " ORDER BY e.id"
    " LIMIT $2::int";

/* The mark: acknowledged rows confirmed, each partition's last acknowledged
 * offset stored for crash recovery, refused rows moved to dead_letters; one
 * statement, run inside BEGIN ... COMMIT. %s = how rows are confirmed. */
static const char SQL_MARK_FMT[] =
    "WITH confirmed AS (%s),"
    " offsets AS ("
    "   INSERT INTO outbox.kafka_offsets AS k (topic, kafka_partition, last_offset)"
    "   SELECT * FROM unnest($2::text[], $3::int[], $4::bigint[])"
    "   ON CONFLICT (topic, kafka_partition) DO UPDATE"
    "     SET last_offset = greatest(k.last_offset, excluded.last_offset), updated_at = now()"
    "   RETURNING 1),"
    " dead AS ("
    "   DELETE FROM outbox.events e USING unnest($5::bigint[], $6::text[]) AS d(id, reason)"
    "   WHERE e.id = d.id AND e.sent_at IS NULL"
    "   RETURNING e.id, e.topic, e.key, e.payload, e.headers, e.created_at, d.reason),"
    " buried AS ("
    "   INSERT INTO outbox.dead_letters (id, topic, key, payload, headers, created_at, reason)"
    "   SELECT * FROM dead ON CONFLICT (id) DO NOTHING RETURNING 1)"
    " SELECT (SELECT count(*) FROM confirmed), (SELECT count(*) FROM offsets),"
    "        (SELECT count(*) FROM buried)";

static const char SQL_CONFIRM_MARK[] = "UPDATE outbox.events SET sent_at = now()"
                                       " WHERE id = ANY ($1::bigint[]) AND sent_at IS NULL"
                                       " RETURNING id";
static const char SQL_CONFIRM_DELETE[] = "DELETE FROM outbox.events"
                                         " WHERE id = ANY ($1::bigint[]) RETURNING id";

/* Migration file for each schema version, for the "apply this" message. */
static const char *const migrations[] = {
    [1] = "sql/001_outbox.sql",
    [2] = "sql/002_recovery.sql",
};

/* A uv_poll_t on the libpq socket. Heap-allocated because PQconnectPoll may
 * switch sockets and a closing handle must outlive its replacement. */
struct pg_watch {
    uv_poll_t handle;
    int fd;
    int events;
};

struct obx_pg {
    uv_loop_t *loop;
    struct obx_pg_callbacks cb;
    void *arg;
    char *conninfo; /* owned; secret */
    int64_t statement_timeout_ms;
    int64_t backoff_min_ms, backoff_max_ms;

    enum obx_pg_state state;
    PGconn *conn;
    struct pg_watch *watch;
    uv_timer_t timer; /* reconnect back-off, or connect+setup timeout */
    int attempts;     /* failed attempts since the last READY */
    bool started;     /* a first connection was attempted */
    int setup_step;   /* SETUP: 0 schema check etc., 1 try the relay lock, 2 wait for it */
    long schema_version;
    bool standby;     /* waiting for the relay lock another outboxd holds */
    PGresult *result; /* first result of the statement in flight */
    char target[256]; /* "host:port/db as user", for logs; no password */

    /* A statement wrapped in BEGIN ... COMMIT runs in steps. */
    enum { TX_NONE, TX_BEGIN, TX_BODY, TX_COMMIT, TX_ROLLBACK } tx;
    const char *tx_sql;
    int tx_nparams;
    const char *const *tx_values;
    int tx_failpoint;    /* reached between the body and COMMIT; -1 = none */
    PGresult *tx_result; /* the body's result, reported after COMMIT */
    char tx_error[512];  /* why the transaction failed (reported after ROLLBACK) */

    struct obx_pg_array params[6]; /* reused parameter buffers */
    const char *param_values[6];   /* must outlive a wrapped transaction's BEGIN */
    char limit_text[16];
    char mark_sql[2048];
};

static const char *const state_names[] = {"disconnected", "connecting", "setup",
                                          "ready",        "busy",       "closed"};

static void set_state(struct obx_pg *pg, enum obx_pg_state to, const char *why)
{
    if (pg->state == to)
        return;
    obx_debug("postgres: %s -> %s (%s)", state_names[pg->state], state_names[to], why);
    pg->state = to;
}

bool obx_pg_standby(const struct obx_pg *pg)
{
    return pg->standby && pg->state == OBX_PG_SETUP;
}

enum obx_pg_state obx_pg_state(const struct obx_pg *pg)
{
    return pg->state;
}

static void on_watch_closed(uv_handle_t *h)
{
    free((struct pg_watch *)h); /* handle is the first member */
}

static void unwatch(struct obx_pg *pg)
{
    if (!pg->watch)
        return;
    uv_close((uv_handle_t *)&pg->watch->handle, on_watch_closed);
    pg->watch = NULL;
}

static void on_poll(uv_poll_t *h, int status, int events);

/* Watches the libpq socket for `events`, re-creating the watcher if libpq
 * switched sockets. Returns 0 or -1. */
static int watch(struct obx_pg *pg, int events)
{
    int fd = PQsocket(pg->conn);
    if (fd < 0)
        return -1;
    if (pg->watch && pg->watch->fd != fd)
        unwatch(pg);
    if (!pg->watch) {
        struct pg_watch *w = malloc(sizeof(*w));
        if (!w)
            return -1;
        if (uv_poll_init(pg->loop, &w->handle, fd) != 0) {
            free(w);
            return -1;
        }
        w->handle.data = pg;
        w->fd = fd;
        w->events = 0;
        pg->watch = w;
    }
    if (pg->watch->events != events) {
        if (uv_poll_start(&pg->watch->handle, events, on_poll) != 0)
            return -1;
        pg->watch->events = events;
    }
    return 0;
}

static void on_timer(uv_timer_t *t);

static void schedule_reconnect(struct obx_pg *pg)
{
    int64_t delay = pg->backoff_min_ms;
    for (int i = 1; i < pg->attempts && delay < pg->backoff_max_ms; i++)
        delay *= 2;
    if (delay > pg->backoff_max_ms)
        delay = pg->backoff_max_ms;
    /* Jitter in [delay/2, delay]: many relays restarting together spread out. */
    delay = delay / 2 + (int64_t)((uint64_t)rand() % (uint64_t)(delay / 2 + 1));
    uv_timer_start(&pg->timer, on_timer, (uint64_t)delay, 0);
    obx_info("postgres: reconnecting in %lldms (attempt %d)", (long long)delay, pg->attempts + 1);
}

/* Drops the connection with a reason, and schedules a reconnect. */
static void disconnect(struct obx_pg *pg, const char *reason)
{
    bool was_usable = pg->state == OBX_PG_READY || pg->state == OBX_PG_BUSY;
    if (pg->state == OBX_PG_CLOSED || pg->state == OBX_PG_DISCONNECTED)
        return;
    if (was_usable)
        obx_warn("postgres: connection to %s lost: %s", pg->target, reason);
    else
        obx_warn("postgres: cannot connect%s%s: %s", pg->target[0] ? " to " : "", pg->target,
                 reason);
    unwatch(pg);
    PQclear(pg->result);
    pg->result = NULL;
    PQclear(pg->tx_result);
    pg->tx_result = NULL;
    pg->tx = TX_NONE;
    PQfinish(pg->conn);
    pg->conn = NULL;
    pg->attempts++;
    set_state(pg, OBX_PG_DISCONNECTED, reason);
    uv_timer_stop(&pg->timer);
    schedule_reconnect(pg);
    if (was_usable)
        pg->cb.lost(pg->arg);
}

static void disconnect_with_error(struct obx_pg *pg, const char *prefix)
{
    char reason[512];
    const char *msg = pg->conn ? PQerrorMessage(pg->conn) : "";
    snprintf(reason, sizeof(reason), "%s%s%s", prefix, *msg ? ": " : "", msg);
    size_t len = strlen(reason);
    while (len > 0 && (reason[len - 1] == '\n' || reason[len - 1] == ' '))
        reason[--len] = '\0';
    disconnect(pg, reason);
}

static void describe_target(struct obx_pg *pg)
{
    const char *host = PQhost(pg->conn);
    snprintf(pg->target, sizeof(pg->target), "%s:%s/%s as %s", host ? host : "?",
             PQport(pg->conn) ? PQport(pg->conn) : "?", PQdb(pg->conn) ? PQdb(pg->conn) : "?",
             PQuser(pg->conn) ? PQuser(pg->conn) : "?");
}

static void start_connect(struct obx_pg *pg)
{
    /* Our defaults come before dbname, so that the user's conninfo (expanded
     * in place of dbname) overrides them. */
    const char *const keys[] = {"application_name", "keepalives_idle", "keepalives_interval",
                                "keepalives_count", "dbname",          NULL};
    const char *const values[] = {"outboxd", "30", "10", "3", pg->conninfo, NULL};

    pg->target[0] = '\0';
    if (pg->started)
        obx_stats.pg_reconnects++;
    pg->started = true;
    pg->conn = PQconnectStartParams(keys, values, 1);
    if (!pg->conn) {
        obx_error("postgres: out of memory starting a connection");
        pg->attempts++;
        schedule_reconnect(pg);
        return;
    }
    set_state(pg, OBX_PG_CONNECTING, "connect");
    if (PQstatus(pg->conn) == CONNECTION_BAD) {
        disconnect_with_error(pg, "connection failed");
        return;
    }
    uv_timer_start(&pg->timer, on_timer, CONNECT_TIMEOUT_MS, 0);
    /* libpq: after PQconnectStart, act as if PQconnectPoll said WRITING. */
    if (watch(pg, UV_WRITABLE) != 0)
        disconnect(pg, "cannot watch the connection socket");
}

/* Sends the next setup statement; the connection stays in SETUP. */
static void send_setup_step(struct obx_pg *pg, const char *sql)
{
    if (!PQsendQuery(pg->conn, sql)) {
        disconnect_with_error(pg, "setup failed");
        return;
    }
    if (watch(pg, UV_READABLE | (PQflush(pg->conn) == 1 ? UV_WRITABLE : 0)) != 0)
        disconnect(pg, "cannot watch the connection socket");
}

static void send_setup(struct obx_pg *pg)
{
    char sql[512];
    /* Server-side keepalives too: if this client vanishes without closing
     * (a network partition), its backend, and the relay lock it holds, go
     * away within about a minute instead of the OS's two hours, so no relay
     * stands by behind a dead session for long. */
    snprintf(sql, sizeof(sql),
             "SELECT coalesce(max(version), 0) FROM outbox.schema_migrations;"
             " LISTEN " OBX_NOTIFY_CHANNEL "; SET statement_timeout = %lld;"
             " SET tcp_keepalives_idle = 30; SET tcp_keepalives_interval = 10;"
             " SET tcp_keepalives_count = 3",
             (long long)pg->statement_timeout_ms);
    describe_target(pg);
    pg->setup_step = 0;
    pg->standby = false;
    if (PQsetnonblocking(pg->conn, 1) != 0 || !PQsendQuery(pg->conn, sql)) {
        disconnect_with_error(pg, "setup failed");
        return;
    }
    set_state(pg, OBX_PG_SETUP, "connected");
    if (watch(pg, UV_READABLE | (PQflush(pg->conn) == 1 ? UV_WRITABLE : 0)) != 0)
        disconnect(pg, "cannot watch the connection socket");
}

static void continue_connect(struct obx_pg *pg)
{
    switch (PQconnectPoll(pg->conn)) {
    case PGRES_POLLING_READING:
        if (watch(pg, UV_READABLE) != 0)
            disconnect(pg, "cannot watch the connection socket");
        break;
    case PGRES_POLLING_WRITING:
        if (watch(pg, UV_WRITABLE) != 0)
            disconnect(pg, "cannot watch the connection socket");
        break;
    case PGRES_POLLING_OK:
        send_setup(pg);
        break;
    default:
        disconnect_with_error(pg, "connection failed");
        break;
    }
}

/* Handles the complete setup result (first error, or the schema version). */
static void finish_setup(struct obx_pg *pg, PGresult *res)
{
    char reason[512];
    const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);

    if (PQresultStatus(res) != PGRES_TUPLES_OK && PQresultStatus(res) != PGRES_COMMAND_OK) {
        if (state && (strcmp(state, "42P01") == 0 || strcmp(state, "3F000") == 0)) {
            snprintf(reason, sizeof(reason),
                     "outbox schema not found in this database: apply %s "
                     "(psql -v ON_ERROR_STOP=1 -f %s)",
                     migrations[1], migrations[1]);
        } else {
            snprintf(reason, sizeof(reason), "setup failed: %s", PQresultErrorMessage(res));
        }
        disconnect(pg, reason);
        return;
    }
    if (pg->setup_step == 0) {
        long version = 0;
        if (PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1)
            version = strtol(PQgetvalue(res, 0, 0), NULL, 10);
        if (version < OBX_SCHEMA_VERSION) {
            snprintf(reason, sizeof(reason),
                     "outbox schema is at version %ld, this outboxd needs %d: apply %s and later "
                     "files in sql/",
                     version, OBX_SCHEMA_VERSION, migrations[version + 1]);
            disconnect(pg, reason);
            return;
        }
        pg->schema_version = version;
        pg->setup_step = 1;
        send_setup_step(pg, "SELECT pg_try_advisory_lock(" OBX_RELAY_LOCK ")");
        return;
    }
    if (pg->setup_step == 1 && !(PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1 &&
                                 strcmp(PQgetvalue(res, 0, 0), "t") == 0)) {
        /* Another relay is active on this outbox. Wait in Postgres for its
         * session to end (no statement_timeout on that wait): the takeover
         * is immediate and nothing polls. */
        char sql[256];
        snprintf(sql, sizeof(sql),
                 "SET statement_timeout = 0; SELECT pg_advisory_lock(" OBX_RELAY_LOCK
                 "); SET statement_timeout = %lld",
                 (long long)pg->statement_timeout_ms);
        obx_warn("postgres: another outboxd is relaying this outbox (it holds the relay lock "
                 "in %s); standing by until its session ends",
                 pg->target);
        uv_timer_stop(&pg->timer); /* the wait may be long: not a connect timeout */
        pg->setup_step = 2;
        pg->standby = true;
        send_setup_step(pg, sql);
        return;
    }
    if (pg->setup_step == 2)
        obx_info("postgres: relay lock acquired: the other outboxd is gone, taking over");
    pg->standby = false;
    uv_timer_stop(&pg->timer);
    pg->attempts = 0;
    set_state(pg, OBX_PG_READY, "setup done");
    obx_info("postgres: connected to %s (schema version %ld, listening on %s)", pg->target,
             pg->schema_version, OBX_NOTIFY_CHANNEL);
    pg->cb.ready(pg->arg);
}

/* Sends a statement on a connection we own (READY, or BUSY inside a
 * wrapped transaction). Returns 0, or -1 after dropping the connection. */
static int send_raw(struct obx_pg *pg, const char *sql, int nparams, const char *const *values,
                    int result_format)
{
    int sent =
        nparams > 0 || result_format != 0
            ? PQsendQueryParams(pg->conn, sql, nparams, NULL, values, NULL, NULL, result_format)
            : PQsendQuery(pg->conn, sql);
    if (!sent) {
        disconnect_with_error(pg, "send failed");
        return -1;
    }
    set_state(pg, OBX_PG_BUSY, "statement sent");
    int f = PQflush(pg->conn);
    if (f < 0 || watch(pg, UV_READABLE | (f == 1 ? UV_WRITABLE : 0)) != 0) {
        disconnect_with_error(pg, "write failed");
        return -1;
    }
    return 0;
}

static void report(struct obx_pg *pg, const PGresult *res, const char *error)
{
    set_state(pg, OBX_PG_READY, error ? "statement failed" : "statement done");
    pg->cb.result(res, error, pg->arg);
}

static bool result_ok(const PGresult *res)
{
    return res &&
           (PQresultStatus(res) == PGRES_COMMAND_OK || PQresultStatus(res) == PGRES_TUPLES_OK);
}

static const char *result_error(const PGresult *res)
{
    const char *msg = res ? PQresultErrorMessage(res) : "";
    return *msg ? msg : "the statement returned no result";
}

/* Our statement completed with `res` (ours to free). Reports it, or moves a
 * wrapped transaction on: BEGIN -> body -> [failpoint] -> COMMIT, with
 * ROLLBACK after a failed body. */
static void statement_done(struct obx_pg *pg, PGresult *res)
{
    bool ok = result_ok(res);
    switch (pg->tx) {
    case TX_NONE:
        report(pg, ok ? res : NULL, ok ? NULL : result_error(res));
        break;
    case TX_BEGIN:
        if (!ok) {
            pg->tx = TX_NONE;
            report(pg, NULL, result_error(res));
            break;
        }
        pg->tx = TX_BODY;
        send_raw(pg, pg->tx_sql, pg->tx_nparams, pg->tx_values, 0);
        break;
    case TX_BODY:
        if (ok && pg->tx_failpoint >= 0 && obx_failpoints_active.armed &&
            obx_failpoint_reach(&obx_failpoints_active, (enum obx_fp_id)pg->tx_failpoint) != 0) {
            snprintf(pg->tx_error, sizeof(pg->tx_error), "injected error at failpoint %s",
                     obx_failpoint_name((enum obx_fp_id)pg->tx_failpoint));
            ok = false;
        } else if (!ok) {
            snprintf(pg->tx_error, sizeof(pg->tx_error), "%s", result_error(res));
        }
        if (!ok) {
            pg->tx = TX_ROLLBACK;
            send_raw(pg, "ROLLBACK", 0, NULL, 0);
            break;
        }
        pg->tx_result = res;
        res = NULL;
        pg->tx = TX_COMMIT;
        send_raw(pg, "COMMIT", 0, NULL, 0);
        break;
    case TX_COMMIT:
        pg->tx = TX_NONE;
        if (ok)
            report(pg, pg->tx_result, NULL);
        else
            report(pg, NULL, result_error(res));
        PQclear(pg->tx_result);
        pg->tx_result = NULL;
        break;
    case TX_ROLLBACK:
        pg->tx = TX_NONE;
        report(pg, NULL, pg->tx_error);
        break;
    }
    PQclear(res);
}

/* Reads what the server sent: notifications and results. */
static void consume(struct obx_pg *pg)
{
    PGnotify *n;
    bool notified = false;

    if (!PQconsumeInput(pg->conn)) {
        disconnect_with_error(pg, "read failed");
        return;
    }
    while ((pg->state == OBX_PG_BUSY || pg->state == OBX_PG_SETUP) && !PQisBusy(pg->conn)) {
        PGresult *res = PQgetResult(pg->conn);
        if (res) {
            /* Keep the first result (or the first error); a multi-statement
             * setup stops at its first error. */
            if (!pg->result || (PQresultStatus(pg->result) != PGRES_FATAL_ERROR &&
                                PQresultStatus(res) == PGRES_FATAL_ERROR)) {
                PQclear(pg->result);
                pg->result = res;
            } else {
                PQclear(res);
            }
            continue;
        }
        /* NULL: the statement is complete. A server that ended the session
         * (terminated backend, shutdown) is a lost connection, not a result. */
        res = pg->result;
        pg->result = NULL;
        if (PQstatus(pg->conn) == CONNECTION_BAD) {
            PQclear(res);
            disconnect_with_error(pg, "server closed the connection");
            return;
        }
        if (pg->state == OBX_PG_SETUP) {
            finish_setup(pg, res);
            PQclear(res);
        } else {
            statement_done(pg, res);
        }
        if (pg->state == OBX_PG_CLOSED || pg->state == OBX_PG_DISCONNECTED)
            return;
    }
    if (PQstatus(pg->conn) == CONNECTION_BAD) {
        disconnect_with_error(pg, "server closed the connection");
        return;
    }
    /* Last: PQgetResult above may have parsed notifications that arrived
     * behind a result; nothing would wake us for them until the next poll. */
    while ((n = PQnotifies(pg->conn)) != NULL) {
        notified = true;
        PQfreemem(n);
    }
    if (notified && (pg->state == OBX_PG_READY || pg->state == OBX_PG_BUSY))
        pg->cb.notify(pg->arg);
}

static void on_poll(uv_poll_t *h, int status, int events)
{
    struct obx_pg *pg = h->data;
    if (!pg->watch || &pg->watch->handle != h)
        return; /* a replaced watcher */
    if (status < 0 && status != UV_EBADF) {
        /* Let libpq find out what is wrong with the socket. */
        events = UV_READABLE;
    }
    if (pg->state == OBX_PG_CONNECTING) {
        continue_connect(pg);
        return;
    }
    if (events & UV_WRITABLE) {
        int f = PQflush(pg->conn);
        if (f < 0) {
            disconnect_with_error(pg, "write failed");
            return;
        }
        if (f == 0 && watch(pg, UV_READABLE) != 0) {
            disconnect(pg, "cannot watch the connection socket");
            return;
        }
    }
    if (events & UV_READABLE)
        consume(pg);
}

static void on_timer(uv_timer_t *t)
{
    struct obx_pg *pg = t->data;
    if (pg->state == OBX_PG_DISCONNECTED)
        start_connect(pg);
    else if (pg->state == OBX_PG_CONNECTING || pg->state == OBX_PG_SETUP)
        disconnect(pg, "timed out connecting");
}

const char *obx_pg_sql_fetch(void)
{
    return SQL_FETCH;
}

const char *obx_pg_sql_mark(int on_sent, char *buf, size_t len)
{
    snprintf(buf, len, SQL_MARK_FMT,
             on_sent == OBX_ON_SENT_DELETE ? SQL_CONFIRM_DELETE : SQL_CONFIRM_MARK);
    return buf;
}

int obx_pg_check_conninfo(const char *conninfo, char *err, size_t errlen)
{
    char *msg = NULL;
    PQconninfoOption *opts = PQconninfoParse(conninfo, &msg);
    if (opts) {
        PQconninfoFree(opts);
        return 0;
    }
    /* libpq quotes fragments of the string in its message; drop them, since
     * the string may contain a password. */
    char clean[256];
    size_t o = 0;
    bool quoted = false;
    for (const char *p = msg ? msg : "out of memory"; *p && o + 4 < sizeof(clean); p++) {
        if (*p == '"') {
            if (!quoted) {
                memcpy(clean + o, "\"...", 4);
                o += 4;
            } else {
                clean[o++] = '"';
            }
            quoted = !quoted;
        } else if (!quoted && *p != '\n') {
            clean[o++] = *p;
        }
    }
    clean[o] = '\0';
    PQfreemem(msg);
    snprintf(err, errlen, "postgres.conninfo is not a valid libpq conninfo: %s", clean);
    return -1;
}

int obx_pg_new(uv_loop_t *loop, const struct obx_config *cfg, const struct obx_pg_callbacks *cb,
               void *arg, struct obx_pg **out, char *err, size_t errlen)
{
    struct obx_pg *pg;
    if (obx_pg_check_conninfo(cfg->pg_conninfo, err, errlen) != 0)
        return -1;
    pg = calloc(1, sizeof(*pg));
    if (!pg || !(pg->conninfo = strdup(cfg->pg_conninfo))) {
        free(pg);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    pg->loop = loop;
    pg->cb = *cb;
    pg->arg = arg;
    pg->statement_timeout_ms = cfg->pg_statement_timeout_ms;
    pg->backoff_min_ms = cfg->pg_backoff_min_ms;
    pg->backoff_max_ms = cfg->pg_backoff_max_ms;
    pg->state = OBX_PG_DISCONNECTED;
    obx_pg_sql_mark(cfg->on_sent, pg->mark_sql, sizeof(pg->mark_sql));
    uv_timer_init(loop, &pg->timer);
    pg->timer.data = pg;
    *out = pg;
    return 0;
}

void obx_pg_start(struct obx_pg *pg)
{
    if (pg->state == OBX_PG_DISCONNECTED && !pg->conn)
        start_connect(pg);
}

static void on_pg_timer_closed(uv_handle_t *h)
{
    struct obx_pg *pg = h->data;
    for (size_t i = 0; i < sizeof(pg->params) / sizeof(pg->params[0]); i++)
        obx_pg_array_free(&pg->params[i]);
    free(pg->conninfo);
    free(pg);
}

void obx_pg_close(struct obx_pg *pg)
{
    if (!pg || pg->state == OBX_PG_CLOSED)
        return;
    set_state(pg, OBX_PG_CLOSED, "close");
    unwatch(pg);
    PQclear(pg->result);
    pg->result = NULL;
    PQclear(pg->tx_result);
    pg->tx_result = NULL;
    if (pg->conn)
        PQfinish(pg->conn);
    pg->conn = NULL;
    uv_close((uv_handle_t *)&pg->timer, on_pg_timer_closed);
}

/* ---- array literals for parameters ---- */

static void array_put(struct obx_pg_array *a, const char *s, size_t n)
{
    obx_buf_append(&a->text, s, n);
}

static void array_sep(struct obx_pg_array *a)
{
    if (a->count++ > 0)
        array_put(a, ",", 1);
}

void obx_pg_array_reset(struct obx_pg_array *a)
{
    obx_buf_reset(&a->text);
    a->count = 0;
    array_put(a, "{", 1);
}

void obx_pg_array_add_int(struct obx_pg_array *a, int64_t v)
{
    char num[24];
    int n = snprintf(num, sizeof(num), "%lld", (long long)v);
    array_sep(a);
    array_put(a, num, (size_t)n);
}

void obx_pg_array_add_text(struct obx_pg_array *a, const char *s, size_t len)
{
    array_sep(a);
    if (!s) {
        array_put(a, "NULL", 4);
        return;
    }
    /* Quoted, with " and \ escaped: safe for any text. */
    array_put(a, "\"", 1);
    for (size_t i = 0; i < len; i++) {
        if (s[i] == '"' || s[i] == '\\')
            array_put(a, "\\", 1);
        array_put(a, &s[i], 1);
    }
    array_put(a, "\"", 1);
}

const char *obx_pg_array_finish(struct obx_pg_array *a)
{
    array_put(a, "}", 1);
    return a->text.oom ? NULL : a->text.data;
}

void obx_pg_array_free(struct obx_pg_array *a)
{
    obx_buf_free(&a->text);
    a->count = 0;
}

/* ---- statements ---- */

int obx_pg_send(struct obx_pg *pg, const char *sql, int nparams, const char *const *values,
                int result_format)
{
    if (pg->state != OBX_PG_READY)
        return -1;
    pg->tx = TX_NONE;
    return send_raw(pg, sql, nparams, values, result_format);
}

int obx_pg_send_tx(struct obx_pg *pg, const char *sql, int nparams, const char *const *values,
                   int failpoint)
{
    if (pg->state != OBX_PG_READY)
        return -1;
    pg->tx = TX_BEGIN;
    pg->tx_sql = sql;
    pg->tx_nparams = nparams;
    pg->tx_values = values;
    pg->tx_failpoint = failpoint;
    return send_raw(pg, "BEGIN", 0, NULL, 0);
}

int obx_pg_send_fetch(struct obx_pg *pg, const struct obx_fetch *f)
{
    const char *values[5];
    struct obx_pg_array *a = pg->params;
    obx_pg_array_reset(&a[0]);
    for (size_t i = 0; i < f->n_exclude; i++)
        obx_pg_array_add_int(&a[0], f->exclude[i]);
    for (int k = 1; k <= 3; k++)
        obx_pg_array_reset(&a[k]);
    for (size_t i = 0; i < f->n_blocked; i++) {
        obx_pg_array_add_text(&a[1], f->blocked[i].topic, strlen(f->blocked[i].topic));
        obx_pg_array_add_text(&a[2], f->blocked[i].key, f->blocked[i].key_len);
        obx_pg_array_add_int(&a[3], f->blocked_ids[i]);
    }
    snprintf(pg->limit_text, sizeof(pg->limit_text), "%d", f->limit);
    values[0] = obx_pg_array_finish(&a[0]);
    values[1] = pg->limit_text;
    values[2] = obx_pg_array_finish(&a[1]);
    values[3] = obx_pg_array_finish(&a[2]);
    values[4] = obx_pg_array_finish(&a[3]);
    if (!values[0] || !values[2] || !values[3] || !values[4]) {
        obx_error("postgres: out of memory building the fetch");
        return -1;
    }
    return obx_pg_send(pg, SQL_FETCH, 5, values, 1);
}

int obx_pg_send_mark(struct obx_pg *pg, const struct obx_mark *m)
{
    const char **values = pg->param_values;
    struct obx_pg_array *a = pg->params;
    for (int k = 0; k < 6; k++)
        obx_pg_array_reset(&a[k]);
    for (size_t i = 0; i < m->n_ids; i++)
        obx_pg_array_add_int(&a[0], m->ids[i]);
    for (size_t i = 0; i < m->n_offsets; i++) {
        obx_pg_array_add_text(&a[1], m->topics[i], strlen(m->topics[i]));
        obx_pg_array_add_int(&a[2], m->partitions[i]);
        obx_pg_array_add_int(&a[3], m->offsets[i]);
    }
    for (size_t i = 0; i < m->n_dead; i++) {
        obx_pg_array_add_int(&a[4], m->dead_ids[i]);
        obx_pg_array_add_text(&a[5], m->dead_reasons[i], strlen(m->dead_reasons[i]));
    }
    for (int k = 0; k < 6; k++) {
        values[k] = obx_pg_array_finish(&a[k]);
        if (!values[k]) {
            obx_error("postgres: out of memory building the mark");
            return -1;
        }
    }
    return obx_pg_send_tx(pg, pg->mark_sql, 6, values, OBX_FP_MARK_BEFORE_COMMIT);
}
