/*
 * What only a real Apache Kafka cluster has (issue 36): replication and the
 * in-sync replicas, leader elections, a paused or unreachable leader,
 * broker-side limits, a topic that does not exist with auto-create off,
 * ACLs, producer state that expires, compression on disk. Each scenario
 * starts its own 3-node KRaft cluster (obx-kafka-cluster: replication
 * factor 3, min.insync.replicas 2; the relay sends with acks=all).
 *
 *   it_real [SCENARIO]
 */
#include "harness.h"
#include "scenario.h"

#include <dirent.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <setjmp.h>
#include <cmocka.h>

static struct h_env env;

/* A second and a third relay on the same outbox (the zombie tests):
 * stopped by the teardown too, whatever failed. */
static struct h_env second, third;

static int teardown_env(void **state)
{
    (void)state;
    if (second.relay_pid > 0)
        h_relay_stop(&second, SIGKILL, 10000);
    if (third.relay_pid > 0)
        h_relay_stop(&third, SIGKILL, 10000);
    h_env_stop(&env);
    return 0;
}

#define TOPICS ((const char *const[]){"it.a:4", "it.b:3", "it.c:1", NULL})

/* Background writers (scenario.h) until stopped. */
struct writers {
    atomic_int stop;
    struct s_writer w[2];
    pthread_t t[2];
};

static void writers_start(struct writers *ws, int pace_ms)
{
    atomic_store(&ws->stop, 0);
    for (int i = 0; i < 2; i++) {
        ws->w[i] = (struct s_writer){
            .env = &env, .w = i, .rows_per_tx = 1 + 2 * i, .stop = &ws->stop, .pace_ms = pace_ms};
        assert_int_equal(pthread_create(&ws->t[i], NULL, s_writer_main, &ws->w[i]), 0);
    }
}

static int writers_stop(struct writers *ws)
{
    atomic_store(&ws->stop, 1);
    for (int i = 0; i < 2; i++)
        pthread_join(ws->t[i], NULL);
    return ws->w[0].written + ws->w[1].written;
}

/* Drains, then checks every row in Kafka exactly once and in key order. */
static size_t drain_exactly_once(const char *const *topics)
{
    s_wait_drained(&env, 120000);
    struct h_records recs = {0};
    h_kafka_read_all(&env, topics, &recs);
    assert_int_equal(h_check_db_matches_kafka(&env, &recs, false), 0);
    size_t n = recs.n;
    h_records_free(&recs);
    return n;
}

/* A node other than `not_a` and `not_b` (1..3). */
static int other_node(long not_a, long not_b)
{
    for (int id = 1; id <= 3; id++)
        if (id != not_a && id != not_b)
            return id;
    return 1;
}

static double relay_metric(const char *series)
{
    static char body[1 << 18];
    assert_int_equal(h_http_get(&env, "/metrics", body, sizeof(body)), 200);
    return h_metric(body, series);
}

/* The canary for a Kafka upgrade (tests/kafka/pom.xml): librdkafka 2.0.2
 * enables what the relay relies on against this broker, as its own
 * feature log says, and a few rows go through once. */
static void test_protocol_features(void **state)
{
    (void)state;
    h_env_start_real(&env, TOPICS, 0, NULL);
    h_relay_start(&env, NULL,
                  (const char *const[]){"log.level=debug", "kafka.debug=feature", NULL});
    s_prefill(&env, "it.a", 50);
    assert_int_equal(drain_exactly_once(S_TOPICS), 50);
    static const char *const needed[] = {"IdempotentProducer", "MsgVer2", "BrokerGroupCoordinator",
                                         "LZ4", "ZSTD"};
    for (size_t i = 0; i < sizeof(needed) / sizeof(needed[0]); i++) {
        char line[96];
        snprintf(line, sizeof(line), "Enabling feature %s", needed[i]);
        if (!h_relay_log_contains(&env, line))
            fail_msg("librdkafka did not enable %s against this broker (no '%s' in the relay's "
                     "log)",
                     needed[i], line);
    }
}

/* The replication window, made wide on purpose: a follower of the only
 * partition is paused, so the leader holds the relay's records above the
 * high watermark until replica.lag.time.max.ms drops the follower from the
 * in-sync set. The relay is killed with them in flight and restarted at
 * once: its recovery pass reads to the high watermark, cannot see them and
 * publishes the rows again. Each duplicate must be of exactly that kind. */
static void test_replication_window(void **state)
{
    (void)state;
    const struct h_kafka k = {.settings = {"replica.lag.time.max.ms=6000", NULL}};
    h_env_start_real(&env, (const char *const[]){"it.w:1", NULL}, 0, &k);
    const char *const *debug = (const char *const[]){"log.level=debug", NULL};
    h_relay_start(&env, NULL, debug);
    PGconn *c = h_connect(&env);
    for (int i = 0; i < 20; i++)
        h_enqueue(c, "it.w", "K", "before", 6, NULL);
    s_wait_drained(&env, 30000);

    long leader = h_broker_query(&env, "leader it.w 0");
    long controller = h_broker_query(&env, "controller");
    int follower = other_node(leader, controller);
    assert_true(h_broker_cmd(&env, "pause %d", follower));
    for (int i = 0; i < 50; i++)
        h_enqueue(c, "it.w", "K", "in the window", 13, NULL);
    /* Sent and waiting for the paused follower's acknowledgement. */
    int64_t deadline = h_now_ms() + 10000;
    while (relay_metric("outboxd_rows_in_flight") < 1 && h_now_ms() < deadline)
        h_sleep_ms(50);
    assert_true(relay_metric("outboxd_rows_in_flight") >= 1);
    h_sleep_ms(300);
    assert_int_equal(h_relay_stop(&env, SIGKILL, 10000), 128 + SIGKILL);
    h_relay_start(&env, NULL, debug);
    s_wait_drained(&env, 60000);
    assert_true(h_broker_cmd(&env, "cont %d", follower));
    assert_true(h_broker_cmd(&env, "wait-isr 60000"));

    struct h_records recs = {0};
    h_kafka_read_all(&env, (const char *const[]){"it.w", NULL}, &recs);
    size_t dups = h_check_db_matches_kafka(&env, &recs, true);
    size_t explained = h_explain_duplicates(&env, &recs);
    assert_int_equal(dups, explained);
    assert_true(dups > 0); /* the window was open: otherwise this test showed nothing */
    print_message("replication window: %zu of 50 rows published twice, each first copy above the "
                  "high watermark the recovery pass read to\n",
                  dups);
    h_records_free(&recs);
    PQfinish(c);
}

/* The leader of a partition the writers use, killed -9 five times, each
 * time the new one; the old one comes back in between. With acks=all and
 * min.insync.replicas 2 an acknowledged record is on a follower that
 * becomes leader, and the idempotent producer's state moves with it. */
