/*
 * recovery: see include/outboxd/recovery.h.
 */
#include "outboxd/recovery.h"
#include "outboxd/alloc.h"
#include "outboxd/failpoint.h"
#include "outboxd/kafka.h"
#include "outboxd/metrics.h"
#include "outboxd/record.h"
#include "outboxd/log.h"
#include "outboxd/relay.h"
#include "outboxd/store.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include <librdkafka/rdkafka.h>
#include <openssl/evp.h>

/* The scan reads in chunks of at most this long (or recovery.chunk_records);
 * after each, the rows found are marked and every partition's position is
 * stored in outbox.kafka_offsets, in one transaction. So progress survives a
 * failed attempt, a lost connection and a restart, and no total time limit
 * is needed: only a chunk that reads nothing for NO_PROGRESS_MS fails. */
#define CHUNK_MS           5000
#define NO_PROGRESS_MS     30000
#define REQUEST_TIMEOUT_MS 10000

#define NPARAMS OBX_RECOVER_NPARAMS

enum step {
    STEP_IDLE = 0,
    STEP_PLAN, /* plan query in flight */
    STEP_SCAN, /* worker reading Kafka (one chunk) */
    STEP_MARK, /* the chunk's recovery transaction in flight */
    STEP_SKIP, /* the ids moved past the highest found, in flight */
};

static const char *const step_names[] = {"idle", "plan", "scan", "mark", "skip"};

/* Which moves are possible: allowed[from] is a bit set of destinations. */
#define STEP_BIT(s) (1u << (s))
static const unsigned step_allowed[] = {
    [STEP_IDLE] = STEP_BIT(STEP_PLAN),
    [STEP_PLAN] = STEP_BIT(STEP_IDLE) | STEP_BIT(STEP_SCAN),
    [STEP_SCAN] = STEP_BIT(STEP_IDLE) | STEP_BIT(STEP_MARK),
    [STEP_MARK] = STEP_BIT(STEP_IDLE) | STEP_BIT(STEP_SCAN) | STEP_BIT(STEP_SKIP),
    [STEP_SKIP] = STEP_BIT(STEP_IDLE),
};

/* One partition to read. */
struct part {
    int topic; /* index into topics */
    int32_t partition;
    int64_t stored;     /* last offset a mark stored; -1 = none */
    int64_t next, end;  /* still to read: [next, end); end = high watermark at the start */
    int64_t chunk_from; /* `next` when the chunk began: store only what moved */
    bool resolved;      /* watermarks known */
    bool done;
    bool gone; /* the topic or partition no longer exists */
};

/* A record carrying an outbox-id. */
struct found {
    int64_t id;
    int topic;
    char *key; /* NULL = no key */
    size_t key_len;
    bool tombstone;
    char digest[65];
    int32_t partition; /* where it was read (log mode hands it to the relay) */
    int64_t offset;
};

/* Log mode: what the stored cursor says, as read at the pass's start, and
 * the records found for rows it does not cover (all owned). */
struct log_read {
    bool has_cursor, about_slots;
    int64_t batch, hwm, max_hwm;
    char *snap;
    struct obx_log_held *held;
    size_t n_held;
    int64_t *also;
    size_t n_also;
    char **off_topics;
    int32_t *off_partitions;
    int64_t *off_offsets;
    size_t n_off;
    struct obx_log_found *found;
    size_t n_found, cap_found;
    struct obx_log_slot_hwm *slot_hwms;
    size_t n_slot_hwms;
};

struct obx_recovery {
    uv_loop_t *loop;
    uint64_t rows_recovered; /* over all passes: rows found in Kafka and marked */
    uint64_t ids_skipped;    /* passes that moved the ids (outboxd_ids_skipped_total) */
    const struct obx_config *cfg;
    struct obx_pg *pg;
    struct obx_recovery_callbacks cb;
    void *arg;
    enum step step;
    bool aborted; /* connection lost mid-pass: drop the worker's results */
    bool closing;
    atomic_bool cancel; /* asks a running chunk to end early */
    uv_work_t work;

    /* The plan (loop thread) and the scan results (worker, then loop). */
    char **topics;
    size_t n_topics;
    struct part *parts;
    size_t n_parts;
    struct found *found;
    size_t n_found, cap_found;
    int64_t id_lo, id_hi; /* unsent ids lie in [id_lo, id_hi] */
    int64_t max_id;       /* the highest outbox-id read, of any row */
    bool any_id;          /* max_id holds one */
    char max_id_text[24];
    bool planned;                      /* metadata and watermarks of every partition known */
    atomic_uint_fast64_t records_read; /* this pass; written by the worker */
    size_t parts_left;                 /* as of the last chunk (read on the loop thread) */
    uint64_t confirmed;                /* rows this pass marked */
    int64_t last_log;
    atomic_uint_fast64_t progress; /* written by the worker and the loop */
    char error[512];

    bool log_mode;       /* relay.on_sent = log: nothing is written */
    struct log_read log; /* log mode */

    /* The pass's slots (relay.shards): the plan, the match's offsets. */
    char shards_text[16];
    char *owned_slots; /* array text; NULL: every row */

    char sql[2048];
    struct obx_pg_array params[NPARAMS];
    const char *values[NPARAMS];
};

/* The one place the step changes; an impossible move is a bug. */
static void set_step(struct obx_recovery *rec, enum step to, const char *why)
{
    if (rec->step == to)
        return;
    if (!(step_allowed[rec->step] & STEP_BIT(to)))
        OBX_BUG("recovery: refused step change %s -> %s (%s)", step_names[rec->step],
                step_names[to], why);
    obx_debug("recovery: %s -> %s (%s)", step_names[rec->step], step_names[to], why);
    rec->step = to;
}

