/*
 * Integration test harness: a throwaway PostgreSQL, Kafka (the mock broker
 * process, or a real Apache Kafka cluster: obx-kafka-cluster) and the real
 * outboxd binary, all children of the test process.
 *
 * Every child gets PR_SET_PDEATHSIG, so even a test process killed by a
 * signal leaves no server behind; h_env_stop() stops them in order and
 * removes the temporary directory.
 */
#ifndef OBX_IT_HARNESS_H
#define OBX_IT_HARNESS_H

#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include <cmocka.h>
#include <libpq-fe.h>

/* A real Kafka cluster (obx-kafka-cluster) rather than the mock. */
struct h_kafka {
    int nodes;                /* 1 or 3; 0 = 3 */
    bool proxy;               /* our TCP proxy before each broker: cut, blackhole, heal */
    bool sasl;                /* the relay authenticates as "relay" and ACLs apply */
    const char *settings[12]; /* more broker settings, "key=value", NULL-ended */
};

struct h_env {
    char dir[256];
    char conninfo[512];
    pid_t pg_pid;
    pid_t broker_pid;
    FILE *broker_in, *broker_out;
    char bootstrap[512];
    /* A real cluster: its brokers' own listener, which no proxy and no SASL
     * is on; the harness reads records back there, whatever a test does to
     * the relay's connections. */
    bool real_kafka;
    struct h_kafka kafka;
    char internal[512];
    bool kafka_trimmed; /* records were deleted on purpose (h_kafka_delete_records) */
    pid_t relay_pid;
    int relay_starts;
    const char *relay_env[4]; /* extra NAME=value for the relay, NULL-ended */
    int pg_port;              /* 0 = 5432; the Unix socket's name follows it */
    const char *pg_opts[8];   /* extra "name=value" server settings, NULL-ended */
    int http_port;            /* free port picked by h_env_start for http.listen */
    bool pg_tcp;              /* Postgres listens on 127.0.0.1:pg_port; conninfo uses TCP */
    /* The relay's files are DIR/<relay_name>.log and .conf ("relay" when
     * empty): give each relay of a test its own name, so logs never mix. */
    char relay_name[32];
    pid_t standby_pid; /* a hot standby of the server (h_standby_start), or 0 */
    int standby_port;
    pid_t pooler_pids[2]; /* PgBouncers in front of the server (h_pooler_start) */
    pid_t copy_pid;       /* the server of a restored copy (h_restore_copy), or 0 */
};

/* h_env_start_with flags. */
#define H_PG_TCP     1 /* Postgres on TCP (127.0.0.1, a free port), as most deployments */
#define H_REAL_KAFKA 2 /* a real Kafka cluster of 3 nodes, whatever OBX_IT_KAFKA says */

struct h_header {
    char *name;
    char *value; /* NULL for a null header value */
    size_t value_len;
};

struct h_record {
    char *topic;
    int32_t partition;
    int64_t offset;
    char *key; /* NULL = no key */
    size_t key_len;
    char *value; /* NULL = tombstone */
    size_t value_len;
    int64_t outbox_id; /* from the (first) outbox-id header; -1 if missing */
    bool has_id;       /* that header was there (ids may be -1 and below) */
    int64_t timestamp; /* the record's timestamp (producer's create time), ms */
    struct h_header *headers;
    size_t nheaders;
};

struct h_records {
    struct h_record *v;
    size_t n, cap;
};

/* Starts Postgres (schema applied) and the broker with `topics`
 * ("name:partitions" strings, NULL-terminated; for a real cluster also
 * "name:partitions:key=value,..." with the topic's settings). Fails the test
 * on error. The broker is the mock unless OBX_IT_KAFKA=real (then a real
 * cluster of OBX_IT_KAFKA_NODES nodes, 3 by default: replication factor 3,
 * min.insync.replicas 2, and the relay's kafka.acks = all). */
