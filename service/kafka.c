/*
 * kafka: see include/outboxd/kafka.h.
 */
#include "outboxd/kafka.h"
#include "outboxd/alloc.h"
#include "outboxd/log.h"
#include "outboxd/metrics.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct obx_kafka {
    rd_kafka_t *rk;
    rd_kafka_queue_t *mainq;
    struct obx_kafka_callbacks cb;
    void *arg;
    int pipe_rd, pipe_wr;
    uv_poll_t poll;
    bool fatal_reported;
    bool closing;
    /* After a refused batch, librdkafka stops the producer rather than let
     * later records of the partition go first (enable.gapless.guarantee).
     * We purge what it holds, wait for every report, and start a new one
     * from this copy of the configuration. */
    rd_kafka_conf_t *conf_copy;
    /* Rows tried alone go through a second producer, made on first use,
     * without the gapless guarantee: one record at a time needs none, and
     * a refusal there stops no producer (the first one would be purged and
     * restarted each time a refused row is tried again). */
    rd_kafka_t *alone_rk;
    rd_kafka_queue_t *alone_q;
    bool resetting;
    bool purged; /* of the reset under way */
    int resets;
    /* Connectivity probe: a metadata request in the thread pool. */
    uv_work_t probe;
    bool probe_busy;
    char history[64];           /* record.history's value */
    bool probe_ok;              /* written by the worker, read in after_work */
    bool connected;             /* the last probe's answer */
    int refs;                   /* the poll handle and a running probe hold k */
    int64_t message_timeout_ms; /* 0 = for ever */
    int64_t max_message_bytes;
    char reason[160];                   /* the last refusal's reason */
    struct obx_record_opts record;      /* record.format and its settings */
    struct obx_headers headers;         /* a row's parsed headers, reused */
    struct obx_labelled published;      /* records acknowledged, by topic */
    struct obx_labelled publish_errors; /* failed produce or delivery, by reason */
    /* relay.transactions: the call running in the thread pool (one at a
     * time), the transactional.id of the producer, and an init that waits
     * for the probe (which may be using the producer it replaces). */
    uv_work_t txn_work;
    bool txn_busy;
    bool txn_init_waiting;
    bool txn_call_init; /* the call running: init, else txn_call_end */
    enum obx_txn_end txn_call_end;
    rd_kafka_t *txn_rk;
    rd_kafka_error_t *txn_error; /* written by the worker */
    bool txn_broken; /* the transactional producer hit a fatal error: the next init replaces it */
    char txn_id[256];
    /* Topics the coordinator would not add to the open transaction (see
     * note_txn_refusal): their records' purge reports are refusals. */
    struct {
        char topic[250];
        char reason[96];
        rd_kafka_resp_err_t err;
    } txn_refused[4];
    int n_txn_refused;
    /* relay.transactions with relay.shards: producers made only to fence
     * the ids of slots' lost owners (obx_kafka_txn_fence), one run at a
     * time; their configurations are made on the loop. */
    uv_work_t fence_work;
    bool fence_busy;
    rd_kafka_conf_t **fence_confs;
    char **fence_ids;
    size_t n_fence;
    obx_kafka_fence_fn fence_done;
    void *fence_arg;
    char fence_error[320]; /* written by the worker */
};

/* Errors that refuse a whole batch, not a record: any record in it may be
 * the cause, or none (the batch is too large as a whole). */
static bool error_refuses_batch(rd_kafka_resp_err_t err)
{
    return err == RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE ||
           err == RD_KAFKA_RESP_ERR_RECORD_LIST_TOO_LARGE || err == RD_KAFKA_RESP_ERR_INVALID_MSG ||
           err == RD_KAFKA_RESP_ERR_INVALID_RECORD;
}

/* Errors that refuse every record of the topic, whichever. */
static bool error_refuses_topic(rd_kafka_resp_err_t err)
{
    return err == RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART ||
           err == RD_KAFKA_RESP_ERR__UNKNOWN_TOPIC || err == RD_KAFKA_RESP_ERR_TOPIC_EXCEPTION ||
           err == RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED;
}

bool obx_kafka_error_is_permanent(rd_kafka_resp_err_t err)
{
    switch (err) {
    case RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE:
    case RD_KAFKA_RESP_ERR_RECORD_LIST_TOO_LARGE:
    case RD_KAFKA_RESP_ERR_INVALID_MSG:
    case RD_KAFKA_RESP_ERR_INVALID_RECORD:
    case RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART:
    case RD_KAFKA_RESP_ERR__UNKNOWN_TOPIC:
    case RD_KAFKA_RESP_ERR__UNKNOWN_PARTITION:
    case RD_KAFKA_RESP_ERR_TOPIC_EXCEPTION:
    case RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED:
    case RD_KAFKA_RESP_ERR_POLICY_VIOLATION:
    case RD_KAFKA_RESP_ERR__INVALID_ARG:
        return true;
    default:
        return false;
    }
}

/* A partition the coordinator would not add to the transaction (a topic
 * the producer may not write, one that does not exist) fails the whole
 * transaction, and every record of it comes back purged, with nothing to
 * say which topic was at fault; a relay that sent the rows again would
 * fail the same way for ever. librdkafka names the partition only in its
 * ADDPARTS log line, 'Failed to add partition "TOPIC" [P] to transaction:
 * Broker: REASON', which is matched here against librdkafka's own texts of
 * the errors that refuse a topic (the partitions "not attempted" beside it
 * are not at fault). A line that does not match changes nothing: the rows
 * are then retried as before. */
static void note_txn_refusal(struct obx_kafka *k, const char *buf)
{
    static const char head[] = "Failed to add partition \"";
    const char *t = strstr(buf, head);
    const char *q = t ? strstr(t + sizeof(head) - 1, "\" [") : NULL;
    const char *why = q ? strstr(q, "to transaction: Broker: ") : NULL;
    if (!why || k->n_txn_refused >= (int)(sizeof(k->txn_refused) / sizeof(k->txn_refused[0])))
        return;
    t += sizeof(head) - 1;
    why += strlen("to transaction: ");
    static const rd_kafka_resp_err_t topic_errors[] = {
        RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED,
        RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART,
        RD_KAFKA_RESP_ERR_TOPIC_EXCEPTION,
    };
    rd_kafka_resp_err_t err = RD_KAFKA_RESP_ERR_NO_ERROR;
    for (size_t i = 0; i < sizeof(topic_errors) / sizeof(topic_errors[0]); i++)
        if (strcmp(why, rd_kafka_err2str(topic_errors[i])) == 0)
            err = topic_errors[i];
    size_t len = (size_t)(q - t);
    if (!err || len == 0 || len >= sizeof(k->txn_refused[0].topic))
        return;
    for (int i = 0; i < k->n_txn_refused; i++)
        if (strlen(k->txn_refused[i].topic) == len && memcmp(k->txn_refused[i].topic, t, len) == 0)
            return;
    memcpy(k->txn_refused[k->n_txn_refused].topic, t, len);
    k->txn_refused[k->n_txn_refused].topic[len] = '\0';
    snprintf(k->txn_refused[k->n_txn_refused].reason, sizeof(k->txn_refused[0].reason),
             "%s (adding the topic to a transaction)", why);
    k->txn_refused[k->n_txn_refused].err = err;
    k->n_txn_refused++;
}

