/*
 * Unit tests of the row -> Kafka record mapping: the headers object,
 * header encoding (DESIGN 1.2) and reading rows of a binary fetch result.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include "cmocka_alloc.h"

#include <string.h>

#include "outboxd/record.h"

static char err[256];

/* The row's headers as jsonb prints them. */
static void with_headers(struct obx_row *row, const char *json)
{
    row->headers = json;
    row->headers_len = strlen(json);
}

static void test_headers(void **state)
{
    (void)state;
    struct obx_headers scratch = {0};
    struct obx_row row = {.id = 9007199254740993LL, .topic = "t"};
    with_headers(&row, "{\"n\": 42, \"empty\": \"\", \"traceparent\": "
                       "\"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\"}");
    rd_kafka_headers_t *h = NULL;
    assert_int_equal(obx_record_headers(&row, NULL, &scratch, &h, err, sizeof(err)), 0);
    assert_non_null(h);
    assert_int_equal(rd_kafka_header_cnt(h), 4);
    const char *name;
    const void *val;
    size_t len;
    /* outbox-id comes first, in decimal ASCII. */
    assert_int_equal(rd_kafka_header_get_all(h, 0, &name, &val, &len), 0);
    assert_string_equal(name, "outbox-id");
    assert_int_equal(len, strlen("9007199254740993"));
    assert_memory_equal(val, "9007199254740993", len);
    /* Then the members in byte order of their keys (COLLATE "C"). */
    assert_int_equal(rd_kafka_header_get_all(h, 1, &name, &val, &len), 0);
    assert_string_equal(name, "empty");
    assert_int_equal(len, 0);
    assert_int_equal(rd_kafka_header_get_all(h, 2, &name, &val, &len), 0);
    assert_string_equal(name, "n");
    assert_memory_equal(val, "42", 2);
    assert_int_equal(rd_kafka_header_get_last(h, "traceparent", &val, &len), 0);
    assert_memory_equal(val, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", len);
    rd_kafka_headers_destroy(h);
    obx_headers_free(&scratch);
}

/* Every JSON shape jsonb prints: escapes unescaped (\u with surrogate
 * pairs too), non-string values as their JSON text, nesting kept as text,
 * keys sorted by bytes, also past shorter prefixes. */
static void test_headers_parse(void **state)
{
    (void)state;
    struct obx_headers h = {0};
    static const char json[] =
        "{\"b\": \"x\\\"y\\\\z\\n\\t\\u0001\\u00e9\\ud83d\\ude00/\", \"a\": null, \"ab\": true,"
        " \"a\\u00e9\": 1.5e+10, \"nested\": {\"k\": [1, \"]\", {\"x\": \"}\"}]}, \"arr\": [],"
        " \"\\u00c9\": -0.25}";
    assert_int_equal(obx_headers_parse(json, strlen(json), &h, err, sizeof(err)), 0);
    assert_int_equal(h.n, 7);
    static const char *const keys[] = {"a", "ab", "arr", "a\xc3\xa9", "b", "nested", "\xc3\x89"};
    static const char *const vals[] = {"null",
                                       "true",
                                       "[]",
                                       "1.5e+10",
                                       "x\"y\\z\n\t\x01\xc3\xa9\xf0\x9f\x98\x80/",
                                       "{\"k\": [1, \"]\", {\"x\": \"}\"}]}",
                                       "-0.25"};
    for (size_t i = 0; i < 7; i++) {
        assert_int_equal(h.v[i].key_len, strlen(keys[i]));
        assert_memory_equal(h.v[i].key, keys[i], h.v[i].key_len);
        assert_int_equal(h.v[i].value_len, strlen(vals[i]));
        assert_memory_equal(h.v[i].value, vals[i], h.v[i].value_len);
    }
    assert_int_equal(obx_headers_parse("{}", 2, &h, err, sizeof(err)), 0);
    assert_int_equal(h.n, 0);
    static const char *const bad[] = {"",
                                      "[]",
                                      "{",
                                      "{\"a\"}",
                                      "{\"a\": }",
                                      "{\"a\": 1,}",
                                      "{\"a\": \"x}",
                                      "{\"a\": \"\\ud800\"}",
                                      "{\"a\": [1}",
                                      "{} x",
                                      "{\"a\": \"\\q\"}"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        if (obx_headers_parse(bad[i], strlen(bad[i]), &h, err, sizeof(err)) != -1)
            fail_msg("accepted malformed headers %s", bad[i]);
    obx_headers_free(&h);
}

static void test_headers_none_and_malformed(void **state)
{
    (void)state;
    struct obx_headers scratch = {0};
    struct obx_row row = {.id = 1, .topic = "t"};
    rd_kafka_headers_t *h = NULL;
    assert_int_equal(obx_record_headers(&row, NULL, &scratch, &h, err, sizeof(err)), 0);
    assert_int_equal(rd_kafka_header_cnt(h), 1);
    rd_kafka_headers_destroy(h);
    with_headers(&row, "{\"a\": 1");
    h = NULL;
    assert_int_equal(obx_record_headers(&row, NULL, &scratch, &h, err, sizeof(err)), -1);
    assert_null(h);
    assert_non_null(strstr(err, "row 1: headers:"));
    obx_headers_free(&scratch);
}

/* The header named `name` at index `idx` (0-based) has `value`. */
static void header_is(rd_kafka_headers_t *h, size_t idx, const char *name, const char *value)
{
    const char *n;
    const void *v;
    size_t len;
    assert_int_equal(rd_kafka_header_get_all(h, idx, &n, &v, &len), 0);
    assert_string_equal(n, name);
    assert_int_equal(len, strlen(value));
    assert_memory_equal(v, value, len);
}

/* record.format = cloudevents: outbox-id, then the CloudEvents attributes
 * (id = the outbox id, source configured, type = the topic, time =
 * created_at); a row's own ce_type and ce_source win, its ce_id does not. */
static void test_headers_cloudevents(void **state)
{
    (void)state;
    struct obx_headers scratch = {0};
    const struct obx_record_opts ce = {.format = OBX_RECORD_CLOUDEVENTS, .ce_source = "/orders"};
    struct obx_row row = {.id = 77, .topic = "orders", .created_us = 1764589396123456};
    rd_kafka_headers_t *h = NULL;
    assert_int_equal(obx_record_headers(&row, &ce, &scratch, &h, err, sizeof(err)), 0);
    assert_int_equal(rd_kafka_header_cnt(h), 6);
    header_is(h, 0, "outbox-id", "77");
    header_is(h, 1, "ce_specversion", "1.0");
    header_is(h, 2, "ce_id", "77");
    header_is(h, 3, "ce_source", "/orders");
    header_is(h, 4, "ce_type", "orders");
    header_is(h, 5, "ce_time", "2025-12-01T11:43:16.123456Z");
    rd_kafka_headers_destroy(h);

    with_headers(&row, "{\"ce_id\": \"forged\", \"ce_type\": \"order.created\","
                       " \"content-type\": \"application/json\"}");
    row.created_us = 0; /* unknown: no ce_time */
    assert_int_equal(obx_record_headers(&row, &ce, &scratch, &h, err, sizeof(err)), 0);
    assert_int_equal(rd_kafka_header_cnt(h), 6);
    header_is(h, 2, "ce_id", "77");
    header_is(h, 3, "ce_source", "/orders");
    header_is(h, 4, "ce_type", "order.created");
    header_is(h, 5, "content-type", "application/json");
    rd_kafka_headers_destroy(h);

    /* The session's history comes second, in either format. */
    struct obx_record_opts with_history = ce;
    with_history.history = "7716322586255596421.2";
    assert_int_equal(obx_record_headers(&row, &with_history, &scratch, &h, err, sizeof(err)), 0);
    assert_int_equal(rd_kafka_header_cnt(h), 7);
    header_is(h, 0, "outbox-id", "77");
    header_is(h, 1, "outbox-history", "7716322586255596421.2");
    header_is(h, 2, "ce_specversion", "1.0");
    rd_kafka_headers_destroy(h);
    with_history.format = OBX_RECORD_PLAIN;
    assert_int_equal(obx_record_headers(&row, &with_history, &scratch, &h, err, sizeof(err)), 0);
    assert_int_equal(rd_kafka_header_cnt(h), 5);
    header_is(h, 1, "outbox-history", "7716322586255596421.2");
    header_is(h, 2, "ce_id", "forged");
    rd_kafka_headers_destroy(h);
    with_history.history = ""; /* unknown: no header */
    assert_int_equal(obx_record_headers(&row, &with_history, &scratch, &h, err, sizeof(err)), 0);
    assert_int_equal(rd_kafka_header_cnt(h), 4);
    header_is(h, 1, "ce_id", "forged");
    rd_kafka_headers_destroy(h);
    obx_headers_free(&scratch);
}

static void test_rfc3339(void **state)
{
    (void)state;
    char buf[40];
    assert_int_equal(obx_format_rfc3339(0, buf, sizeof(buf)), 27);
    assert_string_equal(buf, "1970-01-01T00:00:00.000000Z");
    obx_format_rfc3339(951782400000001, buf, sizeof(buf)); /* a leap day */
    assert_string_equal(buf, "2000-02-29T00:00:00.000001Z");
    obx_format_rfc3339(-1, buf, sizeof(buf));
    assert_string_equal(buf, "1969-12-31T23:59:59.999999Z");
}

static void test_format_id(void **state)
{
    (void)state;
    char buf[24];
    assert_int_equal(obx_format_id(0, buf), 1);
    assert_string_equal(buf, "0");
    assert_int_equal(obx_format_id(INT64_MAX, buf), 19);
    assert_string_equal(buf, "9223372036854775807");
    assert_int_equal(obx_format_id(1234567890, buf), 10);
    assert_string_equal(buf, "1234567890");
    assert_int_equal(obx_format_id(-1, buf), 2);
    assert_string_equal(buf, "-1");
    assert_int_equal(obx_format_id(INT64_MIN, buf), 20);
    assert_string_equal(buf, "-9223372036854775808");
}

/* What obx_format_id writes reads back; anything else, overflow included,
 * is no id (the recovery pass then matches no row with it). */
static void test_parse_id(void **state)
{
    (void)state;
    static const int64_t ids[] = {0, 1, -1, 42, -5, INT64_MAX, INT64_MIN, INT64_MIN + 1};
    char buf[24];
    for (size_t i = 0; i < sizeof(ids) / sizeof(ids[0]); i++) {
        int64_t back = 7;
        size_t n = obx_format_id(ids[i], buf);
        assert_true(obx_parse_id(buf, n, &back));
        assert_true(back == ids[i]);
    }
    static const char *const bad[] = {"",
                                      "-",
                                      "+1",
                                      " 1",
                                      "1 ",
                                      "1a",
                                      "0x1",
                                      "9223372036854775808",
                                      "-9223372036854775809",
                                      "99999999999999999999",
                                      "--1",
                                      "1-"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int64_t v;
        if (obx_parse_id(bad[i], strlen(bad[i]), &v))
            fail_msg("'%s' read as an id", bad[i]);
    }
}

/* Rows read from a binary result built with libpq's PQsetvalue. */
static void test_row_from_result(void **state)
{
    (void)state;
    PGresult *res = PQmakeEmptyPGresult(NULL, PGRES_TUPLES_OK);
    PGresAttDesc attrs[OBX_COL_COUNT];
    static const char *names[] = {"id",         "topic",     "key",      "payload", "headers",
                                  "created_at", "row_bytes", "snapshot", "slot"};
    memset(attrs, 0, sizeof(attrs));
    for (int i = 0; i < OBX_COL_COUNT; i++) {
        attrs[i].name = (char *)names[i];
        attrs[i].format = 1;
    }
    assert_int_equal(PQsetResultAttrs(res, OBX_COL_COUNT, attrs), 1);
    char id[8] = {0, 0, 0, 1, 0, 0, 0, 2}; /* 4294967298 */
    char payload[3] = {'a', 0, 'b'};
    static const char headers[] = "\x01{\"h\": \"v\"}"; /* jsonb binary: version 1 */
    assert_int_equal(PQsetvalue(res, 0, OBX_COL_ID, id, 8), 1);
    assert_int_equal(PQsetvalue(res, 0, OBX_COL_TOPIC, "orders", 6), 1);
    assert_int_equal(PQsetvalue(res, 0, OBX_COL_KEY, NULL, -1), 1);
    assert_int_equal(PQsetvalue(res, 0, OBX_COL_PAYLOAD, payload, 3), 1);
    assert_int_equal(PQsetvalue(res, 0, OBX_COL_HEADERS, (char *)headers, (int)strlen(headers)), 1);
    /* 2026-01-01T00:00:00Z as Postgres sends it: microseconds since 2000. */
    char created[8] = {(char)0x00, (char)0x02, (char)0xea, (char)0x47,
                       (char)0x0a, (char)0xe8, (char)0x60, (char)0x00};
    assert_int_equal(PQsetvalue(res, 0, OBX_COL_CREATED_AT, created, 8), 1);
    char size17[8] = {0, 0, 0, 0, 0, 0, 0, 17}; /* as Postgres stores them: not the text's */
    assert_int_equal(PQsetvalue(res, 0, OBX_COL_ROW_BYTES, size17, 8), 1);

    struct obx_row row;
    assert_int_equal(obx_row_from_result(res, 0, &row, err, sizeof(err)), 0);
    assert_int_equal(row.id, 4294967298LL);
    assert_string_equal(row.topic, "orders");
    assert_null(row.key);
    assert_int_equal(row.payload_len, 3);
    assert_memory_equal(row.payload, payload, 3);
    assert_int_equal(row.headers_len, strlen(headers) - 1);
    assert_memory_equal(row.headers, "{\"h\": \"v\"}", row.headers_len);
    assert_int_equal(row.created_us, 1767225600000000LL);
    assert_false(row.oversize);
    assert_int_equal(row.bytes, 17);
    assert_false(row.has_slot); /* NULL: the fetch did not say */

    /* A NULL payload beside headers: a tombstone. */
    assert_int_equal(PQsetvalue(res, 1, OBX_COL_ID, id, 8), 1);
    assert_int_equal(PQsetvalue(res, 1, OBX_COL_TOPIC, "t", 1), 1);
    assert_int_equal(PQsetvalue(res, 1, OBX_COL_KEY, "kk", 2), 1);
    assert_int_equal(PQsetvalue(res, 1, OBX_COL_PAYLOAD, NULL, -1), 1);
    assert_int_equal(PQsetvalue(res, 1, OBX_COL_HEADERS, (char *)"\x01{}", 3), 1);
    char size7[8] = {0, 0, 0, 0, 0, 0, 0, 7};
    assert_int_equal(PQsetvalue(res, 1, OBX_COL_ROW_BYTES, size7, 8), 1);
    assert_int_equal(obx_row_from_result(res, 1, &row, err, sizeof(err)), 0);
    assert_null(row.payload);
    assert_int_equal(row.payload_len, 0);
    assert_false(row.oversize);
    assert_int_equal(row.headers_len, 2);
    assert_int_equal(row.bytes, 7);

    /* Without payload and headers (never NULL in a row): too large, not
     * fetched. */
    char size5g[8] = {0, 0, 0, 0x01, 0x2a, 0x05, (char)0xf2, 0x00}; /* 5,000,000,000 */
    assert_int_equal(PQsetvalue(res, 2, OBX_COL_ID, id, 8), 1);
    assert_int_equal(PQsetvalue(res, 2, OBX_COL_TOPIC, "t", 1), 1);
    assert_int_equal(PQsetvalue(res, 2, OBX_COL_PAYLOAD, NULL, -1), 1);
    assert_int_equal(PQsetvalue(res, 2, OBX_COL_ROW_BYTES, size5g, 8), 1);
    char slot5[4] = {0, 0, 0, 5};
    assert_int_equal(PQsetvalue(res, 2, OBX_COL_SLOT, slot5, 4), 1);
    assert_int_equal(obx_row_from_result(res, 2, &row, err, sizeof(err)), 0);
    assert_true(row.has_slot);
    assert_int_equal(row.slot, 5);
    assert_true(row.oversize);
    assert_null(row.payload);
    assert_null(row.headers);
    assert_int_equal(row.bytes, 5000000000LL);

    /* An 8-byte id is required. */
    assert_int_equal(PQsetvalue(res, 3, OBX_COL_ID, id, 4), 1);
    assert_int_equal(PQsetvalue(res, 3, OBX_COL_TOPIC, "t", 1), 1);
    assert_int_equal(obx_row_from_result(res, 3, &row, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "row 3"));

    /* A payload without headers, no size, or a size that is not a bigint:
     * refused. */
    assert_int_equal(PQsetvalue(res, 4, OBX_COL_ID, id, 8), 1);
    assert_int_equal(PQsetvalue(res, 4, OBX_COL_TOPIC, "t", 1), 1);
    assert_int_equal(PQsetvalue(res, 4, OBX_COL_PAYLOAD, payload, 3), 1);
    assert_int_equal(PQsetvalue(res, 4, OBX_COL_ROW_BYTES, size5g, 8), 1);
    assert_int_equal(obx_row_from_result(res, 4, &row, err, sizeof(err)), -1);
    assert_int_equal(PQsetvalue(res, 4, OBX_COL_PAYLOAD, NULL, -1), 1);
    assert_int_equal(PQsetvalue(res, 4, OBX_COL_ROW_BYTES, NULL, -1), 1);
    assert_int_equal(obx_row_from_result(res, 4, &row, err, sizeof(err)), -1);
    assert_int_equal(PQsetvalue(res, 4, OBX_COL_ROW_BYTES, size5g, 4), 1);
    assert_int_equal(obx_row_from_result(res, 4, &row, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "row 4"));
    PQclear(res);
}

int main(void)
{
    use_cmocka_allocator();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_headers),
        cmocka_unit_test(test_headers_parse),
        cmocka_unit_test(test_headers_none_and_malformed),
        cmocka_unit_test(test_headers_cloudevents),
        cmocka_unit_test(test_rfc3339),
        cmocka_unit_test(test_format_id),
        cmocka_unit_test(test_parse_id),
        cmocka_unit_test(test_row_from_result),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
