/*
 * Unit tests of the relay in log mode (relay_log.c): the cursor rows,
 * their checkpoints, held rows across sessions, partial checkpoints with slots.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include "cmocka_alloc.h"
#include "relay_fixture.h"

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

/* A row that goes back unsent (the Kafka queue was full) takes the checkpoints
 * of its fetch and of the fetches after it: no cursor row covers it until
 * it was handed out again and acknowledged. */
static void test_log_release_drops_checkpoints(void **state)
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
    assert_int_equal(c->f.marks, 0); /* the fetch's checkpoint went with rows 3 and 4 */
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
 * its report comes for an orphaned seat. That ends the try: the relay
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

/* Log mode with slots, slots 2 and 3 far behind the stored hwm (taken from
 * a relay that stopped): a full fetch cut below it makes a partial checkpoint,
 * about the slots whose cursor rows are at or below its hwm. Its cursor row
 * is about them only, stores no offsets and covers only their rows; a
 * late row of slot 0 waits for a whole checkpoint, which the next fetch makes. */
static void test_log_partial_checkpoint(void **state)
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
    /* The next full fetch finds nothing more: a whole checkpoint at the stored
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

#define TESTS(X)                                                                                   \
    X(test_log_cursor_waits_for_earlier_fetch)                                                     \
    X(test_log_release_drops_checkpoints)                                                          \
    X(test_log_restart_from_stored_cursor)                                                         \
    X(test_log_held_row_outlives_the_session)                                                      \
    X(test_log_alone_try_ends_with_the_session)                                                    \
    X(test_log_retried_rows_orphaned_come_back)                                                    \
    X(test_log_partial_checkpoint)

OBX_FIXTURE_MAIN(TESTS)
