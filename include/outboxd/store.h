/*
 * store: every statement outboxd runs on the outbox schema (sql/), in one
 * place, each shared fragment written once. The modules that run them (pg,
 * recovery, maint, check, bench/) own connections and results, not SQL.
 *
 * Each statement's parameters are named by an enum below: a module puts a
 * value at its name's index of the array it hands libpq, never at a "$N"
 * counted by hand, and store.c keeps each statement's parameter types in
 * a table that a unit test checks against every "$N::type" in its SQL.
 * The fetch's columns are enum obx_fetch_col (record.h); every other
 * statement names its columns, and the modules read them by those names
 * (obx_store_col), never by position.
 */
#ifndef OUTBOXD_STORE_H
#define OUTBOXD_STORE_H

#include <libpq-fe.h>
#include <stdbool.h>
#include <stddef.h>

/* Column `name` of row `row` of a statement's result ("" and a logged bug
 * when the statement has no such column). */
const char *obx_store_col(const PGresult *res, int row, const char *name);
/* The same column is NULL. */
bool obx_store_col_null(const PGresult *res, int row, const char *name);
/* The same column is boolean true ("t"). */
bool obx_store_col_true(const PGresult *res, int row, const char *name);

/* ---- parameters ---- */

/* One parameter: its name (for messages) and its SQL type. */
struct obx_store_param {
    const char *name;
    const char *type;
};

/* Groups of parameters that several statements take, each at an index of
 * its own in them. The stored Kafka offsets: one element per partition. */
enum obx_offsets_param {
    OBX_OFFSETS_TOPICS,     /* text[] */
    OBX_OFFSETS_PARTITIONS, /* int[] */
    OBX_OFFSETS_OFFSETS,    /* bigint[]: the highest acknowledged offset */
    OBX_OFFSETS_NPARAMS
};
/* The slots a relay publishes (relay.shards, sql/008): the rows it reads
 * and the offsets it stores are those of its slots. */
enum obx_slots_param {
    OBX_SLOTS_SHARDS, /* int: relay.shards */
    OBX_SLOTS_OWNED,  /* int[]: the slots owned; NULL: every row (relay.shards = 1) */
    OBX_SLOTS_NPARAMS
};
/* Rows moved to the dead letters. */
enum obx_dead_param {
    OBX_DEAD_IDS,     /* bigint[] */
    OBX_DEAD_REASONS, /* text[] */
    OBX_DEAD_NPARAMS
};
/* Log mode's held keys: one element per key held back behind a refused
 * row (key NULL: that row alone), and the rows of those keys published
 * since. */
enum obx_held_param {
    OBX_HELD_TOPICS,    /* text[] */
    OBX_HELD_KEYS,      /* text[] */
    OBX_HELD_FROM,      /* bigint[]: the refused row's id */
    OBX_HELD_ALSO_SENT, /* bigint[] */
    OBX_HELD_NPARAMS
};

/* The keyset fetch, and (from OBX_FETCH_LOG_HELD) log mode's full fetch. */
enum obx_fetch_param {
    OBX_FETCH_AFTER,       /* bigint: the highest id handed out */
    OBX_FETCH_LIMIT,       /* int: most rows */
    OBX_FETCH_HELD_TOPICS, /* text[]: keys held back behind a refused row, */
    OBX_FETCH_HELD_KEYS,   /* text[] */
    OBX_FETCH_HELD_IDS,    /* bigint[]: and that row's id */
    OBX_FETCH_MAX_BYTES,   /* int: most payload bytes per row */
    OBX_FETCH_SLOTS,       /* enum obx_slots_param: only rows of these slots */
    OBX_FETCH_SNAPSHOT = OBX_FETCH_SLOTS + OBX_SLOTS_NPARAMS, /* pg_snapshot: of the fetch
                                                               * that handed AFTER out */
    OBX_FETCH_NPARAMS,
    OBX_FETCH_LOG_HELD = OBX_FETCH_NPARAMS, /* the stored cursor's: enum obx_held_param */
    OBX_FETCH_LOG_NPARAMS = OBX_FETCH_LOG_HELD + OBX_HELD_NPARAMS
};
/* The full fetch of mark and delete mode takes the keyset fetch's LIMIT ..
 * SLOTS: a module passes values + OBX_FETCH_FULL_FIRST. */
