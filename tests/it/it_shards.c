/*
 * Several active relays (relay.shards, issue 24): relays that join, leave,
 * crash, freeze and restart under writers, and Postgres restarts under
 * them. Throughout, every committed row reaches Kafka once, in per-key
 * order, and the slots end up spread fairly.
 *
 *   it_shards [SCENARIO]
 */
#include "harness.h"
#include "scenario.h"

#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include <setjmp.h>
#include <cmocka.h>

#define SHARDS   8
#define N_RELAYS 4

static struct h_env env; /* Postgres, the broker, and relay r0 */
static struct h_env relays[N_RELAYS];
static char body[1 << 16];

#define TOPICS_SPEC ((const char *const[]){"it.a:3", "it.b:3", "it.c:1", NULL})

static const char *mode_of_test; /* a scenario of one mode sets it */

static int teardown_env(void **state)
{
    (void)state;
    mode_of_test = NULL;
    for (int i = 1; i < N_RELAYS; i++)
        if (relays[i].relay_pid > 0)
            h_relay_stop(&relays[i], SIGKILL, 5000);
    h_env_stop(&env);
    return 0;
}

/* Writers committing rows (keys across every slot) until stopped. */
struct writers {
    atomic_int stop;
    struct s_writer w[2];
    pthread_t t[2];
};

static void writers_start(struct writers *ws)
{
    atomic_store(&ws->stop, 0);
    for (int i = 0; i < 2; i++) {
        ws->w[i] = (struct s_writer){
            .env = &env, .w = i, .rows_per_tx = 2, .stop = &ws->stop, .pace_ms = 4};
        assert_int_equal(pthread_create(&ws->t[i], NULL, s_writer_main, &ws->w[i]), 0);
    }
}

static int writers_stop(struct writers *ws)
{
    atomic_store(&ws->stop, 1);
    int n = 0;
    for (int i = 0; i < 2; i++) {
        pthread_join(ws->t[i], NULL);
        n += ws->w[i].written;
    }
    return n;
}

/* The mode of the suite's relays: OBX_IT_SHARDS_ON_SENT if set (the
 * shards_log_* tests set log; the sanitizer pass sets delete, so that its
 * shards_* cover delete mode), else the harness's OBX_IT_ON_SENT, else mark. */
static const char *on_sent(void)
{
    const char *mode = mode_of_test ? mode_of_test : getenv("OBX_IT_SHARDS_ON_SENT");
    if (!mode || !*mode)
        mode = getenv("OBX_IT_ON_SENT");
    if (mode && strcmp(mode, "delete") == 0)
        return "relay.on_sent=delete";
    if (mode && strcmp(mode, "log") == 0)
        return "relay.on_sent=log";
    return "relay.on_sent=mark";
}

/* Relay i (r0 is env itself) with relay.shards = `shards`. */
static void relay_start_with(int i, int shards, const char *const *extra)
{
    if (i > 0) {
        relays[i] = env;
        relays[i].relay_pid = 0;
        relays[i].http_port = h_free_port();
    }
    struct h_env *e = i > 0 ? &relays[i] : &env;
    snprintf(e->relay_name, sizeof(e->relay_name), "r%d", i);
    char ci[700];
    snprintf(ci, sizeof(ci), "postgres.conninfo=%s application_name=r%d", env.conninfo, i);
    char count[32];
    snprintf(count, sizeof(count), "relay.shards=%d", shards);
    const char *settings[12] = {count, on_sent(), ci, "postgres.reconnect_backoff_min=100ms",
                                "postgres.reconnect_backoff_max=500ms"};
    for (size_t n = 5; extra && *extra; extra++) {
        assert_true(n + 1 < sizeof(settings) / sizeof(settings[0]));
        settings[n++] = *extra;
    }
    h_relay_start(e, NULL, settings);
}

/* Relay i with relay.shards = SHARDS. */
static void relay_start(int i)
{
    relay_start_with(i, SHARDS, NULL);
}

static struct h_env *relay(int i)
{
    return i > 0 ? &relays[i] : &env;
}

/* The slots relay i owns, from its /metrics; -1 when it does not answer. */
static int owned(int i)
{
    if (relay(i)->relay_pid <= 0 || h_http_get(relay(i), "/metrics", body, sizeof(body)) != 200)
        return -1;
    return (int)h_metric(body, "outboxd_slots_owned");
}

/* Waits until the running relays in `which` (a bit per relay) own every
 * slot between them, each its fair share (SHARDS / n, or one more).
 * Returns the milliseconds it took. */
