/*
 * main: command line, configuration assembly, signals, and the wiring of
 * pg, kafka, recovery and maint into the relay (health answers for it all).
 *
 * One libuv loop owns everything. The relay (pure state machine) issues its
 * commands through `relay_ops` below; pg and kafka callbacks feed it events.
 */
#include "outboxd/check.h"
#include "outboxd/alloc.h"
#include "outboxd/config.h"
#include "outboxd/failpoint.h"
#include "outboxd/health.h"
#include "outboxd/http.h"
#include "outboxd/kafka.h"
#include "outboxd/log.h"
#include "outboxd/maint.h"
#include "outboxd/metrics.h"
#include "outboxd/pg.h"
#include "outboxd/record.h"
#include "outboxd/recovery.h"
#include "outboxd/relay.h"
#include "outboxd/tools.h"

#include <getopt.h>
#include <stddef.h>
#include <sys/socket.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define EXIT_RUNTIME 1
#define EXIT_USAGE   2
#define EXIT_DONE    -1 /* --help or --version printed: exit 0 */
#define MAX_WEAKENED 5

/* Housekeeping period: poll fallback, back-offs and deadlines are checked
 * this often. Cheap enough to leave the process idle at ~0% CPU. */
#define HOUSEKEEPING_MS 100
/* Kafka reachability (for /readyz and metrics) is asked this often. */
#define KAFKA_PROBE_MS 5000
/* relay.transactions: fences of lost owners' ids that fail in a row before
 * the relay gives them up (each waits for init_transactions' timeout). */
#define FENCE_GIVE_UP 5
/* After teardown, how long worker threads may keep the loop alive. */
#define LAST_EXIT_MS 300

struct app {
    uv_loop_t loop;
    struct obx_config cfg;
    struct obx_pg *pg;
    struct obx_kafka *kafka;
    struct obx_recovery *recovery;
    struct obx_relay *relay;
    /* A fatal Kafka error reported while the producer was being made, before
     * the relay exists (obx_kafka_new serves librdkafka's queue once): the
     * relay gets it as soon as it does. */
    char early_fatal[256];
    char txn_id[256]; /* relay.transactions: the transactional.id of the session's producer */
    /* relay.transactions with relay.shards: this session's backend pid (its
     * transactional.id ends with it), the pids of slots' lost owners still
     * to fence (the claims say them, or with relay.shards = 1 the relay
     * lock's repair; kept until a fence succeeds; 0 is the id of a relay
     * alone), and the pass op_recover puts off until the fence and the
     * init are done. */
    long session_pid;
    long single_fenced_session; /* the session whose fence took a relay alone's id */
    long fencing_session;       /* the session of the fence running */
    int fence_failures;         /* fences failed in a row (FENCE_GIVE_UP) */
    long fence_pids[64];
    size_t n_fence_pids;
    size_t n_fencing; /* the first n_fencing of them: the fence running */
    /* Lost owners fenced (or given up on; without transactions, every one
     * named) that the next claim takes off the slots this relay holds
     * (outbox.owners_to_fence, sql/013); the first n_fenced_sent of them
     * went with the claim in flight. */
    long fenced_pids[64];
    size_t n_fenced_pids, n_fenced_sent;
    int pass_shards;
    char pass_slots[8192];   /* "{0,3,...}": up to 1,024 slots */
    struct obx_http *http;   /* NULL when http.listen is empty */
    struct obx_maint *maint; /* backlog figures and retention */
    uv_signal_t sigterm, sigint, sighup;
    uv_timer_t housekeeping;
    uv_timer_t look;      /* the relay's next look for new rows */
    uv_timer_t teardown;  /* closes everything from a fresh loop turn */
    uv_timer_t last_exit; /* unreferenced: fires only if a worker thread keeps the loop */
    int signals;
    int exit_code;
    int64_t next_probe;       /* loop time of the next Kafka probe */
    char shards_text[16];     /* the claim's relay.shards, as text */
    struct obx_health health; /* /livez, /readyz, /metrics, sd_notify */
    /* The command line, kept to rebuild the configuration on SIGHUP. */
    const char *config_path;
    char **xargs;
    int n_xargs;
    bool cfg_loaded;
    /* Settings that weaken the guarantees: warned about at --check and start. */
    char weakened[MAX_WEAKENED][384];
    size_t n_weakened;
};

/* ---- relay commands ---- */

static void marked(void *arg, const PGresult *res, const char *error)
{
    struct app *a = arg;
    int64_t now = (int64_t)uv_now(&a->loop);
    (void)res;
    if (error)
        obx_relay_on_query_failed(a->relay, error, now);
    else
        obx_relay_on_marked(a->relay, now);
}

static int op_fetch(void *io, const struct obx_fetch *f)
{
    struct app *a = io;
    return obx_pg_send_fetch(a->pg, f, obx_relay_fetched, a->relay); /* rows: pg -> relay */
}

static int op_mark(void *io, const struct obx_mark *m)
{
    struct app *a = io;
    return obx_pg_send_mark(a->pg, m, marked, a);
}

static int op_mark_fetch(void *io, const struct obx_mark *m, const struct obx_fetch *f)
{
    struct app *a = io;
    return obx_pg_send_mark_fetch(a->pg, m, f, obx_relay_mark_fetched, a->relay);
}

