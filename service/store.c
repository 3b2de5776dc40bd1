/*
 * store: see include/outboxd/store.h.
 */
#include "outboxd/store.h"
#include "outboxd/config.h"

#include <stdarg.h>
#include <stdio.h>

/* Migration file for each schema version, for the "apply this" message. */
static const char *const migrations[] = {
    [1] = "sql/001_outbox.sql",
    [2] = "sql/002_recovery.sql",
    [3] = "sql/003_reserved_header.sql",
};
_Static_assert(sizeof(migrations) / sizeof(migrations[0]) == OBX_SCHEMA_VERSION + 1,
               "every schema version up to OBX_SCHEMA_VERSION names its migration file");

const char *obx_store_next_migration(long version)
{
    if (version < 0)
        version = 0;
    return version < OBX_SCHEMA_VERSION ? migrations[version + 1] : NULL;
}

int obx_store_schema_problem(long version, const char *db, char *buf, size_t len)
{
    char where[160];
    if (version >= OBX_SCHEMA_VERSION)
        return 0;
    if (db)
        snprintf(where, sizeof(where), "database %s", db);
    else
        snprintf(where, sizeof(where), "this database");
    if (version < 0)
        snprintf(buf, len,
                 "outbox schema not found in %s: apply %s and the later files in sql/ in order "
                 "(psql -v ON_ERROR_STOP=1 -f %s ...)",
                 where, migrations[1], migrations[1]);
    else
        snprintf(buf, len,
                 "outbox schema is at version %ld, this outboxd needs %d: apply %s and the "
                 "later files in sql/ (%s)",
                 version, OBX_SCHEMA_VERSION, obx_store_next_migration(version), where);
    return -1;
}

/* The fetch: committed unsent rows in id order, skipping rows in flight.
 * Postgres splits the headers object into two text[] (keys, values; string
 * values verbatim, other JSON values as JSON text), so C never parses JSON.
 * Rows of transactions that commit late (lower ids) are found by the next
 * fetch: nothing is skipped because a higher id was seen first.
 *
 * Memory is bounded by bytes as well as rows: a payload larger than $7
 * (the producer's message.max.bytes) is not fetched at all, only its
 * octet_length (which reads the TOAST pointer, not the value), and the
 * batch ends once its payloads reach $6 bytes (at least one row). */
static const char SQL_FETCH[] =
    "SELECT b.id, b.topic, b.key, b.payload, b.keys, b.vals, b.created_at, b.payload_len"
    " FROM (SELECT e.id, e.topic, e.key,"
    "         CASE WHEN octet_length(e.payload) <= $7::int THEN e.payload END AS payload,"
    "         h.keys, h.vals, e.created_at, octet_length(e.payload) AS payload_len,"
    "         sum(CASE WHEN octet_length(e.payload) <= $7::int THEN octet_length(e.payload)"
    "             ELSE 0 END) OVER (ORDER BY e.id ROWS UNBOUNDED PRECEDING) AS upto,"
    "         row_number() OVER (ORDER BY e.id) AS n"
    "  FROM outbox.events e"
    "  LEFT JOIN LATERAL ("
    "    SELECT array_agg(j.k ORDER BY j.k COLLATE \"C\") AS keys,"
    "           array_agg(CASE jsonb_typeof(j.v) WHEN 'string' THEN j.v #>> '{}'"
    "                     ELSE j.v::text END ORDER BY j.k COLLATE \"C\") AS vals"
    "    FROM jsonb_each(CASE jsonb_typeof(e.headers) WHEN 'object' THEN e.headers END)"
    "         AS j(k, v)) h ON true"
    "  WHERE e.sent_at IS NULL AND NOT (e.id = ANY ($1::bigint[]))"
    /* Rows of a key held back behind a refused row (relay.on_reject = retry). */
    "    AND (cardinality($3::text[]) = 0 OR e.key IS NULL OR NOT EXISTS ("
    "         SELECT FROM unnest($3::text[], $4::text[], $5::bigint[]) AS b(topic, key, id)"
    "         WHERE b.topic = e.topic AND b.key = e.key AND e.id > b.id))"
    "  ORDER BY e.id"
    "  LIMIT $2::int) b"
    " WHERE b.n = 1 OR b.upto <= $6::bigint"
    " ORDER BY b.id";

const char *obx_store_sql_fetch(void)
{
    return SQL_FETCH;
}

/* Each partition's highest acknowledged offset, for crash recovery; never
 * moves back. %d: the first of its three parameters (topic, partition,
 * offset arrays). */
#define OFFSETS_UPSERT_FMT                                                                         \
    " offsets AS ("                                                                                \
    "   INSERT INTO outbox.kafka_offsets AS k (topic, kafka_partition, last_offset)"               \
    "   SELECT * FROM unnest($%d::text[], $%d::int[], $%d::bigint[])"                              \
    "   ON CONFLICT (topic, kafka_partition) DO UPDATE"                                            \
    "     SET last_offset = greatest(k.last_offset, excluded.last_offset), updated_at = now()"     \
    "   RETURNING 1)"

/* How rows are confirmed, for the ids selected by %s: sent_at set (mark
 * mode), or the row deleted (delete mode). */