int obx_sha256_hex(const void *data, size_t len, char out[65])
{
    static const char hex[] = "0123456789abcdef";
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int mdlen = 0;
    if (!EVP_Digest(data, len, md, &mdlen, EVP_sha256(), NULL) || mdlen != 32)
        return -1;
    for (unsigned i = 0; i < 32; i++) {
        out[2 * i] = hex[md[i] >> 4];
        out[2 * i + 1] = hex[md[i] & 15];
    }
    out[64] = '\0';
    return 0;
}

bool obx_valid_text(const char *s, size_t len)
{
    const unsigned char *p = (const unsigned char *)s, *end = p + len;
    while (p < end) {
        unsigned c = *p;
        size_t n;
        uint32_t cp;
        if (c == 0)
            return false;
        if (c < 0x80) {
            p++;
            continue;
        }
        if ((c & 0xe0) == 0xc0) {
            n = 1;
            cp = c & 0x1f;
        } else if ((c & 0xf0) == 0xe0) {
            n = 2;
            cp = c & 0x0f;
        } else if ((c & 0xf8) == 0xf0) {
            n = 3;
            cp = c & 0x07;
        } else {
            return false;
        }
        if ((size_t)(end - p) <= n)
            return false;
        for (size_t i = 1; i <= n; i++) {
            if ((p[i] & 0xc0) != 0x80)
                return false;
            cp = (cp << 6) | (p[i] & 0x3f);
        }
        /* Overlong forms, surrogates and values past U+10FFFF are invalid. */
        if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) ||
            (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff)
            return false;
        p += n + 1;
    }
    return true;
}

/* Forgets the records found by the chunk just stored. */
static void clear_found(struct obx_recovery *rec)
{
    for (size_t i = 0; i < rec->n_found; i++)
        obx_free(rec->found[i].key);
    obx_free(rec->found);
    rec->found = NULL;
    rec->n_found = rec->cap_found = 0;
}

static void clear_log(struct log_read *l)
{
    obx_free(l->snap);
    for (size_t i = 0; i < l->n_held; i++) {
        obx_free((char *)l->held[i].topic);
        obx_free((char *)l->held[i].key);
    }
    obx_free(l->held);
    obx_free(l->also);
    for (size_t i = 0; i < l->n_off; i++)
        obx_free(l->off_topics[i]);
    obx_free(l->off_topics);
    obx_free(l->off_partitions);
    obx_free(l->off_offsets);
    obx_free(l->found);
    obx_free(l->slot_hwms);
    memset(l, 0, sizeof(*l));
}

static void clear_pass(struct obx_recovery *rec)
{
    clear_log(&rec->log);
    for (size_t i = 0; i < rec->n_topics; i++)
        obx_free(rec->topics[i]);
    obx_free(rec->topics);
    rec->topics = NULL;
    rec->n_topics = 0;
    obx_free(rec->parts);
    rec->parts = NULL;
    rec->n_parts = 0;
    clear_found(rec);
    rec->confirmed = 0; /* records_read and parts_left stay for /metrics until the next pass */
    rec->planned = false;
    rec->error[0] = '\0';
}

int obx_recovery_new(uv_loop_t *loop, const struct obx_config *cfg, struct obx_pg *pg,
                     const struct obx_recovery_callbacks *cb, void *arg, struct obx_recovery **out)
{
    struct obx_recovery *rec = obx_calloc(1, sizeof(*rec));
    if (!rec)
        return -1;
    rec->loop = loop;
    rec->cfg = cfg;
    rec->pg = pg;
    rec->cb = *cb;
    rec->arg = arg;
    rec->work.data = rec;
    rec->log_mode = cfg->on_sent == OBX_ON_SENT_LOG;
    obx_store_sql_recover(cfg->on_sent, rec->sql, sizeof(rec->sql));
    *out = rec;
    return 0;
}

static void on_plan_result(void *arg, const PGresult *res, const char *error);
static void on_mark_result(void *arg, const PGresult *res, const char *error);
static void on_state_result(void *arg, const PGresult *res, const char *error);
static void on_match_result(void *arg, const PGresult *res, const char *error);

int obx_recovery_start(struct obx_recovery *rec, int shards, const char *owned_slots)
{
    if (rec->step != STEP_IDLE || rec->closing)
        return -1; /* a scan from an abandoned pass is still running */
    clear_pass(rec);
    obx_free(rec->owned_slots);
    rec->owned_slots = NULL;
    if (owned_slots && !(rec->owned_slots = obx_strdup(owned_slots))) {
        obx_error("recovery: out of memory");
        return -1;
    }
    snprintf(rec->shards_text, sizeof(rec->shards_text), "%d", shards > 0 ? shards : 1);
    atomic_store(&rec->records_read, 0);
    rec->any_id = false;
    rec->parts_left = 0;
    rec->aborted = false;
    atomic_store(&rec->cancel, false);
    /* The stored cursor first, in every mode: after log mode, mark and
     * delete mode leave the rows it covers untouched. Then the plan. */
    if (obx_pg_send(rec->pg, obx_store_sql_log_state(), 0, NULL, 0, on_state_result, rec) != 0)
        return -1;
    set_step(rec, STEP_PLAN, "plan sent");
    return 0;
}

uint64_t obx_recovery_progress(const struct obx_recovery *rec)
{
    return atomic_load(&rec->progress);
}

static void finish(struct obx_recovery *rec, bool ok)
{
    set_step(rec, STEP_IDLE, ok ? "pass done" : "pass failed");
    if (ok) {
        const struct log_read *l = &rec->log;
        struct obx_log_state st = {
            .has_cursor = l->has_cursor,
            .batch = l->batch,
            .hwm = l->hwm,
            .snapshot = l->snap,
            .held = l->held,
            .n_held = l->n_held,
            .also_sent = l->also,
            .n_also = l->n_also,
            .off_topics = (const char *const *)l->off_topics,
            .off_partitions = l->off_partitions,
            .off_offsets = l->off_offsets,
            .n_off = l->n_off,
            .found = l->found,
            .n_found = l->n_found,
            .max_hwm = l->max_hwm,
            .about_slots = l->about_slots,
            .slot_hwms = l->slot_hwms,
            .n_slot_hwms = l->n_slot_hwms,
        };
        if (rec->cb.log_state(&st, rec->arg) != 0) {
            obx_error("recovery: out of memory taking the stored cursor");
            ok = false;
        }
    }
    clear_pass(rec);
    rec->cb.done(ok, rec->arg);
}