void h_env_start(struct h_env *e, const char *const *topics);
void h_env_start_with(struct h_env *e, const char *const *topics, unsigned flags);
/* The same with a real cluster set up as k says (NULL: the defaults). */
void h_env_start_real(struct h_env *e, const char *const *topics, unsigned flags,
                      const struct h_kafka *k);
/* Stops everything that runs and removes the directory. Safe to call twice. */
void h_env_stop(struct h_env *e);

void h_pg_start(struct h_env *e);
/* Starts a hot standby streaming from the server (which must listen on TCP:
 * H_PG_TCP) on a free port, e->standby_port, and waits until it answers in
 * recovery. h_env_stop() stops it. */
void h_standby_start(struct h_env *e);
/* Starts a PgBouncer (Debian's) in front of the server with pool_mode
 * `pool_mode` ("session", "transaction"), 20 server sessions per pool, at
 * most two per env; writes the conninfo through it to `conninfo`. */
void h_pooler_start(struct h_env *e, const char *pool_mode, char *conninfo, size_t len);
/* Stops the pooler h_pooler_start started in `slot` (0 first), closing its
 * server sessions. */
void h_pooler_stop(struct h_env *e, int slot);
/* The database as pg_dump sees it now, restored by pg_restore into a new
 * cluster (initdb: another system identifier) on a free TCP port, with
 * the roles of sql/ created first: a restore, or a cut-over to a copy.
 * Writes the conninfo to it; one per env, stopped with it. */
void h_restore_copy(struct h_env *e, char *conninfo, size_t len);
/* A new cluster subscribed to every table of the test database by logical
 * replication (its schema from pg_dump; the server needs wal_level=logical),
 * and the cut-over to it: the copy caught up, the subscription dropped, the
 * id identity set to the original's. */
void h_logical_copy(struct h_env *e, char *conninfo, size_t len);
void h_logical_cut_over(struct h_env *e, const char *conninfo);
void h_pg_stop(struct h_env *e); /* fast shutdown */
/* Applies sql/ and the checker's trigger to the database e->conninfo names
 * (h_env_start has done so for its own). */
void h_schema_apply(struct h_env *e);
/* Immediate shutdown (SIGQUIT): no checkpoint, every session cut, as a
 * crash of the server leaves them; not started again. */
void h_pg_crash(struct h_env *e);
/* Stops the server with `mode` ("fast" or "immediate") and starts it again. */
void h_pg_restart(struct h_env *e, const char *mode);
/* A base backup of the server (pg_basebackup, its WAL with it), kept for
 * h_pg_rewind; a later one replaces it. Returns 0, or -1 if it failed. */
int h_pg_backup(struct h_env *e);
/* A point-in-time restore to the last h_pg_backup: the server stopped at
 * once, its data replaced by the backup, recovered to the backup's end and
 * promoted onto a new timeline; what committed after the backup is gone and
 * its ids are handed out again. Returns 0 once the server takes writes. */
int h_pg_rewind(struct h_env *e);
/* Path of the relay's log (DIR/<relay_name>.log) into buf. */
const char *h_relay_log_path(const struct h_env *e, char *buf, size_t len);

