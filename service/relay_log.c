/*
 * relay_log: log mode (relay.on_sent = log): the records of the fetches, the
 * checkpoints they make, the held keys the cursor rows name, and the cursor row
 * itself. See relay_log.h for the state, relay.c for the cycle.
 */
#include "relay_log.h"
#include "outboxd/alloc.h"
#include "outboxd/keycount.h"
#include "outboxd/log.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Forgets the checkpoint of record `f`, if it made one. */
static void rec_drop_checkpoint(struct fetch_rec *f)
{
    f->checkpoint = false;
    obx_free(f->snap);
    f->snap = NULL;
    obx_free(f->about);
    f->about = NULL;
    obx_free(f->about_text);
    f->about_text = NULL;
}

/* The ready checkpoint is gone (written, replaced, or forgotten). */
static void ready_about_free(struct log_state *l)
{
    obx_free(l->ready_about);
    l->ready_about = NULL;
    obx_free(l->ready_about_text);
    l->ready_about_text = NULL;
}

struct fetch_rec *log_rec_of(struct log_state *l, uint64_t seq)
{
    if (seq < l->head_seq || seq - l->head_seq >= l->n_recs)
        return NULL;
    return &l->recs[(l->rec_head + (seq - l->head_seq)) % l->cap_recs];
}

uint64_t log_rec_push(struct log_state *l)
{
    /* The newest record has nothing pending (its fetch handed nothing out,
     * or all of it settled) while an older one waits: this fetch takes its
     * place, with its own checkpoint if it makes one. So a row that waits long
     * (a partition Kafka cannot take) costs one record per fetch that
     * hands rows out behind it, not one per look for new rows. */
    if (l->n_recs > 1) {
        uint64_t back_seq = l->head_seq + l->n_recs - 1;
        struct fetch_rec *back = log_rec_of(l, back_seq);
        if (back && back->pending == 0) {
            rec_drop_checkpoint(back);
            *back = (struct fetch_rec){.send_no = l->fetch_send_no};
            return back_seq;
        }
    }
    if (l->n_recs == l->cap_recs) {
        size_t cap = l->cap_recs ? l->cap_recs * 2 : 64;
        struct fetch_rec *grown = obx_calloc(cap, sizeof(*grown));
        if (!grown)
            return 0;
        for (size_t i = 0; i < l->n_recs; i++)
            grown[i] = l->recs[(l->rec_head + i) % l->cap_recs];
        obx_free(l->recs);
        l->recs = grown;
        l->cap_recs = cap;
        l->rec_head = 0;
    }
    if (l->n_recs == 0)
        l->head_seq = l->next_seq + 1;
    uint64_t seq = ++l->next_seq;
    struct fetch_rec *f = &l->recs[(l->rec_head + l->n_recs++) % l->cap_recs];
    *f = (struct fetch_rec){.send_no = l->fetch_send_no};
    return seq;
}

bool log_rec_add_row(struct log_state *l, uint64_t seq)
{
    struct fetch_rec *f = log_rec_of(l, seq);
    if (f)
        f->pending++; /* settled as it is delivered, held or released */
    return f != NULL;
}

/* A cursor row about slot `slot` up to `hwm` is stored. */
static void raise_slot_hwm(struct log_state *l, int slot, int64_t hwm)
{
    if (l->slot_hwm && l->slot_hwm[slot] < hwm)
        l->slot_hwm[slot] = hwm;
}

/* The fetch `seq` made a checkpoint: its cursor (hwm, snap). */
void log_rec_checkpoint(struct log_state *l, uint64_t seq, int64_t hwm, const char *snap)
{
    struct fetch_rec *f = log_rec_of(l, seq);
    if (!f || f->checkpoint)
        return;
    f->snap = obx_strdup(snap);
    f->checkpoint = f->snap != NULL; /* no memory: no checkpoint, which is always safe */
    f->hwm = hwm;
}

/* Raises bound[] to `hwm` for the slots of a checkpoint about `about` (NULL:
 * every slot owned, a whole checkpoint: false, as no partial checkpoint may follow
 * one that is still to be stored). */
static bool bound_by(int shards, int64_t *bound, const bool *about, int64_t hwm)
{
    if (!about)
        return false;
    for (int i = 0; i < shards; i++)
        if (about[i] && bound[i] < hwm)
            bound[i] = hwm;
    return true;
}

/* For each slot, the highest hwm of a cursor row about it that is stored
 * or may yet be: loaded, written (or perhaps written) by this relay, and
 * every checkpoint not dropped. False if a whole checkpoint is among them. Checkpoints
 * are made as a fetch is answered, never while a write is in flight. */