static int64_t wait_spread(unsigned which, int timeout_ms)
{
    int64_t t0 = h_now_ms(), deadline = t0 + timeout_ms;
    int n = __builtin_popcount(which);
    char seen[128] = "";
    while (h_now_ms() < deadline) {
        int total = 0, fair = 1, o;
        size_t len = 0;
        for (int i = 0; i < N_RELAYS; i++) {
            if (!(which & (1u << i)))
                continue;
            o = owned(i);
            len += (size_t)snprintf(seen + len, sizeof(seen) - len, " r%d:%d", i, o);
            total += o;
            fair &= o == SHARDS / n || o == SHARDS / n + 1;
        }
        if (total == SHARDS && fair)
            return h_now_ms() - t0;
        h_sleep_ms(20);
    }
    fail_msg("the slots were not spread over %d relays within %d ms (owned:%s; see %s)", n,
             timeout_ms, seen, env.dir);
    return -1;
}

/* Every committed row published within timeout_ms of `after`. */
static void expect_caught_up(const char *after, int timeout_ms)
{
    if (!h_wait_drained(&env, timeout_ms))
        fail_msg("rows still unsent %d ms after %s (see %s)", timeout_ms, after, env.dir);
}

/* Every committed row in Kafka, once unless `dups_ok`, in per-key order. */
static size_t check_kafka(bool dups_ok)
{
    struct h_records recs = {0};
    h_kafka_read_all(&env, S_TOPICS, &recs);
    size_t dups = h_check_db_matches_kafka(&env, &recs, dups_ok);
    print_message("%zu records, %zu duplicates\n", recs.n, dups);
    h_records_free(&recs);
    return dups;
}

/* `outboxd status --json`'s relays: how many are active, and the slots
 * they own between them (a bit each), which must not overlap. */
static int status_slots(unsigned *slots)
{
    char ci[700], bs[600], out[16384];
    snprintf(ci, sizeof(ci), "postgres.conninfo=%s", env.conninfo);
    snprintf(bs, sizeof(bs), "kafka.bootstrap.servers=%s", env.bootstrap);
    char *const argv[] = {"outboxd", "status", "--json", "-X", ci, "-X", bs, NULL};
    char *const envp[] = {"PATH=/usr/bin:/bin", NULL};
    h_run_outboxd(argv, envp, out, sizeof(out));
    int active = 0;
    *slots = 0;
    for (const char *p = out; (p = strstr(p, "\"active\":true,\"slots\":[")); active++) {
        p += strlen("\"active\":true,\"slots\":[");
        while (*p >= '0' && *p <= '9') {
            unsigned bit = 1u << strtol(p, (char **)&p, 10);
            if (*slots & bit)
                fail_msg("a slot has two owners in outboxd status: %s", out);
            *slots |= bit;
            if (*p == ',')
                p++;
        }
    }
    return active;
}

/* The start of a scenario: Postgres and the broker, relays 0..n-1 sharing
 * the slots, and (ws not NULL) writers. */
static void start_sharing(int n, struct writers *ws)
{
    h_env_start_with(&env, TOPICS_SPEC, H_PG_TCP);
    for (int i = 0; i < n; i++)
        relay_start(i);
    wait_spread((1u << n) - 1, 15000);
    if (ws)
        writers_start(ws);
}

/* The end of one: the writers stop, every row is published within 20 s of
 * `after`, the relays in `which` (a bit each) stop cleanly, and Kafka holds
 * every row in key order. Returns the duplicates (only `dups_ok` allows). */
static size_t finish_sharing(struct writers *ws, const char *after, unsigned which, bool dups_ok)
{
    assert_true(writers_stop(ws) > 0);
    expect_caught_up(after, 20000);
    for (int i = N_RELAYS - 1; i >= 0; i--)
        if (which & (1u << i))
            assert_int_equal(h_relay_stop(relay(i), SIGTERM, 20000), 0);
    return check_kafka(dups_ok);
}

/* 1 -> 4 -> 2 relays under writers: joins and graceful leaves move slots
 * within 2 s, and nothing is lost, repeated or reordered. */
static void test_join_and_leave(void **state)
{
    (void)state;
    struct writers ws;
    start_sharing(1, &ws);
    h_sleep_ms(500);
    for (int i = 1; i < N_RELAYS; i++)
        relay_start(i);
    int64_t took = wait_spread(0xf, 15000);
    print_message("4 relays share the slots after %lld ms\n", (long long)took);
    unsigned slots;
    assert_int_equal(status_slots(&slots), 4);
    assert_int_equal(slots, (1u << SHARDS) - 1);
    h_sleep_ms(500);
    assert_int_equal(h_relay_stop(relay(2), SIGTERM, 20000), 0);
    assert_int_equal(h_relay_stop(relay(3), SIGTERM, 20000), 0);
    took = wait_spread(0x3, 5000);
    print_message("2 relays share the slots %lld ms after the leaves\n", (long long)took);
    h_sleep_ms(500);
    assert_int_equal(finish_sharing(&ws, "the joins and leaves", 0x3, false), 0);
    assert_true(h_relay_events(relay(0), "slots_given_back", NULL) >= 1); /* to the joiners */
}

