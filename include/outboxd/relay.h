/*
 * relay: the relay cycle as an explicit state machine (DESIGN 3.2).
 *
 *   recover once (rows a crashed run published are marked, not republished)
 *   -> fetch committed unsent rows in id order (above the highest id handed
 *      out plus late commits, or all but the rows in flight)
 *   -> produce each one -> collect acknowledgements from delivery reports
 *   -> mark them sent, with each partition's last offset, in one
 *      transaction -> repeat.
 *
 * The relay is pure logic: it does no I/O, includes no client library and
 * touches no global. It reacts to events (obx_relay_on_*) and issues commands
 * through struct obx_relay_ops, which main.c wires to pg, kafka, recovery,
 * the failpoints and the metrics, and which unit tests replace with fakes.
 * Time is passed in by the caller (ms on a monotonic clock).
 *
 * Every row handed to Kafka occupies a seat until it is marked; the seat
 * pointer is the Kafka message opaque, so a delivery report finds its row
 * without a lookup. The number of seats is relay.max_in_flight.
 *
 * Rows Kafka refuses for good follow relay.on_reject: `retry` keeps the row
 * and holds back the later rows of its key (other keys go on); `dead_letter`
 * moves it to outbox.dead_letters with the reason, and its key goes on.
 */
#ifndef OUTBOXD_RELAY_H
#define OUTBOXD_RELAY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "outboxd/config.h"
#include "outboxd/row.h"

enum obx_relay_state {
    OBX_RELAY_WAIT_PG = 0, /* no usable Postgres connection */
    OBX_RELAY_RECOVERING,  /* start-up recovery pass running (before any produce) */
    OBX_RELAY_IDLE,        /* connection idle: waiting for a wake-up, acks or a back-off */
    OBX_RELAY_FETCHING,    /* fetch query in flight */
    OBX_RELAY_MARKING,     /* mark transaction in flight */
    OBX_RELAY_STOPPED,     /* shut down; ops->stopped() has been called */
    OBX_RELAY_CLAIMING,    /* relay.shards > 1: its claim of slots in flight */
};

/* Result of ops->produce. */
enum obx_produce_result {
    OBX_PRODUCE_OK = 0,
    OBX_PRODUCE_BUSY = -1,          /* local queue full: try again later, stop this batch */
    OBX_PRODUCE_REFUSED = -2,       /* this row can never be produced as it is (e.g. too large) */
    OBX_PRODUCE_TOPIC_REFUSED = -3, /* nor any row of its topic (unknown, not authorized) */
};

/* relay.transactions: the calls that end a transaction, and their answers. */
enum obx_txn_end {
    OBX_TXN_COMMIT,
    OBX_TXN_ABORT,
};
enum obx_txn_result {
    OBX_TXN_OK = 0,
    OBX_TXN_RETRY,     /* timed out, and may go on in the background: call it again */
    OBX_TXN_ABORTABLE, /* the transaction cannot commit: abort it, then go on */
    OBX_TXN_FENCED,    /* a producer with our transactional.id took over: stop */
    OBX_TXN_FATAL,     /* the producer cannot go on */
};

/* Outcome of one delivery report. */
enum obx_delivery {
    OBX_DELIVERED = 0,          /* persisted by Kafka */
    OBX_DELIVERY_RETRY,         /* failed for a passing reason: publish again later */
    OBX_DELIVERY_REFUSED,       /* refused for good: relay.on_reject applies */
    OBX_DELIVERY_UNKNOWN,       /* failed, but may be persisted (e.g. timed out in flight): the
                                 * recovery pass looks before the row is published again */
    OBX_DELIVERY_BATCH_REFUSED, /* its whole batch was refused for good (too large, corrupt):
                                 * perhaps for another record's sake, so the row is tried
                                 * again alone before relay.on_reject applies */
    OBX_DELIVERY_TOPIC_REFUSED, /* its topic refuses every record (does not exist, may not be
                                 * written, invalid name): with relay.on_reject = retry in
                                 * mark and delete mode, the topic's rows wait as one */
};

