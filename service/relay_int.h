/*
 * relay_int: the relay's state and the functions its rooms share (internal
 * to service/; include/outboxd/relay.h is the relay's interface).
 *
 *   relay.c        the cycle: fetch, produce, delivery reports, mark
 *   relay_log.c    log mode's cursor rows (relay.on_sent = log)
 *   relay_held.c   refused rows and the keys they hold back
 *   relay_drain.c  drain, shutdown, progress and stalls
 *   relay_owner.c  the slots of relay.shards this relay owns
 *   relay_rows.c   the rows in flight: slots and their states
 *   relay_cursor.c the fetch cursor, the fetch in flight and whether one is due
 */
#ifndef OUTBOXD_RELAY_INT_H
#define OUTBOXD_RELAY_INT_H
#include "outboxd/failpoint.h"
#include "outboxd/keycount.h"
#include "outboxd/relay.h"
#include "relay_cursor.h"
#include "relay_held.h"
#include "relay_owner.h"
#include "relay_rows.h"

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

/* ---- log mode (relay.on_sent = log) ----
 *
 * Nothing is written per row. What is published is what the newest cursor
 * row covers: every row with an id up to its hwm whose writer its snapshot
 * saw committed, but the rows of its held keys. The relay stores a cursor
 * row once every row handed out up to some fetch has been acknowledged:
 * that fetch's own cursor (hwm and snapshot) is then a true claim. So every
 * fetch has a record: how many of its rows are still pending (with Kafka,
 * or parked), and its cursor if that made a claim (a fetch after which the
 * cursor did not hold makes none, and a row going back unsent takes the
 * claims of its fetch and the later ones away). The oldest records are
 * dropped as their rows settle, and the newest claim among them is `ready`:
 * the next cursor row stores it and frees the slots of the rows it covers.
 * Acknowledged rows of later fetches keep their slots until a later row.
 *
 * Refused rows and the rows of their keys behind them are `held`: the
 * cursor rows name them until a claim made after they went on is stored.
 * Each partition's stored offset is where the recovery pass starts reading:
 * below the lowest offset of an acknowledged row a cursor row does not
 * cover yet, so the pass finds every record the cursor does not account for
 * (records of a partition are acknowledged in offset order). */
struct fetch_rec {
    size_t pending;   /* rows handed out and not yet settled */
    bool claim;       /* the cursor after this fetch holds */
    uint64_t send_no; /* which fetch sent (for held keys going on) */
    int64_t hwm;
    char *snap; /* owned when claim */
    /* A partial claim (with slots, relay.c, cursor_advance): about these
     * slots only ([set.shards], owned; NULL: every slot owned), and
     * "{1,5}" for the cursor row. */
    bool *about;
    char *about_text;
};

struct held_rule {
    uint32_t topic;
    char *key; /* owned; NULL = the row alone */
    size_t key_len;
    int64_t from_id;
    uint64_t hash;      /* obx_keycount_hash of topic and key */
    bool lifted;        /* the refused row went on (delivered, dead-lettered, gone) */
    uint64_t lift_send; /* fetches sent when it was lifted */
};

/* A row of a held key published since it was held: the cursor rows list
 * it while a rule that leaves it out lives (a later rule of the same key,
 * after a second refusal, included). */
struct also_row {
    int64_t id;
    uint64_t hash; /* of its topic and key; 0: not known (read back at start) */
    uint32_t topic;
};

struct found_row { /* a record the recovery pass found for an uncovered row */
    int64_t id;
    uint32_t topic;
    int32_t partition;
    int64_t offset;
};

struct log_offset { /* a partition's offset as stored (or to be stored) */
    uint32_t topic;
    int32_t partition;
    int64_t stored;  /* -1: none yet */
    int64_t covered; /* scratch while a write is built: highest offset it covers */
    int64_t below;   /* ... lowest offset of an acknowledged row it does not cover */
};

struct log_state {
    struct fetch_rec *recs; /* ring of fetch records, oldest at head */
    size_t cap_recs, rec_head, n_recs;
    uint64_t head_seq; /* seq of recs[rec_head] */
    uint64_t next_seq;
    uint64_t sends;         /* fetches sent */
    uint64_t fetch_send_no; /* the fetch in flight's */

    bool has_ready; /* the newest claim with nothing pending up to it */
    uint64_t ready_seq, ready_send;
    int64_t ready_hwm;
    char *ready_snap;
    bool *ready_about; /* a partial claim's slots (owned; NULL: every slot owned) */
    char *ready_about_text;

    /* The stored cursor (loaded, or written by us). A partial claim's row
     * moves stored_seq, stored_batch, stored_at and writes, and slot_hwm
     * for its slots; stored_send, stored_hwm and stored_snap stay the last
     * whole one's. */
    bool has_stored;
    uint64_t stored_seq; /* 0: loaded at the start of the session */
    uint64_t stored_send;
    int64_t stored_batch, stored_hwm;
    char *stored_snap;
    uint64_t writes; /* since the table was last emptied */

