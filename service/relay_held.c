/* relay_held: see relay_held.h. */
#include "relay_held.h"
#include "outboxd/alloc.h"
#include "outboxd/log.h"

#include <string.h>

/* Longest pause between retries of a refused row. */
#define MAX_REFUSED_BACKOFF_MS (60 * 1000)

void held_free(struct held *h)
{
    for (size_t i = 0; i < h->n; i++)
        obx_free(h->entry[i].key);
    obx_free(h->entry);
    obx_free(h->lifted);
    h->entry = NULL;
    h->lifted = NULL;
    h->n = h->cap = 0;
}

struct held_back *held_find(struct held *h, int64_t id)
{
    for (size_t i = 0; i < h->n; i++)
        if (h->entry[i].id == id)
            return &h->entry[i];
    return NULL;
}

/* Whether entry `b` holds back the row `id` of `topic` and `key`: a later
 * row of its key, or of its topic when the topic refused it. */
static bool holds(const struct held_back *b, uint32_t topic, int64_t id, const char *key,
                  size_t key_len)
{
    if (b->topic != topic || id <= b->id)
        return false;
    return b->whole_topic ||
           (key && b->key && b->key_len == key_len && memcmp(b->key, key, key_len) == 0);
}

bool held_holds(const struct held *h, int64_t id, uint32_t topic, const char *key, size_t key_len)
{
    for (size_t i = 0; i < h->n; i++)
        if (holds(&h->entry[i], topic, id, key, key_len))
            return true;
    return false;
}

/* The entry that holds back the rows of topic `topic`, or NULL. */
static const struct held_back *topic_held(const struct held *h, uint32_t topic)
{
    for (size_t i = 0; i < h->n; i++)
        if (h->entry[i].whole_topic && h->entry[i].topic == topic)
            return &h->entry[i];
    return NULL;
}

/* Forgets entry `b`: its key goes on. */
static void forget(struct held *h, struct held_back *b, struct held_fx *fx)
{
    fx->clear_cursor = "key no longer held back"; /* its later rows may wait below hwm */
    h->lifted[fx->n_lifted++] = b->id;
    obx_free(b->key);
    *b = h->entry[--h->n];
}

void held_release(struct held *h, int64_t id, struct held_fx *fx)
{
    struct held_back *b = held_find(h, id);
    if (!b)
        return;
    obx_info("relay: row %lld delivered after %d failed tries; its key goes on", (long long)id,
             b->attempts);
    forget(h, b, fx);
}

void held_drop(struct held *h, int64_t id, struct held_fx *fx)
{
    struct held_back *b = held_find(h, id);
    if (b)
        forget(h, b, fx);
}

bool held_behind_another(const struct held *h, const struct held_back *b)
{
    return held_holds(h, b->id, b->topic, b->key, b->key_len);
}

struct held_back *held_due_alone(struct held *h, int64_t now)
{
    struct held_back *best = NULL;
    for (size_t i = 0; i < h->n; i++) {
        struct held_back *b = &h->entry[i];
        if (!b->alone || b->retry_at > now || (best && best->id < b->id))
            continue;
        if (!held_behind_another(h, b))
            best = b;
    }
    return best;
}

void held_drop_gone(struct held *h, const struct obx_row *rows, size_t n, bool full,
                    int64_t fetch_sent_at, struct held_fx *fx)
{
    for (size_t i = 0; i < h->n;) {
        const struct held_back *b = &h->entry[i];
        bool passed = !full || (n > 0 && rows[n - 1].id > b->id);
        bool due = !b->alone && b->retry_at <= fetch_sent_at;
        bool fetched = false;
        for (size_t j = 0; j < n && passed && due && !fetched; j++)
            fetched = rows[j].id == b->id;
        if (!passed || !due || fetched || b->behind_at_fetch) {
            i++;
            continue;
        }
        obx_info("relay: row %lld is no longer waiting to be sent; its key goes on",
                 (long long)b->id);
        forget(h, &h->entry[i], fx); /* moves the last entry here */
        fx->want_fetch = "key no longer held back";
    }
}

/* Room for twice as many entries. */
static int grow(struct held *h)
{
    size_t cap = h->cap ? h->cap * 2 : 64;
    struct held_back *b = obx_realloc(h->entry, cap * sizeof(*b));
    if (!b)
        return -1;
    h->entry = b;
    int64_t *l = obx_realloc(h->lifted, cap * sizeof(*l));
    if (!l)
        return -1;
    h->lifted = l;
    h->cap = cap;
    return 0;
}

