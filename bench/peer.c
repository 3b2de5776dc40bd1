/*
 * outboxd against Debezium (issue 38), OBX_BENCH_PEER=ROUNDS, run by
 * `bench/run --peer`: Debezium's PostgreSQL connector with the Outbox Event
 * Router (bench/debezium, at its defaults and tuned for latency) and
 * outboxd in its three modes, in turn, on one Postgres (wal_level=logical,
 * fsync and synchronous_commit on) and one real Kafka broker. Prints one
 * table a measurement:
 *
 * 1. Drain: ROUNDS rounds, the relays in a rotating order, of --rows rows
 *    written (in transactions of 1,000) while the relay was stopped. Time
 *    from its start to the first acknowledged record and to the last, the
 *    rate between them; CPU per row of the relay process over its whole
 *    life (JVM start and JIT included), of its Postgres backends (the
 *    walsender for Debezium), of the whole server and of the broker; its
 *    peak RSS; the WAL it wrote itself.
 * 2. Latency: commit -> record read by a consumer at 100, 1,000 and 5,000
 *    rows/s, OBX_BENCH_PEER_SECONDS (120) each after 20 s at 1,000 rows/s
 *    (the JIT's warm-up), with the CPU per row of each process.
 * 3. Outage: at 1,000 rows/s the relay is stopped (SIGKILL, then SIGTERM
 *    in a run of its own) 10 s in and started again 60 s later
 *    (OBX_BENCH_PEER_DOWN): records
 *    read twice, rows never read, the WAL the server kept for the relay
 *    after the 60 s (its replication slots) and the rows waiting in the
 *    outbox, the time from the restart to the first record and until
 *    every row committed before the restart was read.
 * 4. The writer's cost, no relay running: 8 and 32 writers each
 *    committing one row a transaction for OBX_BENCH_PEER_WRITER_SECONDS
 *    (20) with outbox.enqueue, with Debezium's outbox INSERT (a plain
 *    INSERT of the same row into a table of the same shape) and with its
 *    INSERT + DELETE in one transaction; transactions/s, WAL bytes and
 *    server CPU per transaction.
 *
 * Environment: OBX_BENCH_PEER_CLASSPATH (bench/debezium/build.sh's
 * classpath file's contents), OBX_BENCH_PEER_DIR (the peer's offsets),
 * OBX_BENCH_BROKER_PIDS (the broker's JVM), OBX_BENCH_PEER_HEAP (the
 * peer's -Xmx and -Xms, 512m), OBX_BENCH_PEER_ONLY=drain,latency,outage,
 * writers (a subset), OBX_BENCH_PEER_RELAYS=debezium,debezium-tuned,mark,
 * delete,log (some of the relays).
 */
#include "bench.h"
#include "outboxd/config.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#define SLOT "dbz_outbox"

struct relay_def {
    const char *name, *tag; /* tag: for OBX_BENCH_PEER_RELAYS */
    bool debezium, tuned;
    int on_sent;
};

static const struct relay_def relay_defs[] = {
    {"Debezium, defaults", "debezium", true, false, 0},
    {"Debezium, tuned", "debezium-tuned", true, true, 0},
    {"outboxd, mark", "mark", false, false, OBX_ON_SENT_MARK},
    {"outboxd, delete", "delete", false, false, OBX_ON_SENT_DELETE},
    {"outboxd, log", "log", false, false, OBX_ON_SENT_LOG},
};
#define N_RELAYS ((int)(sizeof(relay_defs) / sizeof(relay_defs[0])))

/* A relay started here: outboxd, or the peer's JVM writing its lines
 * ("ready 3.1 s", "first ...", "acked N ...") to `out`. */
struct relay {
    const struct relay_def *def;
    pid_t pid;
    char out[512];
};

/* The peer's settings, from the environment and the conninfo. */
static const char *peer_classpath, *peer_dir, *peer_heap = "512m";
static char pg_host[256], pg_port[16], pg_user[64], pg_dbname[64], pg_password[128];
static const char *bootstrap;