/* ---- the scan, in libuv's thread pool ---- */

static int part_index(struct obx_recovery *rec, const char *topic, int32_t partition)
{
    for (size_t i = 0; i < rec->n_parts; i++)
        if (rec->parts[i].partition == partition &&
            strcmp(rec->topics[rec->parts[i].topic], topic) == 0)
            return (int)i;
    return -1;
}

/* Parses the FIRST outbox-id header, the relay's own (a user header of the
 * same name comes after it): false if absent or not an id. */
static bool outbox_id(const rd_kafka_message_t *m, int64_t *id)
{
    rd_kafka_headers_t *hdrs;
    const void *val;
    size_t len;
    return rd_kafka_message_headers(m, &hdrs) == RD_KAFKA_RESP_ERR_NO_ERROR &&
           rd_kafka_header_get(hdrs, 0, "outbox-id", &val, &len) == RD_KAFKA_RESP_ERR_NO_ERROR &&
           val && obx_parse_id(val, len, id);
}

static int add_found(struct obx_recovery *rec, const rd_kafka_message_t *m, int topic)
{
    int64_t id;
    if (!outbox_id(m, &id))
        return 0;
    if (!rec->any_id || id > rec->max_id)
        rec->max_id = id; /* for skip_ids(), sent or not */
    rec->any_id = true;
    /* Not an unsent id, or not storable as our text key: it cannot match
     * a row. Keeping only candidates bounds memory when a partition is
     * read from its start. */
    if (id < rec->id_lo || id > rec->id_hi || (m->key && !obx_valid_text(m->key, m->key_len)))
        return 0;
    if (rec->n_found == rec->cap_found) {
        size_t cap = rec->cap_found ? rec->cap_found * 2 : 256;
        struct found *grown = obx_realloc(rec->found, cap * sizeof(*grown));
        if (!grown)
            return -1;
        rec->found = grown;
        rec->cap_found = cap;
    }
    struct found *f = &rec->found[rec->n_found];
    memset(f, 0, sizeof(*f));
    f->id = id;
    f->topic = topic;
    f->partition = m->partition;
    f->offset = m->offset;
    if (m->key) {
        f->key = obx_malloc(m->key_len ? m->key_len : 1);
        if (!f->key)
            return -1;
        memcpy(f->key, m->key, m->key_len);
        f->key_len = m->key_len;
    }
    f->tombstone = m->payload == NULL;
    if (!f->tombstone && obx_sha256_hex(m->payload, m->len, f->digest) != 0) {
        obx_free(f->key);
        return -1;
    }
    rec->n_found++;
    return 0;
}

/* Topic `t` holds nothing to read: offsets stored for it (a deleted
 * topic) are left behind, not read. */
static void topic_empty(struct obx_recovery *rec, int t)
{
    for (size_t i = 0; i < rec->n_parts; i++)
        if (rec->parts[i].topic == t)
            rec->parts[i].gone = rec->parts[i].done = rec->parts[i].resolved = true;
}

/* Adds every partition of topic `t` to the plan's read list, and marks
 * stored partitions that no longer exist as gone. */
static int plan_topic_partitions(struct obx_recovery *rec, rd_kafka_t *rk, int t)
{
    const struct rd_kafka_metadata *md = NULL;
    rd_kafka_topic_t *rkt = rd_kafka_topic_new(rk, rec->topics[t], NULL);
    if (!rkt) {
        /* A name librdkafka takes for no topic (over 512 bytes): none of
         * our records can be in it, and its row is refused when produced
         * (relay.on_reject). Failing the pass would stop every topic. */
        obx_warn("recovery: a topic of %zu bytes, \"%.40s...\", cannot exist in Kafka: nothing "
                 "to read there",
                 strlen(rec->topics[t]), rec->topics[t]);
        topic_empty(rec, t);
        return 0;
    }
    rd_kafka_resp_err_t e = rd_kafka_metadata(rk, 0, rkt, &md, REQUEST_TIMEOUT_MS);
    rd_kafka_topic_destroy(rkt);
    if (e != RD_KAFKA_RESP_ERR_NO_ERROR) {
        snprintf(rec->error, sizeof(rec->error), "metadata for %s: %s", rec->topics[t],
                 rd_kafka_err2str(e));
        return -1;
    }
    atomic_fetch_add(&rec->progress, 1);
    rd_kafka_resp_err_t terr =
        md->topic_cnt == 1 ? md->topics[0].err : RD_KAFKA_RESP_ERR__UNKNOWN_TOPIC;
    if (terr == RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART ||
        terr == RD_KAFKA_RESP_ERR__UNKNOWN_TOPIC || terr == RD_KAFKA_RESP_ERR_TOPIC_EXCEPTION) {
        /* The topic does not exist, or Kafka calls its name invalid (a
         * space, over 249 characters): nothing can be in it. */
        if (terr == RD_KAFKA_RESP_ERR_TOPIC_EXCEPTION)
            obx_warn("recovery: Kafka calls the topic name \"%.250s\" invalid: nothing to read "
                     "there",
                     rec->topics[t]);
        else
            obx_debug("recovery: %.250s does not exist in Kafka: nothing to read there",
                      rec->topics[t]);
        topic_empty(rec, t);
        rd_kafka_metadata_destroy(md);
        return 0;
    }
    if (terr != RD_KAFKA_RESP_ERR_NO_ERROR) {
        /* Leader not available, not authorized...: we cannot tell what is
         * there, so nothing may be published yet. */
        snprintf(rec->error, sizeof(rec->error), "metadata for %s: %s", rec->topics[t],
                 rd_kafka_err2str(terr));
        rd_kafka_metadata_destroy(md);
        return -1;
    }
    int rc = 0;
    const struct rd_kafka_metadata_topic *mt = &md->topics[0];
    for (size_t i = 0; i < rec->n_parts; i++) { /* stored partitions the topic lacks now */
        struct part *p = &rec->parts[i];
        bool exists = false;
        for (int k = 0; p->topic == t && k < mt->partition_cnt; k++)
            exists = exists || mt->partitions[k].id == p->partition;
        if (p->topic == t && !exists) {
            obx_debug("recovery: %.250s [%d] no longer exists in Kafka: nothing to read there",
                      rec->topics[t], p->partition);
            p->gone = p->done = p->resolved = true;
        }
    }
    for (int k = 0; k < mt->partition_cnt && rc == 0; k++) {
        int32_t pid = mt->partitions[k].id;
        if (part_index(rec, rec->topics[t], pid) >= 0)
            continue;
        struct part *grown = obx_realloc(rec->parts, (rec->n_parts + 1) * sizeof(*grown));
        if (!grown) {
            snprintf(rec->error, sizeof(rec->error), "out of memory");
            rc = -1;
            break;
        }
        rec->parts = grown;
        rec->parts[rec->n_parts++] = (struct part){.topic = t, .partition = pid, .stored = -1};
    }
    rd_kafka_metadata_destroy(md);
    return rc;
}

