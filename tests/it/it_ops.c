/*
 * Integration tests of running outboxd as a production sidecar: the HTTP
 * endpoints and metrics, retention, --check --live, TLS to Postgres.
 *
 *   it_ops [SCENARIO]   runs one scenario (ctest runs each on its own)
 */
#include "harness.h"
#include "scenario.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <setjmp.h>
#include <cmocka.h>

static struct h_env env;
static char body[1 << 20];

static int teardown_env(void **state)
{
    (void)state;
    h_env_stop(&env);
    return 0;
}

/* Polls GET path until it answers `status` with `needle` in the body. */
static void wait_http(const char *path, int status, const char *needle, int timeout_ms)
{
    h_wait_http(&env, path, status, needle, timeout_ms, body, sizeof(body));
}

static void wait_metric(const char *series, double value, int timeout_ms)
{
    h_wait_metric(&env, series, value, timeout_ms);
    assert_int_equal(h_http_get(&env, "/metrics", body, sizeof(body)), 200); /* for later checks */
}

/* Runs promtool's linter on an exposition; fails the test on a complaint. */
static void promtool_check(const char *exposition)
{
    char path[300], cmd[700];
    snprintf(path, sizeof(path), "%s/metrics.txt", env.dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(exposition, f);
    fclose(f);
    snprintf(cmd, sizeof(cmd), "promtool check metrics < %s > %s.lint 2>&1", path, path);
    int rc = system(cmd);
    if (rc != 0) {
        snprintf(cmd, sizeof(cmd), "cat %s.lint >&2", path);
        (void)system(cmd);
        fail_msg("promtool check metrics failed (%d); is the prometheus package installed?", rc);
    }
}

/* A connected socket that sends `head` (maybe nothing) and then idles. */
static int idle_client(const char *head)
{
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)env.http_port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(fd >= 0);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    struct timeval tv = {.tv_sec = 10}; /* longer than the server's deadline */
    assert_int_equal(setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)), 0);
    if (head)
        assert_int_equal(send(fd, head, strlen(head), MSG_NOSIGNAL), (ssize_t)strlen(head));
    return fd;
}

/* Runs docker-compose.yml's health check command of the outboxd service
 * (bash, /dev/tcp) against port `port`; returns its exit status. */
