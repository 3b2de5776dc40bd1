/*
 * pg: see include/outboxd/pg.h.
 */
#include "outboxd/pg.h"
#include "outboxd/pgconn.h"
#include "outboxd/alloc.h"
#include "outboxd/failpoint.h"
#include "outboxd/log.h"
#include "outboxd/metrics.h"
#include "outboxd/record.h"
#include "outboxd/store.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

/* libpq ignores connect_timeout under PQconnectPoll: we time connect+setup. */
#define CONNECT_TIMEOUT_MS 10000

/* A uv_poll_t on the libpq socket. Heap-allocated because PQconnectPoll may
 * switch sockets and a closing handle must outlive its replacement.
 * `events` mirrors what libuv is watching: 0 once libuv stopped the handle. */
struct pg_watch {
    uv_poll_t handle;
    int fd;
    int events;
};

/* The request in flight (BUSY). A transaction runs in steps:
 * BEGIN -> body -> [failpoint] -> COMMIT, or ROLLBACK after a failed body. */
struct pg_request {
    obx_pg_done_fn done; /* one of done and rows_done is set */
    obx_pg_rows_fn rows_done;
    void *arg;
    enum { TX_NONE, TX_BEGIN, TX_BODY, TX_COMMIT, TX_ROLLBACK } tx;
    const char *sql; /* the transaction's body: its text, or with `prepared` its name */
    bool prepared;
    int result_format;
    int nparams;
    const char *const *values;
    int failpoint;    /* reached between the body and COMMIT; -1 = none */
    PGresult *result; /* the body's result, reported after COMMIT */
    char error[512];  /* why the transaction failed (reported after ROLLBACK) */
};

/* The most parameters a statement of the cycle takes. */
#define PG_MAX_PARAMS 16
_Static_assert((int)OBX_MARK_FETCH_NPARAMS <= PG_MAX_PARAMS &&
                   (int)OBX_FETCH_LOG_NPARAMS <= PG_MAX_PARAMS &&
                   (int)OBX_MARK_NPARAMS <= PG_MAX_PARAMS &&
                   (int)OBX_CURSOR_NPARAMS <= PG_MAX_PARAMS,
               "a statement of the cycle has more parameters than pg keeps room for");

struct obx_pg {
    uv_loop_t *loop;
    uint64_t reconnects;             /* connection attempts after the first */
    struct obx_histogram batch_rows; /* rows per fetch */
    struct obx_pg_callbacks cb;
    void *arg;
    char *conninfo; /* owned; secret */
    int64_t statement_timeout_ms;
    int shards; /* relay.shards: above 1 the relay lock is shared by the relays */
    int64_t backoff_min_ms, backoff_max_ms;

    enum obx_pg_state state;
    PGconn *conn;
    struct pg_watch *watch;
    uv_timer_t timer;    /* reconnect back-off, connect+setup timeout, standby lock poll */
    uv_timer_t deferred; /* fires `lost` on a later loop turn */
    int open_handles;    /* timer and deferred until both are closed */
    bool lost_pending;   /* `lost` is due */
    int attempts;        /* failed attempts since the last READY */
    bool started;        /* a first connection was attempted */
    bool standby_logged; /* this session said it stands by */
    long schema_version;
    /* The history of the session being set up, of the last one that was
     * ready ("" before the first), and how often it changed. */
    char system_id[24], ready_system_id[24], stored_system_id[24];
    long timeline, ready_timeline, stored_timeline; /* stored: outbox.history's, before */
    uint64_t history_changes;
    bool history_warned;         /* said once that the server refuses it */
    bool pooler_noted;           /* said once that a session pooler is in between */
    char session_token[24];      /* this session's outboxd.session (see new_session_token) */
    char history[64];            /* obx_pg_history() of the ready session */
    char dbname[128];            /* the server's current_database(), with the history */
    bool fence_slot_owners;      /* relay.transactions, relay.shards = 1 */
    char lost_slot_owners[1024]; /* obx_pg_lost_slot_owners(): 64 pids at most */
    PGresult *result;            /* first result of the statement in flight */
    char target[256];            /* "host:port/db as user", for logs; no password */
    struct pg_request req;

    struct obx_row *rows; /* batch_size rows, decoded from each fetch */
    int max_rows;
    /* A statement's values by their index (store.h's enums), and the array
     * parameters' buffers at the same index; reused, and the values must
     * outlive a wrapped transaction's BEGIN. */
    struct obx_pg_array params[PG_MAX_PARAMS];
    const char *param_values[PG_MAX_PARAMS];
    char batch_text[24], hwm_text[24]; /* log mode's cursor row */
    char limit_text[16];
    char max_bytes_text[24], after_text[24], shards_text[16];
    char mark_sql[OBX_STORE_MARK_SQL_LEN];
    char mark_plain_sql[OBX_STORE_MARK_PLAIN_SQL_LEN]; /* without dead letters */
    char mark_fetch_sql[OBX_STORE_MARK_FETCH_SQL_LEN]; /* the plain mark with the keyset fetch */
    struct obx_buf fetch_sql; /* the full fetch, built around its ids in flight */
    int64_t *sorted_ids;      /* the mark's ids (relay.max_in_flight), sorted into ranges */
    size_t max_ids;
    int setup_step;     /* 0: the schema check and SETs; then each prepared statement;
                         * then HISTORY_STEP */
    bool repairing;     /* LOCKING: the lock is held, the xid repair in flight */
    long long repaired; /* rows the repair statements of this lock gave this cluster's xid */
};

/* The statements of every cycle, prepared once a session, after the schema
 * check they depend on: no parse, analysis and planning for each run. Each
 * keeps its own text, so pg_stat_activity shows which one runs. (The full
 * fetch is not among them: its ids in flight are part of its text.) */
#define STMT_FETCH_KEYSET "obx_fetch_keyset"
#define STMT_MARK         "obx_mark"
#define STMT_MARK_PLAIN   "obx_mark_plain"
#define STMT_MARK_FETCH   "obx_mark_fetch"
enum { N_PREPARES = 4, HISTORY_STEP = N_PREPARES + 1 };

static const char *const state_names[] = {"disconnected", "connecting", "setup", "locking",
                                          "standby",      "ready",      "busy",  "closed"};

const char *obx_pg_state_name(enum obx_pg_state s)
{
    return (unsigned)s < sizeof(state_names) / sizeof(state_names[0]) ? state_names[s] : "?";
}

/* Which moves are possible: allowed[from] is a bit set of destinations. */
#define BIT(s) (1u << (s))
static const unsigned allowed[] = {
    [OBX_PG_DISCONNECTED] = BIT(OBX_PG_CONNECTING) | BIT(OBX_PG_CLOSED),
    [OBX_PG_CONNECTING] = BIT(OBX_PG_SETUP) | BIT(OBX_PG_DISCONNECTED) | BIT(OBX_PG_CLOSED),
    [OBX_PG_SETUP] = BIT(OBX_PG_LOCKING) | BIT(OBX_PG_DISCONNECTED) | BIT(OBX_PG_CLOSED),
    [OBX_PG_LOCKING] =
        BIT(OBX_PG_READY) | BIT(OBX_PG_STANDBY) | BIT(OBX_PG_DISCONNECTED) | BIT(OBX_PG_CLOSED),
    [OBX_PG_STANDBY] = BIT(OBX_PG_LOCKING) | BIT(OBX_PG_DISCONNECTED) | BIT(OBX_PG_CLOSED),
    [OBX_PG_READY] = BIT(OBX_PG_BUSY) | BIT(OBX_PG_DISCONNECTED) | BIT(OBX_PG_CLOSED),
    [OBX_PG_BUSY] = BIT(OBX_PG_READY) | BIT(OBX_PG_DISCONNECTED) | BIT(OBX_PG_CLOSED),
    [OBX_PG_CLOSED] = 0,
};

