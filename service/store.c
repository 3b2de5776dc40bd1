/*
 * store: see include/outboxd/store.h.
 */
#include "outboxd/store.h"
#include "outboxd/buf.h"
#include "outboxd/config.h"
#include "outboxd/log.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

/* Migration file for each schema version, for the "apply this" message. */
/* clang-format off */
static const char *const migrations[] = {
    [1] = "sql/001_outbox.sql",
    [2] = "sql/002_recovery.sql",
    [3] = "sql/003_reserved_header.sql",
    [4] = "sql/004_fetch_cursor.sql",
    [5] = "sql/005_no_notify.sql",
    [6] = "sql/006_writer_xid.sql",
    [7] = "sql/007_partitions.sql",
    [8] = "sql/008_shards.sql",
    [9] = "sql/009_log_slots.sql",
    [10] = "sql/010_log_newest.sql",
    [11] = "sql/011_history.sql",
    [12] = "sql/012_history_header.sql",
    [13] = "sql/013_unfenced_owners.sql",
    [14] = "sql/014_log_floor_after_change.sql",
    [15] = "sql/015_log_cursor_rebase.sql",
    [16] = "sql/016_topic_names_row_bytes.sql",
};
/* clang-format on */

static int column(const PGresult *res, const char *name)
{
    int k = PQfnumber(res, name);
    if (k < 0)
        OBX_BUG("a statement's result has no column %s", name);
    return k;
}

const char *obx_store_col(const PGresult *res, int row, const char *name)
{
    int k = column(res, name);
    return k < 0 ? "" : PQgetvalue(res, row, k);
}

bool obx_store_col_null(const PGresult *res, int row, const char *name)
{
    int k = column(res, name);
    return k < 0 || PQgetisnull(res, row, k);
}

bool obx_store_col_true(const PGresult *res, int row, const char *name)
{
    return strcmp(obx_store_col(res, row, name), "t") == 0;
}
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

int obx_store_id_cache_problem(long cache, char *buf, size_t len)
{
    if (cache <= 1)
        return 0;
    snprintf(buf, len,
             "outbox.events draws ids %ld at a time per session (its identity has CACHE %ld): a "
             "later commit of a key can then hold a lower id, and per-key order is lost; set it "
             "back with ALTER TABLE outbox.events ALTER COLUMN id SET CACHE 1",
             cache, cache);
    return -1;
}

/* The fetches: committed unsent rows in id order. The headers object comes
 * as it is stored (jsonb, binary: its text): splitting it is C's work
 * (record.c), not a per-row jsonb_each here.
 *
 * Memory is bounded by bytes as well as rows without a running sum: a row
 * whose key, payload and headers take more than $6 bytes as stored (the
 * relay passes fetch_max_bytes / limit, or the producer's limit when it
 * asks for one row) comes without its payload and headers (which are
 * never NULL in a row: oversize). Every row comes with that size, so the
 * relay sizes the next fetch by the measure this one used.
 * outbox.row_bytes() (sql/016, inlined) reads TOAST pointers, not values,
 * but for compressed headers. So a batch holds at most limit x $6 bytes of
 * rows as stored, and of an oversize row only its key.
 *
 * Each result has one more row, without an id, that carries the statement's
 * snapshot: what the next keyset fetch asks about (see relay.c, "cursor"),
 * and in its topic column the session's OBX_STORE_SESSION_SETTING (pg.c
 * compares it with the one its set-up set). */
#define FETCH_SELECT                                                                               \
    "SELECT b.id, b.topic, b.key, b.payload, b.headers, b.created_at, b.row_bytes, b.snap,"        \
    "       b.slot"
#define FETCH_SNAPSHOT_ROW                                                                         \
    " FROM (SELECT NULL::bigint AS id,"                                                            \
    "         current_setting('" OBX_STORE_SESSION_SETTING "', true) AS topic,"                    \
    "         NULL::text AS key,"                                                                  \
    "         NULL::bytea AS payload, NULL::jsonb AS headers, NULL::timestamptz AS created_at,"    \
    "         NULL::bigint AS row_bytes, pg_current_snapshot()::text AS snap, NULL::int AS slot"   \
    "       UNION ALL"
/* A row's key, payload and headers in bytes (sql/016). */
#define ROW_BYTES(t) "outbox.row_bytes(" t ".key, " t ".payload, " t ".headers)"
/* The last column is the row's slot: NULL but in log mode's exact fetch
 * with slots, whose partial checkpoints (relay.c, cursor_advance) cover only the
 * rows of some slots. One clause a line; clang-format would pack them. */
/* clang-format off */
#define FETCH_COLUMNS_SLOT(t, max_bytes, slot)                                                     \
    " SELECT " t ".id, " t ".topic, " t ".key,"                                                    \
    "   CASE WHEN " ROW_BYTES(t) " <= " max_bytes "::int THEN " t ".payload END,"                  \
    "   CASE WHEN " ROW_BYTES(t) " <= " max_bytes "::int THEN " t ".headers END,"                  \
    "   " t ".created_at,"                                                                         \
    "   " ROW_BYTES(t) ","                                                                         \
    "   NULL::text, " slot
/* clang-format on */
#define FETCH_COLUMNS(t, max_bytes) FETCH_COLUMNS_SLOT(t, max_bytes, "NULL::int")
/* The rows held back behind a refused row (relay.on_reject = retry), from
 * the parameters `topics`, `keys`, `ids` (a NULL key: the topic refused
 * its row, and holds every later row of the topic) as two maps a row looks
 * itself up in, each with the lowest id that holds it: `topics` (topic to
 * id) and `keys` (topic to key to id). A jsonb object is searched by
 * halves: tested against the arrays, every candidate row cost a walk of
 * every entry (2 s a fetch with 20,000 keys held). A CTE, so a statement
 * builds them once, and only when a row is looked up (see FETCH_HELD_BACK).
 * A NULL topic or id, which the relay never passes, is left out, as it
 * matched nothing before: jsonb_object_agg refuses a NULL name. */
#define HELD_MAPS(topics, keys, ids)                                                               \
    "held AS MATERIALIZED (SELECT"                                                                 \
    "  (SELECT jsonb_object_agg(w.topic, w.id)"                                                    \
    "     FROM (SELECT h.topic, min(h.id) AS id"                                                   \
    "             FROM unnest(" topics "::text[], " keys "::text[], " ids "::bigint[])"            \
    "               AS h(topic, key, id)"                                                          \
    "            WHERE h.key IS NULL AND h.topic IS NOT NULL GROUP BY h.topic) w) AS topics,"      \
    "  " KEY_MAP(topics "::text[]", keys "::text[]", ids "::bigint[]") " AS keys)"
/* Of arrays of topics, keys and ids: topic to key to the lowest id, the
 * NULL keys left out (HELD_MAPS, RULE_MAPS). */
#define KEY_MAP(topics, keys, ids)                                                                 \
    "(SELECT jsonb_object_agg(w.topic, w.keys)"                                                    \
    "   FROM (SELECT k.topic, jsonb_object_agg(k.key, k.id) AS keys"                               \
    "           FROM (SELECT h.topic, h.key, min(h.id) AS id"                                      \
    "                   FROM unnest(" topics ", " keys ", " ids ") AS h(topic, key, id)"           \
    "                  WHERE h.key IS NOT NULL AND h.topic IS NOT NULL"                            \
    "                  GROUP BY h.topic, h.key) k"                                                 \
    "          GROUP BY k.topic) w)"
/* Not a row held back (see HELD_MAPS): a later row than the one that holds
 * its key, or its topic. With nothing held back (`topics` empty) the OR
 * stops at its first test and the maps are never built. A NULL key finds
 * nothing in `keys` (a path with a NULL in it). */
#define FETCH_HELD_BACK(t, topics)                                                                 \
    " AND (cardinality(" topics "::text[]) = 0 OR"                                                 \
    "      (" t ".id <= coalesce(((SELECT held.topics FROM held) ->> " t ".topic)::bigint,"        \
    "                            " MAX_BIGINT ")"                                                  \
    "       AND " t ".id <= coalesce(((SELECT held.keys FROM held)"                                \
    "                                  #>> ARRAY[" t ".topic, " t ".key])::bigint,"                \
    "                                " MAX_BIGINT ")))"

/* Only rows of the relay's slots (relay.shards, sql/008): parameters
 * `shards` and `owned`; with owned NULL (one relay) the OR stops at its
 * first test, and slot_of() is never called. */
#define IN_SLOTS(t, shards, owned)                                                                 \
    " AND (" owned "::int[] IS NULL"                                                               \
    "      OR outbox.slot_of(" t ".key, " t ".id, " shards "::int) = ANY (" owned "::int[]))"

/* The lowest bigint, as a literal Postgres reads as one, and the highest. */
#define MIN_BIGINT "(-9223372036854775807 - 1)::bigint"
#define MAX_BIGINT "9223372036854775807::bigint"

/* One clause a line; clang-format would pack them. */
/* clang-format off */
/* Every unsent row but those in flight, whose ids come between the two
 * halves as a constant: Postgres hashes a constant array for = ANY, and
 * compares every candidate row with every element of a parameter. Its cost
 * grows with the rows in flight all the same: the relay runs it only when
 * rows below its cursor may be waiting. */