/* A key whose later rows are held back behind a refused row. */
struct obx_held_back_key {
    const char *topic;
    const char *key;
    size_t key_len;
};

/* Log mode: a key whose rows the stored cursor leaves out from `from_id` on
 * (refused, or waiting behind a refused row). key NULL: that row alone. */
struct obx_log_held {
    const char *topic;
    const char *key;
    size_t key_len;
    int64_t from_id;
};

/* Log mode: a record the recovery pass found in Kafka for a row the stored
 * cursor does not cover (published by a run that stopped before storing). */
struct obx_log_found {
    int64_t id;
    const char *topic;
    int32_t partition;
    int64_t offset;
};

/* Log mode: the stored cursor and what the recovery pass found. Arrays are
 * the caller's; valid during the call. */
struct obx_log_slot_hwm {
    int32_t shards, slot;
    int64_t hwm;
};

struct obx_log_state {
    bool has_cursor; /* false: no cursor yet (every unsent row is waiting) */
    int64_t batch;   /* the newest cursor row's number */
    int64_t hwm;
    const char *snapshot;
    const struct obx_log_held *held;
    size_t n_held;
    const int64_t *also_sent; /* rows of held keys published since */
    size_t n_also;
    const char *const *off_topics; /* every partition's stored offset */
    const int32_t *off_partitions;
    const int64_t *off_offsets;
    size_t n_off;
    const struct obx_log_found *found;
    size_t n_found;
    int64_t max_hwm;  /* the highest hwm of any cursor row (has_cursor) */
    bool about_slots; /* some cursor row is about slots (sql/009) */
    /* The highest hwm of the cursor rows about each slot, per count
     * (shards 0: rows about no slots, which are about every row). */
    const struct obx_log_slot_hwm *slot_hwms;
    size_t n_slot_hwms;
};

/* What the fetch must leave out. Arrays are the relay's; valid during the call. */
struct obx_fetch {
    const int64_t *exclude; /* ids in flight, and refused rows not yet due for a retry */
    size_t n_exclude;
    const struct obx_held_back_key *held_back; /* rows of these keys wait ... */
    const int64_t *held_back_ids;              /* ... behind these ids (allowed themselves) */
    size_t n_held_back;
    int limit;               /* most rows */
    int64_t max_row_bytes;   /* a larger payload is left out: the row comes as oversize */
    bool keyset;             /* ids above after_id and late commits, nothing excluded */
    int64_t after_id;        /* keyset: the highest id handed out (any value, 0 and below too) */
    const char *snapshot;    /* keyset: the snapshot of the fetch that handed out after_id */
    int shards;              /* relay.shards */
    const char *owned_slots; /* only rows of these slots, as array text ("{0,3}"); NULL: all */
    /* Log mode's full fetch (not keyset): every row the stored cursor does
     * not cover, but the excluded ones. after_id and snapshot are then the
     * stored cursor's. */
    bool log;
    bool by_slot;                    /* log mode: each row against the cursor rows about its slot */
    const struct obx_log_held *held; /* the stored cursor's held keys */
    size_t n_held;
    const int64_t *also_sent;
    size_t n_also;
};

/* What one mark transaction confirms. Arrays are the relay's. */
struct obx_mark {
    const int64_t *ids; /* acknowledged rows: set sent_at (or delete) */
    size_t n_ids;
    const char *const *topics; /* highest acknowledged offset per partition */
    const int32_t *partitions;
    const int64_t *offsets;
    size_t n_offsets;
    int shards;              /* the offsets are stored for each slot of relay.shards ... */
    const char *owned_slots; /* ... in this array text (NULL: slot 0 of 1) */
    const int64_t *dead_ids; /* rows to move to outbox.dead_letters */
    const char *const *dead_reasons;
    size_t n_dead;
    /* Log mode: instead of marking `ids`, one cursor row (its number, hwm,
     * snapshot, held keys and the rows of those published), with the
     * offsets that moved (every partition's when `restart`: the table is
     * emptied first). */
    bool log;
    int64_t batch;
    int64_t hwm;
    const char *snapshot;
    const struct obx_log_held *held;
    size_t n_held;
    const int64_t *also_sent;
    size_t n_also;
    bool restart;
};

