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

#endif
