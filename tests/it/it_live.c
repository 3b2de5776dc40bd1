/*
 * Liveness (G5): a relay that loses its Postgres session in any state
 * notices, reconnects and says so; a relay that makes no progress fails its
 * liveness probe; SIGTERM ends the process within shutdown.timeout whatever
 * it waits for; a standby holds no snapshot. Postgres listens on TCP here, as
 * in most deployments: a reset TCP socket is what the Unix socket of the
 * other suites never shows.
 *
 *   it_live [SCENARIO]
 */
#include "harness.h"
#include "scenario.h"

#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <setjmp.h>
#include <cmocka.h>

static struct h_env env;
static char body[1 << 16];

static int teardown_env(void **state)
{
    (void)state;
    h_env_stop(&env);
    return 0;
}

#define TOPICS_SPEC ((const char *const[]){"it.a:3", "it.b:3", "it.c:1", NULL})

/* One writer committing a row every pace_ms until stopped. */
struct writer {
    atomic_int stop;
    struct s_writer w;
    pthread_t t;
};

static void writer_start(struct writer *wr, int pace_ms)
{
    atomic_store(&wr->stop, 0);
    wr->w = (struct s_writer){
        .env = &env, .w = 0, .rows_per_tx = 1, .stop = &wr->stop, .pace_ms = pace_ms};
    assert_int_equal(pthread_create(&wr->t, NULL, s_writer_main, &wr->w), 0);
}

static int writer_stop(struct writer *wr)
{
    atomic_store(&wr->stop, 1);
    pthread_join(wr->t, NULL);
    return wr->w.written;
}

/* -X postgres.conninfo naming the relay's sessions `app`, so a test can find
 * the backends of one relay among several. */
static const char *conninfo_as(struct h_env *e, const char *app, char *buf, size_t len)
{
    snprintf(buf, len, "postgres.conninfo=%s application_name=%s", e->conninfo, app);
    return buf;
}

/* Terminates every backend of application `app`; returns how many. */
static int terminate(const char *app)
{
    PGconn *c = h_connect(&env);
    int n = (int)h_sql_int(c,
                           "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                           " WHERE application_name = '%s'",
                           app);
    PQfinish(c);
    return n;
}

static int64_t unsent(void)
{
    PGconn *c = h_connect(&env);
    int64_t n = h_sql_int(c, "SELECT count(*) FROM outbox.unpublished"); /* any mode */
    PQfinish(c);
    return n;
}

/* Fails unless every committed row is sent within timeout_ms. */
static void expect_caught_up(const char *after, int timeout_ms)
{
    int64_t deadline = h_now_ms() + timeout_ms;
    int64_t left;
    while ((left = unsent()) > 0 && h_now_ms() < deadline)
        h_sleep_ms(50);
    /* A writer may have committed a row this very moment: give it one poll. */
    if (left > 0) {
        h_sleep_ms(1000);
        left = unsent();
    }
    if (left > 0)
        fail_msg("%lld rows still unsent %d ms after %s (the relay stalled; see %s)",
                 (long long)left, timeout_ms, after, env.dir);
}

static int get_status(struct h_env *e, const char *path)
{
    return h_http_get(e, path, body, sizeof(body));
}

static void wait_http(struct h_env *e, const char *path, int status, const char *needle,
                      int timeout_ms)
{
    h_wait_http(e, path, status, needle, timeout_ms, body, sizeof(body));
}

static void check_exactly_once(void)
{
    struct h_records recs = {0};
    h_kafka_read_all(&env, S_TOPICS, &recs);
    assert_int_equal(h_check_db_matches_kafka(&env, &recs, false), 0);
    h_records_free(&recs);
}

/* The end of a scenario: the writer stops, the relay catches up within
 * 10 s of `after`, stops cleanly on SIGTERM, and every row is in Kafka
 * once. (An immediate Postgres shutdown may lose a mark's commit: rows
 * Kafka acknowledged are then recognised by the recovery pass.) */
static void finish_and_check(struct h_env *relay, struct writer *wr, const char *after)
{
    assert_true(writer_stop(wr) > 0);
    expect_caught_up(after, 10000);
    assert_int_equal(h_relay_stop(relay, SIGTERM, 30000), 0);
    check_exactly_once();
}

/* Starts relay A (active) and B (standby) on env, sessions named aa and bb.
 * A relay whose session was cut reconnects after at least 0.5 s here, so
 * the standby (which tries every 250 ms) is the one that takes over. */
static void start_pair(struct h_env *b, char *ci_a, char *ci_b, size_t len)
{
    static const char *const slow[] = {"postgres.reconnect_backoff_min=1s",
                                       "postgres.reconnect_backoff_max=2s"};
    h_env_start_with(&env, TOPICS_SPEC, H_PG_TCP);
    *b = env;
    snprintf(b->relay_name, sizeof(b->relay_name), "b");
    b->http_port = h_free_port();
    h_relay_start(
        &env, NULL,
        (const char *const[]){conninfo_as(&env, "aa", ci_a, len), slow[0], slow[1], NULL});
    wait_http(&env, "/readyz", 200, "ready\n", 15000);
    h_relay_start(b, NULL,
                  (const char *const[]){conninfo_as(b, "bb", ci_b, len), slow[0], slow[1], NULL});
    wait_http(b, "/readyz", 200, "standby", 15000);
}

/* Issue 9.1: the relay frozen (SIGSTOP) while its backend is terminated;
 * when it goes on, its first statement meets a reset socket (POLLERR). It
 * must notice, reconnect and relay again, every time. */
static void test_stop_terminate_continue(void **state)
{
    (void)state;
    char ci[700];
    h_env_start_with(&env, TOPICS_SPEC, H_PG_TCP);
    h_relay_start(&env, NULL, (const char *const[]){conninfo_as(&env, "zz", ci, sizeof(ci)), NULL});
    wait_http(&env, "/readyz", 200, "ready", 15000);
    struct writer wr;
    writer_start(&wr, 50);
    for (int round = 0; round < 4; round++) {
        h_sleep_ms(300 + 170 * round); /* a different phase of the poll cycle each round */
        kill(env.relay_pid, SIGSTOP);
        assert_true(terminate("zz") >= 1);
        h_sleep_ms(2000);
        kill(env.relay_pid, SIGCONT);
        expect_caught_up("SIGCONT", 5000);
    }
    assert_true(writer_stop(&wr) > 0);
    expect_caught_up("the writer stopped", 5000);
    assert_true(h_relay_events(&env, "postgres_lost", NULL) > 0);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    check_exactly_once();
}

/* Issue 9.1: the same against a standby: it must stand by again, and take
 * over within a second when the active relay dies. */
static void test_standby_stop_terminate_continue(void **state)
{
    (void)state;
    char ci_a[700], ci_b[700];
    struct h_env b;
    start_pair(&b, ci_a, ci_b, sizeof(ci_a));
    struct writer wr;
    writer_start(&wr, 50);
    for (int round = 0; round < 3; round++) {
        h_sleep_ms(200 + 230 * round);
        kill(b.relay_pid, SIGSTOP);
        assert_true(terminate("bb") >= 1);
        h_sleep_ms(1500);
        kill(b.relay_pid, SIGCONT);
        h_sleep_ms(1500);
        /* Back on the lock's queue: a new session of bb, waiting. */
        PGconn *c = h_connect(&env);
        int64_t sessions = h_sql_int(c, "SELECT count(*) FROM pg_stat_activity"
                                        " WHERE application_name = 'bb'");
        PQfinish(c);
        if (sessions < 1)
            fail_msg("round %d: the standby has %lld sessions after its own was terminated", round,
                     (long long)sessions);
        wait_http(&b, "/readyz", 200, "standby", 5000);
    }
    /* The active relay dies: the standby takes over within a second. */
    kill(env.relay_pid, SIGKILL);
    assert_int_equal(h_relay_wait(&env, 10000), 128 + SIGKILL);
    int64_t killed = h_now_ms();
    wait_http(&b, "/readyz", 200, "ready\n", 10000);
    h_wait_metric(&b, "outboxd_standby", 0, 5000);
    int64_t took = h_now_ms() - killed;
    if (took > 3000) /* the probe loop itself polls every 100 ms */
        fail_msg("takeover took %lld ms", (long long)took);
    finish_and_check(&b, &wr, "the takeover");
}