static const char SQL_FETCH_FULL_HEAD[] =
    "WITH " HELD_MAPS("$2", "$3", "$4")
    " " FETCH_SELECT FETCH_SNAPSHOT_ROW
    " (" FETCH_COLUMNS("e", "$5")
    "  FROM outbox.events e"
    "  WHERE e.sent_at IS NULL AND NOT (e.id = ANY ('";
static const char SQL_FETCH_FULL_TAIL[] =
    "'::bigint[]))"
         FETCH_HELD_BACK("e", "$2") IN_SLOTS("e", "$6", "$7")
    "  ORDER BY e.id LIMIT $1::int)) b";

/* The keyset fetch: rows above $1 (the highest id handed out), and the rows
 * below it whose transaction snapshot $9 (the previous fetch's) did not see
 * as committed: late commits. Those are the transactions it lists as
 * running, and any that began after it (an INSERT draws its id a moment
 * before its transaction takes an xid). Each is a range of the (xid, id)
 * index, however many rows the transaction wrote above $1, and only the
 * transactions that have committed (or ended) since are looked at: a
 * transaction still open costs nothing however long it stays open. A
 * visible row whose xid this snapshot calls running or not yet begun was
 * written with another cluster's xid (sql/006 repairs those): it is left
 * out rather than handed out again at every fetch. Nothing in flight can be
 * among these rows, so nothing is excluded and the cost does not grow with
 * the rows in flight. The late
 * parts must not walk the ids up to $1, which means every row in flight
 * (the planner likes that path for its order and its LIMIT, and with stale
 * statistics any path looks cheap): LATERAL makes the running transactions
 * the outer side, a row comparison is a condition only the (xid, id) index
 * can take, and the order by (xid, id) is one only it gives (the session
 * plans with enable_sort off, store.h): for that the running transaction's
 * rows are asked for as `l.xid >= x.xid` and the row comparison, not
 * `l.xid = x.xid`, with which the (id) index gives that order too, and
 * under statistics that say nearly every row is sent the planner took it
 * (a walk of every entry below $1, 165 ms under a held horizon). The last part
 * has no LIMIT, which would cut it in (xid, id) order: its rows are few
 * (an INSERT that drew its id just before the snapshot, a dead letter put
 * back), and its index entries are read without a visit to the table. */
/* The keyset fetch's three parts (rows above $1; rows of the transactions
 * snapshot $9 saw running; rows of later ones), each with `ex(t)` as one
 * more condition on its table t, and only rows of the slots $7, $8. */
#define KEYSET_PARTS(ex)                                                                           \
    "(SELECT * FROM outbox.events u"                                                               \
    " WHERE u.sent_at IS NULL AND u.id > $1::bigint" ex("u")                                       \
        FETCH_HELD_BACK("u", "$3") IN_SLOTS("u", "$7", "$8")                           \
    " ORDER BY u.id LIMIT $2::int)"                                                                \
    " UNION ALL"                                                                                   \
    " (SELECT l.* FROM pg_snapshot_xip($9::pg_snapshot) AS x(xid),"                                \
    "    LATERAL (SELECT * FROM outbox.events l"                                                   \
    "             WHERE l.sent_at IS NULL AND l.xid >= x.xid"                                      \
    "               AND (l.xid, l.id) <= (x.xid, $1::bigint)" ex("l")                              \
                    FETCH_HELD_BACK("l", "$3") IN_SLOTS("l", "$7", "$8")               \
    "             ORDER BY l.xid, l.id LIMIT $2::int) l"                                           \
    "  WHERE pg_visible_in_snapshot(x.xid, pg_current_snapshot())"                                 \
    "  ORDER BY l.id + 0 LIMIT $2::int)"                                                           \
    " UNION ALL"                                                                                   \
    " (SELECT * FROM outbox.events n"                                                              \
    "  WHERE n.sent_at IS NULL AND n.id <= $1::bigint"                                             \
    "    AND (n.xid, n.id) >= (pg_snapshot_xmax($9::pg_snapshot), " MIN_BIGINT ")"                 \
    "    AND n.xid < pg_snapshot_xmax(pg_current_snapshot())" ex("n")                              \
        FETCH_HELD_BACK("n", "$3") IN_SLOTS("n", "$7", "$8")                           \
    "  ORDER BY n.xid, n.id)"
#define NOTHING_MORE(t) ""
/* The keyset fetch, its held maps apart for the mark that takes it along
 * (its WITH lists them after its own). */
#define KEYSET_HELD_MAPS HELD_MAPS("$3", "$4", "$5")
#define KEYSET_BODY                                                                                \
    FETCH_SELECT FETCH_SNAPSHOT_ROW                                                                \
    " (" FETCH_COLUMNS("e", "$6")                                                                  \
    "  FROM (" KEYSET_PARTS(NOTHING_MORE) ") e"                                                    \
    "  ORDER BY e.id LIMIT $2::int)) b"
static const char SQL_FETCH_KEYSET[] = "WITH " KEYSET_HELD_MAPS " " KEYSET_BODY;
/* clang-format on */

const char *obx_store_sql_fetch(struct obx_buf *sql, const char *in_flight)
{
    obx_buf_reset(sql);
    obx_buf_puts(sql, SQL_FETCH_FULL_HEAD);
    for (const char *c = in_flight; *c; c++) { /* "{1,-2,3}": nothing here ends the literal */
        if (*c != '{' && *c != '}' && *c != ',' && *c != '-' && (*c < '0' || *c > '9'))
            return NULL;
    }
    obx_buf_puts(sql, in_flight);
    obx_buf_puts(sql, SQL_FETCH_FULL_TAIL);
    return sql->oom ? NULL : sql->data;
}

const char *obx_store_sql_fetch_keyset(void)
{
    return SQL_FETCH_KEYSET;
}

/* ---- log mode ---- */

/* A cursor's held rules (the columns held_topics, held_keys, held_from and
 * also_sent of `src`: a key held from an id on, a NULL key holding that
 * one row, and rows of such keys published since) as three jsonb maps, the
 * columns of a LATERAL subquery m: r_keys (topic to key to the lowest id
 * held), r_lone (topic to the ids of rows held alone) and r_also (the ids
 * published since). A row looks itself up in them (HELD_ROW) by halves:
 * tested against the arrays, every row below the cursor cost a walk of
 * every rule (5.7 s for log mode's full fetch with 200 keys held). */
#define RULE_MAPS(src)                                                                             \
    " LATERAL (SELECT"                                                                             \
    "   " KEY_MAP(                                                                                 \
        src ".held_topics", src ".held_keys",                                                      \
        src ".held_from") " AS r_keys,"                                                            \
                          "   (SELECT jsonb_object_agg(w.topic, w.ids)"                            \
                          "      FROM (SELECT h.topic, jsonb_object_agg(h.id::text, true) AS ids"  \
                          "              FROM unnest(" src ".held_topics, " src ".held_keys, " src \
                          ".held_from)"                                                            \
                          "                AS h(topic, key, id)"                                   \
                          "             WHERE h.key IS NULL AND h.topic IS NOT NULL AND h.id IS "  \
                          "NOT NULL"                                                               \
                          "             GROUP BY h.topic) w) AS r_lone,"                           \
                          "   (SELECT jsonb_object_agg(a.id::text, true) FROM unnest(" src         \
                          ".also_sent) AS a(id)"                                                   \
                          "     WHERE a.id IS NOT NULL)"                                           \
                          "     AS r_also) m"
/* A row a cursor leaves out although it is at or below its hwm and
 * visible in its snapshot: a row of a held key not listed as published
 * since, by the maps of RULE_MAPS (`keys`, `lone`, `also`: expressions). A
 * NULL key finds nothing in `keys` (a path with a NULL in it). */
#define HELD_ROW(t, keys, lone, also)                                                              \
    " (((" t ".id >= (" keys " #>> ARRAY[" t ".topic, " t ".key])::bigint) IS TRUE"                \
    "   OR (" lone " #> ARRAY[" t ".topic, " t ".id::text]) IS NOT NULL)"                          \
    "  AND (" also " ? " t ".id::text) IS NOT TRUE)"
/* The stored cursor's held rules, as the relay passes them ($10..$13), as
 * maps: the CTE `rules`. */
#define LOG_RULES                                                                                  \
    "rules AS MATERIALIZED (SELECT m.* FROM (SELECT $10::text[] AS held_topics,"                   \
    "   $11::text[] AS held_keys, $12::bigint[] AS held_from, $13::bigint[] AS also_sent) "        \
    "l," RULE_MAPS("l") ")"
#define LOG_HELD(t)                                                                                \
    HELD_ROW(t, "(SELECT r_keys FROM rules)", "(SELECT r_lone FROM rules)",                        \
             "(SELECT r_also FROM rules)")

/* clang-format off */
/* The full fetch of log mode: every row the stored cursor ($1 hwm, $9
 * snapshot, $10..$13 held keys) does not cover, but those in flight (the
 * constant put where IDS stands), in id order. That is the keyset fetch
 * from the stored cursor (ids above it; rows its snapshot saw running or not
 * yet begun) and the rows of held keys below it (a range of the primary key
 * from the lowest held id; empty when none is held). Rows in flight can be
 * anywhere here, so every part leaves them out. */