    uint64_t write_seq; /* the claim the write in flight stores */
    uint64_t write_send;
    int64_t write_hwm;
    char *write_snap;
    bool write_partial;     /* about some slots only: stored_hwm and stored_snap stay */
    bool *write_about;      /* then its slots ([set.shards]) */
    char *write_about_text; /* ... as its cursor row names them */
    /* With slots: the highest hwm of the cursor rows about each slot
     * ([set.shards]; loaded with the cursor, raised by each row written or
     * perhaps written: a write that failed may have committed).
     * A partial claim is about the slots where it, and every claim that
     * may yet be stored, is at or below its hwm, so no cursor row about a
     * slot covers less than the one before it. */
    int64_t *slot_hwm;
    bool partial_told;     /* logged since the cursor was loaded */
    uint64_t looked_seq;   /* the ready claim last found to cover nothing */
    int64_t ready_since;   /* when the ready claim last moved past the stored one */
    int64_t stored_at;     /* when this relay last stored (or loaded) the cursor */
    int64_t others_hwm;    /* with slots: about the highest hwm of any cursor row */
    bool offsets_in_write; /* the write in flight stores the offsets */
    int64_t offsets_due;   /* with slots: when they go with a write again */

    struct held_rule *held;
    size_t n_held, cap_held;
    struct also_row *also;
    size_t n_also, cap_also;
    struct obx_log_held *held_out; /* for the fetch and the write */
    int64_t *also_out;
    size_t cap_held_out, cap_also_out, n_also_out, n_held_out;

    struct found_row *found; /* sorted by id */
    size_t n_found;

    struct log_offset *offs;
    size_t n_offs, cap_offs;
    bool restart_next; /* the write in flight empties the table */
    bool loaded;       /* this session has read the stored cursor */
    /* Cursor rows are about slots (relay.shards above 1, or written so
     * before): the full fetch tests each row against the newest row about
     * its own slot, and stored_hwm is the highest of any row's. */
    bool by_slot;
};

struct obx_relay {
    struct obx_relay_settings set;
    const struct obx_relay_ops *ops;
    void *io;
    void *producer; /* ops->produce's first argument */
    enum obx_relay_state state;

    struct rows rows; /* the rows in flight (relay_rows.h) */

    struct topics topics; /* topic names; slots refer to them by index */

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

    struct slot **batch; /* slots of the rows of the fetch being produced */

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
    uint64_t settled;       /* ... when the last successful pass started */
    int64_t not_before;     /* back-off: no statement before this time */

    int64_t now; /* time of the event being handled */
    bool draining;
    int64_t drain_deadline; /* stop waiting for deliveries; mark what was acknowledged */
    int64_t hard_deadline;  /* stop, whatever is in flight (shutdown.timeout) */

    int64_t last_progress;     /* see obx_relay_last_progress */
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
};

/* relay_log.c (log mode) */
struct fetch_rec *relay_rec_of(struct obx_relay *r, uint64_t seq);
uint64_t relay_rec_push(struct obx_relay *r);
void relay_rec_claim(struct obx_relay *r, uint64_t seq, int64_t hwm, const char *snap);
void relay_rec_claim_partial(struct obx_relay *r, uint64_t seq, int64_t hwm, const char *snap);
void relay_log_write_failed(struct obx_relay *r);
void relay_recs_settle(struct obx_relay *r);
void relay_claims_drop_from(struct obx_relay *r, uint64_t seq);
void relay_log_settle(struct obx_relay *r, struct slot *s, bool acked);
void relay_hold(struct obx_relay *r, int64_t id, uint32_t topic, const char *key, size_t key_len);
void relay_lift(struct obx_relay *r, int64_t id);
bool relay_take_found(struct obx_relay *r, int64_t id, struct found_row *out);
void relay_log_reset(struct obx_relay *r);
bool relay_log_held_out(struct obx_relay *r);
/* Log mode: a cursor row for the ready claim, covering the acknowledged
 * rows of the fetches up to it (a partial claim's: those of its slots up
 * to its hwm), and dead-lettering the refused ones among them. True: one
 * is due, in *m (valid until the next call into relay_log.c); once it is
 * sent, relay_log_write_sent(), and the rows it covers
 * (relay_log_ready_covers) are in it. */
bool relay_log_write_build(struct obx_relay *r, int64_t now, struct obx_mark *m, bool *restart);
void relay_log_write_sent(struct obx_relay *r, bool restart);
bool relay_log_ready_covers(const struct obx_relay *r, const struct slot *s);
void relay_log_write_done(struct obx_relay *r);

/* relay_log.c: log mode's predicates the owner and the cycle read */
bool relay_log_unclaimed(const struct obx_relay *r);
bool relay_log_idle_write_due(const struct obx_relay *r, int64_t now);

/* relay_drain.c (drain and stall) */
bool relay_uncertain(const struct obx_relay *r);
bool relay_drain_over(const struct obx_relay *r, int64_t now);
/* What the relay is waiting for, for the stall report. */
void relay_describe_wait(const struct obx_relay *r, int64_t now, char *why, size_t len);

#endif
