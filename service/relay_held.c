/*
 * relay_held: refused rows (relay.on_reject = retry, the rows of a refused
 * batch tried alone) and the later rows of their keys held back behind
 * them. See relay_int.h for the state, relay.c for the cycle.
 */
#include "relay_int.h"
#include "outboxd/alloc.h"
#include "outboxd/log.h"

#include <string.h>

struct held_back *relay_find_held_back(struct obx_relay *r, int64_t id)
{
    for (size_t i = 0; i < r->n_held_back; i++)
        if (r->held_back[i].id == id)
            return &r->held_back[i];
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

/* True if `row` must wait behind an earlier refused row of its key, or of
 * its topic when the topic refused it. */
bool relay_held_back(struct obx_relay *r, const struct obx_row *row, uint32_t topic)
{
    for (size_t i = 0; i < r->n_held_back; i++)
        if (holds(&r->held_back[i], topic, row->id, row->key, row->key_len))
            return true;
    return false;
}

/* The entry that holds back the rows of topic `topic`, or NULL. */
static struct held_back *topic_held(struct obx_relay *r, uint32_t topic)
{
    for (size_t i = 0; i < r->n_held_back; i++)
        if (r->held_back[i].whole_topic && r->held_back[i].topic == topic)
            return &r->held_back[i];
    return NULL;
}

/* Forgets entry `b`: its key goes on. */
static void forget(struct obx_relay *r, struct held_back *b, struct held_fx *fx)
{
    fx->clear_cursor = "key no longer held back"; /* its later rows may wait below hwm */
    r->lifted[fx->n_lifted++] = b->id;
    obx_free(b->key);
    *b = r->held_back[--r->n_held_back];
}

void relay_release_held_back(struct obx_relay *r, int64_t id, struct held_fx *fx)
{
    struct held_back *b = relay_find_held_back(r, id);
    if (!b)
        return;
    obx_info("relay: row %lld delivered after %d failed tries; its key goes on", (long long)id,
             b->attempts);
    forget(r, b, fx);
}

void relay_drop_held_back(struct obx_relay *r, int64_t id, struct held_fx *fx)
{
    struct held_back *b = relay_find_held_back(r, id);
    if (b)
        forget(r, b, fx);
}

/* True if an earlier held row of its key, or of its topic refused as a
 * whole, holds `b` back too. */
bool relay_behind_another(const struct obx_relay *r, const struct held_back *b)
{
    for (size_t j = 0; j < r->n_held_back; j++)
        if (holds(&r->held_back[j], b->topic, b->id, b->key, b->key_len))
            return true;
    return false;
}

/* The row to try alone next: the lowest-id due one that no earlier refused row
 * of its key holds back. NULL if none. */
struct held_back *relay_due_alone(struct obx_relay *r, int64_t now)
{
    struct held_back *best = NULL;
    for (size_t i = 0; i < r->n_held_back; i++) {
        struct held_back *b = &r->held_back[i];
        if (!b->alone || b->retry_at > now || (best && best->id < b->id))
            continue;
        if (!relay_behind_another(r, b))
            best = b;
    }
    return best;
}

/* After a full fetch: a held row that was due when it was sent, that no
 * earlier held row of its key held back in it (one may have gone since),
 * and whose place the answer passed without it, is no longer unsent (the
 * recovery pass found it in Kafka and marked it, or another relay published
 * it): its key goes on. `rows` are the answer's n rows, `full`: it had as
 * many as it asked for. */
void relay_drop_settled(struct obx_relay *r, const struct obx_row *rows, size_t n, bool full,
                        struct held_fx *fx)
{
    for (size_t i = 0; i < r->n_held_back;) {
        const struct held_back *b = &r->held_back[i];
        bool passed = !full || (n > 0 && rows[n - 1].id > b->id);
        bool due = !b->alone && b->retry_at <= r->cur.fetch_sent_at;
        bool fetched = false;
        for (size_t j = 0; j < n && passed && due && !fetched; j++)
            fetched = rows[j].id == b->id;
        if (!passed || !due || fetched || b->behind_at_fetch) {
            i++;
            continue;
        }
        obx_info("relay: row %lld is no longer waiting to be sent; its key goes on",
                 (long long)b->id);
        forget(r, &r->held_back[i], fx); /* moves the last entry here */
        fx->want_fetch = "key no longer held back";
    }
}

/* Room for twice as many refused rows: their entries, their keys for the
 * fetch, and their ids among the fetch's exclusions. */
int relay_grow_held_back(struct obx_relay *r)
{
    size_t cap = r->cap_held_back ? r->cap_held_back * 2 : 64;
    struct held_back *b = obx_realloc(r->held_back, cap * sizeof(*b));
    if (!b)
        return -1;
    r->held_back = b;
    struct obx_held_back_key *k = obx_realloc(r->keys, cap * sizeof(*k));
    if (!k)
        return -1;
    r->keys = k;
    int64_t *ki = obx_realloc(r->key_ids, cap * sizeof(*ki));
    if (!ki)
        return -1;
    r->key_ids = ki;
    int64_t *li = obx_realloc(r->lifted, cap * sizeof(*li));
    if (!li)
        return -1;
    r->lifted = li;
    int64_t *ids = obx_realloc(r->ids, ((size_t)r->set.max_in_flight + cap) * sizeof(*ids));
    if (!ids)
        return -1;
    r->ids = ids;
    r->cap_held_back = cap;
    return 0;
}

/* The next try of `b`: the back-off doubles with each failed one. */
static void schedule_retry(const struct obx_relay *r, struct held_back *b, int64_t now)
{
    int64_t delay = r->set.retry_backoff_ms;
    for (int i = 0; i < b->attempts && delay < MAX_REFUSED_BACKOFF_MS; i++)
        delay *= 2;
    if (delay > MAX_REFUSED_BACKOFF_MS)
        delay = MAX_REFUSED_BACKOFF_MS;
    b->attempts++;
    b->retry_at = now + delay;
}

/* Row `id` was refused: retry it later, holding back its key meanwhile. */
void relay_hold_back(struct obx_relay *r, int64_t id, uint32_t topic, const char *key,
                     size_t key_len, int64_t now, struct held_fx *fx)
{
    fx->clear_cursor = "row refused"; /* it is below hwm, and comes back by a full fetch */
    struct held_back *b = relay_find_held_back(r, id);
    if (!b) {
        if (r->n_held_back == r->cap_held_back && relay_grow_held_back(r) != 0) {
            /* Retried at once, and its key goes on: a fault we say out loud. */
            obx_error("relay: out of memory holding back the key of row %lld (%zu held back)",
                      (long long)id, r->n_held_back);
            return;
        }
        char *copy = NULL;
        if (key && !(copy = obx_malloc(key_len ? key_len : 1))) {
            obx_error("relay: out of memory holding back the key of row %lld", (long long)id);
            return;
        }
        if (key)
            memcpy(copy, key, key_len);
        b = &r->held_back[r->n_held_back++];
        *b = (struct held_back){.id = id, .topic = topic, .key = copy, .key_len = key_len};
        fx->hold = true; /* log mode: the cursor rows name it */
        fx->hold_id = id;
        fx->hold_topic = topic;
        fx->hold_key = key;
        fx->hold_key_len = key_len;
    }
    schedule_retry(r, b, now);
}

/* Row `id` refused for good, retried (relay.on_reject = retry, or no
 * memory for its dead letter): alone, with back-off, its key waiting. */
void relay_held_refused(struct obx_relay *r, int64_t id, uint32_t topic, const char *key,
                        size_t key_len, int64_t now, struct held_fx *fx)
{
    relay_hold_back(r, id, topic, key, key_len, now, fx);
    struct held_back *b = relay_find_held_back(r, id);
    if (b) {
        b->alone = true;      /* retried alone, with back-off: a refusal in a batch would
                               * take the batch's other rows with it */
        if (b->whole_topic) { /* refused for itself now: the topic takes rows again */
            b->whole_topic = false;
            fx->clear_cursor = "topic no longer held";
        }
    }
}

bool relay_behind_topic(struct obx_relay *r, const struct slot *s)
{
    const struct held_back *t = r->n_held_back > 0 ? topic_held(r, s->topic) : NULL;
    return t && t->id < s->id;
}

bool relay_held_topic_refused(struct obx_relay *r, int64_t id, uint32_t topic, const char *key,
                              size_t key_len, const char *reason, int64_t now, struct held_fx *fx)
{
    struct held_back *t = topic_held(r, topic);
    if (t && t->id < id) { /* behind it: fetched again once the topic goes on */
        obx_debug("relay: row %lld (topic %s) refused: %s; it waits behind row %lld", (long long)id,
                  r->topics.name[topic], reason, (long long)t->id);
        return true;
    }
    if (!t)
        obx_error("relay: topic %s refused row %lld: %s; the topic's rows wait behind its first "
                  "one, which is retried alone with back-off, and other topics go on "
                  "(relay.on_reject = retry)",
                  r->topics.name[topic], (long long)id, reason);
    /* The topic's entry is its lowest row with one, or this row: reports
     * of rows of the topic may have come first (a refusal in a batch purges
     * the producer, and each purged row came back for a retry). Every
     * other entry of the topic goes; its row waits behind that one. */
    int64_t low = id;
    int attempts = 0;
    for (size_t i = 0; i < r->n_held_back; i++) {
        const struct held_back *o = &r->held_back[i];
        if (o->topic != topic)
            continue;
        if (o->id < low)
            low = o->id;
        if (o->attempts > attempts)
            attempts = o->attempts;
    }
    for (size_t i = 0; i < r->n_held_back;) {
        if (r->held_back[i].topic == topic && r->held_back[i].id != low)
            forget(r, &r->held_back[i], fx); /* moves the last entry here */
        else
            i++;
    }
    if (low == id)
        relay_hold_back(r, id, topic, key, key_len, now, fx);
    struct held_back *b = relay_find_held_back(r, low);
    if (b) {
        b->attempts = attempts; /* the topic's back-off goes on from where it was */
        schedule_retry(r, b, now);
        b->whole_topic = true;
        b->alone = true;
    }
    return false;
}

void relay_held_batch_refused(struct obx_relay *r, int64_t id, uint32_t topic, const char *key,
                              size_t key_len, const char *reason, int64_t now, struct held_fx *fx)
{
    obx_warn("relay: the batch of row %lld (topic %s) was refused by Kafka: %s; trying the row "
             "alone before relay.on_reject applies, later rows of its key wait",
             (long long)id, r->topics.name[topic], reason);
    relay_hold_back(r, id, topic, key, key_len, now, fx);
    struct held_back *b = relay_find_held_back(r, id);
    if (b) {
        b->alone = true;
        b->retry_at = now;
    }
}

size_t obx_relay_held_back_keys(const struct obx_relay *r)
{
    return r->n_held_back;
}
