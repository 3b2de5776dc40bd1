/*
 * kafka: the idempotent librdkafka producer, wired into the libuv loop.
 *
 * librdkafka's main queue (delivery reports, errors, and its logs, which we
 * forward there) signals a pipe through rd_kafka_queue_io_event_enable(); a
 * uv_poll on the pipe's read end serves the queue on the loop thread. They
 * come as events, not callbacks, so a call that flushes in the thread pool
 * waits for them without serving them there: everything we run on a report
 * runs on the loop thread, and nothing polls two event systems in turn.
 *
 * Defaults set before the user's kafka.* keys (which override them):
 * enable.idempotence=true, message.timeout.ms=0 (retry transient errors for
 * ever, in order, instead of failing rows), enable.gapless.guarantee=true (a
 * batch refused for good stops the producer before a later record of its
 * partition goes out; we then replace the producer in place; not with
 * relay.transactions, where an abort does that), partitioner=murmur2_random (the
 * Java client's key -> partition mapping), client.id=outboxd, linger.ms=1
 * (low latency; a backlog fills batches without waiting).
 */
#ifndef OUTBOXD_KAFKA_H
#define OUTBOXD_KAFKA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "outboxd/config.h"
#include "outboxd/metrics.h"
#include "outboxd/record.h"
#include "outboxd/relay.h"

struct obx_kafka_callbacks {
    /* One delivery report; `opaque` as given to obx_kafka_produce();
     * key/key_len the record's key. */
    void (*delivery)(void *opaque, enum obx_delivery outcome, int32_t partition, int64_t offset,
                     const char *key, size_t key_len, const char *reason, void *arg);
    /* The producer hit a fatal error (e.g. idempotence broken): it cannot
     * produce any more. Called once. */
    void (*fatal)(const char *reason, void *arg);
    /* relay.transactions: the answer of obx_kafka_txn_init (`init` true) or
     * of obx_kafka_txn_end (`end` the call), with librdkafka's reason. */
    void (*txn_done)(bool init, enum obx_txn_end end, enum obx_txn_result result,
                     const char *reason, void *arg);
};

struct obx_kafka;

enum obx_kafka_role {
    OBX_KAFKA_PRODUCER, /* the relay's producer: our defaults, then kafka.* */
    OBX_KAFKA_CONSUMER, /* the recovery reader: kafka.* (connection and security) */
};

/* Builds a librdkafka configuration from cfg without creating a client:
 * what --check runs. Errors name the key and where it was set. On success
 * *out is owned by the caller. */
int obx_kafka_conf_build(const struct obx_config *cfg, enum obx_kafka_role role,
                         rd_kafka_conf_t **out, char *err, size_t errlen) OBX_WARN_UNUSED;

/* Settings of a producer configuration that weaken DESIGN's guarantees
 * (idempotence off, a finite message.timeout.ms, acks below all): one
 * sentence each into out[0..max). Returns how many. */
/* The librdkafka producer settings outboxd sets before the user's kafka.*
 * keys (for the configuration reference); NULLs past the end. */
size_t obx_kafka_producer_default_count(void);
void obx_kafka_producer_default(size_t i, const char **name, const char **value);

/* With `transactions` (relay.transactions), a finite message timeout and
 * no gapless stop weaken nothing: a failed record aborts its transaction. */
size_t obx_kafka_weakened_guarantees(const rd_kafka_conf_t *conf, bool transactions,
                                     char (*out)[384], size_t max);

/* relay.transactions: whether the producer settings fit a transactional
 * producer (librdkafka checks them only when one is made, with a
 * transactional.id): 0, or -1 with a sentence in err. */
int obx_kafka_conf_check_transactions(const rd_kafka_conf_t *conf, char *err,
                                      size_t errlen) OBX_WARN_UNUSED;
/* The producer's effective transaction.timeout.ms. */
int64_t obx_kafka_transaction_timeout_ms(const struct obx_kafka *k);

/* The effective message.max.bytes of a configuration, and of the producer:
 * payloads above it are not even fetched. */
int64_t obx_kafka_conf_max_message_bytes(const rd_kafka_conf_t *conf);
int64_t obx_kafka_max_message_bytes(const struct obx_kafka *k);
/* The producer's effective message.timeout.ms (0 = for ever). */
int64_t obx_kafka_message_timeout_ms(const struct obx_kafka *k);

/* Whether a delivery or produce error is final for the record (too large,
 * unknown topic, not authorized...) rather than passing. */
bool obx_kafka_error_is_permanent(rd_kafka_resp_err_t err);

/* Routes librdkafka's log lines (of any client) into our log. */
void obx_kafka_log_cb(const rd_kafka_t *rk, int level, const char *fac, const char *buf);