/* The refusal of `topic` by the coordinator in the open transaction, or
 * -1. */
static int txn_refusal_of(const struct obx_kafka *k, const char *topic)
{
    for (int i = 0; i < k->n_txn_refused; i++)
        if (strcmp(k->txn_refused[i].topic, topic) == 0)
            return i;
    return -1;
}

static int serve(struct obx_kafka *k);
static enum obx_produce_result produce_with(struct obx_kafka *k, rd_kafka_t *rk,
                                            const struct obx_row *row, void *opaque,
                                            const char **reason);

static void on_delivery(rd_kafka_t *rk, const rd_kafka_message_t *m, void *opaque)
{
    struct obx_kafka *k = opaque;
    enum obx_delivery outcome = OBX_DELIVERED;
    (void)rk;
    if (k->closing)
        return;
    const char *refused = NULL;
    int ri = m->err && k->n_txn_refused > 0 &&
                     (m->err == RD_KAFKA_RESP_ERR__PURGE_QUEUE ||
                      m->err == RD_KAFKA_RESP_ERR__PURGE_INFLIGHT)
                 ? txn_refusal_of(k, rd_kafka_topic_name(m->rkt))
                 : -1;
    if (ri >= 0) {
        outcome = OBX_DELIVERY_TOPIC_REFUSED;
        refused = k->txn_refused[ri].reason;
        obx_labelled_inc(&k->publish_errors, rd_kafka_err2name(k->txn_refused[ri].err));
    } else if (m->err) {
        /* librdkafka knows whether the record may have reached the broker
         * (a request timed out in flight): then it is not "not persisted". */
        if (rd_kafka_message_status(m) == RD_KAFKA_MSG_STATUS_POSSIBLY_PERSISTED)
            outcome = OBX_DELIVERY_UNKNOWN;
        else if (error_refuses_batch(m->err))
            outcome = OBX_DELIVERY_BATCH_REFUSED;
        else if (error_refuses_topic(m->err))
            outcome = OBX_DELIVERY_TOPIC_REFUSED;
        else
            outcome =
                obx_kafka_error_is_permanent(m->err) ? OBX_DELIVERY_REFUSED : OBX_DELIVERY_RETRY;
        obx_labelled_inc(&k->publish_errors, rd_kafka_err2name(m->err));
    } else {
        obx_labelled_inc(&k->published, rd_kafka_topic_name(m->rkt));
    }
    k->cb.delivery(m->_private, outcome, m->partition, m->offset, m->key, m->key_len,
                   refused  ? refused
                   : m->err ? rd_kafka_err2str(m->err)
                            : NULL,
                   k->arg);
}

static void on_error(rd_kafka_t *rk, int err, const char *reason, void *opaque)
{
    struct obx_kafka *k = opaque;
    char fatal[512];

    if (err == RD_KAFKA_RESP_ERR__FATAL) {
        rd_kafka_resp_err_t orig = rd_kafka_fatal_error(rk, fatal, sizeof(fatal));
        if (orig == RD_KAFKA_RESP_ERR__GAPLESS_GUARANTEE && !k->closing) {
            /* A refusal, not a broken producer (DESIGN G6): serve() replaces it. */
            if (!k->resetting)
                obx_warn("kafka: librdkafka stopped the producer after a refused batch, so "
                         "that no later record of its partition goes first (%s); the records "
                         "it holds come back for a retry and a new producer takes over",
                         fatal);
            k->resetting = true;
            return;
        }
        if (k->txn_id[0] && !k->closing) {
            /* A transactional producer is fenced when its transaction timed
             * out at the broker (a long outage) or another one took its id,
             * and stops at any fatal error: a new one, made by the next
             * session's init, fences in turn and ends what is open. */
            if (!k->txn_broken)
                obx_warn("kafka: the transactional producer cannot go on: %s %s; a new one "
                         "takes over after a recovery pass",
                         rd_kafka_err2name(orig), fatal);
            k->txn_broken = true;
            return;
        }
        obx_error("kafka: fatal error %s: %s", rd_kafka_err2name(orig), fatal);
        if (!k->fatal_reported && !k->closing) {
            k->fatal_reported = true;
            k->cb.fatal(fatal, k->arg);
        }
        return;
    }
    /* Everything else (brokers down, timeouts) is retried by librdkafka. */
    obx_warn("kafka: %s: %s", rd_kafka_err2name((rd_kafka_resp_err_t)err), reason);
}

void obx_kafka_log_cb(const rd_kafka_t *rk, int level, const char *fac, const char *buf)
{
    (void)rk;
    /* syslog levels: 0-3 error, 4 warning, 5-6 notice/info, 7 debug */
    enum obx_log_level l = level <= 3   ? OBX_LOG_ERROR
                           : level == 4 ? OBX_LOG_WARN
                           : level <= 6 ? OBX_LOG_INFO
                                        : OBX_LOG_DEBUG;
    obx_log(l, "librdkafka %s %s: %s", rk ? rd_kafka_name(rk) : "?", fac, buf);
}

/* Delivery reports, errors and logs come as events (rd_kafka_conf_set_events),
 * served here on the loop thread: a call that waits for the reports in the
 * thread pool (a transaction's commit or abort flushes) then only waits,
 * where in callback mode librdkafka's flush would run our callbacks on
 * that thread. Other ops are served through their callbacks by the poll. */
#define PRODUCER_EVENTS (RD_KAFKA_EVENT_DR | RD_KAFKA_EVENT_ERROR | RD_KAFKA_EVENT_LOG)