/* relay.transactions: the transactional.id of this outbox: the user's
 * kafka.transactional.id, else one derived from the server's system
 * identifier (the same on a promoted standby, another on a restored copy)
 * and the database's name. False when neither is known. */
static bool derived_transactional_id(struct app *a, char *out, size_t len);

static bool transactional_id(struct app *a, char *out, size_t len)
{
    const char *set = obx_config_kafka_get(&a->cfg, "transactional.id");
    if (set) {
        snprintf(out, len, "%s", set);
        return true;
    }
    return derived_transactional_id(a, out, len);
}

/* The id outboxd derives (relays with relay.shards add "-PID" to it). */
static bool derived_transactional_id(struct app *a, char *out, size_t len)
{
    const char *history = obx_pg_history(a->pg); /* "SYSTEM_ID.TIMELINE" */
    size_t sys_len = strcspn(history, ".");
    if (sys_len == 0)
        return false;
    snprintf(out, len, "outboxd-%.*s-%s", (int)sys_len, history, obx_pg_dbname(a->pg));
    return true;
}

static void lost_owners_fenced(bool ok, const char *reason, void *arg);
static void note_lost_owners(struct app *a, const char *pids);

/* Fences the transactional ids of the slots' lost owners (relay.shards),
 * then lost_owners_fenced goes on. `base`: the derived id. */
static int fence_lost_owners(struct app *a, const char *base)
{
    char ids[sizeof(a->fence_pids) / sizeof(a->fence_pids[0])][300];
    const char *list[sizeof(a->fence_pids) / sizeof(a->fence_pids[0])];
    for (size_t i = 0; i < a->n_fence_pids; i++) {
        if (a->fence_pids[i] == 0)
            snprintf(ids[i], sizeof(ids[i]), "%s", base);
        else
            snprintf(ids[i], sizeof(ids[i]), "%s-%ld", base, a->fence_pids[i]);
        list[i] = ids[i];
    }
    /* Claims of a next session may add more meanwhile; a fence still
     * running (refused here) keeps its own count. */
    size_t n = a->n_fence_pids;
    bool owners = false; /* a slot's lost owner, not only a relay alone's id */
    for (size_t i = 0; i < n; i++)
        owners = owners || a->fence_pids[i] != 0;
    if ((owners && OBX_FAILPOINT(OBX_FP_TXN_BEFORE_FENCE) != 0) ||
        obx_kafka_txn_fence(a->kafka, list, n, lost_owners_fenced, a) != 0)
        return -1;
    a->n_fencing = n;
    a->fencing_session = a->session_pid;
    return 0;
}

static int op_recover(void *io, int shards, const char *owned_slots)
{
    struct app *a = io;
    if (!a->cfg.transactions)
        return obx_recovery_start(a->recovery, shards, owned_slots);
    /* The pass reads what committed, so it goes after the fence: a new
     * producer with this outbox's transactional.id, whose init aborts the
     * transaction an earlier one (another relay, or this one's lost
     * session) left open, or waits for the end of one it was committing. */
    char base[224]; /* room for "-PID" in txn_id */
    if (!transactional_id(a, base, sizeof(base))) {
        obx_error("relay.transactions: the server does not say its system identifier "
                  "(pg_control_system() refused), from which the transactional.id comes: set "
                  "kafka.transactional.id, the same for every relay of this outbox");
        return -1;
    }
    char derived[224];
    bool have_derived = derived_transactional_id(a, derived, sizeof(derived));
    a->pass_shards = shards;
    snprintf(a->pass_slots, sizeof(a->pass_slots), "%s", owned_slots ? owned_slots : "");
    if (shards <= 1) {
        /* A relay alone after relays with slots (relay.shards changed):
         * the ones that lost their slots are fenced first, by their ids
         * (derived ones: kafka.transactional.id is refused with slots). */
        snprintf(a->txn_id, sizeof(a->txn_id), "%s", base);
        if (have_derived)
            note_lost_owners(a, obx_pg_lost_slot_owners(a->pg));
        else if (obx_pg_lost_slot_owners(a->pg)[0])
            obx_warn("kafka: relays with relay.shards above 1 lost slots (sessions %s), but "
                     "their transactional.ids cannot be told without the server's system "
                     "identifier: they are not fenced",
                     obx_pg_lost_slot_owners(a->pg));
    } else {
        /* With slots, each relay's id is its session's (no two relays
         * share one, so none fences another while both run); the lost
         * owners of the slots it took are fenced by theirs first, and
         * once a session the id of a relay alone, which may have been
         * lost just before (relay.shards changed; a relay alone and
         * relays with slots never hold the relay lock together). */
        snprintf(a->txn_id, sizeof(a->txn_id), "%s-%ld", base, a->session_pid);
        if (a->single_fenced_session != a->session_pid)
            note_lost_owners(a, "0");
    }
    if (a->n_fence_pids > 0)
        return fence_lost_owners(a, derived);
    return obx_kafka_txn_init(a->kafka, a->txn_id);
}

/* The first n_fencing lost owners, as a log's words. */
static void fencing_words(const struct app *a, char *out, size_t len)
{
    out[0] = '\0';
    for (size_t i = 0, used = 0; i < a->n_fencing && used < len; i++)
        used += a->fence_pids[i] == 0
                    ? (size_t)snprintf(out + used, len - used, "%sa relay alone's", i ? ", " : "")
                    : (size_t)snprintf(out + used, len - used, "%ssession %ld", i ? ", " : "",
                                       a->fence_pids[i]);
}

