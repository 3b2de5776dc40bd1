/*
 * relay_txn: relay.transactions: the open Kafka transaction of the relay,
 * how many rows it holds and whether it must be aborted. relay.c begins,
 * commits and aborts it (ops->txn_begin, ops->txn_end) and moves the rows;
 * these only keep the count and answer when it may take rows and when it
 * ends.
 *
 * A transaction takes the rows of one fetch or more, up to
 * relay.transaction_rows; once their delivery reports are in and no fetch
 * is in flight it ends: aborted if a report failed, else committed once it
 * is full or the relay caught up. Acknowledged rows wait in SEAT_SENT until
 * the commit succeeds; only then are they marked (or stored by a cursor
 * row). An abort sends them back unsent.
 */
#ifndef OUTBOXD_RELAY_TXN_H
#define OUTBOXD_RELAY_TXN_H
#include "outboxd/relay.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum txn_state {
    TXN_NONE,   /* no transaction open */
    TXN_OPEN,   /* begun: rows are produced in it */
    TXN_ENDING, /* its commit or abort runs (txn.ending) */
};

struct txn {
    bool on;          /* relay.transactions */
    size_t max_rows;  /* relay.transaction_rows */
    int64_t max_age;  /* ms: half of kafka.transaction.timeout.ms */
    int64_t begun_at; /* when the open transaction began */
    bool handing_out; /* rows of a fetch are being taken and produced: no end now */
    enum txn_state state;
    enum obx_txn_end ending;
    size_t rows;    /* rows taken for the open transaction (or the next, before it begins) */
    size_t pending; /* ... whose delivery report has not come */
    bool failed;    /* a report failed: the transaction is aborted */
    bool stale;     /* the end in flight is of a session that is gone: ignore its answer */
    uint64_t commits, aborts;
};

/* Whether the open transaction is old: half its timeout gone. The
 * coordinator aborts one that outlives kafka.transaction.timeout.ms and
 * fences its producer, so it ends well before. */
static inline bool txn_old(const struct txn *t, int64_t now)
{
    return t->state == TXN_OPEN && now - t->begun_at >= t->max_age;
}

/* Whether a fetch's rows may go out now: no transaction, or an open one
 * with room that has not failed and is not old, and that holds no rows
 * yet if the relay caught up (`caught_up`): caught up, it ends as soon as
 * its reports are in, and a look for new rows sent meanwhile (every
 * millisecond or so) would keep it open until it is full. */
static inline bool txn_takes_rows(const struct txn *t, bool caught_up, int64_t now)
{
    return !t->on || (t->state != TXN_ENDING && !t->failed && t->rows < t->max_rows &&
                      !txn_old(t, now) && !(caught_up && t->rows > 0));
}

/* Whether the open transaction ends now: every report in, no rows being
 * handed out, no fetch that could add rows in flight, and it failed, is
 * full, or nothing more comes (`more`: rows are known to be waiting and a
 * fetch can bring them); an old one ends whatever is in flight (a fetch's
 * rows then wait for the next). */
static inline bool txn_end_due(const struct txn *t, bool fetch_out, bool more, int64_t now)
{
    if (!t->on || t->state != TXN_OPEN || t->pending > 0 || t->handing_out)
        return false;
    return txn_old(t, now) || (!fetch_out && (t->failed || t->rows >= t->max_rows || !more));
}

/* `n` fetched rows were taken: they go into the transaction (counted
 * now, before they are produced, so that the fetch sent meanwhile sees
 * whether it has room). */
static inline void txn_rows_taken(struct txn *t, size_t n)
{
    if (t->on)
        t->rows += n;
}

/* The taken rows are handed out: if none began a transaction (all found
 * published, held back or given back), they count for nothing. */
static inline void txn_batch_done(struct txn *t)
{
    if (t->state == TXN_NONE)
        t->rows = 0;
}

/* A row was handed to Kafka in the open transaction. */
static inline void txn_row_out(struct txn *t)
{
    t->pending++;
}

/* A report of a row of the open transaction came; `ok`: delivered. */
static inline void txn_row_reported(struct txn *t, bool ok)
{
    if (t->pending > 0)
        t->pending--;
    if (!ok)
        t->failed = true;
}

/* The transaction is over (ended, or forgotten with a lost session). */
static inline void txn_reset(struct txn *t)
{
    t->state = TXN_NONE;
    t->rows = t->pending = 0;
    t->failed = false;
}

#endif
