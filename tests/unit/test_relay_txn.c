/*
 * Unit tests of the relay with relay.transactions (relay_txn.h): rows go
 * out in a transaction, are marked only once it committed, and go again
 * after an abort; what a lost session or a fence does to it.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include "cmocka_alloc.h"
#include "relay_fixture.h"

/* The transactional ops beside the fixture's: they count, and answer
 * through obx_relay_on_txn_ended only when a test says so. */
struct txn_fake {
    int begins;
    int begin_rc;
    int commits;
    int aborts;
    int end_rc;
};
static struct txn_fake tf;

static int fake_txn_begin(void *producer, const char **reason)
{
    (void)producer;
    if (tf.begin_rc != 0) {
        *reason = "Operation not valid in state Ready";
        return tf.begin_rc;
    }
    tf.begins++;
    return 0;
}

static int fake_txn_end(void *io, enum obx_txn_end end)
{
    (void)io;
    if (tf.end_rc != 0)
        return tf.end_rc;
    if (end == OBX_TXN_COMMIT)
        tf.commits++;
    else
        tf.aborts++;
    return 0;
}

static const struct obx_relay_ops txn_ops = {
    .fetch = fake_fetch,
    .mark = fake_mark,
    .mark_fetch = fake_mark_fetch,
    .produce = fake_produce,
    .recover = fake_recover,
    .claim = fake_claim,
    .stopped = fake_stopped,
    .wake_at = fake_wake_at,
    .txn_begin = fake_txn_begin,
    .txn_end = fake_txn_end,
    .now = fake_now,
};

static int setup_txn(void **state)
{
    struct ctx *c = test_calloc(1, sizeof(*c));
    c->f.busy_at = -1;
    memset(&tf, 0, sizeof(tf));
    struct obx_relay_settings s = settings;
    s.transactions = true;
    s.transaction_rows = 4;
    assert_int_equal(obx_relay_new(&s, &txn_ops, &c->f, &c->f, &c->r), 0);
    *state = c;
    return 0;
}

/* Four rows (a full transaction) fetched and acknowledged: the commit
 * goes, and only its answer lets the mark go. */
static void test_txn_marks_after_commit(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 4, 1);
    assert_int_equal(tf.begins, 1);
    assert_int_equal(c->f.produced, 4);
    for (int k = 0; k < 4; k++)
        ack(c, k, true, 2);
    assert_int_equal(tf.commits, 1);
    obx_relay_tick(c->r, 3);
    assert_int_equal(c->f.marks, 0);   /* acknowledged, not committed */
    assert_int_equal(c->f.fetches, 1); /* and no fetch adds rows to a transaction that ends */
    obx_relay_on_txn_ended(c->r, OBX_TXN_COMMIT, OBX_TXN_OK, "", 4);
    assert_int_equal(c->f.marks, 1);
    assert_int_equal(c->f.n_marked, 4);
    obx_relay_on_marked(c->r, 5);
    assert_int_equal(obx_relay_in_flight(c->r), 0);
}

/* A fetch with fewer rows than the transaction takes means the relay
 * caught up: the transaction commits without waiting for more. */
static void test_txn_caught_up_commits_small(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 2, 1);
    ack(c, 0, true, 2);
    assert_int_equal(tf.commits, 0); /* a report is still out */
    obx_relay_tick(c->r, 3);
    assert_int_equal(c->f.fetches, 1); /* no look for more: it would keep the transaction open */
    ack(c, 1, true, 4);
    assert_int_equal(tf.commits, 1);
    obx_relay_on_txn_ended(c->r, OBX_TXN_COMMIT, OBX_TXN_OK, "", 5);
    until_fetching(c, 6); /* after the commit (and the mark), the looks go on */
}

/* A failed report dooms the transaction: it is aborted, nothing of it is
 * marked, and its rows are fetched and produced again in a new one. */
static void test_txn_failed_report_aborts(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 4, 1);
    ack(c, 0, true, 2);
    ack(c, 1, true, 2);
    ack_as(c, 2, OBX_DELIVERY_UNKNOWN, 2); /* may have landed: its transaction never commits */
    ack(c, 3, true, 2);
    assert_int_equal(tf.commits, 0);
    assert_int_equal(tf.aborts, 1);
    assert_int_equal(c->f.recovers, 1); /* no pass for it: the abort settles it */
    obx_relay_on_txn_ended(c->r, OBX_TXN_ABORT, OBX_TXN_OK, "", 3);
    assert_int_equal(c->f.marks, 0);
    until_fetching(c, 1000);
    fetched(c, 1, 4, 2000);
    assert_int_equal(tf.begins, 2);
    assert_int_equal(c->f.produced, 8); /* all four again, in a new transaction */
}

/* The coordinator refuses the commit (abortable): the relay aborts, and
 * the rows go again. */