static void peer_settings(const struct opts *o)
{
    bootstrap = o->bootstrap;
    peer_classpath = getenv("OBX_BENCH_PEER_CLASSPATH");
    peer_dir = getenv("OBX_BENCH_PEER_DIR");
    if (!peer_classpath || !*peer_classpath || !peer_dir || !*peer_dir)
        die("OBX_BENCH_PEER", "OBX_BENCH_PEER_CLASSPATH and OBX_BENCH_PEER_DIR are required "
                              "(bench/run --peer sets them)");
    if (getenv("OBX_BENCH_PEER_HEAP") && *getenv("OBX_BENCH_PEER_HEAP"))
        peer_heap = getenv("OBX_BENCH_PEER_HEAP");
    char *err = NULL;
    PQconninfoOption *opts = PQconninfoParse(o->conninfo, &err);
    if (!opts)
        die("--conninfo", err ? err : "out of memory");
    for (PQconninfoOption *p = opts; p->keyword; p++) {
        const char *v = p->val ? p->val : "";
        if (strcmp(p->keyword, "host") == 0)
            snprintf(pg_host, sizeof(pg_host), "%s", v);
        else if (strcmp(p->keyword, "port") == 0)
            snprintf(pg_port, sizeof(pg_port), "%s", v);
        else if (strcmp(p->keyword, "user") == 0)
            snprintf(pg_user, sizeof(pg_user), "%s", v);
        else if (strcmp(p->keyword, "dbname") == 0)
            snprintf(pg_dbname, sizeof(pg_dbname), "%s", v);
        else if (strcmp(p->keyword, "password") == 0)
            snprintf(pg_password, sizeof(pg_password), "%s", v);
    }
    PQconninfoFree(opts);
    /* The JDBC driver speaks TCP only. */
    if (!*pg_host || pg_host[0] == '/' || !*pg_port || !*pg_user || !*pg_dbname)
        die("--conninfo", "the peer needs host (TCP), port, user and dbname in it");
}

/* Starts the peer (tuned or at Debezium's defaults); with `note`, it
 * prints "acked NOTE" once that many records were acknowledged. */
