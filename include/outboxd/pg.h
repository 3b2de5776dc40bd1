/*
 * pg: one asynchronous Postgres connection on the libuv loop, and the outbox
 * statements sent over it.
 *
 * Non-blocking libpq (PQconnectStartParams/PQconnectPoll, PQsendQueryParams,
 * PQconsumeInput, PQflush) watched by a uv_poll on PQsocket(). The connection
 * is a state machine; the one function that moves it logs old -> new. When a
 * connection fails or is lost it is retried after a capped, jittered,
 * doubling back-off, for ever: outboxd never needs a manual reset.
 *
 * After connecting, setup checks the outbox schema version, that the server
 * is a primary and the id cache, sets statement_timeout, prepares the
 * cycle's statements and tries the relay lock; once it holds the lock it
 * repairs rows written with another cluster's xid (sql/006). While
 * another outboxd holds it, the connection stands by idle (no statement, so
 * no snapshot pins the xmin horizon) and tries again every
 * OBX_PG_STANDBY_POLL_MS; once it holds the lock it is READY.
 *
 * Requests carry their own completion callback; nothing is ever called back
 * from inside an obx_pg_* call.
 */
#ifndef OUTBOXD_PG_H
#define OUTBOXD_PG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <libpq-fe.h>
#include <uv.h>

#include "outboxd/buf.h"
#include "outboxd/config.h"
#include "outboxd/metrics.h"
#include "outboxd/record.h"
#include "outboxd/relay.h"
#include "outboxd/store.h"

/* The relay lock: a session-level advisory lock (space 'obxr', key 0) that
 * only the active relay of a database holds. A second outboxd started on
 * the same outbox (a rolling update, a mistake) stands by until the first
 * one's session ends, so two relays never publish the same rows. The space
 * differs from enqueue()'s per-key locks ('obxd'). */
#define OBX_RELAY_LOCK "1868724338, 0"

/* The connection's state machine. One function changes it (pg.c
 * change_state), logs old -> new and refuses impossible moves. */
enum obx_pg_state {
    OBX_PG_DISCONNECTED = 0, /* no connection; reconnect timer armed */
    OBX_PG_CONNECTING,       /* PQconnectPoll in progress */
    OBX_PG_SETUP,            /* schema and recovery check, SETs, prepares in flight */
    OBX_PG_LOCKING,          /* pg_try_advisory_lock(relay lock) in flight */
    OBX_PG_STANDBY,          /* another outboxd holds the lock: idle (no snapshot), the
                              * lock is tried again every OBX_PG_STANDBY_POLL_MS */
    OBX_PG_READY,            /* holds the relay lock; idle */
    OBX_PG_BUSY,             /* one request in flight */
    OBX_PG_CLOSED,           /* obx_pg_close() was called */
};

/* How often a standby tries the relay lock: bounds the takeover time. */
#define OBX_PG_STANDBY_POLL_MS 250

struct obx_pg_callbacks {
    /* Connection set up, relay lock held, idle. Fires again after every
     * reconnect (each is a new acquisition of the lock). */
    void (*ready)(void *arg);
    /* A connection that had fired `ready` is gone: any request in flight is
     * dropped without its callback, and the relay lock is lost. Fires on a
     * later loop turn than the event that broke the connection, never from
     * inside an obx_pg_* call. A reconnect is already scheduled. */
    void (*lost)(void *arg);
};

/* Completion of one request: `res` on success (valid during the call), or
 * `error` (one line from Postgres or from us) with res NULL. The connection
 * is READY again before the call, so the callback may send the next
 * request. */
typedef void (*obx_pg_done_fn)(void *arg, const PGresult *res, const char *error);
/* Completion of a fetch: the rows decoded and the statement's snapshot
 * (borrowed; valid during the call), or `error` with rows NULL. */
typedef void (*obx_pg_rows_fn)(void *arg, const struct obx_row *rows, size_t n,
                               const char *snapshot, const char *error);

struct obx_pg;

/* Copies what it needs from cfg. Does not connect yet. */
int obx_pg_new(uv_loop_t *loop, const struct obx_config *cfg, const struct obx_pg_callbacks *cb,
               void *arg, struct obx_pg **out, char *err, size_t errlen) OBX_WARN_UNUSED;
/* Starts connecting (then reconnects by itself). */
void obx_pg_start(struct obx_pg *pg);
/* Closes the connection and its handles; the struct is freed by the loop.
 * No callback fires afterwards. */
void obx_pg_close(struct obx_pg *pg);