static bool slot_bounds(const struct log_state *l, int shards, int64_t *bound)
{
    memcpy(bound, l->slot_hwm, (size_t)shards * sizeof(*bound));
    if (l->has_ready && l->ready_seq > l->stored_seq &&
        !bound_by(shards, bound, l->ready_about, l->ready_hwm))
        return false;
    for (size_t i = 0; i < l->n_recs; i++) {
        const struct fetch_rec *f = &l->recs[(l->rec_head + i) % l->cap_recs];
        if (f->checkpoint && !bound_by(shards, bound, f->about, f->hwm))
            return false;
    }
    return true;
}

/* The fetch `seq`, a full one cut below the stored hwm, handed out every
 * uncovered row of the owned slots up to `hwm` that its snapshot saw: a
 * checkpoint about those of them whose cursor rows and checkpoints are all at or
 * below `hwm` (about the others, a cursor row at `hwm` would cover less
 * than the one before it). Without it, rows of slots far behind the
 * others' cursor rows (taken from a relay that stopped or froze) could
 * never be stored once they filled relay.max_in_flight. */
void log_rec_checkpoint_partial(struct log_state *l, const struct log_view *v, uint64_t seq,
                                int64_t hwm, const char *snap)
{
    struct fetch_rec *f = log_rec_of(l, seq);
    if (!f || f->checkpoint || !l->slot_hwm || !owner_active(v->owner))
        return;
    int64_t *bound = obx_calloc((size_t)v->shards, sizeof(*bound));
    int n = 0;
    if (bound && slot_bounds(l, v->shards, bound) &&
        (f->about = obx_calloc((size_t)v->shards, sizeof(*f->about))))
        for (int i = 0; i < v->shards; i++) {
            f->about[i] = v->owner->owned[i] && bound[i] <= hwm;
            n += f->about[i];
        }
    obx_free(bound);
    /* "{" and up to five characters a slot (1023,) and "}" */
    size_t cap = 2 + (size_t)n * 5 + 1;
    if (n == 0 || !(f->about_text = obx_malloc(cap)) || !(f->snap = obx_strdup(snap))) {
        rec_drop_checkpoint(f); /* none, or no memory: no checkpoint, which is always safe */
        return;
    }
    size_t len = 0;
    f->about_text[len++] = '{';
    for (int i = 0; i < v->shards; i++)
        if (f->about[i])
            len += (size_t)snprintf(f->about_text + len, cap - len, "%s%d", len > 1 ? "," : "", i);
    f->about_text[len++] = '}';
    f->about_text[len] = '\0';
    f->checkpoint = true;
    f->hwm = hwm;
    if (!l->partial_told) {
        l->partial_told = true;
        obx_event(OBX_LOG_INFO, "log_partial_claims",
                  "relay: slots %s lag behind the cursor (up to %lld, stored %lld): their rows "
                  "are stored as they catch up",
                  f->about_text, (long long)hwm, (long long)l->stored_hwm);
    }
}

/* Records whose rows have all settled retire from the ring, oldest first; the
 * newest checkpoint among them becomes ready (but a partial one behind a whole
 * one not yet stored, which is dropped). */
void log_recs_retire(struct log_state *l, int64_t now)
{
    while (l->n_recs > 0) {
        struct fetch_rec *f = &l->recs[l->rec_head];
        if (f->pending > 0)
            break;
        /* A partial checkpoint does not replace a whole one not yet stored:
         * that one covers the rows of every slot handed out before it. */
        if (f->checkpoint && f->about && l->has_ready && !l->ready_about &&
            l->ready_seq > l->stored_seq)
            rec_drop_checkpoint(f);
        if (f->checkpoint) {
            if (!l->has_ready || l->ready_seq <= l->stored_seq)
                l->ready_since = now;
            obx_free(l->ready_snap);
            ready_about_free(l);
            l->ready_snap = f->snap;
            l->ready_about = f->about;
            l->ready_about_text = f->about_text;
            l->ready_hwm = f->hwm;
            l->ready_seq = l->head_seq;
            l->ready_send = f->send_no;
            l->has_ready = true;
            f->snap = NULL;
            f->about = NULL;
            f->about_text = NULL;
        }
        l->rec_head = (l->rec_head + 1) % l->cap_recs;
        l->n_recs--;
        l->head_seq++;
    }
}

/* The checkpoints of fetch `seq` and of every later one are no longer valid: a row of
 * that fetch is unsent again without being held. */
void log_checkpoints_drop_from(struct log_state *l, uint64_t seq)
{
    for (uint64_t s = seq < l->head_seq ? l->head_seq : seq; s < l->head_seq + l->n_recs; s++) {
        struct fetch_rec *f = log_rec_of(l, s);
        if (!f)
            break;
        rec_drop_checkpoint(f);
    }
}