static int compose_healthcheck(int port)
{
    char yml[16384], cmd[1024], portstr[16];
    FILE *f = fopen(OBX_SOURCE_DIR "/docker-compose.yml", "r");
    assert_non_null(f);
    size_t n = fread(yml, 1, sizeof(yml) - 1, f);
    fclose(f);
    yml[n] = '\0';
    const char *probe = strstr(yml, "/dev/tcp/127.0.0.1/9187");
    assert_non_null(probe);
    const char *start = probe;
    while (start > yml && strncmp(start, "\"-c\", \"", 7) != 0)
        start--;
    assert_true(start > yml);
    start += 7;
    const char *end = strstr(start, "\"]");
    assert_non_null(end);
    /* YAML double quotes: \\ is one backslash. */
    size_t o = 0;
    for (const char *p = start; p < end && o + 8 < sizeof(cmd); p++) {
        if (p[0] == '\\' && p[1] == '\\')
            p++;
        if (strncmp(p, "9187", 4) == 0) {
            o += (size_t)snprintf(cmd + o, sizeof(cmd) - o, "%d", port);
            p += 3;
            continue;
        }
        cmd[o++] = *p;
    }
    cmd[o] = '\0';
    snprintf(portstr, sizeof(portstr), "%d", port);
    assert_non_null(strstr(cmd, portstr));
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        execlp("bash", "bash", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* /livez, /readyz and /metrics through a run with Kafka and Postgres
 * outages; promtool accepts the metrics; hostile clients do not stall the
 * relay. */
static void test_http(void **state)
{
    (void)state;
    h_env_start(&env, (const char *const[]){"it.a:2", "it.b:1", NULL});
    h_relay_start(&env, NULL, NULL);
    wait_http("/livez", 200, "ok", 10000);
    wait_http("/readyz", 200, "ready", 15000);
    assert_int_equal(compose_healthcheck(env.http_port), 0);

    PGconn *c = h_connect(&env);
    for (int i = 0; i < 30; i++)
        h_enqueue(c, i % 3 ? "it.a" : "it.b", "k", "v", 1, NULL);
    s_wait_drained(&env, 15000);
    wait_metric("outboxd_rows_marked_total", 30, 5000);
    assert_int_equal(h_http_get(&env, "/metrics", body, sizeof(body)), 200);
    assert_true(h_metric(body, "outboxd_records_published_total{topic=\"it.a\"}") == 20);
    assert_true(h_metric(body, "outboxd_records_published_total{topic=\"it.b\"}") == 10);
    assert_true(h_metric(body, "outboxd_commit_to_ack_seconds_count") == 30);
    assert_true(h_metric(body, "outboxd_fetch_batch_rows_count") >= 1);
    assert_true(h_metric(body, "outboxd_rows_in_flight") == 0);
    assert_true(h_metric(body, "outboxd_rows_in_flight_limit") == 10000);
    assert_true(h_metric(body, "outboxd_postgres_connected") == 1);
    assert_true(h_metric(body, "outboxd_kafka_connected") == 1);
    assert_true(h_metric(body, "outboxd_ready") == 1);
    assert_non_null(strstr(body, "outboxd_build_info{version=\"" OBX_VERSION "\""));
    promtool_check(body);

    /* Kafka down: not ready, rows wait, the backlog and lag show them. */
    assert_true(h_broker_cmd(&env, "down all"));
    wait_http("/readyz", 503, "Kafka unreachable", 15000);
    assert_int_not_equal(compose_healthcheck(env.http_port), 0);
    for (int i = 0; i < 5; i++)
        h_enqueue(c, "it.a", "k", "waiting", 7, NULL);
    wait_metric("outboxd_outbox_backlog_rows", 5, 15000);
    assert_true(h_metric(body, "outboxd_outbox_lag_seconds") > 0);
    assert_true(h_metric(body, "outboxd_kafka_connected") == 0);
    wait_http("/livez", 200, "ok", 1000); /* alive all the same */
    assert_true(h_broker_cmd(&env, "up all"));
    wait_http("/readyz", 200, "ready", 20000);
    s_wait_drained(&env, 30000);
    wait_metric("outboxd_outbox_backlog_rows", 0, 15000);

    /* Postgres down: not ready; the reconnect is counted. */
    PQfinish(c);
    h_pg_stop(&env);
    wait_http("/readyz", 503, "no Postgres connection", 10000);
    wait_metric("outboxd_postgres_connected", 0, 5000);
    h_pg_start(&env);
    wait_http("/readyz", 200, "ready", 20000);
    assert_int_equal(h_http_get(&env, "/metrics", body, sizeof(body)), 200);
    assert_true(h_metric(body, "outboxd_postgres_reconnects_total") >= 1);

    /* Bad requests get short answers. */
    static const char big_head[] = "GET /metrics HTTP/1.1\r\nX-Filler: ";
    char *huge = malloc(20000);
    assert_non_null(huge);
    memset(huge, 'a', 20000);
    memcpy(huge, big_head, sizeof(big_head) - 1);
    assert_int_equal(h_http_raw(env.http_port, huge, 20000, body, sizeof(body), 5000), 431);
    free(huge);
    static const char junk[] = "HELLO\r\n\r\n";
    assert_int_equal(h_http_raw(env.http_port, junk, sizeof(junk) - 1, body, sizeof(body), 5000),
                     400);
    static const char post[] = "POST /metrics HTTP/1.1\r\n\r\n";
    assert_int_equal(h_http_raw(env.http_port, post, sizeof(post) - 1, body, sizeof(body), 5000),
                     405);
    assert_int_equal(h_http_get(&env, "/nothing", body, sizeof(body)), 404);

    /* Forty idle clients (more than the connection limit) and one that
     * never finishes its head: rows still flow, and idle connections are
     * closed after the request deadline. */
    c = h_connect(&env);
    /* One row through first: the relay has just reconnected, and what the
     * siege does is what is tried below. */
    int64_t t0 = h_now_ms();
    h_enqueue(c, "it.a", "k2", "before-siege", 12, NULL);
    s_wait_drained(&env, 15000);
    print_message("1 row drained in %lld ms after the reconnect\n", (long long)(h_now_ms() - t0));
    int idle[40];
    for (int i = 0; i < 40; i++)
        idle[i] = idle_client(i == 0 ? "GET /metrics HTTP/1.1\r\n" : NULL);
    t0 = h_now_ms();
    for (int i = 0; i < 20; i++)
        h_enqueue(c, "it.a", "k2", "during-siege", 12, NULL);
    s_wait_drained(&env, 10000);
    print_message("20 rows drained in %lld ms with 40 idle HTTP clients\n",
                  (long long)(h_now_ms() - t0));
    /* Drained while the siege held: the server has closed none of them yet
     * (it would at its request deadline). */
    char one;
    for (int i = 0; i < 2; i++) {
        errno = 0;
        assert_int_equal(recv(idle[i], &one, 1, MSG_DONTWAIT), -1);
        assert_true(errno == EAGAIN || errno == EWOULDBLOCK);
    }
    assert_int_equal(recv(idle[0], &one, 1, 0), 0); /* closed by the server (deadline) */
    for (int i = 0; i < 40; i++)
        close(idle[i]);
    wait_http("/livez", 200, "ok", 10000); /* slots free again */

    /* Draining: not ready while in-flight rows wait for Kafka. */
    assert_true(h_broker_cmd(&env, "down all"));
    h_enqueue(c, "it.a", "k", "stuck", 5, NULL);
    h_sleep_ms(1000);
    kill(env.relay_pid, SIGTERM);
    wait_http("/readyz", 503, "draining", 5000);
    assert_true(h_broker_cmd(&env, "up all"));
    assert_int_equal(h_relay_wait(&env, 30000), 0);
    PQfinish(c);

    struct h_records recs = {0};
    h_kafka_read_all(&env, (const char *const[]){"it.a", "it.b", NULL}, &recs);
    assert_int_equal(h_check_db_matches_kafka(&env, &recs, false), 0);
    h_records_free(&recs);
}

/* Retention deletes sent rows older than retention.period in batches, and
 * never an unsent row, however old. */
static void test_retention(void **state)
{
    (void)state;
    h_env_start(&env, (const char *const[]){"it.a:1", NULL});
    PGconn *c = h_connect(&env);
    /* ids 1-1000 sent 2 days ago, 1001-1020 never sent (3 days old),
     * 1021-2500 sent 2 days ago, 2501-2600 sent an hour ago. */
    static const char insert[] =
        "INSERT INTO outbox.events (topic, key, payload, created_at, sent_at)"
        " SELECT 'it.a', 'k' || (g %% 7), 'p', now() - interval '3 days', %s"
        " FROM generate_series(1, %d) g";
    h_sql(c, insert, "now() - interval '2 days'", 1000);
    h_sql(c, insert, "NULL", 20);
    h_sql(c, insert, "now() - interval '2 days'", 1480);
    h_sql(c, "INSERT INTO outbox.events (topic, key, payload, created_at, sent_at)"
             " SELECT 'it.a', 'k', 'p', now() - interval '2 hours', now() - interval '1 hour'"
             " FROM generate_series(1, 100)");
    /* Kafka down: the 20 unsent rows stay unsent while retention runs. */
    assert_true(h_broker_cmd(&env, "down all"));
    h_relay_start(&env, NULL,
                  (const char *const[]){"relay.on_sent=mark", /* its row-by-row retention */
                                        "retention.period=1d", "retention.batch_size=100",
                                        "retention.interval=1s", NULL});
    h_wait_log(&env, "retention: deleted 2480 rows sent more than 86400s ago (26 batches)", 20000);
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM outbox.unpublished"), 20);
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM outbox.events"
                                  " WHERE id NOT IN (SELECT id FROM outbox.unpublished)"),
                     100);
    assert_int_equal(h_sql_int(c, "SELECT min(id) FROM outbox.events"), 1001);
    wait_metric("outboxd_rows_purged_total", 2480, 5000);

    /* Later rounds find nothing more to delete; once Kafka is back the
     * unsent rows go out as usual. */
    h_sleep_ms(2500);
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM outbox.events"), 120);
    assert_true(h_broker_cmd(&env, "up all"));
    s_wait_drained(&env, 30000);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    PQfinish(c);
}

