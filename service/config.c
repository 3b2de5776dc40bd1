/*
 * config: see include/outboxd/config.h.
 */
#include "outboxd/config.h"
#include "outboxd/alloc.h"
#include "outboxd/log.h"

#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

enum key_type {
    KEY_STRING,   /* char * */
    KEY_INT,      /* int, within [min, max] */
    KEY_DURATION, /* int64_t milliseconds; "250ms", "5s", "2m", "1h"; bare = ms */
    KEY_ENUM,     /* int, index into `choices` */
    KEY_KAFKA,    /* stored in the kafka property list */
};

#define KEY_REQUIRED 0x1
#define KEY_SECRET   0x2 /* value never echoed in errors or output */

struct key_def {
    const char *name;
    enum key_type type;
    size_t offset;   /* into struct obx_config; unused for KEY_KAFKA */
    const char *def; /* default, parsed by the same code as user values; NULL = none */
    int64_t min, max;
    const char *const *choices; /* KEY_ENUM: NULL-terminated */
    unsigned flags;
    const char *help;
};

static const char *const on_sent_choices[] = {"mark", "delete", "log", NULL};
static const char *const record_format_choices[] = {"plain", "cloudevents", NULL};
static const char *const on_reject_choices[] = {"retry", "dead_letter", NULL};
static const char *const off_on_choices[] = {"off", "on", NULL};
static const char *const level_choices[] = {"error", "warn", "info", "debug", NULL};
static const char *const format_choices[] = {"text", "json", NULL};

#define OFF(field)  offsetof(struct obx_config, field)
#define MS_PER_HOUR (3600 * 1000LL)