static void test_txn_commit_refused_aborts(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 4, 1);
    for (int k = 0; k < 4; k++)
        ack(c, k, true, 2);
    obx_relay_on_txn_ended(c->r, OBX_TXN_COMMIT, OBX_TXN_ABORTABLE, "Broker: timed out", 3);
    assert_int_equal(tf.aborts, 1);
    assert_int_equal(obx_relay_in_flight(c->r), 4);
    obx_relay_on_txn_ended(c->r, OBX_TXN_ABORT, OBX_TXN_OK, "", 4);
    assert_int_equal(obx_relay_in_flight(c->r), 0);
    assert_int_equal(c->f.marks, 0);
}

/* A commit that timed out is asked again, not aborted: it may have
 * reached the coordinator. */
static void test_txn_commit_timeout_asks_again(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 2, 1);
    ack(c, 0, true, 2);
    ack(c, 1, true, 2);
    obx_relay_on_txn_ended(c->r, OBX_TXN_COMMIT, OBX_TXN_RETRY, "Timed out", 3);
    assert_int_equal(tf.commits, 2);
    assert_int_equal(tf.aborts, 0);
    obx_relay_on_txn_ended(c->r, OBX_TXN_COMMIT, OBX_TXN_OK, "", 4);
    assert_int_equal(c->f.marks, 1);
}

/* Fenced (the transaction timed out at the broker after an outage, or
 * another producer took the id): nothing of the transaction is marked;
 * the relay keeps its session, runs the recovery pass again (after a new
 * producer's init, in main) and publishes again. */
static void test_txn_fenced_recovers(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 2, 1);
    ack(c, 0, true, 2);
    ack(c, 1, true, 2);
    obx_relay_on_txn_ended(c->r, OBX_TXN_COMMIT, OBX_TXN_FENCED,
                           "Producer fenced by newer instance", 3);
    assert_int_equal(c->f.marks, 0);
    assert_int_equal(obx_relay_in_flight(c->r), 0);
    obx_relay_tick(c->r, 1000);
    assert_int_equal(c->f.stopped, 0);
    assert_int_equal(c->f.recovers, 2);
    obx_relay_on_recovered(c->r, true, 1001);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_FETCHING);
    fetched(c, 1, 2, 1002);
    assert_int_equal(tf.begins, 2);
}

/* A producer that cannot begin (it hit a fatal error): the same. */
static void test_txn_begin_fatal_recovers(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    tf.begin_rc = -2;
    fetched(c, 1, 2, 1);
    assert_int_equal(c->f.produced, 0);
    tf.begin_rc = 0;
    obx_relay_tick(c->r, 1000);
    assert_int_equal(c->f.recovers, 2);
    assert_int_equal(c->f.stopped, 0);
}

/* The session lost while the commit runs: its rows go with the session
 * (the next one's pass finds what committed), and the late answer changes
 * nothing. */
static void test_txn_lost_session_ignores_its_end(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    fetched(c, 1, 2, 1);
    ack(c, 0, true, 2);
    ack(c, 1, true, 2);
    assert_int_equal(tf.commits, 1);
    obx_relay_on_pg_lost(c->r, 3);
    assert_int_equal(obx_relay_in_flight(c->r), 0);
    obx_relay_on_txn_ended(c->r, OBX_TXN_COMMIT, OBX_TXN_OK, "", 4);
    assert_int_equal(c->f.marks, 0);
    ready(c, 5);
    assert_int_equal(c->f.recovers, 2);
    fetched(c, 1, 2, 6);
    assert_int_equal(tf.begins, 2);
}

/* A transaction that cannot begin: the rows wait and the fetch is tried
 * again after the back-off. */
static void test_txn_begin_refused_waits(void **state)
{
    struct ctx *c = *state;
    ready(c, 0);
    tf.begin_rc = -1;
    fetched(c, 1, 2, 1);
    assert_int_equal(c->f.produced, 0);
    assert_int_equal(obx_relay_in_flight(c->r), 0);
    tf.begin_rc = 0;
    until_fetching(c, 1000);
    fetched(c, 1, 2, 2000);
    assert_int_equal(c->f.produced, 2);
}

/* A transaction larger than the seats: once every seat holds a row of it
 * no fetch can bring more, so it commits (it waited for ever before). */
static void test_txn_full_seats_commit(void **state)
{
    struct ctx *c = *state;
    obx_relay_free(c->r);
    struct obx_relay_settings s = settings;
    s.transactions = true;
    s.transaction_rows = 100;
    assert_int_equal(obx_relay_new(&s, &txn_ops, &c->f, &c->f, &c->r), 0);
    ready(c, 0);
    fetched(c, 1, 4, 1); /* a full batch: more rows wait */
    for (int k = 0; k < 4; k++)
        ack(c, k, true, 2);
    assert_int_equal(tf.commits, 0); /* two seats free: a fetch brings more first */
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_FETCHING);
    fetched(c, 5, 2, 3); /* as many as the free seats: still not caught up */
    ack(c, 4, true, 4);
    ack(c, 5, true, 4);
    assert_int_equal(tf.commits, 1);
}