#define OBX_FETCH_FULL_FIRST   OBX_FETCH_LIMIT
#define OBX_FETCH_FULL_NPARAMS (OBX_FETCH_SNAPSHOT - OBX_FETCH_LIMIT)

/* The mark; the plain mark takes the first OBX_MARK_PLAIN_NPARAMS. */
enum obx_mark_param {
    OBX_MARK_RANGES,  /* bigint[][]: the acknowledged ids as {first, last} ranges */
    OBX_MARK_OFFSETS, /* enum obx_offsets_param */
    OBX_MARK_SLOTS = OBX_MARK_OFFSETS + OBX_OFFSETS_NPARAMS, /* enum obx_slots_param: the
                                                              * offsets are theirs */
    OBX_MARK_PLAIN_NPARAMS = OBX_MARK_SLOTS + OBX_SLOTS_NPARAMS,
    OBX_MARK_DEAD = OBX_MARK_PLAIN_NPARAMS, /* enum obx_dead_param */
    OBX_MARK_NPARAMS = OBX_MARK_DEAD + OBX_DEAD_NPARAMS
};
/* The plain mark and the keyset fetch in one: the fetch's, then the plain
 * mark's from OBX_MARK_FETCH_MARK. */
#define OBX_MARK_FETCH_MARK    OBX_FETCH_NPARAMS
#define OBX_MARK_FETCH_NPARAMS (OBX_FETCH_NPARAMS + OBX_MARK_PLAIN_NPARAMS)

/* Log mode's cursor row. */
enum obx_cursor_param {
    OBX_CURSOR_BATCH,    /* bigint: the batch number */
    OBX_CURSOR_HWM,      /* bigint: the highest id handed out */
    OBX_CURSOR_SNAPSHOT, /* pg_snapshot: of the fetch that handed HWM out */
    OBX_CURSOR_HELD,     /* enum obx_held_param */
    OBX_CURSOR_OFFSETS = OBX_CURSOR_HELD + OBX_HELD_NPARAMS,       /* enum obx_offsets_param */
    OBX_CURSOR_RESTART = OBX_CURSOR_OFFSETS + OBX_OFFSETS_NPARAMS, /* boolean: first of a run */
    OBX_CURSOR_DEAD,                                               /* enum obx_dead_param */
    OBX_CURSOR_SLOTS = OBX_CURSOR_DEAD + OBX_DEAD_NPARAMS, /* enum obx_slots_param: the row's
                                                            * slots (NULL: every row) */
    OBX_CURSOR_NPARAMS = OBX_CURSOR_SLOTS + OBX_SLOTS_NPARAMS
};

/* The recovery pass's match (log mode's takes the first
 * OBX_RECOVER_MATCH_NPARAMS): the records found in Kafka. */
enum obx_recover_param {
    OBX_RECOVER_IDS,     /* bigint[]: their outbox-id */
    OBX_RECOVER_TOPICS,  /* text[] */
    OBX_RECOVER_KEYS,    /* text[] */
    OBX_RECOVER_DIGESTS, /* text[]: sha256 of the value, hex */
    OBX_RECOVER_MATCH_NPARAMS,
    OBX_RECOVER_OFFSETS = OBX_RECOVER_MATCH_NPARAMS,               /* enum obx_offsets_param */
    OBX_RECOVER_SLOTS = OBX_RECOVER_OFFSETS + OBX_OFFSETS_NPARAMS, /* enum obx_slots_param */
    OBX_RECOVER_NPARAMS = OBX_RECOVER_SLOTS + OBX_SLOTS_NPARAMS,
    /* Log mode's match: the found records, then the pass's slots. */
    OBX_RECOVER_LOG_SLOTS = OBX_RECOVER_MATCH_NPARAMS,
    OBX_RECOVER_LOG_NPARAMS = OBX_RECOVER_LOG_SLOTS + OBX_SLOTS_NPARAMS
};
/* The recovery plan: the pass's slots (enum obx_slots_param). */
enum obx_plan_param { OBX_PLAN_SLOTS, OBX_PLAN_NPARAMS = OBX_PLAN_SLOTS + OBX_SLOTS_NPARAMS };
/* A relay's claim of its slots (outbox.claim_slots). */
enum obx_claim_param {
    OBX_CLAIM_SHARDS,    /* int: relay.shards */
    OBX_CLAIM_GIVE_BACK, /* int[]: slots given back */
    OBX_CLAIM_TAKE,      /* boolean: take free slots up to the share */
    OBX_CLAIM_FENCED,    /* int[]: lost owners this session fenced (relay.transactions) */
    OBX_CLAIM_NPARAMS
};