static void test_leader_kill_chase(void **state)
{
    (void)state;
    struct writers ws;
    h_env_start_real(&env, TOPICS, 0, NULL);
    writers_start(&ws, 5);
    h_relay_start(&env, NULL, NULL);
    s_wait_sent(&env, 200, 30000);
    for (int i = 0; i < 5; i++) {
        long leader = h_broker_query(&env, "leader it.a 0");
        assert_true(leader >= 1 && leader <= 3);
        assert_true(h_broker_cmd(&env, "kill %ld", leader));
        int64_t deadline = h_now_ms() + 30000;
        long now;
        while ((now = h_broker_query(&env, "leader it.a 0")) == leader || now < 0) {
            if (h_now_ms() > deadline)
                fail_msg("kill %d: no new leader of it.a [0] within 30 s", i);
            h_sleep_ms(200);
        }
        h_sleep_ms(1000);
        assert_true(h_broker_cmd(&env, "start %ld", leader));
        assert_true(h_broker_cmd(&env, "wait-isr 60000"));
    }
    int written = writers_stop(&ws);
    size_t n = drain_exactly_once(S_TOPICS);
    print_message("leader killed 5 times: %zu records (%d rows by writers), exactly once\n", n,
                  written);
}

/* Every node restarted in turn under load: cleanly (SIGTERM, controlled
 * shutdown moves leadership first), then hard (kill -9 and start). */
static void test_rolling_restarts(void **state)
{
    (void)state;
    struct writers ws;
    h_env_start_real(&env, TOPICS, 0, NULL);
    writers_start(&ws, 5);
    h_relay_start(&env, NULL, NULL);
    s_wait_sent(&env, 200, 30000);
    for (int id = 1; id <= 3; id++) {
        assert_true(h_broker_cmd(&env, "restart %d", id));
        assert_true(h_broker_cmd(&env, "wait-isr 60000"));
    }
    for (int id = 1; id <= 3; id++) {
        assert_true(h_broker_cmd(&env, "kill %d", id));
        h_sleep_ms(1500);
        assert_true(h_broker_cmd(&env, "start %d", id));
        assert_true(h_broker_cmd(&env, "wait-isr 60000"));
    }
    int written = writers_stop(&ws);
    size_t n = drain_exactly_once(S_TOPICS);
    print_message("clean and hard rolling restarts: %zu records (%d rows by writers), exactly "
                  "once\n",
                  n, written);
}

/* The quorum's active controller killed -9 under load, twice (the other
 * two elect a new one), and the group coordinator of the recovery pass's
 * consumer (group.id outboxd-recovery: it commits nothing, but librdkafka
 * looks the coordinator up), each time with the relay killed and
 * restarted, so that its recovery pass runs while that node is gone. */
static void test_controller_and_coordinator_killed(void **state)
{
    (void)state;
    struct writers ws;
    h_env_start_real(&env, TOPICS, 0, NULL);
    writers_start(&ws, 5);
    h_relay_start(&env, NULL, NULL);
    s_wait_sent(&env, 200, 30000);
    for (int i = 0; i < 3; i++) {
        long victim = i < 2 ? h_broker_query(&env, "controller")
                            : h_broker_query(&env, "coordinator group outboxd-recovery");
        assert_true(h_broker_cmd(&env, "kill %ld", victim));
        if (i < 2)
            assert_true(h_broker_query(&env, "controller") != victim);
        assert_int_equal(h_relay_stop(&env, SIGKILL, 10000), 128 + SIGKILL);
        h_relay_start(&env, NULL, NULL);
        h_sleep_ms(3000);
        assert_true(h_broker_cmd(&env, "start %ld", victim));
        assert_true(h_broker_cmd(&env, "wait-isr 60000"));
    }
    int written = writers_stop(&ws);
    size_t n = drain_exactly_once(S_TOPICS);
    print_message("active controller killed twice, then the recovery group's coordinator (the "
                  "relay killed and restarted each time): %zu records (%d rows by writers), "
                  "exactly once\n",
                  n, written);
}

/* A leader paused (SIGSTOP) for longer than the relay's request timeout
 * and the brokers' session timeout: its requests time out, the controller
 * fences it and another replica leads; it then wakes up with requests of
 * ours it had read but not answered. */
static void test_leader_paused(void **state)
{
    (void)state;
    struct writers ws;
    h_env_start_real(&env, TOPICS, 0, NULL);
    writers_start(&ws, 5);
    h_relay_start(&env, NULL, (const char *const[]){"kafka.request.timeout.ms=3000", NULL});
    s_wait_sent(&env, 200, 30000);
    long leader = h_broker_query(&env, "leader it.a 0");
    assert_true(h_broker_cmd(&env, "pause %ld", leader));
    h_sleep_ms(8000);
    int64_t sent = s_sent_count(&env);
    assert_true(h_broker_cmd(&env, "cont %ld", leader));
    assert_true(h_broker_cmd(&env, "wait-isr 60000"));
    int written = writers_stop(&ws);
    size_t n = drain_exactly_once(S_TOPICS);
    print_message("leader paused 8 s (request timeout 3 s): %lld rows sent while it was, %zu "
                  "records (%d rows by writers), exactly once\n",
                  (long long)sent, n, written);
}

/* Every broker down for longer than a finite kafka.message.timeout.ms:
 * records time out in the producer (possibly persisted or not), the
 * recovery pass cannot reach Kafka and waits; once the cluster is back,
 * every row is there once. */
static void test_all_brokers_down(void **state)
{
    (void)state;
    h_env_start_real(&env, TOPICS, 0, NULL);
    h_relay_start(&env, NULL,
                  (const char *const[]){"kafka.message.timeout.ms=4000",
                                        "kafka.request.timeout.ms=2000",
                                        "relay.retry_backoff=300ms", NULL});
    s_prefill(&env, "it.a", 300);
    s_wait_drained(&env, 30000);
    assert_true(h_broker_cmd(&env, "kill all"));
    s_prefill(&env, "it.b", 300);
    s_prefill(&env, "it.c", 300);
    h_sleep_ms(9000);
    assert_int_equal(s_sent_count(&env), 300);
    assert_true(h_broker_cmd(&env, "start all"));
    assert_true(h_broker_cmd(&env, "wait-isr 60000"));
    assert_int_equal(drain_exactly_once(S_TOPICS), 900);
    assert_true(
        h_relay_events(&env, "publish_failed", NULL) + h_relay_log_count(&env, "timed out") > 0);
}

/* The relay's connections cut (reset, new ones refused) and blackholed
 * (open, nothing forwarded) by our TCP proxy, while the brokers among
 * themselves are fine. */