#define IDS "\x01"
#define NOT_IN_FLIGHT(t) " AND NOT (" t ".id = ANY (" IDS "))"
static const char SQL_FETCH_LOG[] =
    "WITH " HELD_MAPS("$3", "$4", "$5") ", " LOG_RULES
    " " FETCH_SELECT FETCH_SNAPSHOT_ROW
    " (" FETCH_COLUMNS("e", "$6")
    "  FROM (" KEYSET_PARTS(NOT_IN_FLIGHT)
    "        UNION ALL"
    "        (SELECT * FROM outbox.events k"
    "         WHERE k.sent_at IS NULL AND k.id <= $1::bigint"
    "           AND k.id >= coalesce((SELECT min(f) FROM unnest($12::bigint[]) f), $1::bigint + 1)"
    "           AND pg_visible_in_snapshot(k.xid, $9::pg_snapshot)" NOT_IN_FLIGHT("k")
    "           AND" LOG_HELD("k")
                FETCH_HELD_BACK("k", "$3") IN_SLOTS("k", "$7", "$8")
    "         ORDER BY k.id LIMIT $2::int)) e"
    "  ORDER BY e.id LIMIT $2::int)) b";
/* clang-format on */

/* `text` with the ids in flight (array text) put where IDS stands. */
static const char *fill_in_flight(struct obx_buf *sql, const char *text, const char *in_flight)
{
    obx_buf_reset(sql);
    for (const char *c = in_flight; *c; c++) { /* as in obx_store_sql_fetch */
        if (*c != '{' && *c != '}' && *c != ',' && *c != '-' && (*c < '0' || *c > '9'))
            return NULL;
    }
    for (const char *p = text, *q; *p; p = q + 1) {
        q = strchr(p, IDS[0]);
        if (!q) {
            obx_buf_puts(sql, p);
            break;
        }
        obx_buf_append(sql, p, (size_t)(q - p));
        obx_buf_puts(sql, "'");
        obx_buf_puts(sql, in_flight);
        obx_buf_puts(sql, "'::bigint[]");
    }
    return sql->oom ? NULL : sql->data;
}

const char *obx_store_sql_fetch_log(struct obx_buf *sql, const char *in_flight)
{
    return fill_in_flight(sql, SQL_FETCH_LOG, in_flight);
}

/* Whether the newest cursor row about row t's slot (under that cursor
 * row's own count, sql/009) covers it: at or below its hwm, seen committed
 * by its snapshot, not a row of a key it holds unless listed as published.
 * That row is one of LOG_CANDIDATES (outbox.log_newest(), sql/010, read
 * once per statement): the test per row reads those few rows, where a walk
 * down outbox.log_cursor per row read as many as one relay wrote since
 * another's last (hundreds while one drains), and took minutes over a
 * large backlog. A row above every candidate's hwm (a backlog's) is not
 * covered, and is not tested further. */
#define LOG_CANDIDATES                                                                             \
    " cand AS MATERIALIZED (SELECT l.*, m.* FROM outbox.log_newest() l," RULE_MAPS("l") ")"
#define COVERED(t)                                                                                 \
    " (" t ".id <= (SELECT max(hwm) FROM cand) AND EXISTS (SELECT FROM cand cov"                   \
    "         WHERE cov.batch = (SELECT max(v.batch) FROM cand v"                                  \
    "                            WHERE v.slots IS NULL"                                            \
    "                               OR outbox.slot_of(" t ".key, " t ".id, v.shards)"              \
    "                                  = ANY (v.slots))"                                           \
    "           AND " t ".id <= cov.hwm AND pg_visible_in_snapshot(" t ".xid, cov.snap)"           \
    "           AND NOT" HELD_ROW(t, "cov.r_keys", "cov.r_lone", "cov.r_also") "))"
#define NOT_COVERED_EXACT(t) " AND NOT" COVERED(t)
/* An exact fetch's conditions on table t: not in flight, not held back, of
 * the relay's slots, not covered. */
#define EXACT_ROW(t)                                                                               \
    NOT_IN_FLIGHT(t)                                                                               \
    FETCH_HELD_BACK(t, "$2") IN_SLOTS(t, "$6", "$7") NOT_COVERED_EXACT(t)

/* clang-format off */
/* Log mode's full fetch when cursor rows are about slots (relays with
 * relay.shards above 1, or a single relay after them): each row is tested
 * against the newest cursor row about its own slot (COVERED), and only
 * rows that may fail the test are read: from the floor of the relay's
 * slots' cursors (outbox.log_floor: the lowest hwm, a snapshot that saw
 * only what all of theirs saw, every held key), ids above it, rows of the
 * writers it saw running or not yet begun, rows of its held keys; every
 * unsent row of the slots while there is no floor (no count has a cursor
 * row about each of its slots, sql/014). The parts do not
 * overlap, and each gives its lowest ids first: the answer is the lowest
 * $1 uncovered rows not in flight, as the other full fetches. Parameters
 * as the full fetch of mark mode ($1 limit, $2..$4 held back, $5 most
 * payload bytes, $6 shards, $7 slots); a single relay passes no slots, and
 * its floor is over the slots of the newest row. The floor's values are
 * bounds of index scans as scalar subqueries: joined as a table, the
 * planner read every row of the outbox in index order and tested each
 * before the join applied them. */
static const char SQL_FETCH_LOG_EXACT[] =
    "WITH f AS (SELECT l.*, m.*"
    "           FROM outbox.log_floor(CASE WHEN $7::int[] IS NOT NULL THEN $6::int END,"
    "                                 $7::int[]) l," RULE_MAPS("l") "),"
    HELD_MAPS("$2", "$3", "$4") ","
    LOG_CANDIDATES
    " " FETCH_SELECT FETCH_SNAPSHOT_ROW
    " (" FETCH_COLUMNS_SLOT("e", "$5", "CASE WHEN $7::int[] IS NOT NULL"
                                       " THEN outbox.slot_of(e.key, e.id, $6::int) END")
    "  FROM ((SELECT a.* FROM outbox.events a"
    "         WHERE a.sent_at IS NULL"
    "           AND a.id > coalesce((SELECT hwm FROM f), " MIN_BIGINT ")" EXACT_ROW("a")
    "         ORDER BY a.id LIMIT $1::int)"
    "        UNION ALL"
    "        (SELECT l.* FROM f, pg_snapshot_xip(f.snap) AS x(xid),"
    "           LATERAL (SELECT * FROM outbox.events l"
    "                    WHERE l.sent_at IS NULL AND l.xid >= x.xid"
    "                      AND (l.xid, l.id) <= (x.xid, f.hwm)" EXACT_ROW("l")
    "                    ORDER BY l.xid, l.id LIMIT $1::int) l"
    "         WHERE pg_visible_in_snapshot(x.xid, pg_current_snapshot())"
    "         ORDER BY l.id + 0 LIMIT $1::int)"
    "        UNION ALL"
    "        (SELECT n.* FROM outbox.events n"
    "         WHERE n.sent_at IS NULL AND n.id <= (SELECT hwm FROM f)"
    "           AND (n.xid, n.id) >= ((SELECT pg_snapshot_xmax(snap) FROM f), " MIN_BIGINT ")"
    "           AND n.xid < pg_snapshot_xmax(pg_current_snapshot())" EXACT_ROW("n")
    "         ORDER BY n.xid, n.id)"
    "        UNION ALL"
    "        (SELECT k.* FROM outbox.events k"
    "         WHERE k.sent_at IS NULL AND k.id <= (SELECT hwm FROM f)"
    "           AND k.id >= coalesce((SELECT min(h) FROM f, unnest(f.held_from) h),"
    "                                (SELECT hwm + 1 FROM f))"
    "           AND pg_visible_in_snapshot(k.xid, (SELECT snap FROM f))"
    "           AND" HELD_ROW("k", "(SELECT r_keys FROM f)", "(SELECT r_lone FROM f)",
                              "(SELECT r_also FROM f)")
                EXACT_ROW("k")
    "         ORDER BY k.id LIMIT $1::int)) e"
    "  ORDER BY e.id LIMIT $1::int)) b";
/* clang-format on */

const char *obx_store_sql_fetch_log_exact(struct obx_buf *sql, const char *in_flight)
{
    return fill_in_flight(sql, SQL_FETCH_LOG_EXACT, in_flight);
}

const char *obx_store_sql_log_write(void)
{
    /* The cursor row, and the dead letters it covers copied out of the log
     * (the rows themselves stay: nothing in log mode updates or deletes). */
    return "WITH c AS (SELECT outbox.advance_cursor($1::bigint, $2::bigint, $3::pg_snapshot,"
           "                 $4::text[], $5::text[], $6::bigint[], $7::bigint[], $8::text[],"
           "                 $9::int[], $10::bigint[], $11::boolean, $14::int, $15::int[]) AS n),"
           " dead AS ("
           "   INSERT INTO outbox.dead_letters (id, topic, key, payload, headers, created_at,"
           "                                    reason)"
           "   SELECT e.id, e.topic, e.key, e.payload, e.headers, e.created_at, d.reason"
           "   FROM unnest($12::bigint[], $13::text[]) AS d(id, reason)"
           "   JOIN outbox.events e ON e.id = d.id"
           "   ON CONFLICT (id, created_at) DO NOTHING RETURNING 1)"
           " SELECT (SELECT n FROM c), (SELECT count(*) FROM dead)";
}

