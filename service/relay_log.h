/*
 * relay_log: log mode (relay.on_sent = log): the records of the fetches, the
 * checkpoints they make, the held keys the cursor rows name, and the cursor row
 * itself. Its functions change struct log_state alone and read the rest of
 * the relay through a struct log_view that relay.c fills; relay.c sends
 * what they build.
 */
#ifndef OUTBOXD_RELAY_LOG_H
#define OUTBOXD_RELAY_LOG_H
#include "outboxd/relay.h"
#include "relay_held.h"
#include "relay_owner.h"
#include "relay_rows.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- log mode (relay.on_sent = log) ----
 *
 * Nothing is written per row. What is published is what the newest cursor
 * row covers: every row with an id up to its hwm whose writer its snapshot
 * saw committed, but the rows of its held keys. The relay stores a cursor
 * row once every row handed out up to some fetch has been acknowledged:
 * that fetch's own cursor (hwm and snapshot) is then a true checkpoint. So every
 * fetch has a record: how many of its rows are still pending (with Kafka,
 * or parked), and its cursor if that made a checkpoint (a fetch after which the
 * cursor was not valid makes none, and a row going back unsent takes the
 * checkpoints of its fetch and the later ones away). The oldest records are
 * dropped as their rows settle, and the newest checkpoint among them is `ready`:
 * the next cursor row stores it and frees the seats of the rows it covers.
 * Acknowledged rows of later fetches keep their seats until a later row.
 *
 * Refused rows and the rows of their keys behind them are `held`: the
 * cursor rows name them until a checkpoint made after they went on is stored.
 * Each partition's stored offset is where the recovery pass starts reading:
 * below the lowest offset of an acknowledged row a cursor row does not
 * cover yet, so the pass finds every record the cursor does not account for
 * (records of a partition are acknowledged in offset order). */
struct fetch_rec {
    size_t pending;   /* rows handed out and not yet settled */
    bool checkpoint;  /* the cursor after this fetch is valid */
    uint64_t send_no; /* which fetch sent (for held keys going on) */
    int64_t hwm;
    char *snap; /* owned when checkpoint */
    /* A partial checkpoint (with slots, relay.c, cursor_advance): about these
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

    bool has_ready; /* the newest checkpoint with nothing pending up to it */
    uint64_t ready_seq, ready_send;
    int64_t ready_hwm;
    char *ready_snap;
    bool *ready_about; /* a partial checkpoint's slots (owned; NULL: every slot owned) */
    char *ready_about_text;

    /* The stored cursor (loaded, or written by us). A partial checkpoint's row
     * moves stored_seq, stored_batch, stored_at and writes, and slot_hwm
     * for its slots; stored_send, stored_hwm and stored_snap stay the last
     * whole one's. */
    bool has_stored;
    uint64_t stored_seq; /* 0: loaded at the start of the session */
    uint64_t stored_send;
    int64_t stored_batch, stored_hwm;
    char *stored_snap;
    uint64_t writes; /* since the table was last emptied */