static const struct key_def keys[] = {
    {"postgres.conninfo", KEY_STRING, OFF(pg_conninfo), NULL, 0, 0, NULL, KEY_REQUIRED | KEY_SECRET,
     "libpq connection string or URI of the database holding the outbox"},
    {"postgres.statement_timeout", KEY_DURATION, OFF(pg_statement_timeout_ms), "30s", 0,
     MS_PER_HOUR, NULL, 0, "server-side statement_timeout for the relay's queries (0 = none)"},
    {"postgres.reconnect_backoff_min", KEY_DURATION, OFF(pg_backoff_min_ms), "200ms", 1,
     MS_PER_HOUR, NULL, 0, "first delay before reconnecting to Postgres (doubles, jittered)"},
    {"postgres.reconnect_backoff_max", KEY_DURATION, OFF(pg_backoff_max_ms), "10s", 1, MS_PER_HOUR,
     NULL, 0, "largest delay between Postgres reconnect attempts"},
    {"kafka.bootstrap.servers", KEY_KAFKA, 0, NULL, 0, 0, NULL, KEY_REQUIRED,
     "Kafka brokers, host:port[,host:port...]; every other kafka.* key goes to librdkafka"},
    {"relay.on_sent", KEY_ENUM, OFF(on_sent), "mark", 0, 0, on_sent_choices, 0,
     "what happens to a row once Kafka acknowledged it: mark (set sent_at), delete, or log "
     "(nothing per row: a cursor row per acknowledged batch, and space reclaimed a whole "
     "partition at a time; see doc/operations.md)"},
    {"relay.on_reject", KEY_ENUM, OFF(on_reject), "retry", 0, 0, on_reject_choices, 0,
     "a row Kafka refuses for good: retry (its key waits) or dead_letter (moved to "
     "outbox.dead_letters with the reason)"},
    {"relay.shards", KEY_INT, OFF(shards), "1", 1, 1024, NULL, 0,
     "slots the keys hash into: every relay of the outbox with the same value owns a fair "
     "share of them and publishes their rows, so relays added or removed take or give back "
     "slots within a second; 1 = one active relay, the others stand by (every mode; see "
     "doc/operations.md, Several active relays)"},
    {"relay.transactions", KEY_ENUM, OFF(transactions), "off", 0, 0, off_on_choices, 0,
     "on: rows go to Kafka in transactions (a transactional.id derived from the database's "
     "system identifier and name, or kafka.transactional.id), so a relay that took over "
     "fences the one before and a read_committed consumer sees each row once, also after "
     "a crash or a frozen relay; with relay.shards, each relay's id is its session's, and a "
     "relay that takes a lost owner's slots fences that owner's (see doc/operations.md, "
     "Transactions)"},
    {"relay.transaction_rows", KEY_INT, OFF(transaction_rows), "1000", 1, 1000000, NULL, 0,
     "with relay.transactions: a transaction takes no more fetched rows once it holds this "
     "many, and commits when their delivery reports are in (it commits sooner when no "
     "more rows come); larger: fewer commits, later records"},
    {"relay.batch_size", KEY_INT, OFF(batch_size), "1000", 1, 100000, NULL, 0,
     "most rows read by one fetch"},
    {"relay.fetch_max_bytes", KEY_INT, OFF(fetch_max_bytes), "8388608", 1024, 1073741824, NULL, 0,
     "most bytes of rows (key, payload and headers) one fetch brings: a row may take this "
     "divided by the fetch's row limit, a larger one comes without payload and headers and "
     "makes the next fetches ask for fewer rows (a row asked for alone comes whole); a row "
     "above kafka.message.max.bytes is never fetched"},
    {"relay.max_in_flight", KEY_INT, OFF(max_in_flight), "10000", 1, 1000000, NULL, 0,
     "most rows handed to Kafka and not yet marked (back-pressure)"},
    {"relay.poll_interval", KEY_DURATION, OFF(poll_interval_ms), "10ms", 1, MS_PER_HOUR, NULL, 0,
     "longest pause between two looks for new rows: the relay looks again 1ms after a fetch "
     "that found rows and, after one that found none, an eighth of the time since rows were "
     "last found, up to this (an idle relay runs this many cheap index lookups a second: 100 "
     "at 10ms)"},
    {"relay.retry_backoff", KEY_DURATION, OFF(retry_backoff_ms), "1s", 10, MS_PER_HOUR, NULL, 0,
     "pause before fetching again after a failed fetch or a failed delivery"},
    {"relay.stall_timeout", KEY_DURATION, OFF(stall_timeout_ms), "60s", 0, MS_PER_HOUR, NULL, 0,
     "active, with its dependencies reachable, but no row marked and no empty fetch for this "
     "long: log what it waits for and fail /livez (0 = never)"},
    {"shutdown.timeout", KEY_DURATION, OFF(shutdown_timeout_ms), "30s", 0, MS_PER_HOUR, NULL, 0,
     "on SIGTERM/SIGINT, how long to wait for in-flight deliveries before exiting"},
    {"retention.period", KEY_DURATION, OFF(retention_ms), "7d", 0, 3650 * 24 * MS_PER_HOUR, NULL, 0,
     "how long published rows are kept (0 = for ever): mark mode deletes rows sent longer ago "
     "in batches; log mode drops or empties a partition once every row in it is published "
     "and its newest row is older than this"},
    {"retention.interval", KEY_DURATION, OFF(retention_interval_ms), "1m", 1000, 24 * MS_PER_HOUR,
     NULL, 0, "how often a retention round starts"},
    {"retention.batch_size", KEY_INT, OFF(retention_batch), "1000", 1, 100000, NULL, 0,
     "most rows one retention DELETE looks at (each batch is its own short transaction)"},
    {"retention.partition_rows", KEY_INT, OFF(partition_rows), "1000000", 1000, 1000000000, NULL, 0,
     "ids per partition of outbox.events; the relay keeps two partitions ahead of the ids "
     "(log mode drops or empties a whole partition once every row in it is published and "
     "older than retention.period)"},
    {"recovery.chunk_records", KEY_INT, OFF(recovery_chunk_records), "200000", 100, 10000000, NULL,
     0,
     "records the recovery pass reads (or 5 s of reading) before it stores its progress in "
     "outbox.kafka_offsets"},
    {"record.format", KEY_ENUM, OFF(record_format), "plain", 0, 0, record_format_choices, 0,
     "plain (the row's headers and outbox-id) or cloudevents (CloudEvents 1.0 binary mode: "
     "ce_specversion, ce_id = the outbox id, ce_source, ce_type, ce_time added)"},
    {"record.cloudevents_source", KEY_STRING, OFF(ce_source), "", 0, 0, NULL, 0,
     "ce_source of every record under record.format = cloudevents, a URI-reference naming "
     "the producer (e.g. /orders); a row's own ce_source header wins"},
    {"http.listen", KEY_STRING, OFF(http_listen), "127.0.0.1:9187", 0, 0, NULL, 0,
     "HOST:PORT serving /livez, /readyz and /metrics (empty = off)"},
    {"log.level", KEY_ENUM, OFF(log_level), "info", 0, 0, level_choices, 0,
     "error, warn, info or debug"},
    {"log.format", KEY_ENUM, OFF(log_format), "text", 0, 0, format_choices, 0,
     "text or json (one object per line)"},
};