/* The backlog count from where the last one left off. */
enum obx_backlog_param {
    OBX_BACKLOG_FLOOR,  /* bigint */
    OBX_BACKLOG_XMIN,   /* xid8 */
    OBX_BACKLOG_SHARDS, /* int: relay.shards; above 1, by_slot is counted too */
    OBX_BACKLOG_NPARAMS
};
/* Retention's round. */
enum obx_purge_param {
    OBX_PURGE_AFTER,     /* bigint: the last id looked at */
    OBX_PURGE_BATCH,     /* int: rows a round */
    OBX_PURGE_PERIOD_MS, /* bigint: retention.period */
    OBX_PURGE_NPARAMS
};
/* The partitions' upkeep. */
enum obx_upkeep_param {
    OBX_UPKEEP_ROWS,  /* bigint: ids per partition */
    OBX_UPKEEP_AHEAD, /* int: partitions ahead of the last id drawn */
    OBX_UPKEEP_NPARAMS
};
/* Log mode's reclaim. */
enum obx_reclaim_param {
    OBX_RECLAIM_KEEP_MS, /* bigint: retention.period */
    OBX_RECLAIM_NPARAMS
};
/* `outboxd dead`: a list (its LIMIT), or ids to retry, drop or check. */
enum obx_dead_tool_param {
    OBX_DEAD_TOOL_ARG, /* int for the list, bigint[] ids for the others */
    OBX_DEAD_TOOL_NPARAMS
};
/* `outboxd replay`. */
enum obx_replay_param {
    OBX_REPLAY_TOPIC, /* text */
    OBX_REPLAY_FROM,  /* bigint: lowest id */
    OBX_REPLAY_TO,    /* bigint: highest id */
    OBX_REPLAY_SINCE, /* timestamptz: created at or after */
    OBX_REPLAY_NPARAMS
};

/* A statement with parameters, for the test that checks each "$N::type" of
 * its SQL against its table. */
struct obx_store_statement {
    const char *name;
    const char *sql;
    const struct obx_store_param *params;
    int nparams;
};
#define OBX_STORE_MAX_STATEMENTS 24
/* Every statement that takes parameters, built for mode `on_sent`
 * (OBX_ON_SENT_*), into out (OBX_STORE_MAX_STATEMENTS of room). Returns how
 * many. The SQL lives in static storage the next call reuses: for tests. */
int obx_store_statements(int on_sent, struct obx_store_statement *out);

/* The schema this outboxd needs: sql/00N_*.sql up to N. */
#define OBX_SCHEMA_VERSION 16

/* One row, one column: the schema's version (0 if no migration ran). */
#define OBX_STORE_SQL_SCHEMA_VERSION                                                               \
    "SELECT coalesce(max(version), 0) FROM outbox.schema_migrations"
/* Rows read by index, in id order, so that a plan does not depend on the
 * statistics: with stale ones (a burst into a table analyzed while nearly
 * empty) the planner takes the keyset fetch's `id > hwm` for a few hundred
 * rows and reads all of them (a bitmap or sequential scan, then a sort), 60
 * ms instead of 0.5 for each batch of 1000, until autovacuum analyzes. And
 * no JIT compilation: a generic plan's estimates (a mark's ranges taken for
 * 1000 of 22,000 rows each) pass jit_above_cost, and compiling each run took
 * 260 ms a batch. For the relay's and the maintenance session. */
#define OBX_STORE_SQL_READ_BY_INDEX                                                                \
    "SET enable_seqscan = off; SET enable_bitmapscan = off; SET jit = off"
