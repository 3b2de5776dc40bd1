/*
 * The unit tests of the relay drive it against fake pg and kafka
 * operations (struct fake) and look at what it fetches, produces and
 * marks in reply to each event; this is what their files share:
 * test_relay.c (the cycle), test_relay_held.c (refused rows and held
 * keys), test_relay_log.c (log mode) and test_relay_owner.c (the slots of
 * relay.shards). Include it once, after cmocka.h and cmocka_alloc.h.
 */
#ifndef OBX_TEST_RELAY_FIXTURE_H
#define OBX_TEST_RELAY_FIXTURE_H

#include <string.h>

#include "outboxd/failpoint.h"
#include "outboxd/relay.h"

/* The relay core is pure logic: its header pulls in no client library. */
#if defined(LIBPQ_FE_H) || defined(_RDKAFKA_H_) || defined(UV_H)
#error "relay.h must not include libpq, librdkafka or libuv"
#endif

#define MAX_CALLS 2048

struct fake {
    int64_t clock; /* what ops->now says */
    int fetches;
    int64_t exclude[MAX_CALLS];
    size_t n_exclude;
    int limit;
    bool keyset;           /* the last fetch was a keyset one ... */
    int64_t after_id;      /* ... above this id (0 for a full one) */
    char snapshot[32];     /* ... and the snapshot it asked about */
    int64_t max_row_bytes; /* of the last fetch */
    bool combine;          /* mark_fetch takes both (else it answers 1: not together) */
    int mark_fetches;
    int fetch_rc;
    size_t n_held_back;
    char held_back_key[64];
    int64_t held_back_id;

    int marks;
    int64_t marked[MAX_CALLS];
    size_t n_marked;
    char off_topics[MAX_CALLS][16];
    int32_t off_partitions[MAX_CALLS];
    int64_t off_offsets[MAX_CALLS];
    size_t n_offsets;
    int64_t dead[MAX_CALLS];
    char dead_reason[128];
    size_t n_dead;

    int produced;
    int64_t produced_ids[MAX_CALLS];
    void *opaques[MAX_CALLS];
    int busy_at;        /* produce call index that returns BUSY; -1 = none */
    int64_t refused_id; /* row id that produce rejects; 0 = none */
    int produced_alone; /* of `produced`, through produce_alone */

    int recovers;
    int recover_rc;

    int stopped;
    int exit_code;

    int wake_requests; /* calls of ops->wake_at */
    int64_t wake_at;   /* the last one's time */

    /* log mode */
    bool fetch_log;       /* the last fetch was log mode's full one ... */
    int64_t fetch_from;   /* ... from this stored hwm */
    size_t fetch_n_held;  /* ... leaving these held keys out */
    bool mark_log;        /* the last mark was a cursor row: */
    int64_t cursor_batch; /* its number */
    int64_t cursor_hwm;
    char cursor_snap[32];
    size_t cursor_held, cursor_also;

    /* relay.shards */
    char fetch_slots[32];   /* the last fetch's slots ("" for all) */
    char mark_slots[32];    /* the last mark's */
    char recover_slots[32]; /* the last pass's */
    int claims;
    char give_back[32]; /* the last claim's */
    bool take;
};

static inline int fake_fetch(void *io, const struct obx_fetch *f)
{
    struct fake *fk = io;
    if (fk->fetch_rc != 0)
        return fk->fetch_rc;
    fk->fetches++;
    assert_true(f->n_exclude <= MAX_CALLS);
    memcpy(fk->exclude, f->exclude, f->n_exclude * sizeof(*f->exclude));
    fk->n_exclude = f->n_exclude;
    fk->limit = f->limit;
    fk->keyset = f->keyset;
    fk->after_id = f->keyset ? f->after_id : 0;
    snprintf(fk->snapshot, sizeof(fk->snapshot), "%s", f->snapshot ? f->snapshot : "");
    snprintf(fk->fetch_slots, sizeof(fk->fetch_slots), "%s", f->owned_slots ? f->owned_slots : "");
    fk->max_row_bytes = f->max_row_bytes;
    fk->fetch_log = f->log;
    fk->fetch_from = f->log ? f->after_id : 0;
    fk->fetch_n_held = f->n_held;
    fk->n_held_back = f->n_held_back;
    if (f->n_held_back > 0) {
        if (f->held_back[0].key)
            snprintf(fk->held_back_key, sizeof(fk->held_back_key), "%s/%.*s", f->held_back[0].topic,
                     (int)f->held_back[0].key_len, f->held_back[0].key);
        else
            snprintf(fk->held_back_key, sizeof(fk->held_back_key), "%s/(whole topic)",
                     f->held_back[0].topic);
        fk->held_back_id = f->held_back_ids[0];
    }
    return 0;
}