/* Whether row `id` is refused and held: the cursor rows leave it (and its
 * key's later rows) out, so the checkpoints that count it as handed out stay valid. */
static bool held_now(const struct log_state *l, int64_t id)
{
    for (size_t i = 0; i < l->n_held; i++)
        if (l->held[i].from_id == id && !l->held[i].lifted)
            return true;
    return false;
}

void log_settle(struct log_state *l, uint64_t seq, int64_t id, bool acked, int64_t now)
{
    struct fetch_rec *f = log_rec_of(l, seq);
    if (!acked && !held_now(l, id))
        log_checkpoints_drop_from(l, seq);
    if (f && f->pending > 0)
        f->pending--;
    log_recs_retire(l, now);
}

void log_fetch_sent(struct log_state *l)
{
    l->fetch_send_no = ++l->sends;
}

void log_slots_taken(struct log_state *l, bool reload)
{
    if (reload)
        l->loaded = false;
    l->has_ready = false; /* log_write_build refuses writes until the reload */
    log_checkpoints_drop_from(l, 0);
}

void log_others_seen(struct log_state *l, int64_t hwm)
{
    if (hwm > l->others_hwm)
        l->others_hwm = hwm;
}

static void rule_free(struct held_rule *h)
{
    obx_free(h->key);
}

/* Whether a held rule still leaves published row `a` out (so the cursor
 * rows must go on listing it). */
static bool also_needed(const struct log_state *l, const struct also_row *a)
{
    for (size_t i = 0; i < l->n_held; i++) {
        const struct held_rule *h = &l->held[i];
        if (!a->hash || a->id == h->from_id ||
            (h->key && h->hash == a->hash && h->topic == a->topic && a->id > h->from_id))
            return true; /* the refused row itself, delivered since, or one of its key */
    }
    return false;
}

/* Whether a lifted rule starts at row `id`. */
static bool lifted_rule_of(const struct log_state *l, int64_t id)
{
    for (size_t i = 0; i < l->n_held; i++)
        if (l->held[i].from_id == id && l->held[i].lifted)
            return true;
    return false;
}

/* Whether a rule went on before the ready checkpoint's fetch was sent: the next
 * cursor row drops it, worth writing even if it covers no new row. */
static bool rule_to_drop(const struct log_state *l)
{
    for (size_t i = 0; i < l->n_held; i++)
        if (l->held[i].lifted && l->ready_send > l->held[i].lift_send)
            return true;
    return false;
}

/* Adds a published row of a held key; false out of memory. */
static bool also_add(struct log_state *l, int64_t id, uint64_t hash, uint32_t topic)
{
    if (l->n_also == l->cap_also) {
        size_t cap = l->cap_also ? l->cap_also * 2 : 16;
        struct also_row *g = obx_realloc(l->also, cap * sizeof(*g));
        if (!g)
            return false;
        l->also = g;
        l->cap_also = cap;
    }
    l->also[l->n_also++] = (struct also_row){id, hash, topic};
    return true;
}

/* Log mode: row `id` of `topic` (key or NULL) is refused or waits: the
 * cursor leaves it and its key's later rows out until it goes on. */
void log_hold(struct log_state *l, int64_t id, uint32_t topic, const char *key, size_t key_len)
{
    for (size_t i = 0; i < l->n_held; i++)
        if (l->held[i].from_id == id && !l->held[i].lifted)
            return;
    if (l->n_held == l->cap_held) {
        size_t cap = l->cap_held ? l->cap_held * 2 : 16;
        struct held_rule *g = obx_realloc(l->held, cap * sizeof(*g));
        if (!g) {
            obx_error("relay: out of memory holding row %lld out of the cursor; stopping the "
                      "cursor until it is delivered",
                      (long long)id);
            log_checkpoints_drop_from(l, 0);
            return;
        }
        l->held = g;
        l->cap_held = cap;
    }
    char *copy = NULL;
    if (key && !(copy = obx_malloc(key_len ? key_len : 1))) {
        obx_error("relay: out of memory holding row %lld out of the cursor", (long long)id);
        log_checkpoints_drop_from(l, 0);
        return;
    }
    if (key)
        memcpy(copy, key, key_len);
    l->held[l->n_held++] = (struct held_rule){
        .topic = topic,
        .key = copy,
        .key_len = key_len,
        .from_id = id,
        .hash = key ? obx_keycount_hash(topic, key, key_len) : 0,
    };
}

/* Row `id` went on (delivered, dead-lettered or gone): its key's rows may be
 * fetched, and the rule goes once a checkpoint made after this is stored. */