#define KEY_COUNT (sizeof(keys) / sizeof(keys[0]))

size_t obx_config_key_count(void)
{
    return KEY_COUNT;
}

const char *obx_config_key_name(size_t i)
{
    return i < KEY_COUNT ? keys[i].name : NULL;
}

static const struct key_def *find_key(const char *name)
{
    for (size_t i = 0; i < KEY_COUNT; i++)
        if (strcmp(keys[i].name, name) == 0)
            return &keys[i];
    return NULL;
}

/* ASCII-only classification: never the locale's isspace()/isdigit(). */
static bool is_blank(char c)
{
    return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\v' || c == '\f';
}

static bool is_digit(char c)
{
    return c >= '0' && c <= '9';
}

static bool is_key_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || is_digit(c) || c == '.' ||
           c == '_' || c == '-';
}

/* Parses a non-negative decimal integer; the whole string must be digits. */
static int parse_uint(const char *s, size_t len, int64_t *out)
{
    int64_t v = 0;
    if (len == 0)
        return -1;
    for (size_t i = 0; i < len; i++) {
        if (!is_digit(s[i]))
            return -1;
        if (v > (INT64_MAX - 9) / 10)
            return -1;
        v = v * 10 + (s[i] - '0');
    }
    *out = v;
    return 0;
}

static int parse_duration_ms(const char *s, int64_t *out)
{
    size_t n = 0;
    int64_t v, mult;
    while (is_digit(s[n]))
        n++;
    if (parse_uint(s, n, &v) != 0)
        return -1;
    const char *unit = s + n;
    if (*unit == '\0' || strcmp(unit, "ms") == 0)
        mult = 1;
    else if (strcmp(unit, "s") == 0)
        mult = 1000;
    else if (strcmp(unit, "m") == 0)
        mult = 60 * 1000;
    else if (strcmp(unit, "h") == 0)
        mult = MS_PER_HOUR;
    else if (strcmp(unit, "d") == 0)
        mult = 24 * MS_PER_HOUR;
    else
        return -1;
    if (v > INT64_MAX / mult)
        return -1;
    *out = v * mult;
    return 0;
}

static int kafka_prop_set(struct obx_config *cfg, const char *name, const char *value,
                          const char *origin)
{
    struct obx_kafka_prop *p = NULL;
    for (size_t i = 0; i < cfg->kafka_count; i++)
        if (strcmp(cfg->kafka[i].name, name) == 0)
            p = &cfg->kafka[i];
    char *v = obx_strdup(value);
    if (!v)
        return -1;
    if (!p) {
        char *n = obx_strdup(name);
        struct obx_kafka_prop *grown =
            n ? obx_realloc(cfg->kafka, (cfg->kafka_count + 1) * sizeof(*grown)) : NULL;
        if (!grown) {
            obx_free(n);
            obx_free(v);
            return -1;
        }
        cfg->kafka = grown;
        p = &cfg->kafka[cfg->kafka_count++];
        p->name = n;
        p->value = NULL;
    }
    obx_free(p->value);
    p->value = v;
    snprintf(p->origin, sizeof(p->origin), "%s", origin);
    return 0;
}