#define LOG_NEWEST " c AS (SELECT * FROM outbox.log_cursor ORDER BY batch DESC LIMIT 1)"
/* The same with its rules as maps (RULE_MAPS), for NOT_COVERED. */
#define LOG_NEWEST_RULES                                                                           \
    " c AS (SELECT l.*, m.*"                                                                       \
    "       FROM (SELECT * FROM outbox.log_cursor ORDER BY batch DESC LIMIT 1) l," RULE_MAPS(      \
        "l") ")"
/* Log mode's cursor rows: each partition's highest offset they stored. */
#define CURSOR_OFFSETS                                                                             \
    " lc AS (SELECT u.topic, u.p, max(u.o) AS o FROM outbox.log_cursor a,"                         \
    "          unnest(a.topics, a.kafka_partitions, a.last_offsets) AS u(topic, p, o)"             \
    "        GROUP BY 1, 2)"
/* Each partition's stored offset: the higher of what log mode's cursor rows
 * and mark or delete mode's outbox.kafka_offsets say. Each bounds the
 * records of its own time, and the later mode's records lie after the
 * earlier one's, so after a switch of modes the higher one holds. */
#define LOG_OFFSETS                                                                                \
    CURSOR_OFFSETS                                                                                 \
    ","                                                                                            \
    " o AS (SELECT t.topic, t.p, max(t.o) AS o"                                                    \
    "       FROM (SELECT topic, p, o FROM lc"                                                      \
    "             UNION ALL"                                                                       \
    "             SELECT topic, kafka_partition, last_offset FROM outbox.kafka_offsets) t"         \
    "       GROUP BY 1, 2)"

const char *obx_store_sql_log_state(void)
{
    /* One result, a kind per row: 'c' the newest cursor row (batch, hwm,
     * snapshot), 'h' a held key (topic, key, from id), 'a' a row of a held
     * key published since (id), 'o' a partition's stored offset (topic,
     * partition, offset), 'x' the highest hwm of any cursor row and
     * whether any is about slots (sql/009), 's' the highest hwm of the
     * newest rows (sql/010) about a slot (count, slot, hwm; count and slot
     * NULL: of the rows about no slots). No 'c' row: no cursor yet.
     * When the newest row is about slots, the 'a' rows are those of every
     * row: each lists only published rows, and a relay that takes slots
     * must go on listing those of the keys it holds. */
    return "WITH" LOG_NEWEST "," LOG_OFFSETS
           " SELECT 'c' AS kind, c.batch::text AS a, c.hwm::text AS b, c.snap::text AS c FROM c"
           " UNION ALL"
           " SELECT 'h', h.topic, h.key, h.from_id::text"
           " FROM c, unnest(c.held_topics, c.held_keys, c.held_from) AS h(topic, key, from_id)"
           " UNION ALL"
           " SELECT 'a', a.id::text, NULL, NULL FROM c, unnest(c.also_sent) AS a(id)"
           " WHERE c.slots IS NULL"
           " UNION ALL"
           " SELECT DISTINCT 'a', a.id::text, NULL::text, NULL::text"
           " FROM outbox.log_cursor l, unnest(l.also_sent) AS a(id)"
           " WHERE (SELECT c.slots IS NOT NULL FROM c)"
           " UNION ALL"
           " SELECT 'o', o.topic, o.p::text, o.o::text FROM o"
           " UNION ALL"
           " SELECT 'x', max(hwm)::text, bool_or(slots IS NOT NULL)::text, NULL"
           " FROM outbox.log_cursor HAVING count(*) > 0"
           " UNION ALL"
           " SELECT 's', CASE WHEN l.slots IS NOT NULL THEN l.shards::text END, s.s::text,"
           "        max(l.hwm)::text"
           " FROM outbox.log_newest() l LEFT JOIN LATERAL unnest(l.slots) AS s(s) ON true"
           " GROUP BY 2, 3";
}

const char *obx_store_sql_log_recover(void)
{
    /* As obx_store_sql_recover, but nothing is written: the ids of the
     * records found that are of rows the cursor does not cover, matched by
     * topic, key and payload digest, of the pass's slots ($5, $6: the
     * relay fetches no other). The relay takes those rows as acknowledged
     * (with the records' offsets) when it fetches them.
     *
     * No join is left to the planner's estimate of the view, which can be
     * far under the truth: as a semi join, Postgres compared every record
     * with every unpublished row (17 s for 9,000 records, past the
     * statement_timeout on a loaded machine). A subquery under OR is not
     * made a join: its ids are hashed once (a hashed SubPlan). The LIMIT
     * keeps the lateral row lookup a lookup by primary key. */
    return "WITH found AS ("
           "   SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[])"
           "     AS f(id, topic, key, digest))"
           " SELECT DISTINCT f.id FROM found f"
           " CROSS JOIN LATERAL (SELECT FROM outbox.events e WHERE e.id = f.id" IN_SLOTS(
               "e", "$5",
               "$6") "   AND e.topic = f.topic AND e.key IS NOT DISTINCT FROM f.key"
                     "   AND encode(sha256(e.payload), 'hex') IS NOT DISTINCT FROM f.digest"
                     "   LIMIT 1) e"
                     " WHERE (f.id IN (SELECT id FROM outbox.unpublished"
                     "                 WHERE id BETWEEN (SELECT min(id) FROM found)"
                     "                              AND (SELECT max(id) FROM found))"
                     "        OR false)"
                     " ORDER BY f.id";
}

/* Each partition's highest acknowledged offset, for crash recovery; never
 * moves back. A single relay stores it in outbox.kafka_offsets, a relay
 * with relay.shards above 1 for each slot it owns in
 * outbox.kafka_slot_offsets; `offsets` counts both. The $N of its
 * parameters: 1 relay.shards, 2..4 enum obx_offsets_param, 5 the slots
 * owned (NULL: alone). */
#define OFFSETS_UPSERT_FMT                                                                         \
    " alone AS ("                                                                                  \
    "   INSERT INTO outbox.kafka_offsets AS k (topic, kafka_partition, last_offset)"               \
    "   SELECT * FROM unnest($%2$d::text[], $%3$d::int[], $%4$d::bigint[])"                        \
    "   WHERE $%5$d::int[] IS NULL"                                                                \
    "   ON CONFLICT (topic, kafka_partition) DO UPDATE"                                            \
    "     SET last_offset = greatest(k.last_offset, excluded.last_offset), updated_at = now()"     \
    "   RETURNING 1),"                                                                             \
    " per_slot AS ("                                                                               \
    "   INSERT INTO outbox.kafka_slot_offsets AS k"                                                \
    "     (topic, kafka_partition, last_offset, shards, slot)"                                     \
    "   SELECT t.*, $%1$d::int, s.slot"                                                            \
    "   FROM unnest($%2$d::text[], $%3$d::int[], $%4$d::bigint[]) AS t,"                           \
    "        unnest($%5$d::int[]) AS s(slot)"                                                      \
    "   ON CONFLICT (topic, kafka_partition, shards, slot) DO UPDATE"                              \
    "     SET last_offset = greatest(k.last_offset, excluded.last_offset), updated_at = now()"     \
    "   RETURNING 1),"                                                                             \
    " offsets AS (SELECT * FROM alone UNION ALL SELECT * FROM per_slot)"

/* How rows are confirmed: sent_at set (mark mode; a row marked before keeps
 * its time), or the row deleted (delete mode); %s%s an optional FROM (USING)
 * list, %s the condition on e. No "sent_at IS NULL" in the WHERE: it would
 * let the planner walk a partial index whole instead of looking the ids up,
 * and with statistics from a nearly empty table it does (7 index reads a
 * row in a burst). */
#define CONFIRM_MARK_FMT                                                                           \
    "UPDATE outbox.events e SET sent_at = coalesce(e.sent_at, now())%s%s WHERE %s"
#define CONFIRM_DELETE_FMT "DELETE FROM outbox.events e%s%s WHERE %s"

/* The acknowledged rows, for a parameter $N that holds them as ranges: a
 * two-dimensional bigint[] of {first, last} pairs (obx_pg_array_add_ranges).
 * Each range is one walk of the primary key, where "id = ANY" descends it
 * from the root for every id (a third of the backend's time for a batch).
 * Every id of a range was acknowledged, so a row committed late with an id
 * inside a batch's span lies outside them. */
#define ACKED_RANGES_FMT                                                                           \
    "(SELECT ($%d::bigint[])[i][1] AS lo, ($%d::bigint[])[i][2] AS hi"                             \
    "   FROM generate_subscripts($%d::bigint[], 1) AS i) r"
#define ACKED_RANGES_COND "e.id BETWEEN r.lo AND r.hi"

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

/* The offsets' upsert between `before` and `after`, its parameters the
 * enum obx_offsets_param group at index `first` and the enum
 * obx_slots_param group at index `slots`. */