/* The first n_fencing lost owners leave the list (fenced, or given up). */
static void fencing_done(struct app *a)
{
    for (size_t i = 0; i < a->n_fencing; i++) {
        if (a->fence_pids[i] == 0)
            a->single_fenced_session = a->fencing_session;
        else if (a->pass_shards > 1 && /* a relay alone never claims */
                 a->n_fenced_pids < sizeof(a->fenced_pids) / sizeof(a->fenced_pids[0]))
            a->fenced_pids[a->n_fenced_pids++] = a->fence_pids[i];
    }
    a->n_fence_pids -= a->n_fencing;
    memmove(a->fence_pids, a->fence_pids + a->n_fencing,
            a->n_fence_pids * sizeof(a->fence_pids[0]));
    a->fence_failures = 0;
}

static void lost_owners_fenced(bool ok, const char *reason, void *arg)
{
    struct app *a = arg;
    int64_t now = (int64_t)uv_now(&a->loop);
    char words[240];
    fencing_words(a, words, sizeof(words));
    if (ok) {
        obx_event(OBX_LOG_INFO, "owners_fenced",
                  "kafka: the transactional producers of the outbox's lost owners (%s) are "
                  "fenced: what they left open is ended, and they cannot commit",
                  words);
        fencing_done(a);
    } else if (++a->fence_failures >= FENCE_GIVE_UP) {
        /* A coordinator that keeps refusing an id (no right to it, its
         * partition offline) refuses its zombie's commit as well; a relay
         * that waited for ever would publish nothing. */
        obx_warn("kafka: fencing the transactional producers of the outbox's lost owners (%s) "
                 "failed %d times (%s); given up, the pass goes on",
                 words, a->fence_failures, reason);
        fencing_done(a);
        ok = true;
    }
    a->n_fencing = 0;
    if (obx_relay_state(a->relay) != OBX_RELAY_RECOVERING)
        return; /* the session went meanwhile: its next pass goes on from here */
    if (!ok) {
        obx_warn("kafka: fencing the transactional producers of the outbox's lost owners (%s) "
                 "failed (%s); the pass waits and tries again",
                 words, reason);
        obx_relay_on_recovered(a->relay, false, now);
        return;
    }
    if (a->n_fence_pids > 0 || obx_kafka_txn_init(a->kafka, a->txn_id) != 0)
        obx_relay_on_recovered(a->relay, false, now);
}

static int op_txn_begin(void *producer, const char **reason)
{
    return obx_kafka_txn_begin(producer, reason);
}

static int op_txn_end(void *io, enum obx_txn_end end)
{
    struct app *a = io;
    return obx_kafka_txn_end(a->kafka, end);
}

/* The next pid of a list such as "12,34" at *p (moved past it); false at
 * its end. */
static bool next_pid(const char **p, long *pid)
{
    char *end;
    *pid = strtol(*p, &end, 10);
    if (end == *p)
        return false;
    *p = *end == ',' ? end + 1 : end;
    return true;
}

/* The claim's "fence_pids" ("12,34"): owners of slots now held that lost
 * them; kept, once each, until a fence of their ids succeeds. */
static void note_lost_owners(struct app *a, const char *pids)
{
    const size_t cap = sizeof(a->fence_pids) / sizeof(a->fence_pids[0]);
    long pid;
    for (const char *p = pids; next_pid(&p, &pid);) {
        bool known = false;
        for (size_t i = 0; i < a->n_fence_pids; i++)
            known = known || a->fence_pids[i] == pid;
        for (size_t i = 0; i < a->n_fenced_pids; i++)
            known = known || a->fenced_pids[i] == pid; /* fenced, the claim not yet told */
        if (!known && a->n_fence_pids < cap)
            a->fence_pids[a->n_fence_pids++] = pid;
        else if (!known)
            obx_warn("kafka: more than %zu lost slot owners to fence; session %ld is not "
                     "fenced (its open transaction ends at its timeout)",
                     cap, pid);
    }
}

/* Without transactions the claim's lost owners are not fenced, and the
 * next claim takes them off the slots: a relay alone with transactions
 * run later would fence them for nothing. */
static void forget_lost_owners(struct app *a, const char *pids)
{
    const size_t cap = sizeof(a->fenced_pids) / sizeof(a->fenced_pids[0]);
    long pid;
    for (const char *p = pids; a->n_fenced_pids < cap && next_pid(&p, &pid);)
        a->fenced_pids[a->n_fenced_pids++] = pid;
}

