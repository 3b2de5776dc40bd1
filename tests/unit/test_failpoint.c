/*
 * Unit tests of the failpoint spec parser and of the actions.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include "cmocka_alloc.h"

#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "outboxd/failpoint.h"

static char err[256];

static void test_parse_good(void **state)
{
    struct obx_failpoints fps;
    (void)state;
    assert_int_equal(obx_failpoints_parse(&fps, NULL, err, sizeof(err)), 0);
    assert_int_equal(fps.armed, 0);
    assert_int_equal(obx_failpoints_parse(&fps, "", err, sizeof(err)), 0);
    assert_int_equal(fps.armed, 0);

    assert_int_equal(obx_failpoints_parse(&fps,
                                          "fetch.after=crash;ack.after=crash@3;"
                                          "mark.before_commit=error;produce.after=sleep(25)",
                                          err, sizeof(err)),
                     0);
    assert_int_equal(fps.armed, 1);
    assert_int_equal(fps.entry[OBX_FP_FETCH_AFTER].action, OBX_FP_CRASH);
    assert_int_equal(fps.entry[OBX_FP_FETCH_AFTER].arg, 1);
    assert_int_equal(fps.entry[OBX_FP_ACK_AFTER].action, OBX_FP_CRASH);
    assert_int_equal(fps.entry[OBX_FP_ACK_AFTER].arg, 3);
    assert_int_equal(fps.entry[OBX_FP_MARK_BEFORE_COMMIT].action, OBX_FP_ERROR);
    assert_int_equal(fps.entry[OBX_FP_PRODUCE_AFTER].action, OBX_FP_SLEEP);
    assert_int_equal(fps.entry[OBX_FP_PRODUCE_AFTER].arg, 25);
    assert_int_equal(fps.entry[OBX_FP_MARK_AFTER_COMMIT].action, OBX_FP_OFF);

    assert_int_equal(obx_failpoints_parse(&fps, "fetch.after=error@2", err, sizeof(err)), 0);
    assert_int_equal(fps.entry[OBX_FP_FETCH_AFTER].action, OBX_FP_ERROR);
    assert_int_equal(fps.entry[OBX_FP_FETCH_AFTER].arg, 2);
    assert_int_equal(obx_failpoints_parse(&fps,
                                          "recover.after_scan=crash;recover.before_commit=error",
                                          err, sizeof(err)),
                     0);
    assert_int_equal(fps.entry[OBX_FP_RECOVER_AFTER_SCAN].action, OBX_FP_CRASH);
    assert_int_equal(fps.entry[OBX_FP_RECOVER_BEFORE_COMMIT].action, OBX_FP_ERROR);

    /* Empty parts (trailing ;) are ignored. */
    assert_int_equal(obx_failpoints_parse(&fps, "mark.after_commit=error;", err, sizeof(err)), 0);
    assert_int_equal(fps.entry[OBX_FP_MARK_AFTER_COMMIT].action, OBX_FP_ERROR);
}

static void test_parse_bad(void **state)
{
    struct obx_failpoints fps;
    (void)state;
    static const struct {
        const char *spec, *msg;
    } cases[] = {
        {"fetch.before=crash", "unknown failpoint 'fetch.before'"},
        {"fetch.after", "'fetch.after' is not name=action"},
        {"fetch.after=explode", "bad action 'explode' for fetch.after"},
        {"fetch.after=crash@0", "bad action 'crash@0'"},
        {"fetch.after=crash@x", "bad action 'crash@x'"},
        {"fetch.after=error@0", "bad action 'error@0'"},
        {"fetch.after=sleep(", "bad action 'sleep('"},
        {"fetch.after=sleep(1x)", "bad action 'sleep(1x)'"},
        {"ack.after=error;fetch.after=", "bad action '' for fetch.after"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        assert_int_equal(obx_failpoints_parse(&fps, cases[i].spec, err, sizeof(err)), -1);
        if (!strstr(err, cases[i].msg))
            fail_msg("spec '%s': got '%s', expected '%s'", cases[i].spec, err, cases[i].msg);
        assert_int_equal(fps.armed, 0); /* nothing half-armed after an error */
    }
}

static void test_error_and_sleep(void **state)
{
    struct obx_failpoints fps;
    struct timespec a, b;
    (void)state;
    assert_int_equal(
        obx_failpoints_parse(&fps, "fetch.after=error;ack.after=sleep(30)", err, sizeof(err)), 0);
    assert_int_equal(obx_failpoint_reach(&fps, OBX_FP_FETCH_AFTER), -1);
    assert_int_equal(obx_failpoint_reach(&fps, OBX_FP_FETCH_AFTER), -1); /* every hit */
    assert_int_equal(obx_failpoint_reach(&fps, OBX_FP_MARK_AFTER_COMMIT), 0);
    clock_gettime(CLOCK_MONOTONIC, &a);
    assert_int_equal(obx_failpoint_reach(&fps, OBX_FP_ACK_AFTER), 0);
    clock_gettime(CLOCK_MONOTONIC, &b);
    long ms = (b.tv_sec - a.tv_sec) * 1000 + (b.tv_nsec - a.tv_nsec) / 1000000;
    assert_true(ms >= 30);
    assert_int_equal(fps.entry[OBX_FP_FETCH_AFTER].hits, 2);

    /* error@3: only the third hit fails. */
    assert_int_equal(obx_failpoints_parse(&fps, "ack.after=error@3", err, sizeof(err)), 0);
    assert_int_equal(obx_failpoint_reach(&fps, OBX_FP_ACK_AFTER), 0);
    assert_int_equal(obx_failpoint_reach(&fps, OBX_FP_ACK_AFTER), 0);
    assert_int_equal(obx_failpoint_reach(&fps, OBX_FP_ACK_AFTER), -1);
    assert_int_equal(obx_failpoint_reach(&fps, OBX_FP_ACK_AFTER), 0);
}

/* crash@3 kills the process on the third hit, not before. */
static void test_crash_on_nth_hit(void **state)
{
    (void)state;
    int p[2];
    assert_int_equal(pipe(p), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        struct obx_failpoints fps;
        close(p[0]);
        if (obx_failpoints_parse(&fps, "produce.after=crash@3", err, sizeof(err)) != 0)
            _exit(3);
        for (char hit = '1'; hit <= '5'; hit++) {
            obx_failpoint_reach(&fps, OBX_FP_PRODUCE_AFTER);
            if (write(p[1], &hit, 1) != 1)
                _exit(4);
        }
        _exit(0);
    }
    close(p[1]);
    char buf[8];
    ssize_t n = 0, r;
    while ((r = read(p[0], buf + n, sizeof(buf) - (size_t)n)) > 0)
        n += r;
    int status;
    waitpid(pid, &status, 0);
    close(p[0]);
    assert_true(WIFSIGNALED(status));
    assert_int_equal(WTERMSIG(status), SIGKILL);
    assert_int_equal(n, 2); /* survived hits 1 and 2 */
}

int main(void)
{
    use_cmocka_allocator();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_good),
        cmocka_unit_test(test_parse_bad),
        cmocka_unit_test(test_error_and_sleep),
        cmocka_unit_test(test_crash_on_nth_hit),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