/* Issue 9.1: Postgres restarted (fast, then immediate) over TCP while rows
 * flow, several times: the relay comes back every time. */
static void test_pg_restarts(void **state)
{
    (void)state;
    h_env_start_with(&env, TOPICS_SPEC, H_PG_TCP);
    h_relay_start(&env, NULL, NULL);
    wait_http(&env, "/readyz", 200, "ready", 15000);
    struct writer wr;
    writer_start(&wr, 5);
    const char *modes[] = {"fast", "immediate", "fast", "immediate"};
    for (int i = 0; i < 4; i++) {
        h_sleep_ms(400 + 150 * i);
        h_pg_restart(&env, modes[i]);
        h_sleep_ms(1500);
        int64_t before = s_sent_count(&env);
        s_wait_sent(&env, before + 20, 10000); /* relaying again */
    }
    finish_and_check(&env, &wr, "the last restart");
}

/* Issue 9.2: a multi-host conninfo whose first host is dead. */
static void test_multi_host(void **state)
{
    (void)state;
    char ci[700];
    h_env_start_with(&env, TOPICS_SPEC, H_PG_TCP);
    snprintf(ci, sizeof(ci),
             "postgres.conninfo=host=127.0.0.1,127.0.0.1 port=%d,%d user=postgres dbname=postgres"
             " connect_timeout=2",
             h_free_port(), env.pg_port);
    s_prefill(&env, "it.a", 500);
    h_relay_start(&env, NULL, (const char *const[]){ci, NULL});
    expect_caught_up("start", 15000);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    assert_int_equal(h_relay_events(&env, "postgres_unreachable", "timed out connecting"), 0);
}

/* Rows of the new history (the promoted server's obx_test.committed, less
 * its dead letters) and the records of Kafka that carry their id AND their
 * content: none is a row lost, two a row published twice. Records of the
 * lost history (ids the old primary gave out after the standby stopped
 * receiving) may share a row's id with other content; they do not count. */
/* replayed: rows written again (outboxd replay) since they were
 * published, which go out twice; NULL for none. */
static int64_t check_new_history(PGconn *np, const char *mode, bool ids_reused,
                                 const int64_t *replayed)
{
    struct h_records recs = {0};
    h_kafka_read_all(&env, S_TOPICS, &recs);
    int64_t max_id = INT64_MIN;
    for (size_t j = 0; j < recs.n; j++)
        if (recs.v[j].outbox_id > max_id)
            max_id = recs.v[j].outbox_id;
    PGresult *r = PQexecParams(np,
                               "SELECT id, topic, key, payload FROM obx_test.committed c"
                               " WHERE NOT EXISTS (SELECT FROM outbox.dead_letters d"
                               "                   WHERE d.id = c.id) ORDER BY id",
                               0, NULL, NULL, NULL, NULL, 0);
    assert_int_equal(PQresultStatus(r), PGRES_TUPLES_OK);
    int rows = PQntuples(r), lost = 0, twice = 0, other_history = 0, same_header = 0;
    char lost_ids[256] = "";
    for (int i = 0; i < rows; i++) {
        int64_t id = strtoll(PQgetvalue(r, i, 0), NULL, 10);
        const char *topic = PQgetvalue(r, i, 1);
        bool key_null = PQgetisnull(r, i, 2);
        const char *key = PQgetvalue(r, i, 2);
        size_t plen = 0;
        unsigned char *payload =
            PQgetisnull(r, i, 3)
                ? NULL
                : PQunescapeBytea((const unsigned char *)PQgetvalue(r, i, 3), &plen);
        int copies = 0;
        const struct h_header *mine = NULL, *other = NULL; /* outbox-history */
        for (size_t j = 0; j < recs.n; j++) {
            const struct h_record *x = &recs.v[j];
            if (x->outbox_id != id)
                continue;
            bool same =
                strcmp(x->topic, topic) == 0 && key_null == (x->key == NULL) &&
                (key_null || (x->key_len == strlen(key) && memcmp(x->key, key, x->key_len) == 0)) &&
                (payload == NULL) == (x->value == NULL) &&
                (!payload || (x->value_len == plen && memcmp(x->value, payload, plen) == 0));
            if (same) {
                copies++;
                mine = h_record_header(x, "outbox-history");
            } else {
                other_history++;
                other = h_record_header(x, "outbox-history");
            }
        }
        /* A consumer tells the two rows of one id apart by outbox-history. */
        if (other &&
            (!mine || !other->value || !mine->value || strcmp(mine->value, other->value) == 0))
            same_header++;
        PQfreemem(payload);
        if (copies == 0 && lost++ < 10) {
            size_t o = strlen(lost_ids);
            snprintf(lost_ids + o, sizeof(lost_ids) - o, " %lld", (long long)id);
        }
        bool again = false;
        for (const int64_t *x = replayed; x && *x; x++)
            again = again || *x == id;
        if (again)
            assert_int_equal(copies, 2);
        else if (copies > 1)
            twice++;
    }
    PQclear(r);
    h_records_free(&recs);
    print_message("%s mode: %d rows of the new history, %d lost, %d published twice; %d records "
                  "of the lost history share an id with one of them, %d of those with its "
                  "outbox-history\n",
                  mode, rows, lost, twice, other_history, same_header);
    if (lost > 0)
        fail_msg("%s mode: %d rows of the new history were never published (ids%s...)", mode, lost,
                 lost_ids);
    assert_int_equal(twice, 0);
    if (ids_reused)
        assert_true(other_history > 0); /* the case under test */
    assert_int_equal(same_header, 0);
    return max_id;
}

/* The rows the relay's lost sessions left to the next one's pass, as it
 * logs them: acknowledged (or being confirmed) plus awaiting a report. */
static long lost_session_rows(void)
{
    static const char what[] = "relay: the lost session leaves ";
    char path[300], line[4096];
    long sum = 0;
    FILE *f = fopen(h_relay_log_path(&env, path, sizeof(path)), "r");
    while (f && fgets(line, sizeof(line), f)) {
        const char *p = strstr(line, what);
        long acked = 0, awaiting = 0;
        if (p && sscanf(p + strlen(what), "%ld rows acknowledged (or being confirmed) and %ld",
                        &acked, &awaiting) == 2)
            sum += acked + awaiting;
    }
    if (f)
        fclose(f);
    return sum;
}

/* The failover's writer: outlives a test that fails while it writes, until
 * the teardown stops it. */
static struct writer failover_writer;
static bool failover_writing;

/* Starts the failover tests' writer: rows_per_tx rows a transaction, one
 * transaction every pace_ms; teardown_failover stops it if the test did
 * not. */
static void failover_writer_start(int rows_per_tx, int pace_ms)
{
    struct writer *wr = &failover_writer;
    atomic_store(&wr->stop, 0);
    wr->w = (struct s_writer){
        .env = &env, .w = 0, .rows_per_tx = rows_per_tx, .stop = &wr->stop, .pace_ms = pace_ms};
    assert_int_equal(pthread_create(&wr->t, NULL, s_writer_main, &wr->w), 0);
    failover_writing = true;
}

static void failover_writer_stop(void)
{
    atomic_store(&failover_writer.stop, 1);
    pthread_join(failover_writer.t, NULL);
    failover_writing = false;
}

/* A second relay a failover test starts (its relay_pid 0 when none). */
static struct h_env relay_b;

static int teardown_failover(void **state)
{
    if (failover_writing)
        failover_writer_stop();
    if (relay_b.relay_pid > 0)
        h_relay_stop(&relay_b, SIGKILL, 10000);
    memset(&relay_b, 0, sizeof(relay_b));
    return teardown_env(state);
}

/* Issue 37.1-2: a failover to an asynchronous standby. The standby stops
 * receiving; the primary takes more rows, which the relay publishes; the
 * primary crashes in the middle of that stream while the relay is stopped
 * (SIGSTOP) holding rows in flight, acknowledged and being marked; the
 * standby is promoted and the application writes there at once, reusing
 * the ids the lost history had given out; then the relay goes on (SIGCONT)
 * and finds the new primary by its host list. Rows of the new history
 * share ids with records in Kafka: nothing of the old session may be
 * confirmed by its id on the new server, and the recovery pass must not
 * start above records it has to find. */
