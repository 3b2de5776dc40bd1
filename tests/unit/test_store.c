/* The statements' parameter contracts: every "$N" in a statement's SQL is
 * one of its declared parameters, written with the type its table says
 * ("$N::type"), and every declared parameter is used. A parameter moved in
 * the SQL but not in its enum (or the other way round) fails here, not as
 * a wrong value at run time. */
#include "outboxd/config.h"
#include "outboxd/store.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <setjmp.h>
#include <cmocka.h>

static bool is_type_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '[' || c == ']';
}

/* Checks one statement; returns the number of problems (each printed). */
static int check_statement(const struct obx_store_statement *st)
{
    int problems = 0;
    bool used[64] = {false};
    assert_true(st->nparams > 0 && st->nparams < 64);
    for (const char *p = strchr(st->sql, '$'); p; p = strchr(p + 1, '$')) {
        char *end;
        long n = strtol(p + 1, &end, 10);
        if (end == p + 1)
            continue; /* a dollar quote: no number */
        if (n < 1 || n > st->nparams) {
            print_error("%s: $%ld, but it takes %d parameters\n", st->name, n, st->nparams);
            problems++;
            continue;
        }
        const struct obx_store_param *want = &st->params[n - 1];
        assert_non_null(want->type); /* every index of the table has an entry */
        used[n - 1] = true;
        size_t len = 0;
        if (strncmp(end, "::", 2) == 0)
            while (is_type_char(end[2 + len]))
                len++;
        if (len == 0) {
            print_error("%s: $%ld (%s) has no ::%s\n", st->name, n, want->name, want->type);
            problems++;
        } else if (len != strlen(want->type) || strncmp(end + 2, want->type, len) != 0) {
            print_error("%s: $%ld (%s) is written as ::%.*s, its table says %s\n", st->name, n,
                        want->name, (int)len, end + 2, want->type);
            problems++;
        }
    }
    for (int i = 0; i < st->nparams; i++) {
        if (!used[i]) {
            print_error("%s: parameter $%d (%s) is never used\n", st->name, i + 1,
                        st->params[i].name);
            problems++;
        }
    }
    return problems;
}

static void test_every_parameter_typed_as_declared(void **state)
{
    (void)state;
    static const int modes[] = {OBX_ON_SENT_MARK, OBX_ON_SENT_DELETE, OBX_ON_SENT_LOG};
    for (size_t m = 0; m < sizeof(modes) / sizeof(modes[0]); m++) {
        struct obx_store_statement st[OBX_STORE_MAX_STATEMENTS];
        int n = obx_store_statements(modes[m], st);
        assert_true(n >= 19 && n <= OBX_STORE_MAX_STATEMENTS);
        int problems = 0;
        for (int i = 0; i < n; i++) {
            assert_non_null(st[i].sql);
            problems += check_statement(&st[i]);
        }
        assert_int_equal(problems, 0);
    }
}

/* The checker itself finds a wrong type, a number out of range and an
 * unused parameter. */
static void test_checker_finds_mistakes(void **state)
{
    (void)state;
    static const struct obx_store_param two[] = {{"a", "bigint"}, {"b", "text[]"}};
    struct obx_store_statement ok = {"ok", "SELECT $1::bigint, $2::text[], $$x$$", two, 2};
    assert_int_equal(check_statement(&ok), 0);
    struct obx_store_statement wrong = {"wrong", "SELECT $1::int, $2::text[]", two, 2};
    assert_int_equal(check_statement(&wrong), 1);
    struct obx_store_statement bare = {"bare", "SELECT $1, $2::text[]", two, 2};
    assert_int_equal(check_statement(&bare), 1);
    struct obx_store_statement beyond = {"beyond", "SELECT $1::bigint, $2::text[], $3", two, 2};
    assert_int_equal(check_statement(&beyond), 1);
    struct obx_store_statement unused = {"unused", "SELECT $1::bigint", two, 2};
    assert_int_equal(check_statement(&unused), 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_parameter_typed_as_declared),
        cmocka_unit_test(test_checker_finds_mistakes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
