/*
 * health: see include/outboxd/health.h.
 */
#include "outboxd/health.h"
#include "outboxd/log.h"
#include "outboxd/metrics.h"

#include <errno.h>
#include <libpq-fe.h>
#include <librdkafka/rdkafka.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* /livez fails when housekeeping has not run for this long. */
#define LIVENESS_STALL_MS 10000

/* Tells systemd (Type=notify) about our state when NOTIFY_SOCKET is set:
 * one datagram, no libsystemd needed. Best effort. */
static void sd_notify_state(const char *state)
{
    const char *path = getenv("NOTIFY_SOCKET");
    struct sockaddr_un addr;
    size_t len;
    if (!path || (path[0] != '/' && path[0] != '@') ||
        (len = strlen(path)) >= sizeof(addr.sun_path))
        return;
    memset(&addr, 0, sizeof(addr));
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, path, len);
    if (path[0] == '@')
        addr.sun_path[0] = '\0'; /* abstract namespace */
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return;
    if (sendto(fd, state, strlen(state), MSG_NOSIGNAL, (struct sockaddr *)&addr,
               (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len)) < 0)
        obx_debug("sd_notify: %s", strerror(errno));
    close(fd);
}

static double wall_now(void)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    return (double)now.tv_sec + (double)now.tv_nsec / 1e9;
}

void obx_health_init(struct obx_health *h, const struct obx_health_parts *parts)
{
    memset(h, 0, sizeof(*h));
    h->parts = *parts;
    h->start_time = wall_now();
    h->last_tick = (int64_t)uv_now(parts->loop);
    obx_histogram_init_latency(&h->ack_latency);
}

void obx_health_acked(struct obx_health *h, int64_t created_us)
{
    obx_histogram_observe_age(&h->ack_latency, created_us);
}

bool obx_health_pg_connected(const struct obx_health *h)
{
    return obx_pg_usable(h->parts.pg);
}

/* READY=1 once: when publishing may start, or when standing by behind
 * another outboxd (a standby that never said READY would be killed by
 * systemd's start timeout). */
static void notify_ready(struct obx_health *h)
{
    if (h->ready_sent)
        return;
    h->ready_sent = true;
    sd_notify_state("READY=1");
}

void obx_health_recovered(struct obx_health *h)
{
    notify_ready(h);
}

void obx_health_draining(struct obx_health *h)
{
    if (h->draining)
        return;
    h->draining = true;
    sd_notify_state("STOPPING=1");
}

void obx_health_tick(struct obx_health *h, int64_t now)
{
    const struct obx_health_parts *p = &h->parts;
    h->last_tick = now;
    if (obx_pg_standby(p->pg))
        notify_ready(h);
    uint64_t rp = obx_recovery_progress(p->recovery);
    if (rp != h->recovery_seen) { /* the scan reads: not stalled */
        h->recovery_seen = rp;
        obx_relay_note_progress(p->relay, now);
    }
    obx_relay_check_stall(p->relay, obx_health_pg_connected(h) && obx_kafka_connected(p->kafka),
                          now);
}

/* Why the relay is not ready, or NULL when it is. */
static const char *not_ready_reason(const struct obx_health *h)
{
    const struct obx_health_parts *p = &h->parts;
    if (h->draining || obx_relay_state(p->relay) == OBX_RELAY_STOPPED)
        return "draining after SIGTERM/SIGINT";
    if (!obx_pg_standby(p->pg) && !obx_health_pg_connected(h))
        return "no Postgres connection";
    if (!obx_pg_standby(p->pg) && !obx_relay_recovered(p->relay))
        return "recovery pass not finished";
    if (!obx_kafka_connected(p->kafka))
        return "Kafka unreachable (no metadata)";
    return NULL;
}

/* Unix seconds of a loop (monotonic) time. */
static double unix_time_of(const struct obx_health *h, int64_t loop_ms)
{
    return wall_now() - (double)((int64_t)uv_now(h->parts.loop) - loop_ms) / 1000.0;
}