/* Once per pass: every partition and where to read it from. */
static int plan_partitions(struct obx_recovery *rec, rd_kafka_t *rk)
{
    for (size_t t = 0; t < rec->n_topics; t++)
        if (plan_topic_partitions(rec, rk, (int)t) != 0)
            return -1;
    for (size_t i = 0; i < rec->n_parts; i++) {
        struct part *p = &rec->parts[i];
        int64_t low, high;
        if (p->resolved)
            continue;
        rd_kafka_resp_err_t e = rd_kafka_query_watermark_offsets(
            rk, rec->topics[p->topic], p->partition, &low, &high, REQUEST_TIMEOUT_MS);
        if (e != RD_KAFKA_RESP_ERR_NO_ERROR) {
            snprintf(rec->error, sizeof(rec->error), "offsets of %s [%d]: %s",
                     rec->topics[p->topic], p->partition, rd_kafka_err2str(e));
            return -1;
        }
        atomic_fetch_add(&rec->progress, 1);
        p->next = p->stored >= 0 ? p->stored + 1 : low;
        if (p->stored >= high) {
            /* Offsets went back: the topic was re-created (or truncated).
             * What we stored says nothing about it now: read it all. */
            obx_event(OBX_LOG_WARN, "offset_past_end",
                      "recovery: %s [%d]: stored offset %lld is past its end %lld (topic "
                      "re-created?); reading it from its start",
                      rec->topics[p->topic], p->partition, (long long)p->stored, (long long)high);
            p->next = low;
            p->stored = -1;
        }
        if (p->next < low) {
            obx_warn("recovery: %s [%d]: records %lld..%lld are gone (retention); rows published "
                     "there by a crashed run cannot be recognised",
                     rec->topics[p->topic], p->partition, (long long)p->next, (long long)low - 1);
            p->next = low;
        }
        p->end = high;
        p->done = p->next >= p->end;
        /* What this pass can see: a record above the high watermark (still
         * being replicated) is not, and the tests of real Kafka match each
         * row published twice against this line. */
        obx_event(OBX_LOG_DEBUG, "recovery_read",
                  "recovery: reading %s [%d] from offset %lld up to the high watermark %lld",
                  rec->topics[p->topic], p->partition, (long long)p->next, (long long)high);
        p->resolved = true;
    }
    rec->planned = true;
    return 0;
}

/* Reads one chunk: from each unfinished partition's `next` on, for at most
 * CHUNK_MS or recovery.chunk_records records. Runs in the pool. */
static int scan(struct obx_recovery *rec, rd_kafka_t *rk)
{
    rd_kafka_topic_partition_list_t *assign = rd_kafka_topic_partition_list_new(16);
    size_t open_parts = 0;
    uint64_t read = 0;
    int rc = 0;

    if (!rec->planned && plan_partitions(rec, rk) != 0)
        rc = -1;
    for (size_t i = 0; i < rec->n_parts && rc == 0; i++) {
        struct part *p = &rec->parts[i];
        p->chunk_from = p->next;
        if (p->done)
            continue;
        rd_kafka_topic_partition_list_add(assign, rec->topics[p->topic], p->partition)->offset =
            p->next;
        open_parts++;
    }
    if (rc == 0 && open_parts > 0) {
        rd_kafka_resp_err_t e = rd_kafka_assign(rk, assign);
        if (e != RD_KAFKA_RESP_ERR_NO_ERROR) {
            snprintf(rec->error, sizeof(rec->error), "assign: %s", rd_kafka_err2str(e));
            rc = -1;
        }
    }
    uint64_t start = uv_hrtime() / 1000000, last_read = start;
    while (rc == 0 && open_parts > 0 && !atomic_load(&rec->cancel)) {
        uint64_t now = uv_hrtime() / 1000000;
        if (now - start >= CHUNK_MS || read >= (uint64_t)rec->cfg->recovery_chunk_records)
            break; /* the rest in the next chunk, after this one is stored */
        if (now - last_read > NO_PROGRESS_MS) {
            snprintf(rec->error, sizeof(rec->error),
                     "reading Kafka made no progress for %d ms (%zu partitions unfinished)",
                     NO_PROGRESS_MS, open_parts);
            rc = -1;
            break;
        }
        rd_kafka_message_t *m = rd_kafka_consumer_poll(rk, 200);
        if (!m)
            continue;
        const char *tname = m->rkt ? rd_kafka_topic_name(m->rkt) : NULL;
        int pi = tname ? part_index(rec, tname, m->partition) : -1;
        if (m->err && m->err != RD_KAFKA_RESP_ERR__PARTITION_EOF) {
            obx_warn("recovery: reading %s [%d]: %s", tname ? tname : "?", m->partition,
                     rd_kafka_message_errstr(m));
        } else if (pi >= 0 && !rec->parts[pi].done) {
            struct part *p = &rec->parts[pi];
            last_read = now;
            if (!m->err && m->offset < p->end) {
                atomic_fetch_add(&rec->records_read, 1);
                read++;
                atomic_fetch_add(&rec->progress, 1);
                if (add_found(rec, m, p->topic) != 0) {
                    snprintf(rec->error, sizeof(rec->error), "out of memory");
                    rc = -1;
                }
                p->next = m->offset + 1;
            } else if (!m->err && p->next < p->end) {
                p->next = p->end; /* a record past the end: all below it came */
            }
            bool eof = m->err == RD_KAFKA_RESP_ERR__PARTITION_EOF;
            if (eof && m->offset > p->next)
                p->next = m->offset; /* past control records and aborted ones */
            /* An end below the planned one is not the end: under
             * read_uncommitted a new leader's high watermark lags for a
             * moment; under read_committed another producer's transaction
             * still open holds the last stable offset (another relay's,
             * with relay.shards: it ends within half its timeout), and
             * records that committed after it wait behind it. Reading goes
             * on; NO_PROGRESS_MS bounds it. */
            if (p->next >= p->end || (eof && m->offset < 0)) {
                p->done = true;
                open_parts--;
            }
        }
        rd_kafka_message_destroy(m);
    }
    rd_kafka_topic_partition_list_destroy(assign);
    if (rc == 0 && atomic_load(&rec->cancel)) {
        snprintf(rec->error, sizeof(rec->error), "cancelled");
        rc = -1;
    }
    return rc;
}