static void describe_range(const struct key_def *k, char *buf, size_t len)
{
    size_t used = 0;
    switch (k->type) {
    case KEY_INT:
        snprintf(buf, len, "an integer from %lld to %lld", (long long)k->min, (long long)k->max);
        break;
    case KEY_DURATION:
        snprintf(buf, len, "a duration from %lldms to %lldms (e.g. 500ms, 5s, 2m, 7d)",
                 (long long)k->min, (long long)k->max);
        break;
    case KEY_ENUM:
        used = (size_t)snprintf(buf, len, "one of");
        for (const char *const *c = k->choices; *c && used < len; c++)
            used +=
                (size_t)snprintf(buf + used, len - used, "%s %s", c == k->choices ? "" : ",", *c);
        break;
    default:
        snprintf(buf, len, "a string");
        break;
    }
}

static int set_value(struct obx_config *cfg, const struct key_def *k, const char *value,
                     const char *origin, char *err, size_t errlen)
{
    void *field = (char *)cfg + k->offset;
    int64_t v = 0;
    char range[160];

    switch (k->type) {
    case KEY_STRING: {
        char *copy = obx_strdup(value);
        if (!copy) {
            snprintf(err, errlen, "%s: out of memory setting %s", origin, k->name);
            return -1;
        }
        obx_free(*(char **)field);
        *(char **)field = copy;
        return 0;
    }
    case KEY_KAFKA:
        if (kafka_prop_set(cfg, k->name + strlen("kafka."), value, origin) != 0) {
            snprintf(err, errlen, "%s: out of memory setting %s", origin, k->name);
            return -1;
        }
        return 0;
    case KEY_INT:
        if (parse_uint(value, strlen(value), &v) == 0 && v >= k->min && v <= k->max) {
            *(int *)field = (int)v;
            return 0;
        }
        break;
    case KEY_DURATION:
        if (parse_duration_ms(value, &v) == 0 && v >= k->min && v <= k->max) {
            *(int64_t *)field = v;
            return 0;
        }
        break;
    case KEY_ENUM:
        for (int i = 0; k->choices[i]; i++) {
            if (strcmp(k->choices[i], value) == 0) {
                *(int *)field = i;
                return 0;
            }
        }
        break;
    }
    describe_range(k, range, sizeof(range));
    if (k->flags & KEY_SECRET)
        snprintf(err, errlen, "%s: %s must be %s", origin, k->name, range);
    else
        snprintf(err, errlen, "%s: %s must be %s, got '%s'", origin, k->name, range, value);
    return -1;
}

int obx_config_set(struct obx_config *cfg, const char *key, const char *value, const char *origin,
                   char *err, size_t errlen)
{
    const struct key_def *k = find_key(key);
    if (k)
        return set_value(cfg, k, value, origin, err, errlen);
    if (strncmp(key, "kafka.", 6) == 0 && key[6] != '\0') {
        if (kafka_prop_set(cfg, key + 6, value, origin) != 0) {
            snprintf(err, errlen, "%s: out of memory setting %s", origin, key);
            return -1;
        }
        return 0;
    }
    snprintf(err, errlen, "%s: unknown key '%s' (see outboxd --help for the list)", origin, key);
    return -1;
}

int obx_config_init(struct obx_config *cfg)
{
    char err[256];
    memset(cfg, 0, sizeof(*cfg));
    for (size_t i = 0; i < KEY_COUNT; i++) {
        if (!keys[i].def)
            continue;
        if (set_value(cfg, &keys[i], keys[i].def, "default", err, sizeof(err)) != 0) {
            obx_config_free(cfg);
            return -1;
        }
    }
    return 0;
}