static void claimed(void *arg, const PGresult *res, const char *error)
{
    struct app *a = arg;
    int64_t now = (int64_t)uv_now(&a->loop);
    if (error || PQntuples(res) != 1) {
        obx_relay_on_query_failed(a->relay, error ? error : "no answer", now);
        return;
    }
    struct obx_claim c = {
        .owned = obx_store_col(res, 0, "owned"),
        .members = (int)strtol(obx_store_col(res, 0, "members"), NULL, 10),
        .share = (int)strtol(obx_store_col(res, 0, "share"), NULL, 10),
        .free = (int)strtol(obx_store_col(res, 0, "free"), NULL, 10),
        .other_shards = obx_store_col_null(res, 0, "other_shards")
                            ? 0
                            : (int)strtol(obx_store_col(res, 0, "other_shards"), NULL, 10),
        .cursor_hwm = obx_store_col_null(res, 0, "cursor_hwm")
                          ? -1
                          : strtoll(obx_store_col(res, 0, "cursor_hwm"), NULL, 10),
    };
    a->session_pid = strtol(obx_store_col(res, 0, "session_pid"), NULL, 10);
    a->n_fenced_pids -= a->n_fenced_sent; /* off the slots now */
    memmove(a->fenced_pids, a->fenced_pids + a->n_fenced_sent,
            a->n_fenced_pids * sizeof(a->fenced_pids[0]));
    if (a->cfg.transactions)
        note_lost_owners(a, obx_store_col(res, 0, "fence_pids"));
    else
        forget_lost_owners(a, obx_store_col(res, 0, "fence_pids"));
    const char *repaired = obx_store_col(res, 0, "repaired");
    if (strcmp(repaired, "0") != 0)
        obx_warn("postgres: %s unsent rows of the slots taken carried a transaction id from "
                 "another cluster (restored or replicated); they now carry one of this "
                 "cluster's (those not yet published go out once)",
                 repaired);
    obx_relay_on_claimed(a->relay, &c, now);
}

static int op_claim(void *io, int shards, const char *give_back, bool take)
{
    struct app *a = io;
    snprintf(a->shards_text, sizeof(a->shards_text), "%d", shards);
    const char *values[OBX_CLAIM_NPARAMS];
    values[OBX_CLAIM_SHARDS] = a->shards_text;
    values[OBX_CLAIM_GIVE_BACK] = give_back;
    values[OBX_CLAIM_TAKE] = take ? "true" : "false";
    char fenced[sizeof(a->fenced_pids) / sizeof(a->fenced_pids[0]) * 12 + 3] = "{";
    for (size_t i = 0, used = 1; i < a->n_fenced_pids; i++)
        used += (size_t)snprintf(fenced + used, sizeof(fenced) - used, "%s%ld", i ? "," : "",
                                 a->fenced_pids[i]);
    strcat(fenced, "}");
    values[OBX_CLAIM_FENCED] = fenced;
    a->n_fenced_sent = a->n_fenced_pids;
    return obx_pg_send(a->pg, obx_store_sql_claim_slots(), OBX_CLAIM_NPARAMS, values, 0, claimed,
                       a);
}

static void on_teardown(uv_timer_t *t);

static void op_stopped(void *io, int exit_code)
{
    struct app *a = io;
    a->exit_code = exit_code;
    /* We are deep inside a pg or kafka callback: close them from the loop. */
    uv_timer_start(&a->teardown, on_teardown, 0, 0);
}

static int op_failpoint(void *io, int id)
{
    (void)io;
    return OBX_FAILPOINT((enum obx_fp_id)id);
}

static void op_acked(void *io, int64_t created_us)
{
    struct app *a = io;
    obx_health_acked(&a->health, created_us);
}

static int64_t op_now(void *io)
{
    struct app *a = io;
    return (int64_t)uv_now(&a->loop);
}

static void on_look(uv_timer_t *t)
{
    struct app *a = t->data;
    obx_relay_tick(a->relay, (int64_t)uv_now(&a->loop));
}

static void op_wake_at(void *io, int64_t when)
{
    struct app *a = io;
    int64_t delay = when - (int64_t)uv_now(&a->loop);
    uv_timer_start(&a->look, on_look, delay > 0 ? (uint64_t)delay : 0, 0);
}

static const struct obx_relay_ops relay_ops = {
    .fetch = op_fetch,
    .mark_fetch = op_mark_fetch,
    .mark = op_mark,
    .produce = obx_kafka_relay_produce, /* rows: relay -> kafka (its producer) */
    .produce_alone = obx_kafka_relay_produce_alone,
    .recover = op_recover,
    .claim = op_claim,
    .stopped = op_stopped,
    .failpoint = op_failpoint,
    .acked = op_acked,
    .wake_at = op_wake_at,
    .txn_begin = op_txn_begin,
    .txn_end = op_txn_end,
    .now = op_now,
};

/* ---- pg events ---- */

static void pg_ready(void *arg)
{
    struct app *a = arg;
    /* Before the relay's first record of the session (none is in flight). */
    obx_kafka_set_history(a->kafka, obx_pg_history(a->pg));
    obx_relay_on_pg_ready(a->relay, (int64_t)uv_now(&a->loop));
}

static void pg_lost(void *arg)
{
    struct app *a = arg;
    if (obx_relay_state(a->relay) == OBX_RELAY_RECOVERING)
        obx_recovery_abort(a->recovery);
    obx_relay_on_pg_lost(a->relay, (int64_t)uv_now(&a->loop));
    obx_kafka_drop_queued(a->kafka); /* the relay lock is gone: hand nothing more to Kafka */
}

static void reload(struct app *a);

static void recovery_done(bool ok, void *arg)
{
    struct app *a = arg;
    if (ok)
        obx_health_recovered(&a->health); /* publishing may start */
    obx_relay_on_recovered(a->relay, ok, (int64_t)uv_now(&a->loop));
}

static int recovery_log_state(const struct obx_log_state *st, void *arg)
{
    struct app *a = arg;
    return obx_relay_on_log_state(a->relay, st);
}

/* ---- kafka events ---- */

