/*
 * relay: see include/outboxd/relay.h. This file is the cycle: fetch,
 * produce, delivery reports, mark, rows parked behind their key's record,
 * and every entry point (shutdown, fatal errors, progress and stalls too);
 * the other rooms of the relay are relay_rows.c (the rows in flight and
 * their states), relay_cursor.c (the fetch cursor and the fetch in
 * flight), relay_log.c (log mode's cursor rows), relay_held.c (refused rows
 * and the keys they hold back), relay_owner.c (the slots of relay.shards
 * owned) and relay_drain.c (predicates: when a drain may stop, what a stall
 * waits for). Their shared state: relay_int.h.
 */
#include "relay_int.h"
#include "outboxd/alloc.h"
#include "outboxd/log.h"

#include <string.h>

/* The cycle's own, used before they are defined. */
static bool fetch_room_fits(struct obx_relay *r);
static void relay_set_state(struct obx_relay *r, enum obx_relay_state to, const char *why);
static void relay_seat_release(struct obx_relay *r, struct seat *s);
static void relay_ignore_fetch(struct obx_relay *r, const char *why);
static int relay_failpoint(struct obx_relay *r, enum obx_fp_id id);
static void relay_stop(struct obx_relay *r, const char *why);
static void relay_kick(struct obx_relay *r, int64_t now);
static void relay_after_release(struct obx_relay *r);
static void relay_release_parked_of(struct obx_relay *r, uint64_t h);
static void relay_release_all_parked(struct obx_relay *r);
static bool relay_park(struct obx_relay *r, struct seat *s, const struct obx_row *row);
static void relay_produce_parked(struct obx_relay *r, uint64_t h, int64_t now);
static void relay_progress(struct obx_relay *r, int64_t now);

/* The error about log mode's rows in flight that cannot be stored, at most
 * this often. */
#define FULL_WARN_MS 60000
/* Which moves are possible: allowed[from] is a bit set of destinations. */
#define BIT(s) (1u << (s))
static const unsigned allowed[] = {
    [OBX_RELAY_WAIT_PG] = BIT(OBX_RELAY_IDLE) | BIT(OBX_RELAY_STOPPED),
    [OBX_RELAY_RECOVERING] = BIT(OBX_RELAY_IDLE) | BIT(OBX_RELAY_WAIT_PG) | BIT(OBX_RELAY_STOPPED),
    [OBX_RELAY_IDLE] = BIT(OBX_RELAY_RECOVERING) | BIT(OBX_RELAY_FETCHING) |
                       BIT(OBX_RELAY_MARKING) | BIT(OBX_RELAY_CLAIMING) | BIT(OBX_RELAY_WAIT_PG) |
                       BIT(OBX_RELAY_STOPPED),
    [OBX_RELAY_FETCHING] = BIT(OBX_RELAY_IDLE) | BIT(OBX_RELAY_WAIT_PG) | BIT(OBX_RELAY_STOPPED),
    [OBX_RELAY_MARKING] = BIT(OBX_RELAY_IDLE) | BIT(OBX_RELAY_WAIT_PG) | BIT(OBX_RELAY_STOPPED),
    [OBX_RELAY_STOPPED] = 0,
    [OBX_RELAY_CLAIMING] = BIT(OBX_RELAY_IDLE) | BIT(OBX_RELAY_WAIT_PG) | BIT(OBX_RELAY_STOPPED),
};

/* The one place the state changes. Refuses impossible moves (a bug). */
static void relay_set_state(struct obx_relay *r, enum obx_relay_state to, const char *why)
{
    if (!(allowed[r->state] & BIT(to))) {
        OBX_BUG("relay: refused state change %s -> %s (%s)", obx_relay_state_name(r->state),
                obx_relay_state_name(to), why);
        return;
    }
    obx_debug("relay: %s -> %s (%s)", obx_relay_state_name(r->state), obx_relay_state_name(to),
              why);
    r->state = to;
    r->state_since = r->now;
}

void obx_relay_settings_from_config(struct obx_relay_settings *s, const struct obx_config *cfg)
{
    s->batch_size = cfg->batch_size;
    s->max_in_flight = cfg->max_in_flight;
    s->on_reject = cfg->on_reject;
    s->poll_interval_ms = cfg->poll_interval_ms;
    s->retry_backoff_ms = cfg->retry_backoff_ms;
    s->shutdown_timeout_ms = cfg->shutdown_timeout_ms;
    s->stall_timeout_ms = cfg->stall_timeout_ms;
    s->fetch_max_bytes = cfg->fetch_max_bytes;
    s->max_payload = 1000000; /* librdkafka's default; main.c sets the effective value */
    s->one_per_key = false;   /* main.c sets it from the producer's message timeout */
    s->log_mode = cfg->on_sent == OBX_ON_SENT_LOG;
    s->shards = cfg->shards;
    s->transactions = cfg->transactions != 0;
    s->transaction_rows = cfg->transaction_rows;
}

int obx_relay_new(const struct obx_relay_settings *s, const struct obx_relay_ops *ops, void *io,
                  void *producer, struct obx_relay **out)
{
    size_t n = (size_t)s->max_in_flight;
    struct obx_relay *r = obx_calloc(1, sizeof(*r));
    if (!r)
        return -1;
    r->set = *s;
    r->failure_warned_at = r->unknown_warned_at = INT64_MIN / 2; /* the first of each warns */
    r->full_warned_at = INT64_MIN / 2;
    r->ops = ops;
    r->io = io;
    r->producer = producer;
    r->state = OBX_RELAY_WAIT_PG;
    r->ids = obx_calloc(n, sizeof(*r->ids)); /* + held.cap: see fetch_room_fits() */
    r->held.retry_backoff_ms = s->retry_backoff_ms;
    r->dead_ids = obx_calloc(n, sizeof(*r->dead_ids));
    r->dead_reasons = obx_calloc(n, sizeof(*r->dead_reasons));
    r->batch = obx_calloc((size_t)s->batch_size, sizeof(*r->batch));
    if (rows_init(&r->rows, s->max_in_flight) != 0 || !r->ids || !r->dead_ids || !r->dead_reasons ||
        part_offsets_init(&r->offs, n) != 0 || !r->batch ||
        (s->one_per_key && obx_keycount_init(&r->busy_keys, n) != 0)) {
        obx_relay_free(r);
        return -1;
    }
    cursor_want_fetch(&r->cur, "start");
    r->cur.poll_delay = POLL_MIN_MS;
    r->cur.bytes_limit = s->batch_size;
    r->cur.top_id = r->cur.hwm = r->alone_id = r->cur.fetch_alone = NO_ID;
    if (owner_init(&r->owner, s->shards, s->log_mode) != 0) {
        obx_relay_free(r);
        return -1;
    }
    r->txn.on = s->transactions && ops->txn_begin && ops->txn_end;
    r->txn.max_rows = s->transaction_rows > 0 ? (size_t)s->transaction_rows : 1;
    r->txn.max_age = s->transaction_timeout_ms > 0 ? s->transaction_timeout_ms / 2 : 5000;
    if (s->transactions && !r->txn.on)
        OBX_BUG("relay: relay.transactions without the ops that run them");
    *out = r;
    return 0;
}

void obx_relay_free(struct obx_relay *r)
{
    if (!r)
        return;
    held_free(&r->held);
    topics_free(&r->topics);
    obx_free(r->cur.snap);
    rows_free(&r->rows);
    obx_free(r->ids);
    obx_free(r->keys);
    obx_free(r->key_ids);
    obx_free(r->dead_ids);
    obx_free(r->dead_reasons);
    part_offsets_free(&r->offs);
    obx_free(r->batch);
    obx_keycount_free(&r->busy_keys);
    log_free(&r->log);
    owner_free(&r->owner);
    obx_free(r);
}

/* A possibly-persisted report is not yet resolved by a recovery pass. Until
 * it is, nothing is marked: a mark raises the stored offset of each of its
 * partitions past the record it confirms, and the pass reads each partition
 * from that offset on, so a record acknowledged after the uncertain one
 * would move the pass past it, and a row that did land would be published
 * again. The pass marks what it finds itself. */
static bool relay_uncertain(const struct obx_relay *r)
{
    return r->unknowns != r->resolved;
}

/* What relay_drain.c reads of the relay. */
static struct drain_view drain_view_of(const struct obx_relay *r)
{
    return (struct drain_view){
        .state = r->state,
        .state_since = r->state_since,
        .in_use = rows_in_use(&r->rows),
        .to_mark = rows_to_mark(&r->rows),
        .n_outstanding = r->n_outstanding,
        .sent = r->rows.count[SEAT_SENT],
        .uncertain = relay_uncertain(r),
        .log_mode = r->set.log_mode,
        .log_checkpoint_due = log_checkpoint_due(&r->log),
        .drain_deadline = r->drain_deadline,
        .hard_deadline = r->hard_deadline,
    };
}

static bool relay_drain_over(const struct obx_relay *r, int64_t now)
{
    struct drain_view v = drain_view_of(r);
    return drain_over(&v, now);
}

static void relay_describe_wait(const struct obx_relay *r, int64_t now, char *why, size_t len)
{
    struct drain_view v = drain_view_of(r);
    drain_describe_wait(&v, now, why, len);
}

/* What relay_log.c reads of the relay. */
static struct log_view log_view_of(const struct obx_relay *r)
{
    return (struct log_view){
        .rows = &r->rows,
        .topics = &r->topics,
        .owner = &r->owner,
        .shards = r->set.shards,
        .batch_size = (size_t)r->set.batch_size,
        .draining = r->draining,
        .now = r->now,
    };
}

/* Log mode: seat `s` no longer waits for Kafka: `acked` (acknowledged or
 * to be dead-lettered) or not (back unsent, or held: it leaves its fetch). */
static void relay_log_settle(struct obx_relay *r, struct seat *s, bool acked)
{
    if (!r->set.log_mode || s->orphan || s->seq == 0)
        return;
    log_settle(&r->log, s->seq, s->id, acked, r->now);
    if (!acked)
        s->seq = 0;
}

/* Log mode, with slots: a checkpoint waits no longer for more rows. */
static bool relay_log_idle_write_due(const struct obx_relay *r, int64_t now)
{
    struct log_view v = log_view_of(r);
    v.now = now;
    return r->set.log_mode && log_idle_write_due(&r->log, &v);
}

static void relay_seat_release(struct obx_relay *r, struct seat *s)
{
    if (s->state == SEAT_PRODUCED || s->state == SEAT_PARKED || s->state == SEAT_SENT)
        relay_log_settle(r, s, false); /* back unsent, or held */
    rows_release(&r->rows, s);
}

/* ---- refused rows: relay_held.c keeps the entries, this applies the rest ---- */

/* What a call into relay_held.c asked for (struct held_fx), applied right
 * after it: before a seat is released, whose log-mode settle reads the
 * rules of held rows. */