    uint64_t write_seq; /* the checkpoint the write in flight stores */
    uint64_t write_send;
    int64_t write_hwm;
    char *write_snap;
    bool write_partial;     /* about some slots only: stored_hwm and stored_snap stay */
    bool *write_about;      /* then its slots ([set.shards]) */
    char *write_about_text; /* ... as its cursor row names them */
    /* With slots: the highest hwm of the cursor rows about each slot
     * ([set.shards]; loaded with the cursor, raised by each row written or
     * perhaps written: a write that failed may have committed).
     * A partial checkpoint is about the slots where it, and every checkpoint that
     * may yet be stored, is at or below its hwm, so no cursor row about a
     * slot covers less than the one before it. */
    int64_t *slot_hwm;
    bool partial_told;     /* logged since the cursor was loaded */
    uint64_t looked_seq;   /* the ready checkpoint last found to cover nothing */
    int64_t ready_since;   /* when the ready checkpoint last moved past the stored one */
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

/* What relay_log.c reads of the rest of the relay. */
struct log_view {
    const struct rows *rows;
    const struct topics *topics;
    const struct owner *owner;
    int shards;
    size_t batch_size;
    bool draining;
    int64_t now;
};

/* The records of the fetches and their checkpoints. */
struct fetch_rec *log_rec_of(struct log_state *l, uint64_t seq);
/* A record for the fetch just answered; its seq, or 0 out of memory (then
 * the rows are not taken: see on_fetched). */
uint64_t log_rec_push(struct log_state *l);
/* A row of fetch `seq` was handed out; false if the fetch has no record. */
bool log_rec_add_row(struct log_state *l, uint64_t seq);
void log_rec_checkpoint(struct log_state *l, uint64_t seq, int64_t hwm, const char *snap);
void log_rec_checkpoint_partial(struct log_state *l, const struct log_view *v, uint64_t seq,
                                int64_t hwm, const char *snap);
void log_recs_retire(struct log_state *l, int64_t now);
void log_checkpoints_drop_from(struct log_state *l, uint64_t seq);
/* A row of fetch `seq` no longer waits for Kafka: `acked` (acknowledged or
 * to be dead-lettered) or not (back unsent, or held). */
void log_settle(struct log_state *l, uint64_t seq, int64_t id, bool acked, int64_t now);

/* A fetch was sent (its held keys go on by the count of fetches). */
void log_fetch_sent(struct log_state *l);
/* Slots of relay.shards were taken: no checkpoint made before is about them,
 * and with `reload` the stored cursor is read again. */
void log_slots_taken(struct log_state *l, bool reload);
/* Another relay's cursor rows reach `hwm` (with slots). */
void log_others_seen(struct log_state *l, int64_t hwm);

/* Held keys (rules the cursor rows name). */
void log_hold(struct log_state *l, int64_t id, uint32_t topic, const char *key, size_t key_len);
void log_lift(struct log_state *l, int64_t id);
bool log_take_found(struct log_state *l, int64_t id, struct found_row *out);
/* The held keys and their published rows for a full fetch, in
 * l->held_out and l->also_out; false with no memory. */
bool log_held_out(struct log_state *l, const struct topics *topics);

void log_reset(struct log_state *l);
void log_free(struct log_state *l);

/* The records the recovery pass found (sorted by id, topics as indexes;
 * taken over), but those of rows in flight. */
void log_found_set(struct log_state *l, const struct rows *rows, struct found_row *found, size_t n);
/* How many of st's held keys and offsets log_load reads (the first of
 * each). */
void log_load_reads(const struct log_view *v, const struct obx_log_state *st, size_t *n_held,
                    size_t *n_off);
/* The stored cursor read at the start of a session: `held_topic` and
 * `off_topic` are the topics of the held keys and offsets it reads, as
 * indexes, `back`
 * the rows this process still holds back (their rules go on). 0, or -1
 * out of memory. */
int log_load(struct log_state *l, const struct log_view *v, const struct obx_log_state *st,
             const uint32_t *held_topic, const uint32_t *off_topic, const struct held_back *back,
             size_t n_back);

/* A cursor row for the ready checkpoint, covering the acknowledged rows of the
 * fetches up to it (a partial checkpoint's: those of its slots up to its hwm),
 * and dead-lettering the refused ones among them (into dead_ids and
 * dead_reasons, relay.max_in_flight each; its offsets into *offs). True:
 * one is due, in *m (valid until the next call into relay_log.c); once it
 * is sent, log_write_sent(), and the rows it covers (log_ready_covers) are
 * in it. */
bool log_write_build(struct log_state *l, const struct log_view *v, int64_t *dead_ids,
                     const char **dead_reasons, struct part_offsets *offs, struct obx_mark *m,
                     bool *restart);
void log_write_sent(struct log_state *l, bool restart);
bool log_ready_covers(const struct log_state *l, const struct seat *s);
/* The cursor row in flight committed; or failed, and may have committed. */
void log_write_done(struct log_state *l, const struct log_view *v);
void log_write_failed(struct log_state *l, const struct log_view *v);

/* Every row in flight is acknowledged and no checkpoint can store them. */
bool log_waits_checkpoint(const struct log_state *l, const struct rows *rows);
/* The ready checkpoint is newer than the stored one and not yet found to cover
 * nothing. */
bool log_checkpoint_due(const struct log_state *l);
bool log_idle_write_due(const struct log_state *l, const struct log_view *v);

#endif