static void append_offsets(char *buf, size_t len, size_t *o, const char *before, int first,
                           int slots, const char *after)
{
    append(buf, len, o, "%s", before);
    append(buf, len, o, OFFSETS_UPSERT_FMT, slots + OBX_SLOTS_SHARDS + 1,
           first + OBX_OFFSETS_TOPICS + 1, first + OBX_OFFSETS_PARTITIONS + 1,
           first + OBX_OFFSETS_OFFSETS + 1, slots + OBX_SLOTS_OWNED + 1);
    append(buf, len, o, "%s", after);
}

/* `from`: NULL or what the condition `which` joins; `returning`: with
 * RETURNING id, for a CTE that is counted. */
static void append_confirm(char *buf, size_t len, size_t *o, int on_sent, const char *from,
                           const char *which, bool returning)
{
    bool delete = on_sent == OBX_ON_SENT_DELETE;
    append(buf, len, o, delete ? CONFIRM_DELETE_FMT : CONFIRM_MARK_FMT,
           from ? (delete ? " USING " : " FROM ") : "", from ? from : "", which);
    if (returning)
        append(buf, len, o, " RETURNING e.id");
}

/* The confirmation of the acknowledged ranges in the parameter at index
 * `param` (its $N is one more). */
static void append_confirm_acked(char *buf, size_t len, size_t *o, int on_sent, int param,
                                 bool returning)
{
    char from[256];
    snprintf(from, sizeof(from), ACKED_RANGES_FMT, param + 1, param + 1, param + 1);
    append_confirm(buf, len, o, on_sent, from, ACKED_RANGES_COND, returning);
}

const char *obx_store_sql_mark(int on_sent, char *buf, size_t len)
{
    /* Acknowledged rows confirmed, offsets stored, refused rows moved to
     * dead_letters: one statement, run inside BEGIN ... COMMIT. */
    size_t o = 0;
    append_offsets(buf, len, &o, "WITH", OBX_MARK_OFFSETS, OBX_MARK_SLOTS, ", confirmed AS (");
    append_confirm_acked(buf, len, &o, on_sent, OBX_MARK_RANGES, true);
    append(
        buf, len, &o,
        "),"
        " dead AS ("
        "   DELETE FROM outbox.events e USING unnest($%d::bigint[], $%d::text[]) AS d(id, reason)",
        OBX_MARK_DEAD + OBX_DEAD_IDS + 1, OBX_MARK_DEAD + OBX_DEAD_REASONS + 1);
    append(buf, len, &o,
           "   WHERE e.id = d.id AND e.sent_at IS NULL"
           "   RETURNING e.id, e.topic, e.key, e.payload, e.headers, e.created_at, d.reason),"
           " buried AS ("
           "   INSERT INTO outbox.dead_letters (id, topic, key, payload, headers, created_at,"
           "                                    reason)"
           "   SELECT * FROM dead ON CONFLICT (id, created_at) DO NOTHING RETURNING 1)"
           " SELECT (SELECT count(*) FROM confirmed) AS confirmed,"
           "        (SELECT count(*) FROM offsets) AS offsets,"
           "        (SELECT count(*) FROM buried) AS buried");
    return buf;
}

const char *obx_store_sql_mark_plain(int on_sent, char *buf, size_t len)
{
    /* No RETURNING and no counts: nothing reads them, and Postgres would
     * keep and count every id. */
    size_t o = 0;
    append_offsets(buf, len, &o, "WITH", OBX_MARK_OFFSETS, OBX_MARK_SLOTS, " ");
    append_confirm_acked(buf, len, &o, on_sent, OBX_MARK_RANGES, false);
    return buf;
}

const char *obx_store_sql_mark_fetch(int on_sent, char *buf, size_t len)
{
    /* The keyset fetch's snapshot is taken before the mark's changes, and
     * the rows it reads lie above hwm or were not in it: none is marked. */
    size_t o = 0;
    append_offsets(buf, len, &o, "WITH", OBX_MARK_FETCH_MARK + OBX_MARK_OFFSETS,
                   OBX_MARK_FETCH_MARK + OBX_MARK_SLOTS, ", confirmed AS (");
    append_confirm_acked(buf, len, &o, on_sent, OBX_MARK_FETCH_MARK + OBX_MARK_RANGES, false);
    append(buf, len, &o, "), %s", KEYSET_HELD_MAPS " " KEYSET_BODY);
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
    append_confirm(buf, len, &o, on_sent, NULL, "e.id IN (SELECT id FROM matched)", true);
    append_offsets(buf, len, &o, "),", OBX_RECOVER_OFFSETS, OBX_RECOVER_SLOTS, "");
    append(
        buf, len, &o,
        " SELECT (SELECT count(*) FROM confirmed) AS confirmed,"
        "        (SELECT count(*) FROM found) AS found, (SELECT count(*) FROM offsets) AS offsets");
    return buf;
}

/* clang-format off */
/* The stored offsets that bound the unmarked records of the pass's rows ($1
 * relay.shards, $2 its slots; NULL: a single relay, every row), per
 * partition, each table read once by its primary key:
 * - a relay with slots, each of which stored its own offset there: the
 *   lowest of those (each slot's first owner stored one only after its own
 *   pass, which read from the offsets of the time before);
 * - one of its slots without its own: also a single relay's offset and those
 *   stored under another relay.shards;
 * - a single relay: its own, and those of slots stored since it last stored
 *   that partition (or wrote a cursor row, in log mode): relays with slots
 *   ran after it;
 * - and the partition is read from its start (left out here) if a slot
 *   that may have published there has no offset of its own: one whose
 *   owner before the relay running the pass did not give it back cleanly,
 *   or (for a single relay) one owned since it last stored: that owner may
 *   have died before storing any.
 * The higher of that and log mode's cursor rows, as LOG_OFFSETS. */
#define PLAN_OFFSETS                                                                               \
    " ko AS (SELECT k.topic, k.kafka_partition AS p, k.last_offset AS o,"                          \
    "          greatest(k.updated_at, (SELECT max(written_at) FROM outbox.log_cursor)) AS at"      \
    "        FROM outbox.kafka_offsets k),"                                                        \
    " parts AS (SELECT topic, p, o, at FROM ko"                                                    \
    "           UNION"                                                                             \
    "           SELECT DISTINCT s.topic, s.kafka_partition, NULL::bigint,"                         \
    "             (SELECT max(written_at) FROM outbox.log_cursor)"                                 \
    "           FROM outbox.kafka_slot_offsets s"                                                  \
    "           WHERE NOT EXISTS (SELECT FROM outbox.kafka_offsets k"                              \
    "                             WHERE k.topic = s.topic AND k.kafka_partition = s.kafka_partition)),"\
    " pick AS ("                                                                                   \
    "   SELECT pt.topic, pt.p, pt.o AS alone,"                                                     \
    "     min(s.last_offset) FILTER (WHERE s.shards = $1::int AND s.slot = ANY ($2::int[])) AS mine,"\
    "     count(s.slot) FILTER (WHERE s.shards = $1::int AND s.slot = ANY ($2::int[])) AS n_mine,"  \
    "     min(s.last_offset) FILTER (WHERE CASE WHEN $2::int[] IS NULL"                             \
    "                                           THEN pt.at IS NULL OR s.updated_at > pt.at"        \
    "                                           ELSE s.shards <> $1::int END) AS others"          \
    "   FROM parts pt LEFT JOIN outbox.kafka_slot_offsets s"                                       \
    "     ON s.topic = pt.topic AND s.kafka_partition = pt.p"                                      \
    "   GROUP BY pt.topic, pt.p, pt.o, pt.at),"                                                    \
    " gap AS (SELECT DISTINCT pt.topic, pt.p FROM parts pt, outbox.slot_owners w"                  \
    "         WHERE CASE WHEN $2::int[] IS NULL THEN pt.at IS NULL OR w.owned_since > pt.at"       \
    "                    ELSE w.shards = $1::int AND w.slot = ANY ($2::int[]) AND NOT w.taken_clean"\
    "               END"                                                                           \
    "           AND NOT EXISTS (SELECT FROM outbox.kafka_slot_offsets x"                           \
    "                           WHERE x.topic = pt.topic AND x.kafka_partition = pt.p"             \
    "                             AND x.shards = w.shards AND x.slot = w.slot)),"                  \
    " kafka AS (SELECT topic, p,"                                                                  \
    "             CASE WHEN $2::int[] IS NULL THEN least(alone, others)"                           \
    "                  WHEN n_mine = cardinality($2::int[]) THEN mine"                             \
    "                  ELSE least(mine, alone, others) END AS o"                                   \
    "           FROM pick WHERE NOT EXISTS (SELECT FROM gap g"                                     \
    "                                       WHERE g.topic = pick.topic AND g.p = pick.p)),"        \
    CURSOR_OFFSETS ","                                                                             \
    " o AS (SELECT coalesce(k.topic, lc.topic) AS topic, coalesce(k.p, lc.p) AS p,"                \
    "         greatest(k.o, lc.o) AS o"                                                            \
    "       FROM kafka k FULL JOIN lc ON lc.topic = k.topic AND lc.p = k.p"                        \
    "       WHERE NOT EXISTS (SELECT FROM gap g WHERE g.topic = coalesce(k.topic, lc.topic)"       \
    "                                             AND g.p = coalesce(k.p, lc.p))),"                \
    " mine AS (SELECT u.id, u.topic FROM outbox.unpublished u"                                     \
    "          WHERE TRUE" IN_SLOTS("u", "$1", "$2") ")"
