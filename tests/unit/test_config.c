/*
 * Unit tests of the configuration parser: file syntax, types and ranges,
 * precedence (file < environment < -X), validation, error messages.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include "cmocka_alloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "outboxd/config.h"
#include "outboxd/log.h"

static char err[512];

static int setup(void **state)
{
    struct obx_config *cfg = malloc(sizeof(*cfg));
    assert_non_null(cfg);
    assert_int_equal(obx_config_init(cfg), 0);
    *state = cfg;
    err[0] = '\0';
    return 0;
}

static int teardown(void **state)
{
    obx_config_free(*state);
    free(*state);
    return 0;
}

static const char minimal[] = "postgres.conninfo = host=/tmp dbname=app\n"
                              "kafka.bootstrap.servers = localhost:9092\n";

static void test_defaults(void **state)
{
    struct obx_config *cfg = *state;
    assert_int_equal(cfg->batch_size, 1000);
    assert_int_equal(cfg->max_in_flight, 10000);
    assert_int_equal(cfg->on_sent, OBX_ON_SENT_MARK);
    assert_int_equal(cfg->poll_interval_ms, 10);
    assert_int_equal(cfg->shutdown_timeout_ms, 30000);
    assert_int_equal(cfg->log_level, OBX_LOG_INFO);
    assert_null(cfg->pg_conninfo);
    /* Required keys are missing. */
    assert_int_equal(obx_config_validate(cfg, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "postgres.conninfo is required"));
}

static void test_file_syntax(void **state)
{
    struct obx_config *cfg = *state;
    const char *text = "# comment line\n"
                       "\n"
                       "   # indented comment\n"
                       "postgres.conninfo=host=/tmp dbname=app password=a#b\n"
                       "kafka.bootstrap.servers   =   b1:9092,b2:9092   \n"
                       "relay.batch_size = 250\r\n"
                       "relay.on_sent = \"delete\"\n"
                       "log.level = debug\n"
                       "kafka.linger.ms = 7\n"
                       "kafka.client.id = \"with \\\"quotes\\\" and spaces \"\n";
    assert_int_equal(obx_config_load_text(cfg, text, "t.conf", err, sizeof(err)), 0);
    /* '#' inside a value is kept: passwords may contain it. */
    assert_string_equal(cfg->pg_conninfo, "host=/tmp dbname=app password=a#b");
    assert_string_equal(obx_config_kafka_get(cfg, "bootstrap.servers"), "b1:9092,b2:9092");
    assert_int_equal(cfg->batch_size, 250);
    assert_int_equal(cfg->on_sent, OBX_ON_SENT_DELETE);
    assert_int_equal(cfg->log_level, OBX_LOG_DEBUG);
    assert_string_equal(obx_config_kafka_get(cfg, "linger.ms"), "7");
    assert_string_equal(obx_config_kafka_get(cfg, "client.id"), "with \"quotes\" and spaces ");
    assert_int_equal(obx_config_validate(cfg, err, sizeof(err)), 0);
}

static void test_errors_name_key_and_line(void **state)
{
    struct obx_config *cfg = *state;
    assert_int_equal(obx_config_load_text(cfg, "log.level = info\nrelay.batchsize = 5\n", "a.conf",
                                          err, sizeof(err)),
                     -1);
    assert_string_equal(err, "a.conf:2: unknown key 'relay.batchsize' (see outboxd --help for "
                             "the list)");

    assert_int_equal(
        obx_config_load_text(cfg, "\n\nrelay.batch_size = lots\n", "b.conf", err, sizeof(err)), -1);
    assert_non_null(strstr(err, "b.conf:3: relay.batch_size must be an integer from 1 to"));
    assert_non_null(strstr(err, "got 'lots'"));

    assert_int_equal(
        obx_config_load_text(cfg, "relay.on_sent = remove\n", "c.conf", err, sizeof(err)), -1);
    assert_non_null(strstr(err, "c.conf:1: relay.on_sent must be one of mark, delete"));

    assert_int_equal(obx_config_load_text(cfg, "just words\n", "d.conf", err, sizeof(err)), -1);
    assert_string_equal(err, "d.conf:1: expected 'key = value'");

    assert_int_equal(obx_config_load_text(cfg, "log.level = \"info\n", "e.conf", err, sizeof(err)),
                     -1);
    assert_non_null(strstr(err, "e.conf:1: unterminated quoted value for log.level"));

    assert_int_equal(
        obx_config_load_text(cfg, "log.level = inf\xc3\xb6\n", "f.conf", err, sizeof(err)), -1);
    assert_string_equal(err, "f.conf:1: only ASCII is accepted");
}