/* A consumer for the pass: reading what committed (`committed`), or
 * everything. NULL with rec->error set. */
static rd_kafka_t *recovery_consumer(struct obx_recovery *rec, bool committed)
{
    rd_kafka_conf_t *conf;
    char err[400];

    if (obx_kafka_conf_build(rec->cfg, OBX_KAFKA_CONSUMER, &conf, err, sizeof(err)) != 0) {
        snprintf(rec->error, sizeof(rec->error), "%s", err);
        return NULL;
    }
    const char *const settings[][2] = {
        {"group.id", "outboxd-recovery"}, /* required by the API; nothing is committed */
        {"enable.auto.commit", "false"},
        {"enable.partition.eof", "true"},
        {"isolation.level", committed ? "read_committed" : "read_uncommitted"},
        /* A position that retention removed while the pass read elsewhere
         * (between chunks): go on from the first record left, not from
         * the end (librdkafka's default), which would skip records the
         * pass has to find. */
        {"auto.offset.reset", "earliest"},
        /* Read sequentially with a small prefetch: the default (64 MiB
         * queued per consumer) would dominate outboxd's memory. */
        {"queued.max.messages.kbytes", "2048"},
        {"fetch.max.bytes", "4194304"},
        {"client.id", "outboxd-recovery"},
    };
    for (size_t i = 0; i < sizeof(settings) / sizeof(settings[0]); i++)
        rd_kafka_conf_set(conf, settings[i][0], settings[i][1], err, sizeof(err));
    rd_kafka_conf_set_log_cb(conf, obx_kafka_log_cb);
    rd_kafka_t *rk = rd_kafka_new(RD_KAFKA_CONSUMER, conf, err, sizeof(err));
    if (!rk) {
        rd_kafka_conf_destroy(conf);
        snprintf(rec->error, sizeof(rec->error), "cannot create the recovery consumer: %s", err);
        return NULL;
    }
    rd_kafka_poll_set_consumer(rk);
    return rk;
}

static void consumer_done(rd_kafka_t *rk)
{
    rd_kafka_consumer_close(rk);
    rd_kafka_destroy(rk);
}

static void scan_work(uv_work_t *w)
{
    struct obx_recovery *rec = w->data;
    /* With relay.transactions the pass reads what committed only: an
     * aborted transaction's records were never published, and their rows
     * go again (the init before the pass ended this outbox's open one).
     * It plans with a read_uncommitted consumer all the same: a
     * read_committed one's "high watermark" is the last stable offset,
     * below records that committed after another producer's transaction
     * (another relay's, with relay.shards) that is still open; the pass
     * reads on until that one ends and its end is passed. */
    if (!rec->planned && rec->cfg->transactions) {
        rd_kafka_t *planner = recovery_consumer(rec, false);
        if (!planner)
            return;
        int rc = plan_partitions(rec, planner);
        consumer_done(planner);
        if (rc != 0)
            return;
    }
    rd_kafka_t *rk = recovery_consumer(rec, rec->cfg->transactions);
    if (!rk)
        return;
    if (scan(rec, rk) != 0 && !rec->error[0])
        snprintf(rec->error, sizeof(rec->error), "scan failed");
    consumer_done(rk);
}

/* ---- back on the loop ---- */

/* The chunk's records into the match's parameters (enum obx_recover_param
 * up to OBX_RECOVER_MATCH_NPARAMS); the first `n` arrays are reset. */
static void found_params(struct obx_recovery *rec, int n)
{
    struct obx_pg_array *a = rec->params;
    for (int k = 0; k < n; k++)
        obx_pg_array_reset(&a[k]);
    for (size_t i = 0; i < rec->n_found; i++) {
        const struct found *f = &rec->found[i];
        const char *topic = rec->topics[f->topic];
        obx_pg_array_add_int(&a[OBX_RECOVER_IDS], f->id);
        obx_pg_array_add_text(&a[OBX_RECOVER_TOPICS], topic, strlen(topic));
        obx_pg_array_add_text(&a[OBX_RECOVER_KEYS], f->key, f->key_len);
        obx_pg_array_add_text(&a[OBX_RECOVER_DIGESTS], f->tombstone ? NULL : f->digest, 64);
    }
}