static void test_connections_cut(void **state)
{
    (void)state;
    struct writers ws;
    const struct h_kafka k = {.proxy = true};
    h_env_start_real(&env, TOPICS, 0, &k);
    writers_start(&ws, 5);
    h_relay_start(&env, NULL, (const char *const[]){"kafka.request.timeout.ms=3000", NULL});
    s_wait_sent(&env, 200, 30000);
    for (int i = 0; i < 3; i++) {
        assert_true(h_broker_cmd(&env, "cut all"));
        h_sleep_ms(2000);
        assert_true(h_broker_cmd(&env, "heal all"));
        h_sleep_ms(1000);
    }
    long leader = h_broker_query(&env, "leader it.a 0");
    assert_true(h_broker_cmd(&env, "blackhole %ld", leader));
    h_sleep_ms(6000);
    assert_true(h_broker_cmd(&env, "heal %ld", leader));
    int written = writers_stop(&ws);
    size_t n = drain_exactly_once(S_TOPICS);
    print_message("connections cut 3 times and a leader blackholed 6 s: %zu records (%d rows), "
                  "exactly once\n",
                  n, written);
}

/* Refusals a broker makes and the mock cannot: a row larger than the
 * topic's max.message.bytes (the client's limit is larger), a topic that
 * does not exist (auto-create off), and, with SASL, a topic the relay's
 * user may not write. Under dead_letter each goes to outbox.dead_letters
 * with its reason; under retry its key waits. Either way the other topics
 * and keys go on. */
static void refusals(bool dead_letter, bool transactions)
{
    const struct h_kafka k = {.sasl = true};
    h_env_start_real(
        &env,
        (const char *const[]){"it.a:2", "it.small:1:max.message.bytes=10000", "it.denied:1", NULL},
        0, &k);
    /* It may see and read the topic (so the recovery pass can), not write
     * to it. A topic it may not even describe stops the recovery pass, and
     * so every topic, until it may: doc/guarantees.md. */
    assert_true(h_broker_cmd(&env, "acl allow User:relay it.denied describe"));
    assert_true(h_broker_cmd(&env, "acl allow User:relay it.denied read"));
    assert_true(h_broker_cmd(&env, "acl deny User:relay it.denied write"));
    PGconn *c = h_connect(&env);
    int64_t big = h_sql_int(
        c, "SELECT outbox.enqueue('it.small', 'B', convert_to(repeat('x', 20000), 'UTF8'))");
    int64_t missing = h_enqueue(c, "it.missing", "M", "nowhere", 7, NULL);
    int64_t denied = h_enqueue(c, "it.denied", "D", "forbidden", 9, NULL);
    for (int i = 0; i < 20; i++)
        h_enqueue(c, "it.small", "S", "small", 5, NULL);
    s_prefill(&env, "it.a", 300);
    const char *args[8] = {dead_letter ? "relay.on_reject=dead_letter" : "relay.on_reject=retry",
                           "kafka.batch.size=8000", "kafka.topic.metadata.propagation.max.ms=1000",
                           "relay.retry_backoff=300ms"};
    if (transactions) { /* small ones: the refused rows share them with others */
        args[4] = "relay.transactions=on";
        args[5] = "relay.transaction_rows=50";
        args[6] = "relay.batch_size=50";
    }
    h_relay_start(&env, NULL, args);
    const char *reasons[][2] = {
        {"it.small", "too large"}, {"it.missing", "unknown topic"}, {"it.denied", "authoriz"}};
    int64_t ids[] = {big, missing, denied};
    if (dead_letter) {
        s_wait_drained(&env, 60000);
        for (int i = 0; i < 3; i++)
            if (h_sql_int(c,
                          "SELECT count(*) FROM outbox.dead_letters WHERE id = %lld"
                          " AND reason ILIKE '%%%s%%'",
                          (long long)ids[i], reasons[i][1]) != 1)
                fail_msg("row %lld (%s) is not dead-lettered as '%s'", (long long)ids[i],
                         reasons[i][0], reasons[i][1]);
        assert_int_equal(drain_exactly_once((const char *const[]){"it.a", "it.small", NULL}), 320);
        PQfinish(c);
        return;
    }
    /* retry: everything else goes out while the three keys wait. */
    int64_t deadline = h_now_ms() + 60000;
    while (h_sql_int(c, "SELECT count(*) FROM outbox.events WHERE sent_at IS NULL") > 3 &&
           h_now_ms() < deadline)
        h_sleep_ms(200);
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM outbox.events WHERE sent_at IS NULL"), 3);
    h_sleep_ms(2000); /* retried meanwhile, and still refused */
    for (int i = 0; i < 3; i++)
        assert_int_equal(h_sql_int(c,
                                   "SELECT count(*) FROM outbox.events WHERE id = %lld"
                                   " AND sent_at IS NULL",
                                   (long long)ids[i]),
                         1);
    assert_true(relay_metric("outboxd_keys_held_back") >= 3);
    /* Put right: the relay's user may write, the topic exists, the row is
     * made small. Each held row goes out then, once. */
    assert_true(h_broker_cmd(&env, "acl remove User:relay it.denied write"));
    assert_true(h_broker_cmd(&env, "acl allow User:relay it.denied write"));
    assert_true(h_broker_cmd(&env, "topic it.missing 1"));
    h_sql(c, "UPDATE outbox.events SET payload = 'fixed' WHERE id = %lld", (long long)big);
    assert_int_equal(drain_exactly_once((const char *const[]){"it.a", "it.small", "it.missing",
                                                              "it.denied", NULL}),
                     323);
    if (transactions) {
        /* A refusal aborts the transaction it came in (its other rows go
         * again in the next): some did, and the rest committed. */
        double aborted = relay_metric("outboxd_kafka_transactions_total{result=\"aborted\"}");
        double committed = relay_metric("outboxd_kafka_transactions_total{result=\"committed\"}");
        print_message("refusals in transactions: %.0f aborted, %.0f committed\n", aborted,
                      committed);
        assert_true(aborted > 0);
        assert_true(committed > 0);
    }
    PQfinish(c);
}

/* Issue 37.12: records deleted under a recovery pass between two of its
 * chunks (retention, DeleteRecords). The pass goes on from the first
 * record left (auto.offset.reset = earliest), and finds those; librdkafka's
 * default would jump to the end and publish their rows again. The pass is
 * held between its chunks by a lock on a row its first chunk marks. */