/* An old transaction (half its timeout gone) ends although more rows
 * wait, before the coordinator aborts it and fences the producer. */
static void test_txn_old_commits(void **state)
{
    struct ctx *c = *state;
    obx_relay_free(c->r);
    struct obx_relay_settings s = settings;
    s.transactions = true;
    s.transaction_rows = 100;
    s.max_in_flight = 100;
    s.transaction_timeout_ms = 10000;
    assert_int_equal(obx_relay_new(&s, &txn_ops, &c->f, &c->f, &c->r), 0);
    ready(c, 0);
    fetched(c, 1, 4, 1);
    for (int k = 0; k < 4; k++)
        ack(c, k, true, 2);
    assert_int_equal(tf.commits, 0);
    assert_int_equal(obx_relay_state(c->r), OBX_RELAY_FETCHING); /* for more */
    obx_relay_tick(c->r, 5001); /* the fetch out is slow: the transaction is old */
    assert_int_equal(tf.commits, 1);
    fetched(c, 5, 4, 5002); /* its rows wait for the next transaction */
    assert_int_equal(c->f.produced, 4);
    obx_relay_on_txn_ended(c->r, OBX_TXN_COMMIT, OBX_TXN_OK, "", 5003);
    assert_int_equal(c->f.marks, 1);
    assert_int_equal(c->f.n_marked, 4);
}

/* relay.shards: a slot taken while a transaction is open. The pass for
 * it comes after a new producer's init (which would drop the open
 * transaction), so the transaction ends first: it takes no more rows, and
 * once its reports are in it commits, its rows are marked, and the pass
 * goes. */
static void test_txn_slot_taken_pass_waits(void **state)
{
    struct ctx *c = *state;
    struct obx_relay_settings s = settings;
    s.transactions = true;
    s.transaction_rows = 4;
    s.shards = 4;
    obx_relay_free(c->r);
    assert_int_equal(obx_relay_new(&s, &txn_ops, &c->f, &c->f, &c->r), 0);
    obx_relay_on_pg_ready(c->r, 0);
    claimed(c, "0,1", 2, 2, 1);
    assert_int_equal(c->f.recovers, 1);
    obx_relay_on_recovered(c->r, true, 2);
    fetched(c, 1, 4, 3);
    assert_int_equal(tf.begins, 1);
    ack(c, 0, true, 4);
    ack(c, 1, true, 5);
    obx_relay_tick(c->r, 300);
    claimed(c, "0,1,3", 1, 4, 300); /* the other relay left: one more slot */
    obx_relay_tick(c->r, 301);
    assert_int_equal(c->f.recovers, 1); /* not while the transaction is open */
    ack(c, 2, true, 302);
    ack(c, 3, true, 303);
    assert_int_equal(tf.commits, 1);
    assert_int_equal(c->f.recovers, 1);
    obx_relay_on_txn_ended(c->r, OBX_TXN_COMMIT, OBX_TXN_OK, "", 304);
    assert_int_equal(c->f.marks, 1);
    obx_relay_on_marked(c->r, 305);
    assert_int_equal(c->f.recovers, 2);
    assert_string_equal(c->f.recover_slots, "{0,1,3}");
    assert_int_equal(tf.begins, 1);
}

/* As OBX_IN_FIXTURE (cmocka_alloc.h), with this file's setup. */
#define IN_TXN_FIXTURE(fn)                                                                         \
    static void fn##_in_fixture(void **state)                                                      \
    {                                                                                              \
        assert_int_equal(setup_txn(state), 0);                                                     \
        fn(state);                                                                                 \
        assert_int_equal(teardown(state), 0);                                                      \
    }

#define TESTS(X)                                                                                   \
    X(test_txn_marks_after_commit)                                                                 \
    X(test_txn_caught_up_commits_small)                                                            \
    X(test_txn_failed_report_aborts)                                                               \
    X(test_txn_commit_refused_aborts)                                                              \
    X(test_txn_commit_timeout_asks_again)                                                          \
    X(test_txn_fenced_recovers)                                                                    \
    X(test_txn_begin_fatal_recovers)                                                               \
    X(test_txn_lost_session_ignores_its_end)                                                       \
    X(test_txn_begin_refused_waits)                                                                \
    X(test_txn_full_seats_commit)                                                                  \
    X(test_txn_old_commits)                                                                        \
    X(test_txn_slot_taken_pass_waits)

TESTS(IN_TXN_FIXTURE)

int main(void)
{
    use_cmocka_allocator();
    const struct CMUnitTest tests[] = {TESTS(OBX_FIXTURE_ENTRY)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