/* The first `n` arrays into values; false (the pass failed) out of memory. */
static bool finish_params(struct obx_recovery *rec, int n)
{
    for (int k = 0; k < n; k++) {
        rec->values[k] = obx_pg_array_finish(&rec->params[k]);
        if (!rec->values[k]) {
            obx_error("recovery: out of memory building the chunk's statement");
            finish(rec, false);
            return false;
        }
    }
    return true;
}

static void send_mark(struct obx_recovery *rec)
{
    struct obx_pg_array *a = rec->params + OBX_RECOVER_OFFSETS;
    found_params(rec, OBX_RECOVER_SLOTS);
    for (size_t i = 0; i < rec->n_parts; i++) {
        struct part *p = &rec->parts[i];
        /* Done: everything up to the end seen; otherwise up to `next`. */
        int64_t upto = p->done ? p->end - 1 : p->next - 1;
        if (p->gone || upto < 0 || upto <= p->stored)
            continue; /* nothing new there */
        const char *topic = rec->topics[p->topic];
        obx_pg_array_add_text(&a[OBX_OFFSETS_TOPICS], topic, strlen(topic));
        obx_pg_array_add_int(&a[OBX_OFFSETS_PARTITIONS], p->partition);
        obx_pg_array_add_int(&a[OBX_OFFSETS_OFFSETS], upto);
        p->stored = upto;
    }
    if (!finish_params(rec, OBX_RECOVER_SLOTS))
        return;
    rec->values[OBX_RECOVER_SLOTS + OBX_SLOTS_SHARDS] = rec->shards_text;
    rec->values[OBX_RECOVER_SLOTS + OBX_SLOTS_OWNED] = rec->owned_slots;
    if (obx_pg_send_tx(rec->pg, rec->sql, NPARAMS, rec->values, OBX_FP_RECOVER_BEFORE_COMMIT,
                       on_mark_result, rec) != 0) {
        finish(rec, false); /* if the connection broke, `lost` follows */
        return;
    }
    set_step(rec, STEP_MARK, "chunk's mark sent");
}

/* Log mode: which of the records found are of rows the stored cursor does
 * not cover (nothing is written). */
static void send_match(struct obx_recovery *rec)
{
    found_params(rec, OBX_RECOVER_MATCH_NPARAMS);
    for (size_t i = 0; i < rec->n_parts; i++) { /* read up to here */
        struct part *p = &rec->parts[i];
        int64_t upto = p->done ? p->end - 1 : p->next - 1;
        if (upto > p->stored)
            p->stored = upto;
    }
    if (!finish_params(rec, OBX_RECOVER_MATCH_NPARAMS))
        return;
    rec->values[OBX_RECOVER_LOG_SLOTS + OBX_SLOTS_SHARDS] = rec->shards_text;
    rec->values[OBX_RECOVER_LOG_SLOTS + OBX_SLOTS_OWNED] = rec->owned_slots;
    if (obx_pg_send(rec->pg, obx_store_sql_log_recover(), OBX_RECOVER_LOG_NPARAMS, rec->values, 0,
                    on_match_result, rec) != 0) {
        finish(rec, false);
        return;
    }
    set_step(rec, STEP_MARK, "chunk's match sent");
}

static void start_chunk(struct obx_recovery *rec);

static void free_recovery(struct obx_recovery *rec)
{
    clear_pass(rec);
    for (int k = 0; k < NPARAMS; k++)
        obx_pg_array_free(&rec->params[k]);
    obx_free(rec->owned_slots);
    obx_free(rec);
}

static void scan_done(uv_work_t *w, int status)
{
    struct obx_recovery *rec = w->data;
    if (rec->closing) {
        free_recovery(rec);
        return;
    }
    if (rec->aborted || status != 0) {
        set_step(rec, STEP_IDLE, "chunk of an abandoned pass");
        clear_pass(rec);
        return;
    }
    if (rec->error[0]) {
        obx_warn("recovery: cannot read Kafka: %s; retrying before publishing anything",
                 rec->error);
        finish(rec, false);
        return;
    }
    if (OBX_FAILPOINT(OBX_FP_RECOVER_AFTER_SCAN) != 0) {
        finish(rec, false);
        return;
    }
    if (rec->log_mode)
        send_match(rec);
    else
        send_mark(rec);
}

/* Reads the next chunk in the thread pool. */
static void start_chunk(struct obx_recovery *rec)
{
    set_step(rec, STEP_SCAN, "reading a chunk");
    if (uv_queue_work(rec->loop, &rec->work, scan_work, scan_done) != 0) {
        obx_error("recovery: cannot start the Kafka scan");
        finish(rec, false);
    }
}

/* The plan arrived: remember topics and stored offsets, start the scan. */
static void on_plan(struct obx_recovery *rec, const PGresult *res)
{
    int n = PQntuples(res);
    if (n == 0) {
        obx_event(OBX_LOG_INFO, "recovery_done", "recovery: no unsent rows, nothing to recover");
        finish(rec, true);
        return;
    }
    rec->topics = obx_calloc((size_t)n, sizeof(*rec->topics));
    rec->parts = obx_calloc((size_t)n, sizeof(*rec->parts));
    if (!rec->topics || !rec->parts) {
        obx_error("recovery: out of memory");
        finish(rec, false);
        return;
    }
    rec->id_lo = strtoll(obx_store_col(res, 0, "id_lo"), NULL, 10);
    rec->id_hi = strtoll(obx_store_col(res, 0, "id_hi"), NULL, 10);
    for (int i = 0; i < n; i++) {
        const char *topic = obx_store_col(res, i, "topic");
        if (rec->n_topics == 0 || strcmp(rec->topics[rec->n_topics - 1], topic) != 0) {
            rec->topics[rec->n_topics] = obx_strdup(topic);
            if (!rec->topics[rec->n_topics]) {
                obx_error("recovery: out of memory");
                finish(rec, false);
                return;
            }
            rec->n_topics++;
        }
        if (!obx_store_col_null(res, i, "kafka_partition"))
            rec->parts[rec->n_parts++] = (struct part){
                .topic = (int)rec->n_topics - 1,
                .partition = (int32_t)strtol(obx_store_col(res, i, "kafka_partition"), NULL, 10),
                .stored = obx_store_col_null(res, i, "stored_offset")
                              ? -1
                              : strtoll(obx_store_col(res, i, "stored_offset"), NULL, 10),
            };
    }
    start_chunk(rec);
}

