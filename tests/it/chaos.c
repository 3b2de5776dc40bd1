/*
 * obx-chaos: randomized, seeded fault schedules against the real outboxd,
 * a throwaway PostgreSQL (on TCP) and Kafka (the mock broker, or with
 * --kafka real a 3-node Apache Kafka cluster behind our TCP proxy), and a
 * checker that compares what the writers committed with what arrived in
 * Kafka.
 *
 *   obx-chaos [--kafka mock|real] [--seed S] [--schedules N] [--seconds T]
 *             [--faults a,b,...] [--keep-going] [--list-faults] [--print]
 *             [--mode M] [--sharing] [--transactions]
 *
 * --transactions (with --kafka real): only the schedules whose relays run
 * with relay.transactions (half of them, relay.shards or not), where a
 * read_committed reader must see no duplicate in any window.
 *
 * Schedule k of a run has the seed S + k; `--seed X --schedules 1` replays
 * schedule X (the same relays, writers' choices and fault timeline; the
 * system's own timing differs from run to run, which is the point of
 * trying many). OBX_RELAY_BINARY=path tests another outboxd binary.
 *
 * Each schedule: 1-3 relays on one outbox (and up to 2 more that join for a
 * while: the join faults), 3 writers (single rows, same-key
 * bursts, rollbacks, late commits held open for seconds, tombstones, NULL
 * and unicode keys and headers, rows near and above message.max.bytes), and
 * faults drawn on a timeline so that they overlap. Then everything is healed
 * and checked: no committed row lost, no rolled-back row published, per-key
 * order, payloads byte for byte, duplicates only in the windows the README
 * names (counted per window; on real Kafka also the replication window:
 * a first copy no recovery pass could see yet), no stall (everything published within
 * DRAIN_DEADLINE_MS of healing, COORDINATOR_RETRY_MS more when a transaction
 * coordinator put a write off), every relay stops on SIGTERM within its
 * shutdown.timeout, no sanitizer report and no "cannot happen" line.
 */
#include "harness.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>

#include <setjmp.h>
#include <cmocka.h>

#define MAX_RELAYS        3
#define MAX_GUESTS        2 /* relays that join a running schedule (F_JOIN) */
#define WRITERS           3
#define MAX_FAULTS        12
#define DRAIN_DEADLINE_MS 30000
/* A transaction coordinator whose write of a transaction's end meets too
 * few in-sync replicas (a node just back) tries again on its marker
 * thread's next round, up to the broker's request.timeout.ms (30 s by
 * default) later; until then every init_transactions of that id answers
 * CONCURRENT_TRANSACTIONS. The drain may wait that much longer when a
 * node's log says so. */
#define COORDINATOR_RETRY_MS   35000
#define COORDINATOR_RETRY_LINE "Not available to append PendingCompleteTxn"
#define SHUTDOWN_S             5
#define MAX_MESSAGE_BYTES      100000

static const char *const topics[] = {"chaos.a", "chaos.b", "chaos.c", NULL};
static const char *const topic_spec[] = {"chaos.a:4", "chaos.b:3", "chaos.c:1", NULL};
/* On a real cluster the broker refuses what is above MAX_MESSAGE_BYTES (a
 * batch's overhead above it is allowed); the relays' batches stay within
 * REAL_BATCH_BYTES, so that only a row too large alone is refused. Records
 * carry the time the leader appended them: the replication window's
 * excuse needs to know that a copy was in the log (replicating()). */
#define REAL_TOPIC_LIMIT "max.message.bytes=101000,message.timestamp.type=LogAppendTime"
#define REAL_BATCH_BYTES "100000"
static const char *const real_topic_spec[] = {"chaos.a:4:" REAL_TOPIC_LIMIT,
                                              "chaos.b:3:" REAL_TOPIC_LIMIT,
                                              "chaos.c:1:" REAL_TOPIC_LIMIT, NULL};

/* ---- seeded randomness (splitmix64) ---- */

struct rng {
    uint64_t s;
};