static void peer_spawn(struct relay *r, long note)
{
    snprintf(r->out, sizeof(r->out), "%s/peer.out", peer_dir);
    char err_path[600], heap_max[64], note_s[32];
    snprintf(err_path, sizeof(err_path), "%s/peer.err", peer_dir);
    snprintf(heap_max, sizeof(heap_max), "-Xmx%s", peer_heap);
    snprintf(note_s, sizeof(note_s), "%ld", note);
    int out = open(r->out, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    int errfd = open(err_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (out < 0 || errfd < 0)
        die(r->out, strerror(errno));
    char *argv[] = {"java",
                    heap_max,
                    "-cp",
                    (char *)peer_classpath,
                    "outboxd.bench.DebeziumPeer",
                    "--host",
                    pg_host,
                    "--port",
                    pg_port,
                    "--user",
                    pg_user,
                    "--dbname",
                    pg_dbname,
                    "--bootstrap",
                    (char *)bootstrap,
                    "--dir",
                    (char *)peer_dir,
                    "--note",
                    note_s,
                    "--password",
                    pg_password,
                    r->def->tuned ? "--tuned" : NULL,
                    NULL};
    pid_t pid = fork();
    if (pid < 0)
        die("fork", strerror(errno));
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlives the benchmark */
        dup2(out, 1);
        dup2(errfd, 2);
        execvp("java", argv);
        _exit(127);
    }
    close(out);
    close(errfd);
    r->pid = pid;
    live_relay = pid;
}

/* The number after `word` on the peer's line that starts with it (for
 * "acked N T s", the second), or -1 if there is no such line yet. Dies if
 * the peer has exited. */
static double peer_line(struct relay *r, const char *word)
{
    char line[256];
    double v = -1;
    FILE *f = fopen(r->out, "r");
    size_t wl = strlen(word);
    while (f && v < 0 && fgets(line, sizeof(line), f)) {
        if (strncmp(line, word, wl) != 0 || line[wl] != ' ')
            continue;
        const char *p = line + wl + 1;
        if (strcmp(word, "acked") == 0 && (p = strchr(p, ' ')) == NULL)
            continue;
        v = strtod(p, NULL);
    }
    if (f)
        fclose(f);
    int status;
    if (v < 0 && waitpid(r->pid, &status, WNOHANG) == r->pid) {
        live_relay = 0;
        r->pid = 0;
        die("the Debezium peer exited", "see peer.err in OBX_BENCH_PEER_DIR");
    }
    return v;
}

/* Waits (at most 300 s) for the peer's `word` line. */
static void peer_wait(struct relay *r, const char *word)
{
    for (int i = 0; i < 30000 && peer_line(r, word) < 0; i++)
        usleep(10000);
    if (peer_line(r, word) < 0)
        die("the Debezium peer", "did not get there in 300 s");
}

static void relay_stop(struct relay *r, int sig)
{
    if (r->pid <= 0)
        return;
    int status;
    kill(r->pid, sig);
    waitpid(r->pid, &status, 0);
    r->pid = 0;
    live_relay = 0;
}

/* Debezium's slot and offsets gone: the next start streams from the WAL
 * written after it. */
static void peer_forget(PGconn *c)
{
    char path[600];
    /* The JVM has exited; its walsender may not have let go of the slot yet. */
    for (int i = 0; i < 300 && query_int(c, "SELECT count(*) FROM pg_replication_slots"
                                            " WHERE slot_name = '" SLOT "' AND active") > 0;
         i++)
        usleep(100000);
    exec_ok(c, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
               " WHERE slot_name = '" SLOT "'");
    snprintf(path, sizeof(path), "%s/offsets.dat", peer_dir);
    unlink(path);
}

/* A relay started: outboxd, or the peer once it streams (its slot made
 * now if there was none). */
static void relay_start(struct relay *r, const struct opts *o)
{
    if (r->def->debezium) {
        peer_spawn(r, 0);
        peer_wait(r, "ready");
        return;
    }
    r->pid = spawn_outboxd(o, r->def->on_sent, NULL);
}

/* An empty outbox and the relay started on it (the peer with a new slot). */
static void relay_fresh(const struct opts *o, PGconn *c, struct relay *r)
{
    settle(c);
    if (r->def->debezium)
        peer_forget(c);
    relay_start(r, o);
    sleep(2);
}

/* The relay stopped, and the peer's slot dropped: it would keep WAL. */
static void relay_done(PGconn *c, struct relay *r)
{
    relay_stop(r, SIGTERM);
    if (r->def->debezium)
        peer_forget(c);
}

/* ---- CPU of the server and of the relay's sessions ---- */

/* utime + stime (and with `children`, cutime + cstime) of a process, s. */
static double stat_cpu_s(int pid, bool children, int *ppid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    double cpu = -1; /* gone */
    if (f && fgets(buf, sizeof(buf), f)) {
        const char *p = strrchr(buf, ')');
        int pp = 0;
        unsigned long ut = 0, st = 0;
        long cut = 0, cst = 0;
        if (p && sscanf(p + 2, "%*c %d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu %ld %ld", &pp,
                        &ut, &st, &cut, &cst) == 5) {
            cpu = (double)(ut + st + (children ? (unsigned long)(cut + cst) : 0)) /
                  (double)sysconf(_SC_CLK_TCK);
            if (ppid)
                *ppid = pp;
        }
    }
    if (f)
        fclose(f);
    return cpu;
}

static int postmaster_pid;

/* Waits until the benchmark's other sessions (writers that just
 * disconnected) have ended and been reaped: an ending backend's CPU is in
 * neither the /proc walk nor the postmaster's children's times until then. */
static void sessions_settle(PGconn *c)
{
    for (int i = 0; i < 100 && query_int(c, "SELECT count(*) FROM pg_stat_activity"
                                            " WHERE application_name = 'obx-bench'"
                                            " AND pid <> pg_backend_pid()") > 0;
         i++)
        usleep(20000);
    usleep(50000);
}

/* The whole server's CPU so far, s: the postmaster, every process it runs,
 * and (through the postmaster's children's times) every one that ended. */
static double server_cpu_s(void)
{
    double total = stat_cpu_s(postmaster_pid, true, NULL);
    if (total < 0)
        die("the postmaster", "its /proc/PID/stat cannot be read");
    DIR *d = opendir("/proc");
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) {
        int pid = atoi(e->d_name), ppid = 0;
        if (pid <= 0)
            continue;
        double cpu = stat_cpu_s(pid, false, &ppid);
        if (ppid == postmaster_pid && cpu > 0)
            total += cpu;
    }
    if (d)
        closedir(d);
    return total;
}

/* The relay's sessions at a moment (outboxd's and the peer's: every client
 * backend and walsender but the benchmark's own) and their CPU. */
#define MAX_SESSIONS 64
struct sessions {
    int n, pid[MAX_SESSIONS];
    double cpu[MAX_SESSIONS];
};

static void sessions_now(PGconn *c, struct sessions *s)
{
    PGresult *r = PQexec(c, "SELECT pid FROM pg_stat_activity"
                            " WHERE backend_type IN ('client backend', 'walsender')"
                            " AND application_name <> 'obx-bench'");
    if (PQresultStatus(r) != PGRES_TUPLES_OK)
        die("pg_stat_activity", PQresultErrorMessage(r));
    s->n = 0;
    if (PQntuples(r) > MAX_SESSIONS)
        die("the relay's sessions", "more than MAX_SESSIONS");
    for (int i = 0; i < PQntuples(r); i++) {
        s->pid[s->n] = atoi(PQgetvalue(r, i, 0));
        s->cpu[s->n] = stat_cpu_s(s->pid[s->n], false, NULL);
        if (s->cpu[s->n] >= 0) /* else it ended meanwhile */
            s->n++;
    }
    PQclear(r);
}

/* CPU the relay's sessions used between `from` and now (a session that
 * appeared since counts whole). */
