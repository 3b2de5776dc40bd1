/*
 * What obx-bench's parts share: obx_bench.c (outboxd against the limits of
 * Postgres and Kafka) and peer.c (outboxd against Debezium, issue 38).
 */
#ifndef OBX_BENCH_H
#define OBX_BENCH_H

#include <signal.h>
#include <stdbool.h>
#include <sys/types.h>

#include <libpq-fe.h>

#define BATCH      1000
#define PARTITIONS 12
#define KEYS       300
/* commit_at's size: the ids of one latency run, its warm-up and a margin */
#define MAX_IDS (1 << 22)

struct opts {
    const char *conninfo, *bootstrap, *outboxd, *malloc_lib;
    int rows;
    int latency_seconds;
};

double now_s(void);
/* Prints "obx-bench: what: detail", stops the relay in live_relay, exits 1. */
_Noreturn void die(const char *what, const char *detail);
/* The relay process (outboxd or the peer) a failure here must stop too. */
extern volatile sig_atomic_t live_relay;

PGconn *connect_db(const struct opts *o);
void exec_ok(PGconn *c, const char *sql);
long long query_int(PGconn *c, const char *sql);
/* TRUNCATE the outbox, VACUUM ANALYZE, CHECKPOINT. */
void settle(PGconn *c);
char *wal_lsn(PGconn *c, char *buf, size_t len);
/* WAL bytes inserted since `lsn`. */
double wal_since(PGconn *c, const char *lsn);

struct proc_stats {
    double cpu_s; /* user + system */
    long peak_kb; /* VmHWM */
};
void proc_stats(pid_t pid, struct proc_stats *st);
double machine_cpu_s(void);
/* A Postgres backend's CPU so far (user + system), s. */
double backend_cpu_s(int pid);
/* The brokers' CPU so far (OBX_BENCH_BROKER_PIDS), s. */
double brokers_cpu_s(void);

const char *mode_name(int on_sent);
/* The port of the /metrics of the outboxd spawn_outboxd starts. */
extern int http_port;
pid_t spawn_outboxd(const struct opts *o, int on_sent, const char *count_file);
/* An outboxd in mode on_sent, /metrics on `port`, with one more setting
 * `more` (or NULL). */
pid_t spawn_relay(const struct opts *o, int on_sent, const char *count_file, int port,
                  const char *more);
void stop_outboxd(pid_t pid);
long long relay_metric(const char *sample);
const char *left_sql_for(int on_sent);
void wait_drained(PGconn *c, const char *sql, pid_t relay);

/* One record read back: its row, when the row's commit was sent (seconds
 * after the writers started) and how long it took to reach the consumer. */
struct lat_sample {
    long long id;
    double at, lat;
};

struct lat_result {
    double achieved, p50, p99, p999, max; /* ms, but achieved: records/s */
    long n;
};

/* The latency runs match records to commits by outbox-id - id_base. */
extern long long id_base;
extern double *commit_at;
struct lat_probe;
struct lat_sample *lat_run(const struct opts *o, int rate, int seconds, struct lat_probe *probe,
                           size_t *n_out);
void lat_summary(const struct lat_sample *s, size_t n, double from, double to,
                 struct lat_result *res);
/* Called by lat_run about every 10 ms with the seconds since its writers
 * started (peer.c stops and restarts a relay from it). */
extern void (*lat_tick)(double elapsed);
/* Of the last lat_run: records read back for a row already seen, rows
 * committed and never read back (within lat_quiet_s of quiet after the
 * writers ended: 10 s unless set). */
extern long lat_duplicates, lat_missing;
extern double lat_quiet_s;
/* lat_run's writer threads at 1,000 rows/s and more: 4 unless set. */
#define MAX_LAT_THREADS 16
extern int lat_threads;
/* The topic of lat_run's rows (without windows): "lat" unless set. */
extern const char *lat_topic_name;
int cmp_double(const void *a, const void *b);

/* peer.c: OBX_BENCH_PEER=ROUNDS */
void peer_table(const struct opts *o, int rounds);
/* OBX_BENCH_HELD (held.c): fetches with keys held back. */
void held_bench(const struct opts *o, const char *list);

#endif