static void failover_async_standby(const char *mode, bool restarted)
{
    char ci[700], on_sent[64], sci[300];
    h_env_start_with(&env, TOPICS_SPEC, H_PG_TCP);
    h_standby_start(&env);
    snprintf(ci, sizeof(ci),
             "postgres.conninfo=host=127.0.0.1,127.0.0.1 port=%d,%d user=postgres dbname=postgres",
             env.pg_port, env.standby_port);
    snprintf(on_sent, sizeof(on_sent), "relay.on_sent=%s", mode);
    snprintf(sci, sizeof(sci), "host=127.0.0.1 port=%d user=postgres dbname=postgres",
             env.standby_port);
    s_prefill(&env, "it.a", 500);
    h_relay_start(&env, NULL, (const char *const[]){ci, on_sent, NULL});
    expect_caught_up("start", 15000);

    /* The standby has all of it, then stops receiving. */
    PGconn *p = h_connect(&env);
    PGconn *sb = PQconnectdb(sci);
    assert_int_equal(PQstatus(sb), CONNECTION_OK);
    int64_t lsn = h_sql_int(p, "SELECT pg_current_wal_lsn() - '0/0'");
    int64_t deadline = h_now_ms() + 20000;
    while (h_sql_int(sb, "SELECT (pg_last_wal_replay_lsn() - '0/0' >= %lld)::int",
                     (long long)lsn) != 1) {
        if (h_now_ms() > deadline)
            fail_msg("the standby did not replay up to byte %lld of the WAL", (long long)lsn);
        h_sleep_ms(20);
    }
    h_sql(sb, "ALTER SYSTEM SET primary_conninfo = ''");
    h_sql(sb, "SELECT pg_reload_conf()");
    deadline = h_now_ms() + 20000;
    while (h_sql_int(sb, "SELECT count(*) FROM pg_stat_wal_receiver") > 0) {
        if (h_now_ms() > deadline)
            fail_msg("the standby's WAL receiver did not stop");
        h_sleep_ms(20);
    }
    int64_t standby_top = h_sql_int(sb, "SELECT coalesce(max(id), 0) FROM outbox.events");
    /* Kafka answers after 100 ms: rows are always awaiting its report. */
    assert_true(h_broker_cmd(&env, "rtt all 100"));

    /* The primary alone takes a stream of rows, published as they come. */
    failover_writer_start(20, 1);
    deadline = h_now_ms() + 30000;
    while (h_sql_int(p,
                     "SELECT (SELECT count(*) FROM obx_test.committed WHERE id > %lld)"
                     "     - (SELECT count(*) FROM outbox.unpublished WHERE id > %lld)",
                     (long long)standby_top, (long long)standby_top) < 3000 ||
           h_sql_int(p, "SELECT count(*) FROM outbox.unpublished") == 0) {
        if (h_now_ms() > deadline)
            fail_msg("the relay did not publish 3,000 rows of the primary alone in 30 s");
        h_sleep_ms(10);
    }
    /* In the middle of it: the relay stands still with what it holds, the
     * primary crashes. */
    if (restarted) /* or it dies with the primary and is started after */
        assert_int_equal(h_relay_stop(&env, SIGKILL, 10000), 128 + SIGKILL);
    else
        assert_int_equal(kill(env.relay_pid, SIGSTOP), 0);
    int64_t old_top = h_sql_int(p, "SELECT max(id) FROM obx_test.committed");
    PQfinish(p);
    h_pg_crash(&env);
    failover_writer_stop();
    assert_true(h_broker_cmd(&env, "rtt all 0")); /* what follows need not wait */

    /* The standby is promoted; the application writes there at once,
     * reusing half of the ids the lost history gave out. */
    assert_int_equal(h_sql_int(sb, "SELECT pg_promote(true, 60)::int"), 1);
    h_sql(sb,
          "INSERT INTO outbox.events (topic, key, payload)"
          " SELECT 'it.a', 'k' || (g %% 7), convert_to('promoted ' || g, 'UTF8')"
          "   FROM generate_series(1, %lld) g",
          (long long)((old_top - standby_top) / 2 + 1));
    if (restarted)
        h_relay_start(&env, NULL, (const char *const[]){ci, on_sent, NULL});
    else
        assert_int_equal(kill(env.relay_pid, SIGCONT), 0);

    /* Every row of the new history goes out once, with its own content. */
    snprintf(env.conninfo, sizeof(env.conninfo), "%s", sci);
    expect_caught_up("the failover", 30000);
    /* It knows the history changed: the promoted standby is on timeline 2
     * (a relay started after it by outbox.history, replicated from the
     * primary with the data). */
    h_wait_metric(&env, "outboxd_postgres_history_changes_total", 1, 5000);
    h_wait_metric(&env, "outboxd_postgres_timeline", 2, 5000);
    /* Its recovery pass read ids the new primary would hand out again, and
     * moved the identity past them: no id is reissued after that. */
    h_wait_metric(&env, "outboxd_ids_skipped_total", 1, 5000);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    int64_t max_in_kafka = check_new_history(sb, mode, true, NULL);
    assert_true(h_sql_int(sb, "INSERT INTO outbox.events (topic, key, payload)"
                              " VALUES ('it.a', 'k', 'after'::bytea) RETURNING id") > max_in_kafka);
    PQfinish(sb);
    assert_int_equal(h_relay_events(&env, "history_changed", "timeline 2, was system"), 1);
    if (restarted)
        return;
    /* The case under test: the lost session held rows it had handed to
     * Kafka and not confirmed (before, it confirmed them by id later). */
    assert_true(lost_session_rows() > 0);
}

static void test_failover_async_standby_mark(void **state)
{
    (void)state;
    failover_async_standby("mark", false);
}

static void test_failover_async_standby_delete(void **state)
{
    (void)state;
    failover_async_standby("delete", false);
}

static void test_failover_async_standby_log(void **state)
{
    (void)state;
    failover_async_standby("log", false);
}

/* The same with the relay killed as the primary dies and started once the
 * standby is promoted and written to: the pass reads from the offsets the
 * standby had, and matches by content. */
static void test_failover_async_standby_restarted(void **state)
{
    (void)state;
    failover_async_standby("mark", true);
}

/* Issue 37: a restore, or a cut-over to a copy. The relay publishes from
 * the database while a writer goes on; a dump is taken with a transaction
 * open (its row is not in the dump; it commits after, and is published);
 * the relay publishes what follows, and is killed; the application moves to
 * the copy restored from the dump (another cluster: another system
 * identifier; offsets, sequence and rows as of the dump) and writes there
 * at once, reusing ids; the relay is started on the copy. Every row of the
 * copy goes out once with its own content, records of reused ids carry
 * another outbox-history, and rows written after the relay's pass get ids
 * no record in Kafka has. */
static void restore_of_dump(const char *mode)
{
    char on_sent[64], copy[300], ci[400];
    h_env_start_with(&env, TOPICS_SPEC, H_PG_TCP);
    snprintf(on_sent, sizeof(on_sent), "relay.on_sent=%s", mode);
    s_prefill(&env, "it.a", 500);
    h_relay_start(&env, NULL, (const char *const[]){on_sent, NULL});
    expect_caught_up("start", 15000);
    failover_writer_start(10, 2);
    h_sleep_ms(500);
    PGconn *late = h_connect(&env);
    h_sql(late, "BEGIN");
    h_sql(late, "SELECT outbox.enqueue('it.b', 'late', 'late row'::bytea)");
    h_restore_copy(&env, copy, sizeof(copy));
    h_sql(late, "COMMIT");
    PQfinish(late);
    h_sleep_ms(1000); /* more rows, published from the original alone */
    failover_writer_stop();
    expect_caught_up("the writer stopped", 30000);
    kill(env.relay_pid, SIGKILL);
    assert_int_equal(h_relay_wait(&env, 10000), 128 + SIGKILL);

    /* The application writes to the copy; the relay follows it there. */
    PGconn *cp = PQconnectdb(copy);
    assert_int_equal(PQstatus(cp), CONNECTION_OK);
    assert_int_equal(h_sql_int(cp, "SELECT count(*) FROM outbox.events WHERE key = 'late'"), 0);
    h_sql(cp, "INSERT INTO outbox.events (topic, key, payload)"
              " SELECT 'it.c', 'c' || (g %% 5), convert_to('copy ' || g, 'UTF8')"
              "   FROM generate_series(1, 300) g");
    snprintf(ci, sizeof(ci), "postgres.conninfo=%s", copy);
    snprintf(env.conninfo, sizeof(env.conninfo), "%s", copy);
    h_relay_start(&env, NULL, (const char *const[]){ci, on_sent, NULL});
    expect_caught_up("the move to the copy", 30000);
    h_wait_metric(&env, "outboxd_postgres_history_changes_total", 1, 5000);
    h_wait_metric(&env, "outboxd_ids_skipped_total", 1, 5000);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    assert_int_equal(h_relay_events(&env, "history_changed", "was system"), 1);
    int64_t max_in_kafka = check_new_history(cp, mode, true, NULL);
    assert_true(h_sql_int(cp, "INSERT INTO outbox.events (topic, key, payload)"
                              " VALUES ('it.a', 'k', 'after'::bytea) RETURNING id") > max_in_kafka);
    PQfinish(cp);
}

