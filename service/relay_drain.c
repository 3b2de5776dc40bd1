/*
 * relay_drain: predicates and names only, read from a struct drain_view
 * that relay.c fills: when a drain may stop, what a stalled relay waits
 * for, and the states' names. relay.c acts on their answers (shutdown,
 * fatal errors, progress and stalls are its entry points).
 */
#include "relay_drain.h"

#include <stdio.h>

static const char *const state_names[] = {"wait_pg", "recovering", "idle",    "fetching",
                                          "marking", "stopped",    "claiming"};

const char *obx_relay_state_name(enum obx_relay_state s)
{
    return (unsigned)s < sizeof(state_names) / sizeof(state_names[0]) ? state_names[s] : "?";
}

/* During a drain: whether to stop now. Nothing in flight: at once, in any
 * state (a fetch or recovery statement still running is simply dropped).
 * Past the drain deadline: once nothing acknowledged is left to mark, or no
 * connection can mark it. Past the hard deadline: whatever is in flight (a
 * hung Postgres must not hold SIGTERM hostage). */
bool drain_over(const struct drain_view *v, int64_t now)
{
    if (v->in_use == 0 || now >= v->hard_deadline)
        return true;
    /* Without a session (or the relay lock), acknowledged rows cannot be
     * marked by us; once no delivery report is outstanding there is
     * nothing left to wait for: the next holder's recovery pass finds them. */
    if (v->state == OBX_RELAY_WAIT_PG && v->in_use == v->to_mark)
        return true;
    /* Marks wait for a pass, which a drain does not start: the next start's
     * pass finds these rows, from offsets no mark has moved. */
    if (v->uncertain && v->in_use == v->to_mark)
        return true;
    /* Log mode: every report is in and no checkpoint is left to store (the last
     * fetches made none, a row went back unsent): what is acknowledged is
     * in Kafka, and the next start's pass finds it. */
    if (v->log_mode && v->state == OBX_RELAY_IDLE && v->n_outstanding == 0 &&
        v->in_use == v->to_mark && !v->log_checkpoint_due)
        return true;
    if (now < v->drain_deadline)
        return false;
    return v->state == OBX_RELAY_WAIT_PG || (v->state == OBX_RELAY_IDLE && v->to_mark == 0);
}

void drain_describe_wait(const struct drain_view *v, int64_t now, char *why, size_t len)
{
    long long in_state = (long long)((now - v->state_since) / 1000);
    size_t produced = v->in_use - v->to_mark - v->sent;
    switch (v->state) {
    case OBX_RELAY_FETCHING:
    case OBX_RELAY_MARKING:
        snprintf(why, len, "waiting %llds for Postgres to answer the %s", in_state,
                 v->state == OBX_RELAY_FETCHING ? "fetch" : "mark");
        break;
    case OBX_RELAY_RECOVERING:
        snprintf(why, len, "the recovery pass has shown no progress for %llds", in_state);
        break;
    default:
        if (produced > 0)
            snprintf(why, len, "waiting for Kafka's delivery reports of %zu rows", produced);
        else if (v->sent > 0)
            snprintf(why, len, "waiting for the commit of the Kafka transaction of %zu rows",
                     v->sent);
        else
            snprintf(why, len, "%s for %llds with %zu rows in flight",
                     obx_relay_state_name(v->state), in_state, v->in_use);
        break;
    }
}
