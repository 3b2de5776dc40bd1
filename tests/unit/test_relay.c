/*
 * Unit tests of the relay state machine against fake pg/kafka operations:
 * what it fetches, produces and marks in reply to each event.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include "cmocka_alloc.h"

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

static int fake_fetch(void *io, const struct obx_fetch *f)
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

static int fake_mark(void *io, const struct obx_mark *m)
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

static int fake_mark_fetch(void *io, const struct obx_mark *m, const struct obx_fetch *f)
{
    struct fake *fk = io;
    if (!fk->combine)
        return 1;
    fk->mark_fetches++;
    assert_int_equal(fake_mark(io, m), 0);
    return fake_fetch(io, f);
}

static enum obx_produce_result fake_produce(void *io, const struct obx_row *row, void *opaque,
                                            const char **reason)
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

static enum obx_produce_result fake_produce_alone(void *io, const struct obx_row *row, void *opaque,
                                                  const char **reason)
{
    struct fake *f = io;
    enum obx_produce_result pr = fake_produce(io, row, opaque, reason);
    if (pr == OBX_PRODUCE_OK)
        f->produced_alone++;
    return pr;
}

static int fake_recover(void *io, int shards, const char *owned_slots)
{
    struct fake *f = io;
    (void)shards;
    if (f->recover_rc != 0)
        return f->recover_rc;
    f->recovers++;
    snprintf(f->recover_slots, sizeof(f->recover_slots), "%s", owned_slots ? owned_slots : "");
    return 0;
}

static int fake_claim(void *io, int shards, const char *give_back, bool take)
{
    struct fake *f = io;
    assert_int_equal(shards, 4);
    f->claims++;
    snprintf(f->give_back, sizeof(f->give_back), "%s", give_back);
    f->take = take;
    return 0;
}

static void fake_stopped(void *io, int exit_code)
{
    struct fake *f = io;
    f->stopped++;
    f->exit_code = exit_code;
}

static void fake_wake_at(void *io, int64_t when)
{
    struct fake *f = io;
    f->wake_requests++;
    f->wake_at = when;
}

static int64_t fake_now(void *io)
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

static int setup(void **state)
{
    struct ctx *c = test_calloc(1, sizeof(*c));
    c->f.busy_at = -1;
    assert_int_equal(obx_relay_new(&settings, &ops, &c->f, &c->f, &c->r), 0);
    *state = c;
    return 0;
}

static int teardown(void **state)
{
    struct ctx *c = *state;
    obx_relay_free(c->r);
    test_free(c);
    return 0;
}

/* Delivers a fetch result of ids [first, first + n); row i has key "k<id % 3>". */
static void fetched(struct ctx *c, int64_t first, size_t n, int64_t now)
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
static void ack_as(struct ctx *c, int k, enum obx_delivery outcome, int64_t now)
{
    obx_relay_on_delivery(c->r, c->f.opaques[k], outcome, 0, 100 + k, "k0", 2,
                          outcome == OBX_DELIVERED ? NULL : "boom", now);
}

static void ack(struct ctx *c, int k, bool ok, int64_t now)
{
    ack_as(c, k, ok ? OBX_DELIVERED : OBX_DELIVERY_RETRY, now);
}

/* The main loop's timer fires at `now` for the look for new rows the relay
 * asked for: it must have asked for one due by then. */
static void look(struct ctx *c, int64_t now)
{
    assert_true(c->f.wake_requests > 0);
    assert_true(c->f.wake_at <= now);
    obx_relay_tick(c->r, now);
}

/* Slots [from, to) delivered at `now`, their marks done a moment later,
 * and the relay woken after that. */
static void ack_range_marked(struct ctx *c, int from, int to, int64_t now)
{
    for (int k = from; k < to; k++)
        ack(c, k, true, now);
    while (obx_relay_state(c->r) == OBX_RELAY_MARKING)
        obx_relay_on_marked(c->r, now + 1);
    look(c, now + 2);
}

/* Postgres ready and the recovery pass done: the relay fetches. */
static void ready(struct ctx *c, int64_t now)
{
    obx_relay_on_pg_ready(c->r, now);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_RECOVERING);
    obx_relay_on_recovered(c->r, true, now);
}

static bool excluded(struct ctx *c, int64_t id)
{
    for (size_t i = 0; i < c->f.n_exclude; i++)
        if (c->f.exclude[i] == id)
            return true;
    return false;
}

static void test_cycle(void **state)
{
    struct ctx *c = *state;
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_WAIT_PG);
    obx_relay_tick(c->r, 0); /* nothing happens without Postgres */
    assert_int_equal(c->f.fetches, 0);

    obx_relay_on_pg_ready(c->r, 0);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_RECOVERING);
    assert_int_equal(c->f.recovers, 1);
    assert_int_equal(c->f.fetches, 0); /* nothing is published before recovery */
    obx_relay_on_recovered(c->r, true, 0);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_FETCHING);
    assert_int_equal(c->f.fetches, 1);
    assert_int_equal(c->f.limit, 4);
    assert_int_equal(c->f.n_exclude, 0);

    fetched(c, 10, 3, 1);
    assert_int_equal(c->f.produced, 3);
    assert_int_equal(c->f.produced_ids[0], 10);
    assert_int_equal(c->f.produced_ids[2], 12);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_IDLE);
    assert_int_equal(c->f.fetches, 1); /* short batch: no refetch */
    assert_int_equal(obx_relay_in_flight(c->r), 3);

    /* First ack is marked at once; the next two wait for that mark. */
    ack(c, 1, true, 2);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_MARKING);
    assert_int_equal(c->f.n_marked, 1);
    assert_int_equal(c->f.marked[0], 11);
    ack(c, 0, true, 2);
    ack(c, 2, true, 2);
    assert_int_equal(c->f.marks, 1);
    obx_relay_on_marked(c->r, 3);
    assert_int_equal(c->f.marks, 2);
    assert_int_equal(c->f.n_marked, 2);
    obx_relay_on_marked(c->r, 4);
    assert_int_equal(obx_relay_in_flight(c->r), 0);
    assert_int_equal(obx_relay_marked_total(c->r), 3);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_IDLE);
}

/* The routes that skip main: Postgres's answer goes straight to the relay
 * (its time from ops->now), and every row straight to the relay's producer,
 * also a row parked behind its key's record. */
static void test_straight_routes(void **state)
{
    struct ctx *c = *state;
    struct fake producer;
    memset(&producer, 0, sizeof(producer));
    producer.busy_at = -1;
    producer.refused_id = -1;
    struct obx_relay_settings one = settings;
    one.one_per_key = true;
    obx_relay_free(c->r);
    assert_int_equal(obx_relay_new(&one, &ops, &c->f, &producer, &c->r), 0);
    ready(c, 0);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_FETCHING);
    /* An error answer: the fetch failed; a later tick fetches again. */
    c->f.clock = 3;
    obx_relay_fetched(c->r, NULL, 0, NULL, "injected");
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_IDLE);
    assert_int_equal(c->f.fetches, 1);
    obx_relay_tick(c->r, 10000);
    assert_int_equal(c->f.fetches, 2);
    /* Rows 5 and 6 of one key: 5 goes to the producer, 6 is parked. */
    struct obx_row rows[2] = {{.id = 5, .topic = "t", .key = "k", .key_len = 1},
                              {.id = 6, .topic = "t", .key = "k", .key_len = 1}};
    c->f.clock = 10001;
    obx_relay_fetched(c->r, rows, 2, NULL, NULL);
    assert_int_equal(producer.produced, 1);
    assert_int_equal(c->f.produced, 0);
    /* 5 delivered: 6 goes, to the producer too. */
    obx_relay_on_delivery(c->r, producer.opaques[0], OBX_DELIVERED, 0, 100, "k", 1, NULL, 10002);
    assert_int_equal(producer.produced, 2);
    assert_int_equal(producer.produced_ids[1], 6);
    assert_int_equal(c->f.produced, 0);
    obx_relay_on_delivery(c->r, producer.opaques[1], OBX_DELIVERED, 0, 101, "k", 1, NULL, 10003);
    while (obx_relay_state(c->r) == OBX_RELAY_MARKING)
        obx_relay_on_marked(c->r, 10004);
    assert_int_equal(obx_relay_marked_total(c->r), 2);
}

static void test_exclusion_and_backpressure(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 4, 0); /* full batch: fetch again at once */
    assert_int_equal(c->f.fetches, 2);
    assert_int_equal(c->f.limit, 2); /* 6 slots, 4 in flight */
    assert_int_equal(c->f.n_exclude, 4);
    for (int64_t id = 1; id <= 4; id++)
        assert_true(excluded(c, id));

    fetched(c, 5, 2, 0);
    assert_int_equal(obx_relay_in_flight(c->r), 6);
    look(c, 1);
    obx_relay_tick(c->r, 5000);
    assert_int_equal(c->f.fetches, 2); /* full: no fetch while 6 are in flight */

    ack(c, 0, true, 10); /* mark id 1, then a slot frees */
    obx_relay_on_marked(c->r, 11);
    look(c, 12);
    assert_int_equal(c->f.fetches, 3);
    assert_int_equal(c->f.limit, 1);
    assert_false(excluded(c, 1)); /* marked: no longer in flight */
    assert_true(excluded(c, 6));
}

/* The look for new rows (no wake-up comes from the writers): 1 ms after a
 * fetch that found rows, then an eighth of the time since rows were last
 * found (never under 1 ms), up to relay.poll_interval (1000 ms here). No
 * fetch before it is due, and rows found bring it back to 1 ms. */
static void test_adaptive_look(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 2, 10);
    assert_int_equal(c->f.wake_at, 11);
    obx_relay_tick(c->r, 10);
    assert_int_equal(c->f.fetches, 1);
    look(c, 11);
    assert_int_equal(c->f.fetches, 2);
    int64_t now = 11, last = 0;
    int empty_looks = 0;
    while (last < 1000) {
        fetched(c, 0, 0, now);
        int64_t expect = (now - 10) / 8;
        expect = expect < 1 ? 1 : expect > 1000 ? 1000 : expect;
        assert_int_equal(c->f.wake_at - now, expect);
        assert_true(expect >= last); /* never sooner while nothing comes */
        obx_relay_tick(c->r, c->f.wake_at - 1);
        assert_int_equal(c->f.fetches, 2 + empty_looks);
        last = expect;
        now = c->f.wake_at;
        look(c, now);
        assert_int_equal(c->f.fetches, 3 + empty_looks++);
        assert_true(empty_looks < 200);
    }
    /* A gap of 15 ms after rows: still looked for every millisecond. */
    fetched(c, 20, 1, now);
    assert_int_equal(c->f.wake_at, now + 1);
    look(c, now + 1);
    fetched(c, 0, 0, now + 15);
    assert_int_equal(c->f.wake_at, now + 16);
}

/* A lost session's rows are confirmed by their ids in no later session:
 * that one may run on a server whose history was rewound (a failover to
 * an asynchronous standby), where the ids belong to other rows. The pass
 * waits for the reports still outstanding and finds in Kafka what was
 * acknowledged; the old session's offsets are not stored. */
static void test_pg_lost_confirms_nothing_by_id(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 3, 0);
    ack(c, 0, true, 1);
    ack(c, 1, true, 1);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_MARKING);
    int marks = c->f.marks, recovers = c->f.recovers;
    obx_relay_on_pg_lost(c->r, 2); /* the mark may or may not have committed */
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_WAIT_PG);
    assert_int_equal(obx_relay_in_flight(c->r), 1); /* row 3's report is out */

    obx_relay_on_pg_ready(c->r, 3);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_IDLE);
    assert_int_equal(c->f.marks, marks);       /* nothing marked by id */
    assert_int_equal(c->f.recovers, recovers); /* the pass waits for row 3 */
    ack(c, 2, true, 4);                        /* row 3 landed: the pass finds it */
    assert_int_equal(c->f.marks, marks);
    assert_int_equal(c->f.recovers, recovers + 1);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_RECOVERING);
    assert_int_equal(obx_relay_in_flight(c->r), 0);

    /* Row 1 of the new history comes back unsent: published and marked,
     * and only its own offset goes with the mark. */
    int fetches = c->f.fetches;
    obx_relay_on_recovered(c->r, true, 5);
    assert_int_equal(c->f.fetches, fetches + 1);
    assert_int_equal(c->f.after_id, 0); /* a full fetch */
    fetched(c, 1, 1, 6);
    ack(c, 3, true, 2000);
    assert_int_equal(c->f.marks, marks + 1);
    assert_int_equal(c->f.n_marked, 1);
    assert_int_equal(c->f.marked[0], 1);
    assert_true(c->f.n_offsets <= 1);
    for (size_t i = 0; i < c->f.n_offsets; i++)
        assert_int_equal(c->f.off_offsets[i], 103);
}