/* Runs outboxd --check --live with -X settings; returns the exit status
 * and the output in `body`. */
static int check_live(const char *conninfo, const char *bootstrap)
{
    char cmd[2048];
    snprintf(cmd, sizeof(cmd),
             "'%s/outboxd' --check --live -X 'postgres.conninfo=%s' "
             "-X 'kafka.bootstrap.servers=%s' 2>&1",
             OBX_BINARY_DIR, conninfo, bootstrap);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t n = fread(body, 1, sizeof(body) - 1, p);
    body[n] = '\0';
    int status = pclose(p);
    print_message("%s", body);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static int count_lines(const char *text, const char *needle)
{
    int n = 0;
    for (const char *p = text; (p = strstr(p, needle)) != NULL; p++)
        n++;
    return n;
}

/* --check --live: one actionable line per problem, exit 1; 0 when all is
 * well. */
static void test_check_live(void **state)
{
    (void)state;
    char conninfo[700];
    h_env_start(&env, (const char *const[]){"it.a:1", NULL});
    PGconn *c = h_connect(&env);
    h_enqueue(c, "it.a", "k", "v", 1, NULL);

    assert_int_equal(check_live(env.conninfo, env.bootstrap), 0);
    assert_non_null(strstr(body, "schema version 16"));
    assert_non_null(strstr(body, "1 topics with unsent rows"));
    assert_non_null(strstr(body, "live check passed"));

    /* Rows for a topic the cluster does not have. */
    h_enqueue(c, "it.nowhere", "k", "v", 1, NULL);
    h_enqueue(c, "it.nowhere", "k", "v", 1, NULL);
    assert_int_equal(check_live(env.conninfo, env.bootstrap), 1);
    assert_non_null(strstr(body, "topic it.nowhere does not exist (2 unsent rows wait for it)"));
    assert_int_equal(count_lines(body, "problem:"), 1);
    h_sql(c, "DELETE FROM outbox.events WHERE topic = 'it.nowhere'");

    /* A role with less than outboxd_relay has. */
    h_sql(c, "CREATE ROLE weak LOGIN; GRANT USAGE ON SCHEMA outbox TO weak;"
             " GRANT SELECT ON outbox.events, outbox.schema_migrations TO weak");
    snprintf(conninfo, sizeof(conninfo), "%s user=weak", env.conninfo);
    assert_int_equal(check_live(conninfo, env.bootstrap), 1);
    assert_non_null(strstr(body, "role weak lacks UPDATE (sent_at) on outbox.events"));
    assert_non_null(strstr(body, "role weak lacks SELECT, INSERT, UPDATE on outbox.kafka_offsets"));
    assert_non_null(strstr(
        body, "role weak lacks EXECUTE on outbox.repair_writer_xids(integer, integer[], bigint)"));
    assert_non_null(
        strstr(body, "role weak lacks SELECT, INSERT, UPDATE, TRUNCATE on outbox.log_cursor"));
    assert_non_null(strstr(body, "role weak lacks EXECUTE on outbox.upkeep_partitions"));
    assert_non_null(
        strstr(body, "role weak lacks SELECT, INSERT, UPDATE on outbox.kafka_slot_offsets"));
    assert_non_null(strstr(body, "role weak lacks EXECUTE on outbox.claim_slots()"));
    assert_non_null(strstr(body, "GRANT outboxd_relay TO weak"));
    assert_non_null(strstr(body, "role weak lacks SELECT, INSERT, UPDATE on outbox.history"));
    assert_non_null(strstr(body, "role weak lacks EXECUTE on outbox.skip_ids_past(bigint)"));
    /* and the list of waiting rows it cannot read */
    assert_int_equal(count_lines(body, "problem:"), 15);
    /* Exactly the grants of sql/ are enough. */
    h_sql(c, "GRANT outboxd_relay TO weak");
    assert_int_equal(check_live(conninfo, env.bootstrap), 0);

    /* An outdated schema, then none at all. */
    h_sql(c, "DELETE FROM outbox.schema_migrations WHERE version >= 2");
    assert_int_equal(check_live(env.conninfo, env.bootstrap), 1);
    assert_non_null(strstr(body, "outbox schema is at version 1, this outboxd needs 16"));
    h_sql(c, "CREATE DATABASE bare");
    snprintf(conninfo, sizeof(conninfo), "%s dbname=bare", env.conninfo);
    assert_int_equal(check_live(conninfo, env.bootstrap), 1);
    assert_non_null(strstr(body, "outbox schema not found in database bare"));

    /* Nothing reachable; the password is not repeated. */
    assert_int_equal(
        check_live("host=127.0.0.1 port=1 user=x password=PgSecret-4711", "127.0.0.1:1"), 1);
    assert_non_null(strstr(body, "postgres: cannot connect"));
    assert_non_null(strstr(body, "kafka: no broker answered at 127.0.0.1:1"));
    assert_null(strstr(body, "PgSecret"));
    assert_int_equal(count_lines(body, "problem:"), 2);
    PQfinish(c);
}

/* TLS to Postgres with sslmode=verify-full against a throwaway CA: the
 * relay works over TLS only (the server refuses plain TCP), and refuses a
 * server whose certificate another CA signed or whose name differs. */
static void test_tls(void **state)
{
    (void)state;
    char cmd[2048], opt_cert[400], opt_key[400], conninfo[800], path[400];
    h_env_start(&env, (const char *const[]){"it.a:1", NULL});
    snprintf(cmd, sizeof(cmd),
             "cd '%s' && exec >tls.log 2>&1 && "
             "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt"
             " -subj /CN=outboxd-test-ca -days 2 &&"
             " openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr"
             " -subj /CN=localhost &&"
             " printf 'subjectAltName=DNS:localhost\\n' > san.ext &&"
             " openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial"
             " -out server.crt -days 2 -extfile san.ext &&"
             " openssl req -x509 -newkey rsa:2048 -nodes -keyout other.key -out other.crt"
             " -subj /CN=another-ca -days 2 &&"
             " chmod 600 server.key && chown postgres server.key server.crt",
             env.dir);
    if (system(cmd) != 0)
        fail_msg("making the test certificates failed; see %s/tls.log", env.dir);

    /* Only TLS over TCP; the harness keeps its Unix socket. */
    snprintf(path, sizeof(path), "%s/pgdata/pg_hba.conf", env.dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("local all all trust\n"
          "hostssl all all 127.0.0.1/32 trust\n"
          "hostssl all all ::1/128 trust\n",
          f);
    fclose(f);
    h_pg_stop(&env);
    snprintf(opt_cert, sizeof(opt_cert), "ssl_cert_file=%s/server.crt", env.dir);
    snprintf(opt_key, sizeof(opt_key), "ssl_key_file=%s/server.key", env.dir);
    env.pg_port = h_free_port();
    env.pg_opts[0] = "ssl=on";
    env.pg_opts[1] = opt_cert;
    env.pg_opts[2] = opt_key;
    env.pg_opts[3] = "listen_addresses=localhost";
    h_pg_start(&env);

    snprintf(conninfo, sizeof(conninfo),
             "postgres.conninfo=host=localhost port=%d user=postgres dbname=postgres "
             "sslmode=verify-full sslrootcert=%s/ca.crt",
             env.pg_port, env.dir);
    h_relay_start(&env, NULL, (const char *const[]){conninfo, NULL});
    PGconn *c = h_connect(&env);
    for (int i = 0; i < 10; i++)
        h_enqueue(c, "it.a", "k", "over-tls", 8, NULL);
    s_wait_drained(&env, 20000);
    /* Both of the relay's connections (relay, maintenance) use TLS; the
     * maintenance one opens at the first housekeeping tick. */
    int64_t deadline = h_now_ms() + 5000;
    while (h_sql_int(c, "SELECT count(*) FROM pg_stat_activity"
                        " WHERE application_name LIKE 'outboxd%%'") < 2 &&
           h_now_ms() < deadline)
        h_sleep_ms(50);
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM pg_stat_ssl s"
                                  " JOIN pg_stat_activity a USING (pid)"
                                  " WHERE a.application_name LIKE 'outboxd%%' AND s.ssl"),
                     2);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);

    /* A certificate from another CA, then a name the certificate does not
     * carry: no connection, and the log says why. */
    snprintf(conninfo, sizeof(conninfo),
             "postgres.conninfo=host=localhost port=%d user=postgres dbname=postgres "
             "sslmode=verify-full sslrootcert=%s/other.crt",
             env.pg_port, env.dir);
    h_relay_start(&env, NULL, (const char *const[]){conninfo, NULL});
    h_enqueue(c, "it.a", "k", "must-wait", 9, NULL);
    h_wait_log(&env, "certificate verify failed", 10000);
    wait_http("/readyz", 503, "no Postgres connection", 5000);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    snprintf(conninfo, sizeof(conninfo),
             "postgres.conninfo=host=127.0.0.1 port=%d user=postgres dbname=postgres "
             "sslmode=verify-full sslrootcert=%s/ca.crt",
             env.pg_port, env.dir);
    h_relay_start(&env, NULL, (const char *const[]){conninfo, NULL});
    h_wait_log(&env, "does not match host name", 10000);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM outbox.unpublished"), 1);
    PQfinish(c);
}

