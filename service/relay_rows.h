/*
 * relay_rows: the rows in flight, a seat each (relay.max_in_flight seats),
 * from the fetch that hands a row out until its mark commits (or it goes
 * back unsent). A seat's state changes in one place, rows_move(), which
 * refuses moves the table does not allow and keeps the count of every
 * state; the other rooms of the relay read seats and counts and never
 * write a state. Beside them: the topic names rows refer to, and the
 * partitions' offsets a mark stores.
 */
#ifndef OUTBOXD_RELAY_ROWS_H
#define OUTBOXD_RELAY_ROWS_H
#include "outboxd/relay.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum seat_state {
    SEAT_FREE = 0,
    SEAT_PRODUCED,     /* handed to Kafka, delivery report pending */
    SEAT_ACKED,        /* persisted by Kafka, not yet marked */
    SEAT_MARKING,      /* in the mark transaction now in flight */
    SEAT_DEAD,         /* refused; to be moved to outbox.dead_letters */
    SEAT_DEAD_MARKING, /* in the mark transaction now in flight, as a dead letter */
    SEAT_PARKED,       /* set.one_per_key: fetched, waiting behind its key's record at Kafka */
    SEAT_SENT,         /* relay.transactions: acknowledged, its transaction not committed yet */
    SEAT_STATES
};

struct seat {
    int64_t id;
    int64_t created_us; /* for the latency histogram */
    int64_t offset;
    int32_t partition;
    uint32_t topic; /* index into obx_relay.topics */
    enum seat_state state;
    int32_t next_free;      /* free-list link, -1 = end */
    char *reason;           /* SEAT_DEAD*: why Kafka refused it (owned) */
    struct obx_row *parked; /* SEAT_PARKED: a copy of the row (owned, one allocation) */
    uint64_t key_hash;      /* set.one_per_key and a key: its obx_keycount_hash */
    uint64_t log_hash;      /* log mode and a key: its obx_keycount_hash */
    uint64_t seq;           /* log mode: the fetch that handed it out */
    bool orphan;            /* handed out by a session that is gone */
    bool has_key_slot;      /* the fetch said its slot of relay.shards: key_slot */
    int32_t key_slot;
};

struct rows {
    struct seat *seat; /* [cap] */
    int32_t cap;       /* relay.max_in_flight */
    int32_t free_head; /* -1: every seat in use */
    size_t count[SEAT_STATES];
    size_t orphans; /* seats with `orphan` set */
};

/* 0, or -1 out of memory. rows_free() undoes it (also after a failure). */
int rows_init(struct rows *rs, int32_t cap);
void rows_free(struct rows *rs);

/* A free seat for row `id`, PRODUCED, its other fields reset; NULL if
 * every seat is in use. */
struct seat *rows_take(struct rows *rs, int64_t id, uint32_t topic);
/* Moves `s` to `to`; a move the table does not allow is a bug (logged,
 * nothing changes). */
void rows_move(struct rows *rs, struct seat *s, enum seat_state to);
/* Every seat in state `from` to `to` (a mark sent, or one that failed). */
void rows_move_all(struct rows *rs, enum seat_state from, enum seat_state to);
/* `s` back to the free list, its reason and parked row freed. */
void rows_release(struct rows *rs, struct seat *s);
/* `s` was handed out by a session that is gone. */
void rows_orphan(struct rows *rs, struct seat *s);

static inline size_t rows_in_use(const struct rows *rs)
{
    return (size_t)rs->cap - rs->count[SEAT_FREE];
}
/* Waiting for a mark: acknowledged or refused, not in the mark in flight. */
static inline size_t rows_to_mark(const struct rows *rs)
{
    return rs->count[SEAT_ACKED] + rs->count[SEAT_DEAD];
}
static inline int32_t rows_index(const struct rows *rs, const struct seat *s)
{
    return (int32_t)(s - rs->seat);
}

/* Topic names seen so far; seats, held entries and offsets refer to them
 * by index. */
struct topics {
    char **name;
    size_t n, cap;
    uint32_t last;
};
/* Index of `name`, added if new; -1 on no memory. Rows come in runs of one
 * topic, so the last hit is tried first. */
int64_t topics_index(struct topics *t, const char *name);
void topics_free(struct topics *t);

/* The highest acknowledged offset of each partition, to be stored with a
 * mark (as struct obx_mark takes them: topic names point into struct
 * topics). */
struct part_offsets {
    const char **topic;
    int32_t *partition;
    int64_t *offset;
    size_t n, cap;
};
int part_offsets_init(struct part_offsets *o, size_t cap);
void part_offsets_free(struct part_offsets *o);
/* Appends one; -1 on no memory. */
int part_offsets_add(struct part_offsets *o, const char *topic, int32_t partition, int64_t offset);
/* Raises `partition`'s offset to `offset`, or appends it. Without memory
 * for a new partition its stored offset lags, which costs the recovery
 * pass a longer read and nothing else. */
void part_offsets_raise(struct part_offsets *o, const char *topic, int32_t partition,
                        int64_t offset);

#endif