/* Sends a control command to the broker; returns true on "ok". */
bool h_broker_cmd(struct h_env *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The same for a command that answers "ok <number>" (leader, controller,
 * coordinator, pid of a real cluster): returns the number; fails the test
 * on an error, naming the command and the answer. */
long h_broker_query(struct h_env *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The same without failing: false when the cluster answers an error (a
 * partition without a leader while nodes are down). */
bool h_broker_number(struct h_env *e, long *out, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The broker's sequence checks so far ("stats"): batches checked, refused
 * out of sequence, answered as duplicates of a stored batch. */
struct h_seq_stats {
    unsigned long checked, out_of_order, duplicates, fenced, unchecked;
};
void h_broker_seq_stats(struct h_env *e, struct h_seq_stats *out);

/* Starts outboxd with the env's config plus extra -X settings (NULL-ended);
 * `failpoints` may be NULL. Output goes to DIR/relay.log. */
void h_relay_start(struct h_env *e, const char *failpoints, const char *const *xargs);
/* Sends `sig` and waits up to timeout_ms; returns the exit status as
 * WEXITSTATUS, 128+signal if killed, or -1 on timeout (then SIGKILLs). */
int h_relay_stop(struct h_env *e, int sig, int timeout_ms);
/* Waits for the relay to exit by itself; same return values. */
int h_relay_wait(struct h_env *e, int timeout_ms);
/* True if DIR/relay.log contains `needle`. */
bool h_relay_log_contains(struct h_env *e, const char *needle);
/* Waits (20 s at most, else fails) until a backend of the relay waits on a
 * lock while running a statement that starts with `query_prefix` ("" for
 * any); returns its pid. */
int h_relay_backend_waiting(PGconn *c, const char *query_prefix);
/* Fails the test unless `needle` shows up in DIR/relay.log within timeout_ms. */
void h_wait_log(struct h_env *e, const char *needle, int timeout_ms);
/* Lines of the relay's log holding `needle`. */
long h_relay_log_count(struct h_env *e, const char *needle);
/* The lines of the real cluster's node logs that contain NEEDLE (0 on the mock). */
long h_kafka_log_count(struct h_env *e, const char *needle);
/* Lines of the relay's (JSON) log that carry "event":"<event>", and
 * `detail` if not NULL: what tests wait for rather than a message's words;
 * h_wait_event waits until there are at least n. */
long h_relay_events(struct h_env *e, const char *event, const char *detail);
void h_wait_event(struct h_env *e, const char *event, const char *detail, long n, int timeout_ms);
/* Lines of the relay's log saying it lost (or could not open) its Postgres
 * session: how a test sees that a cut was noticed. */
long h_relay_disconnects(struct h_env *e);
/* How many sessions the relay's log says it opened ("postgres: connected"). */
long h_relay_sessions(struct h_env *e);
/* Sum of the integers that directly follow `prefix` in DIR/relay.log. */
long h_relay_log_sum(struct h_env *e, const char *prefix);

PGconn *h_connect(struct h_env *e);
/* Runs SQL that must succeed; returns the first column of the first row as
 * int64 (0 if none). */
int64_t h_sql_int(PGconn *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void h_sql(PGconn *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Enqueues one row through outbox.enqueue(bytea); key/payload may be NULL.
 * headers_json NULL = default. Returns the id. */
int64_t h_enqueue(PGconn *c, const char *topic, const char *key, const void *payload,
                  size_t payload_len, const char *headers_json);

/* Polls until no row is unsent (and at least `min_rows` exist, when marking)
 * or the timeout passes; returns true when drained. */
bool h_wait_drained(struct h_env *e, int timeout_ms);

/* Reads every record of `topics` (NULL-terminated names) from the start to
 * the end of each partition. */
void h_kafka_read_all(struct h_env *e, const char *const *topics, struct h_records *out);
/* The same as a read_committed consumer (h_kafka_read_all's way: what an
 * aborted transaction wrote is left out) or a read_uncommitted one. */
void h_kafka_read_all_as(struct h_env *e, const char *const *topics, bool committed,
                         struct h_records *out);
/* Deletes the records of `topic` [`partition`] below offset `before`
 * (Kafka's DeleteRecords, as retention would; a real cluster). The
 * readers above then start where the partition now begins. */
void h_kafka_delete_records(struct h_env *e, const char *topic, int32_t partition, int64_t before);
/* How many partitions of `topic` hold no record yet. */
int h_kafka_empty_partitions(struct h_env *e, const char *topic);
void h_records_free(struct h_records *r);
const struct h_header *h_record_header(const struct h_record *r, const char *name);

/* Runs the outboxd binary with argv and envp, stdin from /dev/null, and
 * collects its stdout and stderr into out. Returns its exit status (-1 if
 * killed by a signal). */
int h_run_outboxd(char *const argv[], char *const envp[], char *out, size_t outlen);

/* Runs the suite's tests, or only the one argv[1] names (as ctest does):
 * a name that is no test of the suite fails rather than running nothing. */
int h_run_suite(const char *group, const struct CMUnitTest *tests, size_t n, int argc, char **argv);
#define H_RUN_SUITE(tests, argc, argv)                                                             \
    h_run_suite(#tests, tests, sizeof(tests) / sizeof((tests)[0]), argc, argv)

/* Checks, against every row committed since h_env_start (a trigger keeps a
 * copy, so delete mode and retention are covered) except dead letters:
 * every row is in Kafka exactly once (or at least once when
 * allow_duplicates), with the same topic, key and payload, nothing else is
 * in Kafka, and records of one key sit in one partition in id order.
 * Returns the number of duplicates. */
size_t h_check_db_matches_kafka(struct h_env *e, const struct h_records *recs,
                                bool allow_duplicates);

/* Real Kafka's replication window (doc/guarantees.md): a row published
 * twice is explained when its first copy lay at or above the high
 * watermark the relay's next recovery pass read its partition to (the
 * relay's "recovery_read" lines; it must log at debug level). Fails on a
 * duplicate it cannot explain that way; returns how many it explained. */
size_t h_explain_duplicates(struct h_env *e, const struct h_records *recs);
/* The high watermark of the first (or the last) recovery pass in the
 * relay's log (at debug level) that read (topic, partition) between
 * since_ms and until_ms, and when it did in *at_ms (may be NULL); -1 if
 * none did. With slot >= 0 (relay.shards), only passes made while the
 * relay held that slot (its last "took ... slots; holds" line before the
 * pass lists it) count: a pass matches only rows of the slots it holds. */
int64_t h_recovery_high_watermark(struct h_env *e, const char *topic, int32_t partition,
                                  int64_t since_ms, int64_t until_ms, bool last, int slot,
                                  int64_t *at_ms);

/* A datagram socket DIR/name for sd_notify messages; writes
 * "NOTIFY_SOCKET=path" into var (for relay_env). Returns the fd. */
int h_notify_socket(struct h_env *e, const char *name, char *var, size_t var_len);
/* Receives one sd_notify message within timeout_ms; false if none came. */
bool h_recv_notify(int fd, char *buf, size_t len, int timeout_ms);

/* A TCP port that was free a moment ago on 127.0.0.1. */
int h_free_port(void);

/* Sends `request` (raw bytes) to 127.0.0.1:port and reads the answer until
 * the server closes, up to timeout_ms. Returns the HTTP status (0 if none)
 * and the body, NUL-terminated, in body (may be NULL). */
int h_http_raw(int port, const char *request, size_t request_len, char *body, size_t body_len,
               int timeout_ms);
/* GET path from the relay's HTTP endpoints. */
int h_http_get(struct h_env *e, const char *path, char *body, size_t body_len);
/* Polls GET path until it answers `status` with `needle` (NULL = any) in
 * the body, which is left in body; fails the test after timeout_ms. */
void h_wait_http(struct h_env *e, const char *path, int status, const char *needle, int timeout_ms,
                 char *body, size_t body_len);
/* Value of the sample `series` (name with labels, as printed) in a
 * Prometheus text exposition; -1 when absent. */
double h_metric(const char *exposition, const char *series);
/* Waits until the relay's /metrics says `series` is `value` (at least
 * `min`): how tests follow the relay's state, rather than its log's words. */
void h_wait_metric(struct h_env *e, const char *series, double value, int timeout_ms);
void h_wait_metric_min(struct h_env *e, const char *series, double min, int timeout_ms);

int64_t h_now_ms(void);
void h_sleep_ms(int ms);

#endif