/* The planner settings of the relay's session, which runs only the
 * statements below. Its prepared statements are planned once, not for every
 * execution: planning the keyset fetch and the mark (the selectivity of each
 * of the 1000 ids) took a third of their statement's time. No parallel
 * workers for a batch of 1000. No sort where an index gives the order: with
 * statistics that say nearly every row is sent (a table marked for hours),
 * both indexes of unsent rows look empty, and the keyset fetch's late part
 * (store.c, part n) was planned on the (id) one, sorted after: a walk of
 * every entry up to the cursor, which a held xmin horizon leaves in the
 * index for each row sent since (56 ms a fetch at 150,000; the relay's p99
 * 5x in five minutes). Its (xid, id) order comes only from the other one. */
#define OBX_STORE_SQL_PLANNER_SETTINGS                                                             \
    "SET plan_cache_mode = force_generic_plan; SET max_parallel_workers_per_gather = "             \
    "0; SET enable_sort = off; " OBX_STORE_SQL_READ_BY_INDEX
/* One row, one column: how many ids of outbox.events a session draws at
 * once (the identity's CACHE; 1 unless someone raised it). */
#define OBX_STORE_SQL_ID_CACHE                                                                     \
    "(SELECT coalesce((SELECT seqcache FROM pg_catalog.pg_sequence WHERE seqrelid ="               \
    " pg_get_serial_sequence('outbox.events', 'id')::regclass), 1))"
/* The relay session's first statement. One row: version (the schema's),
 * in_recovery (a hot standby: the relay publishes only from a primary,
 * whose snapshots list every running writer), id_cache. */
/* A setting only the relay's set-up gives its session, to a value of its
 * own: a statement that reads another value ran in another server session
 * (a pooler in transaction pooling). */
#define OBX_STORE_SESSION_SETTING "outboxd.session"

#define OBX_STORE_SQL_SETUP_CHECK                                                                  \
    "SELECT coalesce(max(version), 0) AS version, pg_is_in_recovery() AS "                         \
    "in_recovery, " OBX_STORE_SQL_ID_CACHE " AS id_cache, pg_backend_pid() AS backend_pid "        \
    "FROM outbox.schema_migrations"
/* The history a primary is on, read after the setup, and kept in
 * outbox.history (sql/011) when it changed; a server that refuses it (a
 * managed service may revoke pg_control_system() or lack
 * pg_current_wal_lsn()) only goes without the check. One row: system_id
 * (initdb's identifier: a restored dump or a logical copy has another),
 * timeline (a promoted standby and a point-in-time restore start a new
 * one; read from the WAL file being written, which changes at promotion,
 * where pg_control_checkpoint() waits for a checkpoint), and what
 * outbox.history held before (stored_system_id NULL: nothing yet). */
#define OBX_STORE_SQL_HISTORY                                                                      \
    "WITH cur AS (SELECT (SELECT system_identifier FROM pg_control_system())::text AS system_id,"  \
    "   ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int AS timeline),"  \
    " stored AS (SELECT system_id, timeline FROM outbox.history),"                                 \
    " keep AS (INSERT INTO outbox.history AS h (system_id, timeline)"                              \
    "   SELECT system_id, timeline FROM cur ON CONFLICT (one) DO UPDATE"                           \
    "   SET system_id = excluded.system_id, timeline = excluded.timeline, seen_at = now()"         \
    "   WHERE (h.system_id, h.timeline) IS DISTINCT FROM (excluded.system_id, excluded.timeline))" \
    " SELECT c.system_id, c.timeline, s.system_id AS stored_system_id,"                            \
    "        s.timeline AS stored_timeline, current_database() AS dbname"                          \
    " FROM cur c LEFT JOIN stored s ON true"
/* After a recovery pass: moves the id identity past $1, the highest
 * outbox-id it read in Kafka, if the database would hand that id out
 * again (sql/012). One row: the next id, NULL if nothing moved. */
