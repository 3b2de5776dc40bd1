/*
 * check: see include/outboxd/check.h.
 */
#include "outboxd/check.h"
#include "outboxd/pgconn.h"
#include "outboxd/alloc.h"
#include "outboxd/kafka.h"
#include "outboxd/pg.h"
#include "outboxd/store.h"

#include <libpq-fe.h>
#include <stdarg.h>
#include <librdkafka/rdkafka.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#define MAX_TOPICS 256

/* Topics that unsent rows wait for, with their row counts. */
struct waiting {
    bool known; /* Postgres answered: topic and n are meaningful */
    char *topic[MAX_TOPICS];
    long long rows[MAX_TOPICS];
    int n;
};

static void problem(FILE *out, int *problems, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void problem(FILE *out, int *problems, const char *fmt, ...)
{
    va_list ap;
    fputs("outboxd: problem: ", out);
    va_start(ap, fmt);
    vfprintf(out, fmt, ap);
    va_end(ap);
    fputc('\n', out);
    (*problems)++;
}

/* The first line of a libpq error (host names, never the password). */
static const char *first_line(const char *msg, char *buf, size_t len)
{
    size_t n = strcspn(msg, "\n");
    snprintf(buf, len, "%.*s", (int)(n < len ? n : len - 1), msg);
    return buf;
}

/* Each privilege the relay uses, and what it is for. */
static const struct {
    const char *sql; /* a boolean expression on current_user */
    const char *what;
    const char *why;
} privileges[] = {
    {"has_schema_privilege('outbox', 'USAGE')", "USAGE on schema outbox", "to reach the tables"},
    {"has_table_privilege('outbox.schema_migrations', 'SELECT')",
     "SELECT on outbox.schema_migrations", "to check the schema version"},
    {"has_table_privilege('outbox.events', 'SELECT')", "SELECT on outbox.events",
     "to read unsent rows"},
    {"has_column_privilege('outbox.events', 'sent_at', 'UPDATE')",
     "UPDATE (sent_at) on outbox.events", "to mark rows sent"},
    {"has_table_privilege('outbox.events', 'DELETE')", "DELETE on outbox.events",
     "for delete mode, dead letters and retention"},
    {"has_table_privilege('outbox.kafka_offsets', 'SELECT, INSERT, UPDATE')",
     "SELECT, INSERT, UPDATE on outbox.kafka_offsets", "to record offsets for crash recovery"},
    {"has_table_privilege('outbox.dead_letters', 'SELECT, INSERT')",
     "SELECT, INSERT on outbox.dead_letters", "to move refused rows aside"},
    {"coalesce(has_function_privilege("
     "to_regprocedure('outbox.repair_writer_xids(integer, integer[], bigint)'), 'EXECUTE'), false)",
     "EXECUTE on outbox.repair_writer_xids(integer, integer[], bigint)",
     "to repair rows restored with another cluster's xid"},
    {"coalesce(has_table_privilege(to_regclass('outbox.log_cursor'), "
     "'SELECT, INSERT, UPDATE, TRUNCATE'), false)",
     "SELECT, INSERT, UPDATE, TRUNCATE on outbox.log_cursor", "for log mode's cursor"},
    {"coalesce(has_table_privilege(to_regclass('outbox.kafka_slot_offsets'), "
     "'SELECT, INSERT, UPDATE'), false)",
     "SELECT, INSERT, UPDATE on outbox.kafka_slot_offsets",
     "to record offsets per slot (relay.shards above 1)"},
    {"coalesce(has_function_privilege(to_regprocedure('outbox.claim_slots(integer, integer[], "
     "boolean)'), 'EXECUTE'), false)",
     "EXECUTE on outbox.claim_slots()", "to own slots (relay.shards above 1)"},
    {"coalesce(has_table_privilege(to_regclass('outbox.unpublished'), 'SELECT'), false)",
     "SELECT on outbox.unpublished", "to count the rows waiting"},
    {"coalesce(has_function_privilege(to_regprocedure('outbox.advance_cursor(bigint, bigint, "
     "pg_snapshot, text[], text[], bigint[], bigint[], text[], integer[], bigint[], boolean)'), "
     "'EXECUTE'), false)",
     "EXECUTE on outbox.advance_cursor(...)", "to store log mode's cursor"},
    {"coalesce(has_function_privilege(to_regprocedure('outbox.upkeep_partitions(bigint, "
     "integer)'), 'EXECUTE'), false)",
     "EXECUTE on outbox.upkeep_partitions(bigint, integer)",
     "to create the partitions of outbox.events ahead of its ids"},
    {"coalesce(has_function_privilege(to_regprocedure('outbox.reclaim_partitions(interval)'), "
     "'EXECUTE'), false)",
     "EXECUTE on outbox.reclaim_partitions(interval)", "to drop published partitions in log mode"},
    {"coalesce(has_table_privilege(to_regclass('outbox.history'), 'SELECT, INSERT, UPDATE'), "
     "false)",
     "SELECT, INSERT, UPDATE on outbox.history", "to notice a change of history (a failover)"},
    {"coalesce(has_function_privilege(to_regprocedure('outbox.skip_ids_past(bigint)'), "
     "'EXECUTE'), false)",
     "EXECUTE on outbox.skip_ids_past(bigint)",
     "to stop reissuing ids already in Kafka after a failover or a restore"},
    {"coalesce(has_function_privilege(to_regprocedure('outbox.row_bytes(text, bytea, jsonb)'), "
     "'EXECUTE'), false)",
     "EXECUTE on outbox.row_bytes(text, bytea, jsonb)",
     "to bound a fetch's memory by its rows' sizes"},
};
#define N_PRIVILEGES (sizeof(privileges) / sizeof(privileges[0]))

static void check_privileges(PGconn *conn, FILE *out, int *problems)
{
    char sql[4096]; /* the expressions below take 1.7 kB */
    size_t used = (size_t)snprintf(sql, sizeof(sql), "SELECT current_user");
    for (size_t i = 0; i < N_PRIVILEGES; i++)
        used += (size_t)snprintf(sql + used, sizeof(sql) - used, ", %s", privileges[i].sql);
    PGresult *res = PQexec(conn, sql);
    if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1) {
        char line[300];
        problem(out, problems, "postgres: cannot read the role's privileges: %s",
                first_line(PQresultErrorMessage(res), line, sizeof(line)));
        PQclear(res);
        return;
    }
    const char *role = PQgetvalue(res, 0, 0);
    for (size_t i = 0; i < N_PRIVILEGES; i++) {
        if (strcmp(PQgetvalue(res, 0, (int)i + 1), "t") == 0)
            continue;
        problem(out, problems,
                "postgres: role %s lacks %s (%s); the minimum is in sql/: GRANT outboxd_relay "
                "TO %s",
                role, privileges[i].what, privileges[i].why, role);
    }
    PQclear(res);
}

