/*
 * Unit tests of keycount, the counted set of keys with a record at Kafka.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include "cmocka_alloc.h"

#include "outboxd/keycount.h"

static void test_counts(void **state)
{
    (void)state;
    struct obx_keycount kc;
    assert_int_equal(obx_keycount_init(&kc, 4), 0);
    uint64_t a = obx_keycount_hash(0, "a", 1), b = obx_keycount_hash(1, "a", 1);
    assert_true(a != b); /* the topic is part of the key */
    assert_false(obx_keycount_busy(&kc, a));
    assert_int_equal(obx_keycount_add(&kc, a), 0);
    assert_int_equal(obx_keycount_add(&kc, a), 0);
    assert_true(obx_keycount_busy(&kc, a));
    assert_false(obx_keycount_busy(&kc, b));
    assert_int_equal(obx_keycount_remove(&kc, a), 1);
    assert_true(obx_keycount_busy(&kc, a));
    assert_int_equal(obx_keycount_remove(&kc, a), 0);
    assert_false(obx_keycount_busy(&kc, a));
    assert_int_equal(obx_keycount_remove(&kc, b), 0); /* absent: nothing to do */
    obx_keycount_free(&kc);
}

/* Hashes that share a home place: removing one of a run must leave the
 * others findable (backward shift), whichever goes first, across the end
 * of the table too. */
static void test_collisions(void **state)
{
    (void)state;
    struct obx_keycount kc;
    assert_int_equal(obx_keycount_init(&kc, 8), 0); /* 16 places */
    size_t mask = kc.cap - 1;
    /* home(h) = (h ^ h >> 32) & mask: these all start at place 15 or 0. */
    const uint64_t h[] = {15, 31, 47, 16, 32, 63};
    for (size_t i = 0; i < 6; i++)
        assert_int_equal(obx_keycount_add(&kc, h[i]), 0);
    assert_int_equal((size_t)(h[0] & mask), 15);
    for (size_t gone = 0; gone < 6; gone++) {
        assert_int_equal(obx_keycount_remove(&kc, h[gone]), 0);
        for (size_t i = 0; i < 6; i++)
            if (i > gone)
                assert_true(obx_keycount_busy(&kc, h[i]));
            else
                assert_false(obx_keycount_busy(&kc, h[i]));
    }
    assert_int_equal(kc.used, 0);
    obx_keycount_free(&kc);
}

static void test_full(void **state)
{
    (void)state;
    struct obx_keycount kc;
    assert_int_equal(obx_keycount_init(&kc, 8), 0);
    uint64_t i;
    for (i = 1; obx_keycount_add(&kc, i) == 0; i++)
        ;
    assert_int_equal(i - 1, kc.cap / 2); /* refused beyond half full, never lost */
    for (uint64_t k = 1; k < i; k++)
        assert_true(obx_keycount_busy(&kc, k));
    obx_keycount_free(&kc);
}

/* Parked slots come back in the order they were parked, per key; a key
 * stays known while it has a record at Kafka or a parked slot. */
static void test_parked(void **state)
{
    (void)state;
    struct obx_keycount kc;
    assert_int_equal(obx_keycount_init(&kc, 8), 0);
    uint64_t a = obx_keycount_hash(0, "a", 1), b = obx_keycount_hash(0, "b", 1);
    assert_int_equal(obx_keycount_add(&kc, a), 0);
    assert_int_equal(obx_keycount_park(&kc, a, 3), 0);
    assert_int_equal(obx_keycount_park(&kc, b, 5), 0); /* b: parked only */
    assert_int_equal(obx_keycount_park(&kc, a, 1), 0);
    assert_int_equal(obx_keycount_park(&kc, a, 7), 0);
    assert_int_equal(obx_keycount_park(&kc, a, 8), -1); /* no such slot */
    assert_true(obx_keycount_busy(&kc, b));
    assert_int_equal(obx_keycount_remove(&kc, a), 0);
    assert_true(obx_keycount_busy(&kc, a)); /* still has parked slots */
    assert_int_equal(obx_keycount_unpark(&kc, a), 3);
    assert_int_equal(obx_keycount_unpark(&kc, a), 1);
    assert_int_equal(obx_keycount_unpark(&kc, a), 7);
    assert_int_equal(obx_keycount_unpark(&kc, a), -1);
    assert_false(obx_keycount_busy(&kc, a)); /* nothing left: forgotten */
    assert_int_equal(obx_keycount_unpark(&kc, b), 5);
    assert_false(obx_keycount_busy(&kc, b));
    assert_int_equal(kc.used, 0);
    obx_keycount_free(&kc);
}

int main(void)
{
    use_cmocka_allocator(); /* leaks and double frees fail the test */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_counts),
        cmocka_unit_test(test_collisions),
        cmocka_unit_test(test_full),
        cmocka_unit_test(test_parked),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