static void test_restore_of_dump_mark(void **state)
{
    (void)state;
    restore_of_dump("mark");
}

static void test_restore_of_dump_delete(void **state)
{
    (void)state;
    restore_of_dump("delete");
}

static void test_restore_of_dump_log(void **state)
{
    (void)state;
    restore_of_dump("log");
}

/* Issue 37.3: log mode across clusters. A row whose transaction the
 * stored cursor saw running commits, and is not published (the relay
 * stands still); the application moves to a copy in a new cluster whose
 * xids are below the original's (6,000 burnt there first): a restored
 * dump (rows and cursor rows keep their old xids and snapshots) or a
 * logical-replication cut-over (rows get the copy's xids, the cursor rows
 * keep the old snapshots). The relay on the copy must judge the late row
 * by the cursor with the xid the row had there (before: sql/006's repair,
 * or the copy's xids, made it look covered: lost). With `shards` above 1
 * two relays sharing slots start on the copy: the first claim of slots
 * rebases the cursor, in one statement, as relay.shards changes too. */
static void late_row_across_clusters(bool logical, int shards)
{
    char copy[300], ci[400];
    h_env_start_with(&env, TOPICS_SPEC, H_PG_TCP);
    PGconn *p = h_connect(&env);
    if (logical) {
        h_sql(p, "ALTER SYSTEM SET wal_level = logical");
        PQfinish(p);
        h_pg_restart(&env, "fast");
        p = h_connect(&env);
    }
    h_sql(p, "DO $$ BEGIN FOR i IN 1..6000 LOOP PERFORM pg_current_xact_id(); COMMIT; END LOOP;"
             " END $$");
    s_prefill(&env, "it.a", 500);
    if (logical) /* the copy follows from here */
        h_logical_copy(&env, copy, sizeof(copy));
    h_relay_start(&env, NULL, (const char *const[]){"relay.on_sent=log", NULL});
    expect_caught_up("start", 15000);
    failover_writer_start(10, 2);
    PGconn *late = h_connect(&env);
    h_sql(late, "BEGIN");
    int64_t late_id = h_sql_int(late, "SELECT outbox.enqueue('it.b', 'late', 'late row'::bytea)");
    int64_t late_xid = h_sql_int(late, "SELECT pg_current_xact_id()::text::bigint");
    /* The cursor goes past it while it runs. */
    int64_t deadline = h_now_ms() + 15000;
    while (h_sql_int(p,
                     "SELECT count(*) FROM outbox.log_cursor c"
                     " WHERE c.batch = (SELECT max(batch) FROM outbox.log_cursor)"
                     "   AND c.hwm > %lld AND NOT pg_visible_in_snapshot('%lld'::xid8, c.snap)",
                     (long long)late_id, (long long)late_xid) == 0) {
        if (h_now_ms() > deadline)
            fail_msg("the cursor did not pass row %lld while its writer ran", (long long)late_id);
        h_sleep_ms(20);
    }
    assert_int_equal(kill(env.relay_pid, SIGSTOP), 0);
    h_sql(late, "COMMIT");
    PQfinish(late);
    failover_writer_stop();
    /* Stored, not covered, not published. */
    assert_int_equal(
        h_sql_int(p, "SELECT count(*) FROM outbox.unpublished WHERE id = %lld", (long long)late_id),
        1);
    PQfinish(p);
    if (logical)
        h_logical_cut_over(&env, copy);
    else
        h_restore_copy(&env, copy, sizeof(copy));
    kill(env.relay_pid, SIGKILL);
    assert_int_equal(h_relay_wait(&env, 10000), 128 + SIGKILL);

    PGconn *cp = PQconnectdb(copy);
    assert_int_equal(PQstatus(cp), CONNECTION_OK);
    assert_true(h_sql_int(cp, "SELECT pg_current_xact_id()::text::bigint") < late_xid);
    assert_int_equal(
        h_sql_int(cp, "SELECT count(*) FROM outbox.events WHERE id = %lld", (long long)late_id), 1);
    /* The rebase as the relay's repair does it, 100 rows a statement here
     * (it asks again while the answer is -1); after its first statement
     * two covered rows are written again as outboxd replay does, one it
     * read already and one it has not: the rebased cursor must cover
     * neither (their xids came after it began). */
    int steps = 0;
    while (shards == 1 && h_sql_int(cp, "SELECT outbox.repair_writer_xids(1, NULL, 100)") < 0) {
        if (steps++ == 0)
            h_sql(cp, "UPDATE outbox.events SET sent_at = NULL, xid = pg_current_xact_id(),"
                      " origin_xid = NULL WHERE id IN (50, 400)");
    }
    if (shards == 1) {
        assert_true(steps >= 5);
        assert_int_equal(
            h_sql_int(cp, "SELECT count(*) FROM outbox.unpublished WHERE id IN (50, 400, %lld)",
                      (long long)late_id),
            3);
    }
    h_sql(cp, "INSERT INTO outbox.events (topic, key, payload)"
              " SELECT 'it.c', 'c' || (g %% 5), convert_to('copy ' || g, 'UTF8')"
              "   FROM generate_series(1, 300) g");
    char sh[40];
    snprintf(ci, sizeof(ci), "postgres.conninfo=%s", copy);
    snprintf(sh, sizeof(sh), "relay.shards=%d", shards);
    snprintf(env.conninfo, sizeof(env.conninfo), "%s", copy);
    h_relay_start(&env, NULL, (const char *const[]){ci, "relay.on_sent=log", sh, NULL});
    if (shards > 1) {
        relay_b = env;
        relay_b.relay_pid = 0;
        snprintf(relay_b.relay_name, sizeof(relay_b.relay_name), "b");
        relay_b.http_port = h_free_port();
        h_relay_start(&relay_b, NULL, (const char *const[]){ci, "relay.on_sent=log", sh, NULL});
    }
    expect_caught_up("the move to the copy", 30000);
    if (shards == 1)
        h_wait_metric(&env, "outboxd_postgres_history_changes_total", 1, 5000);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    if (shards > 1) {
        assert_int_equal(h_relay_stop(&relay_b, SIGTERM, 30000), 0);
        /* The first to connect notices (both may), and stores the new
         * history for the other. */
        assert_true(h_relay_events(&env, "history_changed", "was system") +
                        h_relay_events(&relay_b, "history_changed", "was system") >=
                    1);
        assert_int_equal(h_sql_int(cp, "SELECT count(*) FROM outbox.log_cursor_system"
                                       " WHERE rebasing_to IS NOT NULL"),
                         0);
    }
    check_new_history(cp, "log", false, shards == 1 ? (const int64_t[]){50, 400, 0} : NULL);
    PQfinish(cp);
}

static void test_restore_of_dump_late_row_log(void **state)
{
    (void)state;
    late_row_across_clusters(false, 1);
}

static void test_logical_cut_over_late_row_log(void **state)
{
    (void)state;
    late_row_across_clusters(true, 1);
}

static void test_restore_of_dump_late_row_log_shards(void **state)
{
    (void)state;
    late_row_across_clusters(false, 2);
}

