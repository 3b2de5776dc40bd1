/*
 * recovery: the start-up pass that makes kill -9 safe (DESIGN 3.4).
 *
 * A relay killed after Kafka stored a record but before the row was marked
 * would, on restart, publish that row again. So before publishing anything,
 * each process:
 *
 *   1. plans: the topics of unsent rows, and for each of their partitions the
 *      last offset a mark transaction stored (outbox.kafka_offsets);
 *   2. scans each partition from that offset + 1 (or its start, if none is
 *      stored) to its end, collecting every record's outbox-id, key and a
 *      SHA-256 of its value (blocking consumer calls, so in libuv's thread
 *      pool, never on the loop thread), in chunks of a few seconds;
 *   3. after each chunk, in one transaction, marks each still-unsent row
 *      whose id, topic, key and payload match a record found (so an
 *      outbox-id from another outbox sharing the topic is never taken for
 *      ours), and stores how far each partition was read. Progress is thus
 *      durable: a failed attempt or a restart goes on from there, and there
 *      is no total time limit (a chunk that reads nothing for 30 s fails).
 *
 * Topic metadata errors other than "unknown topic" fail the pass (it is
 * retried): not knowing is not absence. A stored partition whose topic no
 * longer exists is skipped; a stored offset past a partition's end (the
 * topic was re-created) reads that partition from its start.
 *
 * Limits, stated in the README: records removed by retention before the
 * restart cannot be found (their rows are published again); a partition with
 * no stored offset is scanned from its start; a record still being
 * replicated when the previous process died and not yet visible when the
 * scan reads the end can be published twice.
 */
#ifndef OUTBOXD_RECOVERY_H
#define OUTBOXD_RECOVERY_H

#include <stdbool.h>
#include <stddef.h>

#include <libpq-fe.h>
#include <uv.h>

#include "outboxd/config.h"
#include "outboxd/pg.h"
#include "outboxd/relay.h"

struct obx_recovery_callbacks {
    /* The pass ended: ok = rows published by an earlier run are marked and
     * publishing may start. Not called after obx_recovery_abort(). */
    void (*done)(bool ok, void *arg);
    /* Log mode, just before done(true): the stored cursor and the records
     * found for rows it does not cover. Non-zero: the pass fails. */
    int (*log_state)(const struct obx_log_state *st, void *arg);
};

struct obx_recovery;

/* Keeps pointers to cfg and pg: both must outlive the recovery. */
int obx_recovery_new(uv_loop_t *loop, const struct obx_config *cfg, struct obx_pg *pg,
                     const struct obx_recovery_callbacks *cb, void *arg,
                     struct obx_recovery **out) OBX_WARN_UNUSED;

/* Starts a pass over the rows of `owned_slots` (array text of slots of
 * relay.shards = `shards`; NULL: every row). pg must be READY and left to
 * the recovery until `done`. Returns 0, or -1 if it could not start (a pass
 * still winding down, or the statement could not be sent). */
int obx_recovery_start(struct obx_recovery *rec, int shards, const char *owned_slots);

/* A counter that grows while a pass moves (records read, statements
 * answered): the stall check reads it from the loop thread. */
uint64_t obx_recovery_progress(const struct obx_recovery *rec);

/* Progress of the pass under way (for /metrics and the log). */
bool obx_recovery_running(const struct obx_recovery *rec);
uint64_t obx_recovery_records_read(const struct obx_recovery *rec);
size_t obx_recovery_partitions_left(const struct obx_recovery *rec);

/* The connection was lost: the pass is abandoned without calling `done`. */
void obx_recovery_abort(struct obx_recovery *rec);

/* Frees the recovery, once a scan still running in the thread pool ends. */
void obx_recovery_close(struct obx_recovery *rec);

/* Lower-case hex SHA-256 of data (as Postgres' encode(sha256(x), 'hex')). */
int obx_sha256_hex(const void *data, size_t len, char out[65]);

/* True if s[0..len) is valid UTF-8 without NUL bytes (storable as text). */
bool obx_valid_text(const char *s, size_t len);

/* For /metrics: rows found in Kafka and marked, over all passes. */
uint64_t obx_recovery_rows_recovered(const struct obx_recovery *rec);
/* Passes that found an id in Kafka the database would hand out again, and
 * moved its ids past it. */
uint64_t obx_recovery_ids_skipped(const struct obx_recovery *rec);

#endif