/* Every acquisition of the lock runs the recovery pass, the second one in
 * the same process too (issue 10.1). */
static void test_every_acquisition_recovers(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    assert_int_equal(c->f.recovers, 1);
    obx_relay_on_pg_lost(c->r, 10);
    obx_relay_on_pg_ready(c->r, 20);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_RECOVERING);
    assert_int_equal(c->f.recovers, 2);
    assert_false(obx_relay_recovered(c->r));
}

static void test_query_failed_backs_off(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    obx_relay_on_query_failed(c->r, "permission denied", 100);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_IDLE);
    obx_relay_tick(c->r, 200);
    assert_int_equal(c->f.fetches, 1); /* within the 500 ms back-off */
    obx_relay_tick(c->r, 600);
    assert_int_equal(c->f.fetches, 2);

    /* A failed mark keeps the rows acknowledged and retries the mark. */
    fetched(c, 1, 1, 600);
    ack(c, 0, true, 601);
    assert_int_equal(c->f.marks, 1);
    obx_relay_on_query_failed(c->r, "deadlock", 602);
    obx_relay_tick(c->r, 700);
    assert_int_equal(c->f.marks, 1);
    obx_relay_tick(c->r, 1200);
    assert_int_equal(c->f.marks, 2);
    assert_int_equal(c->f.marked[0], 1);
}

static void test_delivery_failure_refetches(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 2, 0);
    ack(c, 0, false, 1); /* not persisted */
    assert_int_equal(obx_relay_in_flight(c->r), 1);
    assert_int_equal(c->f.marks, 0); /* a failed row is never marked */
    obx_relay_tick(c->r, 400);
    assert_int_equal(c->f.fetches, 1); /* back-off */
    obx_relay_tick(c->r, 600);
    assert_int_equal(c->f.fetches, 2);
    assert_false(excluded(c, 1)); /* fetched again */
    assert_true(excluded(c, 2));
}

static void test_produce_busy_keeps_order(void **state)
{
    struct ctx *c = *state;
    c->f.busy_at = 1;
    ready(c, 0);
    fetched(c, 1, 3, 0);
    /* Row 1 produced; rows 2 and 3 wait for a later fetch, in order. */
    assert_int_equal(c->f.produced, 1);
    assert_int_equal(obx_relay_in_flight(c->r), 1);
    obx_relay_tick(c->r, 50);
    assert_int_equal(c->f.fetches, 1);
    obx_relay_tick(c->r, 1200);
    assert_int_equal(c->f.fetches, 2);
    fetched(c, 2, 2, 1200);
    assert_int_equal(c->f.produced_ids[1], 2);
    assert_int_equal(c->f.produced_ids[2], 3);
}

/* The next fetch goes out before a full batch is produced; if the queue
 * fills in that batch, its answer is dropped, or its rows would overtake
 * the ones left behind. */
static void test_produce_busy_discards_early_fetch(void **state)
{
    struct ctx *c = *state;
    c->f.busy_at = 1;
    ready(c, 0);
    fetched(c, 1, 4, 0); /* full batch; row 2 finds the queue full */
    assert_int_equal(c->f.fetches, 2);
    assert_int_equal(c->f.produced, 1);
    assert_true(excluded(c, 2)); /* the early fetch skipped rows 2-4 */
    fetched(c, 5, 2, 10);        /* its answer: must not run ahead of rows 2-4 */
    assert_int_equal(c->f.produced, 1);
    obx_relay_tick(c->r, 1200);
    assert_int_equal(c->f.fetches, 3);
    assert_false(excluded(c, 2));
    fetched(c, 2, 4, 1200);
    assert_int_equal(c->f.produced, 5);
    for (int i = 1; i <= 4; i++)
        assert_int_equal(c->f.produced_ids[i], i + 1);
}

/* Mark: ids plus the highest acknowledged offset of each partition. */
static void test_mark_carries_offsets(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 3, 0);
    ack(c, 0, true, 1); /* mark [1] goes at once, offset 100, stored with it */
    assert_int_equal(c->f.n_offsets, 1);
    assert_string_equal(c->f.off_topics[0], "t");
    assert_int_equal(c->f.off_partitions[0], 0);
    assert_int_equal(c->f.off_offsets[0], 100);
    obx_relay_on_delivery(c->r, c->f.opaques[2], OBX_DELIVERED, 1, 7, "k0", 2, NULL, 2);
    obx_relay_on_delivery(c->r, c->f.opaques[1], OBX_DELIVERED, 1, 6, "k2", 2, NULL, 2);
    obx_relay_on_marked(c->r, 3);
    assert_int_equal(c->f.n_marked, 2);
    /* Within a second of the last store the offsets wait (they only say
     * where the recovery pass starts reading); the next store has the
     * highest of each partition since. */
    assert_int_equal(c->f.n_offsets, 0);
    obx_relay_on_marked(c->r, 4);
    look(c, 1000);
    fetched(c, 4, 1, 1001);
    obx_relay_on_delivery(c->r, c->f.opaques[3], OBX_DELIVERED, 0, 9, "k1", 2, NULL, 1005);
    assert_int_equal(c->f.n_marked, 1);
    assert_int_equal(c->f.n_offsets, 2);
    for (int i = 0; i < 2; i++)
        assert_int_equal(c->f.off_offsets[i], c->f.off_partitions[i] == 1 ? 7 : 9);
}

static void fetched_snap(struct ctx *c, const int64_t *ids, size_t n, int64_t big_id,
                         size_t big_len, int64_t now);

/* A possibly-persisted report holds every mark until a recovery pass has
 * settled it: a mark of a row acknowledged after it would raise the stored
 * offset past the uncertain record, and the pass, which reads from there,
 * would miss it if it landed. */
static void test_unknown_holds_marks(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 3, 1);
    ack_as(c, 0, OBX_DELIVERY_UNKNOWN, 2);
    ack(c, 1, true, 3); /* acknowledged after the uncertain one */
    assert_int_equal(c->f.marks, 0);
    obx_relay_tick(c->r, 600);
    assert_int_equal(c->f.recovers, 2);
    assert_int_equal(c->f.marks, 0); /* the pass first */
    obx_relay_on_recovered(c->r, true, 601);
    assert_int_equal(c->f.marks, 1);
    assert_int_equal(c->f.marked[0], 2);
}

/* A fetch that was out when a possibly-persisted report came is set aside:
 * its rows may be of the uncertain row's key, and the pass goes first. */
static void test_fetch_after_unknown_set_aside(void **state)
{
    struct ctx *c = *state;
    c->snapshot = "100:100:";
    ready(c, 0);
    fetched_snap(c, (const int64_t[]){1, 2}, 2, 0, 0, 0);
    look(c, 1);
    assert_int_equal(c->f.fetches, 2);
    ack_as(c, 0, OBX_DELIVERY_UNKNOWN, 2);
    fetched_snap(c, (const int64_t[]){3, 4}, 2, 0, 0, 3);
    assert_int_equal(c->f.produced, 2);
    obx_relay_tick(c->r, 600);
    assert_int_equal(c->f.recovers, 2);
    obx_relay_on_recovered(c->r, true, 601);
    assert_int_equal(c->f.fetches, 3);
    assert_int_equal(c->f.after_id, 0); /* a full fetch: 1, 3 and 4 come again */
}

/* More refused rows than the old fixed table held (1,024), each of its own
 * key: every one still holds its key back with a back-off of its own (it
 * used to be retried at once, without a solo try or relay.on_reject). */
static void test_many_keys_held_back(void **state)
{
    struct ctx *c = *state;
    enum { KEYS = 1100 };
    ready(c, 0);
    for (int i = 0; i < KEYS; i++) {
        char key[16];
        snprintf(key, sizeof(key), "key-%d", i);
        struct obx_row row = {.id = i + 1, .topic = "t", .key = key, .key_len = strlen(key)};
        assert_int_equal(obx_relay_state(c->r), OBX_RELAY_FETCHING);
        obx_relay_on_fetched(c->r, &row, 1, NULL, 1);
        obx_relay_on_delivery(c->r, c->f.opaques[c->f.produced - 1], OBX_DELIVERY_REFUSED, 0, -1,
                              key, strlen(key), "Broker: Message size too large", 1);
    }
    assert_int_equal(obx_relay_held_back_keys(c->r), KEYS);
    /* The fetch after the last refusal holds every key back and leaves
     * every refused row out until its back-off has passed. */
    assert_int_equal(c->f.n_held_back, KEYS);
    assert_int_equal(c->f.n_exclude, KEYS);
}

/* A possibly-persisted report that comes during the recovery pass: the pass
 * may have read that partition before the record landed, so another pass
 * runs before anything more is published. */
static void test_unknown_during_recovery_runs_it_again(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 2, 1);
    ack_as(c, 0, OBX_DELIVERY_UNKNOWN, 2);
    obx_relay_tick(c->r, 600); /* after the back-off: the pass */
    assert_int_equal(c->f.recovers, 2);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_RECOVERING);
    ack_as(c, 1, OBX_DELIVERY_UNKNOWN, 601); /* during it */
    obx_relay_on_recovered(c->r, true, 602);
    int fetches = c->f.fetches;
    obx_relay_tick(c->r, 1200);
    assert_int_equal(c->f.recovers, 3);
    assert_int_equal(c->f.fetches, fetches);
    obx_relay_on_recovered(c->r, true, 1201);
    assert_int_equal(c->f.fetches, fetches + 1);
}

static void test_recovery_retried(void **state)
{
    struct ctx *c = *state;
    obx_relay_on_pg_ready(c->r, 0);
    obx_relay_on_recovered(c->r, false, 10); /* e.g. Kafka unreachable */
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_IDLE);
    obx_relay_tick(c->r, 20);
    assert_int_equal(c->f.fetches, 0);
    assert_int_equal(c->f.recovers, 1);
    obx_relay_tick(c->r, 600); /* after the back-off */
    assert_int_equal(c->f.recovers, 2);
    obx_relay_on_pg_lost(c->r, 700); /* lost mid-pass: start over */
    obx_relay_on_pg_ready(c->r, 800);
    assert_int_equal(c->f.recovers, 3);
    obx_relay_on_recovered(c->r, true, 900);
    assert_int_equal(c->f.fetches, 1);
}

/* relay.on_reject = retry: the refused row is retried after a back-off and
 * later rows of its key wait; other keys go on. */