/* Returns the schema version, or -1 after reporting why there is none. */
static long check_schema(PGconn *conn, FILE *out, int *problems)
{
    char line[300];
    PGresult *res = PQexec(conn, OBX_STORE_SQL_HAS_SCHEMA);
    bool present = PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1 &&
                   strcmp(PQgetvalue(res, 0, 0), "t") == 0;
    PQclear(res);
    if (!present) {
        obx_store_schema_problem(-1, PQdb(conn), line, sizeof(line));
        problem(out, problems, "postgres: %s", line);
        return -1;
    }
    res = PQexec(conn, OBX_STORE_SQL_SCHEMA_VERSION);
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        problem(out, problems, "postgres: cannot read outbox.schema_migrations: %s",
                first_line(PQresultErrorMessage(res), line, sizeof(line)));
        PQclear(res);
        return -1;
    }
    long version = strtol(PQgetvalue(res, 0, 0), NULL, 10);
    PQclear(res);
    if (obx_store_schema_problem(version, PQdb(conn), line, sizeof(line)) != 0)
        problem(out, problems, "postgres: %s", line);
    res = PQexec(conn, "SELECT " OBX_STORE_SQL_ID_CACHE);
    if (PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1 &&
        obx_store_id_cache_problem(strtol(PQgetvalue(res, 0, 0), NULL, 10), line, sizeof(line)) !=
            0)
        problem(out, problems, "postgres: %s", line);
    PQclear(res);
    return version;
}