void log_lift(struct log_state *l, int64_t id)
{
    for (size_t i = 0; i < l->n_held; i++) {
        if (l->held[i].from_id == id && !l->held[i].lifted) {
            l->held[i].lifted = true;
            l->held[i].lift_send = l->sends;
        }
    }
}

/* A found row for `id`, removed from the list; false if none. */
bool log_take_found(struct log_state *l, int64_t id, struct found_row *out)
{
    size_t lo = 0, hi = l->n_found;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (l->found[mid].id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == l->n_found || l->found[lo].id != id)
        return false;
    *out = l->found[lo];
    memmove(&l->found[lo], &l->found[lo + 1], (l->n_found - lo - 1) * sizeof(*l->found));
    l->n_found--;
    return true;
}

/* The session's log state starts again from what the next recovery pass
 * reads: checkpoints, held keys, found rows and stored offsets are forgotten. */
void log_reset(struct log_state *l)
{
    for (size_t i = 0; i < l->n_recs; i++)
        rec_drop_checkpoint(&l->recs[(l->rec_head + i) % l->cap_recs]);
    l->n_recs = 0;
    l->has_ready = false;
    ready_about_free(l);
    obx_free(l->slot_hwm);
    l->slot_hwm = NULL;
    l->partial_told = false;
    l->has_stored = false;
    for (size_t i = 0; i < l->n_held; i++)
        rule_free(&l->held[i]);
    l->n_held = 0;
    l->n_found = 0;
    l->n_offs = 0;
    l->n_also = 0;
    l->loaded = false;
    l->others_hwm = 0; /* another session may see another outbox (a restore) */
}

/* The held keys and the rows of them published, in log.held_out and
 * log.also_out (`extra` more ids of room in also_out). false: no memory. */
static bool log_held_out_room(struct log_state *l, const struct topics *topics, size_t extra,
                              uint64_t checkpoint_send)
{
    size_t n_also = extra + l->n_also;
    if (l->n_held > l->cap_held_out) {
        struct obx_log_held *h = obx_realloc(l->held_out, l->n_held * sizeof(*h));
        if (!h)
            return false;
        l->held_out = h;
        l->cap_held_out = l->n_held;
    }
    if (n_also > l->cap_also_out) {
        int64_t *a = obx_realloc(l->also_out, n_also * sizeof(*a));
        if (!a)
            return false;
        l->also_out = a;
        l->cap_also_out = n_also;
    }
    l->n_also_out = 0;
    l->n_held_out = 0;
    for (size_t i = 0; i < l->n_held; i++) {
        const struct held_rule *h = &l->held[i];
        if (h->lifted && checkpoint_send > h->lift_send)
            continue; /* the checkpoint written with these covers its rows */
        l->held_out[l->n_held_out++] =
            (struct obx_log_held){topics->name[h->topic], h->key, h->key_len, h->from_id};
    }
    for (size_t i = 0; i < l->n_also; i++)
        l->also_out[l->n_also_out++] = l->also[i].id;
    return true;
}

bool log_held_out(struct log_state *l, const struct topics *topics)
{
    if (log_held_out_room(l, topics, 0, 0))
        return true;
    obx_error("relay: out of memory building the fetch");
    return false;
}

/* Cursor rows between two that empty the table (and carry every offset). */
#define LOG_RESTART_EVERY 1000
/* A cursor row waits this long for more acknowledgements, unless a batch of
 * them is waiting already (or the relay drains): a row per 100 ms at most
 * when rows trickle in, a few hundred bytes of WAL each, and the one
 * connection is left to the fetches in between. What a row does not cover
 * yet keeps its seat, and a crash meanwhile costs the recovery pass a
 * longer read of Kafka, nothing else. */
#define LOG_WRITE_DELAY_MS 100
/* How often a relay with slots stores its offsets with its cursor rows. */
#define LOG_SLOT_OFFSETS_MS 1000

/* The stored offset entry of (topic, partition), added if new; NULL out of
 * memory (that partition's offset then lags, which costs the recovery pass
 * a longer read and nothing else). */
static struct log_offset *log_offset_of(struct log_state *l, uint32_t topic, int32_t partition)
{
    for (size_t i = 0; i < l->n_offs; i++)
        if (l->offs[i].topic == topic && l->offs[i].partition == partition)
            return &l->offs[i];
    if (l->n_offs == l->cap_offs) {
        size_t cap = l->cap_offs ? l->cap_offs * 2 : 32;
        struct log_offset *g = obx_realloc(l->offs, cap * sizeof(*g));
        if (!g)
            return NULL;
        l->offs = g;
        l->cap_offs = cap;
    }
    struct log_offset *o = &l->offs[l->n_offs++];
    *o = (struct log_offset){
        .topic = topic, .partition = partition, .stored = -1, .covered = -1, .below = INT64_MAX};
    return o;
}