static double sessions_cpu_since(PGconn *c, const struct sessions *from)
{
    struct sessions now;
    sessions_now(c, &now);
    double total = 0;
    for (int i = 0; i < now.n; i++) {
        double before = 0;
        for (int j = 0; j < from->n; j++)
            if (from->pid[j] == now.pid[i])
                before = from->cpu[j];
        total += now.cpu[i] - before;
    }
    return total;
}

/* Every counter at a moment, for per-row costs over a span. */
struct meter {
    double t, relay, server, brokers;
    struct sessions sessions;
};

static void meter_start(PGconn *c, const struct relay *r, struct meter *m)
{
    m->t = now_s();
    m->relay = r->pid > 0 ? stat_cpu_s(r->pid, false, NULL) : 0;
    m->server = server_cpu_s();
    m->brokers = brokers_cpu_s();
    sessions_now(c, &m->sessions);
}

/* CPU per row (us) of each over `rows` since `m`. */
struct costs {
    double relay, sessions, server, brokers;
};

static struct costs meter_stop(PGconn *c, const struct relay *r, const struct meter *m, long rows)
{
    double k = rows > 0 ? 1e6 / (double)rows : 0;
    sessions_settle(c);
    struct costs out = {
        .relay = ((r->pid > 0 ? stat_cpu_s(r->pid, false, NULL) : 0) - m->relay) * k,
        .sessions = sessions_cpu_since(c, &m->sessions) * k,
        .server = (server_cpu_s() - m->server) * k,
        .brokers = (brokers_cpu_s() - m->brokers) * k,
    };
    return out;
}

/* ---- 1. drain ---- */

/* `rows` rows like obx_bench's prefill, in transactions of 1,000 (one big
 * transaction would be decoded at its commit and spill to disk). */
static void backlog(PGconn *c, int rows, const char *topic)
{
    char sql[1024];
    for (int from = 0; from < rows; from += BATCH) {
        int to = from + BATCH < rows ? from + BATCH : rows;
        snprintf(sql, sizeof(sql),
                 "INSERT INTO outbox.events (topic, key, payload, headers)"
                 " SELECT '%s', 'key-' || (g %% %d), convert_to(rpad(g::text, 200, 'x'), "
                 "'UTF8'), jsonb_build_object('traceparent', '00-' || md5(g::text) || '-' ||"
                 "   left(md5('s' || g), 16) || '-01', 'source', 'bench')"
                 " FROM generate_series(%d, %d) g",
                 topic, KEYS, from + 1, to);
        exec_ok(c, sql);
    }
}

struct drain_figures {
    double to_ready, to_first, to_last; /* s from the relay's start */
    struct costs cost;
    double peak_mb, wal_per_row;
};

/* Follows a draining relay from its start at `t0` (polled every 10 ms, on
 * this clock): when it was ready to relay (the peer's "ready" line:
 * connector task started; outboxd's readiness: recovery passed), when Kafka
 * acknowledged its first record and its `rows`-th (outboxd's /metrics,
 * counted at each delivery report; the peer's "first" and "acked" lines,
 * the same). */
static void follow_drain(struct relay *r, long rows, const char *topic, double t0,
                         struct drain_figures *f)
{
    char published[128];
    snprintf(published, sizeof(published), "outboxd_records_published_total{topic=\"%s\"}", topic);
    f->to_ready = f->to_first = -1;
    for (;;) {
        double t = now_s() - t0;
        long long done;
        bool ready;
        if (r->def->debezium) {
            done = peer_line(r, "acked") >= 0 ? rows : peer_line(r, "first") >= 0 ? 1 : 0;
            ready = peer_line(r, "ready") >= 0;
        } else {
            int status;
            if (waitpid(r->pid, &status, WNOHANG) == r->pid) {
                r->pid = 0;
                live_relay = 0;
                die(r->def->name, "exited during the drain (its stderr goes to /dev/null)");
            }
            done = relay_metric(published);
            ready = relay_metric("outboxd_ready") == 1;
        }
        if (ready && f->to_ready < 0)
            f->to_ready = t;
        if (done >= 1 && f->to_first < 0)
            f->to_first = t;
        if (done >= rows) {
            f->to_last = t;
            return;
        }
        if (t > 1800)
            die(r->def->name, "did not relay the backlog in 30 minutes");
        usleep(10000);
    }
}

/* Each run relays to fresh topics of its own (bench/run makes them):
 * outboxd's start reads the partitions of the topics it has rows for, and
 * would otherwise read what the runs before it wrote. */