static void test_reject_retry_holds_key(void **state)
{
    struct ctx *c = *state;
    c->f.refused_id = 3; /* key k0 */
    ready(c, 0);
    fetched(c, 1, 4, 0); /* ids 1 (k1), 2 (k2), 3 (k0, refused), 4 (k1) */
    assert_int_equal(c->f.produced, 3);
    assert_int_equal(obx_relay_held_back_keys(c->r), 1);
    /* Full batch: the next fetch went out before the rows were produced, so
     * it knows nothing of the refusal yet ... */
    assert_int_equal(c->f.fetches, 2);
    assert_int_equal(c->f.n_held_back, 0);

    /* ... and a later row of k0 in its answer is held back; k1 rows go. */
    fetched(c, 6, 2, 1); /* 6 (k0) held, 7 (k1) produced */
    assert_int_equal(c->f.produced, 4);
    assert_int_equal(c->f.produced_ids[3], 7);

    /* The refusal asked for another fetch, sent now: it carries the block,
     * and row 3 is not due yet. */
    assert_int_equal(c->f.fetches, 3);
    assert_int_equal(c->f.n_held_back, 1);
    assert_string_equal(c->f.held_back_key, "t/k0");
    assert_int_equal(c->f.held_back_id, 3);
    assert_true(excluded(c, 3));
    fetched(c, 8, 0, 2);

    /* Due after retry_backoff, and tried alone: while rows of other keys
     * are out, no fetch goes (a refusal in a batch would take them with
     * it). Once they are in, it is fetched again, and this time delivered. */
    c->f.refused_id = 0;
    int fetches = c->f.fetches;
    obx_relay_tick(c->r, 600);
    assert_int_equal(c->f.fetches, fetches);
    ack_range_marked(c, 0, 4, 600);
    assert_false(excluded(c, 3));
    fetched(c, 3, 1, 603);
    assert_int_equal(c->f.produced_ids[4], 3);
    assert_int_equal(c->f.produced_alone, 1); /* a refusal there would stop nothing else */
    obx_relay_on_delivery(c->r, c->f.opaques[4], OBX_DELIVERED, 0, 9, "k0", 2, NULL, 604);
    assert_int_equal(obx_relay_held_back_keys(c->r), 0);
}

/* Issue 37: a topic refused as a whole is one entry, however many keys:
 * its later rows, of any key or none, wait behind its first refused row
 * (reports of rows refused or purged with it add nothing), the fetch asks
 * for the topic with no key, and the row is retried alone. */
static void test_topic_refused_held_as_one(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 4, 0); /* 1 (k1), 2 (k2), 3 (k0), 4 (k1), all topic t */
    assert_int_equal(c->f.produced, 4);
    ack(c, 0, true, 1);
    ack_as(c, 2, OBX_DELIVERY_TOPIC_REFUSED, 2); /* row 3: the topic's first refusal */
    assert_int_equal(obx_relay_held_back_keys(c->r), 1);
    ack_as(c, 1, OBX_DELIVERY_TOPIC_REFUSED, 3); /* row 2, lower: the entry moves to it */
    ack_as(c, 3, OBX_DELIVERY_UNKNOWN, 3);       /* row 4, purged with it: no entry */
    assert_int_equal(obx_relay_held_back_keys(c->r), 1);
    /* The fetch sent before the reports answers; the mark, and the pass
     * the possibly persisted row asks for, go; then a fetch. */
    int fetches = c->f.fetches;
    for (int step = 0; step < 8 && c->f.fetches == fetches; step++) {
        if (obx_relay_state(c->r) == OBX_RELAY_FETCHING)
            fetched(c, 7, 0, 4);
        else if (obx_relay_state(c->r) == OBX_RELAY_MARKING)
            obx_relay_on_marked(c->r, 4);
        else if (obx_relay_state(c->r) == OBX_RELAY_RECOVERING)
            obx_relay_on_recovered(c->r, true, 5);
        else
            obx_relay_tick(c->r, 600);
        if (step == 0)
            fetches = c->f.fetches; /* the answer's own follow-up does not count */
    }
    assert_true(c->f.fetches > fetches);
    assert_int_equal(c->f.n_held_back, 1);
    assert_string_equal(c->f.held_back_key, "t/(whole topic)");
    assert_int_equal(c->f.held_back_id, 2);
    assert_true(excluded(c, 2)); /* not due yet */

    /* Tried again, row 2 is refused for itself (too large): the topic takes
     * rows again, and only its key waits. */
    for (int64_t t = 7; t < 5000 && excluded(c, 2); t += 100) {
        if (obx_relay_state(c->r) == OBX_RELAY_FETCHING)
            fetched(c, 7, 0, t);
        else
            obx_relay_tick(c->r, t);
    }
    assert_false(excluded(c, 2));
    int before = c->f.produced;
    fetched(c, 2, 1, 5000);
    assert_int_equal(c->f.produced, before + 1);
    ack_as(c, before, OBX_DELIVERY_REFUSED, 5001);
    fetches = c->f.fetches;
    for (int step = 0; step < 8 && c->f.fetches == fetches; step++) {
        if (obx_relay_state(c->r) == OBX_RELAY_FETCHING)
            fetched(c, 7, 0, 5002);
        else
            obx_relay_tick(c->r, 5100 + step * 100);
    }
    assert_int_equal(c->f.n_held_back, 1);
    assert_string_equal(c->f.held_back_key, "t/k0"); /* the key its report named (ack_as) */
}

/* Issue 10.4: a refused row being retried that then fails for a passing
 * reason is due again after the back-off, not stuck (and its key with it)
 * until a restart. */
static void test_reject_then_transient_failure(void **state)
{
    struct ctx *c = *state;
    c->f.refused_id = 3;
    ready(c, 0);
    fetched(c, 3, 1, 0); /* row 3 refused: held */
    assert_int_equal(obx_relay_held_back_keys(c->r), 1);
    c->f.refused_id = 0;
    obx_relay_tick(c->r, 600);
    fetched(c, 3, 1, 600); /* retried: produced */
    int k = c->f.produced - 1;
    assert_int_equal(c->f.produced_ids[k], 3);
    assert_true(excluded(c, 3)); /* in flight: the fetch sent meanwhile leaves it out */
    ack(c, k, false, 700);       /* a transient failure this time */
    /* The fetch in flight answers without it: that says nothing (it was
     * due, to be tried alone, when that fetch went, but in flight too). */
    fetched(c, 8, 0, 701);
    int fetches = c->f.fetches;
    obx_relay_tick(c->r, 1300);
    assert_int_equal(c->f.fetches, fetches + 1);
    assert_false(excluded(c, 3));                        /* due again: this fetch may bring it */
    assert_int_equal(obx_relay_held_back_keys(c->r), 1); /* its key still waits behind it */
}

/* Issue 10.5: a delivery that may have been persisted (a request timed out
 * in flight) is not published again blindly: the recovery pass runs before
 * the next fetch. */
static void test_possibly_persisted_reruns_recovery(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    assert_int_equal(c->f.recovers, 1);
    fetched(c, 1, 2, 0);
    ack(c, 0, true, 1);
    obx_relay_on_marked(c->r, 2);
    int fetches = c->f.fetches;
    ack_as(c, 1, OBX_DELIVERY_UNKNOWN, 3);
    assert_false(obx_relay_recovered(c->r));
    obx_relay_tick(c->r, 600); /* after the back-off: recovery first, no fetch */
    assert_int_equal(c->f.recovers, 2);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_RECOVERING);
    assert_int_equal(c->f.fetches, fetches);
    obx_relay_on_recovered(c->r, true, 601);
    assert_int_equal(c->f.fetches, fetches + 1);
}

static int failing_fetch_after(void *io, int id)
{
    (void)io;
    return id == OBX_FP_FETCH_AFTER ? -1 : 0;
}

/* Failpoints reach the relay through its ops (no global): an injected
 * error after the fetch produces nothing and fetches again after the
 * back-off. */
static void test_failpoint_through_ops(void **state)
{
    struct ctx *c = *state;
    struct obx_relay_ops with_fp = ops;
    with_fp.failpoint = failing_fetch_after;
    obx_relay_free(c->r);
    assert_int_equal(obx_relay_new(&settings, &with_fp, &c->f, &c->f, &c->r), 0);
    ready(c, 0);
    int fetches = c->f.fetches;
    fetched(c, 1, 2, 0);
    assert_int_equal(c->f.produced, 0);
    obx_relay_tick(c->r, 600);
    assert_int_equal(c->f.fetches, fetches + 1);
}

/* relay.on_reject = dead_letter: the row goes to dead_letters with the
 * reason, in the next mark; nothing is held back. */
static void test_reject_dead_letter(void **state)
{
    struct ctx *c = *state;
    obx_relay_free(c->r);
    struct obx_relay_settings s = settings;
    s.on_reject = OBX_ON_REJECT_DEAD_LETTER;
    assert_int_equal(obx_relay_new(&s, &ops, &c->f, &c->f, &c->r), 0);
    c->f.refused_id = 2;
    ready(c, 0);
    fetched(c, 1, 3, 0);
    assert_int_equal(c->f.produced, 2);
    assert_int_equal(obx_relay_held_back_keys(c->r), 0);
    assert_int_equal(c->f.marks, 1); /* the dead letter is marked at once */
    assert_int_equal(c->f.n_dead, 1);
    assert_int_equal(c->f.dead[0], 2);
    assert_string_equal(c->f.dead_reason, "Broker: Message size too large");
    assert_int_equal(c->f.n_marked, 0);
    obx_relay_on_marked(c->r, 1);
    assert_int_equal(obx_relay_dead_total(c->r), 1);
    assert_int_equal(obx_relay_in_flight(c->r), 2);

    /* A delivery report that refuses a row: dead-lettered too, in the mark
     * after the fetch now in flight. */
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_FETCHING);
    ack_as(c, 0, OBX_DELIVERY_REFUSED, 2);
    assert_int_equal(c->f.marks, 1);
    fetched(c, 10, 0, 3);
    assert_int_equal(c->f.marks, 2);
    assert_int_equal(c->f.n_dead, 1);
    assert_int_equal(c->f.dead[0], 1);
    assert_string_equal(c->f.dead_reason, "boom");
}

/* Delivers a fetch result of the given ids (keys as in fetched()). */
static void fetched_snap(struct ctx *c, const int64_t *ids, size_t n, int64_t big_id,
                         size_t big_len, int64_t now);
static void fetched_ids(struct ctx *c, const int64_t *ids, size_t n, int64_t now)
{
    fetched_snap(c, ids, n, 0, 0, now);
}

/* Report for the k-th produced row, with that row's own key. */
static void report(struct ctx *c, int k, enum obx_delivery outcome, int64_t now)
{
    char key[8];
    snprintf(key, sizeof(key), "k%d", (int)(c->f.produced_ids[k] % 3));
    obx_relay_on_delivery(c->r, c->f.opaques[k], outcome, 0, 100 + k, key, 2,
                          outcome == OBX_DELIVERED ? NULL : "Broker: Message size too large", now);
}

/* Marks done and the relay woken until its next fetch goes out (by `now`,
 * or by a look up to a few poll intervals later). */
static void until_fetching(struct ctx *c, int64_t now)
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

/* A row whose delivery failed (not persisted) holds its key back until it
 * is delivered: a later row of its key in a fetch already on its way is
 * not produced, the next fetch carries the key, and the row, fetched again
 * with the later one, goes first and alone of its key (issue 21.1). */
static void test_failed_row_holds_its_key(void **state)
{
    struct ctx *c = *state;
    c->snapshot = "100:100:";
    ready(c, 0);
    fetched_snap(c, (const int64_t[]){1, 2}, 2, 0, 0, 0); /* 1:k1 2:k2 */
    look(c, 1);
    assert_int_equal(c->f.fetches, 2);
    report(c, 0, OBX_DELIVERY_RETRY, 2); /* row 1 (k1) not delivered */
    assert_int_equal(obx_relay_held_back_keys(c->r), 1);
    fetched_snap(c, (const int64_t[]){4, 5}, 2, 0, 0, 3); /* 4:k1 5:k2, fetched before */
    assert_int_equal(c->f.produced, 3);
    assert_int_equal(c->f.produced_ids[2], 5); /* k2 goes on, k1's row 4 waits */
    report(c, 1, OBX_DELIVERED, 4);
    report(c, 2, OBX_DELIVERED, 5);
    until_fetching(c, 600); /* after the back-off: a full fetch, with k1 held */
    assert_int_equal(c->f.after_id, 0);
    assert_false(excluded(c, 1));
    assert_int_equal(c->f.n_held_back, 1);
    assert_string_equal(c->f.held_back_key, "t/k1");
    assert_int_equal(c->f.held_back_id, 1);
    /* Had the SQL let row 4 through, the relay itself holds it back. */
    fetched_snap(c, (const int64_t[]){1, 4}, 2, 0, 0, 601);
    assert_int_equal(c->f.produced, 4);
    assert_int_equal(c->f.produced_ids[3], 1);
    report(c, 3, OBX_DELIVERED, 602);
    assert_int_equal(obx_relay_held_back_keys(c->r), 0);
    until_fetching(c, 603);
    assert_int_equal(c->f.n_held_back, 0);
    fetched_snap(c, (const int64_t[]){4}, 1, 0, 0, 5000);
    assert_int_equal(c->f.produced, 5);
    assert_int_equal(c->f.produced_ids[4], 4);
}