/* Log mode: the offset to store for each partition, into the off_* arrays
 * (those that moved, or all with `all`): below the lowest acknowledged row
 * the write does not cover (nor any record the recovery pass found), else
 * the highest it covers. */
static bool log_offsets_out(struct log_state *l, const struct log_view *v, uint64_t upto, bool all,
                            struct part_offsets *out)
{
    for (size_t i = 0; i < l->n_offs; i++) {
        l->offs[i].covered = -1;
        l->offs[i].below = INT64_MAX;
    }
    for (int i = 0; i < v->rows->cap; i++) {
        const struct seat *s = &v->rows->seat[i];
        if (s->orphan || (s->state != SEAT_ACKED && s->state != SEAT_MARKING) || s->offset < 0)
            continue;
        struct log_offset *o = log_offset_of(l, s->topic, s->partition);
        if (!o)
            continue;
        if (s->seq <= upto) {
            if (s->offset > o->covered)
                o->covered = s->offset;
        } else if (s->offset < o->below) {
            o->below = s->offset;
        }
    }
    for (size_t i = 0; i < l->n_found; i++) {
        struct log_offset *o = log_offset_of(l, l->found[i].topic, l->found[i].partition);
        if (o && l->found[i].offset < o->below)
            o->below = l->found[i].offset;
    }
    out->n = 0;
    for (size_t i = 0; i < l->n_offs; i++) {
        struct log_offset *o = &l->offs[i];
        int64_t at = o->below != INT64_MAX ? o->below - 1 : o->covered;
        if (at < o->stored)
            at = o->stored; /* never back: see the comment on log mode */
        o->covered = at;    /* what this write stores */
        if (at < 0 || (!all && at == o->stored))
            continue;
        if (part_offsets_add(out, v->topics->name[o->topic], o->partition, at) != 0)
            return false;
    }
    return true;
}

/* Whether the ready checkpoint covers the row in flight in `s`: handed out up
 * to it, and of a slot a partial checkpoint is about, at or below its hwm. */
static bool ready_covers(const struct log_state *l, const struct seat *s)
{
    if (s->orphan || s->seq > l->ready_seq)
        return false;
    return !l->ready_about ||
           (s->has_key_slot && l->ready_about[s->key_slot] && s->id <= l->ready_hwm);
}

/* A refused row to dead-letter that a partial checkpoint's cursor row could
 * cover without listing it (a row whose slot its fetch did not say): the
 * row would be published by the cursor and in neither Kafka nor
 * outbox.dead_letters. Such a row waits for a whole checkpoint. */
static bool partial_leaves_dead(const struct log_state *l, const struct rows *rows)
{
    for (int i = 0; l->ready_about && i < rows->cap; i++) {
        const struct seat *s = &rows->seat[i];
        if (s->state == SEAT_DEAD && !s->orphan && s->seq <= l->ready_seq && !s->has_key_slot &&
            s->id <= l->ready_hwm)
            return true;
    }
    return false;
}

/* Acknowledged rows of held keys (and dead letters, done with too) that
 * the ready checkpoint covers: published, though a rule leaves their key's rows
 * out, so the cursor row lists them (l->also_out). A hash may match another
 * key: listing a row that is covered anyway changes nothing. False with no
 * memory. */
static bool list_also_sent(struct log_state *l, const struct rows *rows)
{
    for (int i = 0; i < rows->cap && l->n_held > 0; i++) {
        const struct seat *s = &rows->seat[i];
        if ((s->state != SEAT_ACKED && s->state != SEAT_DEAD) || !ready_covers(l, s))
            continue;
        struct also_row a = {s->id, s->log_hash, s->topic};
        if (!a.hash && !held_now(l, s->id) && !lifted_rule_of(l, s->id))
            continue; /* no key: only a rule of the row itself leaves it out */
        if (!also_needed(l, &a))
            continue;
        if (!also_add(l, a.id, a.hash, a.topic))
            return false;
        l->also_out[l->n_also_out++] = s->id;
    }
    return true;
}

/* With slots, a relay whose slots have nothing acknowledged still stores
 * its checkpoint this often once newer rows exist: the floor of every slot's
 * cursor (sql/009, outbox.log_floor) bounds what the reclaim of partitions,
 * the compaction of cursor rows and the reads of uncovered rows look at,
 * and a slot no relay writes for would hold it back for everyone. */
#define LOG_IDLE_WRITE_MS 1000