/* Issue 37.3: a large outbox restored in log mode from a cluster whose
 * xids are ahead of this one's (250,000 rows; the cursor covers those up
 * to 225,000 but the 10 of one writer its snapshot saw running). The
 * rebase and the repair must fit the statement timeout (3 s here): the
 * rebase reads 10,000 rows a statement, and the repair of the 25,000 above
 * the cursor goes in chunks too (before: one UPDATE of every row, which
 * outlasted it and was retried for ever). The 10 and the 25,000 go out,
 * nothing else. */
static void test_rebase_of_large_outbox_log(void **state)
{
    (void)state;
    h_env_start_with(&env, TOPICS_SPEC, H_PG_TCP);
    PGconn *p = h_connect(&env);
    h_sql(p, "INSERT INTO outbox.events (topic, key, payload)"
             " SELECT 'it.a', 'k' || (g %% 1000), convert_to('row ' || g, 'UTF8')"
             "   FROM generate_series(1, 250000) g");
    /* As restored: another cluster's xids (one writer every 10 rows), its
     * cursor row about every row, its system identifier. */
    h_sql(p, "UPDATE outbox.events SET xid = (50000000 + id / 10)::text::xid8");
    h_sql(p, "INSERT INTO outbox.log_cursor (batch, hwm, snap)"
             " SELECT 1, m.top, (m.x - 5 || ':' || m.x + 1 || ':' || m.x - 5)::pg_snapshot"
             " FROM (SELECT max(id) - 25000 AS top, 50000000 + (max(id) - 25000) / 10 AS x"
             "       FROM outbox.events) m");
    h_sql(p, "INSERT INTO outbox.log_cursor_system (system_id) VALUES ('another')"
             " ON CONFLICT (one) DO UPDATE SET system_id = 'another'");
    h_sql(p, "VACUUM ANALYZE outbox.events");
    int64_t late = h_sql_int(p, "SELECT count(*) FROM outbox.unpublished");
    assert_int_equal(late, 25010);
    h_relay_start(
        &env, NULL,
        (const char *const[]){"relay.on_sent=log", "postgres.statement_timeout=3s", NULL});
    expect_caught_up("the relay's start", 120000);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    assert_true(h_relay_log_contains(&env, "rows up to id 225000 it had not covered, published "
                                           "now: 10"));
    /* The 25,000 above the cursor: repaired in 3 statements. */
    assert_true(h_relay_log_contains(&env, "25000 unsent rows carried a transaction id") ||
                h_relay_log_contains(&env, "25010 unsent rows carried a transaction id"));
    assert_false(h_relay_log_contains(&env, "statement timeout"));
    struct h_records recs = {0};
    h_kafka_read_all(&env, S_TOPICS, &recs);
    /* Each once: the 10 (ids 224,950 to 224,959) and those above 225,000. */
    assert_int_equal(recs.n, 25010);
    static bool seen[250001];
    memset(seen, 0, sizeof(seen));
    for (size_t j = 0; j < recs.n; j++) {
        int64_t id = recs.v[j].outbox_id;
        assert_true((id >= 224950 && id <= 224959) || (id > 225000 && id <= 250000));
        assert_false(seen[id]);
        seen[id] = true;
    }
    h_records_free(&recs);
    PQfinish(p);
}

/* Issue 21.5: after a failover the old primary, now a hot standby, is
 * often still first in host=a,b. The relay goes on to the primary at once
 * (target_session_attrs=read-write is its default), and one told to accept
 * any server refuses the standby, saying why, rather than publishing from
 * snapshots that do not list the primary's writers. */
static void test_standby_first_in_hosts(void **state)
{
    (void)state;
    char ci[700];
    h_env_start_with(&env, TOPICS_SPEC, H_PG_TCP);
    h_standby_start(&env);
    snprintf(ci, sizeof(ci),
             "postgres.conninfo=host=127.0.0.1,127.0.0.1 port=%d,%d user=postgres dbname=postgres",
             env.standby_port, env.pg_port);
    s_prefill(&env, "it.a", 500);
    h_relay_start(&env, NULL, (const char *const[]){ci, NULL});
    expect_caught_up("standby first", 15000);
    PGconn *c = h_connect(&env);
    for (int i = 0; i < 200; i++)
        h_enqueue(c, "it.a", i % 2 ? "a" : "b", "after", 5, NULL);
    expect_caught_up("writes after the start", 15000);
    /* The operator tools reach the primary too: on the standby, status
     * would see no relay holding the lock (its sessions are the primary's). */
    char out[8192], bs[600], http[64];
    snprintf(bs, sizeof(bs), "kafka.bootstrap.servers=%s", env.bootstrap);
    snprintf(http, sizeof(http), "http.listen=127.0.0.1:%d", env.http_port);
    char *const tool[] = {"outboxd", "status", "-X", ci, "-X", bs, "-X", http, NULL};
    char *const tool_env[] = {"PATH=/usr/bin:/bin", NULL};
    int status_rc = h_run_outboxd(tool, tool_env, out, sizeof(out));
    print_message("%s", out);
    assert_int_equal(status_rc, 0);
    assert_non_null(strstr(out, "  active  outboxd"));
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    char primary[64];
    snprintf(primary, sizeof(primary), "connected to 127.0.0.1:%d/", env.pg_port);
    assert_int_equal(h_relay_events(&env, "postgres_ready", primary), 1);
    assert_int_equal(h_relay_events(&env, "postgres_ready", NULL), 1); /* the first try */
    struct h_records recs = {0};
    h_kafka_read_all(&env, (const char *const[]){"it.a", NULL}, &recs);
    assert_int_equal(recs.n, 700);
    assert_int_equal(h_check_db_matches_kafka(&env, &recs, false), 0);
    h_records_free(&recs);

    /* The standby alone, any server allowed: refused, nothing published. */
    snprintf(ci, sizeof(ci),
             "postgres.conninfo=host=127.0.0.1 port=%d user=postgres dbname=postgres"
             " target_session_attrs=any",
             env.standby_port);
    h_enqueue(c, "it.a", "a", "waits", 5, NULL);
    h_relay_start(&env, NULL, (const char *const[]){ci, NULL});
    h_wait_log(&env, "is a hot standby (in recovery): outboxd publishes only from a primary",
               10000);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM outbox.unpublished"), 1);
    PQfinish(c);
}

/* "tuples: R removed, K remain, N are dead but not yet removable" */
static void on_notice(void *arg, const PGresult *res)
{
    long *not_removable = arg;
    const char *msg = PQresultErrorField(res, PG_DIAG_MESSAGE_PRIMARY);
    const char *p = msg ? strstr(msg, " are dead but not yet removable") : NULL;
    if (!p)
        return;
    while (p > msg && p[-1] >= '0' && p[-1] <= '9')
        p--;
    *not_removable = strtol(p, NULL, 10);
}

/* Runs VACUUM VERBOSE on outbox.events; returns the dead row versions it
 * could not remove (-1 if it did not say). */
static long vacuum_not_removable(PGconn *c)
{
    long n = -1;
    PQnoticeReceiver old = PQsetNoticeReceiver(c, on_notice, &n);
    PGresult *r = PQexec(c, "VACUUM (VERBOSE) outbox.events");
    assert_int_equal(PQresultStatus(r), PGRES_COMMAND_OK);
    PQclear(r);
    PQsetNoticeReceiver(c, old, NULL); /* libpq's default ignores its argument */
    return n;
}

/* Issue 9.3: a standby holds no snapshot: VACUUM removes the dead rows the
 * active relay's marks leave. Its lock poll is a statement, and a statement
 * has a snapshot while it runs, so a sample may catch backend_xmin set while
 * the state is 'active'. A snapshot that pins is one kept outside a
 * statement ('idle in transaction') or by a statement waiting on a lock (a
 * blocking pg_advisory_lock()). */