static void drain_one(const struct opts *o, PGconn *c, const struct relay_def *def,
                      const char *topic, struct drain_figures *f)
{
    struct relay r = {.def = def};
    settle(c);
    if (def->debezium) { /* its slot first: rows written before it are never streamed */
        peer_forget(c);
        relay_start(&r, o);
        relay_stop(&r, SIGTERM);
    }
    backlog(c, o->rows, topic);
    /* As obx_bench's drains: no checkpoint between the rows and the drain
     * (the relay's first change to each page would log the whole page). */
    exec_ok(c, "VACUUM ANALYZE outbox.events");
    char lsn[64];
    wal_lsn(c, lsn, sizeof(lsn));
    struct meter m;
    meter_start(c, &r, &m);
    double t0 = now_s();
    if (def->debezium)
        peer_spawn(&r, o->rows);
    else
        r.pid = spawn_outboxd(o, def->on_sent, NULL);
    m.relay = 0; /* the process's whole life */
    follow_drain(&r, o->rows, topic, t0, f);
    f->cost = meter_stop(c, &r, &m, o->rows);
    struct proc_stats st = {0};
    proc_stats(r.pid, &st);
    f->peak_mb = (double)st.peak_kb / 1024.0;
    f->wal_per_row = wal_since(c, lsn) / o->rows;
    relay_done(c, &r);
}

/* ---- 2. latency ---- */

static int env_seconds(const char *name, int dflt, int max)
{
    const char *v = getenv(name);
    if (!v || !*v)
        return dflt;
    char *end;
    long s = strtol(v, &end, 10);
    if (*end != '\0' || s < 1 || s > max)
        die(name, "want a number of seconds");
    return (int)s;
}

static void next_ids(const struct opts *o)
{
    PGconn *c = connect_db(o);
    id_base = query_int(c, "SELECT nextval(pg_get_serial_sequence('outbox.events', 'id'))");
    PQfinish(c);
}

static const int rates[3] = {100, 1000, 5000};

struct lat_figures {
    struct lat_result lat[3];
    struct costs cost[3];
};

static void latency_one(const struct opts *o, PGconn *c, const struct relay_def *def, int seconds,
                        struct lat_figures *f)
{
    struct relay r = {.def = def};
    relay_fresh(o, c, &r);
    /* 20 s at 1,000 rows/s first: the JIT's warm-up (and the topic's metadata). */
    size_t n;
    next_ids(o);
    free(lat_run(o, 1000, 20, NULL, &n));
    for (int i = 0; i < 3; i++) {
        next_ids(o);
        struct meter m;
        meter_start(c, &r, &m);
        struct lat_sample *s = lat_run(o, rates[i], seconds, NULL, &n);
        f->cost[i] = meter_stop(c, &r, &m, (long)n);
        lat_summary(s, n, -1e9, 1e9, &f->lat[i]);
        f->lat[i].achieved = (double)n / seconds;
        free(s);
    }
    relay_done(c, &r);
}

/* ---- 3. outage ---- */

#define OUTAGE_AT    10.0         /* s into the run */
#define OUTAGE_AFTER 40.0         /* writers go on this long after the restart */
static double outage_down = 60.0; /* OBX_BENCH_PEER_DOWN */

/* What outage_tick needs and finds (lat_run calls it from its loop). */
static struct {
    const struct opts *o;
    struct relay *r;
    PGconn *c;
    int sig;
    int step; /* 0 up, 1 stopped, 2 restarted */
    double stopped_at, restarted_at;
    long long retained, waiting;
} outage;

static void outage_tick(double elapsed)
{
    if (outage.step == 0 && elapsed >= OUTAGE_AT) {
        relay_stop(outage.r, outage.sig);
        outage.stopped_at = elapsed;
        outage.step = 1;
    } else if (outage.step == 1 && elapsed >= outage.stopped_at + outage_down) {
        /* What the server keeps for the stopped relay: WAL behind any slot,
         * and rows in the outbox (Debezium's peer never deletes them). */
        outage.retained = query_int(
            outage.c, "SELECT coalesce(sum(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)),"
                      " 0)::bigint FROM pg_replication_slots");
        outage.waiting = outage.r->def->debezium
                             ? -1
                             : query_int(outage.c, outage.r->def->on_sent == OBX_ON_SENT_LOG
                                                       ? "SELECT count(*) FROM outbox.unpublished"
                                                   : outage.r->def->on_sent == OBX_ON_SENT_DELETE
                                                       ? "SELECT count(*) FROM outbox.events"
                                                       : "SELECT count(*) FROM outbox.events"
                                                         " WHERE sent_at IS NULL");
        outage.restarted_at = elapsed; /* the JVM's start counts: the peer is up at "ready" */
        relay_start(outage.r, outage.o);
        outage.step = 2;
    }
}

struct outage_figures {
    long duplicates, lost;
    long long retained, waiting;
    double to_first, to_caught_up;
};

