/*
 * maint: background work on a second Postgres connection, off the relay's
 * path: the backlog figures for /metrics, and retention (in mark mode, sent
 * rows older than retention.period are deleted in batches).
 *
 * Runs in libuv's thread pool with a blocking libpq connection of its own,
 * one job at a time, so a slow count or purge never delays a fetch or mark.
 * Results are applied on the loop thread.
 *
 * The purge walks outbox.events in id order, batch by batch, and deletes
 * only rows whose sent_at is older than the period: an unsent row is never
 * touched (sent_at IS NULL never compares as old). A round ends at the first
 * batch that holds a row created within the period, since rows with higher
 * ids are newer; so a round reads the purgeable rows plus one batch, and
 * needs no index on sent_at (which would slow every mark).
 */
#ifndef OUTBOXD_MAINT_H
#define OUTBOXD_MAINT_H

#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "outboxd/config.h"

/* Backlog refresh: at least this often apart, and at least 20 times as long
 * as the last count took, so counting stays a small share of the server. */
#define OBX_MAINT_STATS_MS 5000
/* How often the partitions ahead of the ids are looked after: at 100,000
 * rows a second, a partition of a million ids lasts 10 s, and two are kept
 * ahead. */
#define OBX_MAINT_PARTITIONS_MS 2000
/* Batches per job before yielding to let the next stats job run. */
#define OBX_MAINT_BATCHES_PER_JOB 50

struct obx_maint;

/* with_stats: keep the backlog figures fresh (only /metrics reads them). */
int obx_maint_new(uv_loop_t *loop, const struct obx_config *cfg, bool with_stats,
                  struct obx_maint **out) OBX_WARN_UNUSED;
/* Starts a job if one is due and none runs. `now` is loop milliseconds. */
void obx_maint_tick(struct obx_maint *m, int64_t now);
/* Unsent rows and the age of the oldest (by id) in seconds; -1 until known. */
int64_t obx_maint_backlog(const struct obx_maint *m);
double obx_maint_lag_seconds(const struct obx_maint *m);
/* With relay.shards above 1, the same by slot: sets *rows and *lag_ms
 * (arrays indexed by slot; age of the oldest unsent row in milliseconds)
 * and returns relay.shards; 0 while not known (or relay.shards is 1). */
int obx_maint_slot_backlog(const struct obx_maint *m, const int64_t **rows, const int64_t **lag_ms);
/* The job is not this relay's now (standing by, reconnecting, or slot 0
 * owned by another): the figures above become unknown rather than stale. */
void obx_maint_forget_stats(struct obx_maint *m);
/* Asks a running job to stop after its current statement; closes the
 * connection and frees once no job runs. */
void obx_maint_close(struct obx_maint *m);
/* For /metrics: rows deleted by retention since start. */
uint64_t obx_maint_rows_purged(const struct obx_maint *m);

#endif