/* A row whose delivery is unknown holds its key back too; when the
 * recovery pass finds it in Kafka (and marks it), the full fetch after the
 * pass passes its place without it, and its key goes on. */
static void test_uncertain_row_found_frees_its_key(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched_ids(c, (const int64_t[]){1, 2}, 2, 0); /* 1:k1 2:k2 */
    report(c, 1, OBX_DELIVERED, 1);
    report(c, 0, OBX_DELIVERY_UNKNOWN, 2);
    assert_int_equal(obx_relay_held_back_keys(c->r), 1);
    if (obx_relay_state(c->r) == OBX_RELAY_MARKING)
        obx_relay_on_marked(c->r, 3); /* row 2's, sent before the report */
    obx_relay_tick(c->r, 600);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_RECOVERING);
    obx_relay_on_recovered(c->r, true, 601); /* it marked row 1 */
    until_fetching(c, 602);
    assert_int_equal(c->f.after_id, 0);
    assert_false(excluded(c, 1));
    int produced = c->f.produced;
    fetched_ids(c, (const int64_t[]){4}, 1, 5000); /* 4:k1, and no row 1 */
    assert_int_equal(obx_relay_held_back_keys(c->r), 0);
    assert_int_equal(c->f.produced, produced + 1);
    assert_int_equal(c->f.produced_ids[produced], 4);
}

/* Two failed rows of one key: the later one, held back in a full fetch by
 * the earlier one, is not taken for gone when that fetch's answer comes
 * after the earlier one was delivered (review of 21.1). */
static void test_held_row_behind_another_not_dropped(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched_ids(c, (const int64_t[]){1, 4}, 2, 0); /* both k1 */
    report(c, 0, OBX_DELIVERY_RETRY, 1);
    report(c, 1, OBX_DELIVERY_RETRY, 2);
    assert_int_equal(obx_relay_held_back_keys(c->r), 2);
    until_fetching(c, 600);
    fetched_ids(c, (const int64_t[]){1}, 1, 601); /* 4 held back in the SQL by 1 */
    int k = c->f.produced - 1;
    assert_int_equal(c->f.produced_ids[k], 1);
    until_fetching(c, 602); /* 4 is due: another full fetch, 4 still behind 1 */
    report(c, k, OBX_DELIVERED, 603);
    assert_int_equal(obx_relay_held_back_keys(c->r), 1);
    fetched_ids(c, NULL, 0, 604); /* its answer: without 4, which it held back */
    assert_int_equal(obx_relay_held_back_keys(c->r), 1);
}

/* A refused batch (MSG_SIZE_TOO_LARGE for all of it) dead-letters only the
 * row that is refused alone too: each row of the batch is tried alone, in
 * id order, and later rows of its key wait for it. */
static void test_batch_refused_rows_go_alone(void **state)
{
    struct ctx *c = *state;
    obx_relay_free(c->r);
    struct obx_relay_settings s = settings;
    s.on_reject = OBX_ON_REJECT_DEAD_LETTER;
    assert_int_equal(obx_relay_new(&s, &ops, &c->f, &c->f, &c->r), 0);
    ready(c, 0);
    fetched(c, 1, 4, 0); /* 1:k1 2:k2 3:k0 4:k1 */
    assert_int_equal(c->f.produced, 4);
    report(c, 0, OBX_DELIVERY_BATCH_REFUSED, 1);
    report(c, 1, OBX_DELIVERY_BATCH_REFUSED, 2);
    report(c, 3, OBX_DELIVERY_BATCH_REFUSED, 3);
    assert_int_equal(obx_relay_held_back_keys(c->r), 3);
    report(c, 2, OBX_DELIVERED, 4);                              /* row 3 shared another batch */
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_FETCHING); /* sent after the full batch */
    fetched(c, 5, 0, 4);
    assert_int_equal(c->f.n_dead, 0); /* nobody dead-lettered for a batch */
    assert_int_equal(c->f.n_marked, 1);
    int fetches = c->f.fetches;
    obx_relay_on_marked(c->r, 5);
    assert_int_equal(c->f.fetches, fetches + 1);
    assert_true(c->f.n_held_back >= 1); /* their keys wait in the SQL too */

    /* Row 4 waits behind row 1 of its key (the SQL leaves it out). */
    fetched_ids(c, (const int64_t[]){1, 2, 5}, 3, 6);
    assert_int_equal(c->f.produced, 5);
    assert_int_equal(c->f.produced_ids[4], 1); /* alone */
    fetches = c->f.fetches;
    obx_relay_tick(c->r, 2000);
    look(c, 2001);
    assert_int_equal(c->f.fetches, fetches); /* nothing else while it is out */

    report(c, 4, OBX_DELIVERY_BATCH_REFUSED, 2002); /* refused alone: the row itself */
    assert_int_equal(c->f.n_dead, 1);
    assert_int_equal(c->f.dead[0], 1);
    obx_relay_on_marked(c->r, 2003);

    fetched_ids(c, (const int64_t[]){2, 4, 5}, 3, 2004);
    assert_int_equal(c->f.produced, 6);
    assert_int_equal(c->f.produced_ids[5], 2);
    report(c, 5, OBX_DELIVERED, 2005);
    obx_relay_on_marked(c->r, 2006);

    fetched_ids(c, (const int64_t[]){4, 5}, 2, 2007);
    assert_int_equal(c->f.produced, 7);
    assert_int_equal(c->f.produced_ids[6], 4);
    report(c, 6, OBX_DELIVERED, 2008);
    obx_relay_on_marked(c->r, 2009);
    assert_int_equal(obx_relay_held_back_keys(c->r), 0);

    fetched_ids(c, (const int64_t[]){5, 6}, 2, 2010); /* back to batches */
    assert_int_equal(c->f.produced, 9);
    assert_int_equal(c->f.produced_ids[7], 5);
    assert_int_equal(c->f.produced_ids[8], 6);
    assert_int_equal(obx_relay_dead_total(c->r), 1);
}

/* A row to try alone waits until no other row's report is pending (they
 * would share its request); one that is no longer unsent is forgotten. */
static void test_batch_refused_row_waits_and_may_be_gone(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 2, 0);
    report(c, 0, OBX_DELIVERY_BATCH_REFUSED, 1); /* row 1; row 2 still out */
    int fetches = c->f.fetches;
    obx_relay_tick(c->r, 1500);
    assert_int_equal(c->f.fetches, fetches); /* waits for row 2's report */
    report(c, 1, OBX_DELIVERED, 1501);
    obx_relay_on_marked(c->r, 1502);
    assert_int_equal(c->f.fetches, fetches + 1);
    /* Marked meanwhile (say, by a recovery pass): the fetch passes its place. */
    fetched_ids(c, (const int64_t[]){3, 4}, 2, 1503);
    assert_int_equal(obx_relay_held_back_keys(c->r), 0);
    assert_int_equal(c->f.produced, 4); /* rows 3 and 4 go together */
}

static void test_shutdown_drains(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 2, 0);
    obx_relay_shutdown(c->r, 10);
    look(c, 11);
    obx_relay_tick(c->r, 2000);
    assert_int_equal(c->f.fetches, 1); /* no fetch while draining */
    assert_int_equal(c->f.stopped, 0);
    ack(c, 0, true, 2001);
    ack(c, 1, true, 2002);
    obx_relay_on_marked(c->r, 2003);
    obx_relay_on_marked(c->r, 2004);
    assert_int_equal(c->f.stopped, 1);
    assert_int_equal(c->f.exit_code, 0);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_STOPPED);
}

static void test_shutdown_deadline(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 2, 0);
    obx_relay_shutdown(c->r, 100);
    ack(c, 0, true, 200);
    obx_relay_on_marked(c->r, 201);
    /* 3 s timeout: deliveries are awaited until 2350 (the last quarter,
     * at most 1 s, is kept for the final mark). */
    obx_relay_tick(c->r, 2300);
    assert_int_equal(c->f.stopped, 0);
    obx_relay_tick(c->r, 2400); /* row 2 never acknowledged: give up */
    assert_int_equal(c->f.stopped, 1);
    assert_int_equal(c->f.exit_code, 0);
    assert_int_equal(obx_relay_marked_total(c->r), 1);
}

/* A statement Postgres never answers does not hold SIGTERM past the
 * timeout: at the hard deadline the relay stops while MARKING. */
static void test_shutdown_hard_deadline_while_marking(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 2, 0);
    ack(c, 0, true, 10);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_MARKING);
    obx_relay_shutdown(c->r, 100);
    obx_relay_tick(c->r, 3000);
    assert_int_equal(c->f.stopped, 0);
    obx_relay_tick(c->r, 3100);
    assert_int_equal(c->f.stopped, 1);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_STOPPED);
}

/* Nothing in flight: SIGTERM stops at once, even during the recovery pass
 * or a fetch. */
static void test_shutdown_idle_is_immediate(void **state)
{
    struct ctx *c = *state;
    obx_relay_on_pg_ready(c->r, 0);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_RECOVERING);
    obx_relay_shutdown(c->r, 5);
    assert_int_equal(c->f.stopped, 1);
}

/* No progress for stall_timeout with dependencies up: stalled, with the
 * reason; waiting for a dependency that is down is not a stall; progress
 * clears it. */
static void test_stall(void **state)
{
    struct ctx *c = *state;
    char why[160];
    ready(c, 0);
    fetched(c, 1, 2, 0); /* two rows in flight, never acknowledged */
    obx_relay_check_stall(c->r, true, 5000);
    assert_int_equal(obx_relay_stalled(c->r, why, sizeof(why)), 0); /* timeout 10 s */
    obx_relay_check_stall(c->r, false, 30000); /* Kafka unreachable: not a stall */
    assert_int_equal(obx_relay_stalled(c->r, why, sizeof(why)), 0);
    obx_relay_check_stall(c->r, true, 35000);
    assert_int_equal(obx_relay_stalled(c->r, why, sizeof(why)), 0);
    obx_relay_check_stall(c->r, true, 41000);
    assert_true(obx_relay_stalled(c->r, why, sizeof(why)) >= 10000);
    assert_non_null(strstr(why, "delivery reports of 2 rows"));
    ack(c, 0, true, 42000);
    obx_relay_on_marked(c->r, 42001);
    obx_relay_check_stall(c->r, true, 42002);
    assert_int_equal(obx_relay_stalled(c->r, why, sizeof(why)), 0);
    assert_int_equal(obx_relay_last_progress(c->r), 42001);
}

static void test_fetch_in_flight_at_shutdown_is_not_produced(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    obx_relay_shutdown(c->r, 1);
    fetched(c, 1, 3, 2);
    assert_int_equal(c->f.produced, 0);
    assert_int_equal(c->f.stopped, 1);
}

static void test_fatal_marks_acked_then_stops(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 3, 0);
    ack(c, 0, true, 1); /* mark of id 1 in flight */
    ack(c, 1, true, 1); /* acknowledged, waiting */
    obx_relay_fatal(c->r, "out of order sequence", 2);
    assert_int_equal(c->f.stopped, 0);
    obx_relay_on_marked(c->r, 3); /* then id 2 is marked */
    assert_int_equal(c->f.n_marked, 1);
    assert_int_equal(c->f.marked[0], 2);
    obx_relay_on_marked(c->r, 4);
    assert_int_equal(c->f.stopped, 1);
    assert_int_equal(c->f.exit_code, 1);
    assert_int_equal(obx_relay_marked_total(c->r), 2); /* id 3 never acknowledged */
}

static void test_fatal_without_postgres(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 1, 0);
    ack(c, 0, true, 1);
    obx_relay_on_pg_lost(c->r, 2);
    obx_relay_fatal(c->r, "fatal", 3);
    assert_int_equal(c->f.stopped, 1);
    assert_int_equal(c->f.exit_code, 1);
}

