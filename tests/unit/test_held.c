/*
 * Unit tests of relay_held, the refused rows and the keys (or topics) they
 * hold back, on their own: entries, the effects they ask of the cycle,
 * back-off, the row to try alone, and a topic held as one entry.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include "cmocka_alloc.h"

#include "relay_held.h"

#include <stdio.h>
#include <string.h>

static void test_key_held_and_released(void **state)
{
    (void)state;
    struct held h = {.retry_backoff_ms = 100};
    struct held_fx fx = {0};
    held_hold_back(&h, 10, 0, "k", 1, 1000, &fx);
    assert_string_equal(fx.clear_cursor, "row refused");
    assert_true(fx.hold); /* log mode's rule for it */
    assert_int_equal(fx.hold_id, 10);
    assert_true(held_holds(&h, 11, 0, "k", 1));   /* a later row of its key */
    assert_false(held_holds(&h, 9, 0, "k", 1));   /* an earlier one */
    assert_false(held_holds(&h, 11, 1, "k", 1));  /* another topic */
    assert_false(held_holds(&h, 11, 0, "j", 1));  /* another key */
    assert_false(held_holds(&h, 11, 0, NULL, 0)); /* no key: only the row waits */
    assert_int_equal(held_find(&h, 10)->retry_at, 1100);
    fx = (struct held_fx){0};
    held_hold_back(&h, 10, 0, "k", 1, 2000, &fx); /* failed again: the pause doubles */
    assert_false(fx.hold);                        /* held already */
    assert_int_equal(held_find(&h, 10)->retry_at, 2200);
    fx = (struct held_fx){0};
    held_release(&h, 10, &fx);
    assert_int_equal(h.n, 0);
    assert_int_equal(fx.n_lifted, 1);
    assert_int_equal(h.lifted[0], 10);
    assert_string_equal(fx.clear_cursor, "key no longer held back");
    assert_false(held_holds(&h, 11, 0, "k", 1));
    held_free(&h);
}

static void test_due_alone(void **state)
{
    (void)state;
    struct held h = {.retry_backoff_ms = 100};
    struct held_fx fx = {0};
    held_refused(&h, 20, 0, "k", 1, 0, &fx); /* retried alone from 100 on */
    held_refused(&h, 30, 0, "k", 1, 0, &fx); /* behind 20: its key */
    held_refused(&h, 25, 0, "m", 1, 0, &fx);
    assert_null(held_due_alone(&h, 50)); /* none due yet */
    assert_int_equal(held_due_alone(&h, 100)->id, 20);
    fx = (struct held_fx){0};
    held_drop(&h, 20, &fx); /* dead-lettered, say */
    assert_int_equal(held_due_alone(&h, 100)->id, 25);
    held_drop(&h, 25, &fx);
    assert_int_equal(held_due_alone(&h, 100)->id, 30); /* nothing before it now */
    assert_int_equal(fx.n_lifted, 2);
    held_free(&h);
}

/* A topic refused: one entry for it, at its lowest row; the others of the
 * topic go, and every later row of the topic waits, whatever its key. */
static void test_topic_held_as_one(void **state)
{
    (void)state;
    struct held h = {.retry_backoff_ms = 100};
    struct held_fx fx = {0};
    held_hold_back(&h, 5, 1, "a", 1, 0, &fx); /* a retry of the topic's row first */
    held_hold_back(&h, 7, 2, "b", 1, 0, &fx); /* another topic */
    fx = (struct held_fx){0};
    assert_false(held_topic_refused(&h, 9, 1, "t1", "c", 1, "refused", 0, &fx));
    assert_int_equal(h.n, 2);
    const struct held_back *t = held_find(&h, 5);
    assert_non_null(t);
    assert_true(t->whole_topic);
    assert_true(t->alone);
    assert_null(held_find(&h, 9)); /* waits behind 5 without an entry */
    assert_true(held_holds(&h, 100, 1, "zz", 2));
    assert_true(held_holds(&h, 100, 1, NULL, 0));
    assert_true(held_behind_topic(&h, 1, 100));
    assert_false(held_behind_topic(&h, 2, 100));
    fx = (struct held_fx){0};
    assert_true(held_topic_refused(&h, 12, 1, "t1", "d", 1, "refused", 0, &fx));
    assert_int_equal(h.n, 2); /* nothing new */
    held_free(&h);
}

/* What the entries say, walked one by one: the answers the index must give. */
static bool walk_holds(const struct held *h, int64_t id, uint32_t topic, const char *key,
                       size_t key_len)
{
    for (size_t i = 0; i < h->n; i++) {
        const struct held_back *b = &h->entry[i];
        if (b->topic == topic && id > b->id &&
            (b->whole_topic ||
             (key && b->key && b->key_len == key_len && memcmp(b->key, key, key_len) == 0)))
            return true;
    }
    return false;
}

static const struct held_back *walk_find(const struct held *h, int64_t id)
{
    for (size_t i = 0; i < h->n; i++)
        if (h->entry[i].id == id)
            return &h->entry[i];
    return NULL;
}

static bool walk_behind_topic(const struct held *h, uint32_t topic, int64_t id)
{
    for (size_t i = 0; i < h->n; i++)
        if (h->entry[i].whole_topic && h->entry[i].topic == topic)
            return h->entry[i].id < id;
    return false;
}

/* Thousands of random holds, refusals of rows and topics, releases and
 * drops, each followed by lookups: the index (made once lookups come
 * often enough after a change) answers as a walk of the entries does. */