static void serve_event(struct obx_kafka *k, rd_kafka_t *rk, rd_kafka_event_t *ev)
{
    switch (rd_kafka_event_type(ev)) {
    case RD_KAFKA_EVENT_DR: {
        const rd_kafka_message_t *m;
        while (!k->closing && (m = rd_kafka_event_message_next(ev)))
            on_delivery(rk, m, k);
        break;
    }
    case RD_KAFKA_EVENT_ERROR:
        on_error(rk,
                 rd_kafka_event_error_is_fatal(ev) ? RD_KAFKA_RESP_ERR__FATAL
                                                   : rd_kafka_event_error(ev),
                 rd_kafka_event_error_string(ev), k);
        break;
    case RD_KAFKA_EVENT_LOG: {
        const char *fac, *buf;
        int level;
        if (rd_kafka_event_log(ev, &fac, &buf, &level) != 0)
            break;
        if (rk == k->txn_rk && strcmp(fac, "ADDPARTS") == 0)
            note_txn_refusal(k, buf);
        obx_kafka_log_cb(rk, level, fac, buf);
        break;
    }
    default:
        break;
    }
}

/* Serves producer `rk`'s main queue `q` until it is empty; how many events. */
static int serve_queue(struct obx_kafka *k, rd_kafka_t *rk, rd_kafka_queue_t *q)
{
    int n = 0;
    rd_kafka_event_t *ev;
    while (!k->closing && rk && q && (ev = rd_kafka_queue_poll(q, 0))) {
        serve_event(k, rk, ev);
        rd_kafka_event_destroy(ev);
        n++;
    }
    return n;
}

static int conf_set(rd_kafka_conf_t *conf, const char *name, const char *value, const char *origin,
                    char *err, size_t errlen)
{
    char why[256];
    if (rd_kafka_conf_set(conf, name, value, why, sizeof(why)) != RD_KAFKA_CONF_OK) {
        /* librdkafka's message may quote the value; secrets (sasl.password)
         * must not reach the terminal, so name only the key. */
        bool secret = strstr(name, "password") || strstr(name, "secret") || strstr(name, "key");
        snprintf(err, errlen, "%s: kafka.%s: %s", origin, name, secret ? "invalid value" : why);
        return -1;
    }
    return 0;
}

/* Producer settings we set before the user's kafka.* keys. */
static const char *const producer_defaults[][2] = {
    {"enable.idempotence", "true"},
    /* A batch refused for good must not let later records of its
     * partition go first (G3): librdkafka then stops the producer and
     * we replace it (see serve()). */
    {"enable.gapless.guarantee", "true"},
    {"message.timeout.ms", "0"},
    /* One Produce request at a time per broker: librdkafka 2.0.2 answers
     * a refusal behind a failed request by bumping the producer epoch,
     * and resends a record whose earlier send may have been stored
     * (replication timed out, connection lost) under the new epoch,
     * where the broker cannot recognise it: a duplicate. With one
     * request in flight there is nothing behind a failure to refuse. */
    {"max.in.flight.requests.per.connection", "1"},
    {"partitioner", "murmur2_random"},
    {"client.id", "outboxd"},
    /* librdkafka's 5 ms cost 4 ms of p99 at 1,000 events/s; under a
     * backlog, batches fill from the 1,000-row fetches anyway. */
    {"linger.ms", "1"},
};

#define N_PRODUCER_DEFAULTS (sizeof(producer_defaults) / sizeof(producer_defaults[0]))

size_t obx_kafka_producer_default_count(void)
{
    return N_PRODUCER_DEFAULTS;
}

void obx_kafka_producer_default(size_t i, const char **name, const char **value)
{
    *name = i < N_PRODUCER_DEFAULTS ? producer_defaults[i][0] : NULL;
    *value = i < N_PRODUCER_DEFAULTS ? producer_defaults[i][1] : NULL;
}

int obx_kafka_conf_build(const struct obx_config *cfg, enum obx_kafka_role role,
                         rd_kafka_conf_t **out, char *err, size_t errlen)
{
    rd_kafka_conf_t *conf = rd_kafka_conf_new();
    if (!conf) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (size_t i = 0; role == OBX_KAFKA_PRODUCER && i < N_PRODUCER_DEFAULTS; i++) {
        /* Transactions: a record that fails makes its transaction
         * abortable, and the abort takes the later records of its
         * partition with it: the idempotent producer's gapless stop has
         * nothing to add (librdkafka's default leaves it off). */
        if (cfg->transactions && strcmp(producer_defaults[i][0], "enable.gapless.guarantee") == 0)
            continue;
        if (conf_set(conf, producer_defaults[i][0], producer_defaults[i][1], "default", err,
                     errlen) != 0)
            goto fail;
    }
    for (size_t i = 0; i < cfg->kafka_count; i++)
        if (conf_set(conf, cfg->kafka[i].name, cfg->kafka[i].value, cfg->kafka[i].origin, err,
                     errlen) != 0)
            goto fail;
    /* Transactions: an open transaction holds back every read_committed
     * consumer of its partitions, so its timeout is short (Kafka Streams'
     * 10 s): a relay that dies with one open leaves them waiting at most
     * that long, and one that takes over aborts it at once. The message
     * and socket timeouts go down to it, as librdkafka requires. */
    if (role == OBX_KAFKA_PRODUCER && cfg->transactions) {
        const char *txn_timeout = obx_config_kafka_get(cfg, "transaction.timeout.ms");
        if (!txn_timeout)
            txn_timeout = OBX_KAFKA_TXN_TIMEOUT_MS;
        /* socket.timeout.ms may not exceed it: lowered when the
         * transaction's is below librdkafka's default (60 s). */
        bool socket_too = strtoll(txn_timeout, NULL, 10) < 60000;
        static const char *const follow[] = {"transaction.timeout.ms", "message.timeout.ms",
                                             "socket.timeout.ms"};
        for (size_t i = 0; i < sizeof(follow) / sizeof(follow[0]) - !socket_too; i++)
            if (!obx_config_kafka_get(cfg, follow[i]) &&
                conf_set(conf, follow[i], txn_timeout, "relay.transactions", err, errlen) != 0)
                goto fail;
    }
    /* Ours, after the user's: the loop integration depends on them. */
    if (role == OBX_KAFKA_PRODUCER &&
        conf_set(conf, "log.queue", "true", "outboxd", err, errlen) != 0)
        goto fail;
    *out = conf;
    return 0;
fail:
    rd_kafka_conf_destroy(conf);
    return -1;
}

/* The producer's value of `name` into v ("" when it has none). */
static const char *prop(const rd_kafka_conf_t *conf, const char *name, char *v, size_t cap)
{
    size_t len = cap;
    if (rd_kafka_conf_get(conf, name, v, &len) != RD_KAFKA_CONF_OK)
        v[0] = '\0';
    return v;
}