static void held_apply(struct obx_relay *r, const struct held_fx *fx)
{
    /* The fetch's arrays grow with the entries now, not while a mark holds
     * r->ids (start_mark); failing, the next fetch waits (build_fetch). */
    if (!fetch_room_fits(r))
        obx_error("relay: out of memory for the fetch's %zu held-back keys; fetching once there "
                  "is",
                  r->held.n);
    for (size_t i = 0; r->set.log_mode && i < fx->n_lifted; i++)
        log_lift(&r->log, r->held.lifted[i]);
    if (fx->hold && r->set.log_mode)
        log_hold(&r->log, fx->hold_id, fx->hold_topic, fx->hold_key, fx->hold_key_len);
    if (fx->clear_cursor)
        cursor_clear(&r->cur, fx->clear_cursor);
    if (fx->want_fetch)
        cursor_want_fetch(&r->cur, fx->want_fetch);
}

/* Row `id` was delivered, or went on otherwise (`delivered` false: without
 * a word): its key's rows go on. */
static void held_goes_on(struct obx_relay *r, int64_t id, bool delivered)
{
    struct held_fx fx = {0};
    if (delivered)
        held_release(&r->held, id, &fx);
    else
        held_drop(&r->held, id, &fx);
    held_apply(r, &fx);
}

/* A row Kafka refused for good: apply relay.on_reject. `s` is its seat. */
static void row_refused(struct obx_relay *r, struct seat *s, const char *key, size_t key_len,
                        const char *reason, int64_t now)
{
    if (r->set.on_reject == OBX_ON_REJECT_DEAD_LETTER) {
        obx_error("relay: row %lld (topic %s) refused by Kafka: %s; moving it to "
                  "outbox.dead_letters",
                  (long long)s->id, r->topics.name[s->topic], reason);
        s->reason = obx_strdup(reason ? reason : "refused by Kafka");
        if (s->reason) {
            if (s->state == SEAT_PRODUCED || s->state == SEAT_PARKED)
                relay_log_settle(r, s, true);
            rows_move(&r->rows, s, SEAT_DEAD);
            held_goes_on(r, s->id, false); /* refused alone too: its key goes on */
            return;
        }
        obx_error("relay: out of memory dead-lettering row %lld; retrying it", (long long)s->id);
    } else {
        obx_error("relay: row %lld (topic %s) refused by Kafka: %s; retrying it, later rows of "
                  "its key wait (relay.on_reject = retry)",
                  (long long)s->id, r->topics.name[s->topic], reason);
    }
    struct held_fx fx = {0};
    held_refused(&r->held, s->id, s->topic, key, key_len, now, &fx);
    held_apply(r, &fx);
    relay_seat_release(r, s);
    cursor_want_fetch(&r->cur, "row refused");
}

/* Row `s`'s topic refused it, or `s` itself was refused (`topic` false). */
static void refused_as(struct obx_relay *r, struct seat *s, bool topic, const char *key,
                       size_t key_len, const char *reason, int64_t now)
{
    if (!topic || r->set.on_reject != OBX_ON_REJECT_RETRY || r->set.log_mode) {
        row_refused(r, s, key, key_len, reason, now);
        return;
    }
    struct held_fx fx = {0};
    bool behind = held_topic_refused(&r->held, s->id, s->topic, r->topics.name[s->topic], key,
                                     key_len, reason, now, &fx);
    held_apply(r, &fx);
    relay_seat_release(r, s);
    if (behind) /* below hwm, fetched again by a full fetch once the topic goes on */
        cursor_clear(&r->cur, "row refused");
    else
        cursor_want_fetch(&r->cur, "topic refused");
}

static void batch_refused(struct obx_relay *r, struct seat *s, const char *key, size_t key_len,
                          const char *reason, int64_t now)
{
    struct held_fx fx = {0};
    held_batch_refused(&r->held, s->id, s->topic, r->topics.name[s->topic], key, key_len, reason,
                       now, &fx);
    held_apply(r, &fx);
    relay_seat_release(r, s);
    cursor_want_fetch(&r->cur, "batch refused");
}

/* A fetch in flight, on its own or beside the mark, was sent before `why`: its
 * answer is set aside and its rows fetched again. */
static void relay_ignore_fetch(struct obx_relay *r, const char *why)
{
    if (r->state != OBX_RELAY_FETCHING && r->cur.fetch_ride != RIDE_ON_MARK)
        return;
    if (r->cur.fetch_answer == ANSWER_USE)
        obx_debug("relay: the fetch in flight will be ignored (%s)", why);
    r->cur.fetch_answer = ANSWER_IGNORE;
}

/* Failpoint `id`, through the ops (the relay reads no global). */
static int relay_failpoint(struct obx_relay *r, enum obx_fp_id id)
{
    return r->ops->failpoint ? r->ops->failpoint(r->io, (int)id) : 0;
}

static void relay_stop(struct obx_relay *r, const char *why)
{
    relay_set_state(r, OBX_RELAY_STOPPED, why);
    if (r->state == OBX_RELAY_STOPPED)
        r->ops->stopped(r->io, r->exit_code);
}

/* Adds seat `s`'s offset to the per-partition maxima waiting to be stored. */
static void note_offset(struct obx_relay *r, const struct seat *s)
{
    part_offsets_raise(&r->offs, r->topics.name[s->topic], s->partition, s->offset);
}

/* What relay_owner.c reads of the relay. */
static struct owner_view owner_view_of(const struct obx_relay *r)
{
    return (struct owner_view){
        .quiet = rows_in_use(&r->rows) == 0 && rows_to_mark(&r->rows) == 0 && !relay_uncertain(r),
        .recovered = r->recovered,
        .found_pending = r->set.log_mode && r->log.n_found > 0,
        .log_waits_checkpoint = r->set.log_mode && log_waits_checkpoint(&r->log, &r->rows),
        .draining = r->draining,
        .can_claim = r->ops->claim != NULL,
        .state = r->state,
        .hard_deadline = r->hard_deadline,
    };
}

/* The fetch's arrays fit the held entries (which grow as rows are
 * refused): a key and an id for each, and each id among the exclusions. */
static bool fetch_room_fits(struct obx_relay *r)
{
    size_t cap = r->held.cap;
    if (r->fetch_room >= cap)
        return true;
    struct obx_held_back_key *k = obx_realloc(r->keys, cap * sizeof(*k));
    if (!k)
        return false;
    r->keys = k;
    int64_t *ki = obx_realloc(r->key_ids, cap * sizeof(*ki));
    if (!ki)
        return false;
    r->key_ids = ki;
    int64_t *ids = obx_realloc(r->ids, ((size_t)r->set.max_in_flight + cap) * sizeof(*ids));
    if (!ids)
        return false;
    r->ids = ids;
    r->fetch_room = cap;
    return true;
}

/* Fills `f` for the next fetch; false if none can go (no free seat, or
 * `keyset_only` and it would be a full one). Arrays are the relay's. */
static bool build_fetch(struct obx_relay *r, int64_t now, struct obx_fetch *f, bool keyset_only)
{
    if (!fetch_room_fits(r)) {
        obx_error("relay: out of memory for the fetch's %zu held-back keys; fetching later",
                  r->held.n);
        return false;
    }
    *f = (struct obx_fetch){.exclude = r->ids,
                            .held_back = r->keys,
                            .held_back_ids = r->key_ids,
                            .shards = r->set.shards,
                            .owned_slots = owner_fetch_slots(&r->owner)};
    int free_seats = r->set.max_in_flight - (int)rows_in_use(&r->rows);
    f->limit = free_seats < r->set.batch_size ? free_seats : r->set.batch_size;
    if (f->limit > r->cur.bytes_limit)
        f->limit = r->cur.bytes_limit;
    if (f->limit <= 0)
        return false;
    /* limit x this <= relay.fetch_max_bytes; a row asked for alone comes
     * whole if Kafka could take it at all. */
    f->max_row_bytes = f->limit == 1 ? r->set.max_payload : r->set.fetch_max_bytes / f->limit;
    if (f->max_row_bytes > r->set.max_payload)
        f->max_row_bytes = r->set.max_payload;
    /* The keyset fetch whenever the cursor is valid, caught up or not: it
     * starts from hwm, where a full fetch walks the unsent-row index from
     * its lowest entry, past every row marked or deleted since the last
     * vacuum (and a held xmin horizon keeps them all). */
    bool keyset = r->cur.state == CURSOR_VALID;
    for (size_t i = 0; i < r->held.n && keyset; i++)
        keyset = r->held.entry[i].retry_at > now; /* a due one lies below hwm */
    if (keyset_only && !keyset)
        return false;
    if (keyset) {
        f->keyset = true;
        f->after_id = r->cur.hwm;
        f->snapshot = r->cur.snap;
    } else if (r->log.has_stored) {
        /* Everything the stored cursor does not cover, but what is in flight. */
        if (!log_held_out(&r->log, &r->topics))
            return false;
        f->log = true;
        f->by_slot = r->log.by_slot;
        f->after_id = r->log.stored_hwm;
        f->snapshot = r->log.stored_snap;
        f->held = r->log.held_out;
        f->n_held = r->log.n_held_out;
        f->also_sent = r->log.also_out;
        f->n_also = r->log.n_also_out;
    }
    /* A relay owning every slot reads as a single relay: slot_of() for each
     * row cost its backend a fifth more. Not log mode's full fetch by slot,
     * whose floor is over the slots it names. */
    if (owner_fetch_every_slot(&r->owner) && !(f->log && f->by_slot))
        f->owned_slots = NULL;
    if (!keyset) {
        for (int i = 0; i < r->rows.cap; i++)
            if (r->rows.seat[i].state != SEAT_FREE)
                r->ids[f->n_exclude++] = r->rows.seat[i].id;
    }
    for (size_t i = 0; i < r->held.n; i++) {
        const struct held_back *b = &r->held.entry[i];
        if (b->retry_at > now && !keyset)
            r->ids[f->n_exclude++] = b->id; /* not due yet (a keyset fetch is above it) */
        if (b->key || b->whole_topic) {     /* a topic's: key NULL, every later row */
            r->keys[f->n_held_back] =
                b->whole_topic
                    ? (struct obx_held_back_key){r->topics.name[b->topic], NULL, 0}
                    : (struct obx_held_back_key){r->topics.name[b->topic], b->key, b->key_len};
            r->key_ids[f->n_held_back++] = b->id;
        }
    }
    return true;
}

/* The fetch `f` went to Postgres. */
static void fetch_sent(struct obx_relay *r, const struct obx_fetch *f, int64_t now)
{
    int64_t max_ex = NO_ID;
    for (size_t i = 0; i < f->n_exclude; i++)
        if (f->exclude[i] > max_ex)
            max_ex = f->exclude[i];
    r->cur.fetch_kind = f->keyset ? FETCH_KEYSET : FETCH_FULL;
    r->cur.fetch_after = f->after_id;
    r->cur.fetch_gen = r->cur.gen;
    r->fetches[f->keyset]++;
    r->cur.fetch_limit = f->limit;
    r->cur.fetch_max_ex = max_ex;
    r->cur.fetch_sent_at = now;
    /* As the full fetch's held-back keys say, for the entries held_drop_gone
     * looks at (a keyset fetch drops none). */
    for (size_t i = 0; i < r->held.n && !f->keyset; i++) {
        struct held_back *e = &r->held.entry[i];
        e->behind_at_fetch = !e->alone && e->retry_at <= now && held_behind_another(&r->held, e);
    }
    const struct held_back *alone =
        r->held.n > 0 && !f->keyset ? held_due_alone(&r->held, now) : NULL;
    /* One taken from the answer before (its seat is in the exclusions)
     * is on its way: this fetch's answer without it says nothing. */
    for (size_t i = 0; alone && i < f->n_exclude; i++)
        if (f->exclude[i] == alone->id)
            alone = NULL;
    r->cur.fetch_alone = alone ? alone->id : NO_ID;
    r->cur.fetch_due = FETCH_NOT_DUE;
    log_fetch_sent(&r->log);
}

