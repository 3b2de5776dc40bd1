/*
 * pgconn: see include/outboxd/pgconn.h.
 */
#include "outboxd/pgconn.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

void obx_pg_params(struct obx_pg_params *p, const char *conninfo, const char *application_name,
                   int timeout_s)
{
    int n = 0;
    p->keys[n] = "application_name";
    p->values[n++] = application_name;
    p->keys[n] = "keepalives_idle";
    p->values[n++] = "30";
    p->keys[n] = "keepalives_interval";
    p->values[n++] = "10";
    p->keys[n] = "keepalives_count";
    p->values[n++] = "3";
    p->keys[n] = "target_session_attrs";
    p->values[n++] = "read-write";
    if (timeout_s > 0) {
        snprintf(p->timeout, sizeof(p->timeout), "%d", timeout_s);
        p->keys[n] = "connect_timeout";
        p->values[n++] = p->timeout;
    }
    p->keys[n] = "dbname"; /* the user's conninfo, expanded here, wins over the above */
    p->values[n++] = conninfo;
    /* ... but not over this: keys, topics and headers leave in UTF-8 (the
     * contract), and the recovery pass compares what it reads in Kafka
     * with rows as the server gives them. Unpinned, libpq would take the
     * database's encoding (LATIN1, say) or PGCLIENTENCODING. */
    p->keys[n] = "client_encoding";
    p->values[n++] = "UTF8";
    p->keys[n] = NULL;
    p->values[n] = NULL;
}

PGconn *obx_pg_connect(const char *conninfo, const char *application_name, int timeout_s)
{
    struct obx_pg_params p;
    obx_pg_params(&p, conninfo, application_name, timeout_s);
    return PQconnectdbParams(p.keys, p.values, 1);
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* pg_backend_pid() of a second connection, or -1: no answer within
 * timeout_s (a session pooler with every session taken makes a new client
 * wait for one) or an error. */
static long probe_backend_pid(const char *conninfo, const char *application_name, int timeout_s)
{
    long pid = -1;
    /* Our timeout after the user's conninfo, so that it wins: the probe
     * blocks the relay's loop (connect_timeout=0 would wait for ever). */
    struct obx_pg_params p;
    obx_pg_params(&p, conninfo, application_name, 0);
    char timeout[16];
    snprintf(timeout, sizeof(timeout), "%d", timeout_s);
    int n = 0;
    while (p.keys[n])
        n++;
    p.keys[n] = "connect_timeout";
    p.values[n] = timeout;
    p.keys[n + 1] = p.values[n + 1] = NULL;
    PGconn *c = PQconnectdbParams(p.keys, p.values, 1);
    if (!c || PQstatus(c) != CONNECTION_OK || PQsetnonblocking(c, 1) != 0 ||
        !PQsendQuery(c, "SELECT pg_backend_pid()")) {
        PQfinish(c);
        return -1;
    }
    long long deadline = now_ms() + (long long)timeout_s * 1000;
    for (;;) {
        int unsent = PQflush(c);
        if (unsent < 0 || (unsent == 0 && !PQisBusy(c)))
            break;
        long long left = deadline - now_ms();
        struct pollfd pfd = {.fd = PQsocket(c), .events = unsent ? POLLIN | POLLOUT : POLLIN};
        int ready = left > 0 ? poll(&pfd, 1, (int)left) : 0;
        if (ready < 0 && errno == EINTR)
            continue;
        if (ready <= 0 || !PQconsumeInput(c))
            break;
    }
    if (!PQisBusy(c)) {
        PGresult *res = PQgetResult(c);
        if (PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1)
            pid = strtol(PQgetvalue(res, 0, 0), NULL, 10);
        PQclear(res);
    }
    PQfinish(c); /* a query still waiting is dropped with the connection */
    return pid;
}

enum obx_pooling obx_pg_pooling(PGconn *conn, int backend_pid, const char *conninfo,
                                const char *application_name, int timeout_s)
{
    if (PQbackendPID(conn) == backend_pid)
        return OBX_POOLING_NONE;
    long other = probe_backend_pid(conninfo, application_name, timeout_s);
    if (other < 0)
        return OBX_POOLING_UNKNOWN;
    return other == backend_pid ? OBX_POOLING_SHARED : OBX_POOLING_SESSION;
}

void obx_pg_pooling_problem(char *buf, size_t len)
{
    snprintf(buf, len,
             "the connection goes through a connection pooler in transaction (or statement) "
             "pooling, which hands its server session to other clients between transactions; "
             "the relay lock, prepared statements and snapshots live in that session: point "
             "postgres.conninfo at Postgres itself or at a pool in session pooling (PgBouncer: "
             "pool_mode = session)");
}