/* Delivers ids as a fetch result carrying snapshot `snap`; row `big_id`
 * (0 = none) comes without its payload of `big_len` bytes. */
static void fetched_snap(struct ctx *c, const int64_t *ids, size_t n, int64_t big_id,
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
            rows[i].payload_len = big_len;
        }
    }
    obx_relay_on_fetched(c->r, rows, n, c->snapshot, now);
}

/* After a full fetch the relay asks only above the highest id it handed
 * out, plus late commits of the snapshot it saw, and excludes nothing. */
static void test_keyset_fetch(void **state)
{
    struct ctx *c = *state;
    c->snapshot = "100:105:102";
    ready(c, 0);
    assert_int_equal(c->f.after_id, 0); /* the first fetch is a full one */
    fetched_snap(c, (const int64_t[]){1, 2, 3, 4}, 4, 0, 0, 0);
    assert_int_equal(c->f.fetches, 2); /* full batch: again at once */
    assert_int_equal(c->f.after_id, 4);
    assert_string_equal(c->f.snapshot, "100:105:102");
    assert_int_equal(c->f.n_exclude, 0);
    assert_int_equal(c->f.limit, 2);
    /* A late commit (id 0 < 4 is impossible; use the gap at 5) and a new row. */
    c->snapshot = "103:107:";
    fetched_snap(c, (const int64_t[]){6, 9}, 2, 0, 0, 1);
    assert_int_equal(c->f.produced, 6);
    ack_range_marked(c, 0, 5, 2); /* all but row 9 */
    assert_int_equal(c->f.fetches, 3);
    assert_int_equal(c->f.after_id, 9);
    assert_string_equal(c->f.snapshot, "103:107:");
    assert_int_equal(c->f.limit, 4);
    assert_int_equal(c->f.max_row_bytes, 1000); /* 4000 bytes over 4 rows */

    /* Late rows (5, 7, 8 below 9) fill the batch: some may lie beyond, and
     * only a full fetch finds them. */
    fetched_snap(c, (const int64_t[]){5, 7, 8, 10}, 4, 0, 0, 5);
    assert_int_equal(c->f.fetches, 4);
    assert_int_equal(c->f.after_id, 10); /* the last taken is above: all late ones came */
    fetched_snap(c, (const int64_t[]){}, 0, 0, 0, 6);
    ack_range_marked(c, 6, 10, 7);
    assert_int_equal(c->f.after_id, 10);
    fetched_snap(c, (const int64_t[]){1, 2, 3, 4}, 4, 0, 0, 10); /* all four late */
    assert_int_equal(c->f.after_id, 0);                          /* full again */
    assert_int_equal(c->f.n_exclude, 5);                         /* and row 9 */
}

/* Caught up and with nothing in flight, the next fetch is a keyset one
 * too: a full one would walk the unsent-row index from its lowest entry,
 * past every row marked since the last vacuum. */
static void test_keyset_when_nothing_in_flight(void **state)
{
    struct ctx *c = *state;
    c->snapshot = "100:100:";
    ready(c, 0);
    fetched_snap(c, (const int64_t[]){1, 2, 3, 4}, 4, 0, 0, 0);
    assert_int_equal(c->f.after_id, 4);               /* rows in flight: keyset */
    fetched_snap(c, (const int64_t[]){}, 0, 0, 0, 1); /* caught up */
    ack_range_marked(c, 0, 4, 2);
    assert_int_equal(obx_relay_in_flight(c->r), 0);
    assert_int_equal(c->f.fetches, 3);
    assert_int_equal(c->f.after_id, 4);
    assert_int_equal(c->f.n_exclude, 0);
    fetched_snap(c, (const int64_t[]){5, 6, 7, 8}, 4, 0, 0, 5); /* a backlog */
    assert_int_equal(c->f.after_id, 8);
    fetched_snap(c, (const int64_t[]){9, 10}, 2, 0, 0, 6); /* full again; every slot taken */
    int fetches = c->f.fetches;
    ack_range_marked(c, 4, 10, 7);
    assert_int_equal(c->f.fetches, fetches + 1);
    assert_int_equal(c->f.after_id, 10);
}

/* Rows 1 to 3 handed out by a short full fetch (the cursor at 3), and the
 * keyset fetch above it sent. */
static void three_out_keyset_sent(struct ctx *c)
{
    c->snapshot = "100:100:";
    ready(c, 0);
    fetched_snap(c, (const int64_t[]){1, 2, 3}, 3, 0, 0, 0);
    look(c, 1);
    assert_int_equal(c->f.after_id, 3);
}

/* Whatever puts a row back below the cursor makes the next fetch a full one. */
static void test_keyset_cleared_by_a_row_back(void **state)
{
    struct ctx *c = *state;
    three_out_keyset_sent(c);
    fetched_snap(c, (const int64_t[]){}, 0, 0, 0, 1);
    ack(c, 1, false, 2); /* row 2 comes back unsent */
    obx_relay_tick(c->r, 600);
    assert_int_equal(c->f.after_id, 0);
    assert_true(excluded(c, 1));
    assert_false(excluded(c, 2));
    fetched_snap(c, (const int64_t[]){2, 4}, 2, 0, 0, 600);
    look(c, 601);
    assert_int_equal(c->f.after_id, 4); /* set again by the full fetch */

    /* A new session: full. */
    fetched_snap(c, (const int64_t[]){}, 0, 0, 0, 602);
    obx_relay_on_pg_lost(c->r, 603);
    for (int k = 0; k < c->f.produced; k++)
        if (k != 1) /* the reports still out (rows 1, 3, 2 again, 4): the pass waits for them */
            ack(c, k, true, 603);
    ready(c, 604);
    assert_int_equal(c->f.after_id, 0);
    /* No snapshot in the answer: full again. */
    c->snapshot = NULL;
    fetched_snap(c, (const int64_t[]){}, 0, 0, 0, 605);
    look(c, 609); /* the next look (due a millisecond after the empty answer) */
    assert_int_equal(c->f.after_id, 0);
}

/* Ids of 0 and below (an identity restarted there) keep the cursor: a
 * keyset fetch above -3 is one, not a full fetch that excludes nothing,
 * and an empty answer does not move the cursor to 0. */
static void test_ids_zero_and_below(void **state)
{
    struct ctx *c = *state;
    c->snapshot = "100:100:";
    ready(c, 0);
    fetched_snap(c, (const int64_t[]){-5, -4, -3}, 3, INT64_MIN, 0, 0);
    look(c, 1);
    assert_true(c->f.keyset);
    assert_int_equal(c->f.after_id, -3);
    assert_int_equal(c->f.n_exclude, 0);
    fetched_snap(c, (const int64_t[]){}, 0, INT64_MIN, 0, 1);
    look(c, 3);
    assert_true(c->f.keyset);
    assert_int_equal(c->f.after_id, -3);
    fetched_snap(c, (const int64_t[]){-2, -1}, 2, INT64_MIN, 0, 3);
    look(c, 4);
    assert_int_equal(c->f.after_id, -1);
    assert_int_equal(c->f.produced, 5);
}

/* A row back unsent while a keyset fetch is out: that fetch was sent while
 * the row was in flight, so its answer cannot set the cursor again (the row
 * lies below hwm, and no keyset fetch would find it). */
static void test_cursor_not_set_by_an_earlier_fetch(void **state)
{
    struct ctx *c = *state;
    three_out_keyset_sent(c);
    ack(c, 1, false, 2); /* row 2 comes back unsent while the fetch is out */
    fetched_snap(c, (const int64_t[]){4}, 1, 0, 0, 3);
    obx_relay_tick(c->r, 600); /* after the back-off */
    assert_int_equal(c->f.after_id, 0);
    assert_false(excluded(c, 2));
    assert_true(excluded(c, 1) && excluded(c, 3) && excluded(c, 4));
}

/* A full fetch cut short below what is in flight sets no cursor: the rows
 * between were not looked at. */
static void test_keyset_not_from_a_short_look(void **state)
{
    struct ctx *c = *state;
    c->snapshot = "100:100:";
    ready(c, 0);
    fetched_snap(c, (const int64_t[]){10, 11, 12}, 3, 0, 0, 0);
    look(c, 1);
    fetched_snap(c, (const int64_t[]){}, 0, 0, 0, 1);
    ack(c, 0, false, 2); /* row 10 back: a full fetch */
    obx_relay_tick(c->r, 600);
    assert_int_equal(c->f.after_id, 0);
    assert_int_equal(c->f.limit, 4);
    /* Cut at 4 rows, the last (10) below 12 in flight. */
    int fetches = c->f.fetches;
    fetched_snap(c, (const int64_t[]){5, 6, 7, 10}, 4, 0, 0, 600);
    assert_int_equal(c->f.fetches, fetches); /* all 6 slots taken */
    ack_range_marked(c, 3, 7, 601);
    assert_int_equal(c->f.fetches, fetches + 1);
    assert_int_equal(c->f.after_id, 0); /* full again: 8 and 9 were not looked at */
    assert_true(excluded(c, 11));
    assert_true(excluded(c, 12));
}

/* A payload over its share of relay.fetch_max_bytes ends the batch before
 * it; the next fetch asks for as many rows of its size as fit. */
static void test_byte_budget_withholds(void **state)
{
    struct ctx *c = *state;
    c->snapshot = "100:100:";
    ready(c, 0);
    assert_int_equal(c->f.max_row_bytes, 1000);
    fetched_snap(c, (const int64_t[]){1, 2, 3, 4}, 4, 3, 1500, 0);
    assert_int_equal(c->f.produced, 2); /* 1 and 2; 3 and 4 wait */
    assert_int_equal(c->f.fetches, 2);
    assert_int_equal(c->f.limit, 2); /* 4000 / 1500 */
    assert_int_equal(c->f.max_row_bytes, 2000);
    assert_int_equal(c->f.after_id, 2);
    fetched_snap(c, (const int64_t[]){3, 4}, 2, 0, 0, 1);
    assert_int_equal(c->f.produced, 4);
    assert_int_equal(c->f.produced_ids[2], 3);
    /* A row above the producer's limit is refused, not withheld. */
    ack_range_marked(c, 0, 4, 2);
    assert_int_equal(c->f.limit, 4); /* small rows again: the whole batch */
    /* A payload above the producer's limit is never fetched: it does not
     * shrink the next fetch. (Refused, it is not produced.) */
    struct obx_row rows[2] = {{.id = 7, .topic = "t", .oversize = true, .payload_len = 500000},
                              {.id = 8, .topic = "t"}};
    c->f.refused_id = 7; /* as kafka.c refuses an oversize row */
    obx_relay_on_fetched(c->r, rows, 2, c->snapshot, 4);
    assert_int_equal(c->f.produced, 5); /* row 8 */
    look(c, 5);
    assert_int_equal(c->f.limit, 4);
    /* A payload above the whole budget: asked for alone, it comes whole. */
    fetched_snap(c, (const int64_t[]){9, 10}, 2, 9, 5000, 5);
    assert_int_equal(c->f.limit, 1);
    assert_int_equal(c->f.max_row_bytes, 100000); /* the producer's limit */
    fetched_snap(c, (const int64_t[]){9}, 1, 0, 0, 6);
    assert_int_equal(c->f.produced_ids[5], 9);
}

/* The next keyset fetch rides on the mark; if that
 * statement fails, the mark is sent again and the fetch is a full one. */