static void test_standby_no_snapshot(void **state)
{
    (void)state;
    char ci_a[700], ci_b[700];
    struct h_env b;
    start_pair(&b, ci_a, ci_b, sizeof(ci_a));
    h_sleep_ms(500);

    s_prefill(&env, "it.a", 2000); /* marked by the active relay: 2,000 dead row versions */
    expect_caught_up("the prefill", 15000);
    PGconn *c = h_connect(&env);
    for (int i = 0; i < 20; i++) { /* sample the standby's backend over two seconds */
        int64_t pinned =
            h_sql_int(c, "SELECT count(*) FROM pg_stat_activity"
                         " WHERE application_name = 'bb' AND backend_xmin IS NOT NULL"
                         "   AND (state IS DISTINCT FROM 'active' OR wait_event_type = 'Lock')");
        if (pinned != 0)
            fail_msg("the standby's backend holds a snapshot (backend_xmin set)");
        h_sleep_ms(100);
    }
    long left = vacuum_not_removable(c);
    if (left != 0)
        fail_msg("VACUUM left %ld dead row versions not removable while a standby waits", left);
    PQfinish(c);
    assert_int_equal(h_relay_stop(&b, SIGTERM, 10000), 0);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
}

/* Issue 9, health tied to progress, and 9.6: the relay's backend is frozen
 * (SIGSTOP) while rows wait. The relay cannot tell a slow statement from a
 * hung one, but after relay.stall_timeout without progress it says what it
 * waits for and fails /livez; SIGTERM then ends it within shutdown.timeout. */
static void test_stall_livez(void **state)
{
    (void)state;
    char ci[700];
    h_env_start_with(&env, TOPICS_SPEC, H_PG_TCP);
    h_relay_start(&env, NULL,
                  (const char *const[]){conninfo_as(&env, "zz", ci, sizeof(ci)),
                                        "relay.stall_timeout=2s", "shutdown.timeout=3s", NULL});
    wait_http(&env, "/readyz", 200, "ready", 15000);
    assert_int_equal(get_status(&env, "/metrics"), 200);
    assert_true(h_metric(body, "outboxd_last_progress_timestamp_seconds") > 1e9);
    assert_int_equal(get_status(&env, "/livez"), 200);

    PGconn *c = h_connect(&env);
    int pid = (int)h_sql_int(c, "SELECT pid FROM pg_stat_activity WHERE application_name = 'zz'");
    assert_true(pid > 0);
    kill(pid, SIGSTOP);
    s_prefill(&env, "it.b", 100);
    wait_http(&env, "/livez", 503, "no progress", 10000);
    h_wait_metric(&env, "outboxd_stalled", 1, 1000);
    h_wait_log(&env, "no progress for", 1000); /* G5: and says so in its log */

    int64_t t0 = h_now_ms();
    int rc = h_relay_stop(&env, SIGTERM, 10000);
    int64_t took = h_now_ms() - t0;
    kill(pid, SIGCONT);
    PQfinish(c);
    assert_int_equal(rc, 0);
    if (took > 4500)
        fail_msg("SIGTERM with a hung Postgres took %lld ms (shutdown.timeout 3s)",
                 (long long)took);
}

/* Issue 9.6: SIGTERM during a slow recovery scan (every broker answer
 * delayed) ends the process within shutdown.timeout. */
static void test_sigterm_during_recovery(void **state)
{
    (void)state;
    h_env_start_with(&env, TOPICS_SPEC, H_PG_TCP);
    s_prefill(&env, "it.a", 200);
    assert_true(h_broker_cmd(&env, "rtt all 2500"));
    h_relay_start(&env, NULL, (const char *const[]){"shutdown.timeout=2s", NULL});
    h_wait_metric(&env, "outboxd_postgres_connected", 1, 10000);
    h_sleep_ms(1000); /* the recovery scan waits on the broker's slow answers */
    int64_t t0 = h_now_ms();
    int rc = h_relay_stop(&env, SIGTERM, 15000);
    int64_t took = h_now_ms() - t0;
    assert_true(h_broker_cmd(&env, "rtt all 0"));
    assert_int_equal(rc, 0);
    if (took > 3500)
        fail_msg("SIGTERM during the recovery scan took %lld ms (shutdown.timeout 2s)",
                 (long long)took);
}

/* Peak resident memory of a process in kB (VmHWM), -1 if unknown. */
static long peak_rss_kb(pid_t pid)
{
    char path[64], line[256];
    long kb = -1;
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    while (f && fgets(line, sizeof(line), f))
        if (strncmp(line, "VmHWM:", 6) == 0)
            kb = strtol(line + 6, NULL, 10);
    if (f)
        fclose(f);
    return kb;
}

/* Issue 9.4: rows larger than the producer's message.max.bytes are refused
 * from their stored size, without fetching them, and big rows below it are
 * fetched a few at a time: memory stays bounded, the relay stays up and
 * relay.on_reject applies. */
static void test_large_rows(void **state)
{
    (void)state;
    h_env_start(&env, TOPICS_SPEC);
    PGconn *c = h_connect(&env);
    /* Three 40 MB rows among small ones: refused from their size alone. */
    h_sql(c, "INSERT INTO outbox.events (topic, key, payload)"
             " SELECT 'it.a', 'big', convert_to(repeat('x', 40000000), 'UTF8')"
             " FROM generate_series(1, 3)");
    s_prefill(&env, "it.c", 50);
    h_relay_start(&env, NULL, (const char *const[]){"relay.on_reject=dead_letter", NULL});
    expect_caught_up("the big rows", 30000);
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM outbox.dead_letters"
                                  " WHERE reason LIKE 'row too large: 4000000_ bytes of key,"
                                  " payload and headers, above kafka.message.max.bytes%%'"),
                     3);
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM outbox.dead_letters"), 3);
    long kb = peak_rss_kb(env.relay_pid);
    assert_true(kb > 0);
    /* One 40 MB row fetched would be 40 MB (before: 487 MB for three). */
    if (kb > 100 * 1024)
        fail_msg("the relay's peak RSS was %ld kB", kb);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);

    /* 600 kB rows against a 2 MiB budget: the first fetch (1000 rows at most
     * 2 kB each) brings them without payloads, only their lengths; every
     * later one asks for 3 rows (3 x 600 kB fit in 2 MiB). */
    h_sql(c, "INSERT INTO outbox.events (topic, key, payload)"
             " SELECT 'it.b', 'mid-' || (g %% 5), convert_to(repeat('y', 600000), 'UTF8')"
             " FROM generate_series(1, 30) g");
    h_relay_start(&env, NULL,
                  (const char *const[]){"relay.on_reject=dead_letter",
                                        "relay.fetch_max_bytes=2097152", NULL});
    expect_caught_up("the 600 kB rows", 30000);
    assert_int_equal(get_status(&env, "/metrics"), 200);
    double all = h_metric(body, "outboxd_fetch_batch_rows_bucket{le=\"+Inf\"}");
    double small = h_metric(body, "outboxd_fetch_batch_rows_bucket{le=\"10\"}");
    assert_true(all >= 11); /* the first, then 30 rows at most 3 each */
    if (all - small > 1)
        fail_msg("%.0f fetches after the first brought more than 10 rows of 600 kB (budget 2 MiB)",
                 all - small - 1);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);

    /* Keys and headers count as well (issue 37.15): 30 rows whose headers
     * hold 600 kB (stored compressed in a few kB, so their text's length
     * counts) and whose keys hold 1 kB, and one row of 1.2 MB of headers,
     * above the producer's limit with a 1-byte payload. Before, each fetch
     * brought all 30 rows whole. */
    h_sql(c, "INSERT INTO outbox.events (topic, key, payload, headers)"
             " SELECT 'it.c', repeat('k', 1000) || (g %% 5), '\\x01',"
             "        jsonb_build_object('big', repeat('h', 600000))"
             " FROM generate_series(1, 30) g");
    h_sql(c, "INSERT INTO outbox.events (topic, key, payload, headers)"
             " VALUES ('it.c', 'huge', '\\x01', jsonb_build_object('big', repeat('h', 1200000)))");
    h_relay_start(&env, NULL,
                  (const char *const[]){"relay.on_reject=dead_letter",
                                        "relay.fetch_max_bytes=2097152", "log.level=debug", NULL});
    expect_caught_up("the rows of 600 kB headers", 30000);
    /* The first fetch (1000 rows at most 2 kB each) brought the first row
     * without payload and headers: then 3 rows a fetch. */
    if (!h_relay_log_contains(&env, "bytes: fetching 3 rows at a time"))
        fail_msg("the fetch did not shrink for rows of 600 kB headers (see %s)", env.dir);
    assert_int_equal(get_status(&env, "/metrics"), 200);
    all = h_metric(body, "outboxd_fetch_batch_rows_bucket{le=\"+Inf\"}");
    small = h_metric(body, "outboxd_fetch_batch_rows_bucket{le=\"10\"}");
    if (all - small > 1)
        fail_msg("%.0f fetches after the first brought more than 10 rows of 600 kB headers",
                 all - small - 1);
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM outbox.dead_letters WHERE key = 'huge'"
                                  " AND reason LIKE 'row too large: 12000__ bytes of key,"
                                  " payload and headers%%'"),
                     1);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    PQfinish(c);
}