static void kafka_delivery(void *opaque, enum obx_delivery outcome, int32_t partition,
                           int64_t offset, const char *key, size_t key_len, const char *reason,
                           void *arg)
{
    struct app *a = arg;
    obx_relay_on_delivery(a->relay, opaque, outcome, partition, offset, key, key_len, reason,
                          (int64_t)uv_now(&a->loop));
}

static void kafka_txn_done(bool init, enum obx_txn_end end, enum obx_txn_result result,
                           const char *reason, void *arg)
{
    struct app *a = arg;
    int64_t now = (int64_t)uv_now(&a->loop);
    if (!init) {
        obx_relay_on_txn_ended(a->relay, end, result, reason, now);
        return;
    }
    /* An init of a session gone (another id), or one this session's pass
     * must not follow yet (lost owners still to fence): the pass waits and
     * asks again. */
    if (obx_relay_state(a->relay) == OBX_RELAY_RECOVERING &&
        (strcmp(obx_kafka_txn_id(a->kafka), a->txn_id) != 0 || a->n_fence_pids > 0)) {
        obx_relay_on_recovered(a->relay, false, now);
        return;
    }
    /* The pass op_recover put off. */
    if (result == OBX_TXN_OK && obx_relay_state(a->relay) == OBX_RELAY_RECOVERING &&
        obx_recovery_start(a->recovery, a->pass_shards, a->pass_slots[0] ? a->pass_slots : NULL) ==
            0) {
        obx_event(OBX_LOG_INFO, "transactions_ready",
                  "kafka: transactional producer ready (transactional.id %s); earlier producers "
                  "with it are fenced and their open transaction ended",
                  a->txn_id);
        return;
    }
    if (result != OBX_TXN_OK)
        obx_warn("kafka: init_transactions failed (%s); trying again", reason);
    if (obx_relay_state(a->relay) == OBX_RELAY_RECOVERING)
        obx_relay_on_recovered(a->relay, false, now);
}

static void kafka_fatal(const char *reason, void *arg)
{
    struct app *a = arg;
    if (!a->relay) {
        snprintf(a->early_fatal, sizeof(a->early_fatal), "%s", reason ? reason : "fatal");
        return;
    }
    obx_relay_fatal(a->relay, reason, (int64_t)uv_now(&a->loop));
}

/* ---- loop plumbing ---- */

static void on_housekeeping(uv_timer_t *t)
{
    struct app *a = t->data;
    int64_t now = (int64_t)uv_now(&a->loop);
    obx_kafka_housekeeping(a->kafka);
    obx_relay_tick(a->relay, now);
    if (now >= a->next_probe) {
        obx_kafka_probe(a->kafka);
        a->next_probe = now + KAFKA_PROBE_MS;
    }
    /* Backlog and retention: the active relay's job, not a standby's; with
     * relay.shards, the job of the one that owns slot 0. */
    if (obx_pg_usable(a->pg) && obx_relay_maintains(a->relay))
        obx_maint_tick(a->maint, now);
    else /* standing by, reconnecting, or slot 0 owned by another */
        obx_maint_forget_stats(a->maint);
    obx_health_tick(&a->health, now);
}

static void on_signal(uv_signal_t *s, int signum)
{
    struct app *a = s->data;
    if (signum == SIGHUP) {
        reload(a);
        return;
    }
    if (a->signals == 0)
        obx_health_draining(&a->health);
    if (++a->signals > 1) {
        obx_event(OBX_LOG_WARN, "exit_now", "received %s again: exiting at once",
                  strsignal(signum));
        _exit(EXIT_RUNTIME);
    }
    obx_event(OBX_LOG_INFO, "draining", "received %s: draining", strsignal(signum));
    obx_relay_shutdown(a->relay, (int64_t)uv_now(&a->loop));
}

/* SIGTERM or SIGINT before the loop's handlers are in place (a supervisor
 * that stops a relay it has just started): remembered, and raised again
 * once they are, so it still ends in an orderly stop with exit 0. */
static volatile sig_atomic_t early_signal;

static void on_early_signal(int signum)
{
    early_signal = signum;
}

static void catch_early_signals(bool on)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on ? on_early_signal : SIG_DFL;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    /* A reload asked for before the configuration is even read: nothing
     * to reload yet (its default action would kill the process). */
    sa.sa_handler = on ? SIG_IGN : SIG_DFL;
    sigaction(SIGHUP, &sa, NULL);
}

/* Closes the modules that are open (each frees itself through the loop). */
static void close_parts(struct app *a)
{
    obx_pg_close(a->pg);
    a->pg = NULL;
    obx_kafka_close(a->kafka);
    a->kafka = NULL;
    obx_recovery_close(a->recovery);
    a->recovery = NULL;
    obx_http_close(a->http);
    a->http = NULL;
    obx_maint_close(a->maint);
    a->maint = NULL;
}

/* The loop outlived the teardown: a worker thread (the recovery scan, the
 * maintenance connection) is still inside a blocking Kafka or Postgres call.
 * Nothing of ours is left to flush, and the shutdown deadline is binding. */
static void on_last_exit(uv_timer_t *t)
{
    struct app *a = t->data;
    obx_warn("a worker thread is still waiting on Kafka or Postgres; exiting without it");
    _exit(a->exit_code);
}

