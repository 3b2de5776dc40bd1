/* relay_held: see relay_held.h. */
#include "relay_held.h"
#include "outboxd/alloc.h"
#include "outboxd/keycount.h"
#include "outboxd/log.h"

#include <string.h>

/* Longest pause between retries of a refused row. */
#define MAX_REFUSED_BACKOFF_MS (60 * 1000)
/* Fewer entries are walked: as fast, and nothing to keep. */
#define HELD_INDEX_MIN 16
/* Lookups since a change that walk the entries before the index is made:
 * a refusal looks up a few times between two changes, and making the
 * index each time would cost more than the walks; a fetch's rows look up
 * hundreds of times. */
#define HELD_INDEX_AFTER 8

void held_free(struct held *h)
{
    for (size_t i = 0; i < h->n; i++)
        obx_free(h->entry[i].key);
    obx_free(h->entry);
    obx_free(h->lifted);
    obx_free(h->by_id);
    obx_free(h->by_key);
    obx_free(h->whole);
    h->entry = NULL;
    h->lifted = NULL;
    h->by_id = h->by_key = NULL;
    h->whole = NULL;
    h->n = h->cap = h->n_slots = h->n_whole = 0;
    h->indexed = false;
}

/* ---- the index ---- */

/* An entry was added, dropped or moved, or its topic hold changed. */
static void changed(struct held *h)
{
    h->indexed = false;
    h->lookups_unindexed = 0;
}

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/* The key's hash as the relay's key counts make it, its bits mixed for a
 * table indexed by its low bits. */
static uint64_t key_hash(uint32_t topic, const char *key, size_t key_len)
{
    return mix64(obx_keycount_hash(topic, key, key_len));
}

static bool same_key(const struct held_back *b, uint32_t topic, const char *key, size_t key_len)
{
    return b->topic == topic && b->key && b->key_len == key_len &&
           memcmp(b->key, key, key_len) == 0;
}

/* Builds the index when the entries are many and lookups have come
 * HELD_INDEX_AFTER times since a change. Out of memory: lookups walk the
 * entries, and it is tried again as many lookups later. */
static void index_if_worth(struct held *h)
{
    if (h->indexed || h->n < HELD_INDEX_MIN || ++h->lookups_unindexed < HELD_INDEX_AFTER)
        return;
    size_t want = HELD_INDEX_MIN * 2;
    while (want < h->n * 2)
        want *= 2;
    if (want != h->n_slots) { /* both new tables, or neither */
        uint32_t *by_id = obx_malloc(want * sizeof(*by_id));
        uint32_t *by_key = by_id ? obx_malloc(want * sizeof(*by_key)) : NULL;
        if (!by_key) {
            obx_free(by_id);
            h->lookups_unindexed = 0;
            return;
        }
        obx_free(h->by_id);
        obx_free(h->by_key);
        h->by_id = by_id;
        h->by_key = by_key;
        h->n_slots = want;
    }
    memset(h->by_id, 0, h->n_slots * sizeof(*h->by_id));
    memset(h->by_key, 0, h->n_slots * sizeof(*h->by_key));
    h->n_whole = 0;
    size_t mask = h->n_slots - 1;
    for (size_t i = 0; i < h->n; i++) {
        const struct held_back *b = &h->entry[i];
        size_t s = mix64((uint64_t)b->id) & mask;
        while (h->by_id[s])
            s = (s + 1) & mask;
        h->by_id[s] = (uint32_t)i + 1;
        if (b->whole_topic)
            h->whole[h->n_whole++] = (struct held_topic){b->topic, b->id};
        if (!b->key)
            continue;
        for (s = key_hash(b->topic, b->key, b->key_len) & mask; h->by_key[s]; s = (s + 1) & mask) {
            struct held_back *o = &h->entry[h->by_key[s] - 1];
            if (same_key(o, b->topic, b->key, b->key_len))
                break;
        }
        if (!h->by_key[s] || h->entry[h->by_key[s] - 1].id > b->id)
            h->by_key[s] = (uint32_t)i + 1;
    }
    h->indexed = true;
}

struct held_back *held_find(struct held *h, int64_t id)
{
    index_if_worth(h);
    if (h->indexed) {
        size_t mask = h->n_slots - 1;
        for (size_t s = mix64((uint64_t)id) & mask; h->by_id[s]; s = (s + 1) & mask)
            if (h->entry[h->by_id[s] - 1].id == id)
                return &h->entry[h->by_id[s] - 1];
        return NULL;
    }
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
    return b->whole_topic || (key && same_key(b, topic, key, key_len));
}

bool held_holds(struct held *h, int64_t id, uint32_t topic, const char *key, size_t key_len)
{
    index_if_worth(h);
    if (!h->indexed) {
        for (size_t i = 0; i < h->n; i++)
            if (holds(&h->entry[i], topic, id, key, key_len))
                return true;
        return false;
    }
    for (size_t i = 0; i < h->n_whole; i++)
        if (h->whole[i].topic == topic && id > h->whole[i].id)
            return true;
    if (!key)
        return false;
    size_t mask = h->n_slots - 1;
    for (size_t s = key_hash(topic, key, key_len) & mask; h->by_key[s]; s = (s + 1) & mask) {
        const struct held_back *b = &h->entry[h->by_key[s] - 1];
        if (same_key(b, topic, key, key_len))
            return id > b->id; /* the lowest of its key */
    }
    return false;
}

/* The entry that holds back the rows of topic `topic`, or NULL. */
static const struct held_back *topic_held(struct held *h, uint32_t topic)
{
    index_if_worth(h);
    if (h->indexed) {
        for (size_t i = 0; i < h->n_whole; i++)
            if (h->whole[i].topic == topic)
                return held_find(h, h->whole[i].id);
        return NULL;
    }
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
    changed(h);
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

bool held_behind_another(struct held *h, const struct held_back *b)
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

/* Whether row `id` is among `rows` (n of them; in id order if `sorted`). */
static bool among(const struct obx_row *rows, size_t n, bool sorted, int64_t id)
{
    if (!sorted) {
        for (size_t j = 0; j < n; j++)
            if (rows[j].id == id)
                return true;
        return false;
    }
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (rows[mid].id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && rows[lo].id == id;
}

void held_drop_gone(struct held *h, const struct obx_row *rows, size_t n, bool full,
                    int64_t fetch_sent_at, struct held_fx *fx)
{
    bool sorted = true; /* a fetch answers in id order */
    for (size_t j = 1; j < n && sorted; j++)
        sorted = rows[j - 1].id < rows[j].id;
    for (size_t i = 0; i < h->n;) {
        const struct held_back *b = &h->entry[i];
        bool passed = !full || (n > 0 && rows[n - 1].id > b->id);
        bool due = !b->alone && b->retry_at <= fetch_sent_at;
        bool fetched = passed && due && among(rows, n, sorted, b->id);
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
    struct held_topic *w = obx_realloc(h->whole, cap * sizeof(*w));
    if (!w)
        return -1;
    h->whole = w;
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
        changed(h);
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
            changed(h);
            fx->clear_cursor = "topic no longer held";
        }
    }
}

bool held_behind_topic(struct held *h, uint32_t topic, int64_t id)
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
        changed(h);
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