#define OBX_STORE_SQL_SKIP_IDS "SELECT outbox.skip_ids_past($1::bigint)"
/* Gives unsent rows that carry another cluster's xid (a restore, logical
 * replication) this one's, so the keyset fetch does not take them for late
 * commits for ever (sql/006), after log mode's cursor was rebased if it is
 * another cluster's (sql/015). A relay alone (relay.shards = 1) runs it
 * once it holds the relay lock, OBX_STORE_REPAIR_CHUNK rows a statement,
 * and again while a statement repaired that many: a restored outbox of
 * millions of rows would not fit one statement's timeout. One row: how
 * many (column 0), or -1 while log mode's cursor is being rebased (ask
 * again). */
#define OBX_STORE_REPAIR_CHUNK 10000
#define OBX_STORE_STR_(x)      #x
#define OBX_STORE_STR(x)       OBX_STORE_STR_(x)
#define OBX_STORE_SQL_REPAIR_XIDS                                                                  \
    "SELECT outbox.repair_writer_xids(1, NULL, " OBX_STORE_STR(OBX_STORE_REPAIR_CHUNK) ")"
/* A slot owner of outbox.slot_owners (alias o) whose session is gone: no
 * session of its pid that began before it took the slot. */
#define OBX_STORE_SQL_OWNER_GONE(o)                                                                \
    "NOT EXISTS (SELECT FROM pg_stat_activity a WHERE a.pid = " o ".owner_pid"                     \
    "            AND a.backend_start <= " o ".owned_since)"
/* The same with relay.transactions, and the sessions of relays with
 * relay.shards above 1 whose transactional producers it fences before its
 * pass (column 1, "12,34"): the owners of slots that lost them without
 * giving them back, and those before them nobody fenced (sql/013). Such
 * an owner's session is gone (this relay holds the lock they share),
 * unless its pid is another session's now. */
/* clang-format off */
#define OBX_STORE_SQL_REPAIR_XIDS_AND_LOST_OWNERS                                                  \
    "SELECT outbox.repair_writer_xids(1, NULL, " OBX_STORE_STR(OBX_STORE_REPAIR_CHUNK) "),"        \
    "       array_to_string(ARRAY("                                                                \
    "         SELECT DISTINCT l.pid FROM outbox.slot_owners o,"                                    \
    "           LATERAL (SELECT o.owner_pid"                                                       \
    "                    WHERE NOT o.given_back AND " OBX_STORE_SQL_OWNER_GONE("o")                \
    "                    UNION ALL SELECT unnest(o.unfenced)) AS l(pid)"                           \
    "         WHERE o.shards > 1 AND l.pid <> pg_backend_pid()"                                    \
    "         ORDER BY 1 LIMIT 64), ',') AS lost_slot_owners"
/* clang-format on */
/* The partitions of outbox.events, as a parenthesised list of oids (for
 * "relid IN"): statistics are kept per partition, none for the parent. */
#define OBX_STORE_SQL_EVENTS_PARTITIONS                                                            \
    "(SELECT relid FROM pg_partition_tree('outbox.events') WHERE isleaf)"
/* One row, one column: 't' if the schema exists at all. */
#define OBX_STORE_SQL_HAS_SCHEMA "SELECT to_regclass('outbox.schema_migrations') IS NOT NULL"

/* The migration file that brings a database from `version` to the next
 * one (sql/001_outbox.sql for a missing schema). */
const char *obx_store_next_migration(long version);

/* Whether a database at schema `version` (-1: no outbox schema at all) can
 * be used; if not, one line into buf naming the file to apply. `db` names
 * the database (NULL: "this database"). Returns 0 if usable. */
int obx_store_schema_problem(long version, const char *db, char *buf, size_t len);

/* Whether an id cache of `cache` keeps per-key order (only 1 does); if not,
 * one line into buf saying how to set it back. Returns 0 if fine. */
int obx_store_id_cache_problem(long cache, char *buf, size_t len);

/* The fetches (binary results: see record.h for the columns, and one extra
 * row without an id that carries the snapshot as text). The keyset fetch: $1
 * the highest id handed out, $2 most rows, $3 text[] / $4 text[] / $5
 * bigint[] keys held back (topic, key, behind id), $6 most payload bytes per
 * row (larger ones come as NULL with their length), $7 relay.shards and $8
 * int[] the slots whose rows it reads (NULL: all), $9 the snapshot of the
 * fetch that handed $1 out (enum obx_fetch_param).
 *
 * The full fetch is built into `sql` around `in_flight`, the ids in flight
 * as array text ("{1,2,3}"), and takes the keyset fetch's $2..$8 as its
 * $1..$7. NULL if out of memory or `in_flight` holds anything but digits,
 * signs, commas and braces. */