size_t obx_kafka_weakened_guarantees(const rd_kafka_conf_t *conf, bool transactions,
                                     char (*out)[384], size_t max)
{
    char v[64];
    size_t n = 0;
    if (n < max && strcmp(prop(conf, "enable.idempotence", v, sizeof(v)), "false") == 0)
        snprintf(out[n++], sizeof(out[0]),
                 "kafka.enable.idempotence=false: librdkafka's own retries may then store a "
                 "record twice or out of order (no-duplicates and per-key order no longer hold)");
    if (n < max && !transactions &&
        strcmp(prop(conf, "message.timeout.ms", v, sizeof(v)), "0") != 0)
        snprintf(out[n++], sizeof(out[0]),
                 "kafka.message.timeout.ms=%s: a record not acknowledged within %s ms fails and "
                 "is published again (after a recovery pass if it may have landed); a key's "
                 "next record waits for the one before (slower for busy keys); 0 (our "
                 "default) retries for ever",
                 v, v);
    if (n < max && !transactions &&
        strcmp(prop(conf, "enable.gapless.guarantee", v, sizeof(v)), "false") == 0)
        snprintf(out[n++], sizeof(out[0]),
                 "kafka.enable.gapless.guarantee=false: when Kafka refuses a batch for good "
                 "(too large, not authorized), later records of its keys may be stored before "
                 "the refused one is retried (per-key order no longer holds)");
    if (n < max &&
        strcmp(prop(conf, "max.in.flight.requests.per.connection", v, sizeof(v)), "1") != 0)
        snprintf(out[n++], sizeof(out[0]),
                 "kafka.max.in.flight.requests.per.connection=%s: after a refusal behind other "
                 "requests librdkafka resends, under a new epoch, records that may be stored "
                 "(stored twice: no-duplicates no longer holds), and takes a partition's first "
                 "records, refused before any was stored, as stored once a later one is (lost: "
                 "no-loss no longer holds); 1 is our default",
                 v);
    if (n < max && strcmp(prop(conf, "acks", v, sizeof(v)), "-1") != 0 && strcmp(v, "all") != 0)
        snprintf(out[n++], sizeof(out[0]),
                 "kafka.acks=%s: a record acknowledged by fewer than all in-sync replicas can "
                 "be lost with its broker (no-loss no longer holds)",
                 v);
    return n;
}

int obx_kafka_conf_check_transactions(const rd_kafka_conf_t *conf, char *err, size_t errlen)
{
    char why[512], v[32];
    if (strcmp(prop(conf, "message.timeout.ms", v, sizeof(v)), "0") == 0) {
        snprintf(err, errlen,
                 "kafka.message.timeout.ms = 0 with relay.transactions = on: a record must time "
                 "out within its transaction (at most kafka.transaction.timeout.ms)");
        return -1;
    }
    /* librdkafka checks a transactional producer's settings only when one
     * is made: make one (it connects to nothing before init_transactions). */
    rd_kafka_conf_t *c = rd_kafka_conf_dup(conf);
    if (!c || rd_kafka_conf_set(c, "transactional.id", "outboxd-settings-check", why,
                                sizeof(why)) != RD_KAFKA_CONF_OK) {
        if (c)
            rd_kafka_conf_destroy(c);
        snprintf(err, errlen, "relay.transactions: %s", c ? why : "out of memory");
        return -1;
    }
    rd_kafka_t *rk = rd_kafka_new(RD_KAFKA_PRODUCER, c, why, sizeof(why));
    if (!rk) {
        rd_kafka_conf_destroy(c);
        snprintf(err, errlen,
                 "relay.transactions = on, but the Kafka settings do not fit a "
                 "transactional producer: %s",
                 why);
        return -1;
    }
    rd_kafka_destroy(rk);
    return 0;
}

int64_t obx_kafka_transaction_timeout_ms(const struct obx_kafka *k)
{
    char v[32];
    return strtoll(prop(k->conf_copy, "transaction.timeout.ms", v, sizeof(v)), NULL, 10);
}

int64_t obx_kafka_conf_max_message_bytes(const rd_kafka_conf_t *conf)
{
    char value[32];
    size_t len = sizeof(value);
    if (rd_kafka_conf_get(conf, "message.max.bytes", value, &len) != RD_KAFKA_CONF_OK)
        return 1000000; /* librdkafka's default */
    return strtoll(value, NULL, 10);
}

int64_t obx_kafka_max_message_bytes(const struct obx_kafka *k)
{
    return k->max_message_bytes;
}

int64_t obx_kafka_message_timeout_ms(const struct obx_kafka *k)
{
    return k->message_timeout_ms;
}

/* Creates the producer from `conf` (taken over in every case) and routes
 * its queue to our pipe. */
static int client_start(struct obx_kafka *k, rd_kafka_conf_t *conf, char *err, size_t errlen)
{
    char why[512];
    k->rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, why, sizeof(why));
    if (!k->rk) { /* conf is still ours on failure */
        snprintf(err, errlen, "cannot create the Kafka producer: %s", why);
        rd_kafka_conf_destroy(conf);
        return -1;
    }
    k->mainq = rd_kafka_queue_get_main(k->rk);
    if (rd_kafka_set_log_queue(k->rk, k->mainq) != RD_KAFKA_RESP_ERR_NO_ERROR) {
        snprintf(err, errlen, "cannot route librdkafka logs to the loop");
        return -1;
    }
    rd_kafka_queue_io_event_enable(k->mainq, k->pipe_wr, "1", 1);
    return 0;
}

/* Thread pool: rd_kafka_destroy() joins librdkafka's threads. */
struct retired {
    uv_work_t work;
    rd_kafka_t *rk;
    struct obx_kafka *k;
};

static void unref(struct obx_kafka *k);

static void retire_work(uv_work_t *w)
{
    struct retired *old = w->data;
    rd_kafka_destroy(old->rk);
}

static void retire_done(uv_work_t *w, int status)
{
    struct retired *old = w->data;
    (void)status;
    unref(old->k);
    obx_free(old);
}

/* The configuration of a new producer: the first one's, with the
 * transactional.id of relay.transactions once a session gave it. NULL out
 * of memory (said). */