/* clang-format on */

const char *obx_store_sql_recovery_plan(void)
{
    /* A record outside [lo, hi] cannot match any unsent row. */
    return "WITH" PLAN_OFFSETS " SELECT t.topic, o.p AS kafka_partition, o.o AS stored_offset,"
           "       r.lo AS id_lo, r.hi AS id_hi"
           " FROM (SELECT DISTINCT topic FROM mine) t"
           " CROSS JOIN (SELECT min(id) AS lo, max(id) AS hi FROM mine) r"
           " LEFT JOIN o ON o.topic = t.topic"
           " ORDER BY topic, kafka_partition";
}

const char *obx_store_sql_claim_slots(void)
{
    /* cursor_hwm: about the highest hwm of log mode's cursor rows (those of
     * the newest few), for a relay whose slots lag behind (relay.c,
     * cursor_advance); only of rows whose snapshot's writers have all
     * ended, so that no large transaction still running holds ids below
     * it (its rows would come late, below the cursor, more than a fetch
     * takes). */
    /* fence_pids (relay.transactions): the owners of the slots held now
     * that lost them without giving them back, and those before them that
     * nobody fenced (sql/013), but the ones this session fenced ($4), which
     * leave the slots here; their relays' transactional producers are
     * fenced before the pass over the slots. Read after claim_slots() wrote
     * the new owners (its trigger carries the one before). */
    return "SELECT array_to_string(c.owned, ',') AS owned, c.members, c.share, c.free,"
           "       c.other_shards, c.repaired,"
           "       (SELECT max(n.hwm) FROM (SELECT hwm, snap FROM outbox.log_cursor"
           "                                ORDER BY batch DESC LIMIT 16) n"
           "        WHERE pg_snapshot_xmax(n.snap) <= pg_snapshot_xmin(pg_current_snapshot()))"
           "         AS cursor_hwm,"
           "       pg_backend_pid() AS session_pid,"
           "       array_to_string(outbox.owners_to_fence($1::int, $4::int[]), ',') AS fence_pids"
           " FROM outbox.claim_slots($1::int, $2::int[], $3::boolean) c";
}

const char *obx_store_sql_backlog(void)
{
    /* Any mode: log mode's rows are never marked, the view asks its cursor. */
    return "SELECT count(*) AS rows,"
           "       coalesce(extract(epoch FROM now() - min(created_at))::float8, 0)"
           "         AS oldest_seconds"
           " FROM outbox.unpublished";
}

/* Log mode's backlog count: the view's rows, and with $1 (relay.shards)
 * above 1 by_slot as obx_store_sql_backlog_since's (NULL otherwise). */
const char *obx_store_sql_backlog_log(void)
{
    return "WITH u AS (SELECT created_at,"
           "                  CASE WHEN $1::int > 1 THEN outbox.slot_of(key, id, $1::int) END AS "
           "slot"
           "           FROM outbox.unpublished),"
           " s AS (SELECT slot, count(*) AS n, min(created_at) AS oldest FROM u GROUP BY 1)"
           " SELECT coalesce(sum(n), 0)::bigint AS rows,"
           "        coalesce(extract(epoch FROM now() - min(oldest))::float8, 0) AS oldest_seconds,"
           "        string_agg(concat_ws(' ', slot, n,"
           "                     greatest(0, floor(extract(epoch FROM now() - oldest) * "
           "1000))::bigint),"
           "                   ',' ORDER BY slot) FILTER (WHERE slot IS NOT NULL) AS by_slot"
           " FROM s";
}

/* Not covered by the newest cursor row of log mode (none: every row is
 * uncovered): at or below its hwm, seen committed by its snapshot, and not
 * a row of a key it holds (unless listed as published since). When the
 * newest row is about slots (sql/009), by the newest row about the row's
 * own slot (COVERED). Mark and
 * delete mode after log mode leave such rows unsent in outbox.events until
 * their partition is reclaimed: they are published all the same. */
#define NOT_COVERED(t)                                                                             \
    " AND CASE WHEN (SELECT c.slots IS NULL FROM c) IS NOT FALSE"                                  \
    "     THEN NOT EXISTS (SELECT FROM c WHERE " t ".id <= c.hwm"                                  \
    "         AND pg_visible_in_snapshot(" t ".xid, c.snap)"                                       \
    "         AND NOT" HELD_ROW(t, "c.r_keys", "c.r_lone",                                         \
                                "c.r_also") ")"                                                    \
                                            "     ELSE NOT" COVERED(t) " END"

/* The backlog gauges again, from where the last count left off: $1 the
 * lowest unsent id it saw (its "floor"), $2 the xmin of its snapshot. A row
 * below the floor is unsent now only if it was not visible then (its
 * writer was running) or came back unsent since (sql/004 and 006 give it
 * the xid of whoever did that), and either way its xid is at least $2. So
 * the count reads the entries from the floor on and those of transactions
 * since $2, not every entry from the lowest unsent id: under a held xmin
 * horizon the (id) index keeps one for every row sent since, and counting
 * them all every few seconds (300 ms after five minutes at 1,000 rows/s)
 * was what slowed the relay, on a small machine, under such a horizon.
 * Each part asks for the order of the index it must read (the session
 * plans with enable_sort off). Rows the newest cursor row covers are not
 * counted (NOT_COVERED). Columns: rows (unpublished), oldest_seconds (age of
 * the lowest-id one), next_floor, next_xmin (text), and with $3 (shards)
 * above 1 by_slot: "slot rows oldest-ms" for each slot with unsent rows,
 * comma-separated in slot order (NULL when none, or $3 is 1); a slot's
 * oldest is its earliest created_at, where oldest_seconds is the lowest
 * id's. The slot is computed only with $3 above 1: a single relay keeps
 * nothing more per unsent row. */
#define SLOT_IF_SHARDED " CASE WHEN $3::int > 1 THEN outbox.slot_of(key, id, $3::int) END AS slot"
/* clang-format off */
const char *obx_store_sql_backlog_since(void)
{
    return "WITH" LOG_NEWEST_RULES "," LOG_CANDIDATES ","
           " above AS ("
           "   SELECT id, created_at," SLOT_IF_SHARDED " FROM outbox.events e"
           "   WHERE sent_at IS NULL AND id >= $1::bigint" NOT_COVERED("e")
           "   ORDER BY id),"
           " below AS ("
           "   SELECT id, created_at," SLOT_IF_SHARDED " FROM outbox.events e"
           "   WHERE $1::bigint > " MIN_BIGINT " AND sent_at IS NULL" /* none at first */
           "     AND (xid, id) >= ($2::xid8, " MIN_BIGINT ") AND id < $1::bigint" NOT_COVERED("e")
           "   ORDER BY xid, id),"
           " oldest AS ("
           "   SELECT id, created_at FROM (SELECT * FROM below UNION ALL"
           "                               (SELECT * FROM above LIMIT 1)) o"
           "   ORDER BY id LIMIT 1),"
           " by_slot AS ("
           "   SELECT u.slot, count(*) AS n, min(u.created_at) AS oldest"
           "   FROM (SELECT * FROM above UNION ALL SELECT * FROM below) u"
           "   WHERE $3::int > 1 GROUP BY 1)"
           " SELECT (SELECT count(*) FROM above) + (SELECT count(*) FROM below) AS rows,"
           "        coalesce((SELECT extract(epoch FROM now() - created_at)::float8 FROM oldest),"
           "                 0) AS oldest_seconds,"
           "        coalesce((SELECT id FROM oldest),"
           "                 (SELECT max(id) + 1 FROM outbox.events WHERE id >= $1::bigint),"
           "                 $1::bigint) AS next_floor,"
           "        pg_snapshot_xmin(pg_current_snapshot())::text AS next_xmin,"
           "        (SELECT string_agg(concat_ws(' ', slot, n,"
           "                  greatest(0, floor(extract(epoch FROM now() - oldest) * 1000))::bigint),"
           "                  ',' ORDER BY slot) FROM by_slot) AS by_slot";
}
/* clang-format on */

const char *obx_store_sql_waiting_by_slot(void)
{
    /* $1: relay.shards. Only slots with unsent rows. */
    return "SELECT outbox.slot_of(key, id, $1::int) AS slot, count(*) AS rows,"
           "       coalesce(extract(epoch FROM now() - min(created_at)), 0)::bigint"
           "         AS oldest_seconds"
           " FROM outbox.unpublished GROUP BY 1 ORDER BY 1";
}

const char *obx_store_sql_waiting(void)
{
    return "SELECT topic, count(*) AS rows FROM outbox.unpublished GROUP BY topic"
           " ORDER BY rows DESC";
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
           " SELECT (SELECT max(id) FROM batch) AS last_id,"
           "        (SELECT count(*) FROM doomed) AS deleted,"
           "        (SELECT count(*) FROM batch"
           "         WHERE created_at >= now() - $3::bigint * interval '1 millisecond') AS recent";
}

/* ---- the operator's tools ---- */