static void test_ranges(void **state)
{
    struct obx_config *cfg = *state;
    assert_int_equal(obx_config_set(cfg, "relay.batch_size", "0", "-X", err, sizeof(err)), -1);
    assert_int_equal(obx_config_set(cfg, "relay.batch_size", "100001", "-X", err, sizeof(err)), -1);
    assert_int_equal(obx_config_set(cfg, "relay.batch_size", "-5", "-X", err, sizeof(err)), -1);
    assert_int_equal(obx_config_set(cfg, "relay.batch_size", " 5", "-X", err, sizeof(err)), -1);
    assert_int_equal(
        obx_config_set(cfg, "relay.batch_size", "99999999999999999999999", "-X", err, sizeof(err)),
        -1);
    assert_int_equal(obx_config_set(cfg, "relay.batch_size", "100000", "-X", err, sizeof(err)), 0);
    assert_int_equal(cfg->batch_size, 100000);
}

static void test_durations(void **state)
{
    struct obx_config *cfg = *state;
    static const struct {
        const char *text;
        int64_t ms; /* -1 = invalid */
    } cases[] = {
        {"250ms", 250}, {"5s", 5000}, {"2m", 120000}, {"1h", 3600000},
        {"750", 750},   {"1.5s", -1}, {"5 s", -1},    {"s", -1},
        {"", -1},       {"-1s", -1},  {"10d", -1},    {"2h", -1}, /* above the 1h maximum */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int rc = obx_config_set(cfg, "relay.retry_backoff", cases[i].text, "t", err, sizeof(err));
        if (cases[i].ms < 0) {
            assert_int_equal(rc, -1);
            assert_non_null(strstr(err, "relay.retry_backoff must be a duration"));
        } else {
            assert_int_equal(rc, 0);
            assert_int_equal(cfg->retry_backoff_ms, cases[i].ms);
        }
    }
}

static const char *fake_env(const char *name)
{
    if (strcmp(name, "OUTBOXD_RELAY_BATCH_SIZE") == 0)
        return "300";
    if (strcmp(name, "OUTBOXD_LOG_FORMAT") == 0)
        return "json";
    if (strcmp(name, "OUTBOXD_KAFKA_BOOTSTRAP_SERVERS") == 0)
        return "env:9092";
    return NULL;
}

static const char *bad_env(const char *name)
{
    return strcmp(name, "OUTBOXD_RELAY_MAX_IN_FLIGHT") == 0 ? "many" : NULL;
}

static void test_precedence(void **state)
{
    struct obx_config *cfg = *state;
    assert_int_equal(obx_config_load_text(cfg, "relay.batch_size = 100\nlog.format = text\n",
                                          "f.conf", err, sizeof(err)),
                     0);
    assert_int_equal(obx_config_load_text(cfg, minimal, "f.conf", err, sizeof(err)), 0);
    assert_int_equal(obx_config_apply_env(cfg, fake_env, err, sizeof(err)), 0);
    assert_int_equal(cfg->batch_size, 300);          /* env over file */
    assert_int_equal(cfg->log_format, OBX_LOG_JSON); /* env over file */
    assert_string_equal(obx_config_kafka_get(cfg, "bootstrap.servers"), "env:9092");
    assert_int_equal(obx_config_set_arg(cfg, "relay.batch_size=400", err, sizeof(err)), 0);
    assert_int_equal(cfg->batch_size, 400); /* -X over env */

    assert_int_equal(obx_config_apply_env(cfg, bad_env, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "environment OUTBOXD_RELAY_MAX_IN_FLIGHT: relay.max_in_flight"));
}

static void test_x_args(void **state)
{
    struct obx_config *cfg = *state;
    assert_int_equal(obx_config_set_arg(cfg, "nonsense", err, sizeof(err)), -1);
    assert_string_equal(err, "-X nonsense: expected key=value");
    assert_int_equal(obx_config_set_arg(cfg, "=5", err, sizeof(err)), -1);
    assert_int_equal(obx_config_set_arg(cfg, "kafka.acks=all", err, sizeof(err)), 0);
    assert_string_equal(obx_config_kafka_get(cfg, "acks"), "all");
    /* A value may contain '='. */
    assert_int_equal(obx_config_set_arg(cfg, "postgres.conninfo=host=x dbname=y", err, sizeof(err)),
                     0);
    assert_string_equal(cfg->pg_conninfo, "host=x dbname=y");
    /* Later settings of a kafka key replace earlier ones, keeping one entry. */
    assert_int_equal(obx_config_set_arg(cfg, "kafka.acks=1", err, sizeof(err)), 0);
    assert_string_equal(obx_config_kafka_get(cfg, "acks"), "1");
    size_t n = 0;
    for (size_t i = 0; i < cfg->kafka_count; i++)
        n += strcmp(cfg->kafka[i].name, "acks") == 0;
    assert_int_equal(n, 1);
    assert_int_equal(obx_config_set_arg(cfg, "bogus.key=1", err, sizeof(err)), -1);
    assert_non_null(strstr(err, "-X: unknown key 'bogus.key'"));
}