static void test_recovery_position_deleted(void **state)
{
    (void)state;
    h_env_start_real(&env, TOPICS, 0, NULL);
    s_prefill(&env, "it.c", 1000); /* one partition: offset order is id order */
    /* All 1,000 records in Kafka, no row marked: the relay's loop sleeps at
     * its first acknowledgement while librdkafka sends the rest. */
    h_relay_start(&env, "ack.after=sleep(60000)",
                  (const char *const[]){"relay.on_sent=mark", NULL});
    const char *const topic[] = {"it.c", NULL};
    struct h_records recs = {0};
    for (int64_t deadline = h_now_ms() + 30000; recs.n < 1000 && h_now_ms() < deadline;) {
        h_records_free(&recs);
        h_sleep_ms(300);
        h_kafka_read_all(&env, topic, &recs);
    }
    assert_int_equal(recs.n, 1000);
    h_records_free(&recs);
    assert_int_equal(h_relay_stop(&env, SIGKILL, 10000), 128 + SIGKILL);

    PGconn *c = h_connect(&env), *lock = h_connect(&env);
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM outbox.unpublished"), 1000);
    h_sql(lock, "BEGIN");
    h_sql(lock, "SELECT FROM outbox.events WHERE id = (SELECT min(id) FROM outbox.events)"
                " FOR UPDATE");
    h_relay_start(&env, NULL,
                  (const char *const[]){"relay.on_sent=mark", "recovery.chunk_records=100",
                                        "log.level=debug", NULL});
    /* Its first chunk (offsets 0..99) read, its mark waits for the lock. */
    int64_t deadline = h_now_ms() + 30000;
    while (h_sql_int(c, "SELECT count(*) FROM pg_locks WHERE NOT granted") == 0) {
        if (h_now_ms() > deadline)
            fail_msg("the recovery pass's first mark never waited for the lock (see %s)", env.dir);
        h_sleep_ms(20);
    }
    h_kafka_delete_records(&env, "it.c", 0, 500);
    h_sql(lock, "COMMIT");
    PQfinish(lock);
    s_wait_drained(&env, 60000);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    /* Left in Kafka: the records from 500 on, which the pass found (their
     * rows marked, not published again), and new copies of the rows whose
     * records were deleted before the pass read them (100..499). */
    h_kafka_read_all(&env, topic, &recs);
    size_t dups = 0;
    for (size_t i = 0; i < recs.n; i++)
        for (size_t j = i + 1; j < recs.n; j++)
            dups += recs.v[i].outbox_id == recs.v[j].outbox_id;
    print_message("after 500 records were deleted under the pass: %zu records, %zu rows twice\n",
                  recs.n, dups);
    assert_int_equal(dups, 0);
    assert_int_equal(recs.n, 900);
    h_records_free(&recs);
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM outbox.unpublished"), 0);
    PQfinish(c);
}

static void test_refusals_dead_letter(void **state)
{
    (void)state;
    refusals(true, false);
}

static void test_refusals_retry(void **state)
{
    (void)state;
    refusals(false, false);
}

/* The same with relay.transactions, read back read_committed: the refused
 * rows' keys wait while every other row commits once, then each goes. */
static void test_txn_refusals_retry(void **state)
{
    (void)state;
    refusals(false, true);
}

/* Issue 37 (items 7, 8): a topic the relay may describe but not write (a
 * DENY ACL: the broker refuses each produce request), 3,000 rows over
 * 1,000 keys waiting for it, writers on the other topics for 20 s. The
 * topic is held as one entry and tried alone with back-off, so a refusal
 * never takes another topic's records with it; their oldest unsent row
 * stays young. Once the ACL allows, the topic's rows go out, each once. */
static void test_refused_topic_held(void **state)
{
    (void)state;
    const struct h_kafka k = {.sasl = true};
    h_env_start_real(&env, (const char *const[]){"it.a:2", "it.b:2", "it.c:1", "it.denied:3", NULL},
                     0, &k);
    assert_true(h_broker_cmd(&env, "acl allow User:relay it.denied describe"));
    assert_true(h_broker_cmd(&env, "acl allow User:relay it.denied read"));
    assert_true(h_broker_cmd(&env, "acl deny User:relay it.denied write"));
    PGconn *c = h_connect(&env);
    h_sql(c, "INSERT INTO outbox.events (topic, key, payload)"
             " SELECT 'it.denied', 'd' || (g %% 1000), convert_to('denied ' || g, 'UTF8')"
             "   FROM generate_series(1, 3000) g");
    h_relay_start(
        &env, NULL,
        (const char *const[]){"relay.on_reject=retry", "relay.retry_backoff=300ms", NULL});
    h_wait_log(&env, "topic it.denied refused row", 60000);
    struct writers ws;
    writers_start(&ws, 5);
    int64_t worst = 0, end = h_now_ms() + 20000;
    while (h_now_ms() < end) {
        int64_t lag = h_sql_int(c, "SELECT coalesce(max(extract(epoch FROM clock_timestamp()"
                                   " - created_at) * 1000), 0)::bigint FROM outbox.events"
                                   " WHERE sent_at IS NULL AND topic <> 'it.denied'");
        if (lag > worst)
            worst = lag;
        h_sleep_ms(250);
    }
    int written = writers_stop(&ws);
    long resets = h_relay_events(&env, "producer_replaced", NULL);
    print_message("%d rows to other topics in 20 s while it.denied refused 3,000 rows over 1,000 "
                  "keys: the oldest unsent of them at most %lld ms old; %ld producers replaced, "
                  "%.0f entries held\n",
                  written, (long long)worst, resets, relay_metric("outboxd_keys_held_back"));
    assert_true(written > 500);
    assert_true(worst < 5000);
    assert_true(relay_metric("outboxd_keys_held_back") == 1);
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM outbox.events WHERE topic = 'it.denied'"
                                  " AND sent_at IS NULL"),
                     3000);
    assert_true(h_broker_cmd(&env, "acl remove User:relay it.denied write"));
    assert_true(h_broker_cmd(&env, "acl allow User:relay it.denied write"));
    assert_int_equal(
        drain_exactly_once((const char *const[]){"it.a", "it.b", "it.c", "it.denied", NULL}),
        (size_t)written + 3000);
    PQfinish(c);
}

/* The broker forgets an idle producer's state after
 * producer.id.expiration.ms; the relay, idle that long, writes again and
 * must neither stop on a fatal error nor publish a row twice. */
static void test_producer_state_expires(void **state)
{
    (void)state;
    const struct h_kafka k = {.settings = {"producer.id.expiration.ms=3000",
                                           "producer.id.expiration.check.interval.ms=500", NULL}};
    h_env_start_real(&env, TOPICS, 0, &k);
    h_relay_start(&env, NULL, NULL);
    for (int round = 0; round < 3; round++) {
        s_prefill(&env, round == 1 ? "it.b" : "it.a", 200);
        s_wait_drained(&env, 30000);
        h_sleep_ms(7000); /* idle: well past the expiry and its check */
    }
    /* Neither a fatal error nor a producer replaced after one. */
    assert_int_equal(h_relay_log_count(&env, "kafka: fatal error"), 0);
    assert_int_equal(h_relay_log_count(&env, "librdkafka stopped the producer"), 0);
    static char body[4096];
    assert_int_equal(h_http_get(&env, "/readyz", body, sizeof(body)), 200);
    assert_int_equal(drain_exactly_once(S_TOPICS), 600);
}

/* Bytes of the partition's segment files on node `id` (DIR/kafka/n<id>). */
static long long segment_bytes(int id, const char *topic, int partition)
{
    char path[600];
    snprintf(path, sizeof(path), "%s/kafka/n%d/data/%s-%d", env.dir, id, topic, partition);
    DIR *d = opendir(path);
    if (!d)
        fail_msg("no directory %s", path);
    long long total = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t len = strlen(de->d_name);
        char file[900];
        struct stat st;
        if (len < 4 || strcmp(de->d_name + len - 4, ".log") != 0)
            continue;
        snprintf(file, sizeof(file), "%s/%s", path, de->d_name);
        if (stat(file, &st) == 0)
            total += st.st_size;
    }
    closedir(d);
    return total;
}