static void test_fetch_rides_on_mark(void **state)
{
    struct ctx *c = *state;
    c->snapshot = "100:100:";
    c->f.combine = true;
    ready(c, 0);
    fetched_snap(c, (const int64_t[]){1}, 1, 0, 0, 0); /* short: the cursor is at 1 */
    look(c, 1);
    assert_int_equal(c->f.fetches, 2);
    ack(c, 0, true, 2); /* acknowledged while the fetch runs: waits for it */
    assert_int_equal(c->f.marks, 0);
    fetched_snap(c, (const int64_t[]){2, 3, 4, 5}, 4, 0, 0, 3); /* full: more may wait */
    assert_int_equal(c->f.mark_fetches, 1);
    assert_int_equal(c->f.marks, 1);
    assert_int_equal(c->f.n_marked, 1);
    assert_int_equal(c->f.marked[0], 1);
    assert_int_equal(c->f.fetches, 3);
    assert_int_equal(c->f.after_id, 5);
    assert_int_equal(c->f.limit, 1); /* 6 slots, 5 in use until the mark commits */
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_MARKING);
    obx_relay_on_marked(c->r, 4); /* not the answer of this statement: ignored */
    assert_int_equal(obx_relay_marked_total(c->r), 0);
    obx_relay_on_mark_fetched(c->r, (const struct obx_row[]){{.id = 6, .topic = "t"}}, 1,
                              c->snapshot, 5);
    assert_int_equal(obx_relay_marked_total(c->r), 1);
    assert_int_equal(c->f.produced, 6);
    assert_int_equal(c->f.produced_ids[5], 6);

    /* The mark carries a look for new rows whether one is due or not. If
     * that statement fails, the mark goes again, alone, and the next fetch
     * is a full one. */
    ack(c, 1, true, 6); /* row 2 */
    assert_int_equal(c->f.marks, 2);
    assert_int_equal(c->f.mark_fetches, 2);
    assert_int_equal(c->f.marked[0], 2);
    assert_int_equal(c->f.after_id, 6);
    obx_relay_on_query_failed(c->r, "statement timeout", 9);
    obx_relay_tick(c->r, 600);
    assert_int_equal(c->f.marks, 3); /* the mark again, without the fetch */
    assert_int_equal(c->f.mark_fetches, 2);
    assert_int_equal(c->f.marked[0], 2);
    obx_relay_on_marked(c->r, 601);
    assert_int_equal(c->f.after_id, 0); /* then a full fetch */
    assert_true(excluded(c, 4));
    assert_false(excluded(c, 2));
}

/* A refusal reported in the millisecond a fetch went out: that fetch
 * excluded the row (it was in flight), so its answer without the row says
 * nothing about it; the next full fetch brings it to be tried alone.
 * (chaos seed 13013: the row was taken for gone, and never published.) */
static void test_batch_refused_as_a_fetch_goes(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 4, 5); /* full batch: the next fetch goes at once, at 5 */
    assert_int_equal(c->f.fetches, 2);
    report(c, 0, OBX_DELIVERY_BATCH_REFUSED, 5);         /* row 1, in the same millisecond */
    fetched_ids(c, (const int64_t[]){5, 6}, 2, 6);       /* the answer: row 1 excluded */
    assert_int_equal(obx_relay_held_back_keys(c->r), 1); /* row 1 still waits to go alone */
    for (int k = 1; k < 6; k++)                          /* rows 2 to 6 */
        report(c, k, OBX_DELIVERED, 7);
    while (obx_relay_state(c->r) == OBX_RELAY_MARKING)
        obx_relay_on_marked(c->r, 8);
    obx_relay_tick(c->r, 9);
    assert_false(excluded(c, 1)); /* a full fetch, and row 1 may come */
    fetched_ids(c, (const int64_t[]){1, 7}, 2, 10);
    assert_int_equal(c->f.produced_ids[c->f.produced - 1], 1); /* alone */
}

/* With a finite message timeout (set.one_per_key), a key has one record at
 * Kafka at a time: librdkafka could time an earlier one out while a later
 * one of its partition is sent. A later row of a busy key is parked (a
 * fetch on its way too) and goes as soon as the one before is delivered;
 * other keys go on. If the one before fails, the parked ones go back unsent
 * and come after it, from a full fetch. */
static void test_one_record_per_key(void **state)
{
    struct ctx *c = *state;
    struct obx_relay_settings one = settings;
    one.one_per_key = true;
    obx_relay_free(c->r);
    assert_int_equal(obx_relay_new(&one, &ops, &c->f, &c->f, &c->r), 0);
    ready(c, 0);
    fetched_ids(c, (const int64_t[]){1, 2, 4, 5}, 4, 1); /* 1:k1 2:k2 4:k1 5:k2; full */
    assert_int_equal(c->f.fetches, 2);                   /* the next one went at once */
    assert_int_equal(c->f.produced, 2);                  /* rows 1 and 2; 4 and 5 parked */
    fetched_ids(c, (const int64_t[]){7}, 1, 2);          /* 7:k1, parked behind 4 */
    assert_int_equal(c->f.produced, 2);
    report(c, 0, OBX_DELIVERED, 3); /* row 1: row 4 goes at once */
    assert_int_equal(c->f.produced, 3);
    assert_int_equal(c->f.produced_ids[2], 4);
    report(c, 1, OBX_DELIVERED, 4); /* row 2: row 5 */
    assert_int_equal(c->f.produced_ids[3], 5);
    report(c, 2, OBX_DELIVERY_RETRY, 5); /* row 4 not delivered: 7 goes back unsent */
    assert_int_equal(c->f.produced, 4);
    assert_int_equal(obx_relay_held_back_keys(c->r), 1);
    report(c, 3, OBX_DELIVERED, 6); /* row 5 */
    until_fetching(c, 600);         /* after the back-off: a full fetch */
    assert_int_equal(c->f.after_id, 0);
    assert_false(excluded(c, 4));
    assert_false(excluded(c, 7));
    fetched_ids(c, (const int64_t[]){4, 7}, 2, 601);
    assert_int_equal(c->f.produced, 5); /* 4 again; 7 held back behind it (held_back) */
    assert_int_equal(c->f.produced_ids[4], 4);
    report(c, 4, OBX_DELIVERED, 602);
    until_fetching(c, 603);
    fetched_ids(c, (const int64_t[]){7}, 1, 604);
    assert_int_equal(c->f.produced, 6);
    assert_int_equal(c->f.produced_ids[5], 7);
    /* A row parked when the relay shuts down stays unsent. */
    until_fetching(c, 605);
    fetched_ids(c, (const int64_t[]){10}, 1, 605); /* 10:k1, parked behind 7 */
    assert_int_equal(c->f.produced, 6);
    assert_int_equal(obx_relay_in_flight(c->r), 2); /* 7 at Kafka, 10 parked */
    obx_relay_shutdown(c->r, 606);
    assert_int_equal(obx_relay_in_flight(c->r), 1); /* 10 back unsent */
    report(c, 5, OBX_DELIVERED, 607);
    assert_int_equal(c->f.produced, 6); /* 10 not produced */
}

/* ---- log mode ---- */

/* A relay in log mode, Postgres ready, the recovery pass read `st`. */
static void log_ready(struct ctx *c, const struct obx_log_state *st, int64_t now)
{
    struct obx_relay_settings log = settings;
    log.log_mode = true;
    obx_relay_free(c->r);
    assert_int_equal(obx_relay_new(&log, &ops, &c->f, &c->f, &c->r), 0);
    obx_relay_on_pg_ready(c->r, now);
    assert_int_equal(obx_relay_on_log_state(c->r, st), 0);
    obx_relay_on_recovered(c->r, true, now);
}

/* A cursor row covers the fetches whose rows are all acknowledged: rows of a
 * later fetch acknowledged first wait (their slots kept) until the earlier
 * fetch's rows are in too; then one row, with the later fetch's cursor. */
static void test_log_cursor_waits_for_earlier_fetch(void **state)
{
    struct ctx *c = *state;
    struct obx_log_state none = {0};
    log_ready(c, &none, 0);
    assert_false(c->f.fetch_log); /* no cursor yet: every unsent row */
    c->snapshot = "10:10:";
    fetched(c, 1, 4, 1); /* a full batch: the next fetch goes at once */
    assert_int_equal(c->f.produced, 4);
    c->snapshot = "12:12:";
    fetched(c, 5, 2, 2);
    assert_int_equal(c->f.produced, 6);
    ack(c, 4, true, 3); /* rows 5 and 6 of the second fetch */
    ack(c, 5, true, 3);
    obx_relay_tick(c->r, 500);
    assert_int_equal(c->f.marks, 0); /* row 1..4 still with Kafka */
    assert_int_equal(obx_relay_in_flight(c->r), 6);
    for (int k = 0; k < 3; k++)
        ack(c, k, true, 501);
    assert_int_equal(c->f.marks, 0);
    ack(c, 3, true, 502); /* the last: a batch is waiting, so at once */
    assert_int_equal(c->f.marks, 1);
    assert_true(c->f.mark_log);
    assert_int_equal(c->f.cursor_batch, 1);
    assert_int_equal(c->f.cursor_hwm, 6);
    assert_string_equal(c->f.cursor_snap, "12:12:");
    assert_int_equal(c->f.n_offsets, 1); /* partition 0 up to offset 105 */
    assert_int_equal(c->f.off_offsets[0], 105);
    obx_relay_on_marked(c->r, 503);
    assert_int_equal(obx_relay_in_flight(c->r), 0);
    assert_int_equal(obx_relay_marked_total(c->r), 6);
}

/* A row that goes back unsent (the Kafka queue was full) takes the claims
 * of its fetch and of the fetches after it: no cursor row covers it until
 * it was handed out again and acknowledged. */
static void test_log_release_drops_claims(void **state)
{
    struct ctx *c = *state;
    struct obx_log_state none = {0};
    log_ready(c, &none, 0);
    c->snapshot = "10:10:";
    c->f.busy_at = 2;    /* row 3 meets a full queue: 3 and 4 back unsent */
    fetched(c, 1, 4, 1); /* rows 1, 2 out */
    assert_int_equal(c->f.produced, 2);
    ack(c, 0, true, 2);
    ack(c, 1, true, 2);
    fetched(c, 5, 0, 3); /* the fetch sent before the queue filled up: ignored */
    obx_relay_tick(c->r, 1000);
    assert_int_equal(c->f.marks, 0); /* the fetch's claim went with rows 3 and 4 */
    until_fetching(c, 1001);
    assert_false(c->f.keyset); /* a full fetch, leaving out what is in flight */
    assert_true(excluded(c, 1) && excluded(c, 2));
    fetched(c, 3, 2, 1002);
    assert_int_equal(c->f.produced, 4);
    ack(c, 2, true, 1003);
    ack(c, 3, true, 1003); /* a batch of 4 acknowledged: written at once */
    assert_int_equal(c->f.marks, 1);
    assert_int_equal(c->f.cursor_hwm, 4);
    obx_relay_on_marked(c->r, 1004);
    assert_int_equal(obx_relay_in_flight(c->r), 0);
}

/* After a restart: the first fetch is log mode's full one from the stored
 * cursor, with its held keys; a record the recovery pass found is taken as
 * acknowledged, not produced; a refused row is held in the next cursor row
 * while later rows of other keys go on. */
static void test_log_restart_from_stored_cursor(void **state)
{
    struct ctx *c = *state;
    const struct obx_log_held held = {"t", "k2", 2, 2};
    const struct obx_log_found found = {4, "t", 0, 77};
    const char *off_topics[] = {"t"};
    const struct obx_log_state st = {.has_cursor = true,
                                     .batch = 41,
                                     .hwm = 3,
                                     .snapshot = "9:9:",
                                     .held = &held,
                                     .n_held = 1,
                                     .off_topics = off_topics,
                                     .off_partitions = (const int32_t[]){0},
                                     .off_offsets = (const int64_t[]){70},
                                     .n_off = 1,
                                     .found = &found,
                                     .n_found = 1};
    log_ready(c, &st, 0);
    assert_true(c->f.fetch_log);
    assert_int_equal(c->f.fetch_from, 3);
    assert_int_equal(c->f.fetch_n_held, 1);
    c->snapshot = "20:20:";
    fetched_ids(c, (const int64_t[]){2, 4, 5}, 3, 1); /* 2: the held row; 4: found */
    assert_int_equal(c->f.produced, 2);               /* 2 and 5 */
    assert_int_equal(c->f.produced_ids[0], 2);
    assert_int_equal(c->f.produced_ids[1], 5);
    report(c, 0, OBX_DELIVERY_REFUSED, 2); /* row 2 refused again: held, retried */
    report(c, 1, OBX_DELIVERED, 2);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_FETCHING); /* a full one, after the hold */
    fetched_ids(c, NULL, 0, 3);
    obx_relay_tick(c->r, 200); /* the write's delay */
    assert_int_equal(c->f.marks, 1);
    assert_int_equal(c->f.cursor_batch, 42);
    assert_int_equal(c->f.cursor_hwm, 5);
    assert_true(c->f.cursor_held >= 1);    /* row 2 and its key left out ... */
    assert_int_equal(c->f.cursor_also, 1); /* ... but row 5 of its key, published */
    /* 4 (found, offset 77) and 5 (offset 101) covered; partition 0 moves on. */
    assert_int_equal(c->f.n_offsets, 1);
    assert_int_equal(c->f.off_offsets[0], 101);
}