static void livez(struct obx_health *h, struct obx_buf *body, int *status)
{
    /* Answering proves the loop turns; a starved timer would not. */
    int64_t stalled = (int64_t)uv_now(h->parts.loop) - h->last_tick;
    char why[160];
    int64_t no_progress = obx_relay_stalled(h->parts.relay, why, sizeof(why));
    if (stalled > LIVENESS_STALL_MS) {
        *status = 503;
        obx_buf_printf(body, "housekeeping has not run for %lldms\n", (long long)stalled);
    } else if (no_progress > 0) {
        *status = 503;
        obx_buf_printf(body, "no progress for %llds: %s\n", (long long)(no_progress / 1000), why);
    } else {
        obx_buf_puts(body, "ok\n");
    }
}

static void readyz(struct obx_health *h, struct obx_buf *body, int *status)
{
    const char *why = not_ready_reason(h);
    if (why) {
        *status = 503;
        obx_buf_printf(body, "not ready: %s\n", why);
    } else if (obx_pg_standby(h->parts.pg)) {
        obx_buf_puts(body, "ready: standby, another outboxd holds the relay lock\n");
    } else {
        obx_buf_puts(body, "ready\n");
    }
}

static void metrics(struct obx_health *h, struct obx_buf *body)
{
    const struct obx_health_parts *p = &h->parts;
    struct obx_relay_slots slots;
    obx_relay_slots(p->relay, &slots);
    struct obx_metrics_gauges g = {
        .slots = slots.shards,
        .slots_owned = slots.owned,
        .slot_members = slots.members,
        .slot_moves = slots.moves,
        .published = obx_kafka_published(p->kafka),
        .publish_errors = obx_kafka_publish_errors(p->kafka),
        .ack_latency = &h->ack_latency,
        .batch_rows = obx_pg_batch_rows(p->pg),
        .pg_reconnects = obx_pg_reconnects(p->pg),
        .pg_history_changes = obx_pg_history_changes(p->pg),
        .pg_timeline = obx_pg_timeline(p->pg),
        .rows_recovered = obx_recovery_rows_recovered(p->recovery),
        .ids_skipped = obx_recovery_ids_skipped(p->recovery),
        .rows_purged = obx_maint_rows_purged(p->maint),
        .librdkafka_version = rd_kafka_version_str(),
        .libpq_version = PQlibVersion(),
        .libuv_version = uv_version_string(),
        .in_flight = obx_relay_in_flight(p->relay),
        .in_flight_limit = (size_t)p->cfg->max_in_flight,
        .keys_held_back = obx_relay_held_back_keys(p->relay),
        .rows_marked = obx_relay_marked_total(p->relay),
        .fetches_keyset = obx_relay_fetches(p->relay, true),
        .fetches_full = obx_relay_fetches(p->relay, false),
        .rows_dead_lettered = obx_relay_dead_total(p->relay),
        .txn_committed = obx_relay_transactions(p->relay, true),
        .txn_aborted = obx_relay_transactions(p->relay, false),
        .backlog_rows = obx_maint_backlog(p->maint),
        .lag_seconds = obx_maint_lag_seconds(p->maint),
        .postgres_connected = obx_health_pg_connected(h),
        .kafka_connected = obx_kafka_connected(p->kafka),
        .ready = not_ready_reason(h) == NULL,
        .standby = obx_pg_standby(p->pg),
        .draining = h->draining,
        .start_time = h->start_time,
        .last_progress = unix_time_of(h, obx_relay_last_progress(p->relay)),
        .stalled = obx_relay_stalled(p->relay, NULL, 0) > 0,
        .recovering = obx_recovery_running(p->recovery),
        .recovery_records_read = obx_recovery_records_read(p->recovery),
        .recovery_partitions_left = obx_recovery_partitions_left(p->recovery),
    };
    g.slot_count = obx_maint_slot_backlog(p->maint, &g.slot_backlog_rows, &g.slot_lag_ms);
    obx_metrics_render(body, &g);
}

void obx_health_http(const char *path, struct obx_buf *body, int *status, const char **content_type,
                     void *arg)
{
    struct obx_health *h = arg;
    if (strcmp(path, "/livez") == 0) {
        livez(h, body, status);
    } else if (strcmp(path, "/readyz") == 0) {
        readyz(h, body, status);
    } else if (strcmp(path, "/metrics") == 0) {
        *content_type = "text/plain; version=0.0.4; charset=utf-8";
        metrics(h, body);
    } else {
        *status = 404;
        obx_buf_puts(body, "not found: try /livez, /readyz or /metrics\n");
    }
}