bool log_idle_write_due(const struct log_state *l, const struct log_view *v)
{
    return owner_active(v->owner) && l->loaded && l->has_ready && l->ready_seq > l->stored_seq &&
           l->ready_hwm > l->stored_hwm && v->now - l->stored_at >= LOG_IDLE_WRITE_MS;
}

bool log_ready_covers(const struct log_state *l, const struct seat *s)
{
    return ready_covers(l, s);
}

bool log_write_build(struct log_state *l, const struct log_view *v, int64_t *dead_ids,
                     const char **dead_reasons, struct part_offsets *offs, struct obx_mark *out,
                     bool *restart_out)
{
    int64_t now = v->now;
    bool idle = log_idle_write_due(l, v);
    if (!l->has_ready || l->ready_seq <= l->stored_seq || (l->ready_seq == l->looked_seq && !idle))
        return false;
    /* Slots taken and the cursor rows about them not read yet: a checkpoint
     * from before is not about them (see relay_owner.c, apply_owned). */
    if (owner_active(v->owner) && !l->loaded)
        return false;
    if (!v->draining && !owner_want_quiet(v->owner) && now - l->ready_since < LOG_WRITE_DELAY_MS &&
        rows_to_mark(v->rows) < v->batch_size)
        return false;
    size_t n_cov = 0, n_dead = 0;
    for (int i = 0; i < v->rows->cap; i++) {
        const struct seat *s = &v->rows->seat[i];
        if (!ready_covers(l, s))
            continue;
        if (s->state == SEAT_ACKED)
            n_cov++;
        else if (s->state == SEAT_DEAD)
            dead_reasons[n_dead] = s->reason, dead_ids[n_dead++] = s->id;
    }
    if ((n_cov + n_dead == 0 && !rule_to_drop(l) && !idle) || partial_leaves_dead(l, v->rows)) {
        l->looked_seq = l->ready_seq; /* nothing to store until the checkpoint moves */
        return false;
    }
    if (!log_held_out_room(l, v->topics, n_cov + n_dead, l->ready_send) ||
        !list_also_sent(l, v->rows)) {
        obx_error("relay: out of memory building the cursor row");
        return false;
    }
    bool restart = l->writes + 1 >= LOG_RESTART_EVERY;
    /* With slots the offsets are rows of kafka_slot_offsets, one per slot
     * and partition, updated: once a second is enough (as mark mode's),
     * and at once before slots move or the relay stops. Not with a
     * partial checkpoint: acknowledged rows of the other slots may lie below
     * the offsets, which would be stored for its slots (left lower, they
     * cost the next recovery pass a longer read, nothing more). */
    l->offsets_in_write = !l->ready_about && (!owner_active(v->owner) || restart || v->draining ||
                                              owner_want_quiet(v->owner) || now >= l->offsets_due);
    offs->n = 0;
    if (l->offsets_in_write && !log_offsets_out(l, v, l->ready_seq, restart, offs)) {
        obx_error("relay: out of memory building the cursor row");
        return false;
    }
    obx_free(l->write_snap);
    obx_free(l->write_about_text);
    obx_free(l->write_about);
    l->write_about_text = NULL;
    l->write_about = NULL;
    size_t about_size = (size_t)v->shards * sizeof(*l->write_about);
    if (!(l->write_snap = obx_strdup(l->ready_snap)) ||
        (l->ready_about && (!(l->write_about_text = obx_strdup(l->ready_about_text)) ||
                            !(l->write_about = obx_malloc(about_size))))) {
        obx_error("relay: out of memory building the cursor row");
        return false;
    }
    if (l->write_about)
        memcpy(l->write_about, l->ready_about, about_size);
    struct obx_mark m = {.log = true,
                         .batch = l->stored_batch + 1,
                         .hwm = l->ready_hwm,
                         .snapshot = l->write_snap,
                         .held = l->held_out,
                         .n_held = l->n_held_out,
                         .also_sent = l->also_out,
                         .n_also = l->n_also_out,
                         .restart = restart,
                         .shards = v->shards,
                         .owned_slots =
                             l->ready_about ? l->write_about_text : owner_mark_slots(v->owner),
                         .topics = offs->topic,
                         .partitions = offs->partition,
                         .offsets = offs->offset,
                         .n_offsets = offs->n,
                         .dead_ids = dead_ids,
                         .dead_reasons = dead_reasons,
                         .n_dead = n_dead};
    *out = m;
    *restart_out = restart;
    return true;
}

void log_write_sent(struct log_state *l, bool restart)
{
    l->write_seq = l->ready_seq;
    l->write_send = l->ready_send;
    l->write_hwm = l->ready_hwm;
    l->write_partial = l->ready_about != NULL;
    l->restart_next = restart;
}

bool log_checkpoint_due(const struct log_state *l)
{
    return l->has_ready && l->ready_seq > l->stored_seq && l->ready_seq != l->looked_seq;
}

