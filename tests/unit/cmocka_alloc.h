/*
 * Routes outboxd's allocations (include/outboxd/alloc.h) to cmocka's
 * checked allocator: a block a test leaves allocated, frees twice or
 * overruns fails that test. Include after cmocka.h; call
 * use_cmocka_allocator() first thing in main().
 */
#ifndef OBX_TEST_CMOCKA_ALLOC_H
#define OBX_TEST_CMOCKA_ALLOC_H

#include "outboxd/alloc.h"

static void *cm_malloc(size_t size)
{
    return _test_malloc(size, __FILE__, __LINE__);
}

static void *cm_calloc(size_t count, size_t size)
{
    return _test_calloc(count, size, __FILE__, __LINE__);
}

static void *cm_realloc(void *ptr, size_t size)
{
    return _test_realloc(ptr, size, __FILE__, __LINE__);
}

static void cm_free(void *ptr)
{
    _test_free(ptr, __FILE__, __LINE__);
}

static void use_cmocka_allocator(void)
{
    static const struct obx_allocator cm = {cm_malloc, cm_calloc, cm_realloc, cm_free};
    obx_set_allocator(&cm);
}

/* cmocka looks for leaks right after the test function, before its
 * teardown runs, so module state that a fixture frees in teardown would
 * always count as leaked. OBX_IN_FIXTURE(fn) defines fn_in_fixture, which
 * runs the file's setup(), fn and teardown() as one test; list it with
 * OBX_FIXTURE_ENTRY(fn). */
#define OBX_IN_FIXTURE(fn)                                                                         \
    static void fn##_in_fixture(void **state)                                                      \
    {                                                                                              \
        assert_int_equal(setup(state), 0);                                                         \
        fn(state);                                                                                 \
        assert_int_equal(teardown(state), 0);                                                      \
    }
#define OBX_FIXTURE_ENTRY(fn) cmocka_unit_test(fn##_in_fixture),

/* The wrappers and main() of a file whose tests all use its fixture;
 * `list(X)` names them, X(test_a) X(test_b)... */
#define OBX_FIXTURE_MAIN(list)                                                                     \
    list(OBX_IN_FIXTURE) int main(void)                                                            \
    {                                                                                              \
        use_cmocka_allocator();                                                                    \
        const struct CMUnitTest tests[] = {list(OBX_FIXTURE_ENTRY)};                               \
        return cmocka_run_group_tests(tests, NULL, NULL);                                          \
    }

#endif