void obx_config_free(struct obx_config *cfg)
{
    for (size_t i = 0; i < KEY_COUNT; i++)
        if (keys[i].type == KEY_STRING) {
            char **field = (char **)((char *)cfg + keys[i].offset);
            obx_free(*field);
            *field = NULL;
        }
    for (size_t i = 0; i < cfg->kafka_count; i++) {
        obx_free(cfg->kafka[i].name);
        obx_free(cfg->kafka[i].value);
    }
    obx_free(cfg->kafka);
    cfg->kafka = NULL;
    cfg->kafka_count = 0;
}

/* Removes surrounding double quotes, honouring \" and \\ inside. Writes into
 * the same buffer. Returns -1 on an unterminated quote. */
static int unquote(char *v)
{
    size_t len = strlen(v);
    if (len == 0 || v[0] != '"')
        return 0;
    if (len < 2 || v[len - 1] != '"')
        return -1;
    size_t o = 0;
    for (size_t i = 1; i < len - 1; i++) {
        if (v[i] == '\\' && i + 1 < len - 1 && (v[i + 1] == '"' || v[i + 1] == '\\'))
            i++;
        else if (v[i] == '"')
            return -1;
        v[o++] = v[i];
    }
    v[o] = '\0';
    return 0;
}

/* Parses one line in place. Returns 0 (a setting or nothing), -1 on error. */
static int parse_line(struct obx_config *cfg, char *line, const char *origin, char *err,
                      size_t errlen)
{
    char *p = line, *key, *end, *value;

    while (is_blank(*p))
        p++;
    if (*p == '\0' || *p == '#')
        return 0;
    key = p;
    while (is_key_char(*p))
        p++;
    end = p;
    while (is_blank(*p))
        p++;
    if (end == key || *p != '=') {
        snprintf(err, errlen, "%s: expected 'key = value'", origin);
        return -1;
    }
    *end = '\0';
    value = p + 1;
    while (is_blank(*value))
        value++;
    end = value + strlen(value);
    while (end > value && is_blank(end[-1]))
        *--end = '\0';
    if (unquote(value) != 0) {
        snprintf(err, errlen, "%s: unterminated quoted value for %s", origin, key);
        return -1;
    }
    return obx_config_set(cfg, key, value, origin, err, errlen);
}

int obx_config_load_text(struct obx_config *cfg, const char *text, const char *name, char *err,
                         size_t errlen)
{
    char *copy = obx_strdup(text);
    char origin[160];
    int lineno = 0, rc = 0;
    if (!copy) {
        snprintf(err, errlen, "%s: out of memory", name);
        return -1;
    }
    for (char *line = copy; line && rc == 0;) {
        char *next = strchr(line, '\n');
        if (next)
            *next++ = '\0';
        lineno++;
        for (const char *c = line; *c; c++) {
            if ((unsigned char)*c >= 0x80 || *c == '\0') {
                snprintf(err, errlen, "%s:%d: only ASCII is accepted", name, lineno);
                rc = -1;
                break;
            }
        }
        if (rc == 0) {
            snprintf(origin, sizeof(origin), "%s:%d", name, lineno);
            rc = parse_line(cfg, line, origin, err, errlen);
        }
        line = next;
    }
    obx_free(copy);
    return rc;
}

int obx_config_load_file(struct obx_config *cfg, const char *path, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    char *buf = NULL;
    size_t len = 0, cap = 0;
    int rc;

    if (!f) {
        snprintf(err, errlen, "cannot open config file %s: %s", path, strerror(errno));
        return -1;
    }
    for (;;) {
        if (cap - len < 4096) {
            char *grown = cap > (1u << 24) ? NULL : obx_realloc(buf, cap + 8192);
            if (!grown) {
                snprintf(err, errlen, "config file %s: too large or out of memory", path);
                obx_free(buf);
                fclose(f);
                return -1;
            }
            buf = grown;
            cap += 8192;
        }
        size_t n = fread(buf + len, 1, cap - len - 1, f);
        len += n;
        if (n == 0)
            break;
    }
    if (ferror(f)) {
        snprintf(err, errlen, "cannot read config file %s", path);
        obx_free(buf);
        fclose(f);
        return -1;
    }
    fclose(f);
    buf[len] = '\0';
    if (memchr(buf, '\0', len)) {
        snprintf(err, errlen, "config file %s: contains a NUL byte", path);
        obx_free(buf);
        return -1;
    }
    rc = obx_config_load_text(cfg, buf, path, err, errlen);
    obx_free(buf);
    return rc;
}