/* The fetch in flight (on its own or beside a mark) will not answer: fetch
 * again, and a full fetch, whatever went wrong. */
static void fetch_gone(struct obx_relay *r)
{
    r->cur.fetch_ride = RIDE_ALONE;
    r->cur.fetch_answer = ANSWER_USE;
    cursor_full_fetch_due(&r->cur, "the fetch in flight will not answer");
}

/* Whether a fetch may go now. */
static bool fetch_allowed(struct obx_relay *r, int64_t now)
{
    if (r->draining || !r->recovered)
        return false;
    if (owner_active(&r->owner)) {
        struct owner_view v = owner_view_of(r);
        if (owner_hold_fetch(&r->owner, &v))
            return false;
    }
    /* Transactions: a fetch's rows go into the open transaction while it
     * has room, and wait while it ends. */
    if (!txn_takes_rows(&r->txn, r->cur.caught_up, now))
        return false;
    /* A row tried alone goes to Kafka alone: nothing else is fetched while it is out,
     * and it waits until no other row's report is pending (and no
     * transaction is open: it goes in one of its own). */
    return !(r->alone_id != NO_ID || ((r->n_outstanding > 0 || r->txn.state != TXN_NONE) &&
                                      r->held.n > 0 && held_due_alone(&r->held, now)));
}

/* Whether a fetch should go now (beside a mark, or on its own). */
static bool fetch_wanted(struct obx_relay *r, int64_t now)
{
    return r->cur.fetch_due == FETCH_DUE && fetch_allowed(r, now);
}

/* A fetch answered with `n` rows: when to look for new rows next. Rows
 * keep coming: look again soon. None: look less often, down to one look
 * every relay.poll_interval while nothing is written. */
static void schedule_look(struct obx_relay *r, size_t n, int64_t now)
{
    if (n > 0)
        r->cur.rows_found_at = now;
    r->cur.poll_delay = (now - r->cur.rows_found_at) / POLL_QUIET_DIVISOR;
    if (r->cur.poll_delay < POLL_MIN_MS)
        r->cur.poll_delay = POLL_MIN_MS;
    if (r->cur.poll_delay > r->set.poll_interval_ms)
        r->cur.poll_delay = r->set.poll_interval_ms;
    r->cur.next_look_at = now + r->cur.poll_delay;
    if (r->ops->wake_at)
        r->ops->wake_at(r->io, r->cur.next_look_at);
}

/* Log mode: the cursor row relay_log.c builds, sent; the rows it covers
 * go into the mark in flight. */
static bool start_log_write(struct obx_relay *r, int64_t now)
{
    struct obx_mark m;
    bool restart;
    struct log_view v = log_view_of(r);
    v.now = now;
    if (!log_write_build(&r->log, &v, r->dead_ids, r->dead_reasons, &r->offs, &m, &restart))
        return false;
    if (relay_failpoint(r, OBX_FP_ACK_AFTER) != 0) {
        r->not_before = now + r->set.retry_backoff_ms;
        return false;
    }
    if (r->ops->mark(r->io, &m) != 0)
        return false;
    log_write_sent(&r->log, restart);
    for (int i = 0; i < r->rows.cap; i++) {
        struct seat *s = &r->rows.seat[i];
        if ((s->state == SEAT_ACKED || s->state == SEAT_DEAD) && log_ready_covers(&r->log, s))
            rows_move(&r->rows, s, s->state == SEAT_ACKED ? SEAT_MARKING : SEAT_DEAD_MARKING);
    }
    relay_set_state(r, OBX_RELAY_MARKING, "acknowledged rows to store in the cursor");
    return true;
}

/* Marks every ACKED seat and dead-letters every DEAD one, in one
 * statement (perhaps with the next fetch). Returns true if it was sent. */
static bool start_mark(struct obx_relay *r, int64_t now)
{
    if (r->set.log_mode)
        return start_log_write(r, now);
    struct obx_mark m = {.ids = r->ids,
                         .topics = r->offs.topic,
                         .partitions = r->offs.partition,
                         .offsets = r->offs.offset,
                         .shards = r->set.shards,
                         .owned_slots = owner_mark_slots(&r->owner),
                         .dead_ids = r->dead_ids,
                         .dead_reasons = r->dead_reasons};
    for (int i = 0; i < r->rows.cap; i++) {
        struct seat *s = &r->rows.seat[i];
        if (s->state == SEAT_ACKED) {
            r->ids[m.n_ids++] = s->id;
            note_offset(r, s);
        } else if (s->state == SEAT_DEAD) {
            r->dead_reasons[m.n_dead] = s->reason;
            r->dead_ids[m.n_dead++] = s->id;
        }
    }
    if (m.n_ids + m.n_dead == 0)
        return false;
    /* The offsets go with a mark once a second, and with every mark of a
     * drain (the next start reads less). */
    r->offsets_in_mark = r->offs.n > 0 && (now >= r->offsets_due || r->draining);
    /* A slot just taken is read by its pass from the offsets stored before:
     * ours, stored for it now, could lie above its last owner's records
     * that the pass has yet to find. Kept until the pass is done. */
    if (owner_active(&r->owner) && !r->recovered)
        r->offsets_in_mark = false;
    m.n_offsets = r->offsets_in_mark ? r->offs.n : 0;
    if (relay_failpoint(r, OBX_FP_ACK_AFTER) != 0) {
        r->not_before = now + r->set.retry_backoff_ms;
        return false;
    }
    /* A keyset fetch rides along in the same statement, due or not: one
     * round trip, Postgres does not wait for us between the two, and the
     * look for new rows costs next to nothing there. (It reads nothing the
     * mark changes: marked rows lie at or below hwm.) */
    struct obx_fetch f;
    int rc = 1;
    /* Only with the fetch's arrays grown already: build_fetch must not move
     * r->ids, which holds the mark's ids. */
    if (r->ops->mark_fetch && !r->set.log_mode && m.n_dead == 0 && r->fetch_room >= r->held.cap &&
        fetch_allowed(r, now) && build_fetch(r, now, &f, true))
        rc = r->ops->mark_fetch(r->io, &m, &f);
    if (rc < 0)
        return false;
    if (rc == 0) {
        fetch_sent(r, &f, now);
        r->cur.fetch_ride = RIDE_ON_MARK;
    } else if (r->ops->mark(r->io, &m) != 0) {
        return false;
    }
    rows_move_all(&r->rows, SEAT_ACKED, SEAT_MARKING);
    rows_move_all(&r->rows, SEAT_DEAD, SEAT_DEAD_MARKING);
    relay_set_state(r, OBX_RELAY_MARKING, "acknowledged rows to mark");
    return true;
}

/* Puts seats of a mark that did not (surely) commit back to be marked again. */
static void unmark(struct obx_relay *r)
{
    rows_move_all(&r->rows, SEAT_MARKING, SEAT_ACKED);
    rows_move_all(&r->rows, SEAT_DEAD_MARKING, SEAT_DEAD);
}

static bool start_fetch(struct obx_relay *r, int64_t now)
{
    struct obx_fetch f;
    if (!build_fetch(r, now, &f, false) || r->ops->fetch(r->io, &f) != 0)
        return false;
    fetch_sent(r, &f, now);
    relay_set_state(r, OBX_RELAY_FETCHING, "rows may be waiting");
    return true;
}

/* ---- the slots of relay.shards: relay_owner.c decides, this sends ---- */

/* What a call into relay_owner.c asked for (struct owner_fx). */
static void owner_apply(struct obx_relay *r, const struct owner_fx *fx)
{
    if (fx->taken) {
        r->recovered = false; /* the pass for them goes before their rows */
        /* Log mode took them quiet: the pass reads the cursor rows about
         * every slot now owned, and this relay's cursor starts from them.
         * Mark and delete mode read cursor rows too if log mode left any
         * (cursor_advance: the highest hwm of them). */
        /* A checkpoint made before is not about the slots taken: none may be
         * stored with them (relay_log.c refuses writes until the reload). */
        log_slots_taken(&r->log, r->set.log_mode || r->log.has_stored);
    }
    if (fx->clear_cursor)
        cursor_clear(&r->cur, fx->clear_cursor);
    if (fx->want_fetch)
        cursor_want_fetch(&r->cur, fx->want_fetch);
}

/* Sends a claim if one is due. True if it went. */
static bool start_claim(struct obx_relay *r, int64_t now)
{
    struct owner_fx fx = {0};
    struct claim_due c;
    struct owner_view v = owner_view_of(r);
    bool due = owner_claim_due(&r->owner, &v, now, &c, &fx);
    owner_apply(r, &fx);
    if (!due)
        return false;
    if (r->ops->claim(r->io, r->set.shards, c.give, c.take) != 0) {
        r->not_before = now + r->set.retry_backoff_ms;
        return false;
    }
    owner_claim_sent(&r->owner, c.giving);
    relay_set_state(r, OBX_RELAY_CLAIMING, c.why);
    return true;
}

/* At the end of a drain, every slot back (relay_give_all_due). True if the
 * claim went, or an answer is awaited first. */
static bool give_all(struct obx_relay *r, int64_t now)
{
    struct owner_fx fx = {0};
    const char *give = NULL;
    struct owner_view v = owner_view_of(r);
    enum give_all g = owner_give_all_due(&r->owner, &v, now, &give, &fx);
    owner_apply(r, &fx);
    if (g != GIVE_ALL_SEND)
        return g == GIVE_ALL_WAIT;
    if (r->ops->claim(r->io, r->set.shards, give, false) != 0)
        return false;
    owner_claim_sent(&r->owner, true);
    relay_set_state(r, OBX_RELAY_CLAIMING, "slots to give back before stopping");
    return true;
}

void obx_relay_on_claimed(struct obx_relay *r, const struct obx_claim *c, int64_t now)
{
    r->now = now;
    if (r->state != OBX_RELAY_CLAIMING)
        return;
    relay_set_state(r, OBX_RELAY_IDLE, "claim answered");
    struct owner_fx fx = {0};
    if (!owner_claim_answered(&r->owner, c, r->draining, now, &fx)) {
        r->not_before = now + r->set.retry_backoff_ms;
        relay_kick(r, now);
        return;
    }
    log_others_seen(&r->log, c->cursor_hwm);
    owner_apply(r, &fx);
    if (rows_in_use(&r->rows) == 0)
        relay_progress(r, now); /* nothing in flight waits: not stalled */
    relay_kick(r, now);
}

/* ---- relay.transactions: relay_txn.h counts, this begins and ends ---- */

