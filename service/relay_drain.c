/*
 * relay_drain: when the relay may stop (drain, shutdown.timeout, fatal
 * errors), progress, and how a stall is noticed and described. See
 * relay_int.h for the state, relay.c for the cycle.
 */
#include "relay_int.h"
#include "outboxd/log.h"

#include <stdio.h>

/* A possibly-persisted report is not yet settled by a recovery pass. Until
 * it is, nothing is marked: a mark raises the stored offset of each of its
 * partitions past the record it confirms, and the pass reads each partition
 * from that offset on, so a record acknowledged after the uncertain one
 * would move the pass past it, and a row that did land would be published
 * again. The pass marks what it finds itself. */
bool relay_uncertain(const struct obx_relay *r)
{
    return r->unknowns != r->settled;
}

/* During a drain: whether to stop now. Nothing in flight: at once, in any
 * state (a fetch or recovery statement still running is simply dropped).
 * Past the drain deadline: once nothing acknowledged is left to mark, or no
 * connection can mark it. Past the hard deadline: whatever is in flight (a
 * hung Postgres must not hold SIGTERM hostage). */
bool relay_drain_over(const struct obx_relay *r, int64_t now)
{
    if (rows_in_use(&r->rows) == 0 || now >= r->hard_deadline)
        return true;
    /* Without a session (or the relay lock), acknowledged rows cannot be
     * marked by us; once no delivery report is outstanding there is
     * nothing left to wait for: the next holder's recovery pass finds them. */
    if (r->state == OBX_RELAY_WAIT_PG && rows_in_use(&r->rows) == rows_to_mark(&r->rows))
        return true;
    /* Marks wait for a pass, which a drain does not start: the next start's
     * pass finds these rows, from offsets no mark has moved. */
    if (relay_uncertain(r) && rows_in_use(&r->rows) == rows_to_mark(&r->rows))
        return true;
    /* Log mode: every report is in and no claim is left to store (the last
     * fetches made none, a row went back unsent): what is acknowledged is
     * in Kafka, and the next start's pass finds it. */
    if (r->set.log_mode && r->state == OBX_RELAY_IDLE && r->n_outstanding == 0 &&
        rows_in_use(&r->rows) == rows_to_mark(&r->rows) &&
        !(r->log.has_ready && r->log.ready_seq > r->log.stored_seq &&
          r->log.ready_seq != r->log.looked_seq))
        return true;
    if (now < r->drain_deadline)
        return false;
    return r->state == OBX_RELAY_WAIT_PG ||
           (r->state == OBX_RELAY_IDLE && rows_to_mark(&r->rows) == 0);
}

void relay_progress(struct obx_relay *r, int64_t now)
{
    r->last_progress = now;
    if (r->stalled_ms > 0) {
        obx_info("relay: moving again after %llds without progress",
                 (long long)(r->stalled_ms / 1000));
        r->stalled_ms = 0;
    }
}

void obx_relay_shutdown(struct obx_relay *r, int64_t now)
{
    r->now = now;
    if (r->draining || r->state == OBX_RELAY_STOPPED)
        return;
    r->draining = true;
    relay_release_all_parked(r); /* not handed to Kafka yet: left for the next start */
    /* The last quarter (at most a second) is kept for the final mark. */
    int64_t reserve = r->set.shutdown_timeout_ms / 4 < 1000 ? r->set.shutdown_timeout_ms / 4 : 1000;
    r->hard_deadline = now + r->set.shutdown_timeout_ms;
    r->drain_deadline = r->hard_deadline - reserve;
    obx_event(OBX_LOG_INFO, "shutting_down",
              "relay: shutting down: %zu rows in flight, waiting up to %lldms",
              rows_in_use(&r->rows), (long long)r->set.shutdown_timeout_ms);
    relay_kick(r, now);
}

void obx_relay_fatal(struct obx_relay *r, const char *reason, int64_t now)
{
    r->now = now;
    if (r->state == OBX_RELAY_STOPPED)
        return;
    obx_error("relay: stopping after a fatal error: %s", reason);
    r->exit_code = 1;
    if (!r->draining)
        r->hard_deadline = now + r->set.shutdown_timeout_ms;
    r->draining = true;
    relay_release_all_parked(r);
    r->drain_deadline = now;
    r->not_before = 0;
    relay_kick(r, now);
}

void obx_relay_note_progress(struct obx_relay *r, int64_t now)
{
    relay_progress(r, now);
}

/* What the relay is waiting for, for the stall report. */
static void describe_wait(const struct obx_relay *r, int64_t now, char *why, size_t len)
{
    long long in_state = (long long)((now - r->state_since) / 1000);
    size_t produced = rows_in_use(&r->rows) - rows_to_mark(&r->rows);
    switch (r->state) {
    case OBX_RELAY_FETCHING:
    case OBX_RELAY_MARKING:
        snprintf(why, len, "waiting %llds for Postgres to answer the %s", in_state,
                 r->state == OBX_RELAY_FETCHING ? "fetch" : "mark");
        break;
    case OBX_RELAY_RECOVERING:
        snprintf(why, len, "the recovery pass has shown no progress for %llds", in_state);
        break;
    default:
        if (produced > 0)
            snprintf(why, len, "waiting for Kafka's delivery reports of %zu rows", produced);
        else
            snprintf(why, len, "%s for %llds with %zu rows in flight",
                     obx_relay_state_name(r->state), in_state, rows_in_use(&r->rows));
        break;
    }
}

void obx_relay_check_stall(struct obx_relay *r, bool deps_ok, int64_t now)
{
    r->now = now;
    int64_t idle = now - r->last_progress;
    bool stalled = r->set.stall_timeout_ms > 0 && deps_ok && !r->draining &&
                   r->state != OBX_RELAY_WAIT_PG && r->state != OBX_RELAY_STOPPED &&
                   idle >= r->set.stall_timeout_ms;
    if (!stalled) {
        if (!deps_ok || r->state == OBX_RELAY_WAIT_PG)
            r->last_progress = now; /* waiting for a dependency is not a stall */
        r->stalled_ms = 0;
        return;
    }
    bool first = r->stalled_ms == 0;
    r->stalled_ms = idle;
    if (first || now - r->stall_logged_at >= r->set.stall_timeout_ms) {
        char why[160];
        describe_wait(r, now, why, sizeof(why));
        obx_error("relay: no progress for %llds: %s; /livez fails until it moves (restarting "
                  "outboxd is safe)",
                  (long long)(idle / 1000), why);
        r->stall_logged_at = now;
    }
}

int64_t obx_relay_stalled(const struct obx_relay *r, char *why, size_t len)
{
    if (r->stalled_ms > 0 && why)
        describe_wait(r, r->now, why, len);
    return r->stalled_ms;
}

int64_t obx_relay_last_progress(const struct obx_relay *r)
{
    return r->last_progress;
}