/* An owner killed (-9), then a Postgres restart under three relays: the
 * others take the slots over, recover them first, and every row is in
 * Kafka once. */
static void test_crash_and_restart(void **state)
{
    (void)state;
    struct writers ws;
    start_sharing(3, &ws);
    h_sleep_ms(600);
    kill(relay(1)->relay_pid, SIGKILL);
    assert_int_equal(h_relay_wait(relay(1), 10000), 128 + SIGKILL);
    int64_t took = wait_spread(0x5, 5000);
    print_message("a killed relay's slots moved in %lld ms\n", (long long)took);
    h_sleep_ms(500);
    h_pg_restart(&env, "fast");
    wait_spread(0x5, 15000);
    h_sleep_ms(500);
    assert_int_equal(finish_sharing(&ws, "the crash and the restart", 0x5, false), 0);
}

/* An owner frozen (SIGSTOP) while its session is cut: the other takes its
 * slots, recovers them and publishes; the frozen one goes on, notices and
 * claims again. Nothing lost or reordered; what it had queued at the freeze
 * is the zombie window (guarantees.md), counted and printed. */
static void test_frozen_and_cut(void **state)
{
    (void)state;
    struct writers ws;
    start_sharing(2, &ws);
    h_sleep_ms(600);
    kill(relay(1)->relay_pid, SIGSTOP);
    PGconn *c = h_connect(&env);
    assert_true(h_sql_int(c, "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                             " WHERE application_name = 'r1'") >= 1);
    PQfinish(c);
    wait_spread(0x1, 5000);
    h_sleep_ms(1000);
    kill(relay(1)->relay_pid, SIGCONT);
    wait_spread(0x3, 10000);
    h_sleep_ms(500);
    print_message("zombie window: %zu duplicates\n", finish_sharing(&ws, "the freeze", 0x3, true));
}

/* A rolling restart of every relay, one at a time, under writers: no
 * duplicate at all (each leaves gracefully). */
static void test_rolling_restart(void **state)
{
    (void)state;
    struct writers ws;
    start_sharing(2, &ws);
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < 2; i++) {
            h_sleep_ms(400);
            assert_int_equal(h_relay_stop(relay(i), SIGTERM, 20000), 0);
            wait_spread(0x3 & ~(1u << i), 5000);
            relay_start(i);
            wait_spread(0x3, 5000);
        }
    }
    h_sleep_ms(300);
    assert_int_equal(finish_sharing(&ws, "the rolling restart", 0x3, false), 0);
    /* A drain ends by giving the slots back clean (their next owners'
     * passes then read Kafka from the stored offsets only), unless the
     * relay was still recovering slots it had just taken: of the six stops
     * (two per relay in the rounds, then both), those of a relay that had
     * held its slots for a while did, at least four. */
    long gave_all = h_relay_events(relay(0), "slots_given_back", "holds 0 of") +
                    h_relay_events(relay(1), "slots_given_back", "holds 0 of");
    print_message("%ld of 6 stops gave every slot back\n", gave_all);
    assert_true(gave_all >= 4);
}

/* relay.shards changed under writers, the relays stopped gracefully each
 * time: 8 slots, then 3, then a relay alone. No row is lost, repeated or
 * reordered. In log mode the relays of each count go by cursor rows written
 * under the one before (each row against the newest cursor row about its
 * slot under that row's count). */
static void test_count_changes(void **state)
{
    (void)state;
    struct writers ws;
    start_sharing(2, &ws);
    h_sleep_ms(700);
    for (int i = 1; i >= 0; i--)
        assert_int_equal(h_relay_stop(relay(i), SIGTERM, 20000), 0);
    relay_start_with(0, 3, NULL);
    relay_start_with(1, 3, NULL);
    h_sleep_ms(1500);
    for (int i = 1; i >= 0; i--)
        assert_int_equal(h_relay_stop(relay(i), SIGTERM, 20000), 0);
    relay_start_with(0, 1, NULL);
    h_sleep_ms(1000);
    assert_int_equal(finish_sharing(&ws, "the changes of relay.shards", 0x1, false), 0);
}

static unsigned slots_of(PGconn *c, int i);

/* Log mode: a relay whose slots get no rows still writes cursor rows
 * about them once newer rows exist, so the floor of every slot's cursor
 * (outbox.log_floor: what reclaim, compaction and the backlog count go by)
 * follows the rows of the others. */