/* The one place the state changes. */
static void change_state(struct obx_pg *pg, enum obx_pg_state to, const char *why)
{
    if (!(allowed[pg->state] & BIT(to))) {
        OBX_BUG("postgres: refused state change %s -> %s (%s)", state_names[pg->state],
                state_names[to], why);
        return;
    }
    obx_debug("postgres: %s -> %s (%s)", state_names[pg->state], state_names[to], why);
    pg->state = to;
}

bool obx_pg_standby(const struct obx_pg *pg)
{
    return pg->state == OBX_PG_STANDBY || (pg->state == OBX_PG_LOCKING && pg->standby_logged);
}

bool obx_pg_usable(const struct obx_pg *pg)
{
    return pg->state == OBX_PG_READY || pg->state == OBX_PG_BUSY;
}

enum obx_pg_state obx_pg_state(const struct obx_pg *pg)
{
    return pg->state;
}

static void on_watch_closed(uv_handle_t *h)
{
    obx_free((struct pg_watch *)h); /* handle is the first member */
}

static void unwatch(struct obx_pg *pg)
{
    if (!pg->watch)
        return;
    uv_close((uv_handle_t *)&pg->watch->handle, on_watch_closed);
    pg->watch = NULL;
}

static void on_poll(uv_poll_t *h, int status, int events);

