/*
 * pgconn: see include/outboxd/pgconn.h.
 */
#include "outboxd/pgconn.h"

#include <stdio.h>

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