/* Ends the open transaction: an abort if a report failed, else a commit. */
static void start_txn_end(struct obx_relay *r, int64_t now)
{
    enum obx_txn_end end = r->txn.failed ? OBX_TXN_ABORT : OBX_TXN_COMMIT;
    if (end == OBX_TXN_COMMIT && relay_failpoint(r, OBX_FP_TXN_BEFORE_COMMIT) != 0) {
        end = OBX_TXN_ABORT; /* as if the commit were refused: the rows go again */
        r->txn.failed = true;
    }
    if (r->ops->txn_end(r->io, end) != 0) {
        r->not_before = now + r->set.retry_backoff_ms; /* the producer is busy: the tick retries */
        return;
    }
    r->txn.state = TXN_ENDING;
    r->txn.ending = end;
}

/* The transactional producer cannot go on: fenced (its transaction timed
 * out at the broker, after a long outage, or another producer took its
 * id) or failed. Its rows are let go as a lost session's are, and the
 * relay runs the recovery pass again, after a new producer's init (which
 * fences in turn and ends what is open), so what committed is found in
 * Kafka and marked, never produced again. Postgres' session stays. */
static void txn_producer_lost(struct obx_relay *r, const char *why, int64_t now)
{
    size_t acked = 0, awaiting = 0;
    for (int i = 0; i < r->rows.cap; i++) {
        struct seat *s = &r->rows.seat[i];
        if (s->state == SEAT_PRODUCED && !s->orphan) {
            rows_orphan(&r->rows, s); /* its report still comes (failed) */
            awaiting++;
        } else if (s->state == SEAT_SENT) {
            relay_seat_release(r, s);
            acked++;
        }
    }
    obx_event(OBX_LOG_WARN, "transactions_lost",
              "relay: the Kafka transactional producer cannot go on (%s); %zu rows of its "
              "transaction acknowledged and %zu awaiting a report go to the recovery pass, "
              "which a new producer's init comes before",
              why, acked, awaiting);
    txn_reset(&r->txn);
    r->recovered = false;
    relay_after_release(r);
    r->not_before = now + r->set.retry_backoff_ms;
}

/* The transaction committed: its rows are acknowledged, to be marked. */
static void txn_committed(struct obx_relay *r)
{
    for (int i = 0; i < r->rows.cap; i++) {
        struct seat *s = &r->rows.seat[i];
        if (s->state != SEAT_SENT)
            continue;
        relay_log_settle(r, s, true);
        rows_move(&r->rows, s, SEAT_ACKED);
        if (s->created_us > 0 && r->ops->acked)
            r->ops->acked(r->io, s->created_us);
    }
    r->txn.commits++;
}

/* The transaction aborted: no read_committed consumer sees its records,
 * and its rows go again, from a full fetch. */
static void txn_aborted(struct obx_relay *r)
{
    size_t n = 0;
    for (int i = 0; i < r->rows.cap; i++) {
        struct seat *s = &r->rows.seat[i];
        if (s->state == SEAT_SENT) {
            relay_seat_release(r, s);
            n++;
        }
    }
    r->txn.aborts++;
    obx_warn("relay: a Kafka transaction aborted; its %zu acknowledged rows go again", n);
    if (n > 0)
        relay_after_release(r);
}

void obx_relay_on_txn_ended(struct obx_relay *r, enum obx_txn_end end, enum obx_txn_result result,
                            const char *reason, int64_t now)
{
    r->now = now;
    if (r->txn.stale) { /* a lost session's: its rows went with it */
        r->txn.stale = false;
        relay_kick(r, now);
        return;
    }
    if (r->txn.state != TXN_ENDING || r->txn.ending != end) {
        obx_error("relay: an answer to a transaction %s that was not asked for",
                  end == OBX_TXN_COMMIT ? "commit" : "abort");
        return;
    }
    switch (result) {
    case OBX_TXN_OK:
        if (end == OBX_TXN_COMMIT) {
            txn_committed(r);
            txn_reset(&r->txn);
            /* A crash here leaves committed records unmarked: the next
             * recovery pass (read_committed) finds and marks them. */
            if (relay_failpoint(r, OBX_FP_TXN_AFTER_COMMIT) != 0)
                r->not_before = now + r->set.retry_backoff_ms;
        } else {
            txn_aborted(r);
            txn_reset(&r->txn);
        }
        break;
    case OBX_TXN_RETRY:
        /* Timed out: the call goes on in the background, and the same call
         * again waits for its end. */
        obx_warn("relay: transaction %s timed out (%s); waiting on",
                 end == OBX_TXN_COMMIT ? "commit" : "abort", reason);
        if (r->ops->txn_end(r->io, end) != 0)
            txn_producer_lost(r, "it cannot end its transaction", now);
        return;
    case OBX_TXN_ABORTABLE:
        if (end == OBX_TXN_COMMIT) {
            obx_warn("relay: transaction commit refused (%s); aborting it", reason);
            r->txn.failed = true;
            if (r->ops->txn_end(r->io, OBX_TXN_ABORT) == 0) {
                r->txn.ending = OBX_TXN_ABORT;
                return;
            }
        }
        txn_producer_lost(r, "it cannot abort its transaction", now); /* the next init does */
        break;
    case OBX_TXN_FENCED:
    case OBX_TXN_FATAL: {
        /* A commit may even have taken effect ("succeeded on the broker,
         * failed here"): the pass finds it. */
        char why[320];
        snprintf(why, sizeof(why), "its transaction's %s: %s",
                 end == OBX_TXN_COMMIT ? "commit" : "abort", reason);
        txn_producer_lost(r, why, now);
        break;
    }
    }
    relay_kick(r, now);
}

/* Whether a fetch that could add rows to the transaction is out. */
static bool fetch_out(const struct obx_relay *r)
{
    return r->state == OBX_RELAY_FETCHING ||
           (r->state == OBX_RELAY_MARKING && r->cur.fetch_ride == RIDE_ON_MARK);
}

/* Decides what the relay does next. Called after every event. */
static void relay_kick(struct obx_relay *r, int64_t now)
{
    if (r->state == OBX_RELAY_STOPPED)
        return;
    /* A transaction ends on Kafka's side, whatever Postgres is doing; it
     * stays open for more rows while they are known to wait. */
    if (r->txn.on && r->txn.state == TXN_OPEN) {
        /* More comes only by a fetch, which needs a free seat (rows of an
         * open transaction hold theirs until its commit). */
        bool alone_due = r->held.n > 0 && held_due_alone(&r->held, now);
        bool seat_free = rows_in_use(&r->rows) < (size_t)r->set.max_in_flight;
        /* Nor while a recovery pass is due (slots taken): it waits for
         * this transaction, since its init replaces the producer. */
        bool more = !r->draining && !r->cur.caught_up && !alone_due && seat_free && r->recovered;
        if (txn_end_due(&r->txn, fetch_out(r), more, now))
            start_txn_end(r, now);
    }
    if (r->draining && relay_drain_over(r, now)) {
        if (give_all(r, now))
            return;
        if (rows_in_use(&r->rows) > 0)
            obx_warn("relay: stopping %s with %zu rows unconfirmed (%zu acknowledged but not "
                     "marked); the next start recovers them from Kafka",
                     r->state == OBX_RELAY_IDLE || r->state == OBX_RELAY_WAIT_PG
                         ? "at the shutdown deadline"
                         : "at the shutdown deadline while Postgres has not answered",
                     rows_in_use(&r->rows), rows_to_mark(&r->rows));
        relay_stop(r, r->exit_code ? "fatal error" : "drained");
        return;
    }
    if (r->state != OBX_RELAY_IDLE || now < r->not_before)
        return;
    if ((rows_to_mark(&r->rows) > 0 || relay_log_idle_write_due(r, now)) && !relay_uncertain(r) &&
        start_mark(r, now))
        return;
    if (r->draining)
        return;
    if (owner_active(&r->owner) && start_claim(r, now))
        return;
    if (!r->recovered) {
        if (r->rows.orphans > 0 || (r->set.log_mode && r->n_outstanding > 0 && !r->log.loaded))
            return; /* the pass must see where this or a lost session's records landed */
        if (r->txn.on && r->txn.state != TXN_NONE)
            return; /* the init before the pass replaces the producer: the transaction ends first */
        if (owner_active(&r->owner) && !r->owner.known)
            return; /* the pass is over the slots a claim gives */
        r->pass_unknowns = r->unknowns;
        if (r->ops->recover(r->io, r->set.shards, owner_mark_slots(&r->owner)) == 0)
            relay_set_state(r, OBX_RELAY_RECOVERING, "recovery pass before publishing");
        else
            r->not_before = now + r->set.retry_backoff_ms;
        return;
    }
    if (r->set.log_mode && rows_in_use(&r->rows) == (size_t)r->set.max_in_flight &&
        log_waits_checkpoint(&r->log, &r->rows) && now - r->full_warned_at >= FULL_WARN_MS) {
        /* Known limit of log mode (a cursor row cannot say "part of a
         * transaction"): every seat holds an acknowledged row that no checkpoint
         * covers, so none can be stored and no fetch can go. */
        obx_event(OBX_LOG_ERROR, "log_in_flight_full",
                  "relay: all %d rows in flight are acknowledged but cannot be stored: more "
                  "rows than relay.max_in_flight wait below the cursor (a transaction that "
                  "committed after rows with higher ids were published), and log mode stores "
                  "them only once all are handed out; raise relay.max_in_flight above that count "
                  "and restart (nothing is lost: the recovery pass finds what reached Kafka)",
                  r->set.max_in_flight);
        r->full_warned_at = now;
    }
    if (fetch_wanted(r, now))
        start_fetch(r, now);
}

/* The fetched rows after a released one must not run ahead of it: the next
 * fetch is a full one, and one already sent is ignored. */
static void relay_after_release(struct obx_relay *r)
{
    relay_ignore_fetch(r, "rows released");
    cursor_full_fetch_due(&r->cur, "rows released");
}

void obx_relay_on_pg_ready(struct obx_relay *r, int64_t now)
{
    r->now = now;
    if (r->state != OBX_RELAY_WAIT_PG)
        return;
    relay_set_state(r, OBX_RELAY_IDLE, "postgres ready");
    relay_progress(r, now); /* the lock was just acquired: the clock starts now */
    cursor_want_fetch(&r->cur, "postgres ready");
    cursor_clear(&r->cur, "new session"); /* another relay may have sent or left rows meanwhile */
    r->not_before = 0;
    r->cur.rows_found_at = now; /* rows may be waiting: look often at first */
    relay_kick(r, now);
}