/* GET path from relay `e` (which may be a copy of env for a second relay). */
static int get_from(struct h_env *e, const char *path)
{
    return h_http_get(e, path, body, sizeof(body));
}

static void wait_drained_exactly_once(void)
{
    s_wait_drained(&env, 30000);
    struct h_records recs = {0};
    h_kafka_read_all(&env, (const char *const[]){"it.a", "it.b", "it.c", NULL}, &recs);
    assert_int_equal(h_check_db_matches_kafka(&env, &recs, false), 0);
    h_records_free(&recs);
}

/* Two relays on one outbox (a rolling update): the second stands by on the
 * relay lock, ready but publishing nothing, and takes over when the first
 * drains away or is killed; rows go out exactly once throughout. */
static void test_standby(void **state)
{
    (void)state;
    h_env_start(&env, (const char *const[]){"it.a:3", "it.b:3", "it.c:3", NULL});
    h_relay_start(&env, NULL, NULL);
    wait_http("/readyz", 200, "ready", 15000);
    struct h_env second = env;
    second.http_port = h_free_port();
    snprintf(second.relay_name, sizeof(second.relay_name), "second"); /* its own log */
    char var[160], msg[64];
    int notify_fd = h_notify_socket(&env, "standby.sock", var, sizeof(var));
    second.relay_env[0] = var;
    h_relay_start(&second, NULL, NULL);
    h_wait_metric(&second, "outboxd_standby", 1, 10000);
    /* A standby tells systemd it started (or the start timeout kills it). */
    assert_true(h_recv_notify(notify_fd, msg, sizeof(msg), 5000));
    assert_string_equal(msg, "READY=1");
    close(notify_fd);

    atomic_int stop = 0;
    struct s_writer w = {.env = &env, .w = 0, .rows_per_tx = 2, .pace_ms = 5, .stop = &stop};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, s_writer_main, &w), 0);
    h_sleep_ms(1500);
    /* The standby is ready (a failing probe would stall a rolling update)
     * and has published nothing. */
    assert_int_equal(get_from(&second, "/readyz"), 200);
    assert_non_null(strstr(body, "standby"));
    assert_int_equal(get_from(&second, "/metrics"), 200);
    assert_true(h_metric(body, "outboxd_standby") == 1);
    assert_true(h_metric(body, "outboxd_rows_marked_total") == 0);
    assert_int_equal(get_from(&env, "/metrics"), 200);
    assert_true(h_metric(body, "outboxd_standby") == 0);

    /* The active one drains away (SIGTERM): the standby takes over. */
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    h_wait_metric(&second, "outboxd_standby", 0, 10000); /* the lock acquired */
    h_sleep_ms(1500);
    assert_int_equal(get_from(&second, "/metrics"), 200);
    assert_true(h_metric(body, "outboxd_standby") == 0);
    assert_true(h_metric(body, "outboxd_rows_marked_total") > 0);

    /* A new relay stands by behind it; kill -9 the active one. */
    h_relay_start(&env, NULL, NULL);
    wait_http("/readyz", 200, "standby", 15000);
    h_sleep_ms(1000);
    kill(second.relay_pid, SIGKILL);
    assert_int_equal(h_relay_wait(&second, 10000), 128 + SIGKILL);
    wait_http("/readyz", 200, "ready\n", 15000);
    h_sleep_ms(1000);
    atomic_store(&stop, 1);
    pthread_join(t, NULL);
    assert_true(w.written > 100);
    wait_drained_exactly_once();
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
}

