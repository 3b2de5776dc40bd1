/*
 * config: the configuration of one outboxd process.
 *
 * One table of keys (service/config.c) drives parsing, validation and --help.
 * Sources, lowest precedence first: built-in defaults, the config file,
 * OUTBOXD_<KEY> environment variables (our own keys only), then -X key=value.
 * Loading happens in two passes: every source is parsed (each value checked
 * against its key's type and range, errors name the key and where it came
 * from), then obx_config_validate() checks what needs all keys at once.
 *
 * Every `kafka.*` key is kept verbatim (without the "kafka." prefix) for
 * rd_kafka_conf_set(); librdkafka checks names and values (see kafka.h).
 *
 * Parsing is ASCII-only and never depends on the locale.
 */
#ifndef OUTBOXD_CONFIG_H
#define OUTBOXD_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define OBX_WARN_UNUSED __attribute__((warn_unused_result))

/* record.format: the Kafka record of a row (DESIGN 1.2), or that record as
 * a CloudEvents 1.0 event in binary content mode (ce_* headers added). */
enum obx_record_format {
    OBX_RECORD_PLAIN = 0,
    OBX_RECORD_CLOUDEVENTS = 1,
};

enum obx_on_sent {
    OBX_ON_SENT_MARK = 0,   /* UPDATE ... SET sent_at = now() */
    OBX_ON_SENT_DELETE = 1, /* DELETE the row once acknowledged */
    OBX_ON_SENT_LOG = 2,    /* nothing per row: a cursor row per acknowledged batch */
};

/* One librdkafka property as given by the user. */
struct obx_kafka_prop {
    char *name;       /* librdkafka name, e.g. "bootstrap.servers" */
    char *value;      /* owned */
    char origin[160]; /* "FILE:LINE", "-X" or "environment NAME": for errors */
};

struct obx_config {
    char *pg_conninfo; /* owned; secret: never logged */
    int64_t pg_statement_timeout_ms;
    int64_t pg_backoff_min_ms;
    int64_t pg_backoff_max_ms;

    int on_sent;          /* enum obx_on_sent */
    int on_reject;        /* enum obx_on_reject (relay.h) */
    int shards;           /* relay.shards: slots the keys hash into (1: one active relay) */
    int transactions;     /* relay.transactions: 0 off, 1 on */
    int transaction_rows; /* relay.transaction_rows */
    int batch_size;
    int max_in_flight;
    int fetch_max_bytes;
    int64_t poll_interval_ms;
    int64_t retry_backoff_ms;
    int64_t shutdown_timeout_ms;
    int64_t stall_timeout_ms; /* 0 = no stall detection */

    int64_t retention_ms; /* 0 = keep sent rows */
    int64_t retention_interval_ms;
    int retention_batch;
    int partition_rows; /* ids per partition of outbox.events */
    int recovery_chunk_records;

    char *http_listen; /* owned; "" = no HTTP endpoints */

    int record_format; /* enum obx_record_format */
    char *ce_source;   /* owned; record.cloudevents_source */

    int log_level;  /* enum obx_log_level */
    int log_format; /* enum obx_log_format */

    struct obx_kafka_prop *kafka; /* owned array */
    size_t kafka_count;
};

/* Signature of getenv(); tests pass a fake. */
typedef const char *obx_getenv_fn(const char *name);

/* Fills defaults. Returns 0, or -1 on allocation failure. */
int obx_config_init(struct obx_config *cfg) OBX_WARN_UNUSED;
void obx_config_free(struct obx_config *cfg);

/* Sets one key from `origin` (e.g. "outboxd.conf:12" or "-X"). On error
 * returns -1 and writes one sentence naming the key and origin to err. */
int obx_config_set(struct obx_config *cfg, const char *key, const char *value, const char *origin,
                   char *err, size_t errlen) OBX_WARN_UNUSED;

/* Parses `key = value` lines from a file (or from `text` for tests). */
int obx_config_load_file(struct obx_config *cfg, const char *path, char *err,
                         size_t errlen) OBX_WARN_UNUSED;
int obx_config_load_text(struct obx_config *cfg, const char *text, const char *name, char *err,
                         size_t errlen) OBX_WARN_UNUSED;

/* Parses one "-X key=value" argument. */
int obx_config_set_arg(struct obx_config *cfg, const char *arg, char *err,
                       size_t errlen) OBX_WARN_UNUSED;

/* Applies OUTBOXD_<KEY> for every key of the table (dots as underscores). */
int obx_config_apply_env(struct obx_config *cfg, obx_getenv_fn *get, char *err,
                         size_t errlen) OBX_WARN_UNUSED;

/* Second pass: required keys, cross-key rules. */
int obx_config_validate(const struct obx_config *cfg, char *err, size_t errlen) OBX_WARN_UNUSED;

/* Value of a kafka property, or NULL. `name` is without the "kafka." prefix. */
const char *obx_config_kafka_get(const struct obx_config *cfg, const char *name);

/* Prints every key with its type, default and help text (for --help). */
void obx_config_describe(FILE *out);

/* The key table as reference text: a Markdown table, or an mdoc(7) tag
 * list (the man page's KEYS). Generated docs come from it (doc/gen_docs.c). */
enum obx_config_doc { OBX_CONFIG_DOC_MARKDOWN, OBX_CONFIG_DOC_MDOC };
void obx_config_reference(FILE *out, enum obx_config_doc format);

/* Number of keys in the table and their names (for tests and docs). */
size_t obx_config_key_count(void);
const char *obx_config_key_name(size_t i);

#endif