static void test_index_answers_as_a_walk(void **state)
{
    (void)state;
    struct held h = {.retry_backoff_ms = 100};
    static const char *const keys[] = {"a", "b", "c", "dd", "ee", "f0", "f1", "g", "", NULL};
    uint64_t seed = 12345;
#define RAND(n) ((int)((seed = seed * 6364136223846793005ULL + 1442695040888963407ULL) >> 33) % (n))
    int indexed_answers = 0;
    for (int step = 0; step < 4000; step++) {
        struct held_fx fx = {0};
        int64_t id = 1 + RAND(400);
        uint32_t topic = (uint32_t)RAND(3);
        const char *key = keys[RAND(10)];
        size_t key_len = key ? strlen(key) : 0;
        switch (RAND(10)) {
        case 0:
        case 1:
        case 2:
        case 3:
            held_hold_back(&h, id, topic, key, key_len, step, &fx);
            break;
        case 4:
            held_refused(&h, id, topic, key, key_len, step, &fx);
            break;
        case 5:
            if (RAND(4) == 0)
                held_topic_refused(&h, id, topic, "t", key, key_len, "refused", step, &fx);
            break;
        case 6:
            held_batch_refused(&h, id, topic, "t", key, key_len, "refused", step, &fx);
            break;
        case 7:
            if (h.n > 0)
                held_release(&h, h.entry[RAND((int)h.n)].id, &fx);
            break;
        default:
            if (h.n > 0)
                held_drop(&h, h.entry[RAND((int)h.n)].id, &fx);
            break;
        }
        for (int q = 0; q < 12; q++) {
            int64_t qid = 1 + RAND(420);
            uint32_t qtopic = (uint32_t)RAND(3);
            const char *qkey = keys[RAND(10)];
            size_t qlen = qkey ? strlen(qkey) : 0;
            assert_int_equal(held_holds(&h, qid, qtopic, qkey, qlen),
                             walk_holds(&h, qid, qtopic, qkey, qlen));
            assert_ptr_equal(held_find(&h, qid), walk_find(&h, qid));
            assert_int_equal(held_behind_topic(&h, qtopic, qid),
                             walk_behind_topic(&h, qtopic, qid));
            indexed_answers += h.indexed;
        }
    }
#undef RAND
    assert_true(h.n >= 16);              /* enough entries to be indexed */
    assert_true(indexed_answers > 1000); /* and the index answered */
    held_free(&h);
}

/* An allocator that lets `allowed` more mallocs and reallocs through and
 * refuses those after, while `allowed` is not negative; cmocka's checks
 * stay on. */
static int allowed = -1;

static bool refuse(void)
{
    if (allowed < 0)
        return false;
    if (allowed == 0)
        return true;
    allowed--;
    return false;
}

static void *refusing_malloc(size_t size)
{
    return refuse() ? NULL : _test_malloc(size, __FILE__, __LINE__);
}

static void *refusing_realloc(void *ptr, size_t size)
{
    return refuse() ? NULL : _test_realloc(ptr, size, __FILE__, __LINE__);
}

/* Out of memory while the index is made anew (smaller): lookups walk the
 * entries and answer right, and the index made later, larger again, has
 * tables of the size it uses (a table left smaller by a half-done change
 * was written past; AddressSanitizer's pass sees that). */
static void test_index_out_of_memory(void **state)
{
    (void)state;
    static const struct obx_allocator refuse = {refusing_malloc, cm_calloc, refusing_realloc,
                                                cm_free};
    obx_set_allocator(&refuse);
    struct held h = {.retry_backoff_ms = 100};
    struct held_fx fx;
    char key[16];
    for (int64_t id = 1; id <= 40; id++) {
        fx = (struct held_fx){0};
        int len = snprintf(key, sizeof(key), "k%d", (int)id);
        held_hold_back(&h, id, 0, key, (size_t)len, 0, &fx);
    }
    for (int i = 0; i < 10; i++)
        assert_non_null(held_find(&h, 7));
    assert_true(h.indexed);
    for (int64_t id = 40; id > 16; id--) {
        fx = (struct held_fx){0};
        held_drop(&h, id, &fx);
    }
    allowed = 1; /* of the two smaller tables, only the first can be had */
    for (int64_t id = 1; id <= 40; id++) {
        int len = snprintf(key, sizeof(key), "k%d", (int)id);
        assert_int_equal(held_find(&h, id) != NULL, id <= 16);
        assert_int_equal(held_holds(&h, id + 100, 0, key, (size_t)len), id <= 16);
    }
    assert_false(h.indexed);
    allowed = -1;
    for (int64_t id = 17; id <= 40; id++) {
        fx = (struct held_fx){0};
        int len = snprintf(key, sizeof(key), "k%d", (int)id);
        held_hold_back(&h, id, 0, key, (size_t)len, 0, &fx);
    }
    for (int64_t id = 1; id <= 40; id++) {
        int len = snprintf(key, sizeof(key), "k%d", (int)id);
        assert_non_null(held_find(&h, id));
        assert_true(held_holds(&h, id + 100, 0, key, (size_t)len));
        assert_false(held_holds(&h, id, 0, key, (size_t)len));
    }
    assert_true(h.indexed);
    held_free(&h);
    use_cmocka_allocator();
}

int main(void)
{
    use_cmocka_allocator(); /* leaks and double frees fail the test */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_key_held_and_released),
        cmocka_unit_test(test_due_alone),
        cmocka_unit_test(test_topic_held_as_one),
        cmocka_unit_test(test_index_answers_as_a_walk),
        cmocka_unit_test(test_index_out_of_memory),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