/* Each codec: rows read back intact, and the leader's segment holds far
 * fewer bytes than the payloads (the broker kept the producer's batches
 * compressed). */
static void compression(const char *codec)
{
    char setting[64];
    snprintf(setting, sizeof(setting), "kafka.compression.type=%s", codec);
    h_env_start_real(&env, (const char *const[]){"it.z:1", NULL}, 0, NULL);
    PGconn *c = h_connect(&env);
    h_sql(c, "SELECT outbox.enqueue('it.z', 'k' || (i %% 7)::text,"
             " convert_to(repeat('compressible payload ' || (i %% 10)::text || ' ', 100), 'UTF8'))"
             " FROM generate_series(1, 1000) i");
    h_relay_start(&env, NULL, (const char *const[]){setting, "kafka.linger.ms=20", NULL});
    assert_int_equal(drain_exactly_once((const char *const[]){"it.z", NULL}), 1000);
    long leader = h_broker_query(&env, "leader it.z 0");
    long long payload = 1000LL * 100 * 23, on_disk = segment_bytes((int)leader, "it.z", 0);
    print_message("%s: %lld payload bytes, %lld bytes in the leader's segment\n", codec, payload,
                  on_disk);
    if (on_disk <= 0 || on_disk * 4 > payload)
        fail_msg("%s: the segment holds %lld bytes for %lld payload bytes: not compressed", codec,
                 on_disk, payload);
    PQfinish(c);
}

static void test_compression_gzip(void **state)
{
    (void)state;
    compression("gzip");
}

static void test_compression_lz4(void **state)
{
    (void)state;
    compression("lz4");
}

static void test_compression_zstd(void **state)
{
    (void)state;
    compression("zstd");
}

/* ---- relay.transactions (issue 40) ---- */

/* Small transactions, so that every window below is hit within a few
 * hundred rows. */
#define TXN_ARGS                                                                                   \
    ((const char *const[]){"relay.transactions=on", "relay.transaction_rows=50",                   \
                           "relay.batch_size=50", NULL})

/* What a read_committed consumer sees: every row once, in key order (0
 * duplicates, nothing excused); what a read_uncommitted one sees beside
 * it, as a figure. */
static size_t expect_committed_once(const char *what, size_t *uncommitted_out)
{
    struct h_records recs = {0};
    h_kafka_read_all_as(&env, S_TOPICS, true, &recs);
    assert_int_equal(h_check_db_matches_kafka(&env, &recs, false), 0);
    size_t n = recs.n;
    h_records_free(&recs);
    h_kafka_read_all_as(&env, S_TOPICS, false, &recs);
    size_t uncommitted = recs.n;
    h_records_free(&recs);
    print_message("%s: %zu records for a read_committed consumer, each row once; a "
                  "read_uncommitted one reads %zu (%zu of aborted transactions)\n",
                  what, n, uncommitted, uncommitted - n);
    if (uncommitted_out)
        *uncommitted_out = uncommitted;
    return n;
}

/* Rows go out in transactions, marked once theirs committed; the relay
 * says it fenced the producers before it. */
static void test_txn_delivery(void **state)
{
    (void)state;
    struct writers ws;
    h_env_start_real(&env, TOPICS, 0, NULL);
    writers_start(&ws, 5);
    h_relay_start(&env, NULL, TXN_ARGS);
    h_wait_event(&env, "transactions_ready", NULL, 1, 30000);
    s_wait_sent(&env, 300, 30000);
    int written = writers_stop(&ws);
    s_wait_drained(&env, 60000);
    double commits = relay_metric("outboxd_kafka_transactions_total{result=\"committed\"}");
    assert_true(commits > 0);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    size_t n = expect_committed_once("transactions", NULL);
    print_message("transactions: %.0f committed\n", commits);
    assert_true(n >= (size_t)written);

    /* --check --live initialises transactions as a session does (with an
     * id of its own), and says when the brokers refuse them: here a
     * transaction timeout above their transaction.max.timeout.ms (15 min). */
    char conf[600], out[8192];
    snprintf(conf, sizeof(conf), "%s/relay.conf", env.dir);
    int rc = h_run_outboxd((char *const[]){"outboxd", "--config", conf, "-X",
                                           "relay.transactions=on", "--check", "--live", NULL},
                           (char *const[]){NULL}, out, sizeof(out));
    if (rc != 0 || !strstr(out, "ok: kafka transactions"))
        fail_msg("--check --live with transactions: %d\n%s", rc, out);
    rc = h_run_outboxd((char *const[]){"outboxd", "--config", conf, "-X", "relay.transactions=on",
                                       "-X", "kafka.transaction.timeout.ms=1000000", "--check",
                                       "--live", NULL},
                       (char *const[]){NULL}, out, sizeof(out));
    if (rc == 0 || !strstr(out, "could not initialise transactions"))
        fail_msg("--check --live with a transaction timeout the brokers refuse: %d\n%s", rc, out);
}

/* Every crash window of a transaction: the relay killed (a failpoint's
 * crash, SIGKILL) after rows went to Kafka in an open transaction, with
 * every report in and the commit not sent, after the commit and before the
 * mark, in the mark's windows and after the recovery pass's read; each
 * time started again at once. What
 * the crash left open is aborted by the next relay's init, what committed
 * is found and marked by its recovery pass (read_committed). */
static void test_txn_crash_windows(void **state)
{
    (void)state;
    static const char *const windows[] = {
        "produce.after=crash@3", "txn.before_commit=crash@3",  "txn.after_commit=crash@3",
        "ack.after=crash@3",     "mark.before_commit=crash@3", "mark.after_commit=crash@3",
    };
    h_env_start_real(&env, TOPICS, 0, NULL);
    for (size_t i = 0; i < sizeof(windows) / sizeof(windows[0]); i++) {
        s_prefill(&env, S_TOPICS[i % 3], 400);
        h_relay_start(&env, windows[i], TXN_ARGS);
        int rc = h_relay_wait(&env, 60000);
        if (rc != 128 + SIGKILL)
            fail_msg("%s: the relay ended with %d, not by the failpoint's crash", windows[i], rc);
        h_relay_start(&env, NULL, TXN_ARGS);
        s_wait_drained(&env, 60000);
        assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    }
    /* And the pass that finds committed rows unmarked, killed after its
     * read: the next one finds them again. */
    s_prefill(&env, "it.b", 400);
    h_relay_start(&env, "txn.after_commit=crash@2", TXN_ARGS);
    assert_int_equal(h_relay_wait(&env, 60000), 128 + SIGKILL);
    h_relay_start(&env, "recover.after_scan=crash", TXN_ARGS);
    assert_int_equal(h_relay_wait(&env, 60000), 128 + SIGKILL);
    h_relay_start(&env, NULL, TXN_ARGS);
    s_wait_drained(&env, 60000);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    expect_committed_once("every crash window", NULL);
}