static void on_teardown(uv_timer_t *t)
{
    struct app *a = t->data;
    uv_timer_start(&a->last_exit, on_last_exit, LAST_EXIT_MS, 0);
    uv_unref((uv_handle_t *)&a->last_exit);
    close_parts(a);
    uv_close((uv_handle_t *)&a->sigterm, NULL);
    uv_close((uv_handle_t *)&a->sigint, NULL);
    uv_close((uv_handle_t *)&a->sighup, NULL);
    uv_close((uv_handle_t *)&a->housekeeping, NULL);
    uv_close((uv_handle_t *)&a->look, NULL);
    uv_close((uv_handle_t *)&a->teardown, NULL);
}

/* ---- command line ---- */

static void usage(FILE *out)
{
    fprintf(out, "Usage: outboxd [--config FILE] [-X key=value]... [--check [--live]]\n"
                 "       outboxd status [--json] [--config FILE] [-X key=value]...\n"
                 "       outboxd dead list [--json] | dead retry ID... | dead drop ID...\n"
                 "       outboxd replay --topic T (--from-id N [--to-id M] | --since TIME) "
                 "[--yes]\n"
                 "       outboxd --version | --help\n"
                 "\n"
                 "Relays committed rows of a PostgreSQL transactional outbox to Kafka.\n"
                 "\n"
                 "  -c, --config FILE   read settings from FILE (key = value lines)\n"
                 "  -X key=value        set one key (overrides the file and the environment)\n"
                 "      --check         validate the configuration and exit (0 ok, 2 invalid)\n"
                 "      --live          with --check: also try Postgres and Kafka (schema,\n"
                 "                      privileges, topics); 1 if a problem was found\n"
                 "  -V, --version       print the version and exit\n"
                 "  -h, --help          print this help and exit\n"
                 "\n"
                 "Environment: OUTBOXD_<KEY> (upper case, dots as underscores) sets our own\n"
                 "keys, between the file and -X. OUTBOXD_FAILPOINTS arms failpoints.\n"
                 "\n"
                 "Keys:\n");
    obx_config_describe(out);
}

static const char *real_getenv(const char *name)
{
    return getenv(name);
}

/* Loads and validates the configuration. Returns 0, or EXIT_USAGE. */
/* Builds a configuration from the sources the command line named: file,
 * environment, -X. The same sequence serves start-up and SIGHUP. */
static int build_config(struct app *a, struct obx_config *cfg, char *err, size_t errlen)
{
    if (obx_config_init(cfg) != 0) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    int rc = 0;
    if (a->config_path && obx_config_load_file(cfg, a->config_path, err, errlen) != 0)
        rc = -1;
    if (rc == 0 && obx_config_apply_env(cfg, real_getenv, err, errlen) != 0)
        rc = -1;
    for (int i = 0; rc == 0 && i < a->n_xargs; i++)
        if (obx_config_set_arg(cfg, a->xargs[i], err, errlen) != 0)
            rc = -1;
    if (rc == 0 && obx_config_validate(cfg, err, errlen) != 0)
        rc = -1;
    if (rc == 0 && obx_pg_check_conninfo(cfg->pg_conninfo, err, errlen) != 0)
        rc = -1;
    struct sockaddr_storage http_addr;
    if (rc == 0 && cfg->http_listen[0] != '\0' &&
        obx_http_parse_listen(cfg->http_listen, &http_addr, err, errlen) != 0)
        rc = -1;
    if (rc == 0) {
        rd_kafka_conf_t *conf;
        if (obx_kafka_conf_build(cfg, OBX_KAFKA_PRODUCER, &conf, err, errlen) != 0) {
            rc = -1;
        } else {
            a->n_weakened =
                obx_kafka_weakened_guarantees(conf, cfg->transactions, a->weakened, MAX_WEAKENED);
            if (cfg->transactions && obx_kafka_conf_check_transactions(conf, err, errlen) != 0)
                rc = -1;
            rd_kafka_conf_destroy(conf);
        }
    }
    if (rc != 0)
        obx_config_free(cfg);
    return rc;
}

/* `outboxd status|dead|replay ...`: the operator's tools, on the same
 * configuration as the relay. Returns the exit status. */
static int run_tool(int argc, char **argv)
{
    static struct app a; /* only the configuration parts are used */
    struct obx_tool_args t;
    char err[512];
    int rc = obx_tool_parse(argc, argv, &t);
    if (rc != 0) {
        obx_tool_args_free(&t);
        return rc;
    }
    a.config_path = t.config_path;
    a.xargs = t.xargs;
    a.n_xargs = t.n_xargs;
    if (build_config(&a, &a.cfg, err, sizeof(err)) != 0) {
        fprintf(stderr, "outboxd %s: %s\n", t.tool, err);
        obx_tool_args_free(&t);
        return EXIT_USAGE;
    }
    obx_log_setup((enum obx_log_level)a.cfg.log_level, (enum obx_log_format)a.cfg.log_format);
    rc = obx_tool_run(&t, &a.cfg);
    obx_config_free(&a.cfg);
    obx_tool_args_free(&t);
    return rc;
}

/* Parses the command line and loads the configuration. Returns 0, or the
 * exit status. */