int obx_config_set_arg(struct obx_config *cfg, const char *arg, char *err, size_t errlen)
{
    const char *eq = strchr(arg, '=');
    char key[128];
    size_t klen;

    if (!eq || eq == arg) {
        snprintf(err, errlen, "-X %s: expected key=value", arg);
        return -1;
    }
    klen = (size_t)(eq - arg);
    if (klen >= sizeof(key)) {
        snprintf(err, errlen, "-X: key too long");
        return -1;
    }
    memcpy(key, arg, klen);
    key[klen] = '\0';
    for (size_t i = 0; i < klen; i++)
        if (!is_key_char(key[i])) {
            snprintf(err, errlen, "-X: invalid character in key '%s'", key);
            return -1;
        }
    return obx_config_set(cfg, key, eq + 1, "-X", err, errlen);
}

int obx_config_apply_env(struct obx_config *cfg, obx_getenv_fn *get, char *err, size_t errlen)
{
    char var[128], origin[160];
    for (size_t i = 0; i < KEY_COUNT; i++) {
        const char *name = keys[i].name;
        size_t n = strlen(name);
        if (n + 9 > sizeof(var))
            continue;
        memcpy(var, "OUTBOXD_", 8);
        for (size_t j = 0; j < n; j++) {
            char c = name[j];
            if (c >= 'a' && c <= 'z')
                c = (char)(c - 'a' + 'A');
            else if (c == '.' || c == '-')
                c = '_';
            var[8 + j] = c;
        }
        var[8 + n] = '\0';
        const char *value = get(var);
        if (!value)
            continue;
        snprintf(origin, sizeof(origin), "environment %s", var);
        if (set_value(cfg, &keys[i], value, origin, err, errlen) != 0)
            return -1;
    }
    return 0;
}

const char *obx_config_kafka_get(const struct obx_config *cfg, const char *name)
{
    for (size_t i = 0; i < cfg->kafka_count; i++)
        if (strcmp(cfg->kafka[i].name, name) == 0)
            return cfg->kafka[i].value;
    return NULL;
}

int obx_config_validate(const struct obx_config *cfg, char *err, size_t errlen)
{
    if (!cfg->pg_conninfo || cfg->pg_conninfo[0] == '\0') {
        snprintf(err, errlen, "postgres.conninfo is required (a libpq conninfo or URI)");
        return -1;
    }
    const char *bootstrap = obx_config_kafka_get(cfg, "bootstrap.servers");
    if (!bootstrap || bootstrap[0] == '\0') {
        snprintf(err, errlen, "kafka.bootstrap.servers is required (host:port[,host:port...])");
        return -1;
    }
    if (cfg->pg_backoff_min_ms > cfg->pg_backoff_max_ms) {
        snprintf(err, errlen,
                 "postgres.reconnect_backoff_min (%lldms) is larger than "
                 "postgres.reconnect_backoff_max (%lldms)",
                 (long long)cfg->pg_backoff_min_ms, (long long)cfg->pg_backoff_max_ms);
        return -1;
    }
    if (cfg->record_format == OBX_RECORD_CLOUDEVENTS && (!cfg->ce_source || !cfg->ce_source[0])) {
        snprintf(err, errlen,
                 "record.cloudevents_source is required when record.format = cloudevents "
                 "(a URI-reference naming the producer, e.g. /orders)");
        return -1;
    }
    const char *txn_id = obx_config_kafka_get(cfg, "transactional.id");
    if (txn_id && !cfg->transactions) {
        snprintf(err, errlen,
                 "kafka.transactional.id is set but relay.transactions is off: set "
                 "relay.transactions = on (the relay then runs the transactions), or remove it");
        return -1;
    }
    if (txn_id && cfg->shards > 1) {
        snprintf(err, errlen,
                 "kafka.transactional.id cannot be set with relay.shards = %d: each relay "
                 "sharing the slots needs an id of its own, which it derives from the outbox "
                 "and its Postgres session (and fences the ids of a slot's lost owner with); "
                 "remove it",
                 cfg->shards);
        return -1;
    }
    if (cfg->batch_size > cfg->max_in_flight) {
        snprintf(err, errlen, "relay.batch_size (%d) is larger than relay.max_in_flight (%d)",
                 cfg->batch_size, cfg->max_in_flight);
        return -1;
    }
    return 0;
}