/* The replication window of test_replication_window, with transactions:
 * a follower of the only partition paused in the middle of a backlog,
 * while a transaction that already holds records of the partition goes
 * on; its later records wait above the high watermark for the paused
 * follower, and the relay is killed. The next one's init aborts that
 * transaction (its records do land, for a read_uncommitted consumer), and
 * a read_committed consumer sees every row once (without transactions the
 * same window shows duplicates, which that test requires). */
static void test_txn_replication_window(void **state)
{
    (void)state;
    const struct h_kafka k = {.settings = {"replica.lag.time.max.ms=6000", NULL}};
    /* One record a request, each waiting for every in-sync replica: a
     * transaction of 2,000 rows takes seconds to send, so the pause lands
     * in the middle of one that already registered the partition. */
    const char *const *args = (const char *const[]){
        "relay.transactions=on", "relay.transaction_rows=2000", "kafka.batch.num.messages=1", NULL};
    h_env_start_real(&env, (const char *const[]){"it.w:1", NULL}, 0, &k);
    s_prefill(&env, "it.w", 10000);
    h_relay_start(&env, NULL, args);
    s_wait_sent(&env, 2000, 30000); /* a transaction committed */
    h_sleep_ms(500);                /* the next one is sending */
    long leader = h_broker_query(&env, "leader it.w 0");
    long controller = h_broker_query(&env, "controller");
    int follower = other_node(leader, controller);
    assert_true(h_broker_cmd(&env, "pause %d", follower));
    h_sleep_ms(1500);
    assert_int_equal(h_relay_stop(&env, SIGKILL, 10000), 128 + SIGKILL);
    h_relay_start(&env, NULL, args);
    s_wait_drained(&env, 90000);
    assert_true(h_broker_cmd(&env, "cont %d", follower));
    assert_true(h_broker_cmd(&env, "wait-isr 60000"));
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);

    const char *const *w = (const char *const[]){"it.w", NULL};
    struct h_records recs = {0};
    h_kafka_read_all_as(&env, w, true, &recs);
    assert_int_equal(h_check_db_matches_kafka(&env, &recs, false), 0);
    size_t n = recs.n;
    h_records_free(&recs);
    h_kafka_read_all_as(&env, w, false, &recs);
    size_t uncommitted = recs.n;
    h_records_free(&recs);
    print_message("replication window with transactions: %zu records for a read_committed "
                  "consumer, each row once; %zu for a read_uncommitted one (%zu of the aborted "
                  "transaction)\n",
                  n, uncommitted, uncommitted - n);
    assert_true(uncommitted > n); /* the window was open: otherwise this test showed nothing */
}

/* Two relays on the same servers for the zombie tests: the first (env,
 * application_name aa) and a second (b, bb), with slow reconnects; their
 * conninfo settings into ci_a and ci_b. */
static const char *const zombie_slow[] = {"postgres.reconnect_backoff_min=1s",
                                          "postgres.reconnect_backoff_max=2s"};

static struct h_env *zombie_pair(char *ci_a, char *ci_b, size_t len)
{
    struct h_env *b = &second;
    h_env_start_real(&env, TOPICS, H_PG_TCP, NULL);
    *b = env;
    snprintf(b->relay_name, sizeof(b->relay_name), "b");
    b->http_port = h_free_port();
    snprintf(ci_a, len, "postgres.conninfo=%s application_name=aa", env.conninfo);
    snprintf(ci_b, len, "postgres.conninfo=%s application_name=bb", env.conninfo);
    return b;
}

/* The first relay of zombie_pair alone, in transactions of 2,000 rows
 * sent one record a request through a backlog: a transaction of it is
 * always open with records in the log. */
static void zombie_start_alone(const char *ci_a)
{
    const char *const *slow = zombie_slow;
    h_relay_start(&env, NULL,
                  (const char *const[]){ci_a, slow[0], slow[1], "relay.transactions=on",
                                        "relay.transaction_rows=2000", "kafka.batch.num.messages=1",
                                        NULL});
    h_wait_event(&env, "transactions_ready", NULL, 1, 30000);
}

/* A relay frozen (SIGSTOP) and its Postgres sessions (application_name
 * `app`) terminated. */
static void freeze_and_cut(struct h_env *r, const char *app)
{
    kill(r->relay_pid, SIGSTOP);
    PGconn *c = h_connect(&env);
    assert_true(h_sql_int(c,
                          "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                          " WHERE application_name = '%s'",
                          app) >= 1);
    PQfinish(c);
}

/* The first relay of zombie_pair frozen and cut. */
static void zombie_freeze_and_cut(void)
{
    freeze_and_cut(&env, "aa");
}

/* The zombie: the active relay frozen (SIGSTOP) with rows in flight, its
 * session terminated, the standby takes over (its init fences the frozen
 * one's producer and aborts its open transaction); the frozen one goes on
 * 3 s later with what librdkafka still held (it sends one record a
 * request, so some of its open transaction is always in the log). Nothing
 * it sends is
 * committed: a read_committed consumer sees every row once, nothing
 * excused (live_zombie, without transactions, counts the window). */
static void test_txn_zombie(void **state)
{
    (void)state;
    char ci_a[700], ci_b[700];
    struct writers ws;
    const char *const *slow = zombie_slow;
    struct h_env *b = zombie_pair(ci_a, ci_b, sizeof(ci_a));
    zombie_start_alone(ci_a);
    h_relay_start(
        b, NULL,
        (const char *const[]){ci_b, slow[0], slow[1], TXN_ARGS[0], TXN_ARGS[1], TXN_ARGS[2], NULL});
    h_wait_event(b, "standing_by", NULL, 1, 15000);
    s_prefill(&env, "it.a", 8000);
    writers_start(&ws, 5);
    s_wait_sent(&env, 2000, 30000); /* a transaction committed */
    h_sleep_ms(500);                /* the next one is sending */
    zombie_freeze_and_cut();
    h_wait_event(b, "transactions_ready", NULL, 1, 30000);
    h_sleep_ms(3000);
    kill(env.relay_pid, SIGCONT);
    h_sleep_ms(3000);
    int written = writers_stop(&ws);
    s_wait_drained(b, 60000);
    h_relay_stop(&env, SIGTERM, 30000); /* stood aside, or stopped when fenced */
    assert_int_equal(h_relay_stop(b, SIGTERM, 30000), 0);
    size_t uncommitted;
    size_t n = expect_committed_once("zombie", &uncommitted);
    assert_true(n >= (size_t)written);
    /* The frozen relay had records of its open transaction in the log
     * (one record a request keeps some there at any time): they landed,
     * aborted, and no read_committed consumer saw them. */
    assert_true(uncommitted > n);
}