static inline int fake_mark(void *io, const struct obx_mark *m)
{
    struct fake *f = io;
    f->marks++;
    assert_true(m->n_ids <= MAX_CALLS && m->n_offsets <= MAX_CALLS && m->n_dead <= MAX_CALLS);
    if (m->n_ids > 0) /* log mode's cursor row has none (and no array) */
        memcpy(f->marked, m->ids, m->n_ids * sizeof(*m->ids));
    f->n_marked = m->n_ids;
    for (size_t i = 0; i < m->n_offsets; i++) {
        snprintf(f->off_topics[i], sizeof(f->off_topics[i]), "%s", m->topics[i]);
        f->off_partitions[i] = m->partitions[i];
        f->off_offsets[i] = m->offsets[i];
    }
    f->n_offsets = m->n_offsets;
    memcpy(f->dead, m->dead_ids, m->n_dead * sizeof(*m->dead_ids));
    f->n_dead = m->n_dead;
    snprintf(f->mark_slots, sizeof(f->mark_slots), "%s", m->owned_slots ? m->owned_slots : "");
    if (m->n_dead > 0)
        snprintf(f->dead_reason, sizeof(f->dead_reason), "%s", m->dead_reasons[0]);
    f->mark_log = m->log;
    if (m->log) {
        f->cursor_batch = m->batch;
        f->cursor_hwm = m->hwm;
        snprintf(f->cursor_snap, sizeof(f->cursor_snap), "%s", m->snapshot);
        f->cursor_held = m->n_held;
        f->cursor_also = m->n_also;
    }
    return 0;
}

static inline int fake_mark_fetch(void *io, const struct obx_mark *m, const struct obx_fetch *f)
{
    struct fake *fk = io;
    if (!fk->combine)
        return 1;
    fk->mark_fetches++;
    assert_int_equal(fake_mark(io, m), 0);
    return fake_fetch(io, f);
}

static inline enum obx_produce_result fake_produce(void *io, const struct obx_row *row,
                                                   void *opaque, const char **reason)
{
    struct fake *f = io;
    int call = f->produced;
    if (call == f->busy_at) {
        f->busy_at = -1;
        return OBX_PRODUCE_BUSY;
    }
    if (row->id == f->refused_id) {
        *reason = "Broker: Message size too large";
        return OBX_PRODUCE_REFUSED;
    }
    f->produced_ids[call] = row->id;
    f->opaques[call] = opaque;
    f->produced++;
    return OBX_PRODUCE_OK;
}

static inline enum obx_produce_result fake_produce_alone(void *io, const struct obx_row *row,
                                                         void *opaque, const char **reason)
{
    struct fake *f = io;
    enum obx_produce_result pr = fake_produce(io, row, opaque, reason);
    if (pr == OBX_PRODUCE_OK)
        f->produced_alone++;
    return pr;
}

static inline int fake_recover(void *io, int shards, const char *owned_slots)
{
    struct fake *f = io;
    (void)shards;
    if (f->recover_rc != 0)
        return f->recover_rc;
    f->recovers++;
    snprintf(f->recover_slots, sizeof(f->recover_slots), "%s", owned_slots ? owned_slots : "");
    return 0;
}