enum obx_pg_state obx_pg_state(const struct obx_pg *pg);
const char *obx_pg_state_name(enum obx_pg_state s);
/* Connected, but another outboxd holds the relay lock. */
bool obx_pg_standby(const struct obx_pg *pg);
/* READY or BUSY: holds the relay lock on a live session (as far as we know). */
bool obx_pg_usable(const struct obx_pg *pg);
/* The history of the session's server, "SYSTEM_ID.TIMELINE" (the
 * outbox-history header), or "" when the server would not tell. */
const char *obx_pg_history(const struct obx_pg *pg);
/* The session's database as its server names it (current_database(), not
 * the connection string's name, which a pooler may alias); "" when the
 * server would not tell its history. */
const char *obx_pg_dbname(const struct obx_pg *pg);
/* relay.shards = 1: the sessions ("12,34", or "") of relays with
 * relay.shards above 1 that lost slots without giving them back, as the
 * session's repair found them when it took the relay lock. */
const char *obx_pg_lost_slot_owners(const struct obx_pg *pg);

/* A growable text buffer holding a Postgres array literal ("{1,2}",
 * "{\"a\",NULL}") for a text-format parameter. */
struct obx_pg_array {
    struct obx_buf text;
    int count;
};
void obx_pg_array_reset(struct obx_pg_array *a);
void obx_pg_array_add_int(struct obx_pg_array *a, int64_t v);
/* The ids as {first, last} elements, one for each run of consecutive ids
 * (a two-dimensional array once finished; the mark's ranges). Sorts `ids`. */
void obx_pg_array_add_ranges(struct obx_pg_array *a, int64_t *ids, size_t n);
/* s NULL = a NULL element; otherwise quoted and escaped. */
void obx_pg_array_add_text(struct obx_pg_array *a, const char *s, size_t len);
/* Closes the literal; NULL if memory ran out on the way. */
const char *obx_pg_array_finish(struct obx_pg_array *a);
void obx_pg_array_free(struct obx_pg_array *a);

/* Requests. Each is sent only when READY; it returns 0 when sent, and then
 * its callback fires exactly once unless the connection is lost first (see
 * `lost`). It returns -1 when nothing was sent: the callback never fires
 * (libuv's rule), and if the connection broke, `lost` follows on a later
 * loop turn. */

/* One statement (text parameters; result_format 1 = binary). */
int obx_pg_send(struct obx_pg *pg, const char *sql, int nparams, const char *const *values,
                int result_format, obx_pg_done_fn done, void *arg) OBX_WARN_UNUSED;
/* One statement inside BEGIN ... COMMIT; the result reported is the
 * statement's, after COMMIT succeeded. Failpoint `failpoint` (an enum
 * obx_fp_id, or -1) is reached between the statement and COMMIT. `values`
 * must stay valid until the callback. */
int obx_pg_send_tx(struct obx_pg *pg, const char *sql, int nparams, const char *const *values,
                   int failpoint, obx_pg_done_fn done, void *arg) OBX_WARN_UNUSED;

/* The fetch: unsent rows in id order as `f` says, decoded into rows. */
int obx_pg_send_fetch(struct obx_pg *pg, const struct obx_fetch *f, obx_pg_rows_fn done,
                      void *arg) OBX_WARN_UNUSED;
/* The plain mark and the keyset fetch as one statement (see
 * obx_store_sql_mark_fetch). 1: they cannot go together (dead letters, a
 * full fetch): nothing was sent. */
int obx_pg_send_mark_fetch(struct obx_pg *pg, const struct obx_mark *m, const struct obx_fetch *f,
                           obx_pg_rows_fn done, void *arg);
/* The mark transaction: confirm m->ids (set sent_at, or delete in delete
 * mode), store each partition's last offset, move dead rows to
 * outbox.dead_letters. */
int obx_pg_send_mark(struct obx_pg *pg, const struct obx_mark *m, obx_pg_done_fn done,
                     void *arg) OBX_WARN_UNUSED;

/* Checks that `conninfo` parses; on error writes a sentence without any of
 * its values (it may hold a password). */
int obx_pg_check_conninfo(const char *conninfo, char *err, size_t errlen) OBX_WARN_UNUSED;

/* For /metrics: connection attempts after the first; rows per fetch. */
uint64_t obx_pg_reconnects(const struct obx_pg *pg);
/* Sessions that found their server on another history (system identifier
 * or timeline) than the last ready session's. */
uint64_t obx_pg_history_changes(const struct obx_pg *pg);
/* The timeline of the last ready session's server (0 before the first). */
long obx_pg_timeline(const struct obx_pg *pg);
const struct obx_histogram *obx_pg_batch_rows(const struct obx_pg *pg);

#endif