static void on_plan_result(void *arg, const PGresult *res, const char *error)
{
    struct obx_recovery *rec = arg;
    OBX_ASSERT(rec->step == STEP_PLAN, "recovery: plan answered in step %d", (int)rec->step);
    if (error) {
        obx_warn("recovery: reading the plan failed: %s", error);
        finish(rec, false);
    } else {
        on_plan(rec, res);
    }
}

/* The stored cursor, a kind per row (store.c, obx_store_sql_log_state). */
static int read_log_state(struct log_read *l, const PGresult *res)
{
    int n = PQntuples(res);
    size_t n_held = 0, n_also = 0, n_off = 0, n_slot = 0;
    for (int i = 0; i < n; i++) {
        char kind = obx_store_col(res, i, "kind")[0];
        n_held += kind == 'h';
        n_also += kind == 'a';
        n_off += kind == 'o';
        n_slot += kind == 's';
    }
    if ((n_held && !(l->held = obx_calloc(n_held, sizeof(*l->held)))) ||
        (n_slot && !(l->slot_hwms = obx_calloc(n_slot, sizeof(*l->slot_hwms)))) ||
        (n_also && !(l->also = obx_calloc(n_also, sizeof(*l->also)))) ||
        (n_off && (!(l->off_topics = obx_calloc(n_off, sizeof(*l->off_topics))) ||
                   !(l->off_partitions = obx_calloc(n_off, sizeof(*l->off_partitions))) ||
                   !(l->off_offsets = obx_calloc(n_off, sizeof(*l->off_offsets))))))
        return -1;
    for (int i = 0; i < n; i++) {
        const char *a = obx_store_col(res, i, "a"), *b = obx_store_col(res, i, "b"),
                   *c = obx_store_col(res, i, "c");
        switch (obx_store_col(res, i, "kind")[0]) {
        case 'c':
            l->has_cursor = true;
            l->batch = strtoll(a, NULL, 10);
            l->hwm = strtoll(b, NULL, 10);
            if (!(l->snap = obx_strdup(c)))
                return -1;
            break;
        case 'h': {
            struct obx_log_held *h = &l->held[l->n_held++];
            bool keyless = obx_store_col_null(res, i, "b");
            h->from_id = strtoll(c, NULL, 10);
            h->key_len = keyless ? 0 : strlen(b);
            if (!(h->topic = obx_strdup(a)) || (!keyless && !(h->key = obx_malloc(h->key_len + 1))))
                return -1;
            if (!keyless)
                memcpy((char *)h->key, b, h->key_len + 1);
            break;
        }
        case 'a':
            l->also[l->n_also++] = strtoll(a, NULL, 10);
            break;
        case 'o':
            if (!(l->off_topics[l->n_off] = obx_strdup(a)))
                return -1;
            l->off_partitions[l->n_off] = (int32_t)strtol(b, NULL, 10);
            l->off_offsets[l->n_off++] = strtoll(c, NULL, 10);
            break;
        case 'x':
            l->max_hwm = strtoll(a, NULL, 10);
            l->about_slots = b[0] == 't';
            break;
        case 's':
            l->slot_hwms[l->n_slot_hwms++] = (struct obx_log_slot_hwm){
                .shards = obx_store_col_null(res, i, "a") ? 0 : (int32_t)strtol(a, NULL, 10),
                .slot = obx_store_col_null(res, i, "b") ? 0 : (int32_t)strtol(b, NULL, 10),
                .hwm = strtoll(c, NULL, 10)};
            break;
        default:
            break;
        }
    }
    return 0;
}

static void on_state_result(void *arg, const PGresult *res, const char *error)
{
    struct obx_recovery *rec = arg;
    OBX_ASSERT(rec->step == STEP_PLAN, "recovery: state answered in step %d", (int)rec->step);
    if (error) {
        obx_warn("recovery: reading the stored cursor failed: %s", error);
        finish(rec, false);
        return;
    }
    if (read_log_state(&rec->log, res) != 0) {
        obx_error("recovery: out of memory reading the stored cursor");
        finish(rec, false);
        return;
    }
    const char *values[OBX_PLAN_NPARAMS];
    values[OBX_PLAN_SLOTS + OBX_SLOTS_SHARDS] = rec->shards_text;
    values[OBX_PLAN_SLOTS + OBX_SLOTS_OWNED] = rec->owned_slots;
    if (obx_pg_send(rec->pg, obx_store_sql_recovery_plan(), OBX_PLAN_NPARAMS, values, 0,
                    on_plan_result, rec) != 0)
        finish(rec, false);
}

static void on_skip_result(void *arg, const PGresult *res, const char *error)
{
    struct obx_recovery *rec = arg;
    OBX_ASSERT(rec->step == STEP_SKIP, "recovery: skip answered in step %d", (int)rec->step);
    if (error) {
        /* The pass itself is done: new rows may reuse ids, as before. */
        obx_warn("recovery: moving the ids past the highest in Kafka (%s) failed: %s",
                 rec->max_id_text, error);
    } else if (PQntuples(res) == 1 && !PQgetisnull(res, 0, 0)) {
        rec->ids_skipped++;
        obx_event(OBX_LOG_WARN, "ids_skipped",
                  "recovery: Kafka holds outbox-id %s, above the ids this database has handed "
                  "out: it is on another history (a failover to a standby, a restore, a "
                  "cut-over) and reissued ids; new rows get ids from %s on",
                  rec->max_id_text, PQgetvalue(res, 0, 0));
    }
    finish(rec, true);
}