static void outage_one(const struct opts *o, PGconn *c, const struct relay_def *def, int sig,
                       struct outage_figures *f)
{
    struct relay r = {.def = def};
    relay_fresh(o, c, &r);
    /* No warm-up run: every row the peer streams since its slot was made
     * is one of this run's, so a replay after the restart counts whole. */
    size_t n;
    next_ids(o);
    outage.o = o;
    outage.r = &r;
    outage.c = c;
    outage.sig = sig;
    outage.step = 0;
    lat_tick = outage_tick;
    lat_quiet_s = 60;
    struct lat_sample *s =
        lat_run(o, 1000, (int)(OUTAGE_AT + outage_down + OUTAGE_AFTER), NULL, &n);
    lat_tick = NULL;
    lat_quiet_s = 10;
    f->duplicates = lat_duplicates;
    f->lost = lat_missing;
    f->retained = outage.retained;
    f->waiting = outage.waiting;
    /* Arrival times, on the run's clock (a sample's commit + its latency). */
    double first = -1, caught_up = 0;
    for (size_t i = 0; i < n; i++) {
        double arrived = s[i].at + s[i].lat;
        if (arrived >= outage.restarted_at && (first < 0 || arrived < first))
            first = arrived;
        if (s[i].at < outage.restarted_at && arrived > caught_up)
            caught_up = arrived;
    }
    f->to_first = first < 0 ? -1 : first - outage.restarted_at;
    f->to_caught_up = caught_up - outage.restarted_at;
    free(s);
    relay_done(c, &r);
}

/* ---- 4. the writer's cost ---- */

enum write_kind { WRITE_ENQUEUE, WRITE_INSERT, WRITE_INSERT_DELETE, N_WRITES };
static const char *const write_names[N_WRITES] = {
    "outbox.enqueue",
    "Debezium's outbox INSERT (= a plain INSERT of the row)",
    "Debezium's outbox INSERT + DELETE",
};

struct writer_arg {
    const struct opts *o;
    enum write_kind kind;
    double until;
    atomic_long *done;
    int writers;
    atomic_int started; /* each writer's place among them: its first key */
};

static void *writer_main(void *arg)
{
    struct writer_arg *w = arg;
    PGconn *c = connect_db(w->o);
    char sql[1024], payload[201];
    memset(payload, 'x', 200);
    payload[200] = '\0';
    long k = atomic_fetch_add(&w->started, 1) * KEYS / w->writers;
    while (now_s() < w->until) {
        /* One round trip a transaction whatever the pattern. */
        char values[600];
        snprintf(values, sizeof(values),
                 "'bench', 'key-%ld', convert_to('%s', 'UTF8'),"
                 " '{\"traceparent\": \"00-4bf92f3577b34da6a3ce929d0e0e4736-"
                 "00f067aa0ba902b7-01\", \"source\": \"bench\"}'::jsonb",
                 k++ % KEYS, payload);
        switch (w->kind) {
        case WRITE_ENQUEUE:
            snprintf(sql, sizeof(sql), "SELECT outbox.enqueue(%s)", values);
            break;
        case WRITE_INSERT:
            snprintf(sql, sizeof(sql),
                     "INSERT INTO bench_peer.outbox (topic, key, payload, headers) VALUES (%s)",
                     values);
            break;
        default:
            snprintf(sql, sizeof(sql),
                     "BEGIN; INSERT INTO bench_peer.outbox (topic, key, payload, headers)"
                     " VALUES (%s); DELETE FROM bench_peer.outbox WHERE id = "
                     "currval('bench_peer.outbox_id_seq'); COMMIT",
                     values);
        }
        PGresult *r = PQexec(c, sql);
        while (r) {
            if (PQresultStatus(r) != PGRES_COMMAND_OK && PQresultStatus(r) != PGRES_TUPLES_OK)
                die("writer", PQresultErrorMessage(r));
            PQclear(r);
            r = PQgetResult(c);
        }
        atomic_fetch_add(w->done, 1);
    }
    PQfinish(c);
    return NULL;
}

struct write_figures {
    double tx_per_s, wal_per_tx, server_us_per_tx;
};

static void writers_one(const struct opts *o, PGconn *c, enum write_kind kind, int writers,
                        int seconds, struct write_figures *f)
{
    settle(c);
    exec_ok(c, "TRUNCATE bench_peer.outbox");
    exec_ok(c, "CHECKPOINT");
    char lsn[64];
    wal_lsn(c, lsn, sizeof(lsn));
    atomic_long done = 0;
    pthread_t t[32];
    struct writer_arg w = {o, kind, now_s() + seconds, &done, writers, 0};
    double cpu0 = server_cpu_s(), t0 = now_s();
    for (int i = 0; i < writers; i++)
        if (pthread_create(&t[i], NULL, writer_main, &w) != 0)
            die("pthread_create", "writer");
    for (int i = 0; i < writers; i++)
        pthread_join(t[i], NULL);
    double elapsed = now_s() - t0;
    sessions_settle(c);
    long tx = atomic_load(&done);
    f->tx_per_s = (double)tx / elapsed;
    f->wal_per_tx = wal_since(c, lsn) / (double)tx;
    f->server_us_per_tx = (server_cpu_s() - cpu0) * 1e6 / (double)tx;
}