/* Watches the libpq socket for `events`. Returns 0 or -1. */
static int watch(struct obx_pg *pg, int events)
{
    int fd = PQsocket(pg->conn);
    if (fd < 0)
        return -1;
    if (pg->watch && pg->watch->fd != fd)
        unwatch(pg);
    if (!pg->watch) {
        struct pg_watch *w = obx_malloc(sizeof(*w));
        if (!w)
            return -1;
        if (uv_poll_init(pg->loop, &w->handle, fd) != 0) {
            obx_free(w);
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

/* Watches for an answer, and for writability while libpq holds unsent
 * bytes. Returns 0 or -1. */
static int watch_idle_or_busy(struct obx_pg *pg)
{
    int f = PQflush(pg->conn);
    if (f < 0)
        return -1;
    return watch(pg, UV_READABLE | (f == 1 ? UV_WRITABLE : 0));
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

static void on_deferred(uv_timer_t *t)
{
    struct obx_pg *pg = t->data;
    if (pg->lost_pending && pg->state != OBX_PG_CLOSED) {
        pg->lost_pending = false;
        pg->cb.lost(pg->arg);
    }
}

static void drop_request(struct obx_pg *pg)
{
    PQclear(pg->result);
    pg->result = NULL;
    PQclear(pg->req.result);
    memset(&pg->req, 0, sizeof(pg->req));
}

/* Drops the connection with a reason, and schedules a reconnect. A request
 * in flight is dropped; `lost` follows on a later loop turn. */
static void disconnect(struct obx_pg *pg, const char *reason)
{
    bool had_lock = obx_pg_usable(pg);
    if (pg->state == OBX_PG_CLOSED || pg->state == OBX_PG_DISCONNECTED)
        return;
    if (had_lock || pg->state == OBX_PG_STANDBY)
        obx_event(OBX_LOG_WARN, "postgres_lost", "postgres: connection to %s lost (while %s): %s",
                  pg->target, state_names[pg->state], reason);
    else
        obx_event(OBX_LOG_WARN, "postgres_unreachable", "postgres: cannot connect%s%s: %s",
                  pg->target[0] ? " to " : "", pg->target, reason);
    unwatch(pg);
    drop_request(pg);
    PQfinish(pg->conn);
    pg->conn = NULL;
    pg->attempts++;
    pg->standby_logged = false;
    change_state(pg, OBX_PG_DISCONNECTED, reason);
    uv_timer_stop(&pg->timer);
    schedule_reconnect(pg);
    if (had_lock) {
        pg->lost_pending = true;
        uv_timer_start(&pg->deferred, on_deferred, 0, 0);
    }
}

static void disconnect_with_error(struct obx_pg *pg, const char *prefix)
{
    char reason[512];
    const char *msg = pg->conn ? PQerrorMessage(pg->conn) : "";
    snprintf(reason, sizeof(reason), "%s%s%s", prefix, *msg ? ": " : "", msg);
    size_t len = strlen(reason);
    while (len > 0 && (reason[len - 1] == '\n' || reason[len - 1] == ' '))
        reason[--len] = '\0';
    for (char *p = reason; *p; p++) /* libpq's messages span lines: keep one log line */
        if (*p == '\n' || *p == '\t')
            *p = ' ';
    disconnect(pg, reason);
}

static void describe_target(struct obx_pg *pg)
{
    const char *host = PQhost(pg->conn);
    snprintf(pg->target, sizeof(pg->target), "%s:%s/%s as %s", host ? host : "?",
             PQport(pg->conn) ? PQport(pg->conn) : "?", PQdb(pg->conn) ? PQdb(pg->conn) : "?",
             PQuser(pg->conn) ? PQuser(pg->conn) : "?");
}

/* While connecting, libpq may close its socket and open another for the
 * next host or retry (multi-host conninfo, target_session_attrs,
 * sslmode=prefer) after any PQconnectPoll call, and the new socket usually
 * gets the same fd number: nothing we can compare tells the two apart. So
 * each step gets a fresh watcher. */
static void watch_connect_step(struct obx_pg *pg, int events)
{
    unwatch(pg);
    if (watch(pg, events) != 0)
        disconnect(pg, "cannot watch the connection socket");
}

/* Server notices and warnings (e.g. the FATAL a terminated backend sends)
 * go through our log, as one escaped line, instead of libpq's raw stderr. */
static void on_notice(void *arg, const char *message)
{
    struct obx_pg *pg = arg;
    obx_warn("postgres: server says (%s): %s", pg->target[0] ? pg->target : "connecting", message);
}

static void start_connect(struct obx_pg *pg)
{
    struct obx_pg_params params; /* a primary, keepalives; the user's keys win */
    obx_pg_params(&params, pg->conninfo, "outboxd", 0);

    pg->target[0] = '\0';
    if (pg->started)
        pg->reconnects++;
    pg->started = true;
    pg->conn = PQconnectStartParams(params.keys, params.values, 1);
    if (!pg->conn) {
        obx_error("postgres: out of memory starting a connection");
        pg->attempts++;
        schedule_reconnect(pg);
        return;
    }
    PQsetNoticeProcessor(pg->conn, on_notice, pg);
    change_state(pg, OBX_PG_CONNECTING, "connect");
    if (PQstatus(pg->conn) == CONNECTION_BAD) {
        disconnect_with_error(pg, "connection failed");
        return;
    }
    uv_timer_start(&pg->timer, on_timer, CONNECT_TIMEOUT_MS, 0);
    /* libpq: after PQconnectStart, act as if PQconnectPoll said WRITING. */
    watch_connect_step(pg, UV_WRITABLE);
}

/* Prepares statement `step` (1 .. N_PREPARES) of the cycle. */
static void send_setup_prepare(struct obx_pg *pg, int step)
{
    static const char *const names[N_PREPARES + 1] = {NULL, STMT_FETCH_KEYSET, STMT_MARK,
                                                      STMT_MARK_PLAIN, STMT_MARK_FETCH};
    const char *sql[N_PREPARES + 1] = {NULL, obx_store_sql_fetch_keyset(), pg->mark_sql,
                                       pg->mark_plain_sql, pg->mark_fetch_sql};
    if (!PQsendPrepare(pg->conn, names[step], sql[step], 0, NULL)) {
        disconnect_with_error(pg, "setup failed");
        return;
    }
    if (watch_idle_or_busy(pg) != 0)
        disconnect_with_error(pg, "setup failed");
}

/* Sends a setup statement (simple protocol: may hold several). */
static void send_setup_statement(struct obx_pg *pg, const char *sql)
{
    if (!PQsendQuery(pg->conn, sql)) {
        disconnect_with_error(pg, "setup failed");
        return;
    }
    if (watch_idle_or_busy(pg) != 0)
        disconnect_with_error(pg, "setup failed");
}

/* A value for this session's OBX_STORE_SESSION_SETTING that no other
 * relay's session has: random where the kernel has it, else the process,
 * the time and a count. Hex digits only (it goes into SQL text). */
static void new_session_token(struct obx_pg *pg)
{
    static uint64_t count;
    uint64_t v;
    if (getrandom(&v, sizeof(v), GRND_NONBLOCK) != (ssize_t)sizeof(v))
        v = ((uint64_t)getpid() << 40) ^ (uint64_t)uv_hrtime() ^ (++count << 20);
    snprintf(pg->session_token, sizeof(pg->session_token), "%016llx", (unsigned long long)v);
}

static void send_setup(struct obx_pg *pg)
{
    char sql[1200];
    new_session_token(pg);
    /* Server-side keepalives too: if this client vanishes without closing
     * (a network partition), its backend, and the relay lock it holds, go
     * away within about a minute instead of the OS's two hours, so no relay
     * stands by behind a dead session for long. */
    int n = snprintf(sql, sizeof(sql),
                     OBX_STORE_SQL_SETUP_CHECK
                     ";"
                     " SET statement_timeout = %lld;"
                     " SET tcp_keepalives_idle = 30; SET tcp_keepalives_interval = 10;"
                     " SET tcp_keepalives_count = 3; " OBX_STORE_SQL_PLANNER_SETTINGS
                     "; SELECT set_config('" OBX_STORE_SESSION_SETTING "', '%s', false)",
                     (long long)pg->statement_timeout_ms, pg->session_token);
    describe_target(pg);
    if (n < 0 || (size_t)n >= sizeof(sql)) { /* a bug: the buffer is sized for the text */
        disconnect_with_error(pg, "setup statement too long");
        return;
    }
    if (PQsetnonblocking(pg->conn, 1) != 0) {
        disconnect_with_error(pg, "setup failed");
        return;
    }
    change_state(pg, OBX_PG_SETUP, "connected");
    pg->setup_step = 0;
    send_setup_statement(pg, sql);
}

static void continue_connect(struct obx_pg *pg)
{
    switch (PQconnectPoll(pg->conn)) {
    case PGRES_POLLING_READING:
        watch_connect_step(pg, UV_READABLE);
        break;
    case PGRES_POLLING_WRITING:
        watch_connect_step(pg, UV_WRITABLE);
        break;
    case PGRES_POLLING_OK:
        /* The final socket: from here on it never changes. */
        unwatch(pg);
        send_setup(pg);
        break;
    default:
        disconnect_with_error(pg, "connection failed");
        break;
    }
}

/* Tries the relay lock: a statement that returns at once, so no snapshot is
 * held while another relay is active (a waiting pg_advisory_lock() would pin
 * the database's xmin horizon for as long as it waits). */
static void try_lock(struct obx_pg *pg)
{
    pg->repairing = false;
    pg->lost_slot_owners[0] = '\0';
    change_state(pg, OBX_PG_LOCKING, "try the relay lock");
    /* With relay.shards above 1 the relays hold it shared, each publishing
     * the slots it owns: a single relay (relay.shards = 1) and they exclude
     * each other. */
    /* Only in the server session the set-up ran in (NULL elsewhere): a
     * pooler's other session may hold another relay's lock, which would be
     * granted to this one again. */
    char sql[256];
    snprintf(sql, sizeof(sql),
             "SELECT CASE WHEN current_setting('" OBX_STORE_SESSION_SETTING "', true) = '%s'"
             " THEN %s(" OBX_RELAY_LOCK ") END",
             pg->session_token,
             pg->shards > 1 ? "pg_try_advisory_lock_shared" : "pg_try_advisory_lock");
    send_setup_statement(pg, sql);
}

/* The history's answer: without it (refused, see OBX_STORE_SQL_HISTORY)
 * this session is not compared with the last one. */
static void finish_history(struct obx_pg *pg, const PGresult *res)
{
    pg->system_id[0] = pg->stored_system_id[0] = '\0';
    pg->timeline = pg->stored_timeline = 0;
    pg->dbname[0] = '\0';
    if (PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1 && PQnfields(res) == 5) {
        snprintf(pg->system_id, sizeof(pg->system_id), "%s", obx_store_col(res, 0, "system_id"));
        snprintf(pg->dbname, sizeof(pg->dbname), "%s", obx_store_col(res, 0, "dbname"));
        pg->timeline = strtol(obx_store_col(res, 0, "timeline"), NULL, 10);
        if (!obx_store_col_null(res, 0, "stored_system_id")) {
            snprintf(pg->stored_system_id, sizeof(pg->stored_system_id), "%s",
                     obx_store_col(res, 0, "stored_system_id"));
            pg->stored_timeline = strtol(obx_store_col(res, 0, "stored_timeline"), NULL, 10);
        }
    } else if (!pg->history_warned) {
        pg->history_warned = true;
        obx_warn("postgres: cannot read the server's system identifier and timeline (%s): a "
                 "change of history (a failover, a restore) is not logged",
                 PQresultErrorField(res, PG_DIAG_MESSAGE_PRIMARY)
                     ? PQresultErrorField(res, PG_DIAG_MESSAGE_PRIMARY)
                     : "no answer");
    }
    try_lock(pg);
}

/* The session's server session moved under it: drops the connection,
 * naming the pooling. */
static void session_moved(struct obx_pg *pg)
{
    char reason[512];
    obx_pg_pooling_problem(reason, sizeof(reason));
    disconnect(pg, reason);
}

/* A prepared statement missing (26000) or there already (42P05), on a
 * connection that prepared each once on its own session: the session
 * changed under it, which a transaction pooler does. Returns true after
 * dropping the connection. */
static bool session_changed(struct obx_pg *pg, const PGresult *res)
{
    const char *state = res ? PQresultErrorField(res, PG_DIAG_SQLSTATE) : NULL;
    if (!state || (strcmp(state, "26000") != 0 && strcmp(state, "42P05") != 0))
        return false;
    session_moved(pg);
    return true;
}

/* A fetch's answer from another server session than the one this
 * connection set up: its row without an id carries the session's
 * outboxd.session (FETCH_SNAPSHOT_ROW), which only the set-up set. A
 * pooler in transaction pooling that the probe at set-up missed (another
 * client took the session first), or one that prepares statements for its
 * clients on every session (PgBouncer 1.21 and later), shows here before
 * anything of the fetch is used. Returns true after dropping the
 * connection. */
static bool fetch_from_another_session(struct obx_pg *pg, const PGresult *res)
{
    if (PQresultStatus(res) != PGRES_TUPLES_OK || PQnfields(res) != OBX_COL_COUNT)
        return false;
    for (int i = 0; i < PQntuples(res); i++) {
        if (!PQgetisnull(res, i, OBX_COL_ID) || PQgetisnull(res, i, OBX_COL_SNAPSHOT))
            continue;
        if (!PQgetisnull(res, i, OBX_COL_TOPIC) &&
            strcmp(PQgetvalue(res, i, OBX_COL_TOPIC), pg->session_token) == 0)
            return false;
        session_moved(pg);
        return true;
    }
    return false;
}

/* Behind a pooler, makes sure this connection keeps its server session
 * (see obx_pg_pooling). Returns true after dropping the connection. */
static bool refuse_pooling(struct obx_pg *pg, int backend_pid)
{
    char reason[512];
    switch (obx_pg_pooling(pg->conn, backend_pid, pg->conninfo, "outboxd", OBX_PG_POOL_PROBE_S)) {
    case OBX_POOLING_NONE:
        return false;
    case OBX_POOLING_SHARED:
        obx_pg_pooling_problem(reason, sizeof(reason));
        disconnect(pg, reason);
        return true;
    case OBX_POOLING_SESSION:
        if (!pg->pooler_noted)
            obx_info("postgres: %s is reached through a connection pooler that gave a second "
                     "connection another server session: session pooling, fine",
                     pg->target);
        break;
    case OBX_POOLING_UNKNOWN:
        if (!pg->pooler_noted)
            obx_warn("postgres: %s is reached through a connection pooler, and a second "
                     "connection got no server session within %d s: taken for session "
                     "pooling (transaction pooling is refused when a prepared statement "
                     "vanishes)",
                     pg->target, OBX_PG_POOL_PROBE_S);
        break;
    }
    pg->pooler_noted = true;
    return false;
}

/* The schema check and SETs answered. */
static void finish_setup(struct obx_pg *pg, const PGresult *res)
{
    char reason[512];
    const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);

    if (pg->setup_step == HISTORY_STEP) {
        finish_history(pg, res);
        return;
    }
    if (PQresultStatus(res) != PGRES_TUPLES_OK && PQresultStatus(res) != PGRES_COMMAND_OK) {
        if (session_changed(pg, res))
            return;
        if (state && pg->setup_step == 0 &&
            (strcmp(state, "42P01") == 0 || strcmp(state, "3F000") == 0)) {
            obx_store_schema_problem(-1, NULL, reason, sizeof(reason));
        } else {
            snprintf(reason, sizeof(reason), "setup failed: %s", PQresultErrorMessage(res));
        }
        disconnect(pg, reason);
        return;
    }
    if (pg->setup_step > 0) { /* a statement prepared */
        if (pg->setup_step < N_PREPARES) {
            send_setup_prepare(pg, ++pg->setup_step);
        } else {
            pg->setup_step = HISTORY_STEP;
            send_setup_statement(pg, OBX_STORE_SQL_HISTORY);
        }
        return;
    }
    long version = 0, id_cache = 1, backend_pid = 0;
    bool in_recovery = false;
    if (PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1 && PQnfields(res) == 4) {
        version = strtol(obx_store_col(res, 0, "version"), NULL, 10);
        in_recovery = obx_store_col_true(res, 0, "in_recovery");
        id_cache = strtol(obx_store_col(res, 0, "id_cache"), NULL, 10);
        backend_pid = strtol(obx_store_col(res, 0, "backend_pid"), NULL, 10);
    }
    if (refuse_pooling(pg, (int)backend_pid))
        return;
    if (in_recovery) {
        /* Its snapshots do not list the primary's running writers, so late
         * commits would be skipped; and nothing could be marked there. */
        snprintf(reason, sizeof(reason),
                 "%s is a hot standby (in recovery): outboxd publishes only from a primary "
                 "(list the primary in postgres.conninfo; target_session_attrs=any lets "
                 "libpq pick a standby)",
                 pg->target);
        disconnect(pg, reason);
        return;
    }
    if (obx_store_schema_problem(version, NULL, reason, sizeof(reason)) != 0 ||
        obx_store_id_cache_problem(id_cache, reason, sizeof(reason)) != 0) {
        disconnect(pg, reason);
        return;
    }
    pg->schema_version = version;
    pg->setup_step = 1;
    send_setup_prepare(pg, 1);
}

/* Says so when this session's server is on another history than the last
 * ready session's: ids it hands out from now on may be ids whose records
 * are already in Kafka. Nothing of the old session is confirmed by id in
 * this one (relay.c): the recovery pass matches what it finds by content. */
static void note_history(struct obx_pg *pg)
{
    pg->history[0] = '\0';
    if (!pg->system_id[0])
        return; /* unknown: nothing to compare, and the last known one stays */
    /* What this process saw last, else what the database kept from the
     * last session of any relay (it came along with the data). */
    const char *was_id = pg->ready_system_id[0] ? pg->ready_system_id : pg->stored_system_id;
    long was_tl = pg->ready_system_id[0] ? pg->ready_timeline : pg->stored_timeline;
    if (was_id[0] && (strcmp(pg->system_id, was_id) != 0 || pg->timeline != was_tl)) {
        pg->history_changes++;
        obx_event(OBX_LOG_WARN, "history_changed",
                  "postgres: %s is on another history than the last session's server (system "
                  "%s timeline %ld, was system %s timeline %ld): a failover to a standby, a "
                  "restore or a cut-over; ids may be handed out again, and nothing of the old "
                  "session is confirmed by id: the recovery pass matches records by content",
                  pg->target, pg->system_id, pg->timeline, was_id, was_tl);
    }
    snprintf(pg->ready_system_id, sizeof(pg->ready_system_id), "%s", pg->system_id);
    pg->ready_timeline = pg->timeline;
    snprintf(pg->history, sizeof(pg->history), "%s.%ld", pg->system_id, pg->timeline);
}

const char *obx_pg_history(const struct obx_pg *pg)
{
    return pg->history;
}

const char *obx_pg_dbname(const struct obx_pg *pg)
{
    return pg->dbname;
}

const char *obx_pg_lost_slot_owners(const struct obx_pg *pg)
{
    return pg->lost_slot_owners;
}

/* The lock is held and the rows repaired: the relay may go. */
static void become_ready(struct obx_pg *pg)
{
    change_state(pg, OBX_PG_READY, "relay lock acquired");
    char history[64] = "";
    if (pg->system_id[0])
        snprintf(history, sizeof(history), ", system %s, timeline %ld", pg->system_id,
                 pg->timeline);
    obx_event(OBX_LOG_INFO, "postgres_ready", "postgres: connected to %s (schema version %ld%s)",
              pg->target, pg->schema_version, history);
    note_history(pg);
    if (pg->lost_pending) { /* the old session's end comes first */
        uv_timer_stop(&pg->deferred);
        pg->lost_pending = false;
        pg->cb.lost(pg->arg);
        if (pg->state != OBX_PG_READY)
            return;
    }
    pg->cb.ready(pg->arg);
}

/* The answer of outbox.repair_writer_xids(), run on every acquisition of
 * the lock: a standby may have been connected since before a restore. */
static void finish_repair(struct obx_pg *pg, const PGresult *res)
{
    pg->repairing = false;
    if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1) {
        char reason[512];
        snprintf(reason, sizeof(reason), "repairing rows with another cluster's xid failed: %s",
                 PQresultErrorMessage(res));
        disconnect(pg, reason);
        return;
    }
    long long n = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
    if (n > 0)
        pg->repaired += n;
    if (n < 0 || n >= OBX_STORE_REPAIR_CHUNK) { /* a rebase goes on, or more to repair */
        pg->repairing = true;
        send_setup_statement(pg, PQnfields(res) > 1 ? OBX_STORE_SQL_REPAIR_XIDS_AND_LOST_OWNERS
                                                    : OBX_STORE_SQL_REPAIR_XIDS);
        return;
    }
    if (pg->repaired > 0)
        obx_warn("postgres: %lld unsent rows carried a transaction id from another cluster "
                 "(restored or replicated); they now carry one of this cluster's (those not yet "
                 "published go out once)",
                 pg->repaired);
    snprintf(pg->lost_slot_owners, sizeof(pg->lost_slot_owners), "%s",
             PQnfields(res) > 1 ? PQgetvalue(res, 0, 1) : "");
    become_ready(pg);
}

/* The answer of pg_try_advisory_lock (or, once it is held, of the repair). */
static void finish_lock(struct obx_pg *pg, const PGresult *res)
{
    if (pg->repairing) {
        finish_repair(pg, res);
        return;
    }
    if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1) {
        char reason[512];
        snprintf(reason, sizeof(reason), "trying the relay lock failed: %s",
                 PQresultErrorMessage(res));
        disconnect(pg, reason);
        return;
    }
    if (PQgetisnull(res, 0, 0)) {
        session_moved(pg);
        return;
    }
    if (strcmp(PQgetvalue(res, 0, 0), "t") != 0) {
        if (!pg->standby_logged)
            obx_event(OBX_LOG_WARN, "standing_by",
                      "postgres: another outboxd is relaying this outbox (it holds the relay lock "
                      "in %s%s); standing by, trying the lock every %dms",
                      pg->target,
                      pg->shards > 1 ? " as a single relay, with relay.shards = 1"
                                     : ", or relays with relay.shards above 1 share it",
                      OBX_PG_STANDBY_POLL_MS);
        pg->standby_logged = true;
        pg->attempts = 0; /* connected and healthy: a later reconnect starts its back-off anew */
        change_state(pg, OBX_PG_STANDBY, "the relay lock is held elsewhere");
        uv_timer_start(&pg->timer, on_timer, OBX_PG_STANDBY_POLL_MS, 0);
        return;
    }
    if (pg->standby_logged)
        obx_event(OBX_LOG_INFO, "taking_over",
                  "postgres: relay lock acquired: the other outboxd is gone, taking over");
    pg->standby_logged = false;
    uv_timer_stop(&pg->timer);
    pg->attempts = 0;
    if (pg->shards > 1) {
        /* Other relays publish meanwhile, and a row repaired under one of
         * them would come back to it while in flight: each relay's claim
         * repairs the rows of the slots it takes (sql/008). */
        become_ready(pg);
        return;
    }
    pg->repairing = true;
    pg->repaired = 0;
    send_setup_statement(pg, pg->fence_slot_owners ? OBX_STORE_SQL_REPAIR_XIDS_AND_LOST_OWNERS
                                                   : OBX_STORE_SQL_REPAIR_XIDS);
}

/* After a PQsend*: the statement goes out, or the connection is dropped. */
static int sent_or_lost(struct obx_pg *pg, int sent)
{
    if (!sent) {
        disconnect_with_error(pg, "send failed");
        return -1;
    }
    if (watch_idle_or_busy(pg) != 0) {
        disconnect_with_error(pg, "write failed");
        return -1;
    }
    return 0;
}

/* Sends one statement of the request in flight. Returns 0, or -1 after
 * dropping the connection. */
static int send_raw(struct obx_pg *pg, const char *sql, int nparams, const char *const *values,
                    int result_format)
{
    int sent =
        nparams > 0 || result_format != 0
            ? PQsendQueryParams(pg->conn, sql, nparams, NULL, values, NULL, NULL, result_format)
            : PQsendQuery(pg->conn, sql);
    return sent_or_lost(pg, sent);
}

/* As send_raw, for a prepared statement (see N_PREPARES). */
static int send_prepared(struct obx_pg *pg, const char *name, int nparams,
                         const char *const *values, int result_format)
{
    return sent_or_lost(
        pg, PQsendQueryPrepared(pg->conn, name, nparams, values, NULL, NULL, result_format));
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

/* Decodes a fetch result into pg->rows and reports it. The one row without
 * an id carries the statement's snapshot. */
static void report_rows(struct obx_pg *pg, obx_pg_rows_fn done, void *arg, const PGresult *res,
                        const char *error)
{
    char err[256];
    if (error) {
        done(arg, NULL, 0, NULL, error);
        return;
    }
    int n = PQntuples(res), taken = 0;
    const char *snapshot = NULL;
    for (int i = 0; i < n; i++) {
        if (PQnfields(res) == OBX_COL_COUNT && PQgetisnull(res, i, OBX_COL_ID) &&
            !PQgetisnull(res, i, OBX_COL_SNAPSHOT) && !snapshot) {
            snapshot = PQgetvalue(res, i, OBX_COL_SNAPSHOT);
            continue;
        }
        if (taken == pg->max_rows) {
            done(arg, NULL, 0, NULL, "the fetch returned more rows than it asked for");
            return;
        }
        if (obx_row_from_result(res, i, &pg->rows[taken], err, sizeof(err)) != 0) {
            done(arg, NULL, 0, NULL, err);
            return;
        }
        taken++;
    }
    obx_histogram_observe(&pg->batch_rows, taken);
    done(arg, pg->rows, (size_t)taken, snapshot, NULL);
}

/* The request is complete: READY again, then its callback. */
static void report(struct obx_pg *pg, const PGresult *res, const char *error)
{
    struct pg_request req = pg->req;
    memset(&pg->req, 0, sizeof(pg->req));
    change_state(pg, OBX_PG_READY, error ? "request failed" : "request done");
    if (req.rows_done)
        report_rows(pg, req.rows_done, req.arg, res, error);
    else
        req.done(req.arg, res, error);
}

/* A statement of the request in flight completed with `res` (ours to free).
 * Reports the request, or moves a transaction on. */
static void request_step(struct obx_pg *pg, PGresult *res)
{
    struct pg_request *q = &pg->req;
    bool ok = result_ok(res);
    if ((!ok && session_changed(pg, res)) ||
        (ok && q->rows_done && fetch_from_another_session(pg, res))) {
        PQclear(res);
        return;
    }
    switch (q->tx) {
    case TX_NONE:
        report(pg, ok ? res : NULL, ok ? NULL : result_error(res));
        break;
    case TX_BEGIN:
        if (!ok) {
            report(pg, NULL, result_error(res));
            break;
        }
        q->tx = TX_BODY;
        if (q->prepared)
            send_prepared(pg, q->sql, q->nparams, q->values, q->result_format);
        else
            send_raw(pg, q->sql, q->nparams, q->values, q->result_format);
        break;
    case TX_BODY:
        if (ok && q->failpoint >= 0 && obx_failpoints_active.armed &&
            obx_failpoint_reach(&obx_failpoints_active, (enum obx_fp_id)q->failpoint) != 0) {
            snprintf(q->error, sizeof(q->error), "injected error at failpoint %s",
                     obx_failpoint_name((enum obx_fp_id)q->failpoint));
            ok = false;
        } else if (!ok) {
            snprintf(q->error, sizeof(q->error), "%s", result_error(res));
        }
        if (!ok) {
            q->tx = TX_ROLLBACK;
            send_raw(pg, "ROLLBACK", 0, NULL, 0);
            break;
        }
        q->result = res;
        res = NULL;
        q->tx = TX_COMMIT;
        send_raw(pg, "COMMIT", 0, NULL, 0);
        break;
    case TX_COMMIT: {
        PGresult *body = q->result;
        q->result = NULL;
        if (ok)
            report(pg, body, NULL);
        else
            report(pg, NULL, result_error(res));
        PQclear(body);
        break;
    }
    case TX_ROLLBACK: {
        char error[sizeof(q->error)];
        memcpy(error, q->error, sizeof(error));
        report(pg, NULL, error);
        break;
    }
    }
    PQclear(res);
}

/* A statement is in flight in these states. */
static bool awaiting_answer(const struct obx_pg *pg)
{
    return pg->state == OBX_PG_SETUP || pg->state == OBX_PG_LOCKING || pg->state == OBX_PG_BUSY;
}

/* Reads what the server sent: results. */
static void consume(struct obx_pg *pg)
{
    if (!PQconsumeInput(pg->conn)) {
        disconnect_with_error(pg, "read failed");
        return;
    }
    while (awaiting_answer(pg) && !PQisBusy(pg->conn)) {
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
        } else if (pg->state == OBX_PG_LOCKING) {
            finish_lock(pg, res);
            PQclear(res);
        } else {
            request_step(pg, res);
        }
        if (!pg->conn)
            return; /* disconnected or closed by what ran */
    }
    if (PQstatus(pg->conn) == CONNECTION_BAD)
        disconnect_with_error(pg, "server closed the connection");
}

static void on_poll(uv_poll_t *h, int status, int events)
{
    struct obx_pg *pg = h->data;
    if (!pg->watch || &pg->watch->handle != h)
        return; /* a replaced watcher */
    if (status < 0) {
        /* POLLERR (e.g. a reset socket): libuv has already stopped this
         * handle (src/unix/poll.c, uv__poll_io) and reports no events.
         * Mirror that, and let libpq find out what is wrong. */
        obx_debug("postgres: socket error (%s) while %s", uv_strerror(status),
                  state_names[pg->state]);
        pg->watch->events = 0;
        events = UV_READABLE | UV_WRITABLE;
    }
    if (pg->state == OBX_PG_CONNECTING) {
        continue_connect(pg);
        return;
    }
    if (events & UV_WRITABLE) {
        if (PQflush(pg->conn) < 0) {
            disconnect_with_error(pg, "write failed");
            return;
        }
    }
    if (events & UV_READABLE)
        consume(pg);
    /* Whatever ran, the watcher must match what we wait for now. */
    if (pg->conn && pg->state != OBX_PG_CONNECTING && watch_idle_or_busy(pg) != 0)
        disconnect_with_error(pg, "cannot watch the connection socket");
}

static void on_timer(uv_timer_t *t)
{
    struct obx_pg *pg = t->data;
    switch (pg->state) {
    case OBX_PG_DISCONNECTED:
        start_connect(pg);
        break;
    case OBX_PG_CONNECTING:
    case OBX_PG_SETUP:
        disconnect(pg, "timed out connecting");
        break;
    case OBX_PG_LOCKING:
        disconnect(pg, "timed out trying the relay lock");
        break;
    case OBX_PG_STANDBY:
        uv_timer_start(&pg->timer, on_timer, CONNECT_TIMEOUT_MS, 0); /* the try's own bound */
        try_lock(pg);
        break;
    default:
        break;
    }
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
    pg = obx_calloc(1, sizeof(*pg));
    if (!pg || !(pg->conninfo = obx_strdup(cfg->pg_conninfo))) {
        obx_free(pg);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    pg->loop = loop;
    pg->cb = *cb;
    pg->arg = arg;
    pg->statement_timeout_ms = cfg->pg_statement_timeout_ms;
    pg->shards = cfg->shards;
    pg->fence_slot_owners = cfg->transactions && cfg->shards <= 1;
    pg->backoff_min_ms = cfg->pg_backoff_min_ms;
    pg->backoff_max_ms = cfg->pg_backoff_max_ms;
    pg->state = OBX_PG_DISCONNECTED;
    pg->max_rows = cfg->batch_size;
    obx_histogram_init_batch(&pg->batch_rows);
    pg->rows = obx_calloc((size_t)cfg->batch_size, sizeof(*pg->rows));
    pg->max_ids = (size_t)cfg->max_in_flight;
    pg->sorted_ids = obx_calloc(pg->max_ids, sizeof(*pg->sorted_ids));
    if (!pg->rows || !pg->sorted_ids) {
        obx_free(pg->rows);
        obx_free(pg->sorted_ids);
        obx_free(pg->conninfo);
        obx_free(pg);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    obx_store_sql_mark(cfg->on_sent, pg->mark_sql, sizeof(pg->mark_sql));
    obx_store_sql_mark_plain(cfg->on_sent, pg->mark_plain_sql, sizeof(pg->mark_plain_sql));
    if (cfg->on_sent == OBX_ON_SENT_LOG) /* the cursor row is log mode's mark */
        snprintf(pg->mark_sql, sizeof(pg->mark_sql), "%s", obx_store_sql_log_write());
    obx_store_sql_mark_fetch(cfg->on_sent, pg->mark_fetch_sql, sizeof(pg->mark_fetch_sql));
    uv_timer_init(loop, &pg->timer);
    uv_timer_init(loop, &pg->deferred);
    pg->timer.data = pg->deferred.data = pg;
    pg->open_handles = 2;
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
    if (--pg->open_handles > 0)
        return;
    obx_free(pg->rows);
    for (size_t i = 0; i < sizeof(pg->params) / sizeof(pg->params[0]); i++)
        obx_pg_array_free(&pg->params[i]);
    obx_buf_free(&pg->fetch_sql);
    obx_free(pg->sorted_ids);
    obx_free(pg->conninfo);
    obx_free(pg);
}

void obx_pg_close(struct obx_pg *pg)
{
    if (!pg || pg->state == OBX_PG_CLOSED)
        return;
    change_state(pg, OBX_PG_CLOSED, "close");
    unwatch(pg);
    drop_request(pg);
    if (pg->conn)
        PQfinish(pg->conn);
    pg->conn = NULL;
    uv_close((uv_handle_t *)&pg->timer, on_pg_timer_closed);
    uv_close((uv_handle_t *)&pg->deferred, on_pg_timer_closed);
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
    size_t n = obx_format_id(v, num);
    array_sep(a);
    array_put(a, num, n);
}

static int compare_ids(const void *x, const void *y)
{
    int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return (a > b) - (a < b);
}

void obx_pg_array_add_ranges(struct obx_pg_array *a, int64_t *ids, size_t n)
{
    qsort(ids, n, sizeof(ids[0]), compare_ids);
    for (size_t i = 0, j; i < n; i = j + 1) {
        for (j = i; j + 1 < n && (ids[j + 1] == ids[j] || ids[j + 1] - 1 == ids[j]); j++) {
        }
        char pair[48]; /* "{first,last}" */
        size_t len = 0;
        pair[len++] = '{';
        len += obx_format_id(ids[i], pair + len);
        pair[len++] = ',';
        len += obx_format_id(ids[j], pair + len);
        pair[len++] = '}';
        array_sep(a);
        array_put(a, pair, len);
    }
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

/* ---- requests ---- */

/* Sends `sql` (or, with `prepared`, the prepared statement of that name)
 * as the request `req`. */
static int start_statement(struct obx_pg *pg, const struct pg_request *req, bool prepared,
                           const char *sql, int nparams, const char *const *values,
                           int result_format)
{
    if (pg->state != OBX_PG_READY)
        return -1;
    pg->req = *req;
    change_state(pg, OBX_PG_BUSY, "request sent");
    int rc = prepared ? send_prepared(pg, sql, nparams, values, result_format)
                      : send_raw(pg, sql, nparams, values, result_format);
    return rc != 0 ? -1 : 0; /* -1: disconnected, the request was dropped, `lost` follows */
}

static int start_request(struct obx_pg *pg, const struct pg_request *req, const char *sql,
                         int nparams, const char *const *values, int result_format)
{
    return start_statement(pg, req, false, sql, nparams, values, result_format);
}

static int start_prepared(struct obx_pg *pg, const struct pg_request *req, const char *name,
                          int nparams, const char *const *values, int result_format)
{
    return start_statement(pg, req, true, name, nparams, values, result_format);
}

int obx_pg_send(struct obx_pg *pg, const char *sql, int nparams, const char *const *values,
                int result_format, obx_pg_done_fn done, void *arg)
{
    struct pg_request req = {.done = done, .arg = arg, .tx = TX_NONE};
    return start_request(pg, &req, sql, nparams, values, result_format);
}

int obx_pg_send_tx(struct obx_pg *pg, const char *sql, int nparams, const char *const *values,
                   int failpoint, obx_pg_done_fn done, void *arg)
{
    struct pg_request req = {.done = done,
                             .arg = arg,
                             .tx = TX_BEGIN,
                             .sql = sql,
                             .nparams = nparams,
                             .values = values,
                             .failpoint = failpoint};
    return start_request(pg, &req, "BEGIN", 0, NULL, 0);
}

/* Finishes the array parameters from index `from` up to `to` (exclusive)
 * into their values. Returns -1 out of memory (logged, naming `what`). */
static int finish_arrays(struct obx_pg *pg, int from, int to, const char **values, const char *what)
{
    for (int k = from; k < to; k++) {
        if (!(values[k] = obx_pg_array_finish(&pg->params[k]))) {
            obx_error("postgres: out of memory building the %s", what);
            return -1;
        }
    }
    return 0;
}

static void reset_arrays(struct obx_pg *pg, int from, int to)
{
    for (int k = from; k < to; k++)
        obx_pg_array_reset(&pg->params[k]);
}

/* The relay's slots (enum obx_slots_param) at index `at`: `owned` as
 * array text, NULL for every row. */
static void slots_params(struct obx_pg *pg, int shards, const char *owned, int at,
                         const char **values)
{
    snprintf(pg->shards_text, sizeof(pg->shards_text), "%d", shards > 0 ? shards : 1);
    values[at + OBX_SLOTS_SHARDS] = pg->shards_text;
    values[at + OBX_SLOTS_OWNED] = owned;
}

/* The fetch's parameters (enum obx_fetch_param); a full fetch finds the
 * ids in flight, as array text, at OBX_FETCH_AFTER. */
static int fetch_params(struct obx_pg *pg, const struct obx_fetch *f, bool keyset,
                        const char **values)
{
    struct obx_pg_array *a = pg->params;
    obx_pg_array_reset(&a[OBX_FETCH_AFTER]);
    reset_arrays(pg, OBX_FETCH_HELD_TOPICS, OBX_FETCH_HELD_IDS + 1);
    for (size_t i = 0; i < f->n_exclude && !keyset; i++)
        obx_pg_array_add_int(&a[OBX_FETCH_AFTER], f->exclude[i]);
    for (size_t i = 0; i < f->n_held_back; i++) {
        obx_pg_array_add_text(&a[OBX_FETCH_HELD_TOPICS], f->held_back[i].topic,
                              strlen(f->held_back[i].topic));
        obx_pg_array_add_text(&a[OBX_FETCH_HELD_KEYS], f->held_back[i].key,
                              f->held_back[i].key_len);
        obx_pg_array_add_int(&a[OBX_FETCH_HELD_IDS], f->held_back_ids[i]);
    }
    snprintf(pg->limit_text, sizeof(pg->limit_text), "%d", f->limit);
    snprintf(pg->max_bytes_text, sizeof(pg->max_bytes_text), "%lld", (long long)f->max_row_bytes);
    snprintf(pg->after_text, sizeof(pg->after_text), "%lld", (long long)f->after_id);
    if (finish_arrays(pg, OBX_FETCH_AFTER, OBX_FETCH_AFTER + 1, values, "fetch") != 0 ||
        finish_arrays(pg, OBX_FETCH_HELD_TOPICS, OBX_FETCH_HELD_IDS + 1, values, "fetch") != 0)
        return -1;
    if (keyset)
        values[OBX_FETCH_AFTER] = pg->after_text;
    values[OBX_FETCH_LIMIT] = pg->limit_text;
    values[OBX_FETCH_MAX_BYTES] = pg->max_bytes_text;
    slots_params(pg, f->shards, f->owned_slots, OBX_FETCH_SLOTS, values);
    values[OBX_FETCH_SNAPSHOT] = f->snapshot;
    return 0;
}

/* Log mode's held keys (enum obx_held_param) at index `at`. */
static int held_params(struct obx_pg *pg, const struct obx_log_held *held, size_t n_held,
                       const int64_t *also, size_t n_also, int at, const char **values)
{
    struct obx_pg_array *a = pg->params + at;
    reset_arrays(pg, at, at + OBX_HELD_NPARAMS);
    for (size_t i = 0; i < n_held; i++) {
        obx_pg_array_add_text(&a[OBX_HELD_TOPICS], held[i].topic, strlen(held[i].topic));
        /* NULL: the row alone */
        obx_pg_array_add_text(&a[OBX_HELD_KEYS], held[i].key, held[i].key_len);
        obx_pg_array_add_int(&a[OBX_HELD_FROM], held[i].from_id);
    }
    for (size_t i = 0; i < n_also; i++)
        obx_pg_array_add_int(&a[OBX_HELD_ALSO_SENT], also[i]);
    return finish_arrays(pg, at, at + OBX_HELD_NPARAMS, values, "held keys");
}

int obx_pg_send_fetch(struct obx_pg *pg, const struct obx_fetch *f, obx_pg_rows_fn done, void *arg)
{
    const char *values[OBX_FETCH_LOG_NPARAMS];
    bool keyset = f->keyset && f->snapshot;
    if (fetch_params(pg, f, keyset, values) != 0)
        return -1;
    struct pg_request req = {.rows_done = done, .arg = arg, .tx = TX_NONE};
    if (keyset)
        return start_prepared(pg, &req, STMT_FETCH_KEYSET, OBX_FETCH_NPARAMS, values, 1);
    const char *in_flight = values[OBX_FETCH_AFTER];
    if (f->log && !f->by_slot) {
        /* From the stored cursor: its hwm (after_id) and snapshot as the
         * keyset fetch's. */
        values[OBX_FETCH_AFTER] = pg->after_text;
        const char *sql = held_params(pg, f->held, f->n_held, f->also_sent, f->n_also,
                                      OBX_FETCH_LOG_HELD, values) == 0
                              ? obx_store_sql_fetch_log(&pg->fetch_sql, in_flight)
                              : NULL;
        if (!sql) {
            obx_error("postgres: out of memory building the fetch");
            return -1;
        }
        return start_statement(pg, &req, false, sql, OBX_FETCH_LOG_NPARAMS, values, 1);
    }
    /* By slot, the statement reads the cursor rows itself; it takes the
     * full fetch's parameters. */
    const char *sql = f->log ? obx_store_sql_fetch_log_exact(&pg->fetch_sql, in_flight)
                             : obx_store_sql_fetch(&pg->fetch_sql, in_flight);
    if (!sql) {
        obx_error("postgres: out of memory building the fetch");
        return -1;
    }
    return start_statement(pg, &req, false, sql, OBX_FETCH_FULL_NPARAMS,
                           values + OBX_FETCH_FULL_FIRST, 1);
}

/* The stored offsets (enum obx_offsets_param) at index `at`. */
static int offsets_params(struct obx_pg *pg, const struct obx_mark *m, int at, const char **values)
{
    struct obx_pg_array *a = pg->params + at;
    reset_arrays(pg, at, at + OBX_OFFSETS_NPARAMS);
    for (size_t i = 0; i < m->n_offsets; i++) {
        obx_pg_array_add_text(&a[OBX_OFFSETS_TOPICS], m->topics[i], strlen(m->topics[i]));
        obx_pg_array_add_int(&a[OBX_OFFSETS_PARTITIONS], m->partitions[i]);
        obx_pg_array_add_int(&a[OBX_OFFSETS_OFFSETS], m->offsets[i]);
    }
    return finish_arrays(pg, at, at + OBX_OFFSETS_NPARAMS, values, "offsets");
}

/* The dead letters (enum obx_dead_param) at index `at`. */
static int dead_params(struct obx_pg *pg, const struct obx_mark *m, int at, const char **values)
{
    struct obx_pg_array *a = pg->params + at;
    reset_arrays(pg, at, at + OBX_DEAD_NPARAMS);
    for (size_t i = 0; i < m->n_dead; i++) {
        obx_pg_array_add_int(&a[OBX_DEAD_IDS], m->dead_ids[i]);
        obx_pg_array_add_text(&a[OBX_DEAD_REASONS], m->dead_reasons[i], strlen(m->dead_reasons[i]));
    }
    return finish_arrays(pg, at, at + OBX_DEAD_NPARAMS, values, "dead letters");
}

/* The plain mark's parameters (enum obx_mark_param up to
 * OBX_MARK_PLAIN_NPARAMS) at index `at`. Returns -1 out of memory. */
static int mark_params(struct obx_pg *pg, const struct obx_mark *m, int at, const char **values)
{
    struct obx_pg_array *ranges = &pg->params[at + OBX_MARK_RANGES];
    obx_pg_array_reset(ranges);
    if (m->n_ids > pg->max_ids) { /* cannot happen: one id per slot of the relay */
        obx_error("postgres: a mark of %zu ids, more than relay.max_in_flight", m->n_ids);
        return -1;
    }
    if (m->n_ids > 0) {
        memcpy(pg->sorted_ids, m->ids, m->n_ids * sizeof(*m->ids));
        obx_pg_array_add_ranges(ranges, pg->sorted_ids, m->n_ids);
    }
    if (finish_arrays(pg, at + OBX_MARK_RANGES, at + OBX_MARK_RANGES + 1, values, "mark") != 0)
        return -1;
    slots_params(pg, m->shards, m->owned_slots, at + OBX_MARK_SLOTS, values);
    return offsets_params(pg, m, at + OBX_MARK_OFFSETS, values);
}

/* The mark's statements run as in production whatever is armed; only with
 * mark.before_commit armed is the same prepared statement wrapped in BEGIN
 * ... COMMIT, so that the moment between it and COMMIT exists (the "during
 * the mark" crash window). `values` must outlive the BEGIN's round trip. */
static int start_mark_statement(struct obx_pg *pg, struct pg_request req, const char *name,
                                int nparams, const char *const *values, int result_format)
{
    if (obx_failpoints_active.entry[OBX_FP_MARK_BEFORE_COMMIT].action == OBX_FP_OFF)
        return start_prepared(pg, &req, name, nparams, values, result_format);
    req.tx = TX_BEGIN;
    req.sql = name;
    req.prepared = true;
    req.result_format = result_format;
    req.nparams = nparams;
    req.values = values;
    req.failpoint = OBX_FP_MARK_BEFORE_COMMIT;
    return start_request(pg, &req, "BEGIN", 0, NULL, 0);
}

int obx_pg_send_mark_fetch(struct obx_pg *pg, const struct obx_mark *m, const struct obx_fetch *f,
                           obx_pg_rows_fn done, void *arg)
{
    if (m->n_dead > 0 || !f->keyset || !f->snapshot)
        return 1;
    const char **values = pg->param_values;
    if (fetch_params(pg, f, true, values) != 0 ||
        mark_params(pg, m, OBX_MARK_FETCH_MARK, values) != 0)
        return -1;
    struct pg_request req = {.rows_done = done, .arg = arg, .tx = TX_NONE};
    return start_mark_statement(pg, req, STMT_MARK_FETCH, OBX_MARK_FETCH_NPARAMS, values, 1);
}

/* Log mode's cursor row (enum obx_cursor_param). */
static int send_log_write(struct obx_pg *pg, const struct obx_mark *m, obx_pg_done_fn done,
                          void *arg)
{
    const char **values = pg->param_values;
    snprintf(pg->batch_text, sizeof(pg->batch_text), "%lld", (long long)m->batch);
    snprintf(pg->hwm_text, sizeof(pg->hwm_text), "%lld", (long long)m->hwm);
    values[OBX_CURSOR_BATCH] = pg->batch_text;
    values[OBX_CURSOR_HWM] = pg->hwm_text;
    values[OBX_CURSOR_SNAPSHOT] = m->snapshot;
    values[OBX_CURSOR_RESTART] = m->restart ? "true" : "false";
    if (held_params(pg, m->held, m->n_held, m->also_sent, m->n_also, OBX_CURSOR_HELD, values) !=
            0 ||
        offsets_params(pg, m, OBX_CURSOR_OFFSETS, values) != 0 ||
        dead_params(pg, m, OBX_CURSOR_DEAD, values) != 0)
        return -1;
    slots_params(pg, m->shards, m->owned_slots, OBX_CURSOR_SLOTS, values);
    struct pg_request req = {.done = done, .arg = arg, .tx = TX_NONE};
    return start_mark_statement(pg, req, STMT_MARK, OBX_CURSOR_NPARAMS, values, 0);
}

int obx_pg_send_mark(struct obx_pg *pg, const struct obx_mark *m, obx_pg_done_fn done, void *arg)
{
    const char **values = pg->param_values;
    if (m->log)
        return send_log_write(pg, m, done, arg);
    if (mark_params(pg, m, 0, values) != 0 || dead_params(pg, m, OBX_MARK_DEAD, values) != 0)
        return -1;
    /* The mark is one statement, so on its own it is one transaction: one
     * round trip instead of three. */
    struct pg_request req = {.done = done, .arg = arg, .tx = TX_NONE};
    if (m->n_dead == 0)
        return start_mark_statement(pg, req, STMT_MARK_PLAIN, OBX_MARK_PLAIN_NPARAMS, values, 0);
    return start_mark_statement(pg, req, STMT_MARK, OBX_MARK_NPARAMS, values, 0);
}

uint64_t obx_pg_reconnects(const struct obx_pg *pg)
{
    return pg->reconnects;
}

uint64_t obx_pg_history_changes(const struct obx_pg *pg)
{
    return pg->history_changes;
}

long obx_pg_timeline(const struct obx_pg *pg)
{
    return pg->ready_timeline;
}

const struct obx_histogram *obx_pg_batch_rows(const struct obx_pg *pg)
{
    return &pg->batch_rows;
}
