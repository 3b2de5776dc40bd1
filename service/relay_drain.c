/*
 * relay_drain: predicates and names only, read from the relay's state:
 * whether marks must wait for a recovery pass, when a drain may stop, what
 * a stalled relay waits for, and the states' names. relay.c acts on their
 * answers (shutdown, fatal errors, progress and stalls are its entry
 * points).
 */
#include "relay_int.h"

#include <stdio.h>

static const char *const state_names[] = {"wait_pg", "recovering", "idle",    "fetching",
                                          "marking", "stopped",    "claiming"};

const char *obx_relay_state_name(enum obx_relay_state s)
{
    return (unsigned)s < sizeof(state_names) / sizeof(state_names[0]) ? state_names[s] : "?";
}

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

/* What the relay is waiting for, for the stall report. */
void relay_describe_wait(const struct obx_relay *r, int64_t now, char *why, size_t len)
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