static int load_config(struct app *a, int argc, char **argv, bool *check_only, bool *live)
{
    static const struct option longopts[] = {
        {"config", required_argument, NULL, 'c'}, {"check", no_argument, NULL, 'k'},
        {"live", no_argument, NULL, 'L'},         {"version", no_argument, NULL, 'V'},
        {"help", no_argument, NULL, 'h'},         {NULL, 0, NULL, 0},
    };
    char err[512];
    int opt;

    a->xargs = obx_calloc((size_t)argc + 1, sizeof(char *));
    if (!a->xargs) {
        fprintf(stderr, "outboxd: out of memory\n");
        return EXIT_RUNTIME;
    }
    *check_only = false;
    *live = false;
    while ((opt = getopt_long(argc, argv, "c:X:Vh", longopts, NULL)) != -1) {
        switch (opt) {
        case 'c':
            a->config_path = optarg;
            break;
        case 'X':
            a->xargs[a->n_xargs++] = optarg;
            break;
        case 'k':
            *check_only = true;
            break;
        case 'L':
            *live = true;
            break;
        case 'V':
            printf("outboxd %s (librdkafka %s, libpq %d, libuv %s)\n", OBX_VERSION,
                   rd_kafka_version_str(), PQlibVersion(), uv_version_string());
            return EXIT_DONE;
        case 'h':
            usage(stdout);
            return EXIT_DONE;
        default:
            fprintf(stderr, "Try 'outboxd --help'.\n");
            return EXIT_USAGE;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "outboxd: unexpected argument '%s'\nTry 'outboxd --help'.\n", argv[optind]);
        return EXIT_USAGE;
    }
    if (*live && !*check_only) {
        fprintf(stderr, "outboxd: --live goes with --check\nTry 'outboxd --help'.\n");
        return EXIT_USAGE;
    }
    if (build_config(a, &a->cfg, err, sizeof(err)) != 0) {
        fprintf(stderr, "outboxd: %s\n", err);
        return EXIT_USAGE;
    }
    a->cfg_loaded = true;
    return 0;
}

/* SIGHUP: read the configuration again and apply what can change while
 * running (log.level, log.format); other changes need a restart. */
static void reload(struct app *a)
{
    struct obx_config fresh;
    char err[512];
    if (build_config(a, &fresh, err, sizeof(err)) != 0) {
        obx_event(OBX_LOG_ERROR, "reload_refused", "SIGHUP: configuration not reloaded: %s", err);
        return;
    }
    obx_log_setup((enum obx_log_level)fresh.log_level, (enum obx_log_format)fresh.log_format);
    a->cfg.log_level = fresh.log_level;
    a->cfg.log_format = fresh.log_format;
    obx_event(OBX_LOG_INFO, "reloaded",
              "SIGHUP: log level %s, format %s; other settings take effect after a restart",
              obx_log_level_name((enum obx_log_level)fresh.log_level),
              fresh.log_format == OBX_LOG_JSON ? "json" : "text");
    obx_config_free(&fresh);
}

static int start(struct app *a)
{
    static const struct obx_pg_callbacks pg_cb = {.ready = pg_ready, .lost = pg_lost};
    static const struct obx_kafka_callbacks kafka_cb = {
        .delivery = kafka_delivery, .fatal = kafka_fatal, .txn_done = kafka_txn_done};
    static const struct obx_recovery_callbacks recovery_cb = {.done = recovery_done,
                                                              .log_state = recovery_log_state};
    struct obx_relay_settings rs;
    char err[512];

    if (obx_kafka_new(&a->loop, &a->cfg, &kafka_cb, a, &a->kafka, err, sizeof(err)) != 0) {
        obx_error("%s", err);
        return EXIT_USAGE;
    }
    obx_relay_settings_from_config(&rs, &a->cfg);
    rs.max_payload = obx_kafka_max_message_bytes(a->kafka);
    /* A finite message timeout parks a key's later rows behind its record
     * at Kafka (relay.h); in a transaction a record that times out aborts
     * it, and the later records of its key with it. */
    rs.one_per_key = !a->cfg.transactions && obx_kafka_message_timeout_ms(a->kafka) != 0;
    rs.transaction_timeout_ms = obx_kafka_transaction_timeout_ms(a->kafka);
    if (obx_relay_new(&rs, &relay_ops, a, a->kafka, &a->relay) != 0) {
        obx_error("out of memory allocating %d seats for rows in flight", a->cfg.max_in_flight);
        close_parts(a);
        return EXIT_RUNTIME;
    }
    if (obx_pg_new(&a->loop, &a->cfg, &pg_cb, a, &a->pg, err, sizeof(err)) != 0) {
        obx_error("%s", err);
        close_parts(a);
        return EXIT_USAGE;
    }
    if (obx_recovery_new(&a->loop, &a->cfg, a->pg, &recovery_cb, a, &a->recovery) != 0 ||
        obx_maint_new(&a->loop, &a->cfg, a->cfg.http_listen[0] != '\0', &a->maint) != 0) {
        obx_error("out of memory");
        close_parts(a);
        return EXIT_RUNTIME;
    }
    struct obx_health_parts parts = {.loop = &a->loop,
                                     .cfg = &a->cfg,
                                     .pg = a->pg,
                                     .kafka = a->kafka,
                                     .relay = a->relay,
                                     .recovery = a->recovery,
                                     .maint = a->maint};
    obx_health_init(&a->health, &parts);
    if (a->cfg.http_listen[0] != '\0' &&
        obx_http_new(&a->loop, a->cfg.http_listen, obx_health_http, &a->health, &a->http, err,
                     sizeof(err)) != 0) {
        /* A port in use is a deployment error: say so at once, exit 2. */
        obx_error("%s", err);
        close_parts(a);
        return EXIT_USAGE;
    }
    uv_signal_init(&a->loop, &a->sigterm);
    uv_signal_init(&a->loop, &a->sigint);
    uv_signal_init(&a->loop, &a->sighup);
    a->sigterm.data = a->sigint.data = a->sighup.data = a;
    uv_signal_start(&a->sigterm, on_signal, SIGTERM);
    uv_signal_start(&a->sigint, on_signal, SIGINT);
    uv_signal_start(&a->sighup, on_signal, SIGHUP);
    if (early_signal)
        raise(early_signal); /* now handled by the loop */
    uv_timer_init(&a->loop, &a->housekeeping);
    uv_timer_init(&a->loop, &a->teardown);
    uv_timer_init(&a->loop, &a->last_exit);
    uv_timer_init(&a->loop, &a->look);
    a->housekeeping.data = a->teardown.data = a->last_exit.data = a->look.data = a;
    uv_timer_start(&a->housekeeping, on_housekeeping, HOUSEKEEPING_MS, HOUSEKEEPING_MS);
    obx_kafka_probe(a->kafka);
    a->next_probe = (int64_t)uv_now(&a->loop) + KAFKA_PROBE_MS;
    obx_event(OBX_LOG_INFO, "starting",
              "outboxd %s starting: batch %d, max in flight %d, on_sent=%s", OBX_VERSION,
              a->cfg.batch_size, a->cfg.max_in_flight,
              a->cfg.on_sent == OBX_ON_SENT_DELETE ? "delete"
              : a->cfg.on_sent == OBX_ON_SENT_LOG  ? "log"
                                                   : "mark");
    obx_pg_start(a->pg);
    if (a->early_fatal[0]) /* now that every part exists, as for an early signal */
        obx_relay_fatal(a->relay, a->early_fatal, (int64_t)uv_now(&a->loop));
    return 0;
}