void obx_relay_on_pg_lost(struct obx_relay *r, int64_t now)
{
    r->now = now;
    if (r->state == OBX_RELAY_STOPPED || r->state == OBX_RELAY_WAIT_PG)
        return;
    fetch_gone(r);               /* the fetch in flight, if any */
    relay_release_all_parked(r); /* never handed to Kafka: no relay lock, no publishing */
    /* Nothing of this session is confirmed by id in the next: that one
     * may run on a server whose history was rewound (a failover to an
     * asynchronous standby, a restore), where these ids belong to other
     * rows; a mark or dead letter by bare id would drop them unpublished.
     * What this session acknowledged is found in Kafka by the next
     * session's recovery pass, which matches content and waits for the
     * reports still outstanding (a mark in flight may or may not have
     * committed: the pass finds those rows marked, or marks them); in log
     * mode the next session starts from the stored cursor, as a restart
     * does. The offsets noted for the next mark go too: stored before the
     * pass, they would start it above records it has to find. */
    size_t acked = 0, refused = 0, awaiting = 0;
    for (int i = 0; i < r->rows.cap; i++) {
        struct seat *s = &r->rows.seat[i];
        if (s->state == SEAT_PRODUCED && !s->orphan) {
            rows_orphan(&r->rows, s);
            awaiting++;
        } else if (s->state != SEAT_FREE && s->state != SEAT_PRODUCED) {
            if (s->state == SEAT_DEAD || s->state == SEAT_DEAD_MARKING)
                refused++;
            else
                acked++;
            relay_seat_release(r, s);
        }
    }
    if (acked + awaiting + refused > 0)
        obx_info("relay: the lost session leaves %zu rows acknowledged (or being confirmed) "
                 "and %zu awaiting Kafka's report to the next session's recovery pass, which "
                 "finds in Kafka what landed, and %zu refused rows to be fetched again; none is "
                 "confirmed by its id",
                 acked, awaiting, refused);
    r->offs.n = 0;
    log_reset(&r->log); /* in any mode: a relay in log mode may have taken over meanwhile */
    /* The open transaction goes with the session: the next one's producer
     * aborts it at its init (or waits for the end in flight, whose answer
     * is then ignored here), and its recovery pass finds what committed. */
    r->txn.stale = r->txn.stale || r->txn.state == TXN_ENDING;
    txn_reset(&r->txn);
    owner_lost(&r->owner);
    /* The relay lock went with the session: another relay may have
     * published since. The next acquisition runs the recovery pass again. */
    r->recovered = false;
    relay_set_state(r, OBX_RELAY_WAIT_PG, "postgres connection lost");
    relay_kick(r, now);
}

int obx_relay_on_log_state(struct obx_relay *r, const struct obx_log_state *st)
{
    /* Mark and delete mode after log mode read the stored cursor too (and
     * never write one): their full fetch leaves the rows it covers untouched.
     * The records found, whether the session begins or a pass resolved a
     * possibly-persisted report: rows in flight now are not among them
     * (found rows are only taken when fetched). */
    struct found_row *found = NULL;
    if (st->n_found > 0 && !(found = obx_calloc(st->n_found, sizeof(*found))))
        return -1;
    for (size_t i = 0; i < st->n_found; i++) {
        int64_t t = topics_index(&r->topics, st->found[i].topic);
        if (t < 0) {
            obx_free(found);
            return -1;
        }
        found[i] = (struct found_row){st->found[i].id, (uint32_t)t, st->found[i].partition,
                                      st->found[i].offset};
    }
    log_found_set(&r->log, &r->rows, found, st->n_found);
    if (r->log.loaded)
        return 0; /* the cursor is this session's own */
    /* The topics of the held keys, then of the offsets log_load reads, as
     * indexes. */
    struct log_view v = log_view_of(r);
    size_t n_held, n_off;
    log_load_reads(&v, st, &n_held, &n_off);
    uint32_t *topic = n_held + n_off > 0 ? obx_calloc(n_held + n_off, sizeof(*topic)) : NULL;
    int rc = n_held + n_off > 0 && !topic ? -1 : 0;
    for (size_t i = 0; rc == 0 && i < n_held + n_off; i++) {
        int64_t t =
            topics_index(&r->topics, i < n_held ? st->held[i].topic : st->off_topics[i - n_held]);
        rc = t < 0 ? -1 : 0;
        topic[i] = (uint32_t)t;
    }
    if (rc == 0)
        rc = log_load(&r->log, &v, st, topic, topic ? topic + n_held : NULL, r->held.entry,
                      r->held.n);
    obx_free(topic);
    return rc;
}

void obx_relay_on_recovered(struct obx_relay *r, bool ok, int64_t now)
{
    r->now = now;
    if (r->state != OBX_RELAY_RECOVERING)
        return;
    relay_set_state(r, OBX_RELAY_IDLE, ok ? "recovery done" : "recovery failed");
    if (ok) {
        /* A possibly-persisted report that came during the pass may be of
         * a record the pass read past before it landed: one more pass. */
        r->recovered = r->unknowns == r->pass_unknowns;
        r->resolved = r->pass_unknowns;
        cursor_full_fetch_due(&r->cur,
                              "recovery pass done"); /* it may have marked rows, or left some */
        relay_progress(r, now);
    } else {
        r->not_before = now + r->set.retry_backoff_ms;
    }
    relay_kick(r, now);
}

/* Frees the seats of batch rows [from, to) that were not handed to Kafka;
 * a fetch already sent must not run ahead of them. */
static void release_rest(struct obx_relay *r, size_t from, size_t to)
{
    for (size_t j = from; j < to; j++)
        if (r->batch[j])
            relay_seat_release(r, r->batch[j]);
    relay_ignore_fetch(r, "rows given back");
    cursor_clear(&r->cur, "rows released"); /* they are below hwm now */
}

/* Keeps a copy of the fetch's snapshot for the next keyset fetch. */
static bool keep_snapshot(struct obx_relay *r, const char *snapshot)
{
    size_t len = strlen(snapshot) + 1;
    if (len > r->cur.snap_cap) {
        char *p = obx_realloc(r->cur.snap, len);
        if (!p)
            return false;
        r->cur.snap = p;
        r->cur.snap_cap = len;
    }
    memcpy(r->cur.snap, snapshot, len);
    return true;
}

/* The fetch in flight brought `n` rows in id order, of which the first
 * `n_take` were taken (the rest are left: see withheld()). Moves the cursor
 * on, or clears it when it cannot be valid after this fetch (rows not
 * taken, a cut fetch below the stored hwm, a snapshot it cannot keep). */
static void cursor_advance(struct obx_relay *r, const struct obx_row *rows, size_t n, size_t n_take,
                           const char *snapshot)
{
    bool cut = n_take < n || n >= (size_t)r->cur.fetch_limit; /* rows may lie beyond */
    int64_t last = n_take > 0 ? rows[n_take - 1].id : NO_ID;
    bool ok;
    if (r->cur.fetch_kind == FETCH_KEYSET) {
        /* Late rows (at or below fetch_after) come first: all of them are
         * in if the first row not taken, or the last one taken, is above. */
        int64_t beyond = n_take < n ? rows[n_take].id : last;
        ok = !cut || beyond > r->cur.fetch_after;
        if (ok && last > r->cur.hwm)
            r->cur.hwm = last;
    } else if (!cut) {
        /* Every unsent row but those excluded was taken: any hwm will do
         * that is at or above everything in flight or waiting. */
        ok = true;
        r->cur.hwm = r->cur.top_id > last ? r->cur.top_id : last;
        if (r->cur.fetch_max_ex > r->cur.hwm)
            r->cur.hwm = r->cur.fetch_max_ex;
    } else {
        /* Rows above `last` were not looked at: only a cursor at `last`
         * is valid, and only if nothing in flight or waiting lies above it. */
        ok = n_take > 0 && last >= r->cur.fetch_max_ex;
        if (ok)
            r->cur.hwm = last;
    }
    if (last > r->cur.top_id)
        r->cur.top_id = last;
    /* Log mode with slots: the others' rows are never marked, so a keyset
     * fetch from a hwm far below them would read past all of them to find
     * none of ours. A fetch that returned every row of our slots its
     * snapshot saw may put the cursor anywhere above: the rows of our slots
     * up to there that it did not see are late ones, which the next keyset
     * fetch asks about by their transactions. So it goes up to the others'
     * (and the checkpoint made here with it, which lets the cursor rows about
     * our slots follow theirs). */
    if (ok && !cut && r->set.log_mode && owner_active(&r->owner) && r->log.others_hwm > r->cur.hwm)
        r->cur.hwm = r->log.others_hwm;
    /* Log mode: the stored cursor covers everything up to its hwm that its
     * snapshot saw, and the keyset fetch would read those rows again from
     * a lower hwm. A full fetch that every uncovered row came back from may
     * take the stored hwm; one cut below it leaves no valid cursor (the next one
     * is a full fetch again). With slots it makes a partial checkpoint: about
     * the owned slots whose cursor rows are all at or below its hwm (a slot
     * taken far behind the others, relay_log.c). */
    r->cur.fetch_partial = false;
    if (r->log.has_stored && ok) {
        if (r->cur.fetch_kind == FETCH_FULL && !cut && r->cur.hwm < r->log.stored_hwm)
            r->cur.hwm = r->log.stored_hwm;
        r->cur.fetch_partial = r->cur.fetch_kind == FETCH_FULL && cut && r->log.by_slot &&
                               owner_active(&r->owner) && r->cur.hwm < r->log.stored_hwm;
        ok = r->cur.hwm >= r->log.stored_hwm;
    }
    /* Cleared since this fetch was sent: what it did not return may lie
     * below hwm now (a row that was in flight then, a row its key's hold
     * kept out). */
    ok = ok && r->cur.fetch_gen == r->cur.gen;
    r->cur.fetch_partial = r->cur.fetch_partial && r->cur.fetch_gen == r->cur.gen && snapshot;
    enum cursor_state next =
        ok && snapshot && keep_snapshot(r, snapshot) ? CURSOR_VALID : CURSOR_NONE;
    if (next != r->cur.state)
        obx_debug("relay: cursor %s", next == CURSOR_VALID
                                          ? "taken: keyset fetches from here"
                                          : "not taken: the next fetch is a full one");
    r->cur.state = next;
}

/* A row the fetch brought without its payload for the byte budget: it and
 * the rows after it wait for the next fetch, which asks for fewer rows. (A
 * row above the producer's limit is refused instead: oversize.) */
static bool withheld(const struct obx_relay *r, const struct obx_row *row)
{
    return row->oversize && (int64_t)row->bytes <= r->set.max_payload;
}

/* A fetch answered whose rows may not be taken now: it is set aside (its
 * rows are fetched again) and true returned. */
static bool fetch_set_aside(struct obx_relay *r, int64_t now)
{
    if (r->cur.fetch_answer == ANSWER_IGNORE) {
        /* Sent while the batch before it was produced, and that batch did not
         * all go out: these rows would overtake the ones it left behind. */
        r->cur.fetch_answer = ANSWER_USE;
        cursor_full_fetch_due(&r->cur, "fetch overtook rows left behind");
    } else if (r->draining) { /* fetched before the shutdown began: leave them */
    } else if (!r->recovered) {
        /* A possibly-persisted report came while this fetch was out: the
         * recovery pass goes first, and these rows may be of the uncertain
         * row's key. They are fetched again after it. */
        cursor_full_fetch_due(&r->cur, "recovery pass due");
    } else {
        return false;
    }
    relay_kick(r, now);
    return true;
}

/* A row to try alone that was due when the fetch was sent: rows before it go as usual;
 * it goes alone. If the fetch passed its place without it, it is no longer
 * unsent (marked by the recovery pass, or deleted) and its key goes on. Only
 * a full fetch sent once it was due can tell: one sent a moment before its
 * refusal (even within the same millisecond) excluded it. Returns the id of
 * the row to send alone, or NO_ID. */