#define CONFIRM_MARK_FMT                                                                           \
    "UPDATE outbox.events SET sent_at = now() WHERE %s AND sent_at IS NULL RETURNING id"
#define CONFIRM_DELETE_FMT "DELETE FROM outbox.events WHERE %s RETURNING id"

/* Appends to buf at *o (truncating safely; the buffers are sized for the
 * statements). */
__attribute__((format(printf, 4, 5))) static void append(char *buf, size_t len, size_t *o,
                                                         const char *fmt, ...)
{
    va_list ap;
    if (*o >= len)
        return;
    va_start(ap, fmt);
    int n = vsnprintf(buf + *o, len - *o, fmt, ap);
    va_end(ap);
    if (n > 0)
        *o += (size_t)n;
}

static void append_confirm(char *buf, size_t len, size_t *o, int on_sent, const char *which)
{
    append(buf, len, o, on_sent == OBX_ON_SENT_DELETE ? CONFIRM_DELETE_FMT : CONFIRM_MARK_FMT,
           which);
}

const char *obx_store_sql_mark(int on_sent, char *buf, size_t len)
{
    /* Acknowledged rows confirmed, offsets stored, refused rows moved to
     * dead_letters: one statement, run inside BEGIN ... COMMIT. */
    size_t o = 0;
    append(buf, len, &o, "WITH confirmed AS (");
    append_confirm(buf, len, &o, on_sent, "id = ANY ($1::bigint[])");
    append(buf, len, &o, ")," OFFSETS_UPSERT_FMT ",", 2, 3, 4);
    append(buf, len, &o,
           " dead AS ("
           "   DELETE FROM outbox.events e USING unnest($5::bigint[], $6::text[]) AS d(id, reason)"
           "   WHERE e.id = d.id AND e.sent_at IS NULL"
           "   RETURNING e.id, e.topic, e.key, e.payload, e.headers, e.created_at, d.reason),"
           " buried AS ("
           "   INSERT INTO outbox.dead_letters (id, topic, key, payload, headers, created_at,"
           "                                    reason)"
           "   SELECT * FROM dead ON CONFLICT (id) DO NOTHING RETURNING 1)"
           " SELECT (SELECT count(*) FROM confirmed), (SELECT count(*) FROM offsets),"
           "        (SELECT count(*) FROM buried)");
    return buf;
}

const char *obx_store_sql_recover(int on_sent, char *buf, size_t len)
{
    size_t o = 0;
    append(buf, len, &o,
           "WITH found AS ("
           "   SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[])"
           "     AS f(id, topic, key, digest)),"
           " matched AS ("
           "   SELECT DISTINCT e.id FROM outbox.events e JOIN found f ON f.id = e.id"
           "   WHERE e.sent_at IS NULL AND e.topic = f.topic AND e.key IS NOT DISTINCT FROM f.key"
           "     AND encode(sha256(e.payload), 'hex') IS NOT DISTINCT FROM f.digest),"
           " confirmed AS (");
    append_confirm(buf, len, &o, on_sent, "id IN (SELECT id FROM matched)");
    append(buf, len, &o, ")," OFFSETS_UPSERT_FMT, 5, 6, 7);
    append(buf, len, &o,
           " SELECT (SELECT count(*) FROM confirmed), (SELECT count(*) FROM found),"
           "        (SELECT count(*) FROM offsets)");
    return buf;
}

const char *obx_store_sql_recovery_plan(void)
{
    /* A record outside [lo, hi] cannot match any unsent row. */
    return "SELECT t.topic, k.kafka_partition, k.last_offset, r.lo, r.hi"
           " FROM (SELECT DISTINCT topic FROM outbox.events WHERE sent_at IS NULL) t"
           " CROSS JOIN (SELECT min(id) AS lo, max(id) AS hi FROM outbox.events"
           "             WHERE sent_at IS NULL) r"
           " LEFT JOIN outbox.kafka_offsets k ON k.topic = t.topic"
           " ORDER BY 1, 2";
}

const char *obx_store_sql_backlog(void)
{
    return "SELECT (SELECT count(*) FROM outbox.events WHERE sent_at IS NULL),"
           "       coalesce((SELECT extract(epoch FROM now() - created_at)::float8"
           "                 FROM outbox.events WHERE sent_at IS NULL ORDER BY id LIMIT 1), 0)";
}

const char *obx_store_sql_waiting(void)
{
    return "SELECT topic, count(*) FROM outbox.events"
           " WHERE sent_at IS NULL GROUP BY topic ORDER BY 2 DESC";
}

const char *obx_store_sql_purge(void)
{
    return "WITH batch AS ("
           "   SELECT id, created_at FROM outbox.events WHERE id > $1::bigint ORDER BY id"
           "   LIMIT $2::int),"
           " doomed AS ("
           "   DELETE FROM outbox.events e USING batch b"
           "   WHERE e.id = b.id AND e.sent_at < now() - $3::bigint * interval '1 millisecond'"
           "   RETURNING e.id)"
           " SELECT (SELECT max(id) FROM batch), (SELECT count(*) FROM doomed),"
           "        (SELECT count(*) FROM batch"
           "         WHERE created_at >= now() - $3::bigint * interval '1 millisecond')";
}