/* `--check [--live]`, or a configuration that failed to load: says what
 * it found and returns the exit code. */
static int check_and_exit(struct app *a, int rc, bool live)
{
    catch_early_signals(false); /* --check --live may wait on the network */
    if (early_signal)
        raise(early_signal);
    for (size_t i = 0; rc == 0 && i < a->n_weakened; i++)
        printf("outboxd: warning: %s\n", a->weakened[i]);
    if (rc == 0)
        printf("outboxd: configuration OK\n");
    if (rc == 0 && live) {
        int problems = obx_check_live(&a->cfg, stdout);
        if (problems > 0) {
            printf("outboxd: live check found %d problem%s\n", problems, problems == 1 ? "" : "s");
            rc = EXIT_RUNTIME;
        } else {
            printf("outboxd: live check passed\n");
        }
    }
    if (a->cfg_loaded)
        obx_config_free(&a->cfg);
    obx_free(a->xargs);
    return rc;
}

int main(int argc, char **argv)
{
    struct app a;
    struct sigaction ign;
    bool check_only = false, live = false;
    char err[512];
    int rc;

    memset(&a, 0, sizeof(a));
    memset(&ign, 0, sizeof(ign));
    ign.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &ign, NULL);
    srand((unsigned)time(NULL) ^ (unsigned)getpid());

    if (argc > 1 && obx_tool_is(argv[1]))
        return run_tool(argc - 1, argv + 1);
    catch_early_signals(true);
    rc = load_config(&a, argc, argv, &check_only, &live);
    if (rc == EXIT_DONE) {
        obx_free(a.xargs);
        return 0;
    }
    if (rc == 0 && obx_failpoints_parse(&obx_failpoints_active, getenv("OUTBOXD_FAILPOINTS"), err,
                                        sizeof(err)) != 0) {
        fprintf(stderr, "outboxd: %s\n", err);
        rc = EXIT_USAGE;
    }
    if (rc != 0 || check_only)
        return check_and_exit(&a, rc, live);
    obx_log_setup((enum obx_log_level)a.cfg.log_level, (enum obx_log_format)a.cfg.log_format);
    if (obx_failpoints_active.armed)
        obx_warn("failpoints armed: %s", getenv("OUTBOXD_FAILPOINTS"));
    for (size_t i = 0; i < a.n_weakened; i++)
        obx_warn("%s", a.weakened[i]);

    if (uv_loop_init(&a.loop) != 0) {
        obx_error("cannot initialise the event loop");
        obx_config_free(&a.cfg);
        obx_free(a.xargs);
        return EXIT_RUNTIME;
    }
    rc = start(&a);
    if (rc == 0) {
        uv_run(&a.loop, UV_RUN_DEFAULT);
        rc = a.exit_code;
        obx_info("outboxd stopped (exit %d, %llu rows marked)", rc,
                 (unsigned long long)obx_relay_marked_total(a.relay));
    }
    /* The last-resort timer, and close callbacks of anything closed on an
     * error path. */
    if (a.last_exit.loop && !uv_is_closing((uv_handle_t *)&a.last_exit))
        uv_close((uv_handle_t *)&a.last_exit, NULL);
    uv_run(&a.loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&a.loop) != 0)
        obx_warn("event loop closed with handles still open");
    obx_relay_free(a.relay);
    obx_config_free(&a.cfg);
    obx_free(a.xargs);
    return rc;
}