/* A relay of env under `name`, on its own HTTP port, through `conninfo`. */
static void start_relay_through(struct h_env *r, const char *name, const char *conninfo)
{
    *r = env;
    r->http_port = h_free_port();
    snprintf(r->relay_name, sizeof(r->relay_name), "%s", name);
    snprintf(r->conninfo, sizeof(r->conninfo), "%s", conninfo);
    h_relay_start(r, NULL, NULL);
}

/* Transaction pooling that the probe at set-up takes for session pooling:
 * PgBouncer hands out its idle server sessions in turn
 * (server_round_robin), and with two of them the probe's connection gets
 * the one the relay's set-up did not use. The relay must still refuse, and
 * must not leave the relay lock behind in a session the pool keeps (other
 * relays, direct or through a session pool, would stand by behind it until
 * the pooler closed that session): it takes the lock only in the session
 * its set-up ran in, which its setting outboxd.session names. */
static void test_pooler_probe_misled(void **state)
{
    (void)state;
    char pooled[300];
    struct h_env a;
    h_env_start(&env, (const char *const[]){"it.a:3", NULL});
    /* The pool_mode line takes one more setting along. */
    h_pooler_start(&env, "transaction\nserver_round_robin = 1", pooled, sizeof(pooled));
    PGconn *w[2];
    for (int i = 0; i < 2; i++) { /* two server sessions, both idle after */
        w[i] = PQconnectdb(pooled);
        assert_int_equal(PQstatus(w[i]), CONNECTION_OK);
        h_sql(w[i], "BEGIN");
        h_sql(w[i], "SELECT 1");
    }
    for (int i = 0; i < 2; i++) {
        h_sql(w[i], "COMMIT");
        PQfinish(w[i]);
    }
    struct s_writer ws = {.env = &env, .w = 0, .count = 200, .rows_per_tx = 2};
    s_run_writers(&ws, 1);
    start_relay_through(&a, "rr", pooled);
    h_wait_log(&a, "transaction (or statement) pooling", 15000);
    h_sleep_ms(2000); /* several attempts */
    assert_int_equal(h_relay_stop(&a, SIGTERM, 20000), 0);
    bool misled = h_relay_log_contains(&a, "gave a second connection another server session");
    PGconn *c = h_connect(&env); /* Postgres itself */
    long locks = h_sql_int(c, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                              " AND classid = 1868724338 AND objid = 0 AND objsubid = 2");
    PQfinish(c);
    print_message("probe misled: %s; relay locks left in the pool's sessions: %ld\n",
                  misled ? "yes" : "no", locks);
    assert_true(misled); /* otherwise this test showed nothing */
    assert_int_equal(locks, 0);
    h_pooler_stop(&env, 0);
}

/* Through a real PgBouncer (issue 37). In transaction pooling a server
 * session goes back to the pool after each transaction, and with it the
 * relay lock, the prepared statements and log mode's snapshots: --check
 * and the relays refuse it, naming it, and publish nothing (before, two
 * relays published up to 2,151 of 4,000 rows twice). In session pooling
 * two relays exclude each other on the lock and every row goes out once. */
