/*
 * health: what outboxd says about itself. The answers of /livez, /readyz
 * and /metrics, the readiness policy behind them, the stall check's inputs,
 * and systemd's notifications (READY=1, STOPPING=1, when NOTIFY_SOCKET is
 * set; one datagram each, no libsystemd).
 *
 * Readiness: ready when Postgres is set up, the recovery pass is done, the
 * last Kafka metadata request succeeded and no shutdown is under way. A
 * standby is ready: it does what it should, and failing the probe would take
 * the pod out of service or stall a rolling update whose old pod holds the
 * lock. Liveness: the loop turns (housekeeping ran within 10 s) and the
 * relay is not stalled (relay.stall_timeout).
 */
#ifndef OUTBOXD_HEALTH_H
#define OUTBOXD_HEALTH_H

#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "outboxd/buf.h"
#include "outboxd/config.h"
#include "outboxd/kafka.h"
#include "outboxd/maint.h"
#include "outboxd/pg.h"
#include "outboxd/recovery.h"
#include "outboxd/relay.h"

/* The modules health reads; borrowed, they must outlive it. */
struct obx_health_parts {
    uv_loop_t *loop;
    const struct obx_config *cfg;
    struct obx_pg *pg;
    struct obx_kafka *kafka;
    struct obx_relay *relay;
    struct obx_recovery *recovery;
    struct obx_maint *maint;
};

/* Embedded in its owner (no allocation); fields are health.c's. */
struct obx_health {
    struct obx_health_parts parts;
    double start_time;                /* Unix seconds */
    int64_t last_tick;                /* loop time of the last obx_health_tick */
    uint64_t recovery_seen;           /* obx_recovery_progress() at the last tick */
    bool ready_sent;                  /* READY=1 went to systemd */
    bool draining;                    /* SIGTERM/SIGINT received */
    struct obx_histogram ack_latency; /* seconds from a row's insert to Kafka's ack */
};

void obx_health_init(struct obx_health *h, const struct obx_health_parts *parts);
/* From housekeeping: liveness heartbeat, READY=1 for a standby, recovery
 * progress and the stall check. */
void obx_health_tick(struct obx_health *h, int64_t now);
/* The recovery pass succeeded: publishing may start (READY=1, once). */
void obx_health_recovered(struct obx_health *h);
/* A shutdown began: not ready any more (STOPPING=1, once). */
void obx_health_draining(struct obx_health *h);
/* Kafka acknowledged a row created at `created_us` (Unix microseconds). */
void obx_health_acked(struct obx_health *h, int64_t created_us);
/* Postgres holds the relay lock for us (connected and usable). */
bool obx_health_pg_connected(const struct obx_health *h);
/* The HTTP handler (obx_http_handler) for /livez, /readyz and /metrics;
 * arg is the struct obx_health. */
void obx_health_http(const char *path, struct obx_buf *body, int *status, const char **content_type,
                     void *arg);

#endif
