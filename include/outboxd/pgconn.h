/*
 * pgconn: how every outboxd connection to Postgres is opened. Our defaults
 * come first and the user's conninfo after them, as libpq's "dbname", which
 * libpq expands in place: any key the user sets wins. The defaults:
 * application_name, TCP keepalives (30 s idle, 3 probes 10 s apart), and
 * target_session_attrs=read-write, so that with several hosts (host=a,b)
 * libpq skips a hot standby and tries the next at once; connect_timeout
 * when one is asked for (libpq ignores it for a non-blocking connect).
 */
#ifndef OUTBOXD_PGCONN_H
#define OUTBOXD_PGCONN_H

#include <stddef.h>

#include <libpq-fe.h>

struct obx_pg_params {
    const char *keys[10];
    const char *values[10];
    char timeout[16];
};

/* Fills p for PQconnectdbParams/PQconnectStartParams(p->keys, p->values, 1).
 * conninfo and application_name must outlive p's use; timeout_s 0 = none. */
void obx_pg_params(struct obx_pg_params *p, const char *conninfo, const char *application_name,
                   int timeout_s);

/* A blocking connection with those defaults; check PQstatus(). NULL only
 * when libpq is out of memory. */
PGconn *obx_pg_connect(const char *conninfo, const char *application_name, int timeout_s);

/* What sits between a connection and its server. A pooler (PgBouncer,
 * Pgpool, a cloud proxy) announces a backend pid of its own at login, so
 * PQbackendPID() differs from the server's pg_backend_pid(). In session
 * pooling the client keeps one server session until it disconnects; in
 * transaction (or statement) pooling the session goes back to the pool
 * after each transaction, and with it the relay lock (a session-level
 * advisory lock: a second relay handed the same session holds it too),
 * the prepared statements and log mode's snapshots. */
enum obx_pooling {
    OBX_POOLING_NONE,    /* the connection is the server session */
    OBX_POOLING_SESSION, /* a pooler, and a second client got another session */
    OBX_POOLING_SHARED,  /* a pooler gave a second client this connection's session */
    OBX_POOLING_UNKNOWN, /* a pooler; the probe got no answer in time */
};

/* Tells which, for `conn` (idle, outside a transaction) whose server
 * session is `backend_pid` (pg_backend_pid(), read through it). Behind a
 * pooler, opens a second connection to `conninfo` and asks its session:
 * a transaction pooler hands the idle session on (PgBouncer takes the
 * session released last); a session pooler cannot. Blocks for at most
 * about `timeout_s` seconds twice (connecting, then asking). A pooler
 * serving other clients at that instant may hand them the session first,
 * so SESSION is "not seen shared", and the relay still refuses a session
 * that changes under it later (a prepared statement gone: pg.c). */
#define OBX_PG_POOL_PROBE_S 2 /* the probe's timeout_s in outboxd */
enum obx_pooling obx_pg_pooling(PGconn *conn, int backend_pid, const char *conninfo,
                                const char *application_name, int timeout_s);

/* The one-line reason the relay refuses transaction pooling. */
void obx_pg_pooling_problem(char *buf, size_t len);

#endif
