/*
 * relay: the relay cycle as an explicit state machine (DESIGN 3.2).
 *
 *   fetch committed unsent rows in id order (excluding rows already in flight)
 *   -> produce each one -> collect acknowledged ids from delivery reports
 *   -> mark them sent in one statement -> repeat.
 *
 * The relay is pure logic: it does no I/O and knows neither libuv, libpq nor
 * librdkafka. It reacts to events (obx_relay_on_*) and issues commands
 * through struct obx_relay_ops, which main.c wires to pg and kafka, and which
 * unit tests replace with fakes. Time is passed in by the caller (ms on a
 * monotonic clock).
 *
 * Every row handed to Kafka occupies a slot until it is marked; the slot
 * pointer is the Kafka message opaque, so a delivery report finds its row
 * without a lookup. The number of slots is relay.max_in_flight.
 */
#ifndef OUTBOXD_RELAY_H
#define OUTBOXD_RELAY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "outboxd/config.h"
#include "outboxd/record.h"

enum obx_relay_state {
    OBX_RELAY_WAIT_PG = 0, /* no usable Postgres connection */
    OBX_RELAY_IDLE,        /* connection idle: waiting for a wake-up, acks or a back-off */
    OBX_RELAY_FETCHING,    /* fetch query in flight */
    OBX_RELAY_MARKING,     /* mark statement in flight */
    OBX_RELAY_STOPPED,     /* shut down; ops->stopped() has been called */
};

/* Result of ops->produce. */
enum obx_produce_result {
    OBX_PRODUCE_OK = 0,
    OBX_PRODUCE_BUSY = -1,   /* local queue full: try again later, stop this batch */
    OBX_PRODUCE_FAILED = -2, /* this row cannot be produced now (e.g. too large) */
};

struct obx_relay_ops {
    /* Sends the fetch query: up to `limit` unsent rows in id order, none of
     * the `n_exclude` ids. The answer comes through obx_relay_on_fetched() or
     * obx_relay_on_query_failed(). Returns 0, or -1 if it could not be sent
     * (the relay then waits for obx_relay_on_pg_lost/ready). */
    int (*fetch)(void *io, const int64_t *exclude, size_t n_exclude, int limit);
    /* Sends the mark statement for `ids`; answer via on_marked/on_query_failed. */
    int (*mark)(void *io, const int64_t *ids, size_t n);
    /* Hands one row to Kafka with `opaque` for its delivery report. */
    enum obx_produce_result (*produce)(void *io, const struct obx_row *row, void *opaque);
    /* The relay has stopped; called once. */
    void (*stopped)(void *io, int exit_code);
};

struct obx_relay_settings {
    int batch_size;
    int max_in_flight;
    int64_t poll_interval_ms;
    int64_t retry_backoff_ms;
    int64_t shutdown_timeout_ms;
};

struct obx_relay;

void obx_relay_settings_from_config(struct obx_relay_settings *s, const struct obx_config *cfg);

/* Allocates a relay in WAIT_PG. Does not take ownership of ops or io. */
int obx_relay_new(const struct obx_relay_settings *s, const struct obx_relay_ops *ops, void *io,
                  struct obx_relay **out) OBX_WARN_UNUSED;
void obx_relay_free(struct obx_relay *r);

/* Events. `now` is monotonic milliseconds. */
void obx_relay_on_pg_ready(struct obx_relay *r, int64_t now);
void obx_relay_on_pg_lost(struct obx_relay *r, int64_t now);
void obx_relay_on_fetched(struct obx_relay *r, const struct obx_row *rows, size_t n, int64_t now);
void obx_relay_on_marked(struct obx_relay *r, int64_t now);
/* The fetch or mark statement failed but the connection is still usable. */
void obx_relay_on_query_failed(struct obx_relay *r, const char *reason, int64_t now);
/* One delivery report: `ok` = persisted by Kafka. */
void obx_relay_on_delivery(struct obx_relay *r, void *opaque, bool ok, int32_t partition,
                           int64_t offset, const char *reason, int64_t now);
/* NOTIFY arrived: new rows may be committed. */
void obx_relay_wakeup(struct obx_relay *r, int64_t now);
/* Housekeeping: poll fallback, back-offs, shutdown deadline. */
void obx_relay_tick(struct obx_relay *r, int64_t now);
/* Stop fetching; finish in-flight rows (bounded by the shutdown timeout). */
void obx_relay_shutdown(struct obx_relay *r, int64_t now);
/* Kafka cannot go on (fatal producer error): mark what was acknowledged and
 * stop with exit code 1. */
void obx_relay_fatal(struct obx_relay *r, const char *reason, int64_t now);

enum obx_relay_state obx_relay_state(const struct obx_relay *r);
const char *obx_relay_state_name(enum obx_relay_state s);
/* Rows handed to Kafka and not yet marked. */
size_t obx_relay_in_flight(const struct obx_relay *r);
/* Rows acknowledged and marked since start. */
uint64_t obx_relay_marked_total(const struct obx_relay *r);

#endif