static int64_t alone_of_fetch(struct obx_relay *r, const struct obx_row *rows, size_t n)
{
    int64_t due_alone_id = r->cur.fetch_alone != NO_ID && held_find(&r->held, r->cur.fetch_alone)
                               ? r->cur.fetch_alone
                               : NO_ID;
    if (due_alone_id == NO_ID || (n > 0 && rows[n - 1].id <= due_alone_id))
        return due_alone_id;
    for (size_t i = 0; i < n; i++)
        if (rows[i].id == due_alone_id)
            return due_alone_id;
    obx_info("relay: row %lld is no longer waiting to be sent; its key goes on",
             (long long)due_alone_id);
    held_goes_on(r, due_alone_id, false);
    cursor_want_fetch(&r->cur, "key no longer held back");
    return NO_ID;
}

/* How many of the fetched rows are taken: up to the first one withheld.
 * Sets the next fetch's row limit: as many rows as fit in
 * relay.fetch_max_bytes if they are as large as the largest payload seen
 * now (the one left out, else the largest taken). */
static size_t rows_to_take(struct obx_relay *r, const struct obx_row *rows, size_t n)
{
    size_t n_take = 0;
    while (n_take < n && !withheld(r, &rows[n_take]))
        n_take++;
    size_t largest = n_take < n ? rows[n_take].bytes : 1;
    for (size_t i = 0; i < n_take && n_take == n; i++)
        if (!rows[i].oversize && rows[i].bytes > largest) /* oversize: never fetched */
            largest = rows[i].bytes;
    int64_t fit = r->set.fetch_max_bytes / (int64_t)largest;
    r->cur.bytes_limit = fit < 1 ? 1 : fit < r->set.batch_size ? (int)fit : r->set.batch_size;
    if (n_take < n)
        obx_debug("relay: row %lld has %zu bytes: fetching %d rows at a time",
                  (long long)rows[n_take].id, rows[n_take].bytes, r->cur.bytes_limit);
    return n_take;
}

/* Log mode: the fetch's record (*seq), with its checkpoint if the cursor is valid
 * (or a partial one, see cursor_advance); *seq 0 outside log mode. False
 * with no memory for it: the fetch is then set aside. */
static bool record_fetch(struct obx_relay *r, uint64_t *seq, const char *snapshot, int64_t now)
{
    *seq = 0;
    if (!r->set.log_mode)
        return true;
    *seq = log_rec_push(&r->log);
    if (*seq == 0) { /* no record, no rows: they are fetched again */
        obx_error("relay: out of memory recording a fetch");
        cursor_full_fetch_due(&r->cur, "out of memory");
        r->not_before = now + r->set.retry_backoff_ms;
        relay_kick(r, now);
        return false;
    }
    if (r->cur.state == CURSOR_VALID)
        log_rec_checkpoint(&r->log, *seq, r->cur.hwm, r->cur.snap);
    else if (r->cur.fetch_partial) {
        struct log_view v = log_view_of(r);
        log_rec_checkpoint_partial(&r->log, &v, *seq, r->cur.hwm, snapshot);
    }
    return true;
}

/* Takes a seat for each of the first n_take rows (r->batch[i], NULL for a
 * row not taken) before any goes to Kafka, so that the next statement can
 * go to Postgres now (its exclusions, or the cursor, cover these rows) and
 * run while we hand the rows to Kafka. Returns how many entries of r->batch
 * were filled. */
static size_t take_seats(struct obx_relay *r, const struct obx_row *rows, size_t n_take,
                         uint64_t seq)
{
    size_t taken = 0;
    for (size_t i = 0; i < n_take; i++) {
        const struct obx_row *row = &rows[i];
        int64_t topic = topics_index(&r->topics, row->topic);
        r->batch[i] = NULL;
        if (topic < 0) {
            obx_error("relay: out of memory for topic names");
            cursor_clear(&r->cur, "out of memory"); /* the rest was not taken */
            break;
        }
        if (r->held.n > 0 &&
            held_holds(&r->held, row->id, (uint32_t)topic, row->key, row->key_len)) {
            cursor_clear(&r->cur, "row held back"); /* fetched, not taken: below hwm */
            continue;                               /* a refused row of its key comes first */
        }
        struct seat *s = rows_take(&r->rows, row->id, (uint32_t)topic);
        if (!s) { /* cannot happen: the fetch limit was the free seat count */
            obx_error("relay: no free seat for row %lld", (long long)row->id);
            cursor_clear(&r->cur, "no free seat");
            break;
        }
        s->created_us = row->created_us;
        s->has_key_slot = row->has_slot && row->slot >= 0 && row->slot < r->set.shards;
        s->key_slot = s->has_key_slot ? row->slot : 0;
        s->seq = seq && log_rec_add_row(&r->log, seq) ? seq : 0;
        r->batch[i] = s;
        taken = i + 1;
    }
    return taken;
}

/* Log mode: a row a run before this one published (the recovery pass found
 * its record) is taken as acknowledged. True if it was. */
static bool found_published(struct obx_relay *r, struct seat *s, int64_t id)
{
    struct found_row fr;
    if (!r->set.log_mode || r->log.n_found == 0 || !log_take_found(&r->log, id, &fr))
        return false;
    relay_log_settle(r, s, true);
    rows_move(&r->rows, s, SEAT_ACKED);
    s->partition = fr.partition;
    s->offset = fr.offset;
    if (r->held.n > 0)
        held_goes_on(r, s->id, true); /* it was held: its key goes on */
    return true;
}

/* set.one_per_key: a row of a key with a record at Kafka waits behind it
 * (parked, produced once that one is delivered). True if it waits. */
static bool waits_for_its_key(struct obx_relay *r, struct seat *s, const struct obx_row *row)
{
    if (!r->set.one_per_key || !row->key)
        return false;
    s->key_hash = obx_keycount_hash(s->topic, row->key, row->key_len);
    if (!obx_keycount_busy(&r->busy_keys, s->key_hash))
        return false;
    if (relay_park(r, s, row))
        return true;
    /* No memory to keep it: a fetch after the report brings it again. A
     * fetch on its way may bring the key's later rows without it. */
    relay_seat_release(r, s);
    relay_after_release(r);
    r->key_waits = true;
    return true;
}

/* Hands batch entry i (of `taken`) to Kafka. False when the rest of the
 * batch waits for the next fetch. */
static bool produce_entry(struct obx_relay *r, const struct obx_row *row, size_t i, size_t taken,
                          int64_t due_alone_id, size_t *produced, int64_t now)
{
    struct seat *s = r->batch[i];
    bool alone = row->id == due_alone_id;
    if (alone && (r->n_outstanding > 0 || r->txn.state != TXN_NONE)) {
        /* Rows before it are still out: it and the rest wait for the
         * next fetch, which relay_kick() sends once their reports are in. */
        release_rest(r, i, taken);
        cursor_want_fetch(&r->cur, "rows given back");
        return false;
    }
    const char *reason = NULL;
    if (r->txn.on && r->txn.state == TXN_NONE) {
        int rc = r->ops->txn_begin(r->producer, &reason);
        if (rc == 0) {
            r->txn.begun_at = now;
        } else if (rc == -2) {
            release_rest(r, i, taken);
            txn_producer_lost(r, reason ? reason : "fatal error", now);
            return false;
        } else {
            obx_warn("relay: cannot begin a Kafka transaction at row %lld: %s; retrying shortly",
                     (long long)row->id, reason ? reason : "unknown error");
            release_rest(r, i, taken);
            r->not_before = now + r->set.retry_backoff_ms;
            cursor_want_fetch(&r->cur, "transaction not begun");
            return false;
        }
        r->txn.state = TXN_OPEN;
    } else if (r->txn.on && r->txn.state == TXN_ENDING) {
        /* An old transaction ended with this fetch out: its rows go in the
         * next one, fetched again. */
        release_rest(r, i, taken);
        cursor_want_fetch(&r->cur, "transaction ending");
        return false;
    }
    /* Transactions: a row tried alone begins a transaction of its own
     * (nothing else is out), through the one producer (the second has no
     * transactional.id). */
    enum obx_produce_result pr = alone && r->ops->produce_alone && !r->txn.on
                                     ? r->ops->produce_alone(r->producer, row, s, &reason)
                                     : r->ops->produce(r->producer, row, s, &reason);
    if (pr == OBX_PRODUCE_BUSY) {
        /* Keep id order: the rest of the batch waits for the next fetch,
         * and a fetch already sent must not run ahead of it. */
        obx_warn("relay: Kafka queue full at row %lld; retrying shortly", (long long)row->id);
        release_rest(r, i, taken);
        r->not_before = now + 100;
        cursor_want_fetch(&r->cur, "Kafka queue full");
        return false;
    }
    if (pr != OBX_PRODUCE_OK) {
        refused_as(r, s, pr == OBX_PRODUCE_TOPIC_REFUSED, row->key, row->key_len, reason, now);
        return true;
    }
    if (s->key_hash && obx_keycount_add(&r->busy_keys, s->key_hash) != 0)
        obx_error("relay: more keys with Kafka than rows in flight (row %lld)",
                  (long long)row->id); /* cannot happen: sized for max_in_flight */
    struct held_back *b = r->held.n > 0 ? held_find(&r->held, row->id) : NULL;
    if (b)
        b->retry_at = INT64_MAX; /* being retried: not due again until refused */
    r->n_outstanding++;
    (*produced)++;
    if (r->txn.on)
        txn_row_out(&r->txn);
    if (!alone)
        return true;
    obx_event(OBX_LOG_INFO, "tried_alone", "relay: trying row %lld alone", (long long)row->id);
    r->alone_id = row->id;
    release_rest(r, i + 1, taken);
    cursor_want_fetch(&r->cur, "rows given back");
    return false;
}

/* Hands the taken rows to Kafka in id order. Returns how many went. */
static size_t produce_taken(struct obx_relay *r, const struct obx_row *rows, size_t taken,
                            int64_t due_alone_id, int64_t now)
{
    size_t produced = 0;
    for (size_t i = 0; i < taken; i++) {
        const struct obx_row *row = &rows[i];
        struct seat *s = r->batch[i];
        if (!s)
            continue;
        if (r->held.n > 0 && held_holds(&r->held, row->id, s->topic, row->key, row->key_len)) {
            relay_seat_release(r, s); /* its key was refused earlier in this batch */
            cursor_clear(&r->cur, "row held back");
            continue;
        }
        s->key_hash = 0;
        if (r->set.log_mode && row->key)
            s->log_hash = obx_keycount_hash(s->topic, row->key, row->key_len);
        if (found_published(r, s, row->id) || waits_for_its_key(r, s, row))
            continue;
        if (!produce_entry(r, row, i, taken, due_alone_id, &produced, now))
            break;
    }
    return produced;
}

