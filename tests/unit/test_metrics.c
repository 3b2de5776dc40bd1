/*
 * Unit tests of the metrics registry and its Prometheus text rendering.
 */
#include "outboxd/metrics.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <setjmp.h>
#include <cmocka.h>

#include "cmocka_alloc.h"

/* What the modules own (kafka.c's counters, pg.c's histogram), here. */
static struct obx_labelled published, publish_errors;
static struct obx_histogram batch_rows;

static int setup(void **state)
{
    (void)state;
    obx_histogram_init_batch(&batch_rows);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    obx_labelled_free(&published);
    obx_labelled_free(&publish_errors);
    return 0;
}

static char *render(const struct obx_metrics_gauges *g)
{
    struct obx_buf b = {0};
    obx_metrics_render(&b, g);
    assert_false(b.oom);
    return b.data;
}

static void test_counters_by_label(void **state)
{
    (void)state;
    obx_labelled_inc(&published, "orders");
    obx_labelled_inc(&published, "orders");
    obx_labelled_inc(&published, "pay\"ments\\\n");
    obx_labelled_inc(&publish_errors, "MSG_SIZE_TOO_LARGE");
    struct obx_metrics_gauges g = {.published = &published,
                                   .publish_errors = &publish_errors,
                                   .backlog_rows = 7,
                                   .lag_seconds = 1.5,
                                   .in_flight_limit = 10};
    char *out = render(&g);
    assert_non_null(strstr(out, "outboxd_records_published_total{topic=\"orders\"} 2\n"));
    /* Quotes, backslashes and newlines in a label value are escaped. */
    assert_non_null(
        strstr(out, "outboxd_records_published_total{topic=\"pay\\\"ments\\\\\\n\"} 1\n"));
    assert_non_null(strstr(out, "outboxd_publish_errors_total{reason=\"MSG_SIZE_TOO_LARGE\"} 1\n"));
    assert_non_null(strstr(out, "# TYPE outboxd_records_published_total counter\n"));
    assert_non_null(strstr(out, "outboxd_outbox_backlog_rows 7\n"));
    assert_non_null(strstr(out, "outboxd_outbox_lag_seconds 1.5\n"));
    assert_non_null(strstr(out, "outboxd_rows_in_flight_limit 10\n"));
    obx_free(out);

    /* Unknown backlog and lag are left out rather than shown as 0. */
    g.backlog_rows = -1;
    g.lag_seconds = -1;
    out = render(&g);
    assert_null(strstr(out, "outboxd_outbox_backlog_rows "));
    assert_null(strstr(out, "outboxd_outbox_lag_seconds "));
    obx_free(out);
}

static void test_label_cap(void **state)
{
    char name[32];
    (void)state;
    for (int i = 0; i < OBX_LABELS_MAX + 10; i++) {
        snprintf(name, sizeof(name), "t%d", i);
        obx_labelled_inc(&published, name);
    }
    assert_int_equal(published.n, OBX_LABELS_MAX + 1);
    struct obx_metrics_gauges g = {.published = &published, .backlog_rows = -1, .lag_seconds = -1};
    char *out = render(&g);
    assert_non_null(strstr(out, "outboxd_records_published_total{topic=\"_other\"} 10\n"));
    obx_free(out);
}

static void test_histogram(void **state)
{
    (void)state;
    obx_histogram_observe(&batch_rows, 1);    /* le 1 */
    obx_histogram_observe(&batch_rows, 1000); /* le 1000 */
    obx_histogram_observe(&batch_rows, 1e9);  /* +Inf only */
    struct obx_metrics_gauges g = {.batch_rows = &batch_rows,
                                   .backlog_rows = -1,
                                   .lag_seconds = -1,
                                   .fetches_keyset = 41,
                                   .fetches_full = 2};
    char *out = render(&g);
    assert_non_null(strstr(out, "outboxd_fetches_total{kind=\"keyset\"} 41\n"));
    assert_non_null(strstr(out, "outboxd_fetches_total{kind=\"full\"} 2\n"));
    assert_non_null(strstr(out, "outboxd_fetch_batch_rows_bucket{le=\"1\"} 1\n"));
    assert_non_null(strstr(out, "outboxd_fetch_batch_rows_bucket{le=\"500\"} 1\n"));
    assert_non_null(strstr(out, "outboxd_fetch_batch_rows_bucket{le=\"1000\"} 2\n"));
    assert_non_null(strstr(out, "outboxd_fetch_batch_rows_bucket{le=\"10000\"} 2\n"));
    assert_non_null(strstr(out, "outboxd_fetch_batch_rows_bucket{le=\"+Inf\"} 3\n"));
    assert_non_null(strstr(out, "outboxd_fetch_batch_rows_count 3\n"));
    assert_non_null(strstr(out, "outboxd_fetch_batch_rows_sum 1000001001\n"));
    obx_free(out);
}

/* relay.shards: the backlog by slot, one series each, the lag in seconds;
 * none while unknown (slot_count 0). */
static void test_backlog_by_slot(void **state)
{
    (void)state;
    const int64_t rows[3] = {0, 12, 0}, lag_ms[3] = {0, 2500, 0};
    struct obx_metrics_gauges g = {.published = &published,
                                   .publish_errors = &publish_errors,
                                   .backlog_rows = 12,
                                   .lag_seconds = 2.5,
                                   .slot_count = 3,
                                   .slot_backlog_rows = rows,
                                   .slot_lag_ms = lag_ms};
    char *out = render(&g);
    assert_non_null(strstr(out, "# TYPE outboxd_slot_backlog_rows gauge\n"));
    assert_non_null(strstr(out, "outboxd_slot_backlog_rows{slot=\"0\"} 0\n"));
    assert_non_null(strstr(out, "outboxd_slot_backlog_rows{slot=\"1\"} 12\n"));
    assert_non_null(strstr(out, "outboxd_slot_backlog_rows{slot=\"2\"} 0\n"));
    assert_non_null(strstr(out, "outboxd_slot_lag_seconds{slot=\"1\"} 2.500\n"));
    assert_non_null(strstr(out, "outboxd_slot_lag_seconds{slot=\"2\"} 0.000\n"));
    assert_null(strstr(out, "{slot=\"3\"}"));
    obx_free(out);

    g.slot_count = 0;
    out = render(&g);
    assert_null(strstr(out, "outboxd_slot_backlog_rows"));
    assert_null(strstr(out, "outboxd_slot_lag_seconds"));
    obx_free(out);
}

#define TESTS(X)                                                                                   \
    X(test_counters_by_label)                                                                      \
    X(test_label_cap)                                                                              \
    X(test_histogram)                                                                              \
    X(test_backlog_by_slot)

OBX_FIXTURE_MAIN(TESTS)