static void read_waiting(PGconn *conn, struct waiting *w, FILE *out, int *problems)
{
    char line[300];
    PGresult *res = PQexec(conn, obx_store_sql_waiting());
    if (PQresultStatus(res) != PGRES_TUPLES_OK) {
        problem(out, problems, "postgres: cannot list the topics of unsent rows: %s",
                first_line(PQresultErrorMessage(res), line, sizeof(line)));
        PQclear(res);
        return;
    }
    for (int i = 0; i < PQntuples(res) && w->n < MAX_TOPICS; i++) {
        char *t = obx_strdup(obx_store_col(res, i, "topic"));
        if (!t)
            break; /* fewer topics checked; not worth failing the check */
        w->topic[w->n] = t;
        w->rows[w->n++] = strtoll(obx_store_col(res, i, "rows"), NULL, 10);
    }
    w->known = true;
    PQclear(res);
}

/* A pooler between the relay and Postgres must keep each connection on one
 * server session (obx_pg_pooling). */
static void check_pooling(const struct obx_config *cfg, PGconn *conn, FILE *out, int *problems)
{
    char target[300];
    PGresult *res = PQexec(conn, "SELECT pg_backend_pid()");
    int pid = PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1
                  ? (int)strtol(PQgetvalue(res, 0, 0), NULL, 10)
                  : PQbackendPID(conn);
    PQclear(res);
    snprintf(target, sizeof(target), "%s:%s/%s", PQhost(conn), PQport(conn), PQdb(conn));
    switch (obx_pg_pooling(conn, pid, cfg->pg_conninfo, "outboxd-check", OBX_PG_POOL_PROBE_S)) {
    case OBX_POOLING_NONE:
        break;
    case OBX_POOLING_SHARED: {
        char line[600];
        obx_pg_pooling_problem(line, sizeof(line));
        problem(out, problems, "postgres: %s: %s", target, line);
        break;
    }
    case OBX_POOLING_SESSION:
        fprintf(out,
                "outboxd: ok: postgres %s is reached through a connection pooler in session "
                "pooling\n",
                target);
        break;
    case OBX_POOLING_UNKNOWN:
        fprintf(out,
                "outboxd: note: postgres %s is reached through a connection pooler, and a second "
                "connection got no server session within %d s: it must be in session pooling\n",
                target, OBX_PG_POOL_PROBE_S);
        break;
    }
}

static void check_postgres(const struct obx_config *cfg, struct waiting *w, FILE *out,
                           int *problems)
{
    char line[300];
    PGconn *conn = obx_pg_connect(cfg->pg_conninfo, "outboxd-check", OBX_CHECK_TIMEOUT_S);
    if (!conn || PQstatus(conn) != CONNECTION_OK) {
        problem(out, problems,
                "postgres: cannot connect: %s (check postgres.conninfo, the server and the "
                "network)",
                conn ? first_line(PQerrorMessage(conn), line, sizeof(line)) : "out of memory");
        PQfinish(conn);
        return;
    }
    int before = *problems;
    check_pooling(cfg, conn, out, problems);
    long version = check_schema(conn, out, problems);
    if (version >= 0) {
        check_privileges(conn, out, problems);
        read_waiting(conn, w, out, problems);
    }
    if (*problems == before)
        fprintf(out, "outboxd: ok: postgres %s:%s/%s as %s, schema version %ld\n", PQhost(conn),
                PQport(conn), PQdb(conn), PQuser(conn), version);
    PQfinish(conn);
}

/* Whether the brokers create topics on first use: 1 yes, 0 no, -1 unknown
 * (the request failed or is not supported, as by the mock cluster). */
