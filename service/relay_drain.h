/*
 * relay_drain: when a drain may stop and what a stalled relay waits for,
 * read from a struct drain_view (relay.c fills it: drain_view_of).
 */
#ifndef OUTBOXD_RELAY_DRAIN_H
#define OUTBOXD_RELAY_DRAIN_H
#include "outboxd/relay.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct drain_view {
    enum obx_relay_state state;
    int64_t state_since;     /* when the state last changed */
    size_t in_use;           /* rows in flight */
    size_t to_mark;          /* ... of them acknowledged or dead, waiting for the mark */
    size_t n_outstanding;    /* ... handed to Kafka, report pending */
    size_t sent;             /* ... acknowledged, their transaction not committed */
    bool uncertain;          /* a possibly-persisted report waits for a recovery pass */
    bool log_mode;           /* relay.on_sent = log */
    bool log_checkpoint_due; /* log mode: a checkpoint newer than the stored cursor waits */
    int64_t drain_deadline;  /* stop waiting for deliveries */
    int64_t hard_deadline;   /* stop, whatever is in flight */
};

/* During a drain: whether to stop now. */
bool drain_over(const struct drain_view *v, int64_t now);
/* What the relay is waiting for, for the stall report. */
void drain_describe_wait(const struct drain_view *v, int64_t now, char *why, size_t len);

#endif
