/*
 * metrics: the process's counters and histograms, and their rendering in
 * the Prometheus text format for GET /metrics.
 *
 * One global `obx_stats`, written only on the loop thread (as Redis keeps
 * its stat_* fields in `server`): modules bump it where the event happens
 * (kafka.c per delivery report, pg.c per reconnect, relay.c per
 * acknowledgement). Gauges that are states of other modules (rows in
 * flight, connected or not) are read at render time and passed in.
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

struct obx_stats {
    struct obx_labelled published;      /* records acknowledged, by topic */
    struct obx_labelled publish_errors; /* failed produce or delivery, by reason */
    struct obx_histogram ack_latency;   /* seconds from created_at to acknowledgement */
    struct obx_histogram batch_rows;    /* rows per fetch */
    uint64_t pg_reconnects;             /* connection attempts after the first */
    uint64_t rows_recovered;            /* rows the recovery pass found in Kafka */
    uint64_t rows_purged;               /* rows deleted by retention */
};

extern struct obx_stats obx_stats;

/* Sets the histogram bounds; call once before use. */
void obx_stats_init(void);
void obx_stats_free(void);

void obx_stats_published(const char *topic);
void obx_stats_publish_error(const char *reason);
void obx_histogram_observe(struct obx_histogram *h, double v);
/* Observes the latency of a row created at `created_us` (Unix microseconds)
 * that Kafka acknowledged now. */
void obx_stats_acked(int64_t created_us);

/* Point-in-time values owned by other modules. */
struct obx_metrics_gauges {
    size_t in_flight;
    size_t in_flight_limit;
    size_t keys_held_back;
    uint64_t rows_marked;
    uint64_t rows_dead_lettered;
    int64_t backlog_rows; /* -1 = not known yet */
    double lag_seconds;   /* age of the oldest unsent row; < 0 = not known */
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