static int64_t wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Milliseconds from `event` (wall clock) to the first record produced after
 * it, -1 if none. */
static int64_t first_record_after(const struct h_records *recs, int64_t event)
{
    int64_t first = -1;
    for (size_t i = 0; i < recs->n; i++)
        if (recs->v[i].timestamp >= event && (first < 0 || recs->v[i].timestamp < first))
            first = recs->v[i].timestamp;
    return first < 0 ? -1 : first - event;
}

/* Wall-clock ms of the n-th (1-based) `event` in relay `e`'s (JSON) log,
 * -1 if none. */
static int64_t log_time(struct h_env *e, const char *event, int n)
{
    char path[300], line[4096], field[96];
    int64_t t = -1;
    snprintf(field, sizeof(field), "\"event\":\"%s\"", event);
    FILE *f = fopen(h_relay_log_path(e, path, sizeof(path)), "r");
    while (f && n > 0 && fgets(line, sizeof(line), f)) {
        struct tm tm;
        memset(&tm, 0, sizeof(tm));
        int ms = 0;
        if (!strstr(line, field) ||
            sscanf(line, "{\"ts\":\"%d-%d-%dT%d:%d:%d.%dZ", &tm.tm_year, &tm.tm_mon, &tm.tm_mday,
                   &tm.tm_hour, &tm.tm_min, &tm.tm_sec, &ms) != 7)
            continue;
        tm.tm_year -= 1900;
        tm.tm_mon -= 1;
        t = (int64_t)timegm(&tm) * 1000 + ms;
        n--;
    }
    if (f)
        fclose(f);
    return n == 0 ? t : -1;
}

/* Issue 10: two relays under running writers. (b) the active relay's
 * backend terminated, (c) then the new active one's, so the first takes
 * the lock back: its second takeover in the same process; (a) kill -9 of
 * the active relay. Each takeover within a second; zero lost, zero
 * duplicated, per-key order; both stop cleanly on SIGTERM. */
static void test_takeovers(void **state)
{
    (void)state;
    char ci_a[700], ci_b[700];
    struct h_env b;
    start_pair(&b, ci_a, ci_b, sizeof(ci_a));
    struct writer wr;
    writer_start(&wr, 2);
    int64_t events[3];

    h_sleep_ms(1500); /* (b) A's backend terminated: B takes over */
    events[0] = wall_ms();
    assert_true(terminate("aa") >= 1);
    h_wait_event(&b, "taking_over", NULL, 1, 5000);
    wait_http(&env, "/readyz", 200, "standby", 5000);

    h_sleep_ms(1500); /* (c) B's backend terminated: A takes the lock back */
    events[1] = wall_ms();
    assert_true(terminate("bb") >= 1);
    h_wait_event(&env, "taking_over", NULL, 1, 5000);
    h_wait_event(&env, "recovery_done", NULL, 2, 5000); /* every acquisition runs the pass */
    wait_http(&b, "/readyz", 200, "standby", 5000);

    h_sleep_ms(1500); /* (a) kill -9 of A: B takes over */
    events[2] = wall_ms();
    kill(env.relay_pid, SIGKILL);
    assert_int_equal(h_relay_wait(&env, 10000), 128 + SIGKILL);
    h_wait_event(&b, "taking_over", NULL, 2, 5000);
    h_sleep_ms(1500);

    assert_true(writer_stop(&wr) > 0);
    expect_caught_up("the takeovers", 10000);
    h_relay_start(&env, NULL,
                  (const char *const[]){ci_a, "postgres.reconnect_backoff_min=1s",
                                        "postgres.reconnect_backoff_max=2s", NULL});
    wait_http(&env, "/readyz", 200, "standby", 15000); /* a standby again */
    assert_int_equal(h_relay_stop(&env, SIGTERM, 10000), 0);
    assert_int_equal(h_relay_stop(&b, SIGTERM, 30000), 0);

    struct h_records recs = {0};
    h_kafka_read_all(&env, S_TOPICS, &recs);
    assert_int_equal(h_check_db_matches_kafka(&env, &recs, false), 0);
    /* Takeover time: from the event to the new holder's taking_over event,
     * and, after the kill (when no other relay can publish), to the first
     * record produced. */
    int64_t took[3] = {log_time(&b, "taking_over", 1) - events[0],
                       log_time(&env, "taking_over", 1) - events[1],
                       first_record_after(&recs, events[2])};
    for (int i = 0; i < 3; i++) {
        print_message("takeover %d: %lld ms\n", i, (long long)took[i]);
        if (took[i] < 0 || took[i] > 1000)
            fail_msg("takeover %d took %lld ms", i, (long long)took[i]);
    }
    h_records_free(&recs);
}

/* Issue 10 (d): a zombie. The active relay is frozen (SIGSTOP), its session
 * terminated, the other takes over; 3 s later the first goes on. It must
 * notice, step aside and stop cleanly. The records it still had queued are
 * dropped when it notices; what librdkafka had already sent may land after
 * the new relay's recovery scan: those duplicates are counted (the README
 * names this window), never losses or reordered first copies. */
static void test_zombie(void **state)
{
    (void)state;
    char ci_a[700], ci_b[700];
    struct h_env b;
    start_pair(&b, ci_a, ci_b, sizeof(ci_a));
    struct writer wr;
    writer_start(&wr, 2);
    h_sleep_ms(1500);
    kill(env.relay_pid, SIGSTOP);
    assert_true(terminate("aa") >= 1);
    h_wait_event(&b, "taking_over", NULL, 1, 5000);
    h_sleep_ms(3000);
    kill(env.relay_pid, SIGCONT);
    wait_http(&env, "/readyz", 200, "standby", 10000); /* stepped aside */
    h_sleep_ms(1000);
    assert_true(writer_stop(&wr) > 0);
    expect_caught_up("the zombie", 10000);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 10000), 0);
    assert_int_equal(h_relay_stop(&b, SIGTERM, 30000), 0);
    struct h_records recs = {0};
    h_kafka_read_all(&env, S_TOPICS, &recs);
    size_t dups = h_check_db_matches_kafka(&env, &recs, true);
    print_message("zombie: %zu duplicates of %zu records\n", dups, recs.n);
    h_records_free(&recs);
}

/* Waits until the backend of application `app` waits on a lock while
 * running a statement starting with `prefix`. */
static void wait_backend_on_lock(const char *app, const char *prefix)
{
    PGconn *c = h_connect(&env);
    int64_t deadline = h_now_ms() + 20000;
    while (h_sql_int(c,
                     "SELECT count(*) FROM pg_stat_activity WHERE application_name = '%s'"
                     " AND wait_event_type = 'Lock' AND query LIKE '%s%%'",
                     app, prefix) == 0) {
        if (h_now_ms() > deadline)
            fail_msg("%s never waited on a lock in '%s...'", app, prefix);
        h_sleep_ms(50);
    }
    PQfinish(c);
}

enum cut { CUT_TERMINATE, CUT_PG_FAST, CUT_PG_IMMEDIATE, CUT_COUNT };
static const char *const cut_names[] = {"backend terminated", "fast restart", "immediate restart"};

/* Ends relay e's session the way `cut` says; it must log the loss (with the
 * state it was in) within 3 s. */
static void cut_and_expect_notice(struct h_env *e, const char *app, enum cut cut, const char *state)
{
    long before = h_relay_disconnects(e);
    if (cut == CUT_TERMINATE)
        assert_true(terminate(app) >= 1);
    else
        h_pg_restart(&env, cut == CUT_PG_FAST ? "fast" : "immediate");
    int64_t deadline = h_now_ms() + 3000;
    while (h_relay_disconnects(e) == before && h_now_ms() < deadline)
        h_sleep_ms(50);
    if (h_relay_disconnects(e) == before)
        fail_msg("state %s, %s: the relay did not notice within 3 s", state, cut_names[cut]);
}