/* The zombie with relay.shards, and a chain of lost owners: two relays
 * share 4 slots, each with a transactional.id of its session. The first
 * is frozen (SIGSTOP) with a transaction open and records of it in the
 * log, its session terminated. The second takes its slots and dies
 * (failpoint txn.before_fence) before it fences the first: the slots now
 * name the second as their owner and the first as still to fence
 * (sql/013). A third relay takes every slot and fences both, and the
 * frozen one, going on 3 s later, cannot commit. A read_committed
 * consumer sees every row once. */
static void test_txn_shards_zombie(void **state)
{
    (void)state;
    char ci_a[700], ci_b[700], ci_c[700], first_words[40];
    struct writers ws;
    const char *const *slow = zombie_slow;
    struct h_env *b = zombie_pair(ci_a, ci_b, sizeof(ci_a)), *c = &third;
    *c = env;
    snprintf(c->relay_name, sizeof(c->relay_name), "c");
    c->http_port = h_free_port();
    snprintf(ci_c, sizeof(ci_c), "postgres.conninfo=%s application_name=cc", env.conninfo);
    /* A transaction timeout the test outlasts: only a fence ends the
     * frozen relay's transaction. */
    h_relay_start(&env, NULL,
                  (const char *const[]){ci_a, slow[0], slow[1], "relay.shards=4",
                                        "relay.transactions=on", "relay.transaction_rows=2000",
                                        "kafka.batch.num.messages=1",
                                        "kafka.transaction.timeout.ms=60000", NULL});
    h_relay_start(b, "txn.before_fence=crash",
                  (const char *const[]){ci_b, slow[0], slow[1], "relay.shards=4",
                                        "relay.transactions=on", "relay.transaction_rows=500",
                                        "relay.batch_size=500", NULL});
    h_wait_event(&env, "transactions_ready", NULL, 1, 30000);
    h_wait_event(b, "transactions_ready", NULL, 1, 30000);
    s_prefill(&env, "it.a", 8000);
    writers_start(&ws, 5);
    s_wait_sent(&env, 3000, 60000); /* both publish; the first's transactions are large */
    h_sleep_ms(500);
    PGconn *pc = h_connect(&env);
    long first = h_sql_int(pc, "SELECT min(owner_pid) FROM outbox.slot_owners"
                               " WHERE shards = 4 AND owner_name = 'aa'");
    assert_true(first > 0);
    zombie_freeze_and_cut();
    assert_int_equal(h_relay_wait(b, 30000), 128 + SIGKILL);
    assert_true(h_sql_int(pc,
                          "SELECT count(*) FROM outbox.slot_owners WHERE shards = 4"
                          " AND owner_name = 'bb' AND %ld = ANY (unfenced)",
                          first) >= 1);
    h_relay_start(c, NULL,
                  (const char *const[]){ci_c, slow[0], slow[1], "relay.shards=4",
                                        "relay.transactions=on", "relay.transaction_rows=500",
                                        "relay.batch_size=500", NULL});
    snprintf(first_words, sizeof(first_words), "session %ld", first);
    h_wait_event(c, "owners_fenced", first_words, 1, 30000);
    h_sleep_ms(3000);
    kill(env.relay_pid, SIGCONT);
    h_sleep_ms(3000);
    int written = writers_stop(&ws);
    s_wait_drained(c, 90000);
    /* The third's claims took the owners it fenced off the slots. */
    assert_int_equal(h_sql_int(pc, "SELECT count(*) FROM outbox.slot_owners"
                                   " WHERE shards = 4 AND cardinality(unfenced) > 0"),
                     0);
    PQfinish(pc);
    h_relay_stop(&env, SIGTERM, 30000); /* fenced and back, or stopped */
    assert_int_equal(h_relay_stop(c, SIGTERM, 30000), 0);
    size_t uncommitted;
    size_t n = expect_committed_once("zombie with slots", &uncommitted);
    assert_true(n >= (size_t)written + 8000);
    /* A figure, not a check: the frozen relay may notice its lost session
     * and purge what it held before a request of it reaches a broker. */
    long fenced = h_relay_log_count(&env, "fenced by newer producer instance");
    print_message("zombie with slots, fenced by the third relay: the frozen relay's aborted "
                  "records: %zu, its requests refused as fenced: %ld\n",
                  uncommitted - n, fenced);
    assert_true(uncommitted > n);
}

/* relay.shards changed, both ways, each time over a zombie: a relay
 * alone (relay.shards = 1, transactional.id the outbox's) is frozen with a
 * transaction open and cut off; a relay with 4 slots (an id of its
 * session) takes over and fences the lone relay's id before its pass.
 * Later that one is frozen and cut off in turn, and the first, standing by
 * since, takes the relay lock alone and fences the lost slot owner's id
 * (its session, from outbox.slot_owners) first. Each zombie goes on 3 s
 * after the fence and cannot commit: a read_committed consumer sees every
 * row once. */
static void test_txn_shards_change_zombie(void **state)
{
    (void)state;
    char ci_a[700], ci_b[700];
    struct writers ws;
    const char *const *slow = zombie_slow;
    struct h_env *b = zombie_pair(ci_a, ci_b, sizeof(ci_a));
    zombie_start_alone(ci_a);
    h_relay_start(b, NULL,
                  (const char *const[]){ci_b, slow[0], slow[1], "relay.shards=4",
                                        "relay.transactions=on", "relay.transaction_rows=2000",
                                        "kafka.batch.num.messages=1", NULL});
    h_wait_event(b, "standing_by", NULL, 1, 15000);
    s_prefill(&env, "it.a", 5000);
    writers_start(&ws, 5);
    s_wait_sent(&env, 1500, 30000);
    h_sleep_ms(500); /* the alone relay's next transaction is sending */
    zombie_freeze_and_cut();
    h_wait_event(b, "owners_fenced", "a relay alone", 1, 30000);
    h_sleep_ms(3000);
    kill(env.relay_pid, SIGCONT);
    int64_t sent = s_sent_count(&env);
    s_wait_sent(&env, sent + 1500, 60000);
    h_sleep_ms(500); /* the slot owner's next transaction is sending */
    freeze_and_cut(b, "bb");
    h_wait_event(&env, "owners_fenced", "session", 1, 30000);
    h_sleep_ms(3000);
    kill(b->relay_pid, SIGCONT);
    h_sleep_ms(2000);
    int written = writers_stop(&ws);
    s_wait_drained(&env, 90000);
    h_relay_stop(b, SIGTERM, 30000); /* standing by, or stopped when fenced */
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    size_t uncommitted;
    size_t n = expect_committed_once("relay.shards changed over zombies", &uncommitted);
    assert_true(n >= (size_t)written + 5000);
    print_message("relay.shards changed over zombies: their aborted records: %zu\n",
                  uncommitted - n);
    assert_true(uncommitted > n);
    /* Each zombie went on with requests of its open transaction out, and
     * the brokers refused them: its id had been fenced (by the relay with
     * slots, and by the relay alone), not merely aborted by itself. */
    const char *fenced = "fenced by newer producer instance";
    long fenced_a = h_relay_log_count(&env, fenced), fenced_b = h_relay_log_count(b, fenced);
    print_message("relay.shards changed over zombies: refusals as fenced: the relay alone %ld, "
                  "the relay with slots %ld\n",
                  fenced_a, fenced_b);
    assert_true(fenced_a >= 1);
    assert_true(fenced_b >= 1);
}