static uint64_t rnd(struct rng *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Uniform in [lo, hi]. */
static int rnd_in(struct rng *r, int lo, int hi)
{
    return lo + (int)(rnd(r) % (uint64_t)(hi - lo + 1));
}

/* ---- faults and schedules ---- */

enum fault_kind {
    F_KILL9,          /* kill -9 a relay, restart it after dur */
    F_STOP,           /* SIGSTOP a relay for dur */
    F_TERMINATE,      /* pg_terminate_backend of a relay's sessions */
    F_FREEZE_CUT,     /* SIGSTOP, terminate its sessions, SIGCONT after dur */
    F_PG_FAST,        /* Postgres restart, fast */
    F_PG_IMMEDIATE,   /* Postgres restart, immediate (crash-like) */
    F_PG_DOWN,        /* Postgres stopped for dur */
    F_BROKERS_DOWN,   /* every broker down for dur */
    F_BROKER_DOWN,    /* one broker down for dur */
    F_PRODUCE_ERRORS, /* the next Produce requests fail with a transient error */
    F_REJECT_ERRORS,  /* the next Produce request fails for good (MSG_SIZE_TOO_LARGE) */
    F_RTT,            /* every broker answers dur/4 ms late, for dur */
    F_SIGTERM,        /* SIGTERM a relay, restart it after dur */
    F_SIGHUP,         /* SIGHUP a relay (reload) */
    F_TAKEOVER,       /* the active relay's sessions terminated; after dur, kill -9 of the
                       * relay that took over while acknowledgements lag (restarted at
                       * once): a relay's second acquisition of the lock in one process */
    F_SLOW_ACKS,      /* one broker or all answer 1.7-4 s late, for dur: later than the
                       * relays' finite kafka.message.timeout.ms in such schedules, so
                       * records time out in flight, possibly stored */
    F_JOIN,           /* one more relay joins for dur, then leaves on SIGTERM (with
                       * relay.shards: slots handed to it and back) */
    F_JOIN_CRASH,     /* one more relay joins for dur, then dies by kill -9 */
    /* Faults of a real cluster (--kafka real); the node is the leader of a
     * busy partition or a drawn one (target_node). */
    F_NODE_KILL9,  /* kill -9 of a node, started again after dur */
    F_NODES_KILL9, /* kill -9 of every node, started again after dur */
    F_NODE_PAUSE,  /* SIGSTOP of a node for dur */
    F_LEADER_MOVE, /* a leader stopped cleanly (controlled shutdown hands its partitions
                    * to other replicas), started again after dur */
    F_CUT,         /* the relays' connections to a node (or all) reset and refused for dur */
    F_BLACKHOLE,   /* a node (or all) forwards nothing to the relays for dur */
    /* The mock's again (after the real cluster's, so that the kind numbers
     * of earlier runs' plots keep their meaning). */
    F_TOPIC_REFUSED, /* the next two Produce requests are refused as a topic the relay may
                      * not write (TOPIC_AUTHORIZATION_FAILED): under dead_letter the
                      * rows go there; under retry the topic waits and is tried
                      * alone until it is taken */
    F_PG_REWIND,     /* a base backup of Postgres, and after dur a point-in-time restore to
                      * it on a new timeline: rows committed since are gone and their
                      * ids handed out again, their records in Kafka */
    F_COUNT
};

static const char *const fault_names[F_COUNT] = {"kill9",
                                                 "stop",
                                                 "terminate",
                                                 "freeze-cut",
                                                 "pg-restart-fast",
                                                 "pg-restart-immediate",
                                                 "pg-down",
                                                 "brokers-down",
                                                 "broker-down",
                                                 "produce-errors",
                                                 "reject-errors",
                                                 "rtt",
                                                 "sigterm",
                                                 "sighup",
                                                 "takeover",
                                                 "slow-acks",
                                                 "join",
                                                 "join-crash",
                                                 "node-kill9",
                                                 "nodes-kill9",
                                                 "node-pause",
                                                 "leader-move",
                                                 "cut",
                                                 "blackhole",
                                                 "topic-refused",
                                                 "pg-rewind"};

/* What only the mock broker can do (its control commands), and what only a
 * real cluster can; the rest (relays, Postgres) runs on either. */
#define MOCK_FAULTS                                                                                \
    (1u << F_BROKERS_DOWN | 1u << F_BROKER_DOWN | 1u << F_PRODUCE_ERRORS | 1u << F_REJECT_ERRORS | \
     1u << F_RTT | 1u << F_SLOW_ACKS | 1u << F_TOPIC_REFUSED)
#define REAL_FAULTS                                                                                \
    (1u << F_NODE_KILL9 | 1u << F_NODES_KILL9 | 1u << F_NODE_PAUSE | 1u << F_LEADER_MOVE |         \
     1u << F_CUT | 1u << F_BLACKHOLE)
#define ALL_FAULTS ((1u << F_COUNT) - 1)

/* --kafka real: a 3-node cluster rather than the mock. */
static bool opt_real;

/* Faults drawn unless --faults says otherwise: all that the broker has. */
static unsigned default_faults(void)
{
    return ALL_FAULTS & ~(opt_real ? MOCK_FAULTS : REAL_FAULTS);
}

struct fault {
    enum fault_kind kind;
    int relay;
    int at_ms, dur_ms;
};

struct schedule {
    uint64_t seed;
    int n_relays;     /* started with the schedule; relay[n_relays..] are guests */
    bool retry;       /* relay.on_reject = retry (else dead_letter); no row above the limit */
    int n_guests;     /* relays that join later, one for each join fault */
    const char *mode; /* relay.on_sent: mark, delete or log */
    int shards;       /* relay.shards: above 1, every relay publishes its slots */
    bool txn;         /* relay.transactions (real Kafka): no duplicate excused */
    int duration_ms;
    int n_faults;
    struct fault f[MAX_FAULTS];
};

/* How often each kind is drawn, relative to the others. Lost sessions (cut
 * while frozen, or terminated under a running relay) weigh most: they are
 * where the timing bugs of relays live. A real cluster's faults are close
 * to half of its schedules' draws. The join faults are drawn apart
 * (gen_schedule), 0 here. */
static const int fault_weight[F_COUNT] = {
    [F_KILL9] = 2,       [F_STOP] = 1,           [F_TERMINATE] = 3,     [F_FREEZE_CUT] = 3,
    [F_PG_FAST] = 1,     [F_PG_IMMEDIATE] = 1,   [F_PG_DOWN] = 1,       [F_BROKERS_DOWN] = 1,
    [F_BROKER_DOWN] = 1, [F_PRODUCE_ERRORS] = 1, [F_REJECT_ERRORS] = 1, [F_RTT] = 1,
    [F_SIGTERM] = 1,     [F_SIGHUP] = 1,         [F_TAKEOVER] = 2,      [F_SLOW_ACKS] = 1,
    [F_NODE_KILL9] = 3,  [F_NODES_KILL9] = 1,    [F_NODE_PAUSE] = 2,    [F_LEADER_MOVE] = 2,
    [F_CUT] = 3,         [F_BLACKHOLE] = 2,      [F_TOPIC_REFUSED] = 1,
};

static void gen_schedule(struct schedule *s, uint64_t seed, unsigned enabled)
{
    struct rng r = {seed};
    int kinds[F_COUNT * 4], n_kinds = 0;
    for (int k = 0; k < F_COUNT; k++)
        for (int w = 0; (enabled & (1u << k)) && w < fault_weight[k]; w++)
            kinds[n_kinds++] = k;
    memset(s, 0, sizeof(*s));
    s->seed = seed;
    s->n_relays = rnd_in(&r, 1, MAX_RELAYS);
    static const char *const modes[] = {"delete", "log", "log", "mark", "mark", "mark"};
    s->mode = modes[rnd_in(&r, 0, 5)];
    s->duration_ms = rnd_in(&r, 6000, 10000);
    s->n_faults = n_kinds ? rnd_in(&r, 2, 8) : 0;
    for (int i = 0; i < s->n_faults; i++) {
        struct fault *f = &s->f[i];
        f->kind = (enum fault_kind)kinds[rnd_in(&r, 0, n_kinds - 1)];
        f->relay = rnd_in(&r, 0, s->n_relays - 1);
        f->at_ms = rnd_in(&r, 300, s->duration_ms - 500);
        f->dur_ms = rnd_in(&r, 200, 3000);
    }
    /* Relays joining and leaving: in a third of the schedules one or two
     * more relays join for a while (with relay.shards, slots move to them
     * and back; without, they stand by). Drawn apart too, and appended. */
    unsigned joins = enabled & (1u << F_JOIN | 1u << F_JOIN_CRASH);
    struct rng jr = {seed ^ 0x701e5eedULL};
    int draw = rnd_in(&jr, 0, 5);
    int n_joins = !joins ? 0 : draw < 4 ? 0 : draw - 3;
    for (int j = 0; j < n_joins && j < MAX_GUESTS && s->n_faults < MAX_FAULTS; j++) {
        struct fault *f = &s->f[s->n_faults++];
        bool crash =
            joins == (1u << F_JOIN_CRASH) || (joins != (1u << F_JOIN) && rnd_in(&jr, 0, 2) == 0);
        f->kind = crash ? F_JOIN_CRASH : F_JOIN;
        f->relay = s->n_relays + s->n_guests++;
        f->at_ms = rnd_in(&jr, 300, s->duration_ms - 1500);
        f->dur_ms = rnd_in(&jr, 800, 4000);
    }
    /* A history rewind in a fifth of the schedules, drawn apart: a backup
     * early, the restore to it before the end. */
    struct rng wr = {seed ^ 0x9e3779b97f4a7c15ULL};
    if ((enabled & (1u << F_PG_REWIND)) && rnd_in(&wr, 0, 4) == 0 && s->n_faults < MAX_FAULTS) {
        struct fault *f = &s->f[s->n_faults++];
        f->kind = F_PG_REWIND;
        f->relay = 0;
        f->at_ms = rnd_in(&wr, 300, s->duration_ms - 4500);
        f->dur_ms = rnd_in(&wr, 2000, 4000); /* the backup itself takes a second or two */
    }
    /* Several active relays for half the schedules that can have them
     * (two relays or more, or one joined by others; in every mode).
     * Drawn apart, so that a seed still gives the schedule it gave before
     * relay.shards existed, with only this added. */
    struct rng sr = {seed ^ 0x5a17ed5eedULL};
    s->shards = 1;
    if ((s->n_relays > 1 || s->n_guests > 0) && rnd_in(&sr, 0, 1))
        s->shards = rnd_in(&sr, 2, 6);
    /* relay.transactions in half the real cluster's schedules (the mock
     * cannot fence), relay.shards or not. Drawn apart, as above. */
    struct rng tr = {seed ^ 0x7a5c7105eedULL};
    s->txn = opt_real && rnd_in(&tr, 0, 1);
    /* relay.on_reject = retry in a third of the schedules: refused rows
     * and topics wait and are tried alone (through the second producer)
     * until taken. Drawn apart, as above. */
    struct rng rr = {seed ^ 0x7e7e5eedULL};
    s->retry = rnd_in(&rr, 0, 2) == 0;
}

/* Every relay of the schedule, the guests included. */
static int relays_of(const struct schedule *s)
{
    return s->n_relays + s->n_guests;
}

static void print_schedule(FILE *out, const struct schedule *s)
{
    fprintf(out,
            "schedule seed %llu%s: %d relay%s (%d joining), %s mode, relay.shards = %d, "
            "relay.on_reject = %s%s, %d ms, %d faults:\n",
            (unsigned long long)s->seed, opt_real ? " (real Kafka)" : "", s->n_relays,
            s->n_relays > 1 ? "s" : "", s->n_guests, s->mode, s->shards,
            s->retry ? "retry" : "dead_letter", s->txn ? ", relay.transactions = on" : "",
            s->duration_ms, s->n_faults);
    for (int i = 0; i < s->n_faults; i++)
        fprintf(out, "  at %5d ms  %-20s relay %d  for %d ms\n", s->f[i].at_ms,
                fault_names[s->f[i].kind], s->f[i].relay, s->f[i].dur_ms);
}

/* ---- what the writers committed ---- */

struct row {
    int64_t id;
    int topic;
    char *key; /* NULL = no key */
    bool payload_null;
    size_t payload_len;
    uint64_t hash;
    bool big; /* above message.max.bytes: must be dead-lettered */
    /* When its COMMIT was sent and answered (h_now_ms): a server stopped
     * between the two may have committed it, its answer read later. */
    int64_t commit_sent_ms, commit_ms;
};

struct rows {
    struct row *v;
    size_t n, cap;
};

static void rows_add(struct rows *rs, const struct row *r)
{
    if (rs->n == rs->cap) {
        rs->cap = rs->cap ? rs->cap * 2 : 1024;
        rs->v = realloc(rs->v, rs->cap * sizeof(*rs->v));
        if (!rs->v)
            fail_msg("out of memory");
    }
    rs->v[rs->n++] = *r;
}

static void rows_free(struct rows *rs)
{
    for (size_t i = 0; i < rs->n; i++)
        free(rs->v[i].key);
    free(rs->v);
    memset(rs, 0, sizeof(*rs));
}

static uint64_t fnv(const void *p, size_t n)
{
    const unsigned char *b = p;
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ULL;
    return h;
}

struct writer {
    pthread_t t;
    int w;
    const char *conninfo;
    struct rng r;
    atomic_int *stop;
    bool no_big; /* relay.on_reject = retry: a row above the limit would wait for ever */
    struct rows committed, uncertain, rolled_back;
    int transactions;
    unsigned char payload[MAX_MESSAGE_BYTES + 60000];
};

static bool exec_ok(PGconn *c, const char *sql)
{
    PGresult *r = PQexec(c, sql);
    bool ok = PQresultStatus(r) == PGRES_COMMAND_OK;
    PQclear(r);
    return ok;
}

/* Makes row content from the writer's generator and enqueues it. */
static bool enqueue(struct writer *wr, PGconn *c, const char *key, struct row *out)
{
    unsigned char *payload = wr->payload;
    char headers[256], keybuf[64];
    int kind = rnd_in(&wr->r, 0, 299);
    size_t len = (size_t)rnd_in(&wr->r, 0, 300);
    bool null_payload = kind < 15;
    out->big = kind == 299 && !wr->no_big;
    if (kind == 298)
        len = MAX_MESSAGE_BYTES - 10000; /* near the limit, still allowed */
    if (out->big)
        len = MAX_MESSAGE_BYTES + 50000;
    for (size_t i = 0; i < len; i++)
        payload[i] = (unsigned char)rnd(&wr->r); /* NUL bytes too */
    out->topic = rnd_in(&wr->r, 0, 2);
    if (!key) {
        int k = rnd_in(&wr->r, 0, 39);
        switch (k % 8) {
        case 0:
            key = NULL;
            break;
        case 1:
            snprintf(keybuf, sizeof(keybuf), "ключ-%d", k);
            key = keybuf;
            break;
        case 2:
            snprintf(keybuf, sizeof(keybuf), "キー-%d", k);
            key = keybuf;
            break;
        default:
            snprintf(keybuf, sizeof(keybuf), "k%d", k);
            key = keybuf;
        }
    }
    snprintf(headers, sizeof(headers),
             "{\"w\": \"%d\", \"uni\": \"ünïcødé ✓ %d\", \"n\": %d, \"traceparent\": "
             "\"00-%032x-%016x-01\"}",
             wr->w, kind, kind, (unsigned)rnd(&wr->r), (unsigned)kind + 1);
    const char *values[4] = {topics[out->topic], key, null_payload ? NULL : (char *)payload,
                             headers};
    int lengths[4] = {0, 0, (int)len, 0};
    int formats[4] = {0, 0, 1, 0};
    PGresult *r = PQexecParams(c, "SELECT outbox.enqueue($1, $2, $3::bytea, $4::jsonb)", 4, NULL,
                               values, lengths, formats, 0);
    bool ok = PQresultStatus(r) == PGRES_TUPLES_OK;
    if (ok) {
        out->id = strtoll(PQgetvalue(r, 0, 0), NULL, 10);
        out->key = key ? strdup(key) : NULL;
        out->payload_null = null_payload;
        out->payload_len = null_payload ? 0 : len;
        out->hash = null_payload ? 0 : fnv(payload, len);
    }
    PQclear(r);
    return ok;
}

static void *writer_main(void *arg)
{
    struct writer *wr = arg;
    PGconn *c = NULL;
    struct row pending[8];
    while (!atomic_load(wr->stop)) {
        if (!c || PQstatus(c) != CONNECTION_OK) {
            PQfinish(c);
            c = PQconnectdb(wr->conninfo);
            if (PQstatus(c) != CONNECTION_OK) {
                h_sleep_ms(50);
                continue;
            }
        }
        int action = rnd_in(&wr->r, 0, 99);
        int n = action < 75 ? 1 : rnd_in(&wr->r, 2, 6);
        bool rollback = action >= 85 && action < 93;
        bool late = action >= 93 && action < 97;
        char burst_key[32];
        snprintf(burst_key, sizeof(burst_key), "burst-%d", rnd_in(&wr->r, 0, 9));
        bool burst = action >= 75 && action < 85; /* same key, one transaction */
        if (!exec_ok(c, "BEGIN")) {
            h_sleep_ms(20);
            continue;
        }
        int k = 0;
        bool ok = true;
        for (; ok && k < n; k++)
            ok = enqueue(wr, c, burst ? burst_key : NULL, &pending[k]);
        if (!ok)
            k--; /* the failed one holds nothing */
        if (ok && late)
            h_sleep_ms(rnd_in(&wr->r, 1000, 3000)); /* a lower id becomes visible late */
        if (!ok || rollback) {
            exec_ok(c, "ROLLBACK");
            for (int i = 0; i < k; i++) {
                if (rollback && ok)
                    rows_add(&wr->rolled_back, &pending[i]);
                else
                    free(pending[i].key);
            }
        } else {
            int64_t sent = h_now_ms();
            PGresult *r = PQexec(c, "COMMIT");
            ExecStatusType st = PQresultStatus(r);
            PQclear(r);
            /* A COMMIT whose answer was lost may or may not have happened. */
            struct rows *to = st == PGRES_COMMAND_OK         ? &wr->committed
                              : PQstatus(c) == CONNECTION_OK ? &wr->rolled_back
                                                             : &wr->uncertain;
            int64_t now = h_now_ms();
            for (int i = 0; i < k; i++) {
                pending[i].commit_sent_ms = sent;
                pending[i].commit_ms = now;
                rows_add(to, &pending[i]);
            }
        }
        wr->transactions++;
        h_sleep_ms(rnd_in(&wr->r, 3, 15));
    }
    PQfinish(c);
    return NULL;
}

/* ---- relays ---- */

struct relay {
    struct h_env env; /* a copy of the environment with its own name and port */
    char app[24];
    char conninfo[700];
    bool alive, stopped;
    long fatal_exits; /* its log's "stopping after a fatal error" lines restarted for */
    /* Its session was cut while it was frozen: a zombie until this process
     * has noticed (expect_notice cleared) or is gone. */
    bool cut_frozen;
    int starts;
    /* G5, checked while the schedule runs: after its session was cut, a
     * running relay must say so (a disconnect line) within NOTICE_MS, or
     * have opened a new session since (it had none at the cut: just
     * restarted, seed 94433543). */
    bool expect_notice;
    long notices_at_cut, sessions_at_cut;
    int64_t notice_due;
};

#define NOTICE_MS 5000

struct run {
    struct schedule s;
    struct h_env env;
    struct relay relay[MAX_RELAYS + MAX_GUESTS];
    struct writer writers[WRITERS];
    atomic_int stop_writers;
    bool pg_down;
    /* pg-rewind: when its backup began, and when the server was stopped to
     * be restored to it (0: not done). Rows committed between may be gone. */
    int64_t backup_ms, rewind_ms;
    int rtt_ms;     /* latency an rtt fault set, 0 = none */
    bool slow_acks; /* the schedule has slow-acks: relays time records out */
    /* Windows the README names in which duplicates are expected. */
    bool zombie_window;      /* a relay frozen while its session ended, with another to take over */
    size_t dups_replicating; /* real Kafka: duplicates whose first copy no recovery pass saw */
    int node_of[MAX_FAULTS]; /* real Kafka: the node each fault hit (0: all, -1: none) */
    int nodes_hit;           /* real Kafka: node faults going on */
    bool node_down[4], node_paused[4]; /* real Kafka, by node id (1-3) */
    struct h_seq_stats seq;            /* the broker's sequence checks, at the end */
    long timed_out;                    /* relay log lines of records timed out (slow-acks; the
                                        * possibly-persisted ones are logged one a second) */
    int64_t timeline_t0;               /* when the faults' clock started */
    unsigned coordinator_waits;        /* drains given COORDINATOR_RETRY_MS more (0 or 1) */
    char findings[8][512];
    int n_findings;
    unsigned fault_counts[F_COUNT];
    unsigned fatal_restarts; /* relays that exited 1 after a fatal error, restarted */
    /* Figures of the check. */
    size_t committed, uncertain, rolled_back, dead, duplicates, records;
    size_t rewound; /* committed rows a pg-rewind took back */
};

static struct run run;

static void finding(struct run *x, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void finding(struct run *x, const char *fmt, ...)
{
    if (x->n_findings >= 8)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(x->findings[x->n_findings++], sizeof(x->findings[0]), fmt, ap);
    va_end(ap);
}

/* The sessions of relay i (or all, i < 0) were cut now. */
static void expect_notice(struct run *x, int i)
{
    for (int k = 0; k < relays_of(&x->s); k++) {
        struct relay *rl = &x->relay[k];
        if ((i >= 0 && k != i) || !rl->alive || rl->expect_notice)
            continue;
        rl->expect_notice = true;
        rl->notices_at_cut = h_relay_disconnects(&rl->env);
        rl->sessions_at_cut = h_relay_sessions(&rl->env);
        rl->notice_due = h_now_ms() + NOTICE_MS;
    }
}

/* Checks due expectations; a frozen relay, or one waiting for a Postgres
 * that is down, gets NOTICE_MS more once it can act again. */
static void check_notices(struct run *x)
{
    int64_t now = h_now_ms();
    for (int k = 0; k < relays_of(&x->s); k++) {
        struct relay *rl = &x->relay[k];
        if (!rl->expect_notice || now < rl->notice_due)
            continue;
        if (!rl->alive) {
            rl->expect_notice = false;
        } else if (rl->stopped || x->pg_down) {
            rl->notice_due = now + NOTICE_MS;
        } else if (h_relay_disconnects(&rl->env) > rl->notices_at_cut ||
                   h_relay_sessions(&rl->env) > rl->sessions_at_cut) {
            rl->expect_notice = false;
        } else {
            finding(x,
                    "relay %d never noticed that its Postgres session ended (%d ms ago, "
                    "running): stalled",
                    k, NOTICE_MS);
            rl->expect_notice = false;
        }
    }
}

static void relay_start(struct run *x, int i)
{
    struct relay *rl = &x->relay[i];
    char shutdown[48];
    snprintf(shutdown, sizeof(shutdown), "shutdown.timeout=%ds", SHUTDOWN_S);
    /* OBX_CHAOS_X="k=v;k=v": more -X for every relay (e.g. log.level=debug),
     * to look closer at a replayed finding. */
    static char extra[512];
    char mode[32], shards[32];
    snprintf(mode, sizeof(mode), "relay.on_sent=%s", x->s.mode);
    snprintf(shards, sizeof(shards), "relay.shards=%d", x->s.shards);
    const char *xargs[16] = {rl->conninfo,
                             x->s.retry ? "relay.on_reject=retry" : "relay.on_reject=dead_letter",
                             mode, shutdown, shards};
    int n = 5;
    if (opt_real) {
        /* The brokers refuse the rows above the topics' max.message.bytes
         * (REAL_TOPIC_LIMIT), not the producer, whose batches stay below
         * it; the recovery passes' high watermarks are logged (at debug
         * level) to tell the replication window's duplicates. */
        xargs[n++] = "kafka.message.max.bytes=1000000";
        xargs[n++] = "kafka.batch.size=" REAL_BATCH_BYTES;
        xargs[n++] = "log.level=debug";
    } else {
        xargs[n++] = "kafka.message.max.bytes=100000"; /* MAX_MESSAGE_BYTES */
    }
    /* A finite message timeout (issue 21.1): a record whose acknowledgement
     * comes later fails "possibly persisted"; its row holds its key until
     * the recovery pass has looked for it in Kafka. */
    if (x->s.txn) {
        xargs[n++] = "relay.transactions=on";
        xargs[n++] = "relay.transaction_rows=100"; /* many transactions, many windows */
    }
    if (x->slow_acks) {
        xargs[n++] = "kafka.message.timeout.ms=1500";
        xargs[n++] = "kafka.request.timeout.ms=1000";
    }
    snprintf(extra, sizeof(extra), "%s", getenv("OBX_CHAOS_X") ? getenv("OBX_CHAOS_X") : "");
    for (char *tok = strtok(extra, ";"); tok && n < 15; tok = strtok(NULL, ";"))
        xargs[n++] = tok;
    xargs[n] = NULL;
    h_relay_start(&rl->env, NULL, xargs);
    rl->alive = true;
    rl->stopped = false;
    rl->expect_notice = false;
    rl->cut_frozen = false;
    rl->starts++;
}

static void relay_wait_dead(struct relay *rl)
{
    h_relay_wait(&rl->env, 10000);
    rl->alive = false;
    rl->stopped = false;
    rl->cut_frozen = false; /* what it had queued died with it */
}

/* The relay holding the relay lock (the first by pid, when relays with
 * relay.shards share it), -1 if none (or Postgres is down). */
static int active_relay(struct run *x)
{
    if (x->pg_down)
        return -1;
    PGconn *c = PQconnectdb(x->env.conninfo);
    int found = -1;
    if (PQstatus(c) == CONNECTION_OK) {
        PGresult *r = PQexec(c, "SELECT a.application_name FROM pg_locks l"
                                " JOIN pg_stat_activity a ON a.pid = l.pid"
                                " WHERE l.locktype = 'advisory' AND l.granted"
                                "   AND l.classid = 1868724338 AND l.objid = 0"
                                " ORDER BY l.pid LIMIT 1");
        for (int k = 0;
             PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1 && k < relays_of(&x->s); k++)
            if (strcmp(PQgetvalue(r, 0, 0), x->relay[k].app) == 0)
                found = k;
        PQclear(r);
    }
    PQfinish(c);
    return found;
}

static int terminate_sessions(struct run *x, const char *app)
{
    if (x->pg_down)
        return 0;
    PGconn *c = PQconnectdb(x->env.conninfo);
    int n = 0;
    if (PQstatus(c) == CONNECTION_OK) {
        char sql[256];
        snprintf(sql, sizeof(sql),
                 "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                 " WHERE application_name = '%s'",
                 app);
        PGresult *r = PQexec(c, sql);
        if (PQresultStatus(r) == PGRES_TUPLES_OK)
            n = atoi(PQgetvalue(r, 0, 0));
        PQclear(r);
    }
    PQfinish(c);
    return n;
}

/* A session of a relay ended: if it was frozen and another relay can take
 * over, the frozen one becomes a zombie when it goes on. Another relay: one
 * the schedule started with (dead ones are restarted), or a guest there
 * now; a guest that joins later opens the window then (F_JOIN). */
static void session_cut(struct run *x, int i)
{
    for (int k = 0; k < relays_of(&x->s); k++) {
        if (!x->relay[k].stopped || (i >= 0 && k != i))
            continue;
        x->relay[k].cut_frozen = true;
        bool other = x->s.n_relays > 1;
        for (int g = x->s.n_relays; g < relays_of(&x->s); g++)
            other = other || (g != k && x->relay[g].alive);
        if (other)
            x->zombie_window = true;
    }
}

/* The supervisor outboxd is run under (systemd, Kubernetes, a compose
 * restart policy): a relay that ends by itself after a fatal producer error
 * (an out-of-order sequence from the broker) exits 1 for it to be started
 * again, and the next start's recovery pass keeps that free of duplicates
 * (doc/operations.md, exit status). Chaos restarts such a relay and counts
 * it; any other exit of its own is a finding (and it is restarted too, so
 * the rest of the schedule is still checked). */
static void supervise(struct run *x)
{
    for (int i = 0; i < relays_of(&x->s); i++) {
        struct relay *rl = &x->relay[i];
        int status;
        if (!rl->alive || rl->env.relay_pid <= 0 ||
            waitpid(rl->env.relay_pid, &status, WNOHANG) != rl->env.relay_pid)
            continue;
        rl->env.relay_pid = 0;
        rl->alive = false;
        rl->stopped = false;
        rl->cut_frozen = false;
        long fatal = h_relay_log_count(&rl->env, "stopping after a fatal error");
        if (WIFEXITED(status) && WEXITSTATUS(status) == 1 && fatal > rl->fatal_exits) {
            rl->fatal_exits = fatal;
            x->fatal_restarts++;
        } else {
            finding(x, "relay %d ended by itself (%s %d)", i, WIFEXITED(status) ? "exit" : "signal",
                    WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
        }
        relay_start(x, i);
    }
}

/* Before a signal: a signal that comes before the process reaches main()
 * (the loader still mapping libraries) kills any program, so wait for this
 * start's first line, as a supervisor's signal would come after its start
 * (chaos_bounded seed 79381173: exit 129 72 ms after a restart). By its
 * words, not its event: chaos also runs older binaries (OBX_RELAY_BINARY). */
static void wait_started(struct relay *rl)
{
    int64_t wait_until = h_now_ms() + 5000;
    while (h_relay_log_count(&rl->env, "starting: batch") < rl->starts && h_now_ms() < wait_until)
        h_sleep_ms(10);
}

/* SIGTERM to relay i, which must stop within its shutdown.timeout. */
static void relay_sigterm(struct run *x, int i, const char *when)
{
    struct relay *rl = &x->relay[i];
    wait_started(rl);
    int64_t t0 = h_now_ms();
    int rc = h_relay_stop(&rl->env, SIGTERM, (SHUTDOWN_S + 3) * 1000);
    rl->alive = false;
    if (rc != 0)
        finding(x, "relay %d: SIGTERM%s gave exit %d after %lld ms", i, when, rc,
                (long long)(h_now_ms() - t0));
}

/* The node a real cluster's fault hits: in half the draws the leader of
 * chaos.c's one partition (a third of the rows), else one by the draw; the
 * choice is the schedule's, the leader the cluster's at that moment. */
static int target_node(struct run *x, const struct fault *f)
{
    if (f->at_ms % 2 == 0) {
        long leader = -1; /* none while nodes are down: then the drawn one */
        if (h_broker_number(&x->env, &leader, "leader chaos.c 0") && leader > 0)
            return (int)leader;
    }
    return 1 + (f->at_ms / 7 + f->relay) % 3;
}

/* A real cluster's node command that must succeed (starting a node waits
 * until it is in the metadata). */
static void node_cmd(struct run *x, const char *cmd, int node)
{
    char which[16];
    snprintf(which, sizeof(which), node > 0 ? "%d" : "all", node);
    bool down = strcmp(cmd, "kill") == 0 || strcmp(cmd, "stop") == 0;
    bool up = strcmp(cmd, "start") == 0, pause = strcmp(cmd, "pause") == 0;
    bool cont = strcmp(cmd, "cont") == 0;
    for (int id = 1; id <= 3; id++) {
        if (node > 0 && id != node)
            continue;
        if (down || up)
            x->node_down[id] = down;
        if (down || cont || (pause && !x->node_down[id]))
            x->node_paused[id] = pause;
    }
    if (!h_broker_cmd(&x->env, "%s %s", cmd, which))
        finding(x, "the cluster did not do \"%s %s\"", cmd, which);
}

/* Ends a node's fault: starts it again. A start waits until the running
 * nodes are in the metadata, which takes the controllers' quorum (2 of 3
 * running and not paused): when the node alone would not make one (the
 * others killed or paused by overlapping faults), every node is continued
 * and started, as an operator would bring the cluster back, rather than
 * wait 90 s for a quorum that cannot form. */
static void node_start(struct run *x, int node)
{
    int active = 0;
    for (int id = 1; id <= 3; id++)
        active += !x->node_paused[id] && (id == node || !x->node_down[id]);
    if (active >= 2) {
        node_cmd(x, "start", node);
        return;
    }
    node_cmd(x, "cont", 0);
    node_cmd(x, "start", 0);
}

/* One step of the timeline: phase 0 starts a fault, phase 1 ends it. */
static void apply(struct run *x, const struct fault *f, int phase)
{
    struct relay *rl = &x->relay[f->relay];
    struct h_env *e = &x->env;
    if (phase == 0)
        x->fault_counts[f->kind]++;
    switch (f->kind) {
    case F_KILL9:
        if (phase == 0 && rl->alive) {
            kill(rl->env.relay_pid, SIGKILL);
            relay_wait_dead(rl);
        } else if (phase == 1 && !rl->alive) {
            relay_start(x, f->relay);
        }
        break;
    case F_SIGTERM:
        if (phase == 0 && rl->alive && !rl->stopped)
            relay_sigterm(x, f->relay, "");
        else if (phase == 1 && !rl->alive)
            relay_start(x, f->relay);
        break;
    case F_JOIN:
    case F_JOIN_CRASH:
        /* A guest of its own: nothing else starts or stops it, but a
         * takeover may have killed and restarted it if it held the lock. */
        if (phase == 0 && !rl->alive) {
            /* Its port now: one found free at the schedule's start may
             * have gone to another socket since. */
            rl->env.http_port = h_free_port();
            relay_start(x, f->relay);
            for (int k = 0; k < relays_of(&x->s); k++) {
                struct relay *z = &x->relay[k];
                if (z->cut_frozen && (z->stopped || z->expect_notice))
                    x->zombie_window = true; /* it may take the zombie's place */
            }
        } else if (phase == 1 && rl->alive && !rl->stopped) {
            if (f->kind == F_JOIN) {
                relay_sigterm(x, f->relay, "");
            } else {
                kill(rl->env.relay_pid, SIGKILL);
                relay_wait_dead(rl);
            }
        }
        break;
    case F_STOP:
    case F_FREEZE_CUT:
        if (phase == 0 && rl->alive && !rl->stopped) {
            kill(rl->env.relay_pid, SIGSTOP);
            rl->stopped = true;
            if (f->kind == F_FREEZE_CUT) {
                h_sleep_ms(100);
                expect_notice(x, f->relay);
                if (terminate_sessions(x, rl->app) > 0)
                    session_cut(x, f->relay);
                else
                    rl->expect_notice = false;
            }
        } else if (phase == 1 && rl->alive && rl->stopped) {
            kill(rl->env.relay_pid, SIGCONT);
            rl->stopped = false;
        }
        break;
    case F_TERMINATE:
        if (phase == 0) {
            expect_notice(x, f->relay); /* counted before the cut: the line may come at once */
            if (terminate_sessions(x, rl->app) > 0)
                session_cut(x, f->relay);
            else
                rl->expect_notice = false;
        }
        break;
    case F_PG_FAST:
    case F_PG_IMMEDIATE:
        if (phase == 0 && !x->pg_down) {
            expect_notice(x, -1);
            h_pg_restart(e, f->kind == F_PG_FAST ? "fast" : "immediate");
            session_cut(x, -1);
        }
        break;
    case F_PG_DOWN:
        if (phase == 0 && !x->pg_down) {
            expect_notice(x, -1);
            h_pg_stop(e);
            x->pg_down = true;
            session_cut(x, -1);
        } else if (phase == 1 && x->pg_down) {
            h_pg_start(e);
            x->pg_down = false;
        }
        break;
    case F_BROKERS_DOWN:
    case F_BROKER_DOWN:
        if (phase == 0) {
            if (f->kind == F_BROKERS_DOWN)
                h_broker_cmd(e, "down all");
            else
                h_broker_cmd(e, "down %d", 1 + f->relay % 3);
        } else {
            h_broker_cmd(e, "up all");
        }
        break;
    case F_PRODUCE_ERRORS:
        if (phase == 0)
            h_broker_cmd(e, "push-errors 0 NOT_LEADER_FOR_PARTITION LEADER_NOT_AVAILABLE "
                            "NOT_ENOUGH_REPLICAS");
        break;
    case F_REJECT_ERRORS:
        if (phase == 0)
            h_broker_cmd(e, "push-errors 0 MSG_SIZE_TOO_LARGE");
        break;
    case F_TOPIC_REFUSED:
        if (phase == 0)
            h_broker_cmd(e, "push-errors 0 TOPIC_AUTHORIZATION_FAILED TOPIC_AUTHORIZATION_FAILED");
        break;
    case F_RTT:
        x->rtt_ms = phase == 0 ? f->dur_ms / 4 : 0;
        h_broker_cmd(e, "rtt all %d", x->rtt_ms);
        break;
    case F_SIGHUP:
        if (phase == 0 && rl->alive && !rl->stopped) {
            wait_started(rl);
            kill(rl->env.relay_pid, SIGHUP);
        }
        break;
    case F_SLOW_ACKS: {
        /* One broker or all, by the draw; the rtt fault's latency after. */
        int broker = f->at_ms % 2 ? 1 + f->relay % 3 : -1;
        char which[8];
        snprintf(which, sizeof(which), broker < 0 ? "all" : "%d", broker);
        h_broker_cmd(e, "rtt %s %d", which, phase == 0 ? 1700 + f->dur_ms % 2300 : x->rtt_ms);
        break;
    }
    case F_TAKEOVER: {
        /* Whoever is active, not the drawn relay: a takeover needs one. */
        int a = active_relay(x);
        if (a < 0 || x->relay[a].stopped)
            break;
        struct relay *act = &x->relay[a];
        if (phase == 0) {
            expect_notice(x, a);
            if (terminate_sessions(x, act->app) > 0)
                session_cut(x, a);
            else
                act->expect_notice = false;
        } else {
            /* Killed while acknowledgements lag: records it sent are in
             * Kafka, not yet marked, for the next holder to find. */
            if (!opt_real) /* a real cluster's acknowledgements lag by themselves */
                h_broker_cmd(e, "rtt all %d", x->rtt_ms > 250 ? x->rtt_ms : 250);
            h_sleep_ms(400);
            kill(act->env.relay_pid, SIGKILL);
            relay_wait_dead(act);
            if (!opt_real)
                h_broker_cmd(e, "rtt all %d", x->rtt_ms);
            relay_start(x, a);
        }
        break;
    }
    case F_NODE_KILL9:
    case F_NODE_PAUSE:
    case F_LEADER_MOVE:
        /* The node hit at phase 0 is the one phase 1 brings back. A clean
         * stop needs the controllers' quorum: with another node down or
         * paused it could wait for a minute, so it is left out then. */
        if (phase == 0) {
            bool skip = f->kind == F_LEADER_MOVE && x->nodes_hit > 0;
            x->node_of[f - x->s.f] = skip ? -1 : target_node(x, f);
            if (skip) {
                x->fault_counts[f->kind]--; /* not done: not counted */
                break;
            }
            x->nodes_hit++;
            node_cmd(x,
                     f->kind == F_NODE_KILL9   ? "kill"
                     : f->kind == F_NODE_PAUSE ? "pause"
                                               : "stop",
                     x->node_of[f - x->s.f]);
        } else if (x->node_of[f - x->s.f] > 0) {
            x->nodes_hit--;
            if (f->kind == F_NODE_PAUSE)
                node_cmd(x, "cont", x->node_of[f - x->s.f]);
            else
                node_start(x, x->node_of[f - x->s.f]);
        }
        break;
    case F_NODES_KILL9:
        x->nodes_hit += phase == 0 ? 1 : -1;
        if (phase == 1)
            node_cmd(x, "cont", 0); /* a node paused since would keep the quorum away */
        node_cmd(x, phase == 0 ? "kill" : "start", 0);
        break;
    case F_CUT:
    case F_BLACKHOLE:
        /* One node, or every node in a quarter of the draws. */
        if (phase == 0)
            x->node_of[f - x->s.f] = f->dur_ms % 4 == 0 ? 0 : target_node(x, f);
        node_cmd(x,
                 phase == 1         ? "heal"
                 : f->kind == F_CUT ? "cut"
                                    : "blackhole",
                 x->node_of[f - x->s.f]);
        break;
    case F_PG_REWIND:
        /* Counted when the restore is done. Neither step while another
         * fault keeps Postgres down (that one starts it again). */
        if (phase == 0) {
            x->fault_counts[f->kind]--;
            int64_t t = h_now_ms();
            if (!x->pg_down && h_pg_backup(e) == 0)
                x->backup_ms = t;
        } else if (x->backup_ms && !x->pg_down) {
            expect_notice(x, -1);
            if (h_pg_rewind(e) != 0)
                fail_msg("pg-rewind: the backup is gone");
            /* After the old server stopped: a COMMIT sent just before it
             * may still have been answered. Rows committed since are the
             * new history's, and the restored server holds them. */
            x->rewind_ms = h_now_ms();
            session_cut(x, -1);
            x->fault_counts[f->kind]++;
        }
        break;
    case F_COUNT:
        break;
    }
}

struct step {
    int t;
    int fault;
    int phase;
};

static int cmp_step(const void *a, const void *b)
{
    const struct step *x = a, *y = b;
    return x->t != y->t ? (x->t < y->t ? -1 : 1) : (x->phase - y->phase);
}

/* ---- the picture's data (OBX_CHAOS_PLOT=DIR) ---- */

/* With OBX_CHAOS_PLOT set, the driver writes DIR/faults.dat (a line per
 * fault: start and end in seconds since the driver started, kind number,
 * kind name), DIR/schedules.dat (start, end, seed, 1 if it had findings)
 * and DIR/behind.dat (seconds, committed rows not yet published, sampled
 * twice a second); scripts/chaos-plot.gp draws them. */
static FILE *plot_faults, *plot_schedules, *plot_behind;
static int64_t plot_t0;
static int64_t plot_next_sample;

static void plot_open(void)
{
    const char *dir = getenv("OBX_CHAOS_PLOT");
    char path[512];
    if (!dir || !*dir)
        return;
    plot_t0 = h_now_ms();
    snprintf(path, sizeof(path), "%s/faults.dat", dir);
    plot_faults = fopen(path, "w");
    snprintf(path, sizeof(path), "%s/schedules.dat", dir);
    plot_schedules = fopen(path, "w");
    snprintf(path, sizeof(path), "%s/behind.dat", dir);
    plot_behind = fopen(path, "w");
    if (!plot_faults || !plot_schedules || !plot_behind)
        fail_msg("OBX_CHAOS_PLOT: cannot write in %s: %s", dir, strerror(errno));
}

static double plot_time(int64_t ms)
{
    return (double)(ms - plot_t0) / 1000.0;
}

/* Rows committed and not yet published, twice a second (nothing while
 * Postgres is down). */
static void plot_sample(struct run *x)
{
    int64_t now = h_now_ms();
    if (!plot_behind || x->pg_down || now < plot_next_sample)
        return;
    plot_next_sample = now + 500;
    PGconn *c = PQconnectdb(x->env.conninfo);
    if (PQstatus(c) == CONNECTION_OK) {
        PGresult *r = PQexec(c, "SELECT count(*) FROM outbox.unpublished"); /* any mode */
        if (PQresultStatus(r) == PGRES_TUPLES_OK)
            fprintf(plot_behind, "%.2f %s\n", plot_time(now), PQgetvalue(r, 0, 0));
        PQclear(r);
    }
    PQfinish(c);
}

static void plot_schedule(const struct run *x, int64_t start)
{
    if (!plot_faults)
        return;
    for (int i = 0; i < x->s.n_faults; i++) {
        const struct fault *f = &x->s.f[i];
        int64_t at = x->timeline_t0 + f->at_ms;
        fprintf(plot_faults, "%.2f %.2f %d %s\n", plot_time(at), plot_time(at + f->dur_ms),
                (int)f->kind, fault_names[f->kind]);
    }
    fprintf(plot_schedules, "%.2f %.2f %llu %d\n", plot_time(start), plot_time(h_now_ms()),
            (unsigned long long)x->s.seed, x->n_findings > 0);
    fflush(plot_faults);
    fflush(plot_schedules);
    fflush(plot_behind);
}

static void run_timeline(struct run *x)
{
    struct step steps[2 * MAX_FAULTS];
    int n = 0;
    for (int i = 0; i < x->s.n_faults; i++) {
        steps[n++] = (struct step){x->s.f[i].at_ms, i, 0};
        steps[n++] = (struct step){x->s.f[i].at_ms + x->s.f[i].dur_ms, i, 1};
    }
    qsort(steps, (size_t)n, sizeof(steps[0]), cmp_step);
    int64_t t0 = h_now_ms();
    x->timeline_t0 = t0;
    for (int i = 0; i <= n; i++) {
        int64_t at = t0 + (i < n ? steps[i].t : x->s.duration_ms);
        while (h_now_ms() < at) {
            supervise(x);
            check_notices(x);
            plot_sample(x);
            int64_t left = at - h_now_ms();
            h_sleep_ms(left > 100 ? 100 : (int)(left > 0 ? left : 0));
        }
        if (i < n)
            apply(x, &x->s.f[steps[i].fault], steps[i].phase);
    }
}

/* Ends every fault: each relay the schedule started with runs, Postgres and
 * brokers are up. A guest still there goes on running; one gone stays gone. */
static void heal(struct run *x)
{
    struct h_env *e = &x->env;
    supervise(x);
    if (x->pg_down) {
        h_pg_start(e);
        x->pg_down = false;
    }
    if (opt_real) {
        node_cmd(x, "cont", 0);
        node_cmd(x, "start", 0);
        node_cmd(x, "heal", 0);
    } else {
        h_broker_cmd(e, "up all");
        h_broker_cmd(e, "rtt all 0");
        h_broker_cmd(e, "clear-errors 0");
    }
    for (int i = 0; i < relays_of(&x->s); i++) {
        struct relay *rl = &x->relay[i];
        if (rl->alive && rl->stopped) {
            kill(rl->env.relay_pid, SIGCONT);
            rl->stopped = false;
        }
        if (!rl->alive && i < x->s.n_relays)
            relay_start(x, i);
    }
}

/* ---- the checker ---- */

static PGresult *query(PGconn *c, const char *sql)
{
    PGresult *r = PQexec(c, sql);
    if (PQresultStatus(r) != PGRES_TUPLES_OK)
        fail_msg("checker query failed: %s\n  %s", PQresultErrorMessage(r), sql);
    return r;
}

static bool drained(struct run *x)
{
    PGconn *c = PQconnectdb(x->env.conninfo);
    bool done = false;
    if (PQstatus(c) == CONNECTION_OK) {
        PGresult *r = query(c, "SELECT count(*) FROM outbox.unpublished"); /* any mode */
        done = atoll(PQgetvalue(r, 0, 0)) == 0;
        PQclear(r);
    }
    PQfinish(c);
    return done;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

static bool in_sorted(const int64_t *v, size_t n, int64_t id)
{
    return bsearch(&id, v, n, sizeof(*v), cmp_i64) != NULL;
}

static int cmp_rec(const void *a, const void *b)
{
    const struct h_record *x = *(const struct h_record *const *)a;
    const struct h_record *y = *(const struct h_record *const *)b;
    if (x->outbox_id != y->outbox_id)
        return x->outbox_id < y->outbox_id ? -1 : 1;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

static int cmp_row(const void *a, const void *b)
{
    const struct row *x = a, *y = b;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* Ids of a one-column query, sorted. */
static int64_t *ids_of(PGconn *c, const char *sql, size_t *n)
{
    PGresult *r = query(c, sql);
    *n = (size_t)PQntuples(r);
    int64_t *v = malloc((*n + 1) * sizeof(*v));
    for (size_t i = 0; i < *n; i++)
        v[i] = atoll(PQgetvalue(r, (int)i, 0));
    PQclear(r);
    qsort(v, *n, sizeof(*v), cmp_i64);
    return v;
}

/* Whether row w is stored under its id: 1 with the same content (in
 * outbox.events or outbox.dead_letters), 0 if that id holds another row,
 * -1 if no row has it. */
static int stored_in(PGconn *c, const struct row *w, const char *sql)
{
    char id[24];
    snprintf(id, sizeof(id), "%lld", (long long)w->id);
    const char *values[1] = {id};
    PGresult *r = PQexecParams(c, sql, 1, NULL, values, NULL, NULL, 1);
    if (PQresultStatus(r) != PGRES_TUPLES_OK)
        fail_msg("checker query failed: %s", PQresultErrorMessage(r));
    int result = PQntuples(r) == 0 ? -1 : 0;
    if (result == 0) {
        bool key_null = PQgetisnull(r, 0, 1), payload_null = PQgetisnull(r, 0, 2);
        size_t klen = (size_t)PQgetlength(r, 0, 1), plen = (size_t)PQgetlength(r, 0, 2);
        bool same =
            strcmp(PQgetvalue(r, 0, 0), topics[w->topic]) == 0 && key_null == (w->key == NULL) &&
            (key_null ||
             (klen == strlen(w->key) && memcmp(PQgetvalue(r, 0, 1), w->key, klen) == 0)) &&
            payload_null == w->payload_null &&
            (payload_null || (plen == w->payload_len && fnv(PQgetvalue(r, 0, 2), plen) == w->hash));
        result = same ? 1 : 0;
    }
    PQclear(r);
    return result;
}

static int stored_as(PGconn *c, const struct row *w)
{
    return stored_in(c, w,
                     "SELECT topic, key, payload FROM outbox.events WHERE id = $1"
                     " UNION ALL"
                     " SELECT topic, key, payload FROM outbox.dead_letters WHERE id = $1");
}

/* After a pg-rewind: whether the server holds the row's commit, by the
 * copy the checker's trigger wrote in its transaction (harness.c), which
 * the restore took back with it and a new row of its id replaced. */
static bool survived(PGconn *c, const struct row *w)
{
    return stored_in(c, w, "SELECT topic, key, payload FROM obx_test.committed WHERE id = $1") == 1;
}

/* A row whose COMMIT may have been taken back by a pg-rewind: answered
 * after the backup began, or not answered, and sent before the restored
 * server took writes. */
static bool in_rewind(const struct run *x, const struct row *w)
{
    return x->rewind_ms && w->commit_ms >= x->backup_ms && w->commit_sent_ms <= x->rewind_ms;
}

/* A row whose COMMIT's outcome is unknown (sorted by id). */
static bool maybe_committed(const struct rows *maybe, int64_t id)
{
    struct row key = {.id = id};
    return maybe->n > 0 && bsearch(&key, maybe->v, maybe->n, sizeof(*maybe->v), cmp_row) != NULL;
}

static bool same_content(const struct row *w, const struct h_record *k)
{
    if (strcmp(k->topic, topics[w->topic]) != 0)
        return false;
    if ((w->key == NULL) != (k->key == NULL) ||
        (w->key && (strlen(w->key) != k->key_len || memcmp(w->key, k->key, k->key_len) != 0)))
        return false;
    if (w->payload_null != (k->value == NULL))
        return false;
    return w->payload_null ||
           (k->value_len == w->payload_len && fnv(k->value, k->value_len) == w->hash);
}

/* The slot (relay.shards) of a written row, as the relays compute it; -1
 * without shards or if Postgres cannot say. */
static int row_slot(PGconn *c, const struct row *w, int shards)
{
    if (shards < 2)
        return -1;
    char id[24], n[12];
    snprintf(id, sizeof(id), "%lld", (long long)w->id);
    snprintf(n, sizeof(n), "%d", shards);
    const char *params[3] = {w->key, id, n};
    PGresult *r = PQexecParams(c, "SELECT outbox.slot_of($1, $2::bigint, $3::integer)", 3, NULL,
                               params, NULL, NULL, 0);
    int slot =
        PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1 ? atoi(PQgetvalue(r, 0, 0)) : -1;
    PQclear(r);
    return slot;
}

/* Real Kafka's replication window (doc/guarantees.md): a copy published
 * again after a copy that the leader had appended (LogAppendTime) but that
 * lay at or above the high watermark of the last recovery pass before the
 * next copy was appended: the pass could not see it yet. Only the passes
 * of a relay that held the row's slot count (slot -1: any relay's, since
 * without shards only the lock's holder makes passes): another relay's
 * pass ignores the row whatever it read. A copy still queued in a
 * producer at that pass is not excused: its append time is after the
 * pass. */
static bool replicating(struct run *x, const struct h_record *first, const struct h_record *again,
                        int slot)
{
    /* A keyed row's copies share a partition; a keyless one's second copy
     * goes wherever the partitioner sends it, and what counts is whether
     * the pass could see the first in its own. */
    if (!opt_real || (first->key && first->partition != again->partition) ||
        strcmp(first->topic, again->topic))
        return false;
    int64_t latest = -1, hw = -1;
    for (int i = 0; i < relays_of(&x->s); i++) {
        int64_t at = -1;
        int64_t h = h_recovery_high_watermark(&x->relay[i].env, first->topic, first->partition,
                                              first->timestamp, again->timestamp, true, slot, &at);
        if (h >= 0 && at > latest) {
            latest = at;
            hw = h;
        }
    }
    return hw >= 0 && hw <= first->offset;
}

/* What a real cluster's unexcused duplicate looked like: both copies and
 * each relay's last recovery pass between them, for the one who looks. */
static void explain_duplicate(struct run *x, const struct h_record *a, const struct h_record *b,
                              int slot)
{
    fprintf(stderr,
            "  duplicate: id %lld (slot %d) in %s [%d] at %lld (appended %lld) and [%d] at %lld "
            "(%lld)\n",
            (long long)a->outbox_id, slot, a->topic, a->partition, (long long)a->offset,
            (long long)a->timestamp, b->partition, (long long)b->offset, (long long)b->timestamp);
    for (int i = 0; i < relays_of(&x->s); i++) {
        int64_t at = -1, first_at = -1;
        int64_t last =
            h_recovery_high_watermark(&x->relay[i].env, a->topic, a->partition,
                                      a->timestamp - 60000, b->timestamp, true, slot, &at);
        int64_t first =
            h_recovery_high_watermark(&x->relay[i].env, a->topic, a->partition,
                                      a->timestamp - 60000, b->timestamp, false, slot, &first_at);
        fprintf(stderr,
                "    relay %d: passes before the second copy: first at %lld to %lld, last at %lld "
                "to %lld\n",
                i, (long long)first_at, (long long)first, (long long)at, (long long)last);
    }
}

static void check(struct run *x)
{
    struct rows all = {0};
    for (int i = 0; i < WRITERS; i++) {
        struct writer *w = &x->writers[i];
        for (size_t k = 0; k < w->committed.n; k++)
            rows_add(&all, &w->committed.v[k]);
        x->committed += w->committed.n;
        x->uncertain += w->uncertain.n;
        x->rolled_back += w->rolled_back.n;
    }
    PGconn *c = h_connect(&x->env);
    size_t n_dead;
    int64_t *dead = ids_of(c, "SELECT id FROM outbox.dead_letters", &n_dead);
    x->dead = n_dead;
    /* An uncertain commit (its COMMIT's answer was lost) happened if a row
     * with its id AND its content is stored (unsent or sent, or
     * dead-lettered). The id alone proves nothing: after an immediate
     * restart Postgres may hand out again the identity values of a
     * transaction that never committed (found by chaos seed 7212). In
     * delete mode an absent row may have been published and deleted: it
     * may be in Kafka at most once, unless its id is another committed
     * row's. */
    if (all.n)
        qsort(all.v, all.n, sizeof(*all.v), cmp_row);
    /* pg-rewind: a row committed between the backup and the restore may be
     * gone with the history that held it (its id handed out again since).
     * One the restored server holds is checked as any other; a gone one
     * may be in Kafka, at most once (see in_rewind, survived). */
    struct rows rewound = {0};
    if (x->rewind_ms) {
        size_t keep = 0;
        for (size_t i = 0; i < all.n; i++) {
            const struct row *w = &all.v[i];
            if (in_rewind(x, w) && !survived(c, w))
                rows_add(&rewound, w);
            else
                all.v[keep++] = *w;
        }
        all.n = keep;
    }
    size_t n_definite = all.n;
    struct rows maybe = {0};
    for (int i = 0; i < WRITERS; i++)
        for (size_t k = 0; k < x->writers[i].uncertain.n; k++) {
            struct row *u = &x->writers[i].uncertain.v[k];
            if (in_rewind(x, u)) {
                /* Its id may be a new row's now: held or not, as above. */
                rows_add(survived(c, u) ? &all : &rewound, u);
                continue;
            }
            int stored = stored_as(c, u);
            struct row key = {.id = u->id};
            bool id_taken =
                n_definite > 0 && bsearch(&key, all.v, n_definite, sizeof(*all.v), cmp_row);
            if (stored == 1)
                rows_add(&all, u);
            else if (stored == -1 && !id_taken)
                rows_add(&maybe, u);
        }
    if (all.n)
        qsort(all.v, all.n, sizeof(*all.v), cmp_row);
    if (maybe.n)
        qsort(maybe.v, maybe.n, sizeof(*maybe.v), cmp_row);
    if (rewound.n)
        qsort(rewound.v, rewound.n, sizeof(*rewound.v), cmp_row);
    x->rewound = rewound.n;

    struct h_records recs = {0};
    h_kafka_read_all(&x->env, topics, &recs);
    x->records = recs.n;
    const struct h_record **byid = malloc((recs.n + 1) * sizeof(*byid));
    for (size_t i = 0; i < recs.n; i++)
        byid[i] = &recs.v[i];
    if (recs.n)
        qsort(byid, recs.n, sizeof(*byid), cmp_rec);

    size_t lost = 0, phantom = 0, corrupt = 0, order = 0, dups = 0, collateral = 0;
    size_t dead_under_retry = 0;
    int64_t ex_lost = -1, ex_phantom = -1, ex_dup = -1;
    /* The records of rewound rows leave byid here: each such row at most
     * once, as a duplicate of any other row would be counted. */
    size_t n_recs = recs.n;
    if (rewound.n) {
        const struct h_record **first = calloc(rewound.n, sizeof(*first));
        if (!first)
            fail_msg("out of memory");
        n_recs = 0;
        for (size_t i = 0; i < recs.n; i++) {
            const struct h_record *b = byid[i];
            struct row key = {.id = b->outbox_id};
            const struct row *w = bsearch(&key, rewound.v, rewound.n, sizeof(*rewound.v), cmp_row);
            if (!w || !same_content(w, b)) {
                byid[n_recs++] = b;
                continue;
            }
            const struct h_record **a = &first[w - rewound.v];
            if (!*a) {
                *a = b;
            } else if (!x->s.txn && replicating(x, *a, b, -1)) {
                x->dups_replicating++;
            } else {
                dups++;
                ex_dup = w->id;
            }
        }
        free(first);
    }
    char ex_corrupt[200] = "", ex_collateral[120] = "";
    int rejects = 0;
    for (int i = 0; i < x->s.n_faults; i++)
        rejects += x->s.f[i].kind == F_REJECT_ERRORS;
    /* A topic refused under dead_letter sends its batch's rows there. */
    bool topic_refused = false;
    for (int i = 0; i < x->s.n_faults; i++)
        topic_refused = topic_refused || x->s.f[i].kind == F_TOPIC_REFUSED;
    size_t k = 0;
    for (size_t i = 0; i < all.n; i++) {
        const struct row *w = &all.v[i];
        while (k < n_recs && byid[k]->outbox_id < w->id) {
            if (!maybe_committed(&maybe, byid[k]->outbox_id)) {
                phantom++;
                ex_phantom = byid[k]->outbox_id;
            }
            k++;
        }
        size_t copies = 0, first = k;
        for (; k < n_recs && byid[k]->outbox_id == w->id; k++, copies++)
            if (!same_content(w, byid[k]) && corrupt++ == 0)
                snprintf(ex_corrupt, sizeof(ex_corrupt),
                         "id %lld: topic %s/%s, key %s/%.*s, %zu/%zu bytes", (long long)w->id,
                         topics[w->topic], byid[k]->topic, w->key ? w->key : "(null)",
                         byid[k]->key ? (int)byid[k]->key_len : 6,
                         byid[k]->key ? byid[k]->key : "(null)", w->payload_len,
                         byid[k]->value_len);
        bool is_dead = in_sorted(dead, n_dead, w->id);
        if (copies == 0 && !is_dead) {
            if (lost < 20)
                fprintf(stderr, "  lost: id %lld, topic %s, key %s, %zu bytes\n", (long long)w->id,
                        topics[w->topic], w->key ? w->key : "(null)", w->payload_len);
            lost++;
            ex_lost = w->id;
        } else if (copies == 0 && x->s.retry && dead_under_retry++ == 0) {
            snprintf(ex_collateral, sizeof(ex_collateral),
                     "id %lld: dead-lettered under relay.on_reject = retry", (long long)w->id);
        } else if (copies == 0 && !w->big && rejects < 2 && !topic_refused && collateral++ == 0) {
            /* A refused batch costs only the rows refused alone too; one
             * injected refusal cannot refuse a row twice. */
            snprintf(ex_collateral, sizeof(ex_collateral),
                     "id %lld: dead-lettered although within message.max.bytes", (long long)w->id);
        } else if (copies > 0 && (is_dead || w->big) && corrupt++ == 0) {
            /* published and dead-lettered, or published above the size limit */
            snprintf(ex_corrupt, sizeof(ex_corrupt), "id %lld: published and %s", (long long)w->id,
                     is_dead ? "dead-lettered" : "above message.max.bytes");
        }
        int slot = copies > 1 && opt_real ? row_slot(c, w, x->s.shards) : -1;
        for (size_t n = first; n + 1 < first + copies; n++) {
            /* Copies in one partition are in offset order; a keyless row's
             * copy in another partition goes by its append time
             * (LogAppendTime on these topics). */
            const struct h_record *a = byid[n], *b = byid[n + 1];
            if (a->partition != b->partition && b->timestamp < a->timestamp) {
                a = byid[n + 1];
                b = byid[n];
            }
            if (!x->s.txn && replicating(x, a, b, slot)) {
                x->dups_replicating++;
            } else {
                if (opt_real && dups < 5)
                    explain_duplicate(x, a, b, slot);
                dups++;
                ex_dup = w->id;
            }
        }
    }
    for (; k < n_recs; k++) {
        if (!maybe_committed(&maybe, byid[k]->outbox_id)) {
            phantom++;
            ex_phantom = byid[k]->outbox_id;
        }
    }
    /* Per-key order: the first copy of each row, by key in id order. */
    for (size_t i = 0; i < n_recs; i++) {
        const struct h_record *a = byid[i];
        if (!a->key || (i > 0 && byid[i - 1]->outbox_id == a->outbox_id))
            continue;
        for (size_t j = i + 1; j < n_recs; j++) {
            const struct h_record *b = byid[j];
            if (!b->key || b->outbox_id == a->outbox_id || b->key_len != a->key_len ||
                memcmp(a->key, b->key, a->key_len) != 0 || strcmp(a->topic, b->topic) != 0)
                continue;
            if (b->partition != a->partition || b->offset < a->offset) {
                order++;
                if (order == 1)
                    finding(x, "per-key order: id %lld at %s[%d]@%lld, then id %lld at [%d]@%lld",
                            (long long)a->outbox_id, a->topic, a->partition, (long long)a->offset,
                            (long long)b->outbox_id, b->partition, (long long)b->offset);
            }
            break;
        }
    }
    x->duplicates = dups;
    if (lost)
        finding(x, "%zu committed rows never published (e.g. id %lld)", lost, (long long)ex_lost);
    if (phantom)
        finding(x, "%zu records of rows never committed (e.g. id %lld)", phantom,
                (long long)ex_phantom);
    if (corrupt)
        finding(x, "%zu records differ from their row (e.g. %s)", corrupt, ex_corrupt);
    if (collateral)
        finding(x, "%zu rows dead-lettered for another row's refusal (e.g. %s)", collateral,
                ex_collateral);
    if (dead_under_retry)
        finding(x, "%zu rows dead-lettered although refused rows are retried (e.g. %s)",
                dead_under_retry, ex_collateral);
    /* With transactions a read_committed reader (ours) sees no duplicate
     * in any window. */
    if (dups && x->s.txn)
        finding(x, "%zu duplicates with relay.transactions (e.g. id %lld)", dups,
                (long long)ex_dup);
    else if (dups && !x->zombie_window)
        finding(x, "%zu duplicates outside any named window (e.g. id %lld)", dups,
                (long long)ex_dup);
    free(byid);
    h_records_free(&recs);
    free(dead);
    free(all.v); /* the rows' keys belong to the writers */
    free(rewound.v);
    free(maybe.v);
    PQfinish(c);
}

/* Sanitizer reports and "cannot happen" lines in a relay's log. */
static void scan_log(struct run *x, int i)
{
    static const char *const needles[] = {
        "cannot happen: ", "AddressSanitizer", "LeakSanitizer",
        "runtime error:", "event loop closed with handles still open"};
    char path[300], line[4096];
    FILE *f = fopen(h_relay_log_path(&x->relay[i].env, path, sizeof(path)), "r");
    while (f && fgets(line, sizeof(line), f))
        for (size_t k = 0; k < sizeof(needles) / sizeof(needles[0]); k++)
            if (strstr(line, needles[k])) {
                line[strcspn(line, "\n")] = '\0';
                finding(x, "relay %d logged: %.400s", i, line);
                fclose(f);
                return;
            }
    if (f)
        fclose(f);
}

/* ---- one schedule ---- */

static void run_schedule(struct run *x)
{
    for (int i = 0; i < x->s.n_faults; i++)
        if (x->s.f[i].kind == F_SLOW_ACKS)
            x->slow_acks = true;
    if (opt_real)
        h_env_start_real(&x->env, real_topic_spec, H_PG_TCP,
                         &(struct h_kafka){.nodes = 3, .proxy = true});
    else
        h_env_start_with(&x->env, topic_spec, H_PG_TCP);
    for (int i = 0; i < relays_of(&x->s); i++) {
        struct relay *rl = &x->relay[i];
        rl->env = x->env;
        rl->env.broker_in = rl->env.broker_out = NULL; /* the master's */
        snprintf(rl->env.relay_name, sizeof(rl->env.relay_name), "relay%d", i);
        rl->env.http_port = h_free_port();
        /* Built in locals: GCC's -Wrestrict cannot tell members of *x apart. */
        char app[sizeof(rl->app)], ci[sizeof(rl->conninfo)];
        snprintf(app, sizeof(app), "chaos-r%d", i);
        snprintf(ci, sizeof(ci), "postgres.conninfo=%s application_name=%s", x->env.conninfo, app);
        memcpy(rl->app, app, sizeof(app));
        memcpy(rl->conninfo, ci, sizeof(ci));
        if (i < x->s.n_relays) /* guests join with their fault */
            relay_start(x, i);
    }
    atomic_store(&x->stop_writers, 0);
    for (int i = 0; i < WRITERS; i++) {
        struct writer *w = &x->writers[i];
        memset(w, 0, sizeof(*w));
        w->w = i;
        w->conninfo = x->env.conninfo;
        w->r.s = x->s.seed * 31 + (uint64_t)i;
        w->stop = &x->stop_writers;
        w->no_big = x->s.retry;
        if (pthread_create(&w->t, NULL, writer_main, w) != 0)
            fail_msg("pthread_create failed");
    }
    run_timeline(x);
    heal(x);
    atomic_store(&x->stop_writers, 1);
    for (int i = 0; i < WRITERS; i++)
        pthread_join(x->writers[i].t, NULL);

    int64_t healed = h_now_ms();
    int deadline_ms = DRAIN_DEADLINE_MS;
    for (;;) {
        while (!drained(x) && h_now_ms() - healed < deadline_ms) {
            supervise(x);
            check_notices(x);
            plot_sample(x);
            h_sleep_ms(100);
        }
        if (drained(x) || deadline_ms > DRAIN_DEADLINE_MS || !x->s.txn ||
            h_kafka_log_count(&x->env, COORDINATOR_RETRY_LINE) == 0)
            break;
        deadline_ms += COORDINATOR_RETRY_MS;
        x->coordinator_waits++;
    }
    for (;;) { /* the last cuts' expectations */
        bool pending = false;
        for (int i = 0; i < relays_of(&x->s); i++)
            pending = pending || x->relay[i].expect_notice;
        if (!pending || h_now_ms() - healed > DRAIN_DEADLINE_MS)
            break;
        check_notices(x);
        h_sleep_ms(100);
    }
    if (!drained(x))
        finding(x, "stall: rows still unsent %d ms after healing", deadline_ms);
    for (int i = 0; i < relays_of(&x->s); i++)
        if (x->relay[i].alive)
            relay_sigterm(x, i, " at the end");
    check(x);
    if (!opt_real) /* the sequence checks are the mock's */
        h_broker_seq_stats(&x->env, &x->seq);
    for (int i = 0; i < relays_of(&x->s); i++)
        x->timed_out += h_relay_log_count(&x->relay[i].env, "Local: Message timed out");
    if (x->seq.unchecked)
        finding(x, "the broker passed %lu Produce requests unchecked", x->seq.unchecked);
    for (int i = 0; i < relays_of(&x->s); i++)
        scan_log(x, i);
}

/* ---- the run ---- */

static uint64_t opt_seed;
static int opt_schedules = 0, opt_seconds = 0;
static unsigned opt_faults = 0;
static bool opt_keep_going;
static bool opt_print;       /* print the schedules, run nothing */
static const char *opt_mode; /* --mode: only schedules of this relay.on_sent */
static bool opt_txn;         /* --transactions: only schedules with relay.transactions */
static bool opt_sharing;     /* --sharing: only schedules with relay.shards above 1 */

struct totals {
    int schedules, failed;
    unsigned faults[F_COUNT];
    size_t committed, records, rolled_back, dead, dups_zombie, dups_replicating;
    unsigned long seq_out_of_order, seq_duplicates;
    long timed_out;
    unsigned fatal_restarts;
};

/* Rows a pg-rewind took back, as a note. */
static const char *rewound_note(bool rewind, size_t n)
{
    static char note[64];
    snprintf(note, sizeof(note), ", %zu taken back by a rewind", n);
    return rewind ? note : "";
}

/* A real cluster's duplicates of the replication window, as a note. */
static const char *replicating_note(size_t n)
{
    static char note[64];
    snprintf(note, sizeof(note), " (%zu more of the replication window)", n);
    return note;
}

static void test_chaos(void **state)
{
    (void)state;
    struct totals t = {0};
    int64_t start = h_now_ms();
    plot_open();
    fprintf(stderr, "chaos: base seed %llu (replay one schedule: --seed N --schedules 1)\n",
            (unsigned long long)opt_seed);
    for (int k = 0;; k++) {
        if (opt_schedules > 0 && k >= opt_schedules)
            break;
        if (opt_seconds > 0 && h_now_ms() - start > (int64_t)opt_seconds * 1000)
            break;
        memset(&run, 0, sizeof(run));
        gen_schedule(&run.s, opt_seed + (uint64_t)k, opt_faults);
        if ((opt_mode && strcmp(run.s.mode, opt_mode) != 0) || (opt_sharing && run.s.shards < 2) ||
            (opt_txn && !run.s.txn))
            continue; /* --mode, --sharing, --transactions: a seed keeps its schedule */
        int64_t started = h_now_ms();
        run_schedule(&run);
        plot_schedule(&run, started);
        t.schedules++;
        for (int f = 0; f < F_COUNT; f++)
            t.faults[f] += run.fault_counts[f];
        t.committed += run.committed;
        t.records += run.records;
        t.rolled_back += run.rolled_back;
        t.dead += run.dead;
        t.dups_zombie += run.duplicates; /* any other duplicate is a finding */
        t.dups_replicating += run.dups_replicating;
        t.seq_out_of_order += run.seq.out_of_order;
        t.seq_duplicates += run.seq.duplicates;
        char seq[96] = ""; /* the sequence checks are the mock's */
        if (!opt_real)
            snprintf(seq, sizeof(seq),
                     "broker refused %lu batches out of sequence, recognised %lu "
                     "resent; ",
                     run.seq.out_of_order, run.seq.duplicates);
        fprintf(
            stderr,
            "chaos: seed %llu: %d relays%s%s%s, %d faults, %zu rows committed (%zu uncertain%s), "
            "%zu rolled back, %zu dead-lettered, %zu records, %zu duplicates%s%s; %ld time-out "
            "reports; %s%u restarted after a fatal error%s -> %s\n",
            (unsigned long long)run.s.seed, run.s.n_relays,
            run.s.shards > 1 ? " sharing slots" : "", run.s.n_guests ? " (+ joining)" : "",
            run.s.txn ? " in transactions" : "", run.s.n_faults, run.committed, run.uncertain,
            rewound_note(run.rewind_ms != 0, run.rewound), run.rolled_back, run.dead, run.records,
            run.duplicates, run.zombie_window ? " [zombie window]" : "",
            opt_real ? replicating_note(run.dups_replicating) : "", run.timed_out, seq,
            run.fatal_restarts,
            run.coordinator_waits ? "; waited for a transaction coordinator's deferred write" : "",
            run.n_findings ? "FINDINGS" : "ok");
        t.timed_out += run.timed_out;
        t.fatal_restarts += run.fatal_restarts;
        if (run.n_findings) {
            t.failed++;
            print_schedule(stderr, &run.s);
            for (int i = 0; i < run.n_findings; i++)
                fprintf(stderr, "  finding: %s\n", run.findings[i]);
            fprintf(stderr, "  logs kept in %s\n", run.env.dir);
        }
        bool keep = run.n_findings > 0;
        for (int i = 0; i < MAX_RELAYS + MAX_GUESTS; i++)
            if (run.relay[i].alive && run.relay[i].env.relay_pid > 0) {
                kill(run.relay[i].env.relay_pid, SIGKILL);
                h_relay_wait(&run.relay[i].env, 5000);
            }
        for (int i = 0; i < WRITERS; i++) {
            rows_free(&run.writers[i].committed);
            rows_free(&run.writers[i].uncertain);
            rows_free(&run.writers[i].rolled_back);
        }
        if (keep) {
            /* Keep the directory for the logs: stop the servers only. */
            char dir[256];
            snprintf(dir, sizeof(dir), "%s", run.env.dir);
            run.env.dir[0] = '\0';
            h_env_stop(&run.env);
            snprintf(run.env.dir, sizeof(run.env.dir), "%s", dir);
        } else {
            h_env_stop(&run.env);
        }
        if (keep && !opt_keep_going)
            break;
    }
    fprintf(stderr, "chaos: %d schedules in %llds, %d with findings; faults:", t.schedules,
            (long long)((h_now_ms() - start) / 1000), t.failed);
    for (int f = 0; f < F_COUNT; f++)
        if (t.faults[f])
            fprintf(stderr, " %s %u", fault_names[f], t.faults[f]);
    char seq[128] = "";
    if (!opt_real)
        snprintf(seq, sizeof(seq),
                 "the broker refused %lu batches out of sequence and recognised %lu resent ones; ",
                 t.seq_out_of_order, t.seq_duplicates);
    fprintf(stderr,
            "\nchaos: %zu rows committed, %zu rolled back, %zu dead-lettered, %zu records; "
            "duplicates: %zu, all in zombie windows%s; %ld time-out reports logged; %s%u relays "
            "restarted after a fatal error\n",
            t.committed, t.rolled_back, t.dead, t.records, t.dups_zombie,
            opt_real ? replicating_note(t.dups_replicating) : "", t.timed_out, seq,
            t.fatal_restarts);
    if (t.failed)
        fail_msg("chaos: %d of %d schedules had findings (seeds above)", t.failed, t.schedules);
}

static unsigned parse_faults(const char *list)
{
    unsigned mask = 0;
    char buf[512];
    snprintf(buf, sizeof(buf), "%s", list);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        int k = 0;
        if (strcmp(tok, "default") == 0 || strcmp(tok, "all") == 0) {
            mask |= default_faults();
            continue;
        }
        while (k < F_COUNT && strcmp(fault_names[k], tok) != 0)
            k++;
        if (k == F_COUNT) {
            fprintf(stderr, "obx-chaos: unknown fault '%s' (--list-faults)\n", tok);
            exit(2);
        }
        if (!(default_faults() & (1u << k))) {
            fprintf(stderr, "obx-chaos: fault '%s' needs %s\n", tok,
                    opt_real ? "the mock broker (no --kafka real)" : "--kafka real");
            exit(2);
        }
        mask |= 1u << k;
    }
    return mask;
}

int main(int argc, char **argv)
{
    opt_seed = (uint64_t)time(NULL) * 1000003u ^ (uint64_t)getpid();
    opt_seed %= 1000000000ULL;
    const char *faults = "default";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--seed") == 0 && v) {
            opt_seed = strtoull(v, NULL, 10);
            i++;
        } else if (strcmp(a, "--schedules") == 0 && v) {
            opt_schedules = atoi(v);
            i++;
        } else if (strcmp(a, "--seconds") == 0 && v) {
            opt_seconds = atoi(v);
            i++;
        } else if (strcmp(a, "--faults") == 0 && v) {
            faults = v; /* read once --kafka is known */
            i++;
        } else if (strcmp(a, "--kafka") == 0 && v) {
            if (strcmp(v, "mock") != 0 && strcmp(v, "real") != 0) {
                fprintf(stderr, "obx-chaos: --kafka is mock or real, not '%s'\n", v);
                return 2;
            }
            opt_real = strcmp(v, "real") == 0;
            i++;
        } else if (strcmp(a, "--mode") == 0 && v) {
            if (strcmp(v, "mark") != 0 && strcmp(v, "delete") != 0 && strcmp(v, "log") != 0) {
                fprintf(stderr, "obx-chaos: --mode is mark, delete or log, not '%s'\n", v);
                return 2;
            }
            opt_mode = v;
            i++;
        } else if (strcmp(a, "--sharing") == 0) {
            opt_sharing = true;
        } else if (strcmp(a, "--transactions") == 0) {
            opt_txn = true;
        } else if (strcmp(a, "--keep-going") == 0) {
            opt_keep_going = true;
        } else if (strcmp(a, "--print") == 0) {
            opt_print = true;
        } else if (strcmp(a, "--list-faults") == 0) {
            for (int k = 0; k < F_COUNT; k++)
                printf("%s%s\n", fault_names[k],
                       MOCK_FAULTS & (1u << k)   ? " (mock broker only)"
                       : REAL_FAULTS & (1u << k) ? " (--kafka real only)"
                                                 : "");
            return 0;
        } else {
            fprintf(stderr, "usage: obx-chaos [--kafka mock|real] [--seed S] [--schedules N] "
                            "[--seconds T] [--faults a,b,...|default|all] [--mode mark|delete|log] "
                            "[--sharing] [--transactions] "
                            "[--keep-going] "
                            "[--list-faults] [--print]\n");
            return 2;
        }
    }
    if (opt_txn && !opt_real) {
        fprintf(stderr, "obx-chaos: --transactions goes with --kafka real (the mock cannot "
                        "fence)\n");
        return 2;
    }
    opt_faults = parse_faults(faults);
    if (opt_schedules == 0 && opt_seconds == 0)
        opt_schedules = 1;
    if (opt_print) {
        for (int k = 0; k < opt_schedules; k++) {
            struct schedule sc;
            gen_schedule(&sc, opt_seed + (uint64_t)k, opt_faults);
            print_schedule(stdout, &sc);
        }
        return 0;
    }
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_chaos)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
