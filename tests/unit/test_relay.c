/*
 * Unit tests of the relay cycle against fake pg/kafka operations
 * (relay_fixture.h): what it fetches, produces and marks in reply to each
 * event; shutdown, stalls, the keyset cursor, one record per key.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include "cmocka_alloc.h"
#include "relay_fixture.h"

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

    ack(c, 0, true, 10); /* mark id 1, then a seat frees */
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
    struct obx_row rows[2] = {{.id = 7, .topic = "t", .oversize = true, .bytes = 500000},
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

#define TESTS(X)                                                                                   \
    X(test_cycle)                                                                                  \
    X(test_straight_routes)                                                                        \
    X(test_exclusion_and_backpressure)                                                             \
    X(test_adaptive_look)                                                                          \
    X(test_pg_lost_confirms_nothing_by_id)                                                         \
    X(test_every_acquisition_recovers)                                                             \
    X(test_query_failed_backs_off)                                                                 \
    X(test_delivery_failure_refetches)                                                             \
    X(test_produce_busy_keeps_order)                                                               \
    X(test_produce_busy_discards_early_fetch)                                                      \
    X(test_mark_carries_offsets)                                                                   \
    X(test_unknown_holds_marks)                                                                    \
    X(test_fetch_after_unknown_set_aside)                                                          \
    X(test_unknown_during_recovery_runs_it_again)                                                  \
    X(test_recovery_retried)                                                                       \
    X(test_possibly_persisted_reruns_recovery)                                                     \
    X(test_failpoint_through_ops)                                                                  \
    X(test_shutdown_drains)                                                                        \
    X(test_shutdown_deadline)                                                                      \
    X(test_shutdown_hard_deadline_while_marking)                                                   \
    X(test_shutdown_idle_is_immediate)                                                             \
    X(test_stall)                                                                                  \
    X(test_fetch_in_flight_at_shutdown_is_not_produced)                                            \
    X(test_fatal_marks_acked_then_stops)                                                           \
    X(test_fatal_without_postgres)                                                                 \
    X(test_keyset_fetch)                                                                           \
    X(test_keyset_when_nothing_in_flight)                                                          \
    X(test_keyset_cleared_by_a_row_back)                                                           \
    X(test_ids_zero_and_below)                                                                     \
    X(test_cursor_not_set_by_an_earlier_fetch)                                                     \
    X(test_keyset_not_from_a_short_look)                                                           \
    X(test_byte_budget_withholds)                                                                  \
    X(test_fetch_rides_on_mark)                                                                    \
    X(test_one_record_per_key)

OBX_FIXTURE_MAIN(TESTS)