/* After a cut that ended both sessions, either relay may hold the lock:
 * makes A the active one again and B its standby. */
static void ensure_a_active(struct h_env *b, const char *ci_b)
{
    int64_t deadline = h_now_ms() + 15000;
    for (;;) {
        if (get_status(&env, "/readyz") == 200 && strstr(body, "ready\n") &&
            !strstr(body, "standby"))
            break;
        if (get_status(b, "/readyz") == 200 && !strstr(body, "standby")) {
            assert_int_equal(h_relay_stop(b, SIGTERM, 30000), 0);
            wait_http(&env, "/readyz", 200, "ready\n", 10000);
            h_relay_start(b, NULL, (const char *const[]){ci_b, NULL});
            break;
        }
        if (h_now_ms() > deadline)
            fail_msg("no relay became active after the cut");
        h_sleep_ms(100);
    }
    wait_http(b, "/readyz", 200, "standby", 15000);
}

/* Issue 9, "every state notices": the relay's session ends while it
 * stands by, recovers, idles, fetches, marks and drains, by each of
 * backend terminated, Postgres fast restart and immediate restart (the
 * frozen case is live_stop_terminate_continue). Each time it must say so at
 * once, and in the end every row is in Kafka exactly once. */
static void test_lost_in_every_state(void **state)
{
    (void)state;
    char ci_a[700], ci_b[700];
    struct h_env b;
    start_pair(&b, ci_a, ci_b, sizeof(ci_a));
    PGconn *c = h_connect(&env);
    for (int k = 0; k < CUT_COUNT; k++) {
        enum cut cut = (enum cut)k;

        /* standby: B */
        cut_and_expect_notice(&b, "bb", cut, "standby");
        ensure_a_active(&b, ci_b);

        /* idle: A, nothing to do */
        cut_and_expect_notice(&env, "aa", cut, "idle");
        ensure_a_active(&b, ci_b);

        /* fetching: A's fetch waits behind a table lock */
        PQfinish(c);
        c = h_connect(&env);
        h_sql(c, "BEGIN");
        h_sql(c, "LOCK TABLE outbox.events IN ACCESS EXCLUSIVE MODE");
        h_sql(c, "INSERT INTO outbox.events (topic, key, payload) SELECT 'it.a', 'k' || g,"
                 " 'x'::bytea FROM generate_series(1, 50) g");
        wait_backend_on_lock("aa", "WITH held AS"); /* a fetch */
        cut_and_expect_notice(&env, "aa", cut, "fetching");
        PQfinish(c); /* ends the locking transaction: its rows roll back */
        c = h_connect(&env);
        ensure_a_active(&b, ci_b);
        h_sql(c, "INSERT INTO outbox.events (topic, key, payload) SELECT 'it.a', 'k' || g,"
                 " 'x'::bytea FROM generate_series(1, 50) g");
        expect_caught_up("the fetching case", 10000);

        /* marking: A's mark waits behind row locks (the rows are in Kafka).
         * A is frozen while the rows are written and locked, so that it
         * fetches them only once the locks are held. */
        kill(env.relay_pid, SIGSTOP);
        h_sql(c, "INSERT INTO outbox.events (topic, key, payload) SELECT 'it.b', 'm' || g,"
                 " 'y'::bytea FROM generate_series(1, 50) g");
        h_sql(c, "BEGIN");
        h_sql(c, "SELECT id FROM outbox.events WHERE sent_at IS NULL FOR UPDATE");
        h_sql(c, "LOCK TABLE outbox.log_cursor IN SHARE MODE"); /* log mode's cursor row */
        kill(env.relay_pid, SIGCONT);
        const char *mode = getenv("OBX_IT_ON_SENT");
        wait_backend_on_lock("aa", mode && strcmp(mode, "log") == 0 ? "WITH c AS" : "WITH alone");
        cut_and_expect_notice(&env, "aa", cut, "marking");
        PQfinish(c);
        c = h_connect(&env);
        ensure_a_active(&b, ci_b);
        expect_caught_up("the marking case", 10000);

        /* recovering: A restarted with every broker answer slow */
        assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
        wait_http(&b, "/readyz", 200, "ready\n", 10000); /* B took over */
        assert_int_equal(h_relay_stop(&b, SIGTERM, 30000), 0);
        s_prefill(&env, "it.c", 20);
        assert_true(h_broker_cmd(&env, "rtt all 1500"));
        h_relay_start(&env, NULL, (const char *const[]){ci_a, NULL});
        int64_t deadline = h_now_ms() + 10000;
        bool recovering = false;
        while (!recovering && h_now_ms() < deadline) {
            recovering =
                get_status(&env, "/metrics") == 200 && h_metric(body, "outboxd_recovering") == 1;
            h_sleep_ms(50);
        }
        assert_true(recovering);
        cut_and_expect_notice(&env, "aa", cut, "recovering");
        assert_true(h_broker_cmd(&env, "rtt all 0"));
        expect_caught_up("the recovering case", 15000);

        /* draining: SIGTERM while deliveries wait for brokers that are down */
        assert_true(h_broker_cmd(&env, "down all"));
        s_prefill(&env, "it.a", 20);
        h_sleep_ms(1500); /* fetched and handed to librdkafka */
        long shutdowns = h_relay_events(&env, "shutting_down", NULL); /* earlier cases' */
        kill(env.relay_pid, SIGTERM);
        h_wait_event(&env, "shutting_down", NULL, shutdowns + 1, 5000);
        cut_and_expect_notice(&env, "aa", cut, "draining");
        assert_true(h_broker_cmd(&env, "up all"));
        assert_int_equal(h_relay_wait(&env, 30000), 0);
        h_relay_start(&env, NULL, (const char *const[]){ci_a, NULL});
        expect_caught_up("the draining case", 15000);
        h_relay_start(&b, NULL, (const char *const[]){ci_b, NULL});
        wait_http(&b, "/readyz", 200, "standby", 15000);
    }
    PQfinish(c);
    assert_int_equal(h_relay_stop(&b, SIGTERM, 30000), 0);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    check_exactly_once();
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_stop_terminate_continue, teardown_env),
        cmocka_unit_test_teardown(test_standby_stop_terminate_continue, teardown_env),
        cmocka_unit_test_teardown(test_pg_restarts, teardown_env),
        cmocka_unit_test_teardown(test_multi_host, teardown_env),
        cmocka_unit_test_teardown(test_standby_first_in_hosts, teardown_env),
        cmocka_unit_test_teardown(test_failover_async_standby_mark, teardown_failover),
        cmocka_unit_test_teardown(test_failover_async_standby_delete, teardown_failover),
        cmocka_unit_test_teardown(test_failover_async_standby_log, teardown_failover),
        cmocka_unit_test_teardown(test_failover_async_standby_restarted, teardown_failover),
        cmocka_unit_test_teardown(test_restore_of_dump_mark, teardown_failover),
        cmocka_unit_test_teardown(test_restore_of_dump_delete, teardown_failover),
        cmocka_unit_test_teardown(test_restore_of_dump_log, teardown_failover),
        cmocka_unit_test_teardown(test_restore_of_dump_late_row_log, teardown_failover),
        cmocka_unit_test_teardown(test_logical_cut_over_late_row_log, teardown_failover),
        cmocka_unit_test_teardown(test_restore_of_dump_late_row_log_shards, teardown_failover),
        cmocka_unit_test_teardown(test_rebase_of_large_outbox_log, teardown_env),
        cmocka_unit_test_teardown(test_standby_no_snapshot, teardown_env),
        cmocka_unit_test_teardown(test_stall_livez, teardown_env),
        cmocka_unit_test_teardown(test_sigterm_during_recovery, teardown_env),
        cmocka_unit_test_teardown(test_large_rows, teardown_env),
        cmocka_unit_test_teardown(test_takeovers, teardown_env),
        cmocka_unit_test_teardown(test_zombie, teardown_env),
        cmocka_unit_test_teardown(test_lost_in_every_state, teardown_env),
    };
    return H_RUN_SUITE(tests, argc, argv);
}