/* A row whose delivery failed is held back, and stays so when the session
 * is lost before it is retried: the next session's cursor rows hold it too
 * (chaos found a cursor covering such a row, never published, when only the
 * rules read back from the stored cursor were held). */
static void test_log_held_row_outlives_the_session(void **state)
{
    struct ctx *c = *state;
    struct obx_log_state none = {0};
    log_ready(c, &none, 0);
    c->snapshot = "10:10:";
    fetched(c, 1, 3, 1);
    ack(c, 0, true, 2);
    ack(c, 1, false, 2); /* row 2 not delivered: held, retried later */
    ack(c, 2, true, 2);
    obx_relay_on_pg_lost(c->r, 3);
    const struct obx_log_state again = {
        .has_cursor = true, .batch = 1, .hwm = 0, .snapshot = "9:9:"};
    obx_relay_on_pg_ready(c->r, 4);
    assert_int_equal(obx_relay_on_log_state(c->r, &again), 0);
    obx_relay_on_recovered(c->r, true, 4);
    assert_true(c->f.fetch_log);
    assert_true(excluded(c, 2)); /* not due yet */
    c->snapshot = "12:12:";
    fetched_ids(c, (const int64_t[]){1, 3, 4}, 3, 5); /* 1 and 3 were published: recovered */
    for (int k = 3; k < 6; k++)
        ack(c, k, true, 6);
    obx_relay_tick(c->r, 200);
    while (obx_relay_state(c->r) == OBX_RELAY_FETCHING)
        fetched_ids(c, NULL, 0, 200);
    obx_relay_tick(c->r, 400);
    assert_true(c->f.marks >= 1);
    assert_true(c->f.mark_log);
    assert_int_equal(c->f.cursor_held, 1); /* row 2: still left out */
}

/* Log mode: a row of a refused batch is out alone when the session ends;
 * its report comes for an orphaned slot. That ends the try: the relay
 * fetches again after the next recovery pass (chaos seed 747685443 found
 * it waiting for that try for ever, every row unsent). */
static void test_log_alone_try_ends_with_the_session(void **state)
{
    struct ctx *c = *state;
    struct obx_log_state none = {0};
    log_ready(c, &none, 0);
    c->snapshot = "10:10:";
    fetched_ids(c, (const int64_t[]){1}, 1, 1);
    report(c, 0, OBX_DELIVERY_BATCH_REFUSED, 2); /* held back, to be tried alone */
    until_fetching(c, 3);
    fetched_ids(c, (const int64_t[]){1}, 1, 4003);
    assert_int_equal(c->f.produced, 2); /* row 1, alone */
    obx_relay_on_pg_lost(c->r, 4004);
    report(c, 1, OBX_DELIVERY_RETRY, 4005); /* purged with the queue: an orphan's report */
    obx_relay_on_pg_ready(c->r, 4006);
    assert_int_equal(obx_relay_on_log_state(c->r, &none), 0);
    int fetches = c->f.fetches;
    obx_relay_on_recovered(c->r, true, 4006);
    until_fetching(c, 4007);
    assert_true(c->f.fetches > fetches);
    /* Row 1 is due again, not left out of every fetch as one still out. */
    assert_false(c->f.keyset);
    for (size_t i = 0; i < c->f.n_exclude; i++)
        assert_int_not_equal(c->f.exclude[i], 1);
    fetched_ids(c, (const int64_t[]){1}, 1, 4008);
    assert_int_equal(c->f.produced, 3);
    assert_int_equal(c->f.produced_ids[2], 1);
}

/* Rows of a refused batch fetched again, produced and then orphaned with
 * their session (purged with the queue, log mode) are due again after the
 * recovery pass: they and their keys' later rows are not left out of every
 * fetch for ever (chaos seed 747685443). */
static void test_log_retried_rows_orphaned_come_back(void **state)
{
    struct ctx *c = *state;
    struct obx_log_state none = {0};
    log_ready(c, &none, 0);
    c->snapshot = "10:10:";
    fetched_ids(c, (const int64_t[]){1, 2}, 2, 1);
    report(c, 0, OBX_DELIVERY_RETRY, 2); /* purged: held back, retried later */
    report(c, 1, OBX_DELIVERY_RETRY, 2);
    until_fetching(c, 1003);
    fetched_ids(c, (const int64_t[]){1, 2}, 2, 1003);
    assert_int_equal(c->f.produced, 4); /* both again */
    obx_relay_on_pg_lost(c->r, 1004);
    report(c, 2, OBX_DELIVERY_RETRY, 1005); /* orphans' reports */
    report(c, 3, OBX_DELIVERY_RETRY, 1005);
    obx_relay_on_pg_ready(c->r, 1006);
    assert_int_equal(obx_relay_on_log_state(c->r, &none), 0);
    obx_relay_on_recovered(c->r, true, 1006);
    until_fetching(c, 1007);
    assert_false(c->f.keyset);
    assert_int_equal(c->f.n_exclude, 0);
    fetched_ids(c, (const int64_t[]){1, 2}, 2, 1008);
    assert_int_equal(c->f.produced, 6);
}

/* ---- relay.shards ---- */

/* A relay with relay.shards = 4, Postgres ready. */
static void shards_ready(struct ctx *c, int64_t now)
{
    struct obx_relay_settings sharded = settings;
    sharded.shards = 4;
    obx_relay_free(c->r);
    assert_int_equal(obx_relay_new(&sharded, &ops, &c->f, &c->f, &c->r), 0);
    obx_relay_on_pg_ready(c->r, now);
}

static void claimed(struct ctx *c, const char *owned, int members, int share, int64_t now)
{
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_CLAIMING);
    struct obx_claim a = {.owned = owned, .members = members, .share = share, .other_shards = 0};
    obx_relay_on_claimed(c->r, &a, now);
}

/* The first claim of a session takes slots; the pass covers them, and only
 * then do fetches go, for those slots; marks store offsets for them. */
static void test_shards_claim_then_pass_then_fetch(void **state)
{
    struct ctx *c = *state;
    shards_ready(c, 0);
    assert_int_equal(c->f.claims, 1);
    assert_true(c->f.take);
    assert_string_equal(c->f.give_back, "{}");
    assert_int_equal(c->f.recovers, 0); /* the pass waits for the slots */
    assert_int_equal(c->f.fetches, 0);
    claimed(c, "0,2", 2, 2, 1);
    assert_int_equal(c->f.recovers, 1);
    assert_string_equal(c->f.recover_slots, "{0,2}");
    assert_string_equal(obx_relay_owned_slots(c->r), "0,2");
    obx_relay_on_recovered(c->r, true, 2);
    assert_int_equal(c->f.fetches, 1);
    assert_string_equal(c->f.fetch_slots, "{0,2}");
    fetched(c, 1, 2, 3);
    ack(c, 0, true, 4);
    ack(c, 1, true, 4);
    until_fetching(c, 5);
    assert_string_equal(c->f.mark_slots, "{0,2}");
    struct obx_relay_slots sl;
    obx_relay_slots(c->r, &sl);
    assert_int_equal(sl.owned, 2);
    assert_int_equal(sl.members, 2);
    assert_int_equal(sl.moves, 2);
}

/* A relay with more than its share stops fetching, waits until its rows in
 * flight are delivered and marked, and only then gives the surplus back. */
static void test_shards_give_back_after_quiet(void **state)
{
    struct ctx *c = *state;
    shards_ready(c, 0);
    claimed(c, "0,1,2,3", 1, 4, 1);
    obx_relay_on_recovered(c->r, true, 2);
    assert_string_equal(c->f.fetch_slots, ""); /* every slot: no test of a row's slot */
    fetched(c, 1, 2, 3);                       /* two rows in flight */
    int fetches = c->f.fetches;
    /* A second relay joined: the share is 2. */
    obx_relay_tick(c->r, 300);
    claimed(c, "0,1,2,3", 2, 2, 300);
    obx_relay_tick(c->r, 600);
    assert_int_equal(c->f.fetches, fetches);   /* fetching stops */
    assert_string_equal(c->f.give_back, "{}"); /* the next look gives nothing back yet: */
    assert_false(c->f.take);                   /* rows are out */
    claimed(c, "0,1,2,3", 2, 2, 600);
    ack(c, 0, true, 601);
    ack(c, 1, true, 601);
    obx_relay_tick(c->r, 700); /* their marks */
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_MARKING);
    for (int i = 0; i < 3 && obx_relay_state(c->r) == OBX_RELAY_MARKING; i++) {
        assert_string_equal(c->f.mark_slots, "{0,1,2,3}"); /* the leaving ones' too */
        obx_relay_on_marked(c->r, 701);
    }
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_CLAIMING);
    assert_string_equal(c->f.give_back, "{2,3}");
    assert_false(c->f.take);
    claimed(c, "0,1", 2, 2, 702);
    assert_string_equal(obx_relay_owned_slots(c->r), "0,1");
    until_fetching(c, 703);
    assert_string_equal(c->f.fetch_slots, "{0,1}");
    assert_int_equal(c->f.recovers, 1); /* nothing taken: no pass */
}

/* A slot taken later is recovered before any fetch reads it. */
static void test_shards_taken_slot_recovered_first(void **state)
{
    struct ctx *c = *state;
    shards_ready(c, 0);
    claimed(c, "0,1", 2, 2, 1);
    obx_relay_on_recovered(c->r, true, 2);
    fetched(c, 1, 0, 3);
    obx_relay_tick(c->r, 300);
    claimed(c, "0,1,3", 1, 4, 300); /* the other relay left: one more slot */
    assert_int_equal(c->f.recovers, 2);
    assert_string_equal(c->f.recover_slots, "{0,1,3}");
    int fetches = c->f.fetches;
    obx_relay_tick(c->r, 400);
    assert_int_equal(c->f.fetches, fetches);
    obx_relay_on_recovered(c->r, true, 401);
    assert_string_equal(c->f.fetch_slots, "{0,1,3}");
    assert_false(c->f.keyset); /* the cursor started again */
}

/* Acknowledged rows marked just after a slot was taken store no offsets
 * (they would be the taken slot's too, above its last owner's records that
 * the pass has yet to find); once the pass is done they do. */
static void test_shards_no_offsets_before_the_pass(void **state)
{
    struct ctx *c = *state;
    shards_ready(c, 0);
    claimed(c, "0,1", 2, 2, 1);
    obx_relay_on_recovered(c->r, true, 2);
    fetched(c, 1, 2, 3);
    obx_relay_tick(c->r, 300);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_CLAIMING);
    ack(c, 0, true, 301); /* while the claim is out */
    ack(c, 1, true, 301);
    claimed(c, "0,1,3", 1, 4, 302);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_MARKING);
    assert_string_equal(c->f.mark_slots, "{0,1,3}");
    assert_int_equal(c->f.n_offsets, 0);
    obx_relay_on_marked(c->r, 303);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_RECOVERING);
    obx_relay_on_recovered(c->r, true, 304);
    fetched(c, 3, 1, 305);
    ack(c, 2, true, 2000);
    while (obx_relay_state(c->r) == OBX_RELAY_CLAIMING)
        claimed(c, "0,1,3", 1, 4, 2000);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_MARKING);
    assert_int_equal(c->f.n_offsets, 1); /* partition 0, up to the highest acknowledged */
    assert_int_equal(c->f.off_offsets[0], 102);
}