struct obx_relay_ops {
    /* Sends the fetch query: unsent rows in id order per `f`. The answer
     * comes through obx_relay_on_fetched() or obx_relay_on_query_failed().
     * Returns 0, or -1 if it could not be sent. */
    int (*fetch)(void *io, const struct obx_fetch *f);
    /* Sends the mark transaction; answer via on_marked/on_query_failed. */
    int (*mark)(void *io, const struct obx_mark *m);
    /* Sends the mark (no dead letters) and the keyset fetch `f` as one
     * statement; answer via on_mark_fetched/on_query_failed. Returns 0, -1
     * if it could not be sent, or 1 if they cannot go together now (then
     * the relay sends the mark alone). May be NULL. */
    int (*mark_fetch)(void *io, const struct obx_mark *m, const struct obx_fetch *f);
    /* Hands one row to Kafka with `opaque` for its delivery report, called
     * with the relay's `producer` (obx_relay_new): the row goes from the
     * relay straight to it. On
     * OBX_PRODUCE_REFUSED, *reason says why (static or valid until the
     * next call). */
    enum obx_produce_result (*produce)(void *producer, const struct obx_row *row, void *opaque,
                                       const char **reason);
    /* As produce, for a row tried alone (nothing else is out): a producer
     * whose refusal stops nothing else. May be NULL (then produce); not
     * used with transactions. */
    enum obx_produce_result (*produce_alone)(void *producer, const struct obx_row *row,
                                             void *opaque, const char **reason);
    /* Starts the recovery pass over the rows of `owned_slots` (array text
     * of slots of relay.shards = `shards`; NULL: every row); its end comes
     * through obx_relay_on_recovered. Returns 0, or -1 if it could not
     * start. */
    int (*recover)(void *io, int shards, const char *owned_slots);
    /* relay.shards > 1: gives the slots in `give_back` (array text) back and
     * with `take` takes free ones up to this relay's share
     * (outbox.claim_slots); the answer comes through obx_relay_on_claimed or
     * obx_relay_on_query_failed. Returns 0, or -1 if it could not be sent.
     * May be NULL when relay.shards is 1. */
    int (*claim)(void *io, int shards, const char *give_back, bool take);
    /* The relay has stopped; called once. */
    void (*stopped)(void *io, int exit_code);
    /* Failpoint `id` (enum obx_fp_id) is reached: non-zero = act as if the
     * step failed (an armed `crash` does not return). NULL = none armed. */
    int (*failpoint)(void *io, int id);
    /* A row created at `created_us` (Unix microseconds) was acknowledged:
     * for the latency histogram. May be NULL. */
    void (*acked)(void *io, int64_t created_us);
    /* The relay wants obx_relay_tick at monotonic time `when` (the next
     * look for new rows); replaces any earlier request. May be NULL (then
     * only the caller's periodic tick drives it). */
    void (*wake_at)(void *io, int64_t when);
    /* relay.transactions: begins a transaction (with the relay's
     * `producer`, at once): 0, or -1 with *reason, or -2 when the producer
     * cannot go on (a new one comes with the next recovery pass's init).
     * Then ends it, commit or abort: 0 when the call went (its answer comes
     * through obx_relay_on_txn_ended), -1 when it could not. NULL without
     * transactions. */
    int (*txn_begin)(void *producer, const char **reason);
    int (*txn_end)(void *io, enum obx_txn_end end);
    /* The loop's monotonic time in ms, for the answers that come straight
     * from Postgres (obx_relay_fetched, obx_relay_mark_fetched). May be
     * NULL if those are not used. */
    int64_t (*now)(void *io);
};