struct obx_buf;
const char *obx_store_sql_fetch(struct obx_buf *sql, const char *in_flight);
const char *obx_store_sql_fetch_keyset(void);

/* Log mode's full fetch (relay.on_sent = log): every row the stored cursor
 * does not cover but those in flight. Built as obx_store_sql_fetch is; takes
 * the keyset fetch's $1..$9 with $1 and $9 the stored cursor's hwm and
 * snapshot, then $10 text[] / $11 text[] / $12 bigint[] its held keys
 * (topic, key or NULL, from id) and $13 bigint[] the rows of those
 * published. */
const char *obx_store_sql_fetch_log(struct obx_buf *sql, const char *in_flight);
/* Log mode's full fetch that tests each row against the cursor rows about
 * its slot (sql/009): parameters as the full fetch's (values +
 * OBX_FETCH_FULL_FIRST). */
const char *obx_store_sql_fetch_log_exact(struct obx_buf *sql, const char *in_flight);
/* Log mode's write: one cursor row (outbox.advance_cursor's $1..$11: batch,
 * hwm, snapshot, held topics / keys / from ids, also sent, offsets' topics /
 * partitions / offsets, restart; $14 relay.shards and $15 the slots it is
 * about, NULL for every row) and the dead letters it covers ($12 bigint[]
 * ids, $13 text[] reasons). One row: 1 (0 if the session holds none of the
 * slots), dead letters stored. */
const char *obx_store_sql_log_write(void);
/* What the stored cursor says, a kind per row (see store.c). Columns: kind,
 * a, b, c. */
const char *obx_store_sql_log_state(void);
/* The recovery match of log mode: as obx_store_sql_recover, for the rows
 * the stored cursor does not cover; writes nothing and returns the matched
 * ids. */
const char *obx_store_sql_log_recover(void);

/* The buffers the relay builds its marks in (pg.c): the unit test builds
 * each statement in one of these sizes and fails on a cut one. */
#define OBX_STORE_MARK_SQL_LEN       2048
#define OBX_STORE_MARK_PLAIN_SQL_LEN 2048
#define OBX_STORE_MARK_FETCH_SQL_LEN 8192

/* The mark: one statement, so one transaction on its own (enum
 * obx_mark_param): the acknowledged ids as ranges (obx_pg_array_add_ranges
 * in pg.h), the highest offset per partition, stored for each of the
 * relay's slots, then the dead letters and reasons. One row: confirmed,
 * offsets stored, dead-lettered. `on_sent` is OBX_ON_SENT_*. */
const char *obx_store_sql_mark(int on_sent, char *buf, size_t len);
/* The same without dead letters (the usual case): no dead-letter branches
 * for Postgres to run, and no rows back. */
const char *obx_store_sql_mark_plain(int on_sent, char *buf, size_t len);
/* The plain mark and the keyset fetch in one statement: the keyset fetch's
 * parameters, then the plain mark's. Returns the fetch's rows. */
const char *obx_store_sql_mark_fetch(int on_sent, char *buf, size_t len);

/* The recovery pass's marking of one chunk (enum obx_recover_param): the
 * records found (outbox id, topic, key, sha256 hex of the value), how far
 * each partition was read and the pass's slots, as the mark's. Marks the
 * rows whose id, topic, key and payload all match. One row: confirmed,
 * found, offsets stored. */
const char *obx_store_sql_recover(int on_sent, char *buf, size_t len);

/* The recovery plan, any mode, for the pass's slots (enum
 * obx_plan_param): topics with unpublished rows of them, each stored
 * (partition, offset) of them (the higher of outbox.kafka_offsets and log
 * mode's cursor rows), and the range of their unpublished ids. Columns:
 * topic, kafka_partition, stored_offset (NULL both when none is stored),
 * id_lo, id_hi. */