/* The next try of `b`: the back-off doubles with each failed one. */
static void schedule_retry(const struct held *h, struct held_back *b, int64_t now)
{
    int64_t delay = h->retry_backoff_ms;
    for (int i = 0; i < b->attempts && delay < MAX_REFUSED_BACKOFF_MS; i++)
        delay *= 2;
    if (delay > MAX_REFUSED_BACKOFF_MS)
        delay = MAX_REFUSED_BACKOFF_MS;
    b->attempts++;
    b->retry_at = now + delay;
}

void held_hold_back(struct held *h, int64_t id, uint32_t topic, const char *key, size_t key_len,
                    int64_t now, struct held_fx *fx)
{
    fx->clear_cursor = "row refused"; /* it is below hwm, and comes back by a full fetch */
    struct held_back *b = held_find(h, id);
    if (!b) {
        if (h->n == h->cap && grow(h) != 0) {
            /* Retried at once, and its key goes on: a fault we say out loud. */
            obx_error("relay: out of memory holding back the key of row %lld (%zu held back)",
                      (long long)id, h->n);
            return;
        }
        char *copy = NULL;
        if (key && !(copy = obx_malloc(key_len ? key_len : 1))) {
            obx_error("relay: out of memory holding back the key of row %lld", (long long)id);
            return;
        }
        if (key)
            memcpy(copy, key, key_len);
        b = &h->entry[h->n++];
        *b = (struct held_back){.id = id, .topic = topic, .key = copy, .key_len = key_len};
        fx->hold = true; /* log mode: the cursor rows name it */
        fx->hold_id = id;
        fx->hold_topic = topic;
        fx->hold_key = key;
        fx->hold_key_len = key_len;
    }
    schedule_retry(h, b, now);
}

void held_refused(struct held *h, int64_t id, uint32_t topic, const char *key, size_t key_len,
                  int64_t now, struct held_fx *fx)
{
    held_hold_back(h, id, topic, key, key_len, now, fx);
    struct held_back *b = held_find(h, id);
    if (b) {
        b->alone = true;      /* retried alone, with back-off: a refusal in a batch would
                               * take the batch's other rows with it */
        if (b->whole_topic) { /* refused for itself now: the topic takes rows again */
            b->whole_topic = false;
            fx->clear_cursor = "topic no longer held";
        }
    }
}

bool held_behind_topic(const struct held *h, uint32_t topic, int64_t id)
{
    const struct held_back *t = h->n > 0 ? topic_held(h, topic) : NULL;
    return t && t->id < id;
}

bool held_topic_refused(struct held *h, int64_t id, uint32_t topic, const char *topic_name,
                        const char *key, size_t key_len, const char *reason, int64_t now,
                        struct held_fx *fx)
{
    const struct held_back *t = topic_held(h, topic);
    if (t && t->id < id) { /* behind it: fetched again once the topic goes on */
        obx_debug("relay: row %lld (topic %s) refused: %s; it waits behind row %lld", (long long)id,
                  topic_name, reason, (long long)t->id);
        return true;
    }
    if (!t)
        obx_error("relay: topic %s refused row %lld: %s; the topic's rows wait behind its first "
                  "one, which is retried alone with back-off, and other topics go on "
                  "(relay.on_reject = retry)",
                  topic_name, (long long)id, reason);
    /* The topic's entry is its lowest row with one, or this row: reports
     * of rows of the topic may have come first (a refusal in a batch purges
     * the producer, and each purged row came back for a retry). Every
     * other entry of the topic goes; its row waits behind that one. */
    int64_t low = id;
    int attempts = 0;
    for (size_t i = 0; i < h->n; i++) {
        const struct held_back *o = &h->entry[i];
        if (o->topic != topic)
            continue;
        if (o->id < low)
            low = o->id;
        if (o->attempts > attempts)
            attempts = o->attempts;
    }
    for (size_t i = 0; i < h->n;) {
        if (h->entry[i].topic == topic && h->entry[i].id != low)
            forget(h, &h->entry[i], fx); /* moves the last entry here */
        else
            i++;
    }
    if (low == id)
        held_hold_back(h, id, topic, key, key_len, now, fx);
    struct held_back *b = held_find(h, low);
    if (b) {
        b->attempts = attempts; /* the topic's back-off goes on from where it was */
        schedule_retry(h, b, now);
        b->whole_topic = true;
        b->alone = true;
    }
    return false;
}

void held_batch_refused(struct held *h, int64_t id, uint32_t topic, const char *topic_name,
                        const char *key, size_t key_len, const char *reason, int64_t now,
                        struct held_fx *fx)
{
    obx_warn("relay: the batch of row %lld (topic %s) was refused by Kafka: %s; trying the row "
             "alone before relay.on_reject applies, later rows of its key wait",
             (long long)id, topic_name, reason);
    held_hold_back(h, id, topic, key, key_len, now, fx);
    struct held_back *b = held_find(h, id);
    if (b) {
        b->alone = true;
        b->retry_at = now;
    }
}