enum obx_on_reject {
    OBX_ON_REJECT_RETRY = 0,
    OBX_ON_REJECT_DEAD_LETTER = 1,
};

struct obx_relay_settings {
    int batch_size;
    int max_in_flight;
    int on_reject; /* enum obx_on_reject */
    int64_t poll_interval_ms;
    int64_t retry_backoff_ms;
    int64_t shutdown_timeout_ms;
    int64_t stall_timeout_ms; /* 0 = never report a stall */
    int64_t fetch_max_bytes;  /* payload bytes one fetch may bring */
    int64_t max_payload;      /* the producer's message.max.bytes */
    /* A finite message timeout: librdkafka may time a queued record out while
     * a later one of its partition is sent after it, so a key has one record
     * with Kafka at a time and its later rows are parked behind it. */
    bool one_per_key;
    /* relay.on_sent = log: progress is a cursor row per batch (see relay.c). */
    bool log_mode;
    /* relay.shards: above 1 the relay publishes only the rows of the slots
     * it owns (relay_owner.c). */
    int shards;
    /* relay.transactions: rows go out in Kafka transactions of up to
     * transaction_rows rows; acknowledged rows are marked once theirs
     * committed (relay_txn.h). */
    bool transactions;
    int transaction_rows;
    int64_t transaction_timeout_ms; /* the producer's kafka.transaction.timeout.ms */
};

/* The answer to ops->claim (outbox.claim_slots). */
struct obx_claim {
    const char *owned;  /* the slots held now, comma-separated ("" for none) */
    int members;        /* relays sharing the slots */
    int share;          /* this relay's fair part */
    int free;           /* slots nobody holds */
    int other_shards;   /* a member with another relay.shards (0: none) */
    int64_t cursor_hwm; /* about the highest hwm of log mode's cursor rows (-1: none) */
};

struct obx_relay;

void obx_relay_settings_from_config(struct obx_relay_settings *s, const struct obx_config *cfg);

/* Allocates a relay in WAIT_PG. Every op is called with `io` but
 * ops->produce, which is called with `producer`. Takes ownership of
 * neither. */
int obx_relay_new(const struct obx_relay_settings *s, const struct obx_relay_ops *ops, void *io,
                  void *producer, struct obx_relay **out) OBX_WARN_UNUSED;
void obx_relay_free(struct obx_relay *r);

/* Events. `now` is monotonic milliseconds. */
void obx_relay_on_pg_ready(struct obx_relay *r, int64_t now);
void obx_relay_on_pg_lost(struct obx_relay *r, int64_t now);
/* relay.transactions: the answer of ops->txn_end. */
void obx_relay_on_txn_ended(struct obx_relay *r, enum obx_txn_end end, enum obx_txn_result result,
                            const char *reason, int64_t now);
void obx_relay_on_recovered(struct obx_relay *r, bool ok, int64_t now);
/* Log mode: what the recovery pass read, given just before
 * obx_relay_on_recovered(ok = true). Returns -1 out of memory (then report
 * the pass as failed). */
int obx_relay_on_log_state(struct obx_relay *r, const struct obx_log_state *st) OBX_WARN_UNUSED;
/* `snapshot`: the fetch statement's snapshot (pg_snapshot text), NULL if
 * unknown (the next fetch is then a full one). */
void obx_relay_on_fetched(struct obx_relay *r, const struct obx_row *rows, size_t n,
                          const char *snapshot, int64_t now);
void obx_relay_on_marked(struct obx_relay *r, int64_t now);
/* The answer to ops->claim. */
void obx_relay_on_claimed(struct obx_relay *r, const struct obx_claim *c, int64_t now);
/* The answer of ops->mark_fetch: the mark committed and the fetch's rows. */
void obx_relay_on_mark_fetched(struct obx_relay *r, const struct obx_row *rows, size_t n,
                               const char *snapshot, int64_t now);
/* The same two answers in the shape of pg's obx_pg_rows_fn (`relay` is the
 * struct obx_relay, the time is ops->now's): Postgres hands the fetched rows
 * straight to the relay. `error` set: as obx_relay_on_query_failed. */