/* ---- the table ---- */

static bool wanted(const char *part)
{
    const char *only = getenv("OBX_BENCH_PEER_ONLY");
    return !only || !*only || strstr(only, part) != NULL;
}

/* OBX_BENCH_PEER_RELAYS=debezium,debezium-tuned,mark,delete,log: some. */
static bool relay_wanted(const struct relay_def *def)
{
    const char *list = getenv("OBX_BENCH_PEER_RELAYS");
    if (!list || !*list)
        return true;
    size_t n = strlen(def->tag);
    for (const char *p = list; (p = strstr(p, def->tag)) != NULL; p += n)
        if ((p == list || p[-1] == ',') && (p[n] == ',' || p[n] == '\0'))
            return true;
    return false;
}

static void print_costs(const struct costs *c)
{
    printf("%.1f | %.1f | %.1f | %.1f", c->relay, c->sessions, c->server, c->brokers);
}

void peer_table(const struct opts *o, int rounds)
{
    peer_settings(o);
    PGconn *c = connect_db(o);
    postmaster_pid = 0;
    stat_cpu_s(PQbackendPID(c), false, &postmaster_pid);
    if (postmaster_pid <= 0)
        die("the postmaster", "cannot read /proc/PID/stat of this session's backend");
    PGresult *r = PQexec(c, "SHOW wal_level");
    if (PQresultStatus(r) != PGRES_TUPLES_OK || strcmp(PQgetvalue(r, 0, 0), "logical") != 0)
        die("Postgres", "the peer needs wal_level = logical");
    PQclear(r);
    exec_ok(c, "CREATE SCHEMA IF NOT EXISTS bench_peer");
    exec_ok(c, "CREATE TABLE IF NOT EXISTS bench_peer.outbox (id bigserial PRIMARY KEY,"
               " topic text NOT NULL, key text, payload bytea, headers jsonb)");
    /* commit_at holds MAX_IDS ids: at 5,000 rows/s, 838 s */
    int seconds = env_seconds("OBX_BENCH_PEER_SECONDS", 120, 600);
    lat_threads = MAX_LAT_THREADS; /* 4 cannot commit 5,000 rows/s durably here */
    int write_seconds = env_seconds("OBX_BENCH_PEER_WRITER_SECONDS", 20, 3600);
    outage_down = env_seconds("OBX_BENCH_PEER_DOWN", 60, 3600);

    if (wanted("drain")) {
        printf("\n1. Drain of %d rows written while the relay was stopped, %d rounds in a "
               "rotating order. Rows/s: over the whole drain, from the relay's start (its JVM's "
               "too) to the last record Kafka acknowledged; and from the first acknowledged "
               "record to the last. Seconds from the start: ready (Debezium: its connector "
               "task started; outboxd: /readyz, its recovery pass done), first and last "
               "acknowledged record. CPU per row (us): the relay process over its whole life, "
               "its Postgres sessions (Debezium: the walsender), the whole server, the broker. "
               "Peak RSS (the peer's heap: -Xmx%s). WAL: what the relay made the server "
               "write.\n\n",
               o->rows, rounds, peer_heap);
        printf("| round | relay | rows/s | rows/s first to last | ready s | first s | last s | "
               "relay us/row | its sessions us/row | server us/row | broker us/row | peak RSS "
               "MB | relay WAL B/row |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | "
               "--- | --- | --- | --- |\n");
        fflush(stdout);
        for (int round = 0; round < rounds; round++)
            for (int i = 0; i < N_RELAYS; i++) {
                const struct relay_def *def = &relay_defs[(i + round) % N_RELAYS];
                if (!relay_wanted(def))
                    continue;
                struct drain_figures f;
                char topic[32];
                snprintf(topic, sizeof(topic), "drain%d-%d", round + 1, (int)(def - relay_defs));
                drain_one(o, c, def, topic, &f);
                char between[32] = "-";
                if (f.to_last > f.to_first)
                    snprintf(between, sizeof(between), "%.0f",
                             (double)o->rows / (f.to_last - f.to_first));
                printf("| %d | %s | %.0f | %s | %.2f | %.2f | %.2f | ", round + 1, def->name,
                       (double)o->rows / f.to_last, between, f.to_ready, f.to_first, f.to_last);
                print_costs(&f.cost);
                printf(" | %.0f | %.1f |\n", f.peak_mb, f.wal_per_row);
                fflush(stdout);
            }
    }
    if (wanted("latency")) {
        printf("\n2. Latency, commit -> record read by a consumer, one row a transaction "
               "(outbox.enqueue; %d writers at 1,000 rows/s and more: durable commits), %d s a "
               "rate after 20 s at 1,000 rows/s. CPU per row (us) as in 1: at 100 rows/s mostly "
               "what each costs idle; the server's includes the writers' sessions, the broker's "
               "this benchmark's consumer, the same for every relay.\n\n",
               lat_threads, seconds);
        printf("| relay | rate | achieved/s | p50 ms | p99 ms | p99.9 ms | max ms | relay us/row "
               "| its sessions us/row | server us/row | broker us/row |\n| --- | --- | --- | --- "
               "| --- | --- | --- | --- | --- | --- | --- |\n");
        fflush(stdout);
        for (int i = 0; i < N_RELAYS; i++) {
            if (!relay_wanted(&relay_defs[i]))
                continue;
            struct lat_figures f;
            char topic[32];
            snprintf(topic, sizeof(topic), "plat-%d", i);
            lat_topic_name = topic;
            latency_one(o, c, &relay_defs[i], seconds, &f);
            lat_topic_name = NULL;
            for (int k = 0; k < 3; k++) {
                const struct lat_result *l = &f.lat[k];
                printf("| %s | %d | %.0f | %.1f | %.1f | %.1f | %.1f | ", relay_defs[i].name,
                       rates[k], l->achieved, l->p50, l->p99, l->p999, l->max);
                print_costs(&f.cost[k]);
                printf(" |\n");
            }
            fflush(stdout);
        }
    }
    if (wanted("outage")) {
        printf("\n3. Outage at 1,000 rows/s: the relay stopped %.0f s in, started again %.0f s "
               "later; writers go on %.0f s after that. Duplicates: records read twice; lost: "
               "rows never read (must be 0). Kept: WAL behind replication slots after the %.0f s "
               "(and outboxd's rows waiting in the outbox). From the restart: the first record, "
               "and the last row committed before it.\n\n",
               OUTAGE_AT, outage_down, OUTAGE_AFTER, outage_down);
        printf("| relay | stopped by | duplicates | lost | WAL kept, bytes | rows waiting | to "
               "first s | caught up s |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n");
        fflush(stdout);
        static const int sigs[2] = {SIGKILL, SIGTERM};
        for (int k = 0; k < 2; k++)
            for (int i = 0; i < N_RELAYS; i++) {
                if (!relay_wanted(&relay_defs[i]))
                    continue;
                struct outage_figures f;
                char topic[32];
                snprintf(topic, sizeof(topic), "pout%d-%d", k, i);
                lat_topic_name = topic;
                outage_one(o, c, &relay_defs[i], sigs[k], &f);
                lat_topic_name = NULL;
                char waiting[32] = "-", first[32] = "-", caught_up[32] = "never";
                if (f.waiting >= 0)
                    snprintf(waiting, sizeof(waiting), "%lld", f.waiting);
                if (f.to_first >= 0)
                    snprintf(first, sizeof(first), "%.2f", f.to_first);
                if (f.lost == 0)
                    snprintf(caught_up, sizeof(caught_up), "%.2f", f.to_caught_up);
                printf("| %s | %s | %ld | %ld | %lld | %s | %s | %s |\n", relay_defs[i].name,
                       sigs[k] == SIGKILL ? "SIGKILL" : "SIGTERM", f.duplicates, f.lost, f.retained,
                       waiting, first, caught_up);
                fflush(stdout);
            }
    }
    if (wanted("writers")) {
        printf("\n4. The writer's cost, no relay running: one row a transaction, %d s, durable "
               "commits. The same row each (200-byte payload, 2 headers).\n\n",
               write_seconds);
        printf("| writers | statement | tx/s | WAL B/tx | server CPU us/tx |\n| --- | --- | --- "
               "| --- | --- |\n");
        static const int counts[2] = {8, 32};
        for (int k = 0; k < 2; k++)
            for (int w = 0; w < N_WRITES; w++) {
                struct write_figures f;
                writers_one(o, c, (enum write_kind)w, counts[k], write_seconds, &f);
                printf("| %d | %s | %.0f | %.0f | %.1f |\n", counts[k], write_names[w], f.tx_per_s,
                       f.wal_per_tx, f.server_us_per_tx);
                fflush(stdout);
            }
    }
    exec_ok(c, "DROP SCHEMA bench_peer CASCADE");
    PQfinish(c);
}