static rd_kafka_conf_t *producer_conf(struct obx_kafka *k)
{
    char why[256];
    rd_kafka_conf_t *conf = rd_kafka_conf_dup(k->conf_copy);
    if (conf && k->txn_id[0] &&
        rd_kafka_conf_set(conf, "transactional.id", k->txn_id, why, sizeof(why)) !=
            RD_KAFKA_CONF_OK) {
        obx_error("kafka: transactional.id %s: %s", k->txn_id, why);
        rd_kafka_conf_destroy(conf);
        return NULL;
    }
    if (!conf)
        obx_warn("kafka: out of memory for a new producer's configuration");
    return conf;
}

/* Destroys the producer in the thread pool (rd_kafka_destroy joins
 * librdkafka's threads); its queue goes now, with whatever it still holds. */
static void retire_producer(struct obx_kafka *k)
{
    struct retired *old = obx_malloc(sizeof(*old));
    rd_kafka_queue_io_event_enable(k->mainq, -1, NULL, 0);
    rd_kafka_queue_destroy(k->mainq);
    k->mainq = NULL;
    if (old) {
        *old = (struct retired){.rk = k->rk, .k = k};
        old->work.data = old;
    }
    if (old && uv_queue_work(k->poll.loop, &old->work, retire_work, retire_done) == 0) {
        k->refs++;
    } else {
        rd_kafka_destroy(k->rk); /* no memory, or no loop: blocks briefly */
        obx_free(old);
    }
    k->rk = NULL;
}

/* Starts the producer that replaces a retired one, from `conf` (taken
 * over). 0, or -1 after reporting a fatal error (k->rk stays NULL: every
 * entry point checks). */
static int replace_producer(struct obx_kafka *k, rd_kafka_conf_t *conf)
{
    char err[600];
    if (client_start(k, conf, err, sizeof(err)) == 0)
        return 0;
    if (k->mainq) {
        rd_kafka_queue_destroy(k->mainq);
        k->mainq = NULL;
    }
    if (k->rk) {
        rd_kafka_destroy(k->rk);
        k->rk = NULL;
    }
    obx_error("kafka: %s", err);
    k->fatal_reported = true;
    k->cb.fatal(err, k->arg);
    return -1;
}

/* The old producer holds nothing any more: a new one (a new producer id,
 * sequence numbers from zero) replaces it. */
static void finish_reset(struct obx_kafka *k)
{
    rd_kafka_conf_t *conf = producer_conf(k);
    if (!conf)
        return; /* tried again at the next serve */
    retire_producer(k);
    k->resetting = false;
    k->purged = false;
    if (replace_producer(k, conf) != 0)
        return;
    k->resets++;
    obx_event(OBX_LOG_INFO, "producer_replaced", "kafka: new producer ready (%d since start)",
              k->resets);
}

/* Serves everything queued; returns how many events were served. The io
 * event fires only when the queue turns non-empty, so leaving ops behind
 * would stall. */
static int serve(struct obx_kafka *k)
{
    int total = serve_queue(k, k->rk, k->mainq) + serve_queue(k, k->alone_rk, k->alone_q);
    if (k->resetting && !k->closing && k->rk) {
        if (!k->purged) {
            /* Queued records were never sent; those in flight may have
             * landed (their reports say so, and the recovery pass looks). */
            k->purged = true;
            rd_kafka_purge(k->rk, RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_INFLIGHT |
                                      RD_KAFKA_PURGE_F_NON_BLOCKING);
        }
        total += serve_queue(k, k->rk, k->mainq);
        if (rd_kafka_outq_len(k->rk) == 0 && !k->probe_busy) {
            finish_reset(k);
            /* Ops the new producer queued before its wake-up was routed. */
            total += serve_queue(k, k->rk, k->mainq);
        }
    }
    return total;
}

static void on_pipe(uv_poll_t *h, int status, int events)
{
    struct obx_kafka *k = h->data;
    char drain[64];
    (void)status;
    (void)events;
    while (read(k->pipe_rd, drain, sizeof(drain)) > 0) {
    }
    serve(k);
}

void obx_kafka_housekeeping(struct obx_kafka *k)
{
    /* A safety net for a lost wake-up: cheap, and it may legitimately find
     * events whose wake-up is merely not processed yet in this loop turn. */
    int n = serve(k);
    if (n > 0)
        obx_debug("kafka: housekeeping served %d events", n);
}

int obx_kafka_new(uv_loop_t *loop, const struct obx_config *cfg,
                  const struct obx_kafka_callbacks *cb, void *arg, struct obx_kafka **out,
                  char *err, size_t errlen)
{
    rd_kafka_conf_t *conf;
    int fds[2];
    struct obx_kafka *k = obx_calloc(1, sizeof(*k));

    if (!k) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if (obx_kafka_conf_build(cfg, OBX_KAFKA_PRODUCER, &conf, err, errlen) != 0) {
        obx_free(k);
        return -1;
    }
    if (pipe2(fds, O_NONBLOCK | O_CLOEXEC) != 0) {
        snprintf(err, errlen, "pipe: %s", strerror(errno));
        rd_kafka_conf_destroy(conf);
        obx_free(k);
        return -1;
    }
    k->pipe_rd = fds[0];
    k->pipe_wr = fds[1];
    k->cb = *cb;
    k->arg = arg;
    k->max_message_bytes = obx_kafka_conf_max_message_bytes(conf);
    /* The effective value: librdkafka keeps whichever of its two names
     * (message.timeout.ms, delivery.timeout.ms) was set last. */
    char timeout[32];
    size_t timeout_len = sizeof(timeout);
    k->message_timeout_ms =
        rd_kafka_conf_get(conf, "message.timeout.ms", timeout, &timeout_len) == RD_KAFKA_CONF_OK
            ? strtoll(timeout, NULL, 10)
            : 0;
    /* cfg outlives the producer (main's, for the whole run). */
    k->record = (struct obx_record_opts){.format = cfg->record_format, .ce_source = cfg->ce_source};
    rd_kafka_conf_set_events(conf, PRODUCER_EVENTS);
    rd_kafka_conf_set_error_cb(conf, on_error);
    rd_kafka_conf_set_log_cb(conf, obx_kafka_log_cb);
    rd_kafka_conf_set_opaque(conf, k);
    k->conf_copy = rd_kafka_conf_dup(conf);
    if (!k->conf_copy) {
        snprintf(err, errlen, "out of memory");
        rd_kafka_conf_destroy(conf);
        goto fail;
    }
    if (client_start(k, conf, err, errlen) != 0)
        goto fail;
    if (uv_poll_init(loop, &k->poll, k->pipe_rd) != 0) {
        snprintf(err, errlen, "cannot watch the librdkafka queue pipe");
        goto fail;
    }
    k->poll.data = k;
    k->refs = 1;
    if (uv_poll_start(&k->poll, UV_READABLE, on_pipe) != 0) {
        snprintf(err, errlen, "cannot watch the librdkafka queue pipe");
        obx_kafka_close(k); /* the handle is initialised: free through its close */
        return -1;
    }
    /* librdkafka writes the wake-up only when the queue turns from empty to
     * non-empty (rd_kafka_q_enq1: `if (rkq->rkq_qlen == 1)`). Ops queued
     * before io_event_enable (start-up logs, "brokers down" errors) would keep
     * it non-empty for ever and nothing would wake us: serve them now. */
    serve(k);
    obx_info("kafka: producer ready for %s (idempotent)",
             obx_config_kafka_get(cfg, "bootstrap.servers"));
    *out = k;
    return 0;
fail:
    if (k->mainq)
        rd_kafka_queue_destroy(k->mainq);
    if (k->rk)
        rd_kafka_destroy(k->rk);
    if (k->conf_copy)
        rd_kafka_conf_destroy(k->conf_copy);
    close(k->pipe_rd);
    close(k->pipe_wr);
    obx_free(k);
    return -1;
}