/* The pass read every record after the stored offsets: if one carries an
 * id this database has not handed out yet, the database is on another
 * history than the one that published it, and would hand that id out
 * again. outbox.skip_ids_past (sql/012) moves the identity past it, so
 * from now on ids are unique among the records in Kafka again. */
static void skip_ids(struct obx_recovery *rec)
{
    if (!rec->any_id) {
        finish(rec, true);
        return;
    }
    snprintf(rec->max_id_text, sizeof(rec->max_id_text), "%lld", (long long)rec->max_id);
    rec->values[0] = rec->max_id_text;
    if (obx_pg_send(rec->pg, OBX_STORE_SQL_SKIP_IDS, 1, rec->values, 0, on_skip_result, rec) != 0) {
        finish(rec, false);
        return;
    }
    set_step(rec, STEP_SKIP, "pass done, ids to check");
}

/* Log mode: a chunk's records matched; keep those of uncovered rows. */
static void on_match_result(void *arg, const PGresult *res, const char *error)
{
    struct obx_recovery *rec = arg;
    struct log_read *l = &rec->log;
    OBX_ASSERT(rec->step == STEP_MARK, "recovery: match answered in step %d", (int)rec->step);
    if (error) {
        obx_warn("recovery: matching the records found failed: %s", error);
        finish(rec, false);
        return;
    }
    int n = PQntuples(res);
    for (int i = 0; i < n; i++) {
        int64_t id = strtoll(obx_store_col(res, i, "id"), NULL, 10);
        for (size_t j = 0; j < rec->n_found; j++) {
            const struct found *f = &rec->found[j];
            if (f->id != id)
                continue;
            if (l->n_found == l->cap_found) {
                size_t cap = l->cap_found ? l->cap_found * 2 : 64;
                struct obx_log_found *g = obx_realloc(l->found, cap * sizeof(*g));
                if (!g) {
                    obx_error("recovery: out of memory keeping the records found");
                    finish(rec, false);
                    return;
                }
                l->found = g;
                l->cap_found = cap;
            }
            l->found[l->n_found++] =
                (struct obx_log_found){id, rec->topics[f->topic], f->partition, f->offset};
            break; /* the first record of a row: a later one is a duplicate */
        }
    }
    rec->confirmed += (uint64_t)n;
    rec->rows_recovered += (uint64_t)n;
    size_t left = 0;
    for (size_t i = 0; i < rec->n_parts; i++)
        left += !rec->parts[i].done;
    rec->parts_left = left;
    clear_found(rec);
    if (left > 0) {
        start_chunk(rec);
        return;
    }
    obx_event(OBX_LOG_INFO, "recovery_done",
              "recovery: %llu rows were already in Kafka (published by an earlier run): they are "
              "taken as published, not published again (%llu records read in %zu partitions)",
              (unsigned long long)rec->confirmed,
              (unsigned long long)atomic_load(&rec->records_read), rec->n_parts);
    skip_ids(rec);
}

static void on_mark_result(void *arg, const PGresult *res, const char *error)
{
    struct obx_recovery *rec = arg;
    OBX_ASSERT(rec->step == STEP_MARK, "recovery: mark answered in step %d", (int)rec->step);
    if (error) {
        obx_warn("recovery: marking failed: %s", error);
        finish(rec, false);
        return;
    }
    uint64_t confirmed = strtoull(obx_store_col(res, 0, "confirmed"), NULL, 10);
    rec->confirmed += confirmed;
    rec->rows_recovered += confirmed;
    size_t left = 0;
    for (size_t i = 0; i < rec->n_parts; i++)
        left += !rec->parts[i].done;
    rec->parts_left = left;
    if (left > 0) {
        /* This chunk is stored: the next goes on from there, now or after
         * a failure or restart. */
        int64_t now = (int64_t)uv_now(rec->loop);
        if (now - rec->last_log >= CHUNK_MS) {
            obx_event(OBX_LOG_INFO, "recovery_progress",
                      "recovery: reading Kafka, %llu records so far, %zu of %zu partitions "
                      "left",
                      (unsigned long long)atomic_load(&rec->records_read), left, rec->n_parts);
            rec->last_log = now;
        }
        clear_found(rec);
        start_chunk(rec);
        return;
    }
    obx_event(OBX_LOG_INFO, "recovery_done",
              "recovery: %llu rows were already in Kafka (published by an earlier run) and are "
              "now marked, not published again (%llu records read in %zu partitions)",
              (unsigned long long)rec->confirmed,
              (unsigned long long)atomic_load(&rec->records_read), rec->n_parts);
    skip_ids(rec);
}

uint64_t obx_recovery_records_read(const struct obx_recovery *rec)
{
    return atomic_load(&rec->records_read);
}

bool obx_recovery_running(const struct obx_recovery *rec)
{
    return rec->step != STEP_IDLE;
}

size_t obx_recovery_partitions_left(const struct obx_recovery *rec)
{
    return rec->parts_left; /* the worker may be changing `parts` right now */
}

void obx_recovery_abort(struct obx_recovery *rec)
{
    if (rec->step == STEP_SCAN) {
        rec->aborted = true; /* scan_done drops the results */
        atomic_store(&rec->cancel, true);
        return;
    }
    set_step(rec, STEP_IDLE, "pass abandoned");
    clear_pass(rec);
}

void obx_recovery_close(struct obx_recovery *rec)
{
    if (!rec)
        return;
    if (rec->step == STEP_SCAN) {
        rec->closing = true; /* freed by scan_done */
        atomic_store(&rec->cancel, true);
        return;
    }
    free_recovery(rec);
}

uint64_t obx_recovery_ids_skipped(const struct obx_recovery *rec)
{
    return rec->ids_skipped;
}

uint64_t obx_recovery_rows_recovered(const struct obx_recovery *rec)
{
    return rec->rows_recovered;
}