int obx_kafka_new(uv_loop_t *loop, const struct obx_config *cfg,
                  const struct obx_kafka_callbacks *cb, void *arg, struct obx_kafka **out,
                  char *err, size_t errlen) OBX_WARN_UNUSED;

/* Hands one row to librdkafka (payload, key and headers are copied). On
 * OBX_PRODUCE_REFUSED, *reason says why (a static string). */
enum obx_produce_result obx_kafka_produce(struct obx_kafka *k, const struct obx_row *row,
                                          void *opaque, const char **reason);
/* The same in the shape of the relay's ops->produce (`kafka` is the struct
 * obx_kafka): the relay hands rows straight to the producer. */
/* As obx_kafka_produce, for a row tried alone (relay.h): through a second
 * producer without the gapless guarantee, made on first use, so that its
 * refusal stops no producer and purges no other record. */
enum obx_produce_result obx_kafka_produce_alone(struct obx_kafka *k, const struct obx_row *row,
                                                void *opaque, const char **reason);
enum obx_produce_result obx_kafka_relay_produce_alone(void *kafka, const struct obx_row *row,
                                                      void *opaque, const char **reason);
enum obx_produce_result obx_kafka_relay_produce(void *kafka, const struct obx_row *row,
                                                void *opaque, const char **reason);

/* Starts a metadata request in the thread pool unless one runs; its answer
 * sets obx_kafka_connected(). */
#define OBX_KAFKA_PROBE_TIMEOUT_MS 3000
void obx_kafka_probe(struct obx_kafka *k);

/* The value of the outbox-history header of the records produced from
 * here on ("" = none): the Postgres session's (obx_pg_history). */
void obx_kafka_set_history(struct obx_kafka *k, const char *history);
/* The relay lost its session (and with it the relay lock): drops what
 * librdkafka has not sent yet, so that nothing of ours lands after another
 * relay's recovery scan; each comes back as a "not delivered" report. */
void obx_kafka_drop_queued(struct obx_kafka *k);
/* Whether the last probe reached a broker. */
bool obx_kafka_connected(const struct obx_kafka *k);
/* Records acknowledged, by topic; failed produce calls and deliveries, by
 * librdkafka error name (for /metrics). */
const struct obx_labelled *obx_kafka_published(const struct obx_kafka *k);
const struct obx_labelled *obx_kafka_publish_errors(const struct obx_kafka *k);

/* ---- relay.transactions ----
 *
 * Each relay session begins with obx_kafka_txn_init: a new producer with
 * the outbox's transactional.id replaces the one before (which must have
 * nothing in flight), and init_transactions, in the thread pool, fences
 * every earlier producer of that id and ends its open transaction (aborted,
 * or its commit finished). Commits and aborts run in the thread pool too,
 * one call at a time; the answers come through cb.txn_done on the loop. */
#define OBX_KAFKA_TXN_TIMEOUT_MS "10000"
/* 0 when the init started (or waits for the probe, then starts): its
 * answer comes through cb.txn_done; -1 when a call is still running or the
 * producer could not be replaced (then nothing comes). */
int obx_kafka_txn_init(struct obx_kafka *k, const char *transactional_id);
/* The transactional.id of the last init started ("" before any). */
const char *obx_kafka_txn_id(const struct obx_kafka *k);
/* Begins a transaction (local, at once): 0, or -1 with *reason, or -2
 * when the producer hit a fatal error (fenced: its transaction timed out
 * at the broker, or another producer took its id): only the next
 * obx_kafka_txn_init's new producer can go on. */
int obx_kafka_txn_begin(struct obx_kafka *k, const char **reason);
/* Commits or aborts the open transaction: 0, or -1 when a call is still
 * running or the producer is gone. */
int obx_kafka_txn_end(struct obx_kafka *k, enum obx_txn_end end);

/* relay.transactions with relay.shards: each relay has a transactional.id
 * of its own, and one that takes a slot its owner lost (without giving it
 * back) fences that owner's id first: a producer with each of `ids` is
 * made and initialised, in the thread pool, which ends whatever that
 * owner left open (aborted, or its commit finished) and fences it should
 * it wake up. `done` answers on the loop. 0 when started; -1 when a fence
 * runs already or it could not start (then nothing comes). */
typedef void (*obx_kafka_fence_fn)(bool ok, const char *reason, void *arg);
int obx_kafka_txn_fence(struct obx_kafka *k, const char *const *ids, size_t n,
                        obx_kafka_fence_fn done, void *arg);

/* Serves librdkafka's queue from the housekeeping timer too. */
void obx_kafka_housekeeping(struct obx_kafka *k);

/* Purges what is still queued (no more delivery callbacks are made for
 * them), destroys the producer and closes the pipe watcher; the struct is
 * freed by the loop. */
void obx_kafka_close(struct obx_kafka *k);

#endif
