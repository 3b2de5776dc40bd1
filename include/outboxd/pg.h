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
 * After connecting, setup checks the outbox schema version, LISTENs on the
 * wake-up channel and sets statement_timeout; only then is it READY.
 */
#ifndef OUTBOXD_PG_H
#define OUTBOXD_PG_H

#include <stddef.h>
#include <stdint.h>

#include <libpq-fe.h>
#include <uv.h>

#include "outboxd/config.h"

/* The newest migration in sql/ that this binary needs. */
#define OBX_SCHEMA_VERSION 1
/* NOTIFY channel used by outbox.enqueue(). */
#define OBX_NOTIFY_CHANNEL "outboxd"

enum obx_pg_state {
    OBX_PG_DISCONNECTED = 0, /* no connection; reconnect timer armed */
    OBX_PG_CONNECTING,       /* PQconnectPoll in progress */
    OBX_PG_SETUP,            /* schema check, LISTEN, SET in flight */
    OBX_PG_READY,            /* usable and idle */
    OBX_PG_BUSY,             /* one statement of the relay in flight */
    OBX_PG_CLOSED,           /* obx_pg_close() was called */
};

struct obx_pg_callbacks {
    /* Connection set up and idle. */
    void (*ready)(void *arg);
    /* A READY or BUSY connection was lost; a statement in flight has no
     * result. A reconnect is already scheduled. */
    void (*lost)(void *arg);
    /* The result of the statement in flight. `res` is freed when the callback
     * returns. The connection is READY again before the call, so the callback
     * may send the next statement. */
    void (*result)(PGresult *res, void *arg);
    /* A NOTIFY arrived on the wake-up channel. */
    void (*notify)(void *arg);
};

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

/* Sends the fetch statement: up to `limit` unsent rows in id order, none of
 * `exclude`. Binary results, columns as in record.h. Only when READY.
 * Returns 0, or -1 if nothing was sent; if the connection broke, it is
 * dropped and `lost` has fired before this returns. */
int obx_pg_send_fetch(struct obx_pg *pg, const int64_t *exclude, size_t n_exclude, int limit);
/* Sends the statement that marks `ids` sent (or deletes them). */
int obx_pg_send_mark(struct obx_pg *pg, const int64_t *ids, size_t n);

/* Checks that `conninfo` parses; on error writes a sentence without any of
 * its values (it may hold a password). */
int obx_pg_check_conninfo(const char *conninfo, char *err, size_t errlen) OBX_WARN_UNUSED;

#endif
