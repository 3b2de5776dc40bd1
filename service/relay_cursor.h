/*
 * relay_cursor: what the relay's next fetch may be (a keyset fetch from the
 * cursor, or a full one), the fetch in flight, and whether a fetch is due
 * and when the next look for new rows is. relay.c sends the fetches and
 * sets these as they go out and come back; the other rooms of the relay
 * only drop the cursor or make a fetch due, through the functions below,
 * each of which logs its move with the reason.
 */
#ifndef OUTBOXD_RELAY_CURSOR_H
#define OUTBOXD_RELAY_CURSOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* What the next fetch may be (see struct cursor). Moves
 * are logged at debug level with their reason. */
enum cursor_state {
    CURSOR_NONE,  /* a full fetch, which excludes what is in flight and takes a cursor */
    CURSOR_VALID, /* a keyset fetch from hwm and snap */
};
/* The fetch in flight: its kind and whether it rides on the mark in flight
 * (one statement) or goes alone, both set when it is sent (the state moves
 * that go with them, FETCHING and MARKING, are logged); and whether its
 * answer will be used, set by relay_ignore_fetch (relay.c) (logged) and back to USE
 * once that answer is set aside or the fetch is gone. */
enum fetch_kind {
    FETCH_FULL,   /* every unsent row but those in flight */
    FETCH_KEYSET, /* from the cursor */
};
enum fetch_ride {
    RIDE_ALONE,   /* the relay is FETCHING (or no fetch is in flight) */
    RIDE_ON_MARK, /* the relay is MARKING, with the fetch in the same statement */
};
enum fetch_answer {
    ANSWER_USE,
    ANSWER_IGNORE, /* rows were given back while it was out: they would be overtaken */
};

/* Whether the relay has a reason to fetch now (rows may be waiting: a look
 * is due, a batch came back full, rows were given back, a key is free) or
 * waits for one. Moves are logged at debug level with their reason. */
enum fetch_due {
    FETCH_NOT_DUE,
    FETCH_DUE,
};

struct cursor {
    /* The fetch cursor. While it is valid, every unsent row with an id up to
     * `hwm` whose transaction is visible in snapshot `snap` has been handed
     * out by this session (or is held back behind a refused row, or waits
     * as a refused row itself), and no row in flight lies above `hwm`. The
     * keyset fetch then asks only for ids above `hwm` and for the rows below
     * it that `snap` did not see yet (late commits), and nothing in flight
     * can be among them. Whatever may break that (a row back unsent, a
     * fetch ignored, a new session) drops it (cursor_clear); the next fetch is then
     * a full one, which excludes what is in flight and sets it again. */
    enum cursor_state state;
    uint64_t gen;       /* counts cursor_clear() calls */
    uint64_t fetch_gen; /* gen when the fetch in flight was sent */
    int64_t hwm;
    char *snap;
    size_t snap_cap;
    int64_t top_id;             /* highest id handed out in this session (NO_ID: none) */
    enum fetch_kind fetch_kind; /* the fetch in flight is a full or a keyset one ... */
    int64_t fetch_after;        /* ... above this id */
    int fetch_limit;            /* its row limit */
    int64_t fetch_max_ex;       /* full fetch: the highest id it excluded */
    bool fetch_partial;         /* log mode: the fetch answered makes a partial checkpoint at hwm */
    int bytes_limit;            /* most rows relay.fetch_max_bytes allows for now */
    enum fetch_ride fetch_ride; /* it goes on its own (FETCHING) or with the mark (MARKING) */
    bool caught_up;             /* the last fetch found fewer rows than it asked for */
    int64_t fetch_alone; /* the fetch in flight is a full one sent when this row was due to be tried
                          * alone (NO_ID: none) */
    int64_t fetch_sent_at;          /* when the fetch in flight was sent */
    enum fetch_answer fetch_answer; /* see relay_ignore_fetch (relay.c) */
    enum fetch_due fetch_due;       /* see cursor_want_fetch */
    int64_t poll_delay;             /* the pause before the next look for new rows */
    int64_t rows_found_at;          /* when a fetch last found rows */
    int64_t next_look_at;           /* when that look is due */
};

/* Something broke the cursor's promise (a row back unsent below hwm, a
 * key no longer held back, a new session): the next fetch is a full one.
 * A fetch already in flight was sent before it and cannot set the cursor
 * again when it answers. */
void cursor_clear(struct cursor *c, const char *why);
/* A fetch may find rows now (`why`); it goes once one is allowed. */
void cursor_want_fetch(struct cursor *c, const char *why);
/* Rows may lie below the cursor now (`why`): the next fetch is a full one,
 * and it is due. */
void cursor_full_fetch_due(struct cursor *c, const char *why);

#endif