/* Makes the producer for rows tried alone (see struct obx_kafka): the
 * configuration of the first, without the gapless guarantee. 0, or -1
 * after saying why. */
static int alone_start(struct obx_kafka *k)
{
    char why[512];
    rd_kafka_conf_t *conf = rd_kafka_conf_dup(k->conf_copy);
    if (!conf || rd_kafka_conf_set(conf, "enable.gapless.guarantee", "false", why, sizeof(why)) !=
                     RD_KAFKA_CONF_OK) {
        if (conf)
            rd_kafka_conf_destroy(conf);
        obx_warn("kafka: cannot configure a producer for rows tried alone; they go through "
                 "the first one");
        return -1;
    }
    k->alone_rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, why, sizeof(why));
    if (!k->alone_rk) {
        rd_kafka_conf_destroy(conf);
        obx_warn("kafka: cannot create a producer for rows tried alone (%s); they go through "
                 "the first one",
                 why);
        return -1;
    }
    k->alone_q = rd_kafka_queue_get_main(k->alone_rk);
    rd_kafka_set_log_queue(k->alone_rk, k->alone_q);
    rd_kafka_queue_io_event_enable(k->alone_q, k->pipe_wr, "1", 1);
    obx_info("kafka: a second producer tries refused rows alone, so that a refusal stops no "
             "other record");
    /* What it queued before the wake-up was routed; its own queue only:
     * the relay is in the middle of handing rows out. */
    serve_queue(k, k->alone_rk, k->alone_q);
    return 0;
}

enum obx_produce_result obx_kafka_produce(struct obx_kafka *k, const struct obx_row *row,
                                          void *opaque, const char **reason)
{
    return produce_with(k, k->rk, row, opaque, reason);
}

enum obx_produce_result obx_kafka_produce_alone(struct obx_kafka *k, const struct obx_row *row,
                                                void *opaque, const char **reason)
{
    if (!k->alone_rk && !k->closing && alone_start(k) != 0)
        return obx_kafka_produce(k, row, opaque, reason);
    return produce_with(k, k->alone_rk, row, opaque, reason);
}

static enum obx_produce_result produce_with(struct obx_kafka *k, rd_kafka_t *rk,
                                            const struct obx_row *row, void *opaque,
                                            const char **reason)
{
    rd_kafka_headers_t *hdrs;
    char err[256];
    rd_kafka_resp_err_t e;

    if ((rk == k->rk && k->resetting) || !rk || k->closing)
        return OBX_PRODUCE_BUSY; /* a new producer is on its way */
    if (row->oversize) {
        /* Refused from its stored size, without fetching it (DESIGN G6). */
        snprintf(k->reason, sizeof(k->reason),
                 "row too large: %zu bytes of key, payload and headers, above "
                 "kafka.message.max.bytes (%lld)",
                 row->bytes, (long long)k->max_message_bytes);
        obx_labelled_inc(&k->publish_errors, "MSG_SIZE_TOO_LARGE");
        *reason = k->reason;
        return OBX_PRODUCE_REFUSED;
    }
    if (obx_record_headers(row, &k->record, &k->headers, &hdrs, err, sizeof(err)) != 0) {
        obx_error("kafka: %s", err);
        obx_labelled_inc(&k->publish_errors, "HEADERS_INVALID");
        *reason = "headers could not be encoded";
        return OBX_PRODUCE_REFUSED;
    }
    e = rd_kafka_producev(
        rk, RD_KAFKA_V_TOPIC(row->topic), RD_KAFKA_V_KEY(row->key, row->key ? row->key_len : 0),
        RD_KAFKA_V_VALUE((void *)row->payload, row->payload_len), RD_KAFKA_V_HEADERS(hdrs),
        RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY), RD_KAFKA_V_OPAQUE(opaque), RD_KAFKA_V_END);
    if (e == RD_KAFKA_RESP_ERR_NO_ERROR)
        return OBX_PRODUCE_OK;
    rd_kafka_headers_destroy(hdrs); /* ownership passes only on success */
    /* A full queue passes; after a fatal error the fatal callback stops the
     * relay, so the row just waits. */
    if (e == RD_KAFKA_RESP_ERR__QUEUE_FULL || e == RD_KAFKA_RESP_ERR__FATAL ||
        !obx_kafka_error_is_permanent(e))
        return OBX_PRODUCE_BUSY;
    obx_labelled_inc(&k->publish_errors, rd_kafka_err2name(e));
    *reason = rd_kafka_err2str(e);
    return error_refuses_topic(e) ? OBX_PRODUCE_TOPIC_REFUSED : OBX_PRODUCE_REFUSED;
}

enum obx_produce_result obx_kafka_relay_produce(void *kafka, const struct obx_row *row,
                                                void *opaque, const char **reason)
{
    return obx_kafka_produce(kafka, row, opaque, reason);
}

enum obx_produce_result obx_kafka_relay_produce_alone(void *kafka, const struct obx_row *row,
                                                      void *opaque, const char **reason)
{
    return obx_kafka_produce_alone(kafka, row, opaque, reason);
}

static void unref(struct obx_kafka *k)
{
    if (--k->refs > 0)
        return;
    if (k->rk)
        rd_kafka_destroy(k->rk);
    if (k->alone_rk)
        rd_kafka_destroy(k->alone_rk);
    rd_kafka_conf_destroy(k->conf_copy);
    obx_labelled_free(&k->published);
    obx_labelled_free(&k->publish_errors);
    obx_headers_free(&k->headers);
    close(k->pipe_rd);
    close(k->pipe_wr);
    obx_free(k);
}