static void test_log_idle_slots_follow(void **state)
{
    (void)state;
    mode_of_test = "log";
    start_sharing(2, NULL);
    PGconn *c = h_connect(&env);
    unsigned mine = slots_of(c, 0);
    assert_true(mine != 0 && mine != (1u << SHARDS) - 1);
    /* 200 rows whose keys all fall in relay 0's slots. */
    int64_t written =
        h_sql_int(c,
                  "WITH k AS (SELECT 'idle-' || g AS key FROM generate_series(1, 2000) g"
                  "           WHERE (%u >> outbox.slot_of('idle-' || g, 0, %d)) & 1 = 1 LIMIT 200)"
                  " SELECT count(outbox.enqueue('it.a', key, 'x'::bytea)) FROM k",
                  mine, SHARDS);
    assert_int_equal(written, 200);
    expect_caught_up("rows of one relay's slots", 20000);
    int64_t top = h_sql_int(c, "SELECT max(id) FROM outbox.events");
    int64_t deadline = h_now_ms() + 10000, floor = -1;
    while (floor < top && h_now_ms() < deadline) {
        floor = h_sql_int(c, "SELECT coalesce((SELECT hwm FROM outbox.log_floor(NULL, NULL)), -1)");
        if (floor < top)
            h_sleep_ms(100);
    }
    if (floor < top)
        fail_msg("the floor of the slots' cursors is %lld, the rows go to %lld (see %s)",
                 (long long)floor, (long long)top, env.dir);
    /* Every slot has a cursor row of relay.shards = 8. */
    assert_int_equal(h_sql_int(c,
                               "SELECT count(DISTINCT s) FROM outbox.log_cursor, unnest(slots) s"
                               " WHERE shards = %d",
                               SHARDS),
                     SHARDS);
    PQfinish(c);
    for (int i = 1; i >= 0; i--)
        assert_int_equal(h_relay_stop(relay(i), SIGTERM, 20000), 0);
    assert_int_equal(check_kafka(false), 0);
}

/* Enqueues n rows on it.a, keys "<prefix>-<g>" for g from `from` on, whose
 * slot is (in) or is not (!in) in `mask`; returns how many it wrote. */
static long long enqueue_in_slots(PGconn *c, const char *prefix, int from, unsigned mask, bool in,
                                  int n)
{
    return h_sql_int(c,
                     "WITH k AS (SELECT '%s-' || g AS key FROM generate_series(%d, %d) g"
                     "           WHERE ((%u >> outbox.slot_of('%s-' || g, 0, %d)) & 1) = %d"
                     "           LIMIT %d)"
                     " SELECT count(outbox.enqueue('it.a', key, 'x'::bytea)) FROM k",
                     prefix, from, from + 20 * n + 100, mask, prefix, SHARDS, in ? 1 : 0, n);
}

/* Ends relay i, frozen by SIGSTOP, with kill -9. */
static void kill_frozen(int i)
{
    kill(relay(i)->relay_pid, SIGKILL);
    kill(relay(i)->relay_pid, SIGCONT);
    h_relay_wait(relay(i), 10000);
}

/* Log mode with slots: a relay that takes slots far behind its own cursor
 * (their owner froze and was killed with a backlog of them larger than
 * relay.max_in_flight, while the taker's cursor went on past it). Its full
 * fetches are cut below its stored hwm, so they make partial claims, about
 * the slots taken only: it stores them as it goes and never fills
 * relay.max_in_flight with rows it cannot store (before partial claims it
 * stopped there, log_in_flight_full). Every row once, in key order. */
static void test_log_lagging_slots_taken(void **state)
{
    (void)state;
    mode_of_test = "log";
    h_env_start_with(&env, TOPICS_SPEC, H_PG_TCP);
    for (int i = 0; i < 2; i++)
        relay_start_with(
            i, SHARDS,
            (const char *const[]){"relay.max_in_flight=300", "relay.batch_size=100", NULL});
    wait_spread(0x3, 15000);
    PGconn *c = h_connect(&env);
    unsigned lagging = slots_of(c, 1);
    kill(relay(1)->relay_pid, SIGSTOP);
    /* 2,000 rows of the frozen relay's slots, then rows of the other's,
     * which it publishes: its cursor passes the backlog. */
    assert_int_equal(enqueue_in_slots(c, "lag", 1, lagging, true, 2000), 2000);
    assert_int_equal(enqueue_in_slots(c, "lag", 1, lagging, false, 50), 50);
    int64_t deadline = h_now_ms() + 20000;
    while (h_sql_int(c, "SELECT count(*) FROM outbox.unpublished") > 2000 && h_now_ms() < deadline)
        h_sleep_ms(100);
    h_sleep_ms(300); /* a cursor row past the backlog */
    kill_frozen(1);
    expect_caught_up("the backlog of the slots taken", 60000);
    assert_true(h_relay_events(relay(0), "log_partial_claims", NULL) >= 1);
    assert_int_equal(h_relay_events(relay(0), "log_in_flight_full", NULL), 0);
    /* And rows of every slot go on. */
    assert_int_equal(enqueue_in_slots(c, "after", 1, lagging, true, 50), 50);
    assert_int_equal(enqueue_in_slots(c, "after", 1, lagging, false, 50), 50);
    expect_caught_up("rows after the backlog", 30000);
    PQfinish(c);
    assert_int_equal(h_relay_stop(relay(0), SIGTERM, 20000), 0);
    assert_int_equal(check_kafka(false), 0);
}

