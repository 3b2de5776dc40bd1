/*
 * Unit tests of the small encoders the statements depend on: Postgres array
 * literals for parameters, the SHA-256 hex used to recognise our records in
 * recovery, and the text check for record keys.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include "cmocka_alloc.h"

#include <string.h>

#include "outboxd/pg.h"
#include "outboxd/recovery.h"

static void test_array_literals(void **state)
{
    (void)state;
    struct obx_pg_array a = {0};
    obx_pg_array_reset(&a);
    assert_string_equal(obx_pg_array_finish(&a), "{}");

    obx_pg_array_reset(&a);
    obx_pg_array_add_int(&a, 1);
    obx_pg_array_add_int(&a, -9223372036854775807LL - 1);
    obx_pg_array_add_int(&a, 42);
    assert_string_equal(obx_pg_array_finish(&a), "{1,-9223372036854775808,42}");

    /* Text is always quoted; quotes and backslashes escaped; NULL unquoted;
     * commas, braces and spaces need nothing more. */
    obx_pg_array_reset(&a);
    obx_pg_array_add_text(&a, "plain", 5);
    obx_pg_array_add_text(&a, NULL, 0);
    obx_pg_array_add_text(&a, "a\"b\\c", 5);
    obx_pg_array_add_text(&a, "{x, y}", 6);
    obx_pg_array_add_text(&a, "NULL", 4);
    obx_pg_array_add_text(&a, "", 0);
    assert_string_equal(obx_pg_array_finish(&a),
                        "{\"plain\",NULL,\"a\\\"b\\\\c\",\"{x, y}\",\"NULL\",\"\"}");

    /* Ranges: runs of consecutive ids, in order, whatever order they came
     * in; a gap (a row that came late, a rolled-back id) starts a new one. */
    int64_t ids[] = {7, 5, 6, 9, 12, 11, 10, 6, 20, -1, 0};
    obx_pg_array_reset(&a);
    obx_pg_array_add_ranges(&a, ids, sizeof(ids) / sizeof(ids[0]));
    assert_string_equal(obx_pg_array_finish(&a), "{{-1,0},{5,7},{9,12},{20,20}}");
    obx_pg_array_reset(&a);
    obx_pg_array_add_ranges(&a, ids, 0);
    assert_string_equal(obx_pg_array_finish(&a), "{}");

    /* Reuse keeps working and grows as needed. */
    obx_pg_array_reset(&a);
    for (int i = 0; i < 10000; i++)
        obx_pg_array_add_int(&a, i);
    const char *big = obx_pg_array_finish(&a);
    assert_non_null(big);
    assert_int_equal(big[0], '{');
    assert_non_null(strstr(big, ",9999}"));
    obx_pg_array_free(&a);
}

static void test_sha256_hex(void **state)
{
    (void)state;
    char hex[65];
    /* FIPS 180-2 test vector, as Postgres: encode(sha256('abc'), 'hex'). */
    assert_int_equal(obx_sha256_hex("abc", 3, hex), 0);
    assert_string_equal(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    assert_int_equal(obx_sha256_hex("", 0, hex), 0);
    assert_string_equal(hex, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

static void test_valid_text(void **state)
{
    (void)state;
    assert_true(obx_valid_text("order-42", 8));
    assert_true(obx_valid_text("", 0));
    assert_true(obx_valid_text("gr\xc3\xbc\xc3\x9f", 6)); /* grüß */
    assert_true(obx_valid_text("\xf0\x9f\x93\xa6", 4));   /* U+1F4E6 */
    assert_false(obx_valid_text("a\0b", 3));              /* NUL */
    assert_false(obx_valid_text("\xc3", 1));              /* truncated */
    assert_false(obx_valid_text("\xc0\xaf", 2));          /* overlong */
    assert_false(obx_valid_text("\xed\xa0\x80", 3));      /* surrogate */
    assert_false(obx_valid_text("\xf4\x90\x80\x80", 4));  /* > U+10FFFF */
    assert_false(obx_valid_text("\xff", 1));
}

int main(void)
{
    use_cmocka_allocator();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_array_literals),
        cmocka_unit_test(test_sha256_hex),
        cmocka_unit_test(test_valid_text),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