/* The fetches that handed the rows out made no checkpoint, or partial ones
 * about other slots: only a fetch that makes one can store them. */
bool log_waits_checkpoint(const struct log_state *l, const struct rows *rows)
{
    return rows_to_mark(rows) > 0 && rows_in_use(rows) == rows_to_mark(rows) &&
           !log_checkpoint_due(l);
}

/* The cursor row in flight is stored, or may be: slot_hwm of its slots
 * (a partial one's, or every slot owned) rises to its hwm. */
static void raise_for_write(struct log_state *l, const struct log_view *v)
{
    for (int i = 0; owner_active(v->owner) && i < v->shards; i++)
        if (l->write_partial ? l->write_about[i] : v->owner->owned[i])
            raise_slot_hwm(l, i, l->write_hwm);
}

/* The cursor row in flight failed, and may have committed all the same
 * (its answer lost): later partial checkpoints about its slots stay at or above
 * its hwm, as if it had. */
void log_write_failed(struct log_state *l, const struct log_view *v)
{
    raise_for_write(l, v);
}

/* The cursor row in flight committed: it is the stored cursor now. */
void log_write_done(struct log_state *l, const struct log_view *v)
{
    l->has_stored = true;
    l->stored_batch++;
    l->stored_seq = l->write_seq;
    l->stored_at = v->now;
    l->writes = l->restart_next ? 1 : l->writes + 1;
    /* A partial checkpoint's row is about some slots, below the stored hwm: the
     * checkpoints after it still start from the one before. It covers no held
     * key of the other slots, and stored no offsets. */
    raise_for_write(l, v);
    if (l->write_partial)
        return;
    l->stored_send = l->write_send;
    l->stored_hwm = l->write_hwm;
    obx_free(l->stored_snap);
    l->stored_snap = l->write_snap;
    l->write_snap = NULL;
    if (l->offsets_in_write) {
        for (size_t i = 0; i < l->n_offs; i++)
            l->offs[i].stored = l->offs[i].covered;
        l->offsets_due = v->now + LOG_SLOT_OFFSETS_MS;
    }
    /* A held key whose refused row went on before a fetch that the stored
     * checkpoint comes from (or an earlier one) is covered by that checkpoint. */
    for (size_t i = 0; i < l->n_held;) {
        if (l->held[i].lifted && l->stored_send > l->held[i].lift_send) {
            rule_free(&l->held[i]);
            l->held[i] = l->held[--l->n_held];
        } else {
            i++;
        }
    }
    for (size_t i = 0; i < l->n_also;) {
        if (also_needed(l, &l->also[i]))
            i++;
        else
            l->also[i] = l->also[--l->n_also];
    }
}

static int compare_found(const void *a, const void *b)
{
    int64_t x = ((const struct found_row *)a)->id, y = ((const struct found_row *)b)->id;
    return (x > y) - (x < y);
}