/* Log mode's full fetch over a large backlog, after one relay wrote many
 * cursor rows since another's last: the relay that comes next reads from
 * the floor of every slot and tests each row against the newest cursor row
 * about its slot. That test walked the cursor table down per row, and parts
 * of the fetch tested every row of the table before their bounds: with
 * these 200 cursor rows and 40,000 rows each fetch ran past the statement
 * timeout (1 s here, 30 s by default on 400,000 rows), and the relay never
 * published a row. Now the few cursor rows that can cover a row are read
 * once per fetch (outbox.log_newest(), sql/010). */
static void test_log_full_fetch_over_backlog(void **state)
{
    (void)state;
    mode_of_test = "log";
    h_env_start_with(&env, TOPICS_SPEC, H_PG_TCP);
    for (int i = 0; i < 2; i++) /* small batches: a cursor row each, at once */
        relay_start_with(i, SHARDS, (const char *const[]){"relay.batch_size=10", NULL});
    wait_spread(0x3, 15000);
    PGconn *c = h_connect(&env);
    unsigned frozen = slots_of(c, 1);
    /* A cursor row of relay 1 about its slots, then it freezes. */
    assert_int_equal(enqueue_in_slots(c, "first", 1, frozen, true, 10), 10);
    expect_caught_up("rows of relay 1's slots", 20000);
    kill(relay(1)->relay_pid, SIGSTOP);
    /* Ten rows at a time of the other relay's slots: a cursor row each. */
    int64_t deadline = h_now_ms() + 60000;
    int written = 0;
    while (h_sql_int(c,
                     "SELECT count(*) FROM outbox.log_cursor WHERE batch > (SELECT max(batch)"
                     " FROM outbox.log_cursor WHERE slots && (SELECT array_agg(s)"
                     " FROM generate_series(0, %d) s WHERE (%u >> s) & 1 = 1))",
                     SHARDS - 1, frozen) < 200 &&
           h_now_ms() < deadline) {
        assert_int_equal(enqueue_in_slots(c, "ten", written * 40, frozen, false, 10), 10);
        written++;
        h_sleep_ms(20);
    }
    assert_true(h_now_ms() < deadline);
    expect_caught_up("the rows of the running relay", 20000);
    assert_int_equal(h_relay_stop(relay(0), SIGTERM, 20000), 0);
    kill_frozen(1);
    assert_int_equal(h_sql_int(c, "SELECT count(outbox.enqueue('it.b', 'k-' || (g %% 500),"
                                  " 'x'::bytea)) FROM generate_series(1, 40000) g"),
                     40000);
    relay_start_with(0, 1, (const char *const[]){"postgres.statement_timeout=1s", NULL});
    expect_caught_up("a relay alone started over 40,000 rows", 60000);
    PQfinish(c);
    assert_int_equal(h_relay_stop(relay(0), SIGTERM, 20000), 0);
    assert_int_equal(check_kafka(false), 0);
}

/* Log mode, relay.shards changed from 2 to 3 while slots of the new count
 * have no cursor row yet (one of the 3 has one): outbox.log_floor() still
 * gives a floor, from the newest cursor rows of both counts, not of a
 * count used long before (sql/014; before, it gave none, and every
 * statement read and tested the whole outbox until each slot had a row). What it leaves out, each
 * row's own newest cursor row covers, as outbox.log_covers() says row by row; relays of the new
 * count publish the rest, none twice. */