static void on_poll_closed(uv_handle_t *h)
{
    unref(h->data);
}

/* Thread pool: a metadata request for brokers only (no topic is created or
 * listed). rd_kafka_metadata() may be called from any thread. */
static void probe_work(uv_work_t *w)
{
    struct obx_kafka *k = w->data;
    const struct rd_kafka_metadata *md = NULL;
    rd_kafka_resp_err_t e = rd_kafka_metadata(k->rk, 0, NULL, &md, OBX_KAFKA_PROBE_TIMEOUT_MS);
    k->probe_ok = e == RD_KAFKA_RESP_ERR_NO_ERROR && md && md->broker_cnt > 0;
    if (md)
        rd_kafka_metadata_destroy(md);
}

static int txn_init_start(struct obx_kafka *k);

static void probe_done(uv_work_t *w, int status)
{
    struct obx_kafka *k = w->data;
    k->probe_busy = false;
    /* An init that waited for the probe: its caller is gone, so a failure
     * is an answer (the caller's pass waits for one either way). */
    if (k->txn_init_waiting && !k->closing && txn_init_start(k) != 0 && k->cb.txn_done)
        k->cb.txn_done(true, OBX_TXN_COMMIT, OBX_TXN_RETRY, "cannot start init_transactions",
                       k->arg);
    if (!k->closing) {
        bool ok = status == 0 && k->probe_ok;
        if (ok != k->connected)
            obx_info("kafka: cluster %s",
                     ok ? "reachable (metadata received)" : "unreachable (no metadata)");
        k->connected = ok;
    }
    unref(k);
}

/* ---- relay.transactions ---- */

static void txn_work(uv_work_t *w)
{
    struct obx_kafka *k = w->data;
    /* -1: the remaining transaction time (init: twice transaction.timeout.ms),
     * as librdkafka recommends; the loop goes on meanwhile. */
    if (k->txn_call_init)
        k->txn_error = rd_kafka_init_transactions(k->txn_rk, -1);
    else if (k->txn_call_end == OBX_TXN_COMMIT)
        k->txn_error = rd_kafka_commit_transaction(k->txn_rk, -1);
    else
        k->txn_error = rd_kafka_abort_transaction(k->txn_rk, -1);
}

static enum obx_txn_result txn_result_of(const rd_kafka_error_t *e)
{
    if (!e)
        return OBX_TXN_OK;
    rd_kafka_resp_err_t code = rd_kafka_error_code(e);
    if (code == RD_KAFKA_RESP_ERR__FENCED || code == RD_KAFKA_RESP_ERR_PRODUCER_FENCED ||
        code == RD_KAFKA_RESP_ERR_INVALID_PRODUCER_EPOCH)
        return OBX_TXN_FENCED;
    if (rd_kafka_error_is_fatal(e))
        return OBX_TXN_FATAL;
    if (rd_kafka_error_txn_requires_abort(e))
        return OBX_TXN_ABORTABLE;
    if (rd_kafka_error_is_retriable(e))
        return OBX_TXN_RETRY;
    /* Neither: a state the call does not fit (aborting with nothing open
     * after a lost answer, say). Retrying cannot help; an abort can. */
    return OBX_TXN_ABORTABLE;
}

static void txn_done(uv_work_t *w, int status)
{
    struct obx_kafka *k = w->data;
    rd_kafka_error_t *e = k->txn_error;
    enum obx_txn_result result = status == 0 ? txn_result_of(e) : OBX_TXN_RETRY;
    char reason[256];
    snprintf(reason, sizeof(reason), "%s", e ? rd_kafka_error_string(e) : "");
    k->txn_error = NULL;
    k->txn_busy = false;
    if (e)
        rd_kafka_error_destroy(e);
    bool init = k->txn_call_init;
    if (!k->closing && k->cb.txn_done)
        k->cb.txn_done(init, k->txn_call_end, result, reason, k->arg);
    unref(k);
}

static int txn_call(struct obx_kafka *k, bool init, enum obx_txn_end end)
{
    if (k->txn_busy || k->closing || !k->rk)
        return -1;
    k->txn_call_init = init;
    k->txn_call_end = end;
    k->txn_rk = k->rk;
    k->txn_work.data = k;
    if (uv_queue_work(k->poll.loop, &k->txn_work, txn_work, txn_done) != 0)
        return -1;
    k->txn_busy = true;
    k->refs++;
    return 0;
}

/* A producer with the transactional.id replaces the one before, and its
 * init_transactions goes to the thread pool. 0, or -1 if it could not
 * start. */
static int txn_init_start(struct obx_kafka *k)
{
    k->txn_init_waiting = false;
    rd_kafka_conf_t *conf = producer_conf(k);
    if (!conf)
        return -1;
    if (rd_kafka_outq_len(k->rk) > 0)
        obx_warn("kafka: the producer replaced for a new session still held %d records; they "
                 "are dropped (their transaction is aborted by the next init or fence of its "
                 "transactional.id, or at its timeout)",
                 rd_kafka_outq_len(k->rk));
    retire_producer(k);
    k->txn_broken = false;
    if (replace_producer(k, conf) != 0)
        return -1;
    serve_queue(k, k->rk, k->mainq);
    return txn_call(k, true, OBX_TXN_COMMIT);
}

int obx_kafka_txn_init(struct obx_kafka *k, const char *transactional_id)
{
    if (k->txn_busy || k->txn_init_waiting || k->closing || !k->rk)
        return -1;
    snprintf(k->txn_id, sizeof(k->txn_id), "%s", transactional_id);
    k->txn_init_waiting = true;
    return k->probe_busy ? 0 : txn_init_start(k);
}

const char *obx_kafka_txn_id(const struct obx_kafka *k)
{
    return k->txn_id;
}

int obx_kafka_txn_begin(struct obx_kafka *k, const char **reason)
{
    if (k->txn_broken) {
        *reason = "the transactional producer hit a fatal error";
        return -2;
    }
    if (k->txn_busy || k->closing || !k->rk) {
        *reason = "the producer is busy";
        return -1;
    }
    rd_kafka_error_t *e = rd_kafka_begin_transaction(k->rk);
    if (!e) {
        k->n_txn_refused = 0; /* the refusals were of the transaction before */
        return 0;
    }
    snprintf(k->reason, sizeof(k->reason), "%s", rd_kafka_error_string(e));
    rd_kafka_error_destroy(e);
    *reason = k->reason;
    return -1;
}