static inline int fake_claim(void *io, int shards, const char *give_back, bool take)
{
    struct fake *f = io;
    assert_int_equal(shards, 4);
    f->claims++;
    snprintf(f->give_back, sizeof(f->give_back), "%s", give_back);
    f->take = take;
    return 0;
}

static inline void fake_stopped(void *io, int exit_code)
{
    struct fake *f = io;
    f->stopped++;
    f->exit_code = exit_code;
}

static inline void fake_wake_at(void *io, int64_t when)
{
    struct fake *f = io;
    f->wake_requests++;
    f->wake_at = when;
}

static inline int64_t fake_now(void *io)
{
    struct fake *f = io;
    return f->clock;
}

static const struct obx_relay_ops ops = {
    .fetch = fake_fetch,
    .mark = fake_mark,
    .mark_fetch = fake_mark_fetch,
    .produce = fake_produce,
    .produce_alone = fake_produce_alone,
    .recover = fake_recover,
    .claim = fake_claim,
    .stopped = fake_stopped,
    .wake_at = fake_wake_at,
    .now = fake_now,
};

struct ctx {
    struct fake f;
    struct obx_relay *r;
    const char *snapshot; /* what fetch results carry (NULL: none, so every fetch is full) */
};

static struct obx_relay_settings settings = {
    .batch_size = 4,
    .max_in_flight = 6,
    .on_reject = OBX_ON_REJECT_RETRY,
    .poll_interval_ms = 1000,
    .retry_backoff_ms = 500,
    .shutdown_timeout_ms = 3000,
    .stall_timeout_ms = 10000,
    .fetch_max_bytes = 4000, /* 1000 payload bytes a row in a batch of 4 */
    .max_payload = 100000,
};

static inline int setup(void **state)
{
    struct ctx *c = test_calloc(1, sizeof(*c));
    c->f.busy_at = -1;
    assert_int_equal(obx_relay_new(&settings, &ops, &c->f, &c->f, &c->r), 0);
    *state = c;
    return 0;
}

static inline int teardown(void **state)
{
    struct ctx *c = *state;
    obx_relay_free(c->r);
    test_free(c);
    return 0;
}

/* Delivers a fetch result of ids [first, first + n); row i has key "k<id % 3>". */
static inline void fetched(struct ctx *c, int64_t first, size_t n, int64_t now)
{
    static char keys[16][8];
    struct obx_row rows[16];
    memset(rows, 0, sizeof(rows));
    for (size_t i = 0; i < n; i++) {
        rows[i].id = first + (int64_t)i;
        rows[i].topic = "t";
        snprintf(keys[i], sizeof(keys[i]), "k%d", (int)(rows[i].id % 3));
        rows[i].key = keys[i];
        rows[i].key_len = 2;
    }
    obx_relay_on_fetched(c->r, rows, n, c->snapshot, now);
}

/* Delivery report for the k-th produced row, at partition 0, offset 100 + k. */
static inline void ack_as(struct ctx *c, int k, enum obx_delivery outcome, int64_t now)
{
    obx_relay_on_delivery(c->r, c->f.opaques[k], outcome, 0, 100 + k, "k0", 2,
                          outcome == OBX_DELIVERED ? NULL : "boom", now);
}

static inline void ack(struct ctx *c, int k, bool ok, int64_t now)
{
    ack_as(c, k, ok ? OBX_DELIVERED : OBX_DELIVERY_RETRY, now);
}

/* The main loop's timer fires at `now` for the look for new rows the relay
 * asked for: it must have asked for one due by then. */
static inline void look(struct ctx *c, int64_t now)
{
    assert_true(c->f.wake_requests > 0);
    assert_true(c->f.wake_at <= now);
    obx_relay_tick(c->r, now);
}

/* Slots [from, to) delivered at `now`, their marks done a moment later,
 * and the relay woken after that. */
static inline void ack_range_marked(struct ctx *c, int from, int to, int64_t now)
{
    for (int k = from; k < to; k++)
        ack(c, k, true, now);
    while (obx_relay_state(c->r) == OBX_RELAY_MARKING)
        obx_relay_on_marked(c->r, now + 1);
    look(c, now + 2);
}