static void test_log_floor_after_count_change(void **state)
{
    (void)state;
    mode_of_test = "log";
    h_env_start_with(&env, TOPICS_SPEC, H_PG_TCP);
    relay_start_with(0, 2, NULL);
    relay_start_with(1, 2, NULL);
    PGconn *c = h_connect(&env);
#define SOME_ROWS                                                                                  \
    "SELECT count(outbox.enqueue('it.a', 'k-' || (g %% 50), 'x'::bytea))"                          \
    " FROM generate_series(1, %d) g"
    assert_int_equal(h_sql_int(c, SOME_ROWS, 2000), 2000);
    expect_caught_up("2,000 rows under 2 slots", 20000);
    for (int i = 1; i >= 0; i--)
        assert_int_equal(h_relay_stop(relay(i), SIGTERM, 20000), 0);
    /* The first cursor row of the new count, about slot 0 of 3, as its
     * relay writes it (every row is published: up to the highest id, all
     * committed); and a row about slot 0 of 4 from long before, below
     * every other, which the floor must not go down to. */
    h_sql(c, "INSERT INTO outbox.log_cursor (batch, hwm, snap, shards, slots)"
             " SELECT max(batch) + 1, (SELECT max(id) FROM outbox.events),"
             "        pg_current_snapshot(), 3, '{0}' FROM outbox.log_cursor");
    h_sql(c, "INSERT INTO outbox.log_cursor (batch, hwm, snap, shards, slots)"
             " SELECT min(batch) - 1000, 1, pg_current_snapshot(), 4, '{0}'"
             " FROM outbox.log_cursor");
    assert_int_equal(h_sql_int(c, SOME_ROWS, 500), 500);
    const char *uncovered = "SELECT count(*) FROM outbox.events e"
                            " WHERE NOT outbox.log_covers(e.id, e.topic, e.key, e.xid)";
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM outbox.log_floor(NULL, NULL)"), 1);
    assert_int_equal(h_sql_int(c, "SELECT hwm FROM outbox.log_floor(NULL, NULL)"),
                     h_sql_int(c, "SELECT min(hwm) FROM outbox.log_newest() WHERE shards < 4"));
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM outbox.log_floor(3, '{1,2}')"), 1);
    assert_true(h_sql_int(c, "SELECT count(*) FROM outbox.unpublished") >= 500);
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM outbox.unpublished"),
                     h_sql_int(c, "%s", uncovered));
    /* Below the floor, every row is covered. */
    assert_int_equal(h_sql_int(c,
                               "%s AND e.id <= (SELECT hwm FROM outbox.log_floor(NULL, NULL))"
                               " AND pg_visible_in_snapshot(e.xid,"
                               "       (SELECT snap FROM outbox.log_floor(NULL, NULL)))",
                               uncovered),
                     0);
    for (int i = 0; i < 3; i++)
        relay_start_with(i, 3, NULL);
    expect_caught_up("relay.shards changed from 2 to 3", 20000);
    assert_int_equal(h_sql_int(c, "%s", uncovered), 0);
    PQfinish(c);
    for (int i = 2; i >= 0; i--)
        assert_int_equal(h_relay_stop(relay(i), SIGTERM, 20000), 0);
    assert_int_equal(check_kafka(false), 0);
#undef SOME_ROWS
}

/* A relay alone (relay.shards = 1) and sharded relays exclude each other,
 * and two relays counting different slots publish nothing until they agree. */
static void test_mixed_counts_refused(void **state)
{
    (void)state;
    start_sharing(1, NULL);
    /* A relay alone stands by while sharded relays hold the relay lock. */
    relays[1] = env;
    relays[1].relay_pid = 0;
    relays[1].http_port = h_free_port();
    snprintf(relays[1].relay_name, sizeof(relays[1].relay_name), "alone");
    h_relay_start(&relays[1], NULL, (const char *const[]){on_sent(), NULL});
    h_wait_event(&relays[1], "standing_by", NULL, 1, 10000);
    assert_int_equal(h_relay_stop(&relays[1], SIGTERM, 10000), 0);
    /* Another count: both give every slot back and say why. */
    relays[2] = env;
    relays[2].relay_pid = 0;
    relays[2].http_port = h_free_port();
    snprintf(relays[2].relay_name, sizeof(relays[2].relay_name), "other");
    h_relay_start(&relays[2], NULL, (const char *const[]){"relay.shards=4", on_sent(), NULL});
    h_wait_log(&env, "runs with relay.shards = 4", 10000);
    h_wait_log(&relays[2], "runs with relay.shards = 8", 10000);
    int64_t deadline = h_now_ms() + 5000;
    while ((owned(0) != 0 || owned(2) != 0) && h_now_ms() < deadline)
        h_sleep_ms(20);
    assert_int_equal(owned(0), 0);
    assert_int_equal(owned(2), 0);
    /* Rows written now wait: neither relay publishes. */
    PGconn *c = h_connect(&env);
    for (int i = 0; i < 20; i++)
        h_enqueue(c, "it.a", i % 2 ? "k1" : "k2", "while they disagree", 19, NULL);
    h_sleep_ms(1000);
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM outbox.unpublished"), 20);
    PQfinish(c);
    assert_int_equal(h_relay_stop(&relays[2], SIGTERM, 10000), 0);
    wait_spread(1u, 5000); /* alone again: it takes them back and publishes */
    c = h_connect(&env);   /* taken back, recorded as taken: no longer "given back" */
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM outbox.slot_owners WHERE given_back"), 0);
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM outbox.slot_owners WHERE taken_clean"), 8);
    PQfinish(c);
    expect_caught_up("the other count left", 10000);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 10000), 0);
    assert_int_equal(check_kafka(false), 0);
}

/* The first relays with relay.shards after a relay alone read Kafka from
 * the offsets the relay alone stored, not from each partition's start: a
 * slot taken for the first time has published nothing under this count. */