static int broker_auto_create(rd_kafka_t *rk, int32_t broker_id)
{
    char id[16];
    int answer = -1;
    snprintf(id, sizeof(id), "%d", broker_id);
    rd_kafka_ConfigResource_t *res = rd_kafka_ConfigResource_new(RD_KAFKA_RESOURCE_BROKER, id);
    rd_kafka_queue_t *q = rd_kafka_queue_new(rk);
    rd_kafka_AdminOptions_t *opt = rd_kafka_AdminOptions_new(rk, RD_KAFKA_ADMIN_OP_DESCRIBECONFIGS);
    if (!res || !q || !opt)
        goto done;
    rd_kafka_AdminOptions_set_request_timeout(opt, OBX_CHECK_TIMEOUT_S * 1000, NULL, 0);
    rd_kafka_DescribeConfigs(rk, &res, 1, opt, q);
    rd_kafka_event_t *ev = rd_kafka_queue_poll(q, (OBX_CHECK_TIMEOUT_S + 1) * 1000);
    const rd_kafka_DescribeConfigs_result_t *r =
        ev ? rd_kafka_event_DescribeConfigs_result(ev) : NULL;
    if (r && rd_kafka_event_error(ev) == RD_KAFKA_RESP_ERR_NO_ERROR) {
        size_t n_res, n_cfg;
        const rd_kafka_ConfigResource_t **rs = rd_kafka_DescribeConfigs_result_resources(r, &n_res);
        for (size_t i = 0; i < n_res; i++) {
            const rd_kafka_ConfigEntry_t **e = rd_kafka_ConfigResource_configs(rs[i], &n_cfg);
            for (size_t j = 0; j < n_cfg; j++)
                if (strcmp(rd_kafka_ConfigEntry_name(e[j]), "auto.create.topics.enable") == 0)
                    answer = rd_kafka_ConfigEntry_value(e[j]) &&
                             strcmp(rd_kafka_ConfigEntry_value(e[j]), "true") == 0;
        }
    }
    if (ev)
        rd_kafka_event_destroy(ev);
done:
    if (opt)
        rd_kafka_AdminOptions_destroy(opt);
    if (q)
        rd_kafka_queue_destroy(q);
    if (res)
        rd_kafka_ConfigResource_destroy(res);
    return answer;
}

/* relay.transactions: a producer with a transactional.id of its own (the
 * outbox's with "-check" after it: never the outbox's, whose init would
 * fence the running relay) initialises transactions, as each relay
 * session does. That needs a transaction coordinator (the brokers'
 * transaction.state.log.* must fit the cluster), the right to write that
 * transactional id (ACLs), and a transaction.timeout.ms the brokers allow
 * (transaction.max.timeout.ms). */
static void check_transactions(const struct obx_config *cfg, FILE *out, int *problems)
{
    rd_kafka_conf_t *conf;
    char err[512], id[300];
    const char *set = obx_config_kafka_get(cfg, "transactional.id");
    snprintf(id, sizeof(id), "%s-check", set ? set : "outboxd");
    if (obx_kafka_conf_build(cfg, OBX_KAFKA_PRODUCER, &conf, err, sizeof(err)) != 0 ||
        rd_kafka_conf_set(conf, "transactional.id", id, err, sizeof(err)) != RD_KAFKA_CONF_OK) {
        problem(out, problems, "kafka: relay.transactions: %s", err);
        return;
    }
    rd_kafka_t *rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, err, sizeof(err));
    if (!rk) {
        rd_kafka_conf_destroy(conf);
        problem(out, problems, "kafka: relay.transactions: cannot create a client: %s", err);
        return;
    }
    rd_kafka_error_t *e = rd_kafka_init_transactions(rk, OBX_CHECK_TIMEOUT_S * 1000);
    if (!e)
        fprintf(out,
                "outboxd: ok: kafka transactions (a producer with transactional.id %s "
                "initialised)\n",
                id);
    else
        problem(out, problems,
                "kafka: relay.transactions = on, but a producer with transactional.id %s could "
                "not initialise transactions within %ds (%s: %s); the brokers need a "
                "transaction coordinator (transaction.state.log.replication.factor and "
                "min.isr no larger than the cluster), the relay's user the right to write its "
                "transactional id, and kafka.transaction.timeout.ms no larger than the brokers' "
                "transaction.max.timeout.ms",
                id, OBX_CHECK_TIMEOUT_S, rd_kafka_err2name(rd_kafka_error_code(e)),
                rd_kafka_error_string(e));
    if (e)
        rd_kafka_error_destroy(e);
    rd_kafka_destroy(rk);
}