void obx_relay_on_fetched(struct obx_relay *r, const struct obx_row *rows, size_t n,
                          const char *snapshot, int64_t now)
{
    r->now = now;
    if (r->state != OBX_RELAY_FETCHING)
        return;
    relay_set_state(r, OBX_RELAY_IDLE, "fetch done");
    if (fetch_set_aside(r, now))
        return;
    if (n == 0 && rows_in_use(&r->rows) == 0)
        relay_progress(r, now); /* caught up: nothing waits */
    if (relay_failpoint(r, OBX_FP_FETCH_AFTER) != 0) {
        r->not_before = now + r->set.retry_backoff_ms;
        cursor_want_fetch(&r->cur, "fetch.after failpoint");
        return;
    }
    int64_t due_alone_id = alone_of_fetch(r, rows, n);
    if (r->held.n > 0 && r->cur.fetch_kind == FETCH_FULL) {
        struct held_fx fx = {0};
        held_drop_gone(&r->held, rows, n, n >= (size_t)r->cur.fetch_limit, r->cur.fetch_sent_at,
                       &fx);
        held_apply(r, &fx);
    }
    size_t n_take = rows_to_take(r, rows, n);
    cursor_advance(r, rows, n, n_take, snapshot);
    uint64_t seq;
    if (!record_fetch(r, &seq, snapshot, now))
        return;
    uint64_t gen_at_checkpoint = r->cur.gen;
    r->cur.caught_up = n < (size_t)r->cur.fetch_limit;
    schedule_look(r, n, now);
    r->txn.handing_out = true; /* until produced: the transaction may not end before */
    size_t taken = take_seats(r, rows, n_take, seq);
    txn_rows_taken(&r->txn, taken);
    /* Rows fetched and not taken: the checkpoint above is not valid. */
    if (seq && r->cur.gen != gen_at_checkpoint)
        log_checkpoints_drop_from(&r->log, seq);
    /* A full batch means more rows are likely waiting (a batch of
     * relay.batch_size, or of what the byte budget allows, is one). */
    if (n_take < n || (!r->cur.caught_up && r->cur.fetch_limit >= r->cur.bytes_limit))
        cursor_want_fetch(&r->cur, "full batch");
    relay_kick(r, now);
    size_t produced = produce_taken(r, rows, taken, due_alone_id, now);
    r->txn.handing_out = false;
    txn_batch_done(&r->txn);
    if (r->set.log_mode)
        log_recs_retire(&r->log,
                        r->now); /* the record of a fetch that handed nothing out retires */
    if (produced > 0 && relay_failpoint(r, OBX_FP_PRODUCE_AFTER) != 0)
        r->not_before = now + r->set.retry_backoff_ms; /* as after a Kafka hiccup: pause */
    obx_debug("relay: fetched %zu rows, produced %zu, in flight %zu", n, produced,
              rows_in_use(&r->rows));
    relay_kick(r, now);
}

/* The mark in flight committed: its rows are done. */
static void mark_done(struct obx_relay *r, int64_t now)
{
    size_t marked = 0, dead = 0;
    if (r->set.log_mode) {
        struct log_view v = log_view_of(r);
        log_write_done(&r->log, &v);
    }
    for (int i = 0; i < r->rows.cap; i++) {
        struct seat *s = &r->rows.seat[i];
        if (s->state == SEAT_MARKING || s->state == SEAT_DEAD_MARKING) {
            if (s->state == SEAT_MARKING)
                marked++;
            else
                dead++;
            relay_seat_release(r, s);
        }
    }
    r->marked_total += marked;
    r->dead_total += dead;
    if (r->offsets_in_mark) {
        r->offs.n = 0;
        r->offsets_due = now + OFFSETS_STORE_MS;
        r->offsets_in_mark = false;
    }
    relay_progress(r, now);
    obx_debug("relay: marked %zu rows, dead-lettered %zu", marked, dead);
    relay_set_state(r, OBX_RELAY_IDLE, "mark done");
    if (dead > 0)
        cursor_want_fetch(&r->cur, "rows dead-lettered"); /* the rows behind them may go now */
}

void obx_relay_on_marked(struct obx_relay *r, int64_t now)
{
    r->now = now;
    if (r->state != OBX_RELAY_MARKING || r->cur.fetch_ride == RIDE_ON_MARK)
        return;
    if (relay_failpoint(r, OBX_FP_MARK_AFTER_COMMIT) != 0) {
        /* As if the COMMIT's answer was lost: mark again (idempotent). */
        obx_relay_on_query_failed(r, "injected error after commit", now);
        return;
    }
    mark_done(r, now);
    relay_kick(r, now);
}

void obx_relay_on_mark_fetched(struct obx_relay *r, const struct obx_row *rows, size_t n,
                               const char *snapshot, int64_t now)
{
    r->now = now;
    if (r->state != OBX_RELAY_MARKING || r->cur.fetch_ride != RIDE_ON_MARK)
        return;
    if (relay_failpoint(r, OBX_FP_MARK_AFTER_COMMIT) != 0) { /* as in obx_relay_on_marked */
        obx_relay_on_query_failed(r, "injected error after commit", now);
        return;
    }
    r->cur.fetch_ride = RIDE_ALONE;
    mark_done(r, now);
    relay_set_state(r, OBX_RELAY_FETCHING, "the fetch beside the mark");
    obx_relay_on_fetched(r, rows, n, snapshot, now);
}

/* Postgres's answer with rows, straight from pg: `on_rows` takes them. */
static void rows_answer(void *relay, const struct obx_row *rows, size_t n, const char *snapshot,
                        const char *error,
                        void (*on_rows)(struct obx_relay *, const struct obx_row *, size_t,
                                        const char *, int64_t))
{
    struct obx_relay *r = relay;
    int64_t now = r->ops->now(r->io);
    if (error)
        obx_relay_on_query_failed(r, error, now);
    else
        on_rows(r, rows, n, snapshot, now);
}

void obx_relay_fetched(void *relay, const struct obx_row *rows, size_t n, const char *snapshot,
                       const char *error)
{
    rows_answer(relay, rows, n, snapshot, error, obx_relay_on_fetched);
}

void obx_relay_mark_fetched(void *relay, const struct obx_row *rows, size_t n, const char *snapshot,
                            const char *error)
{
    rows_answer(relay, rows, n, snapshot, error, obx_relay_on_mark_fetched);
}

void obx_relay_on_query_failed(struct obx_relay *r, const char *reason, int64_t now)
{
    r->now = now;
    if (r->state == OBX_RELAY_FETCHING) {
        obx_warn("relay: fetch failed: %s", reason);
        fetch_gone(r);
    } else if (r->state == OBX_RELAY_MARKING) {
        obx_warn("relay: mark failed: %s", reason);
        if (r->cur.fetch_ride == RIDE_ON_MARK) /* and the fetch beside it */
            fetch_gone(r);
        if (r->set.log_mode) {
            struct log_view v = log_view_of(r);
            log_write_failed(&r->log, &v);
        }
        unmark(r);
    } else if (r->state == OBX_RELAY_CLAIMING) {
        obx_warn("relay: claim of slots failed: %s", reason);
        owner_claim_failed(&r->owner);
    } else {
        return;
    }
    r->not_before = now + r->set.retry_backoff_ms;
    relay_set_state(r, OBX_RELAY_IDLE, "query failed");
    relay_kick(r, now);
}

/* A report that the row is not persisted (RETRY) or perhaps is (UNKNOWN):
 * the row stays unsent in Postgres and is fetched again after the back-off;
 * a refused row being retried is due again then too (not stuck until a
 * restart). Until it is delivered (or found in Kafka), later rows of its key
 * wait: one fetched meanwhile, or already in a fetch on its way, would land
 * before it. */
static void not_delivered(struct obx_relay *r, struct seat *s, enum obx_delivery outcome,
                          const char *key, size_t key_len, const char *reason, int64_t now)
{
    struct held_back *b = r->held.n > 0 ? held_find(&r->held, s->id) : NULL;
    /* A later row of a topic held as a whole waits with the topic's rows:
     * no entry of its own. Log mode: a held row, key or none. */
    if (!b && (key || r->set.log_mode) && !held_behind_topic(&r->held, s->topic, s->id)) {
        struct held_fx fx = {0};
        held_hold_back(&r->held, s->id, s->topic, key, key_len, now, &fx);
        held_apply(r, &fx);
        b = held_find(&r->held, s->id);
    } else if (b)
        b->attempts++;
    if (b)
        b->retry_at = now + r->set.retry_backoff_ms;
    /* Such reports come in bursts (a whole request timed out, a
     * transaction's records with it): one warning a second of each kind,
     * the rest at debug (a row that may have landed is always said). */
    int64_t *warned_at =
        outcome == OBX_DELIVERY_UNKNOWN ? &r->unknown_warned_at : &r->failure_warned_at;
    enum obx_log_level level = now - *warned_at >= 1000 ? OBX_LOG_WARN : OBX_LOG_DEBUG;
    if (level == OBX_LOG_WARN)
        *warned_at = now;
    if (outcome == OBX_DELIVERY_UNKNOWN) {
        /* Publishing it again blindly could duplicate it: the recovery pass
         * reads Kafka first and marks it if it landed. */
        obx_log(level,
                "relay: row %lld may or may not be in Kafka (%s); the recovery pass checks "
                "before it is published again",
                (long long)s->id, reason ? reason : "unknown error");
        r->recovered = false;
        r->unknowns++;
    } else {
        obx_log(level, "relay: row %lld not delivered: %s; will retry", (long long)s->id,
                reason ? reason : "unknown error");
    }
    relay_seat_release(r, s);
    cursor_full_fetch_due(&r->cur,
                          "row not delivered"); /* unsent below hwm: a full fetch finds it */
    r->not_before = now + r->set.retry_backoff_ms;
}

/* A report for a row handed out by a session that is gone: the next one's
 * recovery pass finds the record if it landed. */
static void orphan_reported(struct obx_relay *r, struct seat *s, int64_t now)
{
    if (s->key_hash && obx_keycount_remove(&r->busy_keys, s->key_hash) == 0)
        relay_release_parked_of(r, s->key_hash);
    r->n_outstanding--;
    /* A row tried alone: that try is over, whatever its report says (its
     * held-back entry tries it again). Left set, no fetch would ever go. */
    if (s->id == r->alone_id)
        r->alone_id = NO_ID;
    /* A held-back row was out again (not due while out): due now, so the
     * next session's full fetch brings it back, found in Kafka or not.
     * Left as it was, every fetch would leave it and its key out. */
    struct held_back *b = r->held.n > 0 ? held_find(&r->held, s->id) : NULL;
    if (b && b->retry_at > now)
        b->retry_at = now;
    relay_seat_release(r, s);
    relay_kick(r, now);
}