static void test_validate(void **state)
{
    struct obx_config *cfg = *state;
    assert_int_equal(obx_config_load_text(cfg, minimal, "m", err, sizeof(err)), 0);
    assert_int_equal(obx_config_validate(cfg, err, sizeof(err)), 0);

    assert_int_equal(obx_config_set_arg(cfg, "relay.batch_size=20000", err, sizeof(err)), 0);
    assert_int_equal(obx_config_validate(cfg, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "relay.batch_size (20000) is larger than relay.max_in_flight"));
    assert_int_equal(obx_config_set_arg(cfg, "relay.batch_size=100", err, sizeof(err)), 0);

    assert_int_equal(
        obx_config_set_arg(cfg, "postgres.reconnect_backoff_min=20s", err, sizeof(err)), 0);
    assert_int_equal(obx_config_validate(cfg, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "postgres.reconnect_backoff_min (20000ms) is larger"));
    assert_int_equal(obx_config_set_arg(cfg, "postgres.reconnect_backoff_min=1s", err, sizeof(err)),
                     0);

    /* relay.transactions: with relay.shards too, and a transactional.id
     * set by hand only with it and one relay (with slots each relay
     * derives its own). */
    assert_int_equal(obx_config_set_arg(cfg, "relay.transactions=on", err, sizeof(err)), 0);
    assert_int_equal(obx_config_validate(cfg, err, sizeof(err)), 0);
    assert_int_equal(obx_config_set_arg(cfg, "relay.shards=4", err, sizeof(err)), 0);
    assert_int_equal(obx_config_validate(cfg, err, sizeof(err)), 0);
    assert_int_equal(obx_config_set_arg(cfg, "kafka.transactional.id=orders", err, sizeof(err)), 0);
    assert_int_equal(obx_config_validate(cfg, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "kafka.transactional.id cannot be set with relay.shards = 4"));
    assert_int_equal(obx_config_set_arg(cfg, "relay.shards=1", err, sizeof(err)), 0);
    assert_int_equal(obx_config_set_arg(cfg, "relay.transactions=off", err, sizeof(err)), 0);
    assert_int_equal(obx_config_validate(cfg, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "kafka.transactional.id is set but relay.transactions is off"));
    assert_int_equal(obx_config_set_arg(cfg, "relay.transactions=on", err, sizeof(err)), 0);
    assert_int_equal(obx_config_validate(cfg, err, sizeof(err)), 0);

    assert_int_equal(obx_config_set_arg(cfg, "kafka.bootstrap.servers=", err, sizeof(err)), 0);
    assert_int_equal(obx_config_validate(cfg, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "kafka.bootstrap.servers is required"));
}

/* The shipped example config documents every key of the table, and is
 * itself a valid configuration. */
static void test_example_config_documents_every_key(void **state)
{
    struct obx_config *cfg = *state;
    const char *path = OBX_SOURCE_DIR "/config/outboxd.conf";
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    static char text[65536];
    size_t n = fread(text, 1, sizeof(text) - 1, f);
    text[n] = '\0';
    fclose(f);
    for (size_t i = 0; i < obx_config_key_count(); i++) {
        const char *key = obx_config_key_name(i);
        if (!strstr(text, key))
            fail_msg("config/outboxd.conf does not mention %s", key);
    }
    assert_int_equal(obx_config_load_file(cfg, path, err, sizeof(err)), 0);
    assert_int_equal(obx_config_validate(cfg, err, sizeof(err)), 0);
}

static void test_missing_file(void **state)
{
    struct obx_config *cfg = *state;
    assert_int_equal(obx_config_load_file(cfg, "/nonexistent/outboxd.conf", err, sizeof(err)), -1);
    assert_non_null(strstr(err, "cannot open config file /nonexistent/outboxd.conf"));
}

#define TESTS(X)                                                                                   \
    X(test_defaults)                                                                               \
    X(test_file_syntax)                                                                            \
    X(test_errors_name_key_and_line)                                                               \
    X(test_ranges)                                                                                 \
    X(test_durations)                                                                              \
    X(test_precedence)                                                                             \
    X(test_x_args)                                                                                 \
    X(test_validate)                                                                               \
    X(test_example_config_documents_every_key)                                                     \
    X(test_missing_file)

OBX_FIXTURE_MAIN(TESTS)