#define UTC(col) "to_char((" col ") AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')"

/* clang-format off */
const char *obx_store_sql_relay_sessions(void)
{
    /* A standby's last statement is always its try of the lock (every
     * 250 ms); the active relay holds the lock (relays with relay.shards
     * share it, and `slots` lists those each owns, sql/008). */
    return "SELECT a.pid, coalesce(a.application_name, '') AS application_name,"
           "       coalesce(host(a.client_addr), 'local socket') AS client,"
           "       " UTC("a.backend_start") " AS started, l.pid IS NOT NULL AS active,"
           "       extract(epoch FROM now() - a.backend_start)::bigint AS session_seconds,"
           "       coalesce((SELECT string_agg(s.objid::text, ',' ORDER BY s.objid)"
           "                 FROM pg_locks s WHERE s.pid = a.pid AND s.locktype = 'advisory'"
           "                   AND s.granted AND s.classid = 1868724340 AND s.objsubid = 2),"
           "                '') AS slots"
           " FROM pg_stat_activity a"
           " LEFT JOIN pg_locks l ON l.pid = a.pid AND l.locktype = 'advisory' AND l.granted"
           "      AND l.classid = 1868724338 AND l.objid = 0 AND l.objsubid = 2"
           " WHERE l.pid IS NOT NULL"
           "    OR (a.pid <> pg_backend_pid()" /* this text has the words too */
           "        AND (a.query LIKE 'SELECT pg_try_advisory_lock%(1868724338, 0)%'" /* older relays */
           "             OR a.query LIKE 'SELECT CASE WHEN current_setting(''" OBX_STORE_SESSION_SETTING
           "'', true) = %pg_try_advisory_lock%(1868724338, 0)%'))"
           " ORDER BY active DESC, a.backend_start";
}
/* clang-format on */

const char *obx_store_sql_dead_summary(void)
{
    return "SELECT count(*) AS rows,"
           "       coalesce(extract(epoch FROM now() - max(failed_at)), 0)::bigint"
           "         AS newest_seconds"
           " FROM outbox.dead_letters";
}

const char *obx_store_sql_oldest_xmin(void)
{
    return "SELECT pid, age(backend_xmin) AS xmin_age,"
           "       coalesce(application_name, '') AS application_name,"
           "       coalesce(state, '') AS state,"
           "       coalesce(extract(epoch FROM now() - xact_start), 0)::bigint"
           "         AS transaction_seconds,"
           "       left(regexp_replace(coalesce(query, ''), '\\s+', ' ', 'g'), 60) AS query"
           " FROM pg_stat_activity"
           " WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid()"
           /* Of equal horizons, the longest-open transaction: a relay's
            * fetch of a moment ago shares a report's xmin when no writer
            * ran in between, and the report is the one that holds it. */
           " ORDER BY age(backend_xmin) DESC, xact_start ASC NULLS LAST LIMIT 1";
}

const char *obx_store_sql_oldest_slot(void)
{
    return "SELECT slot_name, greatest(age(xmin), age(catalog_xmin)) AS xmin_age"
           " FROM pg_replication_slots"
           " WHERE xmin IS NOT NULL OR catalog_xmin IS NOT NULL ORDER BY xmin_age DESC LIMIT 1";
}

/* clang-format off */
const char *obx_store_sql_events_tuples(void)
{
    /* Summed over the partitions; the oldest partition's last vacuum. */
    return "SELECT coalesce(sum(n_live_tup), 0) AS live, coalesce(sum(n_dead_tup), 0) AS dead,"
           "       coalesce(" UTC("min(greatest(last_autovacuum, last_vacuum))") ", 'never')"
           "         AS last_vacuum"
           " FROM pg_stat_user_tables WHERE relid IN " OBX_STORE_SQL_EVENTS_PARTITIONS;
}
/* clang-format on */

/* clang-format off */
const char *obx_store_sql_dead_list(void)
{
    return "SELECT id, topic, coalesce(key, '') AS key, key IS NULL AS no_key, reason,"
           "       extract(epoch FROM now() - failed_at)::bigint AS age_seconds,"
           "       coalesce(octet_length(payload), 0) AS bytes"
           " FROM outbox.dead_letters ORDER BY id LIMIT $1::int";
}
/* clang-format on */

const char *obx_store_sql_dead_existing(void)
{
    return "SELECT id FROM outbox.dead_letters WHERE id = ANY ($1::bigint[]) ORDER BY id";
}

const char *obx_store_sql_dead_retry(void)
{
    /* Mark and delete mode moved the row out of outbox.events: it goes
     * back. Log mode left it in place: it is written again (the xid of this
     * transaction), which the cursor does not cover, so it is published.
     * The same row, by id and created_at: a row of another history with
     * that id is not it (the INSERT then fails on the id: nothing moves). */
    return "WITH moved AS ("
           "   DELETE FROM outbox.dead_letters WHERE id = ANY ($1::bigint[])"
           "   RETURNING id, topic, key, payload, headers, created_at),"
           " again AS ("
           "   UPDATE outbox.events e"
           "   SET xid = pg_current_xact_id(), origin_xid = NULL, sent_at = NULL"
           "   FROM moved m WHERE e.id = m.id AND e.created_at = m.created_at RETURNING e.id),"
           " back AS ("
           "   INSERT INTO outbox.events (id, topic, key, payload, headers, created_at)"
           "   OVERRIDING SYSTEM VALUE"
           "   SELECT id, topic, key, payload, headers, created_at FROM moved"
           "   WHERE id NOT IN (SELECT id FROM again) RETURNING id)"
           " SELECT id FROM again UNION ALL SELECT id FROM back";
}

const char *obx_store_sql_dead_drop(void)
{
    return "DELETE FROM outbox.dead_letters WHERE id = ANY ($1::bigint[]) RETURNING id";
}

/* Published rows (any mode: marked, or covered by log mode's cursor). */
#define REPLAY_WHERE                                                                               \
    " WHERE topic = $1::text AND id BETWEEN $2::bigint AND $3::bigint"                             \
    "   AND created_at >= $4::timestamptz"                                                         \
    "   AND id NOT IN (SELECT id FROM outbox.unpublished"                                          \
    "                  WHERE topic = $1::text AND id BETWEEN $2::bigint AND $3::bigint)"

/* clang-format off */
const char *obx_store_sql_replay_plan(void)
{
    return "SELECT count(*) AS rows, min(id) AS first_id, max(id) AS last_id,"
           "       " UTC("min(created_at)") " AS first_created,"
           "       " UTC("max(created_at)") " AS last_created"
           " FROM outbox.events" REPLAY_WHERE;
}
/* clang-format on */

const char *obx_store_sql_replay(void)
{
    /* A new xid: log mode's cursor does not cover the row any more (in
     * mark mode the trigger of sql/004 does the same). */
    return "UPDATE outbox.events SET sent_at = NULL, xid = pg_current_xact_id(), origin_xid = "
           "NULL" REPLAY_WHERE;
}

/* ---- the statements' parameter types (checked by test_store) ---- */

#define OFFSETS_TYPES(at)                                                                          \
    [(at) + OBX_OFFSETS_TOPICS] = {"offset topics", "text[]"},                                     \
            [(at) + OBX_OFFSETS_PARTITIONS] = {"offset partitions", "int[]"},                      \
            [(at) + OBX_OFFSETS_OFFSETS] = {"offsets", "bigint[]"}
#define SLOTS_TYPES(at)                                                                            \
    [(at) + OBX_SLOTS_SHARDS] = {"shards", "int"},                                                 \
            [(at) + OBX_SLOTS_OWNED] = {"owned slots", "int[]"}
#define DEAD_TYPES(at)                                                                             \
    [(at) + OBX_DEAD_IDS] = {"dead ids", "bigint[]"},                                              \
            [(at) + OBX_DEAD_REASONS] = {"dead reasons", "text[]"}
#define HELD_TYPES(at)                                                                             \
    [(at) + OBX_HELD_TOPICS] = {"held topics", "text[]"},                                          \
            [(at) + OBX_HELD_KEYS] = {"held keys", "text[]"},                                      \
            [(at) + OBX_HELD_FROM] = {"held from ids", "bigint[]"},                                \
            [(at) + OBX_HELD_ALSO_SENT] = {"also sent", "bigint[]"}
#define FETCH_TYPES                                                                                \
    [OBX_FETCH_AFTER] = {"after id", "bigint"}, [OBX_FETCH_LIMIT] = {"limit", "int"},              \
    [OBX_FETCH_HELD_TOPICS] = {"held-back topics", "text[]"},                                      \
    [OBX_FETCH_HELD_KEYS] = {"held-back keys", "text[]"},                                          \
    [OBX_FETCH_HELD_IDS] = {"held-back ids", "bigint[]"},                                          \
    [OBX_FETCH_MAX_BYTES] = {"max payload bytes", "int"},                                          \
    SLOTS_TYPES(OBX_FETCH_SLOTS), [OBX_FETCH_SNAPSHOT] = {"snapshot", "pg_snapshot"}
#define RECOVER_MATCH_TYPES                                                                        \
    [OBX_RECOVER_IDS] = {"found ids", "bigint[]"},                                                 \
    [OBX_RECOVER_TOPICS] = {"found topics", "text[]"},                                             \
    [OBX_RECOVER_KEYS] = {"found keys", "text[]"},                                                 \
    [OBX_RECOVER_DIGESTS] = {"found digests", "text[]"}