void obx_relay_on_delivery(struct obx_relay *r, void *opaque, enum obx_delivery outcome,
                           int32_t partition, int64_t offset, const char *key, size_t key_len,
                           const char *reason, int64_t now)
{
    struct seat *s = opaque;
    r->now = now;
    if (!s || s->state != SEAT_PRODUCED) {
        obx_error("relay: delivery report for an unknown or finished row");
        return;
    }
    if (s->orphan) {
        orphan_reported(r, s, now);
        return;
    }
    /* One record of a key at a time: is its key free now? */
    uint64_t key_hash = s->key_hash;
    bool key_free = key_hash && obx_keycount_remove(&r->busy_keys, key_hash) == 0;
    if (key_free && r->key_waits) {
        r->key_waits = false; /* rows left behind for their key: fetch them now */
        cursor_want_fetch(&r->cur, "key free");
    }
    r->n_outstanding--;
    if (r->txn.on) {
        /* Its transaction is aborted after a failed report: a record that
         * may have landed is never shown to a read_committed consumer, so
         * the row simply goes again. */
        if (outcome == OBX_DELIVERY_UNKNOWN)
            outcome = OBX_DELIVERY_RETRY;
        txn_row_reported(&r->txn, outcome == OBX_DELIVERED);
    }
    bool was_alone = s->id == r->alone_id;
    if (was_alone)
        r->alone_id = NO_ID;
    if (outcome == OBX_DELIVERY_BATCH_REFUSED && was_alone)
        outcome = OBX_DELIVERY_REFUSED; /* refused alone: it is the row itself */
    switch (outcome) {
    case OBX_DELIVERED:
        s->partition = partition;
        s->offset = offset;
        if (r->txn.on) {
            rows_move(&r->rows, s, SEAT_SENT); /* acknowledged once its transaction commits */
        } else {
            relay_log_settle(r, s, true);
            rows_move(&r->rows, s, SEAT_ACKED);
            if (s->created_us > 0 && r->ops->acked)
                r->ops->acked(r->io, s->created_us);
        }
        if (r->held.n > 0)
            held_goes_on(r, s->id, true);
        break;
    case OBX_DELIVERY_RETRY:
    case OBX_DELIVERY_UNKNOWN:
        not_delivered(r, s, outcome, key, key_len, reason, now);
        break;
    case OBX_DELIVERY_REFUSED:
        row_refused(r, s, key, key_len, reason ? reason : "refused by Kafka", now);
        break;
    case OBX_DELIVERY_BATCH_REFUSED:
        batch_refused(r, s, key, key_len, reason ? reason : "refused by Kafka", now);
        break;
    case OBX_DELIVERY_TOPIC_REFUSED:
        refused_as(r, s, true, key, key_len, reason ? reason : "refused by Kafka", now);
        break;
    }
    /* The key's next row goes once this one is delivered; after any other
     * outcome this one is fetched again, and its key's later rows after it. */
    if (key_free && outcome == OBX_DELIVERED)
        relay_produce_parked(r, key_hash, now);
    else if (key_free)
        relay_release_parked_of(r, key_hash);
    relay_kick(r, now);
}

void obx_relay_tick(struct obx_relay *r, int64_t now)
{
    r->now = now;
    if (r->state == OBX_RELAY_STOPPED)
        return;
    if (now >= r->cur.next_look_at)
        cursor_want_fetch(&r->cur, "look due");
    for (size_t i = 0; i < r->held.n; i++)
        if (r->held.entry[i].retry_at <= now)
            cursor_want_fetch(&r->cur,
                              "refused row due"); /* a refused row is due for another try */
    relay_kick(r, now);
}

enum obx_relay_state obx_relay_state(const struct obx_relay *r)
{
    return r->state;
}

bool obx_relay_recovered(const struct obx_relay *r)
{
    return r->recovered;
}

size_t obx_relay_in_flight(const struct obx_relay *r)
{
    return rows_in_use(&r->rows);
}

uint64_t obx_relay_fetches(const struct obx_relay *r, bool keyset)
{
    return r->fetches[keyset];
}

uint64_t obx_relay_marked_total(const struct obx_relay *r)
{
    return r->marked_total;
}

uint64_t obx_relay_transactions(const struct obx_relay *r, bool committed)
{
    return committed ? r->txn.commits : r->txn.aborts;
}

uint64_t obx_relay_dead_total(const struct obx_relay *r)
{
    return r->dead_total;
}

/* ---- rows parked behind their key's record at Kafka (set.one_per_key) ---- */

/* A copy of `row` in one allocation, or NULL. */
static struct obx_row *row_copy(const struct obx_row *row)
{
    size_t topic_len = strlen(row->topic) + 1;
    size_t payload_len = row->payload ? row->payload_len : 0;
    struct obx_row *c =
        obx_malloc(sizeof(*c) + topic_len + row->key_len + payload_len + row->headers_len);
    if (!c)
        return NULL;
    char *p = (char *)(c + 1);
    *c = *row;
    memcpy(p, row->topic, topic_len);
    c->topic = p;
    p += topic_len;
    if (row->key) {
        memcpy(p, row->key, row->key_len);
        c->key = p;
        p += row->key_len;
    }
    if (row->payload) {
        memcpy(p, row->payload, payload_len);
        c->payload = p;
        p += payload_len;
    }
    if (row->headers) {
        memcpy(p, row->headers, row->headers_len);
        c->headers = p;
    }
    return c;
}

/* The rows parked behind key hash h go back unsent, to be fetched again. */
static void relay_release_parked_of(struct obx_relay *r, uint64_t h)
{
    int32_t i;
    bool any = false;
    while ((i = obx_keycount_unpark(&r->busy_keys, h)) >= 0) {
        relay_seat_release(r, &r->rows.seat[i]);
        any = true;
    }
    if (any)
        relay_after_release(r);
}

/* Every parked row goes back unsent: the relay stops handing rows to Kafka
 * (shutdown, fatal error, session lost). */
static void relay_release_all_parked(struct obx_relay *r)
{
    if (!r->set.one_per_key)
        return;
    for (int i = 0; i < r->rows.cap; i++)
        if (r->rows.seat[i].state == SEAT_PARKED)
            relay_release_parked_of(r, r->rows.seat[i].key_hash);
}

/* Parks row `row` of seat s behind its key's record at Kafka. false: no
 * memory for it (the caller leaves it for a later fetch). */
static bool relay_park(struct obx_relay *r, struct seat *s, const struct obx_row *row)
{
    struct obx_row *copy = row_copy(row);
    if (!copy || obx_keycount_park(&r->busy_keys, s->key_hash, rows_index(&r->rows, s)) != 0) {
        obx_free(copy);
        return false;
    }
    s->parked = copy;
    rows_move(&r->rows, s, SEAT_PARKED);
    return true;
}

/* Key hash h has no record at Kafka any more, the last one delivered: its
 * first parked row goes now, if the relay may publish. */
static void relay_produce_parked(struct obx_relay *r, uint64_t h, int64_t now)
{
    if (!r->recovered || r->draining || r->state == OBX_RELAY_WAIT_PG) {
        relay_release_parked_of(r, h); /* fetched again once it may */
        return;
    }
    int32_t i = obx_keycount_unpark(&r->busy_keys, h);
    if (i < 0)
        return;
    struct seat *p = &r->rows.seat[i];
    const char *reason = NULL;
    rows_move(&r->rows, p, SEAT_PRODUCED);
    enum obx_produce_result pr = r->ops->produce(r->producer, p->parked, p, &reason);
    if (pr == OBX_PRODUCE_OK) {
        obx_free(p->parked);
        p->parked = NULL;
        (void)obx_keycount_add(&r->busy_keys, h); /* it had a place: cannot fail */
        r->n_outstanding++;
        return;
    }
    if (pr == OBX_PRODUCE_BUSY) {
        relay_seat_release(r, p);
        r->not_before = now + 100;
    } else {
        refused_as(r, p, pr == OBX_PRODUCE_TOPIC_REFUSED, p->parked->key, p->parked->key_len,
                   reason, now);
        obx_free(p->parked);
        p->parked = NULL;
    }
    relay_release_parked_of(r, h); /* the rest of the key after it, by a fetch */
    relay_after_release(r);
}

/* ---- shutdown, fatal errors, progress and stalls ---- */

static void relay_progress(struct obx_relay *r, int64_t now)
{
    r->last_progress = now;
    if (r->stalled_ms > 0) {
        obx_info("relay: moving again after %llds without progress",
                 (long long)(r->stalled_ms / 1000));
        r->stalled_ms = 0;
    }
}

void obx_relay_shutdown(struct obx_relay *r, int64_t now)
{
    r->now = now;
    if (r->draining || r->state == OBX_RELAY_STOPPED)
        return;
    r->draining = true;
    relay_release_all_parked(r); /* not handed to Kafka yet: left for the next start */
    /* The last quarter (at most a second) is kept for the final mark. */
    int64_t reserve = r->set.shutdown_timeout_ms / 4 < 1000 ? r->set.shutdown_timeout_ms / 4 : 1000;
    r->hard_deadline = now + r->set.shutdown_timeout_ms;
    r->drain_deadline = r->hard_deadline - reserve;
    obx_event(OBX_LOG_INFO, "shutting_down",
              "relay: shutting down: %zu rows in flight, waiting up to %lldms",
              rows_in_use(&r->rows), (long long)r->set.shutdown_timeout_ms);
    relay_kick(r, now);
}

void obx_relay_fatal(struct obx_relay *r, const char *reason, int64_t now)
{
    r->now = now;
    if (r->state == OBX_RELAY_STOPPED)
        return;
    obx_error("relay: stopping after a fatal error: %s", reason);
    r->exit_code = 1;
    if (!r->draining)
        r->hard_deadline = now + r->set.shutdown_timeout_ms;
    r->draining = true;
    relay_release_all_parked(r);
    r->drain_deadline = now;
    r->not_before = 0;
    relay_kick(r, now);
}

void obx_relay_note_progress(struct obx_relay *r, int64_t now)
{
    relay_progress(r, now);
}

void obx_relay_check_stall(struct obx_relay *r, bool deps_ok, int64_t now)
{
    r->now = now;
    int64_t idle = now - r->last_progress;
    bool stalled = r->set.stall_timeout_ms > 0 && deps_ok && !r->draining &&
                   r->state != OBX_RELAY_WAIT_PG && r->state != OBX_RELAY_STOPPED &&
                   idle >= r->set.stall_timeout_ms;
    if (!stalled) {
        if (!deps_ok || r->state == OBX_RELAY_WAIT_PG)
            r->last_progress = now; /* waiting for a dependency is not a stall */
        r->stalled_ms = 0;
        return;
    }
    bool first = r->stalled_ms == 0;
    r->stalled_ms = idle;
    if (first || now - r->stall_logged_at >= r->set.stall_timeout_ms) {
        char why[160];
        relay_describe_wait(r, now, why, sizeof(why));
        obx_error("relay: no progress for %llds: %s; /livez fails until it moves (restarting "
                  "outboxd is safe)",
                  (long long)(idle / 1000), why);
        r->stall_logged_at = now;
    }
}

int64_t obx_relay_stalled(const struct obx_relay *r, char *why, size_t len)
{
    if (r->stalled_ms > 0 && why)
        relay_describe_wait(r, r->now, why, len);
    return r->stalled_ms;
}

int64_t obx_relay_last_progress(const struct obx_relay *r)
{
    return r->last_progress;
}

size_t obx_relay_held_back_keys(const struct obx_relay *r)
{
    return r->held.n;
}

void obx_relay_slots(const struct obx_relay *r, struct obx_relay_slots *out)
{
    const struct owner *h = &r->owner;
    *out = (struct obx_relay_slots){
        .shards = r->set.shards,
        .owned =
            owner_active(&r->owner) ? h->n_owned : r->recovered, /* alone: 1 while it publishes */
        .members = owner_active(&r->owner) ? h->members : 1,
        .share = owner_active(&r->owner) ? h->share : 1,
        .moves = h->moves,
    };
}

bool obx_relay_maintains(const struct obx_relay *r)
{
    return !owner_active(&r->owner) || (r->owner.known && r->owner.owned[0]);
}

const char *obx_relay_owned_slots(const struct obx_relay *r)
{
    return owner_active(&r->owner) ? r->owner.list_text : "all";
}