void obx_config_describe(FILE *out)
{
    char range[160];
    for (size_t i = 0; i < KEY_COUNT; i++) {
        const struct key_def *k = &keys[i];
        describe_range(k, range, sizeof(range));
        fprintf(out, "  %-32s %s%s\n", k->name, k->help,
                (k->flags & KEY_REQUIRED) ? " (required)" : "");
        if (k->type != KEY_STRING && k->type != KEY_KAFKA)
            fprintf(out, "  %-32s   %s; default %s\n", "", range, k->def);
        else if (k->type == KEY_STRING && k->def)
            fprintf(out, "  %-32s   default %s\n", "", k->def);
    }
    fprintf(out, "  %-32s %s\n", "kafka.<property>",
            "any librdkafka producer property, passed as-is (like kcat -X)");
}

/* Text for a Markdown table cell or an mdoc line: '|' and '\\' escaped,
 * and for mdoc a leading '.' or '\'' made literal. */
static void put_text(FILE *out, const char *text, enum obx_config_doc format)
{
    if (format == OBX_CONFIG_DOC_MDOC && (text[0] == '.' || text[0] == '\''))
        fputs("\\&", out);
    for (const char *c = text; *c; c++) {
        if (*c == '\\')
            fputs(format == OBX_CONFIG_DOC_MDOC ? "\\e" : "\\\\", out);
        else if (*c == '|' && format == OBX_CONFIG_DOC_MARKDOWN)
            fputs("\\|", out);
        else
            fputc(*c, out);
    }
}

void obx_config_reference(FILE *out, enum obx_config_doc format)
{
    char range[160];
    bool md = format == OBX_CONFIG_DOC_MARKDOWN;
    if (md)
        fputs("| key | default | values | meaning |\n| --- | --- | --- | --- |\n", out);
    else
        fputs(".Bl -tag -width Ds\n", out);
    for (size_t i = 0; i < KEY_COUNT; i++) {
        const struct key_def *k = &keys[i];
        describe_range(k, range, sizeof(range));
        const char *def = (k->flags & KEY_REQUIRED) ? "required" : k->def ? k->def : "none";
        const char *secret = (k->flags & KEY_SECRET) ? " (never printed: may hold a password)" : "";
        if (md) {
            bool literal = *def && !(k->flags & KEY_REQUIRED);
            fprintf(out, "| `%s` | %s%s%s | %s | ", k->name, literal ? "`" : "",
                    *def ? def : "empty", literal ? "`" : "",
                    k->type == KEY_KAFKA ? "a string" : range);
            put_text(out, k->help, format);
            fprintf(out, "%s |\n", secret);
        } else {
            fprintf(out, ".It Cm %s\n", k->name);
            put_text(out, k->help, format);
            fprintf(out, "%s.\n", secret);
            if (k->flags & KEY_REQUIRED)
                fprintf(out, "Values: %s.\nRequired.\n", k->type == KEY_KAFKA ? "a string" : range);
            else
                fprintf(out, "Values: %s; default: %s.\n",
                        k->type == KEY_KAFKA ? "a string" : range, *def ? def : "empty");
        }
    }
    if (md) {
        fputs("| `kafka.<property>` | librdkafka's, or ours below | see librdkafka's "
              "CONFIGURATION.md | any librdkafka producer property, passed as it is |\n",
              out);
    } else {
        fputs(".It Cm kafka. Ns Ar property\nAny librdkafka producer property, passed as it "
              "is.\n.El\n",
              out);
    }
}
