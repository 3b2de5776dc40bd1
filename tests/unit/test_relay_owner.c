/*
 * Unit tests of the relay with relay.shards above 1 (relay_owner.c):
 * claims, the pass before a taken slot, giving slots back when quiet.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include "cmocka_alloc.h"
#include "relay_fixture.h"

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
    X(test_shards_claim_then_pass_then_fetch)                                                      \
    X(test_shards_give_back_after_quiet)                                                           \
    X(test_shards_taken_slot_recovered_first)                                                      \
    X(test_shards_no_offsets_before_the_pass)                                                      \
    X(test_shards_no_give_back_before_the_pass)                                                    \
    X(test_shards_other_count_gives_all_back)                                                      \
    X(test_shards_lost_session_claims_again)

OBX_FIXTURE_MAIN(TESTS)