static void check_kafka(const struct obx_config *cfg, const struct waiting *w, FILE *out,
                        int *problems)
{
    rd_kafka_conf_t *conf;
    char err[512];
    const char *bootstrap = obx_config_kafka_get(cfg, "bootstrap.servers");
    if (obx_kafka_conf_build(cfg, OBX_KAFKA_PRODUCER, &conf, err, sizeof(err)) != 0) {
        problem(out, problems, "kafka: %s", err);
        return;
    }
    /* log.queue is on and no one serves the queue: librdkafka stays quiet. */
    rd_kafka_t *rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, err, sizeof(err));
    if (!rk) {
        rd_kafka_conf_destroy(conf);
        problem(out, problems, "kafka: cannot create a client: %s", err);
        return;
    }
    const struct rd_kafka_metadata *md = NULL;
    rd_kafka_resp_err_t e = rd_kafka_metadata(rk, 1, NULL, &md, OBX_CHECK_TIMEOUT_S * 1000);
    if (e != RD_KAFKA_RESP_ERR_NO_ERROR || !md || md->broker_cnt == 0) {
        problem(out, problems,
                "kafka: no broker answered at %s within %ds (%s); check "
                "kafka.bootstrap.servers, the network and the security settings",
                bootstrap, OBX_CHECK_TIMEOUT_S,
                e ? rd_kafka_err2str(e) : "no brokers in the answer");
        if (md)
            rd_kafka_metadata_destroy(md);
        rd_kafka_destroy(rk);
        return;
    }
    int before = *problems, auto_create = -2; /* -2: not asked yet */
    for (int i = 0; i < w->n; i++) {
        bool found = false;
        for (int t = 0; t < md->topic_cnt && !found; t++)
            found = strcmp(md->topics[t].topic, w->topic[i]) == 0 && md->topics[t].err == 0;
        if (found)
            continue;
        if (auto_create == -2)
            auto_create = broker_auto_create(rk, md->brokers[0].id);
        if (auto_create == 1)
            fprintf(out,
                    "outboxd: note: topic %s does not exist yet (%lld unsent rows wait for it); "
                    "the brokers create it on first publish\n",
                    w->topic[i], w->rows[i]);
        else
            problem(out, problems,
                    "kafka: topic %s does not exist (%lld unsent rows wait for it) and the "
                    "brokers %s auto-create topics: create it",
                    w->topic[i], w->rows[i], auto_create == 0 ? "do not" : "may not");
    }
    if (*problems == before && w->known)
        fprintf(out, "outboxd: ok: kafka %d brokers at %s, %d topics with unsent rows\n",
                md->broker_cnt, bootstrap, w->n);
    else if (*problems == before)
        fprintf(out, "outboxd: ok: kafka %d brokers at %s (topics not checked without Postgres)\n",
                md->broker_cnt, bootstrap);
    rd_kafka_metadata_destroy(md);
    rd_kafka_destroy(rk);
    if (cfg->transactions)
        check_transactions(cfg, out, problems);
}

int obx_check_live(const struct obx_config *cfg, FILE *out)
{
    struct waiting w = {.n = 0};
    int problems = 0;
    check_postgres(cfg, &w, out, &problems);
    check_kafka(cfg, &w, out, &problems);
    for (int i = 0; i < w.n; i++)
        obx_free(w.topic[i]);
    return problems;
}