static void test_pooler(void **state)
{
    (void)state;
    char pooled[300];
    struct h_env a, b;
    h_env_start(&env, (const char *const[]){"it.a:3", "it.b:3", "it.c:3", NULL});

    h_pooler_start(&env, "transaction", pooled, sizeof(pooled));
    assert_int_equal(check_live(pooled, env.bootstrap), 1);
    assert_non_null(strstr(body, "goes through a connection pooler in transaction (or "
                                 "statement) pooling"));
    assert_int_equal(count_lines(body, "problem:"), 1);
    struct s_writer ws[3];
    for (int i = 0; i < 3; i++)
        ws[i] = (struct s_writer){.env = &env, .w = i, .count = 300, .rows_per_tx = 3};
    s_run_writers(ws, 3);
    start_relay_through(&a, "tx-a", pooled);
    h_wait_log(&a, "transaction (or statement) pooling", 15000);
    start_relay_through(&b, "tx-b", pooled);
    h_wait_log(&b, "transaction (or statement) pooling", 15000);
    h_sleep_ms(2000); /* several attempts each */
    assert_true(h_relay_log_count(&a, "transaction (or statement) pooling") >= 2);
    assert_int_equal(h_relay_stop(&a, SIGTERM, 20000), 0);
    assert_int_equal(h_relay_stop(&b, SIGTERM, 20000), 0);
    /* The probe is best-effort (a pool can hand the session on before it
     * asks; seen once in CI): a relay it missed ran until its session
     * changed. Whatever went out, went out once. */
    struct h_records recs = {0};
    h_kafka_read_all(&env, (const char *const[]){"it.a", "it.b", "it.c", NULL}, &recs);
    for (size_t i = 0; i < recs.n; i++)
        for (size_t j = i + 1; j < recs.n; j++)
            if (recs.v[i].outbox_id == recs.v[j].outbox_id)
                fail_msg("row %lld published twice through transaction pooling",
                         (long long)recs.v[i].outbox_id);
    print_message("through transaction pooling: %zu of 900 rows published before the refusal\n",
                  recs.n);
    h_records_free(&recs);
    /* A relay the probe missed took the relay lock in a server session the
     * pool keeps after the relay left: it stays held until the pooler
     * closes that session (seen in CI: the session-pooling relays below
     * stood by behind it). The operator's fix is ours: stop that pool. */
    h_pooler_stop(&env, 0);

    h_pooler_start(&env, "session", pooled, sizeof(pooled));
    assert_int_equal(check_live(pooled, env.bootstrap), 0);
    assert_non_null(strstr(body, "reached through a connection pooler in session pooling"));
    start_relay_through(&a, "session-a", pooled);
    h_wait_metric(&a, "outboxd_standby", 0, 15000);
    start_relay_through(&b, "session-b", pooled);
    h_wait_metric(&b, "outboxd_standby", 1, 15000);
    assert_true(h_relay_log_contains(&a, "connection pooler that gave a second connection "
                                         "another server session"));
    for (int i = 0; i < 3; i++)
        ws[i] = (struct s_writer){.env = &env, .w = i, .count = 1000, .rows_per_tx = 2};
    s_run_writers(ws, 3);
    /* The active one is killed mid-stream: the other takes over. */
    kill(a.relay_pid, SIGKILL);
    assert_int_equal(h_relay_wait(&a, 10000), 128 + SIGKILL);
    h_wait_metric(&b, "outboxd_standby", 0, 15000);
    for (int i = 0; i < 3; i++)
        ws[i] = (struct s_writer){.env = &env, .w = i, .count = 100, .rows_per_tx = 2};
    s_run_writers(ws, 3);
    wait_drained_exactly_once();
    assert_int_equal(h_relay_stop(&b, SIGTERM, 20000), 0);
}

/* Runs `outboxd TOOL ARGS...` against env (its Postgres, broker and the
 * relay's http.listen); stdout and stderr into out. Returns the exit code. */
static int tool(char *out, size_t outlen, const char *const *args)
{
    char ci[700], bs[600], http[64];
    snprintf(ci, sizeof(ci), "postgres.conninfo=%s", env.conninfo);
    snprintf(bs, sizeof(bs), "kafka.bootstrap.servers=%s", env.bootstrap);
    snprintf(http, sizeof(http), "http.listen=127.0.0.1:%d", env.http_port);
    char *argv[32];
    int n = 0;
    argv[n++] = "outboxd";
    for (; *args && n < 24; args++)
        argv[n++] = (char *)*args;
    argv[n++] = "-X";
    argv[n++] = ci;
    argv[n++] = "-X";
    argv[n++] = bs;
    argv[n++] = "-X";
    argv[n++] = http;
    argv[n] = NULL;
    char *const envp[] = {"PATH=/usr/bin:/bin", NULL};
    int rc = h_run_outboxd(argv, envp, out, outlen);
    print_message("%s", out);
    return rc;
}

static void expect_in(const char *out, const char *needle)
{
    if (!strstr(out, needle))
        fail_msg("expected \"%s\" in:\n%s", needle, out);
}

/* outboxd status: healthy when caught up; with a backlog the relay cannot
 * send (brokers down) and a transaction holding a snapshot, it names the
 * backlog, the holder of the xmin horizon and exits 1; --json for scripts. */
static void test_status(void **state)
{
    (void)state;
    static char out[1 << 16];
    h_env_start(&env, (const char *const[]){"it.a:2", "it.b:1", NULL});
    h_relay_start(&env, NULL, NULL);
    wait_http("/readyz", 200, "ready", 15000);
    struct h_env second = env; /* a standby, named in its conninfo */
    second.http_port = h_free_port();
    snprintf(second.relay_name, sizeof(second.relay_name), "second");
    char ci[700];
    snprintf(ci, sizeof(ci), "postgres.conninfo=%s application_name=relay-b", env.conninfo);
    h_relay_start(&second, NULL, (const char *const[]){ci, NULL});
    h_wait_metric(&second, "outboxd_standby", 1, 10000);
    h_sleep_ms(300); /* its last statement is a try of the lock */
    assert_int_equal(tool(out, sizeof(out), (const char *const[]){"status", NULL}), 0);
    expect_in(out, "outboxd status: healthy");
    expect_in(out, "active  outboxd");
    expect_in(out, "standby relay-b");
    expect_in(out, "unsent:   0 rows");
    expect_in(out, "ready, 0 rows in flight");
    assert_int_equal(h_relay_stop(&second, SIGTERM, 30000), 0);

    /* A backlog, and a stuck transaction. */
    assert_true(h_broker_cmd(&env, "down all"));
    PGconn *c = h_connect(&env);
    for (int i = 0; i < 40; i++)
        h_enqueue(c, i % 4 ? "it.a" : "it.b", "k", "v", 1, NULL);
    PGconn *stuck = h_connect(&env);
    h_sql(stuck, "SET application_name = 'billing-report'");
    h_sql(stuck, "BEGIN ISOLATION LEVEL REPEATABLE READ");
    h_sql(stuck, "SELECT count(*) FROM outbox.events");
    wait_http("/readyz", 503, "not ready", 30000);
    assert_int_equal(tool(out, sizeof(out), (const char *const[]){"status", NULL}), 1);
    expect_in(out, "outboxd status: NOT HEALTHY");
    expect_in(out, "problem: the relay is not ready");
    expect_in(out, "unsent:   40 rows, oldest waiting");
    expect_in(out, "it.a                           30");
    expect_in(out, "xmin horizon: held by pid");
    expect_in(out, "billing-report, idle in transaction");
    expect_in(out, "SELECT count(*) FROM outbox.events");
    expect_in(out, "outbox.events:");
    assert_int_equal(tool(out, sizeof(out), (const char *const[]){"status", "--json", NULL}), 1);
    expect_in(out, "{\"healthy\":false,");
    expect_in(out, "\"unsent_rows\":40,");
    expect_in(out, "\"application_name\":\"billing-report\"");
    assert_int_equal(tool(out, sizeof(out), (const char *const[]){"status", "extra", NULL}), 2);
    expect_in(out, "outboxd status: takes no arguments");

    PQfinish(stuck);
    assert_true(h_broker_cmd(&env, "up all"));
    s_wait_drained(&env, 30000);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    /* No relay: not healthy, and it says why. */
    assert_int_equal(tool(out, sizeof(out), (const char *const[]){"status", NULL}), 1);
    expect_in(out, "problem: no outboxd holds the relay lock");
    /* Its own statement names the lock too: it does not list itself. */
    expect_in(out, "none connected");
    PQfinish(c);
}