/* The transaction coordinator's broker killed -9 in the middle of a
 * stream of transactions, and started again: the relay finds the new
 * coordinator (or, fenced when its transaction outlived the timeout,
 * makes a new producer after a recovery pass) and every row goes once. */
static void test_txn_coordinator_killed(void **state)
{
    (void)state;
    struct writers ws;
    h_env_start_real(&env, TOPICS, 0, NULL);
    writers_start(&ws, 5);
    h_relay_start(&env, NULL,
                  (const char *const[]){"relay.transactions=on", "relay.transaction_rows=50",
                                        "kafka.transactional.id=it-txn", NULL});
    s_wait_sent(&env, 300, 30000);
    long victim = h_broker_query(&env, "coordinator txn it-txn");
    assert_true(victim >= 1 && victim <= 3);
    assert_true(h_broker_cmd(&env, "kill %ld", victim));
    h_sleep_ms(4000);
    int64_t sent = s_sent_count(&env);
    assert_true(h_broker_cmd(&env, "start %ld", victim));
    assert_true(h_broker_cmd(&env, "wait-isr 60000"));
    int written = writers_stop(&ws);
    s_wait_drained(&env, 60000);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0); /* it lived through it */
    size_t n = expect_committed_once("coordinator killed", NULL);
    assert_true(n >= (size_t)written);
    print_message("coordinator (node %ld) killed 4 s: %lld rows sent by then, %ld transactions "
                  "lost their producer\n",
                  victim, (long long)sent, h_relay_events(&env, "transactions_lost", NULL));
}

/* Every broker down for longer than the transaction timeout, a
 * transaction open (one record a request through a backlog): when the
 * cluster is back, the coordinator has aborted it and fenced the producer;
 * the relay makes a new one after a recovery pass, and every row goes
 * once. */
static void test_txn_all_brokers_down(void **state)
{
    (void)state;
    h_env_start_real(&env, TOPICS, 0, NULL);
    s_prefill(&env, "it.a", 6000);
    h_relay_start(&env, NULL,
                  (const char *const[]){"relay.transactions=on", "relay.transaction_rows=2000",
                                        "kafka.transaction.timeout.ms=6000",
                                        "kafka.batch.num.messages=1", "relay.retry_backoff=300ms",
                                        NULL});
    s_wait_sent(&env, 2000, 30000);
    h_sleep_ms(300); /* the next transaction is sending */
    assert_true(h_broker_cmd(&env, "kill all"));
    h_sleep_ms(10000); /* past the 6 s transaction timeout */
    assert_true(h_broker_cmd(&env, "start all"));
    assert_true(h_broker_cmd(&env, "wait-isr 60000"));
    s_wait_drained(&env, 90000);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0); /* it lived through it */
    size_t n = expect_committed_once("all brokers down past the transaction timeout", NULL);
    assert_int_equal(n, 6000);
    print_message("all brokers down 10 s: %ld times the producer was lost and replaced\n",
                  h_relay_events(&env, "transactions_lost", NULL));
}

/* kill -9 at random moments, writers running, with transactions: each
 * next relay's init aborts what the killed one left open, its pass
 * (read_committed) finds what committed; a read_committed consumer sees
 * every row once, whatever the moment (test_kill_loop's, without the
 * replication window's excuse). OBX_KILLS, OBX_SEED as there. */
static void test_txn_kill_loop(void **state)
{
    (void)state;
    struct writers ws;
    int kills;
    unsigned seed;
    s_kill_loop_settings(10, &kills, &seed);
    h_env_start_real(&env, TOPICS, 0, NULL);
    s_prefill(&env, "it.c", 2000);
    writers_start(&ws, 10);
    for (int i = 0; i < kills; i++) {
        h_relay_start(&env, NULL, TXN_ARGS);
        h_sleep_ms(400 + rand() % 1400);
        int rc = h_relay_stop(&env, SIGKILL, 10000);
        if (rc != 128 + SIGKILL)
            fail_msg("kill %d (seed %u): the relay had already exited with %d (see %s)", i, seed,
                     rc, env.dir);
    }
    h_relay_start(&env, NULL, TXN_ARGS);
    h_sleep_ms(1000);
    int written = writers_stop(&ws);
    s_wait_drained(&env, 90000);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    size_t uncommitted = 0;
    size_t n = expect_committed_once("kill loop in transactions", &uncommitted);
    assert_true(n >= (size_t)written + 2000);
    print_message("kill loop in transactions (seed %u): %d kills, %zu rows once each for "
                  "read_committed, %zu records of aborted transactions\n",
                  seed, kills, n, uncommitted - n);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_protocol_features, teardown_env),
        cmocka_unit_test_teardown(test_replication_window, teardown_env),
        cmocka_unit_test_teardown(test_leader_kill_chase, teardown_env),
        cmocka_unit_test_teardown(test_rolling_restarts, teardown_env),
        cmocka_unit_test_teardown(test_controller_and_coordinator_killed, teardown_env),
        cmocka_unit_test_teardown(test_leader_paused, teardown_env),
        cmocka_unit_test_teardown(test_all_brokers_down, teardown_env),
        cmocka_unit_test_teardown(test_connections_cut, teardown_env),
        cmocka_unit_test_teardown(test_refusals_dead_letter, teardown_env),
        cmocka_unit_test_teardown(test_refusals_retry, teardown_env),
        cmocka_unit_test_teardown(test_refused_topic_held, teardown_env),
        cmocka_unit_test_teardown(test_producer_state_expires, teardown_env),
        cmocka_unit_test_teardown(test_compression_gzip, teardown_env),
        cmocka_unit_test_teardown(test_compression_lz4, teardown_env),
        cmocka_unit_test_teardown(test_compression_zstd, teardown_env),
        cmocka_unit_test_teardown(test_recovery_position_deleted, teardown_env),
        cmocka_unit_test_teardown(test_txn_delivery, teardown_env),
        cmocka_unit_test_teardown(test_txn_crash_windows, teardown_env),
        cmocka_unit_test_teardown(test_txn_replication_window, teardown_env),
        cmocka_unit_test_teardown(test_txn_zombie, teardown_env),
        cmocka_unit_test_teardown(test_txn_coordinator_killed, teardown_env),
        cmocka_unit_test_teardown(test_txn_all_brokers_down, teardown_env),
        cmocka_unit_test_teardown(test_txn_refusals_retry, teardown_env),
        cmocka_unit_test_teardown(test_txn_kill_loop, teardown_env),
        cmocka_unit_test_teardown(test_txn_shards_zombie, teardown_env),
        cmocka_unit_test_teardown(test_txn_shards_change_zombie, teardown_env),
    };
    return H_RUN_SUITE(tests, argc, argv);
}