static void test_first_take_reads_from_stored_offsets(void **state)
{
    (void)state;
    h_env_start_with(&env, TOPICS_SPEC, H_PG_TCP);
    h_relay_start(&env, NULL, (const char *const[]){on_sent(), NULL}); /* alone */
    PGconn *c = h_connect(&env);
    for (int i = 0; i < 200; i++)
        h_enqueue(c, "it.a", i % 2 ? "k1" : "k2", "before", 6, NULL);
    expect_caught_up("the relay alone", 20000);
    /* Offsets go with a mark once a second: one more row, a second later,
     * stores those of all 200. */
    h_sleep_ms(1100);
    h_enqueue(c, "it.a", "k1", "last", 4, NULL);
    expect_caught_up("the relay alone", 20000);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 20000), 0);
    for (int i = 0; i < 5; i++) /* waiting for the pass to look at it.a */
        h_enqueue(c, "it.a", i % 2 ? "k1" : "k2", "after", 5, NULL);
    PQfinish(c);
    relay_start(0);
    wait_spread(1u, 15000);
    expect_caught_up("the relay with slots", 20000);
    /* Read from the start, the pass would read the 201 records of before. */
    char path[300], line[4096];
    long long read = -1;
    FILE *f = fopen(h_relay_log_path(&env, path, sizeof(path)), "r");
    while (f && fgets(line, sizeof(line), f)) {
        const char *p = strstr(line, "\"event\":\"recovery_done\"");
        const char *q = p ? strstr(p, " records read in") : NULL;
        while (q && q > p && q[-1] >= '0' && q[-1] <= '9')
            q--;
        if (q && sscanf(q, "%lld records read", &read) == 1)
            break;
    }
    if (f)
        fclose(f);
    print_message("the first pass with slots read %lld records\n", read);
    assert_true(read >= 0 && read < 100);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 20000), 0);
    assert_int_equal(check_kafka(false), 0);
}

/* The slots relay i owns (a bit each), from pg_locks. */
static unsigned slots_of(PGconn *c, int i)
{
    return (unsigned)h_sql_int(c,
                               "SELECT coalesce(sum(1 << l.objid::int), 0) FROM pg_locks l"
                               " JOIN pg_stat_activity a USING (pid)"
                               " WHERE a.application_name = 'r%d' AND l.locktype = 'advisory'"
                               "   AND l.granted AND l.classid = 1868724340 AND l.objsubid = 2",
                               i);
}

/* The backlog by slot: the relay that counts the backlog (the owner of
 * slot 0) shows each slot's unsent rows and the age of the oldest on
 * /metrics, and `outboxd status` lists them. With one owner frozen, its
 * slots are the ones that wait, and they come back to 0 once it goes on. */
static void test_lag_by_slot(void **state)
{
    (void)state;
    start_sharing(2, NULL);
    int counter = -1;
    int64_t deadline = h_now_ms() + 15000;
    while (counter < 0 && h_now_ms() < deadline) {
        for (int i = 0; i < 2 && counter < 0; i++)
            if (h_http_get(relay(i), "/metrics", body, sizeof(body)) == 200 &&
                h_metric(body, "outboxd_slot_backlog_rows{slot=\"0\"}") >= 0)
                counter = i;
        h_sleep_ms(50);
    }
    if (counter < 0)
        fail_msg("no relay shows outboxd_slot_backlog_rows (see %s)", env.dir);
    int frozen = 1 - counter;
    PGconn *c = h_connect(&env);
    unsigned frozen_slots = slots_of(c, frozen);
    assert_true(frozen_slots != 0 && !(frozen_slots & 1u));
    kill(relay(frozen)->relay_pid, SIGSTOP);
    for (int i = 0; i < 64; i++) {
        char key[16];
        snprintf(key, sizeof(key), "lag-%d", i);
        h_enqueue(c, "it.a", key, "waits", 5, NULL);
    }
    char series[64], out[16384], want[64];
    int64_t expected[SHARDS];
    for (int slot = 0; slot < SHARDS; slot++) {
        expected[slot] =
            (frozen_slots & (1u << slot))
                ? h_sql_int(c,
                            "SELECT count(*) FROM outbox.events WHERE key LIKE 'lag-%%'"
                            "   AND outbox.slot_of(key, id, %d) = %d",
                            SHARDS, slot)
                : 0;
        snprintf(series, sizeof(series), "outboxd_slot_backlog_rows{slot=\"%d\"}", slot);
        h_wait_metric(relay(counter), series, (double)expected[slot], 20000);
        if (expected[slot] > 0) {
            snprintf(series, sizeof(series), "outboxd_slot_lag_seconds{slot=\"%d\"}", slot);
            h_wait_metric_min(relay(counter), series, 0.001, 5000);
        }
    }
    /* outboxd status: the same slots, and only those. */
    char ci[700], bs[600];
    snprintf(ci, sizeof(ci), "postgres.conninfo=%s", env.conninfo);
    snprintf(bs, sizeof(bs), "kafka.bootstrap.servers=%s", env.bootstrap);
    char *const argv[] = {"outboxd", "status", "--json",         "-X", ci, "-X",
                          bs,        "-X",     "relay.shards=8", NULL};
    char *const envp[] = {"PATH=/usr/bin:/bin", NULL};
    h_run_outboxd(argv, envp, out, sizeof(out));
    assert_non_null(strstr(out, "\"unsent_by_slot\":{"));
    for (int slot = 0; slot < SHARDS; slot++) {
        snprintf(want, sizeof(want), "\"%d\":{\"rows\":%lld,", slot, (long long)expected[slot]);
        if ((expected[slot] > 0) != (strstr(out, want) != NULL))
            fail_msg("slot %d: %lld rows waiting, and outboxd status says: %s", slot,
                     (long long)expected[slot], out);
    }
    kill(relay(frozen)->relay_pid, SIGCONT);
    expect_caught_up("the freeze", 20000);
    for (int slot = 0; slot < SHARDS; slot++) {
        snprintf(series, sizeof(series), "outboxd_slot_backlog_rows{slot=\"%d\"}", slot);
        h_wait_metric(relay(counter), series, 0, 20000);
    }
    PQfinish(c);
    for (int i = 1; i >= 0; i--)
        assert_int_equal(h_relay_stop(relay(i), SIGTERM, 20000), 0);
    assert_int_equal(check_kafka(false), 0);
}

