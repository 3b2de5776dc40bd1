/*
 * metrics: counter and histogram types, and the rendering of everything in
 * the Prometheus text format for GET /metrics.
 *
 * No global: each module keeps its own counters (kafka.c per delivery
 * report, pg.c per reconnect and fetch, recovery.c and maint.c their rows)
 * and exposes getters; health.c reads them all at render time into one
 * struct obx_metrics_gauges. metrics.c includes no client library.
 */
#ifndef OUTBOXD_METRICS_H
#define OUTBOXD_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "outboxd/buf.h"

#define OBX_HIST_MAX_BOUNDS 16
/* Distinct label values kept per labelled counter; later ones are counted
 * under "_other" so a stream of odd topic names cannot grow memory. */
#define OBX_LABELS_MAX 1024

struct obx_histogram {
    const double *bounds; /* upper bounds, ascending */
    size_t n_bounds;
    uint64_t counts[OBX_HIST_MAX_BOUNDS + 1]; /* per bucket; the last is +Inf */
    double sum;
    uint64_t count;
};

struct obx_label_counter {
    char *label; /* owned */
    uint64_t value;
};

struct obx_labelled {
    struct obx_label_counter *items;
    size_t n, cap;
    size_t last; /* last hit: events come in runs of one label */
};

/* Adds one to the counter of `label` (copied). */
void obx_labelled_inc(struct obx_labelled *l, const char *label);
void obx_labelled_free(struct obx_labelled *l);

/* Bucket bounds: seconds from a row's insert to its acknowledgement, and
 * rows per fetch. */
void obx_histogram_init_latency(struct obx_histogram *h);
void obx_histogram_init_batch(struct obx_histogram *h);
void obx_histogram_observe(struct obx_histogram *h, double v);
/* Observes the age, now, of a row created at `created_us` (Unix us). */
void obx_histogram_observe_age(struct obx_histogram *h, int64_t created_us);

/* Everything /metrics shows, read from its owner at render time. Pointers
 * may be NULL (nothing to show yet). */
struct obx_metrics_gauges {
    const struct obx_labelled *published;      /* records acknowledged, by topic */
    const struct obx_labelled *publish_errors; /* failed produce or delivery, by reason */
    const struct obx_histogram *ack_latency;   /* seconds from created_at to acknowledgement */
    const struct obx_histogram *batch_rows;    /* rows per fetch */
    uint64_t pg_reconnects;                    /* connection attempts after the first */
    uint64_t pg_history_changes;               /* obx_pg_history_changes */
    long pg_timeline;                          /* obx_pg_timeline */
    uint64_t rows_recovered;                   /* rows the recovery pass found in Kafka */
    uint64_t ids_skipped;                      /* passes that moved the ids past Kafka's */
    uint64_t rows_purged;                      /* rows deleted by retention */
    const char *librdkafka_version, *libuv_version;
    int libpq_version;
    size_t in_flight;
    size_t in_flight_limit;
    size_t keys_held_back;
    /* relay.shards: slots, those this relay owns, the relays sharing them
     * (0 before the first claim of a session), slots taken or given back. */
    int slots, slots_owned, slot_members;
    uint64_t slot_moves;
    uint64_t rows_marked;
    uint64_t fetches_keyset, fetches_full;
    uint64_t rows_dead_lettered;
    uint64_t txn_committed, txn_aborted; /* relay.transactions */
    int64_t backlog_rows;                /* -1 = not known yet */
    double lag_seconds;                  /* age of the oldest unsent row; < 0 = not known */
    /* The same by slot (relay.shards above 1, on the relay that counts the
     * backlog: the owner of slot 0): slot_count entries, 0 = not known. */
    int slot_count;
    const int64_t *slot_backlog_rows, *slot_lag_ms;
    bool postgres_connected;
    bool kafka_connected;
    bool ready;
    bool standby; /* waiting for the relay lock another outboxd holds */
    bool draining;
    double start_time;              /* Unix seconds */
    double last_progress;           /* Unix seconds of the relay's last progress */
    bool stalled;                   /* /livez fails: no progress while dependencies are reachable */
    bool recovering;                /* a recovery pass runs */
    uint64_t recovery_records_read; /* by the running (or last) pass */
    size_t recovery_partitions_left;
};

/* Appends the exposition (text format 0.0.4) to `out`. */
void obx_metrics_render(struct obx_buf *out, const struct obx_metrics_gauges *g);

#endif
