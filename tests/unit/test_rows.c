/*
 * Unit tests of relay_rows, the rows in flight: seats, the free list, and
 * the count of every state kept by the one function that moves a seat;
 * the topic names and the partitions' offsets beside them.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include "cmocka_alloc.h"

#include "outboxd/alloc.h"
#include "relay_rows.h"

#include <stdio.h>
#include <string.h>

/* The counts agree with the seats' states. */
static void assert_counts(const struct rows *rs)
{
    size_t seen[SEAT_STATES] = {0}, orphans = 0;
    for (int32_t i = 0; i < rs->cap; i++) {
        seen[rs->seat[i].state]++;
        orphans += rs->seat[i].orphan;
    }
    for (int k = 0; k < SEAT_STATES; k++)
        assert_int_equal(seen[k], rs->count[k]);
    assert_int_equal(orphans, rs->orphans);
}

static void test_take_until_full(void **state)
{
    (void)state;
    struct rows rs;
    assert_int_equal(rows_init(&rs, 3), 0);
    assert_int_equal(rows_in_use(&rs), 0);
    struct seat *a = rows_take(&rs, 10, 0), *b = rows_take(&rs, 11, 1), *c = rows_take(&rs, 12, 0);
    assert_non_null(a);
    assert_non_null(b);
    assert_non_null(c);
    assert_null(rows_take(&rs, 13, 0)); /* full */
    assert_int_equal(rows_in_use(&rs), 3);
    assert_int_equal(b->id, 11);
    assert_int_equal(b->topic, 1);
    assert_int_equal(b->partition, -1);
    assert_int_equal(b->offset, -1);
    assert_int_equal(b->state, SEAT_PRODUCED);
    assert_counts(&rs);
    rows_release(&rs, b);
    assert_int_equal(b->state, SEAT_FREE);
    assert_int_equal(rows_in_use(&rs), 2);
    struct seat *d = rows_take(&rs, 14, 0);
    assert_ptr_equal(d, b); /* the seat freed last is taken first */
    assert_int_equal(d->id, 14);
    assert_counts(&rs);
    rows_free(&rs);
}

/* A row's life through a mark that fails and one that commits. */
static void test_mark_cycle(void **state)
{
    (void)state;
    struct rows rs;
    assert_int_equal(rows_init(&rs, 4), 0);
    struct seat *a = rows_take(&rs, 1, 0), *b = rows_take(&rs, 2, 0), *c = rows_take(&rs, 3, 0);
    rows_move(&rs, a, SEAT_ACKED);
    rows_move(&rs, b, SEAT_DEAD);
    b->reason = obx_strdup("refused");
    assert_int_equal(rows_to_mark(&rs), 2);
    rows_move_all(&rs, SEAT_ACKED, SEAT_MARKING);
    rows_move_all(&rs, SEAT_DEAD, SEAT_DEAD_MARKING);
    assert_int_equal(rows_to_mark(&rs), 0);
    assert_int_equal(a->state, SEAT_MARKING);
    assert_int_equal(b->state, SEAT_DEAD_MARKING);
    assert_int_equal(c->state, SEAT_PRODUCED); /* not in the mark */
    assert_counts(&rs);
    rows_move_all(&rs, SEAT_MARKING, SEAT_ACKED); /* the mark failed */
    rows_move_all(&rs, SEAT_DEAD_MARKING, SEAT_DEAD);
    assert_int_equal(rows_to_mark(&rs), 2);
    assert_string_equal(b->reason, "refused");
    rows_move_all(&rs, SEAT_ACKED, SEAT_MARKING);
    rows_move_all(&rs, SEAT_DEAD, SEAT_DEAD_MARKING);
    rows_release(&rs, a); /* the mark committed: the reason is freed with the seat */
    rows_release(&rs, b);
    assert_null(b->reason);
    assert_int_equal(rows_in_use(&rs), 1);
    assert_counts(&rs);
    rows_free(&rs);
}

static void test_parked_and_orphans(void **state)
{
    (void)state;
    struct rows rs;
    assert_int_equal(rows_init(&rs, 2), 0);
    struct seat *a = rows_take(&rs, 1, 0), *b = rows_take(&rs, 2, 0);
    rows_move(&rs, b, SEAT_PARKED);
    b->parked = obx_malloc(16);
    assert_int_equal(rs.count[SEAT_PARKED], 1);
    rows_orphan(&rs, a);
    rows_orphan(&rs, a); /* counted once */
    assert_int_equal(rs.orphans, 1);
    assert_counts(&rs);
    rows_release(&rs, a);
    assert_int_equal(rs.orphans, 0);
    assert_false(a->orphan);
    rows_move(&rs, b, SEAT_PRODUCED); /* its key is free: it goes */
    assert_counts(&rs);
    rows_free(&rs); /* frees b's parked copy */
}

static void test_topics_and_offsets(void **state)
{
    (void)state;
    struct topics t = {0};
    assert_int_equal(topics_index(&t, "a"), 0);
    assert_int_equal(topics_index(&t, "b"), 1);
    assert_int_equal(topics_index(&t, "a"), 0); /* found again, not added */
    for (int i = 0; i < 40; i++) {              /* grows past its first 16 */
        char name[16];
        snprintf(name, sizeof(name), "t%d", i);
        assert_int_equal(topics_index(&t, name), 2 + i);
    }
    assert_string_equal(t.name[1], "b");

    struct part_offsets o;
    assert_int_equal(part_offsets_init(&o, 1), 0);
    part_offsets_raise(&o, t.name[0], 3, 10);
    part_offsets_raise(&o, t.name[0], 3, 7); /* never back */
    part_offsets_raise(&o, t.name[1], 3, 5); /* another topic: its own entry (grown) */
    part_offsets_raise(&o, t.name[0], 3, 12);
    assert_int_equal(o.n, 2);
    assert_int_equal(o.offset[0], 12);
    assert_int_equal(o.offset[1], 5);
    assert_int_equal(part_offsets_add(&o, t.name[0], 4, 1), 0);
    assert_int_equal(o.n, 3);
    assert_int_equal(o.partition[2], 4);
    part_offsets_free(&o);
    topics_free(&t);
}

int main(void)
{
    use_cmocka_allocator(); /* leaks and double frees fail the test */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_take_until_full),
        cmocka_unit_test(test_mark_cycle),
        cmocka_unit_test(test_parked_and_orphans),
        cmocka_unit_test(test_topics_and_offsets),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