/* Rows with their slots, ids and slots given, as log mode's exact fetch
 * with slots returns them. */
static void fetched_in_slots(struct ctx *c, const int64_t *ids, const int32_t *slots, size_t n,
                             int64_t now)
{
    struct obx_row rows[16];
    memset(rows, 0, sizeof(rows));
    for (size_t i = 0; i < n; i++)
        rows[i] = (struct obx_row){.id = ids[i], .topic = "t", .has_slot = true, .slot = slots[i]};
    obx_relay_on_fetched(c->r, rows, n, c->snapshot, now);
}

/* Log mode with slots, slots 2 and 3 far behind the stored hwm (taken from
 * a relay that stopped): a full fetch cut below it makes a partial claim,
 * about the slots whose cursor rows are at or below its hwm. Its cursor row
 * is about them only, stores no offsets and covers only their rows; a
 * late row of slot 0 waits for a whole claim, which the next fetch makes. */
static void test_log_partial_claim(void **state)
{
    struct ctx *c = *state;
    struct obx_relay_settings log = settings;
    log.log_mode = true;
    log.shards = 4;
    obx_relay_free(c->r);
    assert_int_equal(obx_relay_new(&log, &ops, &c->f, &c->f, &c->r), 0);
    obx_relay_on_pg_ready(c->r, 0);
    claimed(c, "0,1,2,3", 1, 4, 1);
    const struct obx_log_slot_hwm hwms[] = {{4, 0, 1000}, {4, 1, 1000}, {4, 2, 10}, {4, 3, 10}};
    struct obx_log_state st = {.has_cursor = true,
                               .batch = 7,
                               .hwm = 1000,
                               .snapshot = "990:990:",
                               .max_hwm = 1000,
                               .about_slots = true,
                               .slot_hwms = hwms,
                               .n_slot_hwms = 4};
    assert_int_equal(obx_relay_on_log_state(c->r, &st), 0);
    obx_relay_on_recovered(c->r, true, 2);
    assert_true(c->f.fetch_log);
    c->snapshot = "1100:1100:";
    /* A full batch (cut): rows of the lagging slots, and row 13, a late row
     * of slot 0. */
    fetched_in_slots(c, (const int64_t[]){11, 12, 13, 14}, (const int32_t[]){2, 3, 0, 2}, 4, 3);
    /* The next fetch goes at once, for the two free places: cut too. */
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_FETCHING);
    assert_int_equal(c->f.limit, 2);
    c->snapshot = "1101:1101:";
    fetched_in_slots(c, (const int64_t[]){15, 16}, (const int32_t[]){3, 2}, 2, 3);
    for (int k = 0; k < 6; k++) /* the second fetch's rows first */
        ack(c, (k + 4) % 6, true, 4);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_MARKING);
    assert_true(c->f.mark_log);
    assert_string_equal(c->f.mark_slots, "{2,3}");
    assert_int_equal(c->f.cursor_hwm, 16);
    assert_string_equal(c->f.cursor_snap, "1101:1101:");
    assert_int_equal(c->f.n_offsets, 0);
    obx_relay_on_marked(c->r, 5);
    assert_int_equal(obx_relay_in_flight(c->r), 1); /* row 13 */
    assert_int_equal(obx_relay_marked_total(c->r), 5);
    /* The next full fetch finds nothing more: a whole claim at the stored
     * hwm, about every slot, covers row 13. */
    for (int64_t t = 6; t < 400 && obx_relay_state(c->r) != OBX_RELAY_FETCHING; t += 50) {
        obx_relay_tick(c->r, t);
        if (obx_relay_state(c->r) == OBX_RELAY_CLAIMING) /* the periodic look */
            claimed(c, "0,1,2,3", 1, 4, t);
    }
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_FETCHING);
    assert_true(c->f.fetch_log);
    assert_int_equal(c->f.n_exclude, 1);
    assert_int_equal(c->f.exclude[0], 13);
    fetched_in_slots(c, NULL, NULL, 0, 400);
    for (int64_t t = 401; t < 1000 && obx_relay_state(c->r) != OBX_RELAY_MARKING; t += 50) {
        obx_relay_tick(c->r, t);
        if (obx_relay_state(c->r) == OBX_RELAY_CLAIMING)
            claimed(c, "0,1,2,3", 1, 4, t);
        if (obx_relay_state(c->r) == OBX_RELAY_FETCHING) /* looks for new rows */
            fetched_in_slots(c, NULL, NULL, 0, t);
    }
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_MARKING);
    assert_string_equal(c->f.mark_slots, "{0,1,2,3}");
    assert_int_equal(c->f.cursor_hwm, 1000);
    obx_relay_on_marked(c->r, 1000);
    assert_int_equal(obx_relay_in_flight(c->r), 0);
    assert_int_equal(obx_relay_marked_total(c->r), 6);
}

/* Slots taken after an owner that did not give them back cleanly are not
 * given back (as clean) before the pass over them has succeeded: the next
 * owner would trust that no record of theirs lacks a stored offset. */
static void test_shards_no_give_back_before_the_pass(void **state)
{
    struct ctx *c = *state;
    shards_ready(c, 0);
    claimed(c, "0,1,2,3", 1, 4, 1);
    obx_relay_on_recovered(c->r, false, 2); /* the pass failed (Kafka down) */
    obx_relay_tick(c->r, 600);              /* after the back-off: the claim first */
    claimed(c, "0,1,2,3", 2, 2, 600);       /* a relay joined: two to give back */
    for (int64_t t = 601; t < 3000; t += 100) {
        obx_relay_tick(c->r, t);
        if (obx_relay_state(c->r) == OBX_RELAY_CLAIMING) {
            assert_string_equal(c->f.give_back, "{}");
            claimed(c, "0,1,2,3", 2, 2, t);
        }
        if (obx_relay_state(c->r) == OBX_RELAY_RECOVERING && t < 2000)
            obx_relay_on_recovered(c->r, false, t); /* still failing */
    }
    if (obx_relay_state(c->r) == OBX_RELAY_RECOVERING)
        obx_relay_on_recovered(c->r, true, 3000);
    for (int64_t t = 3001; t < 4000 && obx_relay_state(c->r) != OBX_RELAY_CLAIMING; t += 100)
        obx_relay_tick(c->r, t);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_CLAIMING);
    assert_string_equal(c->f.give_back, "{2,3}"); /* once the pass is done */
}

/* A member counting other slots: this relay gives every slot back. No
 * slots, no fetch, and still not stalled. */
static void test_shards_other_count_gives_all_back(void **state)
{
    struct ctx *c = *state;
    shards_ready(c, 0);
    struct obx_claim a = {.owned = "0,1", .members = 2, .share = 2, .other_shards = 8};
    obx_relay_on_claimed(c->r, &a, 1);
    /* Taken: their pass first, then back at once (nothing out). */
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_RECOVERING);
    assert_int_equal(c->f.fetches, 0);
    obx_relay_on_recovered(c->r, true, 1);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_CLAIMING);
    assert_string_equal(c->f.give_back, "{0,1}");
    claimed(c, "", 2, 2, 2);
    assert_string_equal(obx_relay_owned_slots(c->r), "");
    assert_int_equal(c->f.fetches, 0);
    for (int64_t t = 300; t < 30000; t += 300) {
        obx_relay_tick(c->r, t);
        if (obx_relay_state(c->r) == OBX_RELAY_RECOVERING) /* of no slot: nothing to do */
            obx_relay_on_recovered(c->r, true, t);
        if (obx_relay_state(c->r) == OBX_RELAY_CLAIMING)
            claimed(c, "", 2, 2, t);
        obx_relay_check_stall(c->r, true, t);
    }
    char why[128];
    assert_int_equal(obx_relay_stalled(c->r, why, sizeof(why)), 0);
    assert_int_equal(c->f.fetches, 0);
}

/* A lost session loses the slots: the next one claims before its pass. */
static void test_shards_lost_session_claims_again(void **state)
{
    struct ctx *c = *state;
    shards_ready(c, 0);
    claimed(c, "1", 4, 1, 1);
    obx_relay_on_recovered(c->r, true, 2);
    obx_relay_on_pg_lost(c->r, 3);
    assert_string_equal(obx_relay_owned_slots(c->r), "");
    obx_relay_on_pg_ready(c->r, 4);
    assert_int_equal(c->f.claims, 2);
    assert_true(c->f.take);
    assert_int_equal(c->f.recovers, 1);
    claimed(c, "2", 4, 1, 5);
    assert_int_equal(c->f.recovers, 2);
    assert_string_equal(c->f.recover_slots, "{2}");
}

#define TESTS(X)                                                                                   \
    X(test_cycle)                                                                                  \
    X(test_straight_routes)                                                                        \
    X(test_exclusion_and_backpressure)                                                             \
    X(test_adaptive_look)                                                                          \
    X(test_pg_lost_confirms_nothing_by_id)                                                         \
    X(test_query_failed_backs_off)                                                                 \
    X(test_delivery_failure_refetches)                                                             \
    X(test_produce_busy_keeps_order)                                                               \
    X(test_produce_busy_discards_early_fetch)                                                      \
    X(test_mark_carries_offsets)                                                                   \
    X(test_recovery_retried)                                                                       \
    X(test_unknown_during_recovery_runs_it_again)                                                  \
    X(test_many_keys_held_back)                                                                    \
    X(test_failed_row_holds_its_key)                                                               \
    X(test_uncertain_row_found_frees_its_key)                                                      \
    X(test_held_row_behind_another_not_dropped)                                                    \
    X(test_unknown_holds_marks)                                                                    \
    X(test_fetch_after_unknown_set_aside)                                                          \
    X(test_reject_retry_holds_key)                                                                 \
    X(test_reject_dead_letter)                                                                     \
    X(test_topic_refused_held_as_one)                                                              \
    X(test_reject_then_transient_failure)                                                          \
    X(test_possibly_persisted_reruns_recovery)                                                     \
    X(test_failpoint_through_ops)                                                                  \
    X(test_shutdown_drains)                                                                        \
    X(test_shutdown_deadline)                                                                      \
    X(test_shutdown_hard_deadline_while_marking)                                                   \
    X(test_shutdown_idle_is_immediate)                                                             \
    X(test_stall)                                                                                  \
    X(test_batch_refused_rows_go_alone)                                                            \
    X(test_batch_refused_row_waits_and_may_be_gone)                                                \
    X(test_every_acquisition_recovers)                                                             \
    X(test_fetch_in_flight_at_shutdown_is_not_produced)                                            \
    X(test_fatal_marks_acked_then_stops)                                                           \
    X(test_fatal_without_postgres)                                                                 \
    X(test_keyset_fetch)                                                                           \
    X(test_keyset_when_nothing_in_flight)                                                          \
    X(test_cursor_not_set_by_an_earlier_fetch)                                                     \
    X(test_ids_zero_and_below)                                                                     \
    X(test_keyset_cleared_by_a_row_back)                                                           \
    X(test_keyset_not_from_a_short_look)                                                           \
    X(test_byte_budget_withholds)                                                                  \
    X(test_fetch_rides_on_mark)                                                                    \
    X(test_batch_refused_as_a_fetch_goes)                                                          \
    X(test_one_record_per_key)                                                                     \
    X(test_log_cursor_waits_for_earlier_fetch)                                                     \
    X(test_log_release_drops_claims)                                                               \
    X(test_log_restart_from_stored_cursor)                                                         \
    X(test_log_held_row_outlives_the_session)                                                      \
    X(test_log_alone_try_ends_with_the_session)                                                    \
    X(test_log_retried_rows_orphaned_come_back)                                                    \
    X(test_shards_claim_then_pass_then_fetch)                                                      \
    X(test_shards_give_back_after_quiet)                                                           \
    X(test_shards_taken_slot_recovered_first)                                                      \
    X(test_shards_no_offsets_before_the_pass)                                                      \
    X(test_shards_no_give_back_before_the_pass)                                                    \
    X(test_log_partial_claim)                                                                      \
    X(test_shards_other_count_gives_all_back)                                                      \
    X(test_shards_lost_session_claims_again)

OBX_FIXTURE_MAIN(TESTS)