const char *obx_store_sql_recovery_plan(void);
/* A relay's claim of its slots (enum obx_claim_param). One row: owned (the
 * slots held after it, comma-separated), members (relays sharing them),
 * share (this relay's fair part), free (slots nobody holds), other_shards
 * (NULL, or the relay.shards of a member that counts differently),
 * repaired (rows of the slots taken that carried another cluster's xid,
 * given this one's: sql/006). */
const char *obx_store_sql_claim_slots(void);

/* The backlog gauges (any mode, outbox.unpublished). Columns: rows,
 * oldest_seconds (age of the oldest). */
const char *obx_store_sql_backlog(void);
/* Log mode's backlog count ($1 relay.shards): rows, oldest_seconds,
 * by_slot as obx_store_sql_backlog_since's. */
const char *obx_store_sql_backlog_log(void);
/* The same, read from the floor and xmin the last one returned (see
 * store.c); parameters floor, xmin; columns: rows, oldest_seconds,
 * next_floor, next_xmin. The first count passes the lowest bigint and xmin
 * 0. Rows log mode's newest cursor row covers are not counted. */
const char *obx_store_sql_backlog_since(void);

/* Partitions of outbox.events ahead of the ids: $1 ids per partition, $2
 * partitions ahead. One row: how many were created. */
#define OBX_STORE_SQL_UPKEEP_PARTITIONS "SELECT outbox.upkeep_partitions($1::bigint, $2::int)"
/* Log mode's reclaim: $1 retention in ms. One row: partitions dropped or
 * emptied. */
#define OBX_STORE_SQL_RECLAIM_PARTITIONS                                                           \
    "SELECT outbox.reclaim_partitions($1::bigint * interval '1 millisecond')"
/* How many partitions the upkeep keeps ahead of the last id drawn. */
#define OBX_STORE_PARTITIONS_AHEAD 2

/* `outboxd status` with relay.shards above 1: unsent rows by slot ($1 the
 * shards): slot, rows, oldest_seconds. */
const char *obx_store_sql_waiting_by_slot(void);
/* Unpublished rows per topic (--check, status). Columns: topic, rows. */
const char *obx_store_sql_waiting(void);

/* Retention: $1 cursor (last id looked at), $2 batch size, $3 period in ms.
 * Columns: last_id (the highest id looked at), deleted, recent (rows
 * created within the period). */
const char *obx_store_sql_purge(void);

/* ---- the operator's tools (tools.c) ---- */

/* Relay sessions: the holder of the relay lock and the standbys trying it.
 * Columns: pid, application_name, client, started (UTC), active (t/f),
 * session_seconds. */
const char *obx_store_sql_relay_sessions(void);
/* Dead letters. Columns: rows, newest_seconds (since the newest). */
const char *obx_store_sql_dead_summary(void);
/* The session holding back the xmin horizon the most. Columns: pid,
 * xmin_age, application_name, state, transaction_seconds, query (60
 * characters). */
const char *obx_store_sql_oldest_xmin(void);
/* The replication slot holding back the horizon the most. Columns:
 * slot_name, xmin_age. */
const char *obx_store_sql_oldest_slot(void);
/* outbox.events' tuples. Columns: live, dead, last_vacuum (UTC or
 * "never"). */
const char *obx_store_sql_events_tuples(void);
/* Up to $1 dead letters. Columns: id, topic, key, no_key (t/f), reason,
 * age_seconds, bytes. */
const char *obx_store_sql_dead_list(void);
/* Which of the ids $1 are dead letters. */
const char *obx_store_sql_dead_existing(void);
/* Puts the dead letters $1 back in outbox.events with their ids; returns
 * their ids. */
const char *obx_store_sql_dead_retry(void);
/* Deletes the dead letters $1; returns their ids. */
const char *obx_store_sql_dead_drop(void);
/* Sent rows of topic $1 with id in [$2, $3] created at or after $4.
 * Columns: rows, first_id, last_id, first_created, last_created (UTC). */
const char *obx_store_sql_replay_plan(void);
/* Marks those rows unsent again (the relay publishes them again, ids
 * kept); returns how many. */
const char *obx_store_sql_replay(void);

#endif
