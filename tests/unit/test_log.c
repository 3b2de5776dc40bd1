/*
 * Unit tests of the log module: one line per call, control characters
 * escaped (a topic or key holding a newline cannot forge a line), JSON
 * lines well-formed.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include "cmocka_alloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "outboxd/log.h"

/* Runs obx_log_write with stderr sent to a temporary file; returns what was
 * written (static buffer). */
static const char *capture_event(enum obx_log_format format, const char *topic, const char *event)
{
    static char out[4096];
    char path[] = "/tmp/obx-test-log-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    int saved = dup(STDERR_FILENO);
    assert_true(dup2(fd, STDERR_FILENO) >= 0);
    obx_log_setup(OBX_LOG_INFO, format);
    if (event)
        obx_event(OBX_LOG_INFO, event, "relay: row 7 (topic %s) refused", topic);
    else
        obx_info("relay: row 7 (topic %s) refused", topic);
    dup2(saved, STDERR_FILENO);
    close(saved);
    ssize_t n = pread(fd, out, sizeof(out) - 1, 0);
    close(fd);
    unlink(path);
    out[n > 0 ? n : 0] = '\0';
    return out;
}

static const char *capture(enum obx_log_format format, const char *topic)
{
    return capture_event(format, topic, NULL);
}

static size_t count_newlines(const char *s)
{
    size_t n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

static void test_text_escapes_controls(void **state)
{
    (void)state;
    const char *line = capture(OBX_LOG_TEXT, "a\nZ error forged\r\x1b[31m");
    assert_int_equal(count_newlines(line), 1);
    assert_non_null(strstr(line, "topic a\\x0aZ error forged\\x0d\\x1b[31m)"));
}

static void test_json_escapes_controls(void **state)
{
    (void)state;
    const char *line = capture(OBX_LOG_JSON, "a\nb\"c");
    assert_int_equal(count_newlines(line), 1);
    assert_non_null(strstr(line, "topic a\\nb\\\"c)"));
}

static void test_plain_text_unchanged(void **state)
{
    (void)state;
    const char *line = capture(OBX_LOG_TEXT, "orders.v1 ünï");
    assert_non_null(strstr(line, "info  relay: row 7 (topic orders.v1 ünï) refused\n"));
}

/* An event's name is a field of its JSON line (what tests and log tools
 * wait for); the text line is the message alone. */
static void test_event_field(void **state)
{
    (void)state;
    const char *line = capture_event(OBX_LOG_JSON, "t", "tried_alone");
    assert_non_null(strstr(line, "\",\"level\":\"info\",\"event\":\"tried_alone\",\"msg\":\"relay: "
                                 "row 7 (topic t) refused\"}\n"));
    line = capture(OBX_LOG_JSON, "t");
    assert_null(strstr(line, "\"event\""));
    line = capture_event(OBX_LOG_TEXT, "t", "tried_alone");
    assert_non_null(strstr(line, "info  relay: row 7 (topic t) refused\n"));
    assert_null(strstr(line, "tried_alone"));
}

int main(void)
{
    use_cmocka_allocator();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_text_escapes_controls),
        cmocka_unit_test(test_json_escapes_controls),
        cmocka_unit_test(test_plain_text_unchanged),
        cmocka_unit_test(test_event_field),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
