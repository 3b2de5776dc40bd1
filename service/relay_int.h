/*
 * relay_int: the relay's state, struct obx_relay, which relay.c alone reads
 * whole; each room below has its own struct in it and a header of its own
 * (internal to service/; include/outboxd/relay.h is the relay's interface).
 *
 *   relay.c        the cycle: fetch, produce, delivery reports, mark; every
 *                  entry point; the only writer of this struct
 *   relay_log.c    log mode's records, checkpoints and cursor rows (relay.on_sent = log)
 *   relay_held.c   refused rows and the keys they hold back
 *   relay_drain.c  when a drain may stop, what a stall waits for
 *   relay_owner.c  the slots of relay.shards this relay owns
 *   relay_rows.c   the rows in flight: their seats and states
 *   relay_cursor.c the fetch cursor, the fetch in flight and whether one is due
 */
#ifndef OUTBOXD_RELAY_INT_H
#define OUTBOXD_RELAY_INT_H
#include "outboxd/failpoint.h"
#include "outboxd/keycount.h"
#include "outboxd/relay.h"
#include "relay_cursor.h"
#include "relay_drain.h"
#include "relay_held.h"
#include "relay_log.h"
#include "relay_owner.h"
#include "relay_rows.h"
#include "relay_txn.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* "No row" wherever an id is kept: ids may be 0 or below (an identity
 * restarted or set there by an operator). */
#define NO_ID INT64_MIN
/* The pause before the next look for new rows: POLL_MIN_MS after a fetch
 * that found some, and an eighth of the time since one last did after a
 * fetch that found none, up to relay.poll_interval. Rows that keep coming,
 * even with gaps, are looked for every millisecond or two (doubling the
 * pause at each empty look left a row waiting 4 to 8 ms behind a gap of a
 * few ms, which set the p99 at 1,000 rows/s), and an idle relay is at
 * relay.poll_interval within 8 x that of the last row. */
#define POLL_MIN_MS        1
#define POLL_QUIET_DIVISOR 8
/* How often the marks store the partitions' offsets (outbox.kafka_offsets).
 * A stored offset only says where the recovery pass starts reading, so it
 * may lag: the pass then reads up to this much more. Storing it with every
 * mark updated a dozen rows a few hundred times a second, and under a held
 * xmin horizon every one of those versions stays, and each upsert walked
 * them all. */
#define OFFSETS_STORE_MS 1000

struct obx_relay {
    struct obx_relay_settings set;
    const struct obx_relay_ops *ops;
    void *io;
    void *producer; /* ops->produce's first argument */
    enum obx_relay_state state;

    struct rows rows; /* the rows in flight (relay_rows.h) */

    struct topics topics; /* topic names; seats refer to them by index */

    struct held held; /* refused rows and the keys they hold back (relay_held.h) */

    /* Scratch arrays for the fetch and mark arguments, sized once. */
    int64_t *ids;
    int64_t *dead_ids;
    const char **dead_reasons;
    /* The highest acknowledged offset per partition not yet stored. */
    struct part_offsets offs;
    bool offsets_in_mark; /* the mark in flight stores them */
    int64_t offsets_due;  /* when the next mark stores them */
    /* The fetch's held-back keys and their rows' ids (held.cap of them,
     * as r->ids has set.max_in_flight + held.cap: see fetch_room). */
    struct obx_held_back_key *keys;
    int64_t *key_ids;
    size_t fetch_room; /* the held.cap they fit */

    struct seat **batch; /* seats of the rows of the fetch being produced */

    struct cursor cur; /* the fetch cursor and the fetch in flight (relay_cursor.h) */

    /* set.one_per_key: the keys with a record at Kafka and the rows parked
     * behind them; key_waits: a row was left for a later fetch instead (no
     * memory to park it). */
    struct obx_keycount busy_keys;
    bool key_waits;

    size_t n_outstanding; /* rows handed to Kafka whose delivery report is pending */
    int64_t alone_id;     /* a row tried alone, handed to Kafka, report pending (NO_ID: none) */

    bool recovered;         /* the start-up recovery pass has succeeded */
    uint64_t unknowns;      /* possibly-persisted reports so far */
    uint64_t pass_unknowns; /* ... when the recovery pass in flight started */
    uint64_t resolved;      /* ... when the last successful pass started */
    int64_t not_before;     /* back-off: no statement before this time */

    int64_t now; /* time of the event being handled */
    bool draining;
    int64_t drain_deadline; /* stop waiting for deliveries; mark what was acknowledged */
    int64_t hard_deadline;  /* stop, whatever is in flight (shutdown.timeout) */

    int64_t last_progress;     /* see obx_relay_last_progress */
    int64_t failure_warned_at; /* last "not delivered" warning */
    int64_t unknown_warned_at; /* last "may or may not be in Kafka" warning */
    int64_t full_warned_at;    /* last "rows in flight cannot be stored" error */
    int64_t state_since;       /* when the state last changed */
    int64_t stalled_ms;        /* > 0 while a stall is reported */
    int64_t stall_logged_at;
    int exit_code;
    uint64_t marked_total;
    uint64_t dead_total;
    uint64_t fetches[2]; /* full, keyset */

    struct log_state log; /* set.log_mode only */
    struct owner owner;   /* the slots of relay.shards owned (relay_owner.h) */
    struct txn txn;       /* relay.transactions: the open transaction (relay_txn.h) */
};

#endif