void obx_relay_fetched(void *relay, const struct obx_row *rows, size_t n, const char *snapshot,
                       const char *error);
void obx_relay_mark_fetched(void *relay, const struct obx_row *rows, size_t n, const char *snapshot,
                            const char *error);
/* The fetch or mark failed but the connection is still usable. */
void obx_relay_on_query_failed(struct obx_relay *r, const char *reason, int64_t now);
/* One delivery report. key/key_len are the record's key (for blocking). */
void obx_relay_on_delivery(struct obx_relay *r, void *opaque, enum obx_delivery outcome,
                           int32_t partition, int64_t offset, const char *key, size_t key_len,
                           const char *reason, int64_t now);
/* Timers: the look for new rows, back-offs, shutdown deadline. */
void obx_relay_tick(struct obx_relay *r, int64_t now);
/* Stop fetching; finish in-flight rows (bounded by the shutdown timeout). */
void obx_relay_shutdown(struct obx_relay *r, int64_t now);
/* Kafka cannot go on (fatal producer error): mark what was acknowledged and
 * stop with exit code 1. */
void obx_relay_fatal(struct obx_relay *r, const char *reason, int64_t now);

/* Something moved outside the relay's own view (the recovery scan read
 * records): counts as progress for the stall check. */
void obx_relay_note_progress(struct obx_relay *r, int64_t now);
/* The stall check, from housekeeping. `deps_ok`: Postgres and Kafka look
 * reachable (a relay waiting for a dependency that is down is not stalled:
 * restarting it would not help). Logs when a stall begins, every
 * stall_timeout while it lasts, and when it ends. */
void obx_relay_check_stall(struct obx_relay *r, bool deps_ok, int64_t now);
/* Milliseconds without progress if stalled (as last checked), else 0; why
 * into buf. */
int64_t obx_relay_stalled(const struct obx_relay *r, char *why, size_t len);
/* Monotonic time of the last progress: a row marked, an empty fetch with
 * nothing in flight, the lock acquired, recovery done or reading. */
int64_t obx_relay_last_progress(const struct obx_relay *r);

enum obx_relay_state obx_relay_state(const struct obx_relay *r);
const char *obx_relay_state_name(enum obx_relay_state s);
/* The start-up recovery pass has succeeded (publishing may happen). */
bool obx_relay_recovered(const struct obx_relay *r);
/* Rows handed to Kafka and not yet marked. */
size_t obx_relay_in_flight(const struct obx_relay *r);
/* Rows acknowledged and marked since start. */
uint64_t obx_relay_marked_total(const struct obx_relay *r);
/* Fetches sent: keyset ones (the cursor valid) or full ones. */
uint64_t obx_relay_fetches(const struct obx_relay *r, bool keyset);
/* Rows moved to outbox.dead_letters since start. */
uint64_t obx_relay_dead_total(const struct obx_relay *r);
/* relay.transactions: Kafka transactions committed (else aborted) so far. */
uint64_t obx_relay_transactions(const struct obx_relay *r, bool committed);
/* Keys currently held back behind a refused row. */
size_t obx_relay_held_back_keys(const struct obx_relay *r);
/* relay.shards > 1: the slots owned, the relays sharing them (0 before the
 * first claim of a session), and slot moves (taken or given back) so far. */
struct obx_relay_slots {
    int shards, owned, members, share;
    uint64_t moves;
};
void obx_relay_slots(const struct obx_relay *r, struct obx_relay_slots *out);
/* Whether this relay runs the outbox's maintenance (retention, partitions,
 * the backlog gauges): with relay.shards above 1 only the owner of slot 0,
 * so relays do not do it twice and race for the same partitions. */
bool obx_relay_maintains(const struct obx_relay *r);
/* The slots owned as text ("0,3,5"; "" for none, "all" for relay.shards 1). */
const char *obx_relay_owned_slots(const struct obx_relay *r);

#endif