/* outboxd dead list / retry / drop, and outboxd replay, in `mode`. */
static void dead_and_replay(const char *mode)
{
    static char out[1 << 16];
    h_env_start(&env, (const char *const[]){"it.a:2", "it.missing:1", NULL});
    assert_true(h_broker_cmd(&env, "topic-error it.missing UNKNOWN_TOPIC_OR_PART"));
    h_relay_start(&env, NULL,
                  (const char *const[]){"relay.on_reject=dead_letter",
                                        "kafka.topic.metadata.propagation.max.ms=1000", mode,
                                        NULL});
    PGconn *c = h_connect(&env);
    int64_t d1 = h_enqueue(c, "it.missing", "m", "one", 3, NULL);
    int64_t d2 = h_enqueue(c, "it.missing", NULL, "two", 3, NULL);
    for (int i = 0; i < 20; i++)
        h_enqueue(c, "it.a", "k", "v", 1, NULL);
    s_wait_drained(&env, 60000);
    int64_t deadline = h_now_ms() + 20000;
    while (h_sql_int(c, "SELECT count(*) FROM outbox.dead_letters") < 2 && h_now_ms() < deadline)
        h_sleep_ms(100);

    assert_int_equal(tool(out, sizeof(out), (const char *const[]){"dead", "list", NULL}), 0);
    expect_in(out, "reason");
    expect_in(out, "it.missing");
    expect_in(out, "(none)"); /* d2 has no key */
    char id1[24], id2[24];
    snprintf(id1, sizeof(id1), "%lld", (long long)d1);
    snprintf(id2, sizeof(id2), "%lld", (long long)d2);
    /* Unknown ids are refused, and nothing changes. */
    assert_int_equal(
        tool(out, sizeof(out), (const char *const[]){"dead", "retry", id1, "999999", NULL}), 1);
    expect_in(out, "no dead letter has id 999999; nothing changed");
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM outbox.dead_letters"), 2);
    assert_int_equal(tool(out, sizeof(out), (const char *const[]){"dead", "retry", "x1", NULL}), 2);
    assert_int_equal(tool(out, sizeof(out), (const char *const[]){"dead", "bury", NULL}), 2);

    /* The topic exists now: d1 goes back in line with its id and out.
     * librdkafka may still hold "unknown topic" from its last metadata for
     * a moment: then d1 is dead-lettered again and retried again, as an
     * operator would. */
    assert_true(h_broker_cmd(&env, "topic-error it.missing 0"));
    assert_int_equal(tool(out, sizeof(out), (const char *const[]){"dead", "drop", id2, NULL}), 0);
    expect_in(out, "dropped 1 dead letter");
    bool sent = false;
    for (int attempt = 0; attempt < 10 && !sent; attempt++) {
        assert_int_equal(tool(out, sizeof(out), (const char *const[]){"dead", "retry", id1, NULL}),
                         0);
        expect_in(out, "retried 1 dead letter");
        deadline = h_now_ms() + 10000;
        while (!sent && h_now_ms() < deadline &&
               h_sql_int(c, "SELECT count(*) FROM outbox.dead_letters") == 0) {
            sent = h_sql_int(c,
                             "SELECT count(*) FROM outbox.events WHERE id = %lld"
                             " AND id NOT IN (SELECT id FROM outbox.unpublished)"
                             " AND id NOT IN (SELECT id FROM outbox.dead_letters)",
                             (long long)d1) == 1;
            h_sleep_ms(100);
        }
        if (!sent)
            h_sleep_ms(1000);
    }
    assert_true(sent);
    assert_int_equal(h_sql_int(c, "SELECT count(*) FROM outbox.dead_letters"), 0);

    /* Replay: confirmation needed without a terminal; then 10 rows again. */
    int64_t first = h_sql_int(c, "SELECT min(id) FROM outbox.events WHERE topic = 'it.a'");
    char from[24], to[24];
    snprintf(from, sizeof(from), "%lld", (long long)first);
    snprintf(to, sizeof(to), "%lld", (long long)first + 9);
    assert_int_equal(tool(out, sizeof(out),
                          (const char *const[]){"replay", "--topic", "it.a", "--from-id", from,
                                                "--to-id", to, NULL}),
                     2);
    expect_in(out, "replay: 10 sent rows of topic it.a");
    expect_in(out, "not confirmed: add --yes");
    assert_int_equal(tool(out, sizeof(out),
                          (const char *const[]){"replay", "--topic", "it.a", "--from-id", from,
                                                "--to-id", to, "--yes", NULL}),
                     0);
    expect_in(out, "replay: 10 rows queued again");
    assert_int_equal(
        tool(out, sizeof(out), (const char *const[]){"replay", "--topic", "it.a", NULL}), 2);
    expect_in(out, "give --from-id N [--to-id M] or --since TIME");
    assert_int_equal(
        tool(out, sizeof(out),
             (const char *const[]){"replay", "--topic", "it.a", "--since", "yesterday", NULL}),
        2);
    s_wait_drained(&env, 30000);
    struct h_records recs = {0};
    h_kafka_read_all(&env, (const char *const[]){"it.a", "it.missing", NULL}, &recs);
    size_t replayed = 0, retried = 0;
    for (size_t i = 0; i < recs.n; i++) {
        replayed += recs.v[i].outbox_id >= first && recs.v[i].outbox_id <= first + 9;
        retried += recs.v[i].outbox_id == d1;
    }
    assert_int_equal(recs.n, 20 + 10 + 1);
    assert_int_equal(replayed, 20); /* each of the 10 twice, ids kept */
    assert_int_equal(retried, 1);
    h_records_free(&recs);
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
    PQfinish(c);
}