/* Rows restored with another cluster's xids while no relay ran (the
 * trigger off, as in a data-only restore): the relays that take their
 * slots repair them (outbox.claim_slots) and each is published once. */
static void test_foreign_xids_repaired_by_claim(void **state)
{
    (void)state;
    start_sharing(2, NULL);
    PGconn *c = h_connect(&env);
    for (int i = 0; i < 20; i++)
        h_enqueue(c, "it.a", i % 2 ? "own1" : "own2", "own", 3, NULL);
    expect_caught_up("the first rows", 20000);
    for (int i = 1; i >= 0; i--)
        assert_int_equal(h_relay_stop(relay(i), SIGTERM, 20000), 0);
    int64_t ahead = h_sql_int(c, "SELECT pg_current_xact_id()::text::bigint + 1000000");
    h_sql(c, "ALTER TABLE outbox.events DISABLE TRIGGER own_xid");
    h_sql(
        c,
        "INSERT INTO outbox.events (topic, key, payload, xid)"
        " SELECT 'it.b', 'r' || g, 'restored'::bytea, '%lld'::xid8 FROM generate_series(1, 100) g",
        (long long)ahead);
    h_sql(c, "ALTER TABLE outbox.events ENABLE ALWAYS TRIGGER own_xid"); /* as sql/006 left it */
    relay_start(0);
    relay_start(1);
    wait_spread(0x3, 15000);
    for (int i = 0; i < 30; i++)
        h_enqueue(c, "it.a", i % 2 ? "own1" : "own2", "own", 3, NULL);
    expect_caught_up("the restore", 20000);
    h_sleep_ms(300); /* dozens of keyset fetches: a row taken for late would be out again */
    PQfinish(c);
    for (int i = 1; i >= 0; i--)
        assert_int_equal(h_relay_stop(relay(i), SIGTERM, 20000), 0);
    assert_int_equal(check_kafka(false), 0);
    assert_true(h_relay_log_count(relay(0), "of the slots taken carried a transaction id") +
                    h_relay_log_count(relay(1), "of the slots taken carried a transaction id") >=
                1);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_join_and_leave, teardown_env),
        cmocka_unit_test_teardown(test_crash_and_restart, teardown_env),
        cmocka_unit_test_teardown(test_frozen_and_cut, teardown_env),
        cmocka_unit_test_teardown(test_rolling_restart, teardown_env),
        cmocka_unit_test_teardown(test_count_changes, teardown_env),
        cmocka_unit_test_teardown(test_log_idle_slots_follow, teardown_env),
        cmocka_unit_test_teardown(test_log_lagging_slots_taken, teardown_env),
        cmocka_unit_test_teardown(test_log_full_fetch_over_backlog, teardown_env),
        cmocka_unit_test_teardown(test_log_floor_after_count_change, teardown_env),
        cmocka_unit_test_teardown(test_mixed_counts_refused, teardown_env),
        cmocka_unit_test_teardown(test_first_take_reads_from_stored_offsets, teardown_env),
        cmocka_unit_test_teardown(test_lag_by_slot, teardown_env),
        cmocka_unit_test_teardown(test_foreign_xids_repaired_by_claim, teardown_env),
    };
    return H_RUN_SUITE(tests, argc, argv);
}