static int compare_id(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The found rows (sorted by id) a fetch will take: each id once, and not
 * those of rows this session has in flight (a pass that resolves a
 * possibly-persisted report runs while rows are out: they are stored as
 * they are, and an entry for them would wait for a fetch that never comes,
 * holding their slots back, relay_owner.c). Returns how many are kept. */
static size_t keep_found(const struct rows *rows, struct found_row *found, size_t n)
{
    size_t n_out = 0, kept = 0;
    int64_t *out = rows_in_use(rows) > 0 ? obx_calloc(rows_in_use(rows), sizeof(*out)) : NULL;
    for (int i = 0; out && i < rows->cap; i++)
        if (rows->seat[i].state != SEAT_FREE && !rows->seat[i].orphan && n_out < rows_in_use(rows))
            out[n_out++] = rows->seat[i].id;
    if (n_out > 1)
        qsort(out, n_out, sizeof(*out), compare_id);
    for (size_t i = 0; i < n; i++) {
        if (kept > 0 && found[kept - 1].id == found[i].id)
            continue;
        if (n_out > 0 && bsearch(&found[i].id, out, n_out, sizeof(*out), compare_id))
            continue;
        found[kept++] = found[i];
    }
    obx_free(out); /* no memory for it: every entry is kept, as before */
    return kept;
}

/* With slots: the highest hwm of the cursor rows about each slot (rows
 * about no slots, or about slots of another count, are counted for every
 * slot). 0, or -1 out of memory. */
static int load_slot_hwm(struct log_state *l, int n, const struct obx_log_state *st)
{
    if (!(l->slot_hwm = obx_calloc((size_t)n, sizeof(*l->slot_hwm))))
        return -1;
    int64_t every = INT64_MIN;
    for (size_t i = 0; i < st->n_slot_hwms; i++) {
        const struct obx_log_slot_hwm *h = &st->slot_hwms[i];
        if (h->shards != n && h->hwm > every)
            every = h->hwm;
    }
    for (int s = 0; s < n; s++)
        l->slot_hwm[s] = every;
    for (size_t i = 0; i < st->n_slot_hwms; i++) {
        const struct obx_log_slot_hwm *h = &st->slot_hwms[i];
        if (h->shards == n && h->slot >= 0 && h->slot < n)
            raise_slot_hwm(l, h->slot, h->hwm);
    }
    return 0;
}

void log_found_set(struct log_state *l, const struct rows *rows, struct found_row *found, size_t n)
{
    if (n > 1)
        qsort(found, n, sizeof(*found), compare_found);
    size_t kept = keep_found(rows, found, n);
    obx_free(l->found);
    l->found = found;
    l->n_found = kept;
}

void log_load_reads(const struct log_view *v, const struct obx_log_state *st, size_t *n_held,
                    size_t *n_off)
{
    /* By slot, the full fetch reads every cursor row's held keys itself
     * (the rows published of them are still listed: see log_load); with
     * slots, the offsets are each slot's (kafka_slot_offsets), and the
     * first row stores all of ours for the slots it is about. */
    *n_held = owner_active(v->owner) || st->about_slots ? 0 : st->n_held;
    *n_off = owner_active(v->owner) ? 0 : st->n_off;
}

int log_load(struct log_state *l, const struct log_view *v, const struct obx_log_state *st,
             const uint32_t *held_topic, const uint32_t *off_topic, const struct held_back *back,
             size_t n_back)
{
    size_t n_found = l->n_found;
    log_reset(l);
    l->n_found = n_found; /* the records found stay */
    l->has_stored = st->has_cursor;
    l->stored_seq = 0;
    l->stored_send = 0;
    l->stored_batch = st->has_cursor ? st->batch : 0;
    l->stored_hwm = st->hwm;
    l->by_slot = owner_active(v->owner) || st->about_slots;
    if (owner_active(v->owner) && load_slot_hwm(l, v->shards, st) != 0)
        return -1;
    l->stored_at = v->now - LOG_IDLE_WRITE_MS; /* a checkpoint about the slots taken goes soon */
    if (l->by_slot && st->has_cursor && st->max_hwm > l->stored_hwm)
        l->stored_hwm = st->max_hwm; /* see cursor_advance */
    l->writes = 0;                   /* the next write empties the table when it is due */
    obx_free(l->stored_snap);
    l->stored_snap = NULL;
    if (st->has_cursor && !(l->stored_snap = obx_strdup(st->snapshot)))
        return -1;
    size_t n_held, n_off;
    log_load_reads(v, st, &n_held, &n_off);
    for (size_t i = 0; i < n_held; i++) {
        const struct obx_log_held *h = &st->held[i];
        size_t before = l->n_held;
        log_hold(l, h->from_id, held_topic[i], h->key, h->key_len);
        if (l->n_held == before)
            return -1;
        /* Lifted at once: the first checkpoint of this session (from a full
         * fetch, which reads the held rows) covers them. */
        l->held[before].lifted = true;
        l->held[before].lift_send = l->sends;
    }
    /* Rows of held keys published since: their keys are not stored, so
     * they are listed while any rule lives. */
    for (size_t i = 0; i < st->n_also; i++)
        if (!also_add(l, st->also_sent[i], 0, 0))
            return -1;
    for (size_t i = 0; i < n_off; i++) {
        struct log_offset *o = log_offset_of(l, off_topic[i], st->off_partitions[i]);
        if (!o)
            return -1;
        o->stored = st->off_offsets[i];
    }
    /* Rows refused or failed in an earlier session of this process are
     * still held back (their entries outlive a lost session): the cursor
     * rows of this one must leave them out too. */
    for (size_t i = 0; i < n_back; i++) {
        const struct held_back *b = &back[i];
        size_t before = l->n_held;
        log_hold(l, b->id, b->topic, b->key, b->key_len);
        if (l->n_held == before && !held_now(l, b->id))
            return -1;
    }
    l->loaded = true;
    return 0;
}

void log_free(struct log_state *l)
{
    log_reset(l);
    obx_free(l->recs);
    obx_free(l->ready_snap);
    obx_free(l->stored_snap);
    obx_free(l->write_snap);
    obx_free(l->write_about_text);
    obx_free(l->write_about);
    obx_free(l->held);
    obx_free(l->held_out);
    obx_free(l->also_out);
    obx_free(l->also);
    obx_free(l->found);
    obx_free(l->offs);
}