/* Postgres ready and the recovery pass done: the relay fetches. */
static inline void ready(struct ctx *c, int64_t now)
{
    obx_relay_on_pg_ready(c->r, now);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_RECOVERING);
    obx_relay_on_recovered(c->r, true, now);
}

static inline bool excluded(struct ctx *c, int64_t id)
{
    for (size_t i = 0; i < c->f.n_exclude; i++)
        if (c->f.exclude[i] == id)
            return true;
    return false;
}

/* Delivers ids as a fetch result carrying snapshot `snap`; row `big_id`
 * (0 = none) comes without its payload of `big_len` bytes. */
static inline void fetched_snap(struct ctx *c, const int64_t *ids, size_t n, int64_t big_id,
                                size_t big_len, int64_t now)
{
    static char keys[16][8];
    struct obx_row rows[16];
    memset(rows, 0, sizeof(rows));
    for (size_t i = 0; i < n; i++) {
        rows[i].id = ids[i];
        rows[i].topic = "t";
        snprintf(keys[i], sizeof(keys[i]), "k%d", (int)(ids[i] % 3));
        rows[i].key = keys[i];
        rows[i].key_len = 2;
        if (ids[i] == big_id) {
            rows[i].oversize = true;
            rows[i].bytes = big_len;
        }
    }
    obx_relay_on_fetched(c->r, rows, n, c->snapshot, now);
}

static inline void fetched_ids(struct ctx *c, const int64_t *ids, size_t n, int64_t now)
{
    fetched_snap(c, ids, n, 0, 0, now);
}

/* Report for the k-th produced row, with that row's own key. */
static inline void report(struct ctx *c, int k, enum obx_delivery outcome, int64_t now)
{
    char key[8];
    snprintf(key, sizeof(key), "k%d", (int)(c->f.produced_ids[k] % 3));
    obx_relay_on_delivery(c->r, c->f.opaques[k], outcome, 0, 100 + k, key, 2,
                          outcome == OBX_DELIVERED ? NULL : "Broker: Message size too large", now);
}

/* Marks done and the relay woken until its next fetch goes out (by `now`,
 * or by a look up to a few poll intervals later). */
static inline void until_fetching(struct ctx *c, int64_t now)
{
    for (int i = 0; i < 8 && obx_relay_state(c->r) != OBX_RELAY_FETCHING; i++) {
        if (obx_relay_state(c->r) == OBX_RELAY_MARKING) {
            obx_relay_on_marked(c->r, now);
            continue;
        }
        obx_relay_tick(c->r, now);
        now += 1000;
    }
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_FETCHING);
}

/* A relay with relay.shards = 4, Postgres ready. */
static inline void shards_ready(struct ctx *c, int64_t now)
{
    struct obx_relay_settings sharded = settings;
    sharded.shards = 4;
    obx_relay_free(c->r);
    assert_int_equal(obx_relay_new(&sharded, &ops, &c->f, &c->f, &c->r), 0);
    obx_relay_on_pg_ready(c->r, now);
}

static inline void claimed(struct ctx *c, const char *owned, int members, int share, int64_t now)
{
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_CLAIMING);
    struct obx_claim a = {.owned = owned, .members = members, .share = share, .other_shards = 0};
    obx_relay_on_claimed(c->r, &a, now);
}

/* Rows with their slots, ids and slots given, as log mode's exact fetch
 * with slots returns them. */
static inline void fetched_in_slots(struct ctx *c, const int64_t *ids, const int32_t *slots,
                                    size_t n, int64_t now)
{
    struct obx_row rows[16];
    memset(rows, 0, sizeof(rows));
    for (size_t i = 0; i < n; i++)
        rows[i] = (struct obx_row){.id = ids[i], .topic = "t", .has_slot = true, .slot = slots[i]};
    obx_relay_on_fetched(c->r, rows, n, c->snapshot, now);
}

#endif