static void test_dead_and_replay(void **state)
{
    (void)state;
    dead_and_replay("relay.on_sent=mark");
}

/* Log mode: the dead letter is a copy (the row stays in the log), and a
 * retried one or a replayed row is written again, which the cursor does
 * not cover. */
static void test_dead_and_replay_log(void **state)
{
    (void)state;
    dead_and_replay("relay.on_sent=log");
}

/* Whether `name` is a metric of the exposition: a "# TYPE" name, or a
 * histogram's _bucket, _sum or _count series. */
static bool exported(const char *exposition, const char *name)
{
    char want[160];
    static const char *const suffixes[] = {"_bucket", "_sum", "_count"};
    snprintf(want, sizeof(want), "# TYPE %s ", name);
    if (strstr(exposition, want))
        return true;
    for (size_t i = 0; i < 3; i++) {
        size_t n = strlen(name), sl = strlen(suffixes[i]);
        if (n > sl && strcmp(name + n - sl, suffixes[i]) == 0) {
            snprintf(want, sizeof(want), "# TYPE %.*s histogram", (int)(n - sl), name);
            if (strstr(exposition, want))
                return true;
        }
    }
    return false;
}

static bool name_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

/* Every metric name a file under config/ uses (outboxd_*, process_*) is one
 * the relay exports. Returns how many names were checked. */
static int check_names_in(const char *path, const char *exposition)
{
    static char text[1 << 17];
    FILE *f = fopen(path, "r");
    if (!f)
        fail_msg("cannot read %s", path);
    size_t len = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    text[len] = '\0';
    int checked = 0;
    for (const char *p = text; *p; p++) {
        bool start = (p == text || !name_char(p[-1])) &&
                     (strncmp(p, "outboxd_", 8) == 0 || strncmp(p, "process_", 8) == 0);
        if (!start)
            continue;
        char name[128];
        size_t n = 0;
        while (name_char(p[n]) && n < sizeof(name) - 1) {
            name[n] = p[n];
            n++;
        }
        name[n] = '\0';
        if (!exported(exposition, name))
            fail_msg("%s uses %s, which /metrics does not export", path, name);
        checked++;
        p += n - 1;
    }
    return checked;
}

/* The Grafana dashboard and the alert rules under config/ query only
 * metrics a live relay exports. */
static void test_dashboard(void **state)
{
    (void)state;
    h_env_start(&env, (const char *const[]){"it.a:2", NULL});
    /* With relay.shards (in mark mode, as the sidecar runs by default), which exports
     * every metric a relay alone does and the slots' too. */
    h_relay_start(&env, NULL, (const char *const[]){"relay.shards=2", "relay.on_sent=mark", NULL});
    wait_http("/readyz", 200, "ready", 15000);
    /* The backlog gauges appear once the maintenance connection measured. */
    wait_http("/metrics", 200, "# TYPE outboxd_outbox_lag_seconds", 15000);
    wait_http("/metrics", 200, "# TYPE outboxd_slot_lag_seconds", 15000);
    int dashboard = check_names_in(OBX_SOURCE_DIR "/config/grafana/outboxd-dashboard.json", body);
    int rules = check_names_in(OBX_SOURCE_DIR "/config/prometheus/outboxd-alerts.yml", body);
    print_message("dashboard: %d metric references, alert rules: %d, all exported\n", dashboard,
                  rules);
    assert_true(dashboard >= 20);
    assert_true(rules >= 6);
    /* The check itself: a name the relay does not export is caught. */
    assert_false(exported(body, "outboxd_no_such_metric"));
    assert_true(exported(body, "outboxd_commit_to_ack_seconds_bucket"));
    assert_int_equal(h_relay_stop(&env, SIGTERM, 30000), 0);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_http, teardown_env),
        cmocka_unit_test_teardown(test_retention, teardown_env),
        cmocka_unit_test_teardown(test_check_live, teardown_env),
        cmocka_unit_test_teardown(test_tls, teardown_env),
        cmocka_unit_test_teardown(test_standby, teardown_env),
        cmocka_unit_test_teardown(test_pooler, teardown_env),
        cmocka_unit_test_teardown(test_pooler_probe_misled, teardown_env),
        cmocka_unit_test_teardown(test_dashboard, teardown_env),
        cmocka_unit_test_teardown(test_status, teardown_env),
        cmocka_unit_test_teardown(test_dead_and_replay, teardown_env),
        cmocka_unit_test_teardown(test_dead_and_replay_log, teardown_env),
    };
    return H_RUN_SUITE(tests, argc, argv);
}