int obx_kafka_txn_end(struct obx_kafka *k, enum obx_txn_end end)
{
    return txn_call(k, false, end);
}

static void fence_work(uv_work_t *w)
{
    struct obx_kafka *k = w->data;
    for (size_t i = 0; i < k->n_fence && !k->fence_error[0]; i++) {
        char why[256];
        rd_kafka_t *rk = rd_kafka_new(RD_KAFKA_PRODUCER, k->fence_confs[i], why, sizeof(why));
        if (!rk) {
            snprintf(k->fence_error, sizeof(k->fence_error), "a producer for %s: %s",
                     k->fence_ids[i], why);
            break;
        }
        k->fence_confs[i] = NULL; /* the producer owns it */
        /* -1: twice transaction.timeout.ms: an owner's commit under way is
         * waited for, an open transaction aborted. */
        rd_kafka_error_t *e = rd_kafka_init_transactions(rk, -1);
        if (e) {
            snprintf(k->fence_error, sizeof(k->fence_error), "init_transactions for %s: %s",
                     k->fence_ids[i], rd_kafka_error_string(e));
            rd_kafka_error_destroy(e);
        }
        rd_kafka_destroy(rk);
    }
}

static void fence_free(struct obx_kafka *k)
{
    for (size_t i = 0; i < k->n_fence; i++) {
        if (k->fence_confs && k->fence_confs[i])
            rd_kafka_conf_destroy(k->fence_confs[i]);
        if (k->fence_ids)
            obx_free(k->fence_ids[i]);
    }
    obx_free(k->fence_confs);
    obx_free(k->fence_ids);
    k->fence_confs = NULL;
    k->fence_ids = NULL;
    k->n_fence = 0;
}

static void fence_after(uv_work_t *w, int status)
{
    struct obx_kafka *k = w->data;
    char why[320];
    snprintf(why, sizeof(why), "%s", status != 0 ? "cancelled" : k->fence_error);
    bool ok = why[0] == '\0';
    fence_free(k);
    k->fence_busy = false;
    if (!k->closing && k->fence_done)
        k->fence_done(ok, why, k->fence_arg);
    unref(k);
}

int obx_kafka_txn_fence(struct obx_kafka *k, const char *const *ids, size_t n,
                        obx_kafka_fence_fn done, void *arg)
{
    /* Not beside an init: one of a session gone could answer while this
     * session's pass waits for the fence. */
    if (k->fence_busy || k->txn_busy || k->txn_init_waiting || k->closing || n == 0)
        return -1;
    k->fence_confs = obx_calloc(n, sizeof(*k->fence_confs));
    k->fence_ids = obx_calloc(n, sizeof(*k->fence_ids));
    k->n_fence = n;
    bool ok = k->fence_confs && k->fence_ids;
    for (size_t i = 0; ok && i < n; i++) {
        char why[256];
        k->fence_ids[i] = obx_strdup(ids[i]);
        k->fence_confs[i] = rd_kafka_conf_dup(k->conf_copy);
        ok = k->fence_ids[i] && k->fence_confs[i] &&
             rd_kafka_conf_set(k->fence_confs[i], "transactional.id", ids[i], why, sizeof(why)) ==
                 RD_KAFKA_CONF_OK;
    }
    if (!ok) {
        if (!k->fence_confs || !k->fence_ids)
            k->n_fence = 0;
        fence_free(k);
        return -1;
    }
    k->fence_error[0] = '\0';
    k->fence_done = done;
    k->fence_arg = arg;
    k->fence_work.data = k;
    if (uv_queue_work(k->poll.loop, &k->fence_work, fence_work, fence_after) != 0) {
        fence_free(k);
        return -1;
    }
    k->fence_busy = true;
    k->refs++;
    return 0;
}

void obx_kafka_set_history(struct obx_kafka *k, const char *history)
{
    snprintf(k->history, sizeof(k->history), "%s", history);
    k->record.history = k->history;
}

void obx_kafka_probe(struct obx_kafka *k)
{
    if (k->probe_busy || k->closing || !k->rk)
        return;
    k->probe.data = k;
    if (uv_queue_work(k->poll.loop, &k->probe, probe_work, probe_done) == 0) {
        k->probe_busy = true;
        k->refs++;
    }
}

void obx_kafka_drop_queued(struct obx_kafka *k)
{
    if (k->closing || !k->rk)
        return;
    int queued = rd_kafka_outq_len(k->rk);
    /* Queued, not yet sent: certainly not persisted, so they come back as
     * RD_KAFKA_RESP_ERR__PURGE_QUEUE reports (retry). Requests already
     * sent are left to finish: purging those could not unsend them. */
    rd_kafka_resp_err_t e =
        rd_kafka_purge(k->rk, RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_NON_BLOCKING);
    if (k->alone_rk)
        rd_kafka_purge(k->alone_rk, RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_NON_BLOCKING);
    if (e != RD_KAFKA_RESP_ERR_NO_ERROR)
        obx_warn("kafka: purging the queue failed: %s", rd_kafka_err2str(e));
    else if (queued > 0)
        obx_info("kafka: dropped the records not yet sent (up to %d in the queue)", queued);
}

bool obx_kafka_connected(const struct obx_kafka *k)
{
    return k->connected;
}

const struct obx_labelled *obx_kafka_published(const struct obx_kafka *k)
{
    return &k->published;
}

const struct obx_labelled *obx_kafka_publish_errors(const struct obx_kafka *k)
{
    return &k->publish_errors;
}

void obx_kafka_close(struct obx_kafka *k)
{
    if (!k || k->closing)
        return;
    k->closing = true;
    if (k->rk) {
        int left = rd_kafka_outq_len(k->rk);
        if (left > 0)
            obx_warn("kafka: discarding %d messages without a delivery report", left);
        rd_kafka_purge(k->rk, RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_INFLIGHT);
    }
    if (k->mainq) {
        rd_kafka_queue_io_event_enable(k->mainq, -1, NULL, 0);
        rd_kafka_queue_destroy(k->mainq);
    }
    if (k->alone_rk) {
        if (rd_kafka_outq_len(k->alone_rk) > 0)
            obx_warn("kafka: discarding a row tried alone without a delivery report");
        rd_kafka_purge(k->alone_rk, RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_INFLIGHT);
        rd_kafka_queue_io_event_enable(k->alone_q, -1, NULL, 0);
        rd_kafka_queue_destroy(k->alone_q);
    }
    /* rd_kafka_destroy waits for the last reference: a running probe. */
    uv_close((uv_handle_t *)&k->poll, on_poll_closed);
}