static const struct obx_store_param fetch_types[OBX_FETCH_LOG_NPARAMS] = {
    FETCH_TYPES, HELD_TYPES(OBX_FETCH_LOG_HELD)};
static const struct obx_store_param mark_types[OBX_MARK_NPARAMS] = {
    [OBX_MARK_RANGES] = {"acknowledged ranges", "bigint[]"},
    OFFSETS_TYPES(OBX_MARK_OFFSETS),
    SLOTS_TYPES(OBX_MARK_SLOTS),
    DEAD_TYPES(OBX_MARK_DEAD)};
static const struct obx_store_param mark_fetch_types[OBX_MARK_FETCH_NPARAMS] = {
    FETCH_TYPES, [OBX_MARK_FETCH_MARK + OBX_MARK_RANGES] = {"acknowledged ranges", "bigint[]"},
    OFFSETS_TYPES(OBX_MARK_FETCH_MARK + OBX_MARK_OFFSETS),
    SLOTS_TYPES(OBX_MARK_FETCH_MARK + OBX_MARK_SLOTS)};
static const struct obx_store_param cursor_types[OBX_CURSOR_NPARAMS] = {
    [OBX_CURSOR_BATCH] = {"batch", "bigint"},
    [OBX_CURSOR_HWM] = {"hwm", "bigint"},
    [OBX_CURSOR_SNAPSHOT] = {"snapshot", "pg_snapshot"},
    HELD_TYPES(OBX_CURSOR_HELD),
    OFFSETS_TYPES(OBX_CURSOR_OFFSETS),
    [OBX_CURSOR_RESTART] = {"restart", "boolean"},
    DEAD_TYPES(OBX_CURSOR_DEAD),
    SLOTS_TYPES(OBX_CURSOR_SLOTS)};
static const struct obx_store_param recover_types[OBX_RECOVER_NPARAMS] = {
    RECOVER_MATCH_TYPES, OFFSETS_TYPES(OBX_RECOVER_OFFSETS), SLOTS_TYPES(OBX_RECOVER_SLOTS)};
static const struct obx_store_param log_recover_types[OBX_RECOVER_LOG_NPARAMS] = {
    RECOVER_MATCH_TYPES, SLOTS_TYPES(OBX_RECOVER_LOG_SLOTS)};
static const struct obx_store_param plan_types[OBX_PLAN_NPARAMS] = {SLOTS_TYPES(OBX_PLAN_SLOTS)};
static const struct obx_store_param claim_types[OBX_CLAIM_NPARAMS] = {
    [OBX_CLAIM_SHARDS] = {"shards", "int"},
    [OBX_CLAIM_GIVE_BACK] = {"slots given back", "int[]"},
    [OBX_CLAIM_TAKE] = {"take", "boolean"},
    [OBX_CLAIM_FENCED] = {"fenced", "int[]"}};
static const struct obx_store_param backlog_types[OBX_BACKLOG_NPARAMS] = {
    [OBX_BACKLOG_FLOOR] = {"floor", "bigint"},
    [OBX_BACKLOG_XMIN] = {"xmin", "xid8"},
    [OBX_BACKLOG_SHARDS] = {"shards", "int"}};
static const struct obx_store_param purge_types[OBX_PURGE_NPARAMS] = {
    [OBX_PURGE_AFTER] = {"after id", "bigint"},
    [OBX_PURGE_BATCH] = {"batch size", "int"},
    [OBX_PURGE_PERIOD_MS] = {"period ms", "bigint"}};
static const struct obx_store_param upkeep_types[OBX_UPKEEP_NPARAMS] = {
    [OBX_UPKEEP_ROWS] = {"ids per partition", "bigint"},
    [OBX_UPKEEP_AHEAD] = {"partitions ahead", "int"}};
static const struct obx_store_param reclaim_types[OBX_RECLAIM_NPARAMS] = {
    [OBX_RECLAIM_KEEP_MS] = {"retention ms", "bigint"}};
static const struct obx_store_param dead_list_types[OBX_DEAD_TOOL_NPARAMS] = {
    [OBX_DEAD_TOOL_ARG] = {"limit", "int"}};
static const struct obx_store_param dead_ids_types[OBX_DEAD_TOOL_NPARAMS] = {
    [OBX_DEAD_TOOL_ARG] = {"ids", "bigint[]"}};
static const struct obx_store_param replay_types[OBX_REPLAY_NPARAMS] = {
    [OBX_REPLAY_TOPIC] = {"topic", "text"},
    [OBX_REPLAY_FROM] = {"from id", "bigint"},
    [OBX_REPLAY_TO] = {"to id", "bigint"},
    [OBX_REPLAY_SINCE] = {"since", "timestamptz"}};

/* `sql`, or NULL when it filled a buffer of `len` bytes (it may be cut). */
static const char *fits(const char *sql, size_t len)
{
    return strlen(sql) + 1 < len ? sql : NULL;
}

int obx_store_statements(int on_sent, struct obx_store_statement *out)
{
    /* The marks in the relay's sizes; NULL when one does not fit. */
    static char mark[OBX_STORE_MARK_SQL_LEN], mark_plain[OBX_STORE_MARK_PLAIN_SQL_LEN],
        mark_fetch[OBX_STORE_MARK_FETCH_SQL_LEN], recover[8192];
    static struct obx_buf full, log, log_exact;
    int n = 0;
#define ADD(label, text, types, count)                                                             \
    out[n++] = (struct obx_store_statement){label, text, types, count}
    ADD("keyset fetch", obx_store_sql_fetch_keyset(), fetch_types, OBX_FETCH_NPARAMS);
    ADD("full fetch", obx_store_sql_fetch(&full, "{1,2}"), fetch_types + OBX_FETCH_FULL_FIRST,
        OBX_FETCH_FULL_NPARAMS);
    ADD("log fetch", obx_store_sql_fetch_log(&log, "{1,2}"), fetch_types, OBX_FETCH_LOG_NPARAMS);
    ADD("log fetch by slot", obx_store_sql_fetch_log_exact(&log_exact, "{1,2}"),
        fetch_types + OBX_FETCH_FULL_FIRST, OBX_FETCH_FULL_NPARAMS);
    /* pg.c keeps the cursor row in the mark's buffer. */
    ADD("cursor row", fits(obx_store_sql_log_write(), sizeof(mark)), cursor_types,
        OBX_CURSOR_NPARAMS);
    ADD("mark", fits(obx_store_sql_mark(on_sent, mark, sizeof(mark)), sizeof(mark)), mark_types,
        OBX_MARK_NPARAMS);
    ADD("plain mark",
        fits(obx_store_sql_mark_plain(on_sent, mark_plain, sizeof(mark_plain)), sizeof(mark_plain)),
        mark_types, OBX_MARK_PLAIN_NPARAMS);
    ADD("mark with fetch",
        fits(obx_store_sql_mark_fetch(on_sent, mark_fetch, sizeof(mark_fetch)), sizeof(mark_fetch)),
        mark_fetch_types, OBX_MARK_FETCH_NPARAMS);
    ADD("recovery match", obx_store_sql_recover(on_sent, recover, sizeof(recover)), recover_types,
        OBX_RECOVER_NPARAMS);
    ADD("log recovery match", obx_store_sql_log_recover(), log_recover_types,
        OBX_RECOVER_LOG_NPARAMS);
    ADD("recovery plan", obx_store_sql_recovery_plan(), plan_types, OBX_PLAN_NPARAMS);
    ADD("claim slots", obx_store_sql_claim_slots(), claim_types, OBX_CLAIM_NPARAMS);
    ADD("backlog since", obx_store_sql_backlog_since(), backlog_types, OBX_BACKLOG_NPARAMS);
    ADD("log backlog", obx_store_sql_backlog_log(), backlog_types + OBX_BACKLOG_SHARDS, 1);
    ADD("purge", obx_store_sql_purge(), purge_types, OBX_PURGE_NPARAMS);
    ADD("upkeep", OBX_STORE_SQL_UPKEEP_PARTITIONS, upkeep_types, OBX_UPKEEP_NPARAMS);
    ADD("reclaim", OBX_STORE_SQL_RECLAIM_PARTITIONS, reclaim_types, OBX_RECLAIM_NPARAMS);
    ADD("dead list", obx_store_sql_dead_list(), dead_list_types, OBX_DEAD_TOOL_NPARAMS);
    ADD("dead existing", obx_store_sql_dead_existing(), dead_ids_types, OBX_DEAD_TOOL_NPARAMS);
    ADD("dead retry", obx_store_sql_dead_retry(), dead_ids_types, OBX_DEAD_TOOL_NPARAMS);
    ADD("dead drop", obx_store_sql_dead_drop(), dead_ids_types, OBX_DEAD_TOOL_NPARAMS);
    ADD("replay plan", obx_store_sql_replay_plan(), replay_types, OBX_REPLAY_NPARAMS);
    ADD("replay", obx_store_sql_replay(), replay_types, OBX_REPLAY_NPARAMS);
#undef ADD
    return n;
}
