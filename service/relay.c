/*
 * relay: see include/outboxd/relay.h.
 */
#include "outboxd/relay.h"
#include "outboxd/alloc.h"
#include "outboxd/failpoint.h"
#include "outboxd/keycount.h"
#include "outboxd/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* "No row" wherever an id is kept: ids may be 0 or below (an identity
 * restarted or set there by an operator). */
#define NO_ID INT64_MIN
/* Longest pause between retries of a refused row. */
#define MAX_REJECT_BACKOFF_MS (60 * 1000)
/* The pause before the next look for new rows after a fetch that found
 * some; each look that finds none doubles it, up to relay.poll_interval. */
#define POLL_MIN_MS 1
/* How often the marks store the partitions' offsets (outbox.kafka_offsets).
 * A stored offset only says where the recovery pass starts reading, so it
 * may lag: the pass then reads up to this much more. Storing it with every
 * mark updated a dozen rows a few hundred times a second, and under a held
 * xmin horizon every one of those versions stays, and each upsert walked
 * them all. */
#define OFFSETS_STORE_MS 1000

enum slot_state {
    SLOT_FREE = 0,
    SLOT_PRODUCED,     /* handed to Kafka, delivery report pending */
    SLOT_ACKED,        /* persisted by Kafka, not yet marked */
    SLOT_MARKING,      /* in the mark transaction now in flight */
    SLOT_DEAD,         /* refused; to be moved to outbox.dead_letters */
    SLOT_DEAD_MARKING, /* in the mark transaction now in flight, as a dead letter */
    SLOT_PARKED,       /* set.one_per_key: fetched, waiting behind its key's record at Kafka */
};

struct slot {
    int64_t id;
    int64_t created_us; /* for the latency histogram */
    int64_t offset;
    int32_t partition;
    uint32_t topic; /* index into obx_relay.topics */
    enum slot_state state;
    int32_t next_free;      /* free-list link, -1 = end */
    char *reason;           /* SLOT_DEAD*: why Kafka refused it (owned) */
    struct obx_row *parked; /* SLOT_PARKED: a copy of the row (owned, one allocation) */
    uint64_t key_hash;      /* set.one_per_key and a key: its obx_keycount_hash */
    uint64_t log_hash;      /* log mode and a key: its obx_keycount_hash */
    uint64_t seq;           /* log mode: the fetch that handed it out */
    bool orphan;            /* log mode: handed out by a session that is gone */
};

/* ---- log mode (relay.on_sent = log) ----
 *
 * Nothing is written per row. What is published is what the newest cursor
 * row covers: every row with an id up to its hwm whose writer its snapshot
 * saw committed, but the rows of its held keys. The relay stores a cursor
 * row once every row handed out up to some fetch has been acknowledged:
 * that fetch's own cursor (hwm and snapshot) is then a true claim. So every
 * fetch has a record: how many of its rows are still pending (with Kafka,
 * or parked), and its cursor if that made a claim (a fetch after which the
 * cursor did not hold makes none, and a row going back unsent takes the
 * claims of its fetch and the later ones away). The oldest records are
 * dropped as their rows settle, and the newest claim among them is `ready`:
 * the next cursor row stores it and frees the slots of the rows it covers.
 * Acknowledged rows of later fetches keep their slots until a later row.
 *
 * Refused rows and the rows of their keys behind them are `held`: the
 * cursor rows name them until a claim made after they went on is stored.
 * Each partition's stored offset is where the recovery pass starts reading:
 * below the lowest offset of an acknowledged row a cursor row does not
 * cover yet, so the pass finds every record the cursor does not account for
 * (records of a partition are acknowledged in offset order). */
struct fetch_rec {
    size_t pending;   /* rows handed out and not yet settled */
    bool claim;       /* the cursor after this fetch holds */
    uint64_t send_no; /* which fetch sent (for held keys going on) */
    int64_t hwm;
    char *snap; /* owned when claim */
};

struct held_rule {
    uint32_t topic;
    char *key; /* owned; NULL = the row alone */
    size_t key_len;
    int64_t from_id;
    uint64_t hash;      /* obx_keycount_hash of topic and key */
    bool lifted;        /* the refused row went on (delivered, dead-lettered, gone) */
    uint64_t lift_send; /* fetches sent when it was lifted */
};

/* A row of a held key published since it was held: the cursor rows list
 * it while a rule that leaves it out lives (a later rule of the same key,
 * after a second refusal, included). */
struct also_row {
    int64_t id;
    uint64_t hash; /* of its topic and key; 0: not known (read back at start) */
    uint32_t topic;
};

struct found_row { /* a record the recovery pass found for an uncovered row */
    int64_t id;
    uint32_t topic;
    int32_t partition;
    int64_t offset;
};

struct log_offset { /* a partition's offset as stored (or to be stored) */
    uint32_t topic;
    int32_t partition;
    int64_t stored;  /* -1: none yet */
    int64_t covered; /* scratch while a write is built: highest offset it covers */
    int64_t below;   /* ... lowest offset of an acknowledged row it does not cover */
};

struct log_state {
    struct fetch_rec *recs; /* ring of fetch records, oldest at head */
    size_t cap_recs, rec_head, n_recs;
    uint64_t head_seq; /* seq of recs[rec_head] */
    uint64_t next_seq;
    uint64_t sends;         /* fetches sent */
    uint64_t fetch_send_no; /* the fetch in flight's */

    bool has_ready; /* the newest claim with nothing pending up to it */
    uint64_t ready_seq, ready_send;
    int64_t ready_hwm;
    char *ready_snap;

    bool has_stored;     /* the stored cursor (loaded, or written by us) */
    uint64_t stored_seq; /* 0: loaded at the start of the session */
    uint64_t stored_send;
    int64_t stored_batch, stored_hwm;
    char *stored_snap;
    uint64_t writes; /* since the table was last emptied */

    uint64_t write_seq; /* the claim the write in flight stores */
    uint64_t write_send;
    int64_t write_hwm;
    char *write_snap;
    uint64_t looked_seq; /* the ready claim last found to cover nothing */
    int64_t ready_since; /* when the ready claim last moved past the stored one */

    struct held_rule *held;
    size_t n_held, cap_held;
    struct also_row *also;
    size_t n_also, cap_also;
    struct obx_log_held *held_out; /* for the fetch and the write */
    int64_t *also_out;
    size_t cap_held_out, cap_also_out, n_also_out, n_held_out;

    struct found_row *found; /* sorted by id */
    size_t n_found;

    struct log_offset *offs;
    size_t n_offs, cap_offs;
    bool restart_next; /* the write in flight empties the table */
    bool loaded;       /* this session has read the stored cursor */
};

/* A refused row under relay.on_reject = retry, or a row whose whole batch
 * was refused (a probe: it is tried again alone before on_reject applies). */
struct blocked {
    int64_t id;
    int64_t retry_at;
    uint32_t topic;
    int attempts;
    bool probe;
    bool behind_at_fetch; /* an earlier one of its key held it back in the fetch in flight */
    char *key;            /* owned; NULL = no key (only the row itself waits) */
    size_t key_len;
};

struct obx_relay {
    struct obx_relay_settings set;
    const struct obx_relay_ops *ops;
    void *io;
    enum obx_relay_state state;

    struct slot *slots;
    int32_t free_head;
    size_t in_use;  /* slots not FREE */
    size_t to_mark; /* slots ACKED or DEAD (waiting for a mark) */

    /* Topic names seen so far; slots refer to them by index. */
    char **topics;
    size_t n_topics, cap_topics;
    uint32_t last_topic;

    /* Refused rows and the keys they hold back: grown as needed. */
    struct blocked *blocked;
    size_t n_blocked, cap_blocked;

    /* Scratch arrays for the fetch and mark arguments, sized once. */
    int64_t *ids;
    int64_t *dead_ids;
    const char **dead_reasons;
    /* The highest acknowledged offset per partition not yet stored. */
    const char **off_topics;
    int32_t *off_partitions;
    int64_t *off_offsets;
    size_t n_off, cap_off;
    bool offsets_in_mark;         /* the mark in flight stores them */
    int64_t offsets_due;          /* when the next mark stores them */
    struct obx_blocked_key *keys; /* cap_blocked of them */
    int64_t *key_ids;             /* cap_blocked of them */

    struct slot **batch; /* slots of the rows of the fetch being produced */

    /* The fetch cursor. While it holds, every unsent row with an id up to
     * `hwm` whose transaction is visible in snapshot `snap` has been handed
     * out by this session (or is held back behind a refused row, or waits
     * as a refused row itself), and no row in flight lies above `hwm`. The
     * keyset fetch then asks only for ids above `hwm` and for the rows below
     * it that `snap` did not see yet (late commits), and nothing in flight
     * can be among them. Whatever may break that (a row back unsent, a
     * fetch ignored, a new session) clears `cursor_ok`; the next fetch is
     * then a full one, which excludes what is in flight and sets it again. */
    bool cursor_ok;
    uint64_t cursor_gen; /* counts cursor_clear() calls */
    uint64_t fetch_gen;  /* cursor_gen when the fetch in flight was sent */
    int64_t hwm;
    char *snap;
    size_t snap_cap;
    int64_t top_id;        /* highest id handed out in this session (NO_ID: none) */
    bool fetch_keyset;     /* the fetch in flight is a keyset fetch ... */
    int64_t fetch_after;   /* ... above this id */
    int fetch_limit;       /* its row limit */
    int64_t fetch_max_ex;  /* full fetch: the highest id it excluded */
    int bytes_limit;       /* most rows relay.fetch_max_bytes allows for now */
    bool fetch_riding;     /* the mark in flight carries the next fetch */
    bool caught_up;        /* the last fetch found fewer rows than it asked for */
    int64_t fetch_probe;   /* the fetch in flight is a full one sent when this probe was due
                            * (NO_ID: none) */
    int64_t fetch_sent_at; /* when the fetch in flight was sent */

    /* set.one_per_key: the keys with a record at Kafka and the rows parked
     * behind them; key_waits: a row was left for a later fetch instead (no
     * memory to park it). */
    struct obx_keycount busy_keys;
    bool key_waits;

    size_t n_outstanding; /* rows handed to Kafka whose delivery report is pending */
    int64_t probe_id;     /* a probe handed to Kafka alone, report pending (NO_ID: none) */
    bool discard_fetch;   /* the fetch in flight must be ignored (see on_fetched) */

    bool recovered;         /* the start-up recovery pass has succeeded */
    uint64_t unknowns;      /* possibly-persisted reports so far */
    uint64_t pass_unknowns; /* ... when the recovery pass in flight started */
    uint64_t settled;       /* ... when the last successful pass started */
    bool want_fetch;        /* rows may be waiting: a look is due, a full batch, ... */
    int64_t not_before;     /* back-off: no statement before this time */
    int64_t poll_delay;     /* the pause before the next look for new rows */
    int64_t next_look_at;   /* when that look is due */

    int64_t now; /* time of the event being handled */
    bool draining;
    int64_t drain_deadline; /* stop waiting for deliveries; mark what was acknowledged */
    int64_t hard_deadline;  /* stop, whatever is in flight (shutdown.timeout) */

    int64_t last_progress;     /* see obx_relay_last_progress */
    int64_t unknown_warned_at; /* last "may or may not be in Kafka" warning */
    int64_t state_since;       /* when the state last changed */
    int64_t stalled_ms;        /* > 0 while a stall is reported */
    int64_t stall_logged_at;
    int exit_code;
    uint64_t marked_total;
    uint64_t dead_total;
    uint64_t fetches[2]; /* full, keyset */

    struct log_state log; /* set.log_mode only */
};

static void log_reset(struct obx_relay *r);
static void log_settle(struct obx_relay *r, struct slot *s, bool acked);

static const char *const state_names[] = {"wait_pg",  "recovering", "idle",
                                          "fetching", "marking",    "stopped"};

const char *obx_relay_state_name(enum obx_relay_state s)
{
    return (unsigned)s < sizeof(state_names) / sizeof(state_names[0]) ? state_names[s] : "?";
}

/* Which moves are possible: allowed[from] is a bit set of destinations. */
#define BIT(s) (1u << (s))
static const unsigned allowed[] = {
    [OBX_RELAY_WAIT_PG] = BIT(OBX_RELAY_IDLE) | BIT(OBX_RELAY_STOPPED),
    [OBX_RELAY_RECOVERING] = BIT(OBX_RELAY_IDLE) | BIT(OBX_RELAY_WAIT_PG) | BIT(OBX_RELAY_STOPPED),
    [OBX_RELAY_IDLE] = BIT(OBX_RELAY_RECOVERING) | BIT(OBX_RELAY_FETCHING) |
                       BIT(OBX_RELAY_MARKING) | BIT(OBX_RELAY_WAIT_PG) | BIT(OBX_RELAY_STOPPED),
    [OBX_RELAY_FETCHING] = BIT(OBX_RELAY_IDLE) | BIT(OBX_RELAY_WAIT_PG) | BIT(OBX_RELAY_STOPPED),
    [OBX_RELAY_MARKING] = BIT(OBX_RELAY_IDLE) | BIT(OBX_RELAY_WAIT_PG) | BIT(OBX_RELAY_STOPPED),
    [OBX_RELAY_STOPPED] = 0,
};

/* The one place the state changes. Refuses impossible moves (a bug). */
static void set_state(struct obx_relay *r, enum obx_relay_state to, const char *why)
{
    if (!(allowed[r->state] & BIT(to))) {
        OBX_BUG("relay: refused state change %s -> %s (%s)", state_names[r->state], state_names[to],
                why);
        return;
    }
    obx_debug("relay: %s -> %s (%s)", state_names[r->state], state_names[to], why);
    r->state = to;
    r->state_since = r->now;
}

void obx_relay_settings_from_config(struct obx_relay_settings *s, const struct obx_config *cfg)
{
    s->batch_size = cfg->batch_size;
    s->max_in_flight = cfg->max_in_flight;
    s->on_reject = cfg->on_reject;
    s->poll_interval_ms = cfg->poll_interval_ms;
    s->retry_backoff_ms = cfg->retry_backoff_ms;
    s->shutdown_timeout_ms = cfg->shutdown_timeout_ms;
    s->stall_timeout_ms = cfg->stall_timeout_ms;
    s->fetch_max_bytes = cfg->fetch_max_bytes;
    s->max_payload = 1000000; /* librdkafka's default; main.c sets the effective value */
    s->one_per_key = false;   /* main.c sets it from the producer's message timeout */
    s->log_mode = cfg->on_sent == OBX_ON_SENT_LOG;
}

int obx_relay_new(const struct obx_relay_settings *s, const struct obx_relay_ops *ops, void *io,
                  struct obx_relay **out)
{
    size_t n = (size_t)s->max_in_flight;
    struct obx_relay *r = obx_calloc(1, sizeof(*r));
    if (!r)
        return -1;
    r->set = *s;
    r->unknown_warned_at = INT64_MIN / 2; /* the first such report warns */
    r->ops = ops;
    r->io = io;
    r->state = OBX_RELAY_WAIT_PG;
    r->slots = obx_calloc(n, sizeof(*r->slots));
    r->ids = obx_calloc(n, sizeof(*r->ids)); /* + cap_blocked: see grow_blocked() */
    r->dead_ids = obx_calloc(n, sizeof(*r->dead_ids));
    r->dead_reasons = obx_calloc(n, sizeof(*r->dead_reasons));
    r->off_topics = obx_calloc(n, sizeof(*r->off_topics));
    r->off_partitions = obx_calloc(n, sizeof(*r->off_partitions));
    r->off_offsets = obx_calloc(n, sizeof(*r->off_offsets));
    r->batch = obx_calloc((size_t)s->batch_size, sizeof(*r->batch));
    if (!r->slots || !r->ids || !r->dead_ids || !r->dead_reasons || !r->off_topics ||
        !r->off_partitions || !r->off_offsets || !r->batch ||
        (s->one_per_key && obx_keycount_init(&r->busy_keys, n) != 0)) {
        obx_relay_free(r);
        return -1;
    }
    r->cap_off = n;
    for (int32_t i = 0; i < s->max_in_flight; i++)
        r->slots[i].next_free = i + 1 < s->max_in_flight ? i + 1 : -1;
    r->free_head = 0;
    r->want_fetch = true;
    r->poll_delay = POLL_MIN_MS;
    r->bytes_limit = s->batch_size;
    r->top_id = r->hwm = r->probe_id = r->fetch_probe = NO_ID;
    *out = r;
    return 0;
}

void obx_relay_free(struct obx_relay *r)
{
    if (!r)
        return;
    if (r->slots)
        for (int i = 0; i < r->set.max_in_flight; i++)
            obx_free(r->slots[i].reason);
    for (size_t i = 0; i < r->n_blocked; i++)
        obx_free(r->blocked[i].key);
    for (size_t i = 0; i < r->n_topics; i++)
        obx_free(r->topics[i]);
    obx_free(r->topics);
    obx_free(r->snap);
    obx_free(r->slots);
    obx_free(r->ids);
    obx_free(r->blocked);
    obx_free(r->keys);
    obx_free(r->key_ids);
    obx_free(r->dead_ids);
    obx_free(r->dead_reasons);
    obx_free(r->off_topics);
    obx_free(r->off_partitions);
    obx_free(r->off_offsets);
    obx_free(r->batch);
    obx_keycount_free(&r->busy_keys);
    log_reset(r);
    obx_free(r->log.recs);
    obx_free(r->log.ready_snap);
    obx_free(r->log.stored_snap);
    obx_free(r->log.write_snap);
    obx_free(r->log.held);
    obx_free(r->log.held_out);
    obx_free(r->log.also_out);
    obx_free(r->log.also);
    obx_free(r->log.found);
    obx_free(r->log.offs);
    obx_free(r);
}

/* Index of `name` in the topic table, adding it if new; -1 on no memory.
 * Rows come in runs of one topic, so the last hit is tried first. */
static int64_t topic_index(struct obx_relay *r, const char *name)
{
    if (r->last_topic < r->n_topics && strcmp(r->topics[r->last_topic], name) == 0)
        return r->last_topic;
    for (size_t i = 0; i < r->n_topics; i++)
        if (strcmp(r->topics[i], name) == 0)
            return r->last_topic = (uint32_t)i;
    if (r->n_topics == r->cap_topics) {
        size_t cap = r->cap_topics ? r->cap_topics * 2 : 16;
        char **grown = obx_realloc(r->topics, cap * sizeof(*grown));
        if (!grown)
            return -1;
        r->topics = grown;
        r->cap_topics = cap;
    }
    char *copy = obx_strdup(name);
    if (!copy)
        return -1;
    r->topics[r->n_topics] = copy;
    return r->last_topic = (uint32_t)r->n_topics++;
}

static struct slot *slot_alloc(struct obx_relay *r, int64_t id, uint32_t topic)
{
    struct slot *s;
    if (r->free_head < 0)
        return NULL;
    s = &r->slots[r->free_head];
    r->free_head = s->next_free;
    s->id = id;
    s->topic = topic;
    s->partition = -1;
    s->offset = -1;
    s->key_hash = 0;
    s->log_hash = 0;
    s->seq = 0;
    s->orphan = false;
    s->state = SLOT_PRODUCED;
    r->in_use++;
    return s;
}

static void slot_release(struct obx_relay *r, struct slot *s)
{
    if (s->state == SLOT_ACKED || s->state == SLOT_DEAD)
        r->to_mark--;
    if (s->state == SLOT_PRODUCED || s->state == SLOT_PARKED)
        log_settle(r, s, false); /* back unsent, or held */
    obx_free(s->reason);
    s->reason = NULL;
    obx_free(s->parked);
    s->parked = NULL;
    s->state = SLOT_FREE;
    s->next_free = r->free_head;
    r->free_head = (int32_t)(s - r->slots);
    r->in_use--;
}

/* Something broke the cursor's promise (a row back unsent below hwm, a
 * key no longer held back, a new session): the next fetch is a full one.
 * A fetch already in flight was sent before it and cannot set the cursor
 * again when it answers. */
static void cursor_clear(struct obx_relay *r)
{
    r->cursor_ok = false;
    r->cursor_gen++;
}

/* ---- log mode: fetch records, claims, held keys ---- */

static struct fetch_rec *rec_of(struct obx_relay *r, uint64_t seq)
{
    struct log_state *l = &r->log;
    if (seq < l->head_seq || seq - l->head_seq >= l->n_recs)
        return NULL;
    return &l->recs[(l->rec_head + (seq - l->head_seq)) % l->cap_recs];
}

/* A record for the fetch just answered; its seq, or 0 out of memory (then
 * the rows are not taken: see on_fetched). */
static uint64_t rec_push(struct obx_relay *r)
{
    struct log_state *l = &r->log;
    /* The newest record has nothing pending (its fetch handed nothing out,
     * or all of it settled) while an older one waits: this fetch takes its
     * place, with its own claim if it makes one. So a row that waits long
     * (a partition Kafka cannot take) costs one record per fetch that
     * hands rows out behind it, not one per look for new rows. */
    if (l->n_recs > 1) {
        uint64_t back_seq = l->head_seq + l->n_recs - 1;
        struct fetch_rec *back = rec_of(r, back_seq);
        if (back && back->pending == 0) {
            obx_free(back->snap);
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

/* The fetch `seq` made a claim: its cursor (hwm, snap). */
static void rec_claim(struct obx_relay *r, uint64_t seq, int64_t hwm, const char *snap)
{
    struct fetch_rec *f = rec_of(r, seq);
    if (!f || f->claim)
        return;
    f->snap = obx_strdup(snap);
    f->claim = f->snap != NULL; /* no memory: no claim, which is always safe */
    f->hwm = hwm;
}

/* Records whose rows have all settled leave the ring, oldest first; the
 * newest claim among them becomes ready. */
static void recs_settle(struct obx_relay *r)
{
    struct log_state *l = &r->log;
    while (l->n_recs > 0) {
        struct fetch_rec *f = &l->recs[l->rec_head];
        if (f->pending > 0)
            break;
        if (f->claim) {
            if (!l->has_ready || l->ready_seq <= l->stored_seq)
                l->ready_since = r->now;
            obx_free(l->ready_snap);
            l->ready_snap = f->snap;
            l->ready_hwm = f->hwm;
            l->ready_seq = l->head_seq;
            l->ready_send = f->send_no;
            l->has_ready = true;
            f->snap = NULL;
        }
        l->rec_head = (l->rec_head + 1) % l->cap_recs;
        l->n_recs--;
        l->head_seq++;
    }
}

/* The claims of fetch `seq` and of every later one no longer hold: a row of
 * that fetch is unsent again without being held. */
static void claims_drop_from(struct obx_relay *r, uint64_t seq)
{
    struct log_state *l = &r->log;
    for (uint64_t s = seq < l->head_seq ? l->head_seq : seq; s < l->head_seq + l->n_recs; s++) {
        struct fetch_rec *f = rec_of(r, s);
        if (!f)
            break;
        f->claim = false;
        obx_free(f->snap);
        f->snap = NULL;
    }
}

/* Whether row `id` is refused and held: the cursor rows leave it (and its
 * key's later rows) out, so the claims that count it as handed out hold. */
static bool held_now(const struct obx_relay *r, int64_t id)
{
    for (size_t i = 0; i < r->log.n_held; i++)
        if (r->log.held[i].from_id == id && !r->log.held[i].lifted)
            return true;
    return false;
}

/* Slot `s` no longer waits for Kafka: `acked` (acknowledged or to be dead-
 * lettered) or not (back unsent, or held). */
static void log_settle(struct obx_relay *r, struct slot *s, bool acked)
{
    if (!r->set.log_mode || s->orphan || s->seq == 0)
        return;
    struct fetch_rec *f = rec_of(r, s->seq);
    if (!acked && !held_now(r, s->id))
        claims_drop_from(r, s->seq);
    if (f && f->pending > 0)
        f->pending--;
    s->seq = acked ? s->seq : 0;
    recs_settle(r);
}

static void held_free(struct held_rule *h)
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

/* Whether a rule went on before the ready claim's fetch was sent: the next
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
static void hold(struct obx_relay *r, int64_t id, uint32_t topic, const char *key, size_t key_len)
{
    struct log_state *l = &r->log;
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
            claims_drop_from(r, 0);
            return;
        }
        l->held = g;
        l->cap_held = cap;
    }
    char *copy = NULL;
    if (key && !(copy = obx_malloc(key_len ? key_len : 1))) {
        obx_error("relay: out of memory holding row %lld out of the cursor", (long long)id);
        claims_drop_from(r, 0);
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
 * fetched, and the rule goes once a claim made after this is stored. */
static void lift(struct obx_relay *r, int64_t id)
{
    struct log_state *l = &r->log;
    for (size_t i = 0; i < l->n_held; i++) {
        if (l->held[i].from_id == id && !l->held[i].lifted) {
            l->held[i].lifted = true;
            l->held[i].lift_send = l->sends;
        }
    }
}

/* A found row for `id`, removed from the list; false if none. */
static bool take_found(struct obx_relay *r, int64_t id, struct found_row *out)
{
    struct log_state *l = &r->log;
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
 * reads: claims, held keys, found rows and stored offsets are forgotten. */
static void log_reset(struct obx_relay *r)
{
    struct log_state *l = &r->log;
    for (size_t i = 0; i < l->n_recs; i++)
        obx_free(l->recs[(l->rec_head + i) % l->cap_recs].snap);
    l->n_recs = 0;
    l->has_ready = false;
    l->has_stored = false;
    for (size_t i = 0; i < l->n_held; i++)
        held_free(&l->held[i]);
    l->n_held = 0;
    l->n_found = 0;
    l->n_offs = 0;
    l->n_also = 0;
    l->loaded = false;
}

/* ---- keys held back behind a refused row (relay.on_reject = retry) ---- */

static struct blocked *find_block_by_id(struct obx_relay *r, int64_t id)
{
    for (size_t i = 0; i < r->n_blocked; i++)
        if (r->blocked[i].id == id)
            return &r->blocked[i];
    return NULL;
}

/* True if `row` must wait behind an earlier refused row of its key. */
static bool held_back(struct obx_relay *r, const struct obx_row *row, uint32_t topic)
{
    if (!row->key)
        return false;
    for (size_t i = 0; i < r->n_blocked; i++) {
        const struct blocked *b = &r->blocked[i];
        if (b->key && b->topic == topic && row->id > b->id && b->key_len == row->key_len &&
            memcmp(b->key, row->key, row->key_len) == 0)
            return true;
    }
    return false;
}

static void unblock(struct obx_relay *r, int64_t id)
{
    struct blocked *b = find_block_by_id(r, id);
    if (!b)
        return;
    cursor_clear(r); /* its key's later rows may be waiting below hwm */
    obx_info("relay: row %lld delivered after %d failed tries; its key goes on", (long long)id,
             b->attempts);
    if (r->set.log_mode)
        lift(r, id);
    obx_free(b->key);
    *b = r->blocked[--r->n_blocked];
}

/* Forgets the entry of row `id` without a word (dead-lettered, or gone). */
static void drop_block(struct obx_relay *r, int64_t id)
{
    struct blocked *b = find_block_by_id(r, id);
    if (!b)
        return;
    cursor_clear(r);
    if (r->set.log_mode)
        lift(r, id);
    obx_free(b->key);
    *b = r->blocked[--r->n_blocked];
}

/* True if an earlier held row of its key holds `b` back too. */
static bool behind_another(const struct obx_relay *r, const struct blocked *b)
{
    for (size_t j = 0; j < r->n_blocked && b->key; j++) {
        const struct blocked *o = &r->blocked[j];
        if (o->key && o->id < b->id && o->topic == b->topic && o->key_len == b->key_len &&
            memcmp(o->key, b->key, b->key_len) == 0)
            return true;
    }
    return false;
}

/* The probe to try next: the lowest-id due one that no earlier refused row
 * of its key holds back. NULL if none. */
static struct blocked *due_probe(struct obx_relay *r, int64_t now)
{
    struct blocked *best = NULL;
    for (size_t i = 0; i < r->n_blocked; i++) {
        struct blocked *b = &r->blocked[i];
        if (!b->probe || b->retry_at > now || (best && best->id < b->id))
            continue;
        if (!behind_another(r, b))
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
static void drop_settled(struct obx_relay *r, const struct obx_row *rows, size_t n, bool full)
{
    for (size_t i = 0; i < r->n_blocked;) {
        const struct blocked *b = &r->blocked[i];
        bool passed = !full || (n > 0 && rows[n - 1].id > b->id);
        bool due = !b->probe && b->retry_at <= r->fetch_sent_at;
        bool fetched = false;
        for (size_t j = 0; j < n && passed && due && !fetched; j++)
            fetched = rows[j].id == b->id;
        if (!passed || !due || fetched || b->behind_at_fetch) {
            i++;
            continue;
        }
        obx_info("relay: row %lld is no longer waiting to be sent; its key goes on",
                 (long long)b->id);
        drop_block(r, b->id); /* moves the last entry here */
        r->want_fetch = true;
    }
}

/* Room for twice as many refused rows: their entries, their keys for the
 * fetch, and their ids among the fetch's exclusions. */
static int grow_blocked(struct obx_relay *r)
{
    size_t cap = r->cap_blocked ? r->cap_blocked * 2 : 64;
    struct blocked *b = obx_realloc(r->blocked, cap * sizeof(*b));
    if (!b)
        return -1;
    r->blocked = b;
    struct obx_blocked_key *k = obx_realloc(r->keys, cap * sizeof(*k));
    if (!k)
        return -1;
    r->keys = k;
    int64_t *ki = obx_realloc(r->key_ids, cap * sizeof(*ki));
    if (!ki)
        return -1;
    r->key_ids = ki;
    int64_t *ids = obx_realloc(r->ids, ((size_t)r->set.max_in_flight + cap) * sizeof(*ids));
    if (!ids)
        return -1;
    r->ids = ids;
    r->cap_blocked = cap;
    return 0;
}

/* Row `id` was refused: retry it later, holding back its key meanwhile. */
static void block(struct obx_relay *r, int64_t id, uint32_t topic, const char *key, size_t key_len,
                  int64_t now)
{
    cursor_clear(r); /* it is below hwm, and comes back by a full fetch */
    struct blocked *b = find_block_by_id(r, id);
    if (!b) {
        if (r->n_blocked == r->cap_blocked && grow_blocked(r) != 0) {
            /* Retried at once, and its key goes on: a fault we say out loud. */
            obx_error("relay: out of memory holding back the key of row %lld (%zu held back)",
                      (long long)id, r->n_blocked);
            return;
        }
        char *copy = NULL;
        if (key && !(copy = obx_malloc(key_len ? key_len : 1))) {
            obx_error("relay: out of memory holding back the key of row %lld", (long long)id);
            return;
        }
        if (key)
            memcpy(copy, key, key_len);
        b = &r->blocked[r->n_blocked++];
        *b = (struct blocked){.id = id, .topic = topic, .key = copy, .key_len = key_len};
        if (r->set.log_mode)
            hold(r, id, topic, key, key_len);
    }
    int64_t delay = r->set.retry_backoff_ms;
    for (int i = 0; i < b->attempts && delay < MAX_REJECT_BACKOFF_MS; i++)
        delay *= 2;
    if (delay > MAX_REJECT_BACKOFF_MS)
        delay = MAX_REJECT_BACKOFF_MS;
    b->attempts++;
    b->retry_at = now + delay;
}

/* A row Kafka refused for good: apply relay.on_reject. `s` is its slot. */
static void rejected(struct obx_relay *r, struct slot *s, const char *key, size_t key_len,
                     const char *reason, int64_t now)
{
    if (r->set.on_reject == OBX_ON_REJECT_DEAD_LETTER) {
        obx_error("relay: row %lld (topic %s) refused by Kafka: %s; moving it to "
                  "outbox.dead_letters",
                  (long long)s->id, r->topics[s->topic], reason);
        s->reason = obx_strdup(reason ? reason : "refused by Kafka");
        if (s->reason) {
            if (s->state == SLOT_PRODUCED || s->state == SLOT_PARKED)
                log_settle(r, s, true);
            s->state = SLOT_DEAD;
            r->to_mark++;
            drop_block(r, s->id); /* refused alone too: its key goes on */
            return;
        }
        obx_error("relay: out of memory dead-lettering row %lld; retrying it", (long long)s->id);
    } else {
        obx_error("relay: row %lld (topic %s) refused by Kafka: %s; retrying it, later rows of "
                  "its key wait (relay.on_reject = retry)",
                  (long long)s->id, r->topics[s->topic], reason);
    }
    block(r, s->id, s->topic, key, key_len, now);
    struct blocked *b = find_block_by_id(r, s->id);
    if (b)
        b->probe = false; /* refused alone: a retry with back-off from here */
    slot_release(r, s);
    r->want_fetch = true;
}

/* The batch row `s` went in was refused for good, perhaps for another
 * record's sake (a batch is too large as a whole, or one record in it is):
 * its key waits while it is tried again alone, at once. */
static void batch_refused(struct obx_relay *r, struct slot *s, const char *key, size_t key_len,
                          const char *reason, int64_t now)
{
    obx_warn("relay: the batch of row %lld (topic %s) was refused by Kafka: %s; trying the row "
             "alone before relay.on_reject applies, later rows of its key wait",
             (long long)s->id, r->topics[s->topic], reason);
    block(r, s->id, s->topic, key, key_len, now);
    struct blocked *b = find_block_by_id(r, s->id);
    if (b) {
        b->probe = true;
        b->retry_at = now;
    }
    slot_release(r, s);
    r->want_fetch = true;
}

/* ---- commands ---- */

/* Failpoint `id`, through the ops (the relay reads no global). */
static int failpoint(struct obx_relay *r, enum obx_fp_id id)
{
    return r->ops->failpoint ? r->ops->failpoint(r->io, (int)id) : 0;
}

static void stop(struct obx_relay *r, const char *why)
{
    set_state(r, OBX_RELAY_STOPPED, why);
    if (r->state == OBX_RELAY_STOPPED)
        r->ops->stopped(r->io, r->exit_code);
}

/* Room for twice as many partitions' offsets. */
static int grow_offsets(struct obx_relay *r)
{
    size_t cap = r->cap_off * 2;
    const char **t = obx_realloc(r->off_topics, cap * sizeof(*t));
    if (!t)
        return -1;
    r->off_topics = t;
    int32_t *p = obx_realloc(r->off_partitions, cap * sizeof(*p));
    if (!p)
        return -1;
    r->off_partitions = p;
    int64_t *o = obx_realloc(r->off_offsets, cap * sizeof(*o));
    if (!o)
        return -1;
    r->off_offsets = o;
    r->cap_off = cap;
    return 0;
}

/* Adds slot `s`'s offset to the per-partition maxima waiting to be stored.
 * Without memory for a new partition its stored offset lags, which costs
 * the recovery pass a longer read and nothing else. */
static void note_offset(struct obx_relay *r, const struct slot *s)
{
    const char *topic = r->topics[s->topic];
    for (size_t i = 0; i < r->n_off; i++) {
        if (r->off_partitions[i] == s->partition && r->off_topics[i] == topic) {
            if (s->offset > r->off_offsets[i])
                r->off_offsets[i] = s->offset;
            return;
        }
    }
    if (r->n_off == r->cap_off && grow_offsets(r) != 0)
        return;
    r->off_topics[r->n_off] = topic;
    r->off_partitions[r->n_off] = s->partition;
    r->off_offsets[r->n_off++] = s->offset;
}

/* The held keys and the rows of them published, in log.held_out and
 * log.also_out (`extra` more ids of room in also_out). false: no memory. */
static bool log_held_out_room(struct obx_relay *r, size_t extra, uint64_t claim_send)
{
    struct log_state *l = &r->log;
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
        if (h->lifted && claim_send > h->lift_send)
            continue; /* the claim written with these covers its rows */
        l->held_out[l->n_held_out++] =
            (struct obx_log_held){r->topics[h->topic], h->key, h->key_len, h->from_id};
    }
    for (size_t i = 0; i < l->n_also; i++)
        l->also_out[l->n_also_out++] = l->also[i].id;
    return true;
}

static bool log_held_out(struct obx_relay *r)
{
    if (log_held_out_room(r, 0, 0))
        return true;
    obx_error("relay: out of memory building the fetch");
    return false;
}

/* Fills `f` for the next fetch; false if none can go (no free slot, or
 * `keyset_only` and it would be a full one). Arrays are the relay's. */
static bool build_fetch(struct obx_relay *r, int64_t now, struct obx_fetch *f, bool keyset_only)
{
    *f = (struct obx_fetch){.exclude = r->ids, .blocked = r->keys, .blocked_ids = r->key_ids};
    int free_slots = r->set.max_in_flight - (int)r->in_use;
    f->limit = free_slots < r->set.batch_size ? free_slots : r->set.batch_size;
    if (f->limit > r->bytes_limit)
        f->limit = r->bytes_limit;
    if (f->limit <= 0)
        return false;
    /* limit x this <= relay.fetch_max_bytes; a row asked for alone comes
     * whole if Kafka could take it at all. */
    f->max_row_bytes = f->limit == 1 ? r->set.max_payload : r->set.fetch_max_bytes / f->limit;
    if (f->max_row_bytes > r->set.max_payload)
        f->max_row_bytes = r->set.max_payload;
    /* The keyset fetch whenever the cursor holds, caught up or not: it
     * starts from hwm, where a full fetch walks the unsent-row index from
     * its lowest entry, past every row marked or deleted since the last
     * vacuum (and a held xmin horizon keeps them all). */
    bool keyset = r->cursor_ok;
    for (size_t i = 0; i < r->n_blocked && keyset; i++)
        keyset = r->blocked[i].retry_at > now; /* a due one lies below hwm */
    if (keyset_only && !keyset)
        return false;
    if (keyset) {
        f->keyset = true;
        f->after_id = r->hwm;
        f->snapshot = r->snap;
    } else if (r->log.has_stored) {
        /* Everything the stored cursor does not cover, but what is in flight. */
        if (!log_held_out(r))
            return false;
        f->log = true;
        f->after_id = r->log.stored_hwm;
        f->snapshot = r->log.stored_snap;
        f->held = r->log.held_out;
        f->n_held = r->log.n_held_out;
        f->also_sent = r->log.also_out;
        f->n_also = r->log.n_also_out;
    }
    if (!keyset) {
        for (int i = 0; i < r->set.max_in_flight; i++)
            if (r->slots[i].state != SLOT_FREE)
                r->ids[f->n_exclude++] = r->slots[i].id;
    }
    for (size_t i = 0; i < r->n_blocked; i++) {
        const struct blocked *b = &r->blocked[i];
        if (b->retry_at > now && !keyset)
            r->ids[f->n_exclude++] = b->id; /* not due yet (a keyset fetch is above it) */
        if (b->key) {
            r->keys[f->n_blocked] =
                (struct obx_blocked_key){r->topics[b->topic], b->key, b->key_len};
            r->key_ids[f->n_blocked++] = b->id;
        }
    }
    return true;
}

/* The fetch `f` went to Postgres. */
static void fetch_sent(struct obx_relay *r, const struct obx_fetch *f, int64_t now)
{
    int64_t max_ex = NO_ID;
    for (size_t i = 0; i < f->n_exclude; i++)
        if (f->exclude[i] > max_ex)
            max_ex = f->exclude[i];
    r->fetch_keyset = f->keyset;
    r->fetch_after = f->after_id;
    r->fetch_gen = r->cursor_gen;
    r->fetches[f->keyset]++;
    r->fetch_limit = f->limit;
    r->fetch_max_ex = max_ex;
    r->fetch_sent_at = now;
    /* As the full fetch's held-back keys say, for the entries drop_settled
     * looks at (a keyset fetch settles none). */
    for (size_t i = 0; i < r->n_blocked && !f->keyset; i++) {
        struct blocked *e = &r->blocked[i];
        e->behind_at_fetch = !e->probe && e->retry_at <= now && behind_another(r, e);
    }
    const struct blocked *probe = r->n_blocked > 0 && !f->keyset ? due_probe(r, now) : NULL;
    r->fetch_probe = probe ? probe->id : NO_ID;
    r->want_fetch = false;
    r->log.fetch_send_no = ++r->log.sends;
}

/* The fetch in flight (alone or beside a mark) will not answer: fetch
 * again, and a full fetch, whatever went wrong. */
static void fetch_gone(struct obx_relay *r)
{
    r->fetch_riding = false;
    r->discard_fetch = false;
    r->want_fetch = true;
    cursor_clear(r);
}

/* Whether a fetch may go now. */
static bool fetch_allowed(struct obx_relay *r, int64_t now)
{
    if (r->draining || !r->recovered)
        return false;
    /* A probe goes to Kafka alone: nothing else is fetched while it is out,
     * and it waits until no other row's report is pending. */
    return !(r->probe_id != NO_ID ||
             (r->n_outstanding > 0 && r->n_blocked > 0 && due_probe(r, now)));
}

/* Whether a fetch should go now (beside a mark, or alone). */
static bool fetch_wanted(struct obx_relay *r, int64_t now)
{
    return r->want_fetch && fetch_allowed(r, now);
}

/* A fetch answered with `n` rows: when to look for new rows next. Rows
 * keep coming: look again soon. None: look less often, down to one look
 * every relay.poll_interval while nothing is written. */
static void schedule_look(struct obx_relay *r, size_t n, int64_t now)
{
    if (n > 0) {
        r->poll_delay = POLL_MIN_MS;
    } else {
        r->poll_delay *= 2;
        if (r->poll_delay > r->set.poll_interval_ms)
            r->poll_delay = r->set.poll_interval_ms;
    }
    r->next_look_at = now + r->poll_delay;
    if (r->ops->wake_at)
        r->ops->wake_at(r->io, r->next_look_at);
}

/* Cursor rows between two that empty the table (and carry every offset). */
#define LOG_RESTART_EVERY 1000
/* A cursor row waits this long for more acknowledgements, unless a batch of
 * them is waiting already (or the relay drains): a row per 100 ms at most
 * when rows trickle in, a few hundred bytes of WAL each, and the one
 * connection is left to the fetches in between. What a row does not cover
 * yet keeps its slot, and a crash meanwhile costs the recovery pass a
 * longer read of Kafka, nothing else. */
#define LOG_WRITE_DELAY_MS 100

/* The stored offset entry of (topic, partition), added if new; NULL out of
 * memory (that partition's offset then lags, which costs the recovery pass
 * a longer read and nothing else). */
static struct log_offset *log_offset_of(struct obx_relay *r, uint32_t topic, int32_t partition)
{
    struct log_state *l = &r->log;
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
static bool log_offsets_out(struct obx_relay *r, uint64_t upto, bool all)
{
    struct log_state *l = &r->log;
    for (size_t i = 0; i < l->n_offs; i++) {
        l->offs[i].covered = -1;
        l->offs[i].below = INT64_MAX;
    }
    for (int i = 0; i < r->set.max_in_flight; i++) {
        const struct slot *s = &r->slots[i];
        if (s->orphan || (s->state != SLOT_ACKED && s->state != SLOT_MARKING) || s->offset < 0)
            continue;
        struct log_offset *o = log_offset_of(r, s->topic, s->partition);
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
        struct log_offset *o = log_offset_of(r, l->found[i].topic, l->found[i].partition);
        if (o && l->found[i].offset < o->below)
            o->below = l->found[i].offset;
    }
    r->n_off = 0;
    for (size_t i = 0; i < l->n_offs; i++) {
        struct log_offset *o = &l->offs[i];
        int64_t v = o->below != INT64_MAX ? o->below - 1 : o->covered;
        if (v < o->stored)
            v = o->stored; /* never back: see the comment on log mode */
        o->covered = v;    /* what this write stores */
        if (v < 0 || (!all && v == o->stored))
            continue;
        if (r->n_off == r->cap_off && grow_offsets(r) != 0)
            return false;
        r->off_topics[r->n_off] = r->topics[o->topic];
        r->off_partitions[r->n_off] = o->partition;
        r->off_offsets[r->n_off++] = v;
    }
    return true;
}

/* Log mode: a cursor row for the ready claim, covering the acknowledged
 * rows of the fetches up to it (and dead-lettering the refused ones among
 * them). Returns true if it was sent. */
static bool start_log_write(struct obx_relay *r, int64_t now)
{
    struct log_state *l = &r->log;
    if (!l->has_ready || l->ready_seq <= l->stored_seq || l->ready_seq == l->looked_seq)
        return false;
    if (!r->draining && now - l->ready_since < LOG_WRITE_DELAY_MS &&
        r->to_mark < (size_t)r->set.batch_size)
        return false;
    size_t n_cov = 0, n_dead = 0;
    for (int i = 0; i < r->set.max_in_flight; i++) {
        const struct slot *s = &r->slots[i];
        if (s->orphan || s->seq > l->ready_seq)
            continue;
        if (s->state == SLOT_ACKED)
            n_cov++;
        else if (s->state == SLOT_DEAD)
            r->dead_reasons[n_dead] = s->reason, r->dead_ids[n_dead++] = s->id;
    }
    if (n_cov + n_dead == 0 && !rule_to_drop(l)) {
        l->looked_seq = l->ready_seq; /* nothing to store until the claim moves */
        return false;
    }
    /* Acknowledged rows of held keys: published, though the rule leaves
     * their key's rows out. A hash may match another key: listing a row
     * that is covered anyway changes nothing. */
    if (!log_held_out_room(r, n_cov + n_dead, l->ready_send)) {
        obx_error("relay: out of memory building the cursor row");
        return false;
    }
    for (int i = 0; i < r->set.max_in_flight && l->n_held > 0; i++) {
        const struct slot *s = &r->slots[i];
        if (s->orphan || (s->state != SLOT_ACKED && s->state != SLOT_DEAD) || s->seq > l->ready_seq)
            continue; /* a dead letter is done with too */
        struct also_row a = {s->id, s->log_hash, s->topic};
        if (!a.hash && !held_now(r, s->id) && !lifted_rule_of(l, s->id))
            continue; /* no key: only a rule of the row itself leaves it out */
        if (!also_needed(l, &a))
            continue;
        if (!also_add(l, a.id, a.hash, a.topic)) {
            obx_error("relay: out of memory building the cursor row");
            return false;
        }
        l->also_out[l->n_also_out++] = s->id;
    }
    bool restart = l->writes + 1 >= LOG_RESTART_EVERY;
    if (!log_offsets_out(r, l->ready_seq, restart)) {
        obx_error("relay: out of memory building the cursor row");
        return false;
    }
    obx_free(l->write_snap);
    if (!(l->write_snap = obx_strdup(l->ready_snap))) {
        obx_error("relay: out of memory building the cursor row");
        return false;
    }
    struct obx_mark m = {.log = true,
                         .batch = l->stored_batch + 1,
                         .hwm = l->ready_hwm,
                         .snapshot = l->write_snap,
                         .held = l->held_out,
                         .n_held = l->n_held_out,
                         .also_sent = l->also_out,
                         .n_also = l->n_also_out,
                         .restart = restart,
                         .topics = r->off_topics,
                         .partitions = r->off_partitions,
                         .offsets = r->off_offsets,
                         .n_offsets = r->n_off,
                         .dead_ids = r->dead_ids,
                         .dead_reasons = r->dead_reasons,
                         .n_dead = n_dead};
    if (failpoint(r, OBX_FP_ACK_AFTER) != 0) {
        r->not_before = now + r->set.retry_backoff_ms;
        return false;
    }
    if (r->ops->mark(r->io, &m) != 0)
        return false;
    l->write_seq = l->ready_seq;
    l->write_send = l->ready_send;
    l->write_hwm = l->ready_hwm;
    l->restart_next = restart;
    for (int i = 0; i < r->set.max_in_flight; i++) {
        struct slot *s = &r->slots[i];
        if (s->orphan || s->seq > l->ready_seq)
            continue;
        if (s->state == SLOT_ACKED)
            s->state = SLOT_MARKING, r->to_mark--;
        else if (s->state == SLOT_DEAD)
            s->state = SLOT_DEAD_MARKING, r->to_mark--;
    }
    set_state(r, OBX_RELAY_MARKING, "acknowledged rows to store in the cursor");
    return true;
}

/* The cursor row in flight committed: it is the stored cursor now. */
static void log_write_done(struct obx_relay *r)
{
    struct log_state *l = &r->log;
    l->has_stored = true;
    l->stored_batch++;
    l->stored_seq = l->write_seq;
    l->stored_send = l->write_send;
    l->stored_hwm = l->write_hwm;
    obx_free(l->stored_snap);
    l->stored_snap = l->write_snap;
    l->write_snap = NULL;
    l->writes = l->restart_next ? 1 : l->writes + 1;
    for (size_t i = 0; i < l->n_offs; i++)
        l->offs[i].stored = l->offs[i].covered;
    /* A held key whose refused row went on before a fetch that the stored
     * claim comes from (or an earlier one) is covered by that claim. */
    for (size_t i = 0; i < l->n_held;) {
        if (l->held[i].lifted && l->stored_send > l->held[i].lift_send) {
            held_free(&l->held[i]);
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

/* Marks every ACKED slot and dead-letters every DEAD one, in one
 * statement (perhaps with the next fetch). Returns true if it was sent. */
static bool start_mark(struct obx_relay *r, int64_t now)
{
    if (r->set.log_mode)
        return start_log_write(r, now);
    struct obx_mark m = {.ids = r->ids,
                         .topics = r->off_topics,
                         .partitions = r->off_partitions,
                         .offsets = r->off_offsets,
                         .dead_ids = r->dead_ids,
                         .dead_reasons = r->dead_reasons};
    for (int i = 0; i < r->set.max_in_flight; i++) {
        struct slot *s = &r->slots[i];
        if (s->state == SLOT_ACKED) {
            r->ids[m.n_ids++] = s->id;
            note_offset(r, s);
        } else if (s->state == SLOT_DEAD) {
            r->dead_reasons[m.n_dead] = s->reason;
            r->dead_ids[m.n_dead++] = s->id;
        }
    }
    if (m.n_ids + m.n_dead == 0)
        return false;
    /* The offsets go with a mark once a second, and with every mark of a
     * drain (the next start reads less). */
    r->offsets_in_mark = r->n_off > 0 && (now >= r->offsets_due || r->draining);
    m.n_offsets = r->offsets_in_mark ? r->n_off : 0;
    if (failpoint(r, OBX_FP_ACK_AFTER) != 0) {
        r->not_before = now + r->set.retry_backoff_ms;
        return false;
    }
    /* A keyset fetch rides along in the same statement, due or not: one
     * round trip, Postgres does not wait for us between the two, and the
     * look for new rows costs next to nothing there. (It reads nothing the
     * mark changes: marked rows lie at or below hwm.) */
    struct obx_fetch f;
    int rc = 1;
    if (r->ops->mark_fetch && !r->set.log_mode && m.n_dead == 0 && fetch_allowed(r, now) &&
        build_fetch(r, now, &f, true))
        rc = r->ops->mark_fetch(r->io, &m, &f);
    if (rc < 0)
        return false;
    if (rc == 0) {
        fetch_sent(r, &f, now);
        r->fetch_riding = true;
    } else if (r->ops->mark(r->io, &m) != 0) {
        return false;
    }
    for (int i = 0; i < r->set.max_in_flight; i++) {
        struct slot *s = &r->slots[i];
        if (s->state == SLOT_ACKED)
            s->state = SLOT_MARKING;
        else if (s->state == SLOT_DEAD)
            s->state = SLOT_DEAD_MARKING;
    }
    r->to_mark = 0;
    set_state(r, OBX_RELAY_MARKING, "acknowledged rows to mark");
    return true;
}

/* Puts slots of a mark that did not (surely) commit back to be marked again. */
static void unmark(struct obx_relay *r)
{
    for (int i = 0; i < r->set.max_in_flight; i++) {
        struct slot *s = &r->slots[i];
        if (s->state == SLOT_MARKING || s->state == SLOT_DEAD_MARKING) {
            s->state = s->state == SLOT_MARKING ? SLOT_ACKED : SLOT_DEAD;
            r->to_mark++;
        }
    }
}

static bool start_fetch(struct obx_relay *r, int64_t now)
{
    struct obx_fetch f;
    if (!build_fetch(r, now, &f, false) || r->ops->fetch(r->io, &f) != 0)
        return false;
    fetch_sent(r, &f, now);
    set_state(r, OBX_RELAY_FETCHING, "rows may be waiting");
    return true;
}

/* A possibly-persisted report is not yet settled by a recovery pass. Until
 * it is, nothing is marked: a mark raises the stored offset of each of its
 * partitions past the record it confirms, and the pass reads each partition
 * from that offset on, so a record acknowledged after the uncertain one
 * would move the pass past it, and a row that did land would be published
 * again. The pass marks what it finds itself. */
static bool uncertain(const struct obx_relay *r)
{
    return r->unknowns != r->settled;
}

/* During a drain: whether to stop now. Nothing in flight: at once, in any
 * state (a fetch or recovery statement still running is simply dropped).
 * Past the drain deadline: once nothing acknowledged is left to mark, or no
 * connection can mark it. Past the hard deadline: whatever is in flight (a
 * hung Postgres must not hold SIGTERM hostage). */
static bool drain_over(const struct obx_relay *r, int64_t now)
{
    if (r->in_use == 0 || now >= r->hard_deadline)
        return true;
    /* Without a session (or the relay lock), acknowledged rows cannot be
     * marked by us; once no delivery report is outstanding there is
     * nothing left to wait for: the next holder's recovery pass finds them. */
    if (r->state == OBX_RELAY_WAIT_PG && r->in_use == r->to_mark)
        return true;
    /* Marks wait for a pass, which a drain does not start: the next start's
     * pass finds these rows, from offsets no mark has moved. */
    if (uncertain(r) && r->in_use == r->to_mark)
        return true;
    /* Log mode: every report is in and no claim is left to store (the last
     * fetches made none, a row went back unsent): what is acknowledged is
     * in Kafka, and the next start's pass finds it. */
    if (r->set.log_mode && r->state == OBX_RELAY_IDLE && r->n_outstanding == 0 &&
        r->in_use == r->to_mark &&
        !(r->log.has_ready && r->log.ready_seq > r->log.stored_seq &&
          r->log.ready_seq != r->log.looked_seq))
        return true;
    if (now < r->drain_deadline)
        return false;
    return r->state == OBX_RELAY_WAIT_PG || (r->state == OBX_RELAY_IDLE && r->to_mark == 0);
}

/* Decides what the relay does next. Called after every event. */
static void kick(struct obx_relay *r, int64_t now)
{
    if (r->state == OBX_RELAY_STOPPED)
        return;
    if (r->draining && drain_over(r, now)) {
        if (r->in_use > 0)
            obx_warn("relay: stopping %s with %zu rows unconfirmed (%zu acknowledged but not "
                     "marked); the next start recovers them from Kafka",
                     r->state == OBX_RELAY_IDLE || r->state == OBX_RELAY_WAIT_PG
                         ? "at the shutdown deadline"
                         : "at the shutdown deadline while Postgres has not answered",
                     r->in_use, r->to_mark);
        stop(r, r->exit_code ? "fatal error" : "drained");
        return;
    }
    if (r->state != OBX_RELAY_IDLE || now < r->not_before)
        return;
    if (r->to_mark > 0 && !uncertain(r) && start_mark(r, now))
        return;
    if (r->draining)
        return;
    if (!r->recovered) {
        if (r->set.log_mode && r->n_outstanding > 0 && !r->log.loaded)
            return; /* the pass must see where this session's records landed */
        r->pass_unknowns = r->unknowns;
        if (r->ops->recover(r->io) == 0)
            set_state(r, OBX_RELAY_RECOVERING, "recovery pass before publishing");
        else
            r->not_before = now + r->set.retry_backoff_ms;
        return;
    }
    if (fetch_wanted(r, now))
        start_fetch(r, now);
}

static void progress(struct obx_relay *r, int64_t now)
{
    r->last_progress = now;
    if (r->stalled_ms > 0) {
        obx_info("relay: moving again after %llds without progress",
                 (long long)(r->stalled_ms / 1000));
        r->stalled_ms = 0;
    }
}

/* ---- one record of a key at a time (set.one_per_key) ---- */

/* A copy of `row` in one allocation, or NULL. */
static struct obx_row *row_copy(const struct obx_row *row)
{
    size_t topic_len = strlen(row->topic) + 1;
    size_t payload_len = row->payload ? row->payload_len : 0;
    struct obx_row *c =
        obx_malloc(sizeof(*c) + topic_len + row->key_len + payload_len + row->headers_len);
    if (!c)
        return NULL;
    char *p = (char *)(c + 1);
    *c = *row;
    memcpy(p, row->topic, topic_len);
    c->topic = p;
    p += topic_len;
    if (row->key) {
        memcpy(p, row->key, row->key_len);
        c->key = p;
        p += row->key_len;
    }
    if (row->payload) {
        memcpy(p, row->payload, payload_len);
        c->payload = p;
        p += payload_len;
    }
    if (row->headers) {
        memcpy(p, row->headers, row->headers_len);
        c->headers = p;
    }
    return c;
}

/* The fetched rows after a released one must not run ahead of it: the next
 * fetch is a full one, and one already sent is ignored. */
static void after_release(struct obx_relay *r)
{
    cursor_clear(r);
    if (r->state == OBX_RELAY_FETCHING || r->fetch_riding)
        r->discard_fetch = true;
    r->want_fetch = true;
}

/* The rows parked behind key hash h go back unsent, to be fetched again. */
static void release_parked_of(struct obx_relay *r, uint64_t h)
{
    int32_t i;
    bool any = false;
    while ((i = obx_keycount_unpark(&r->busy_keys, h)) >= 0) {
        slot_release(r, &r->slots[i]);
        any = true;
    }
    if (any)
        after_release(r);
}

/* Every parked row goes back unsent: the relay stops handing rows to Kafka
 * (shutdown, fatal error, session lost). */
static void release_all_parked(struct obx_relay *r)
{
    if (!r->set.one_per_key)
        return;
    for (int i = 0; i < r->set.max_in_flight; i++)
        if (r->slots[i].state == SLOT_PARKED)
            release_parked_of(r, r->slots[i].key_hash);
}

/* Parks row `row` of slot s behind its key's record at Kafka. false: no
 * memory for it (the caller leaves it for a later fetch). */
static bool park(struct obx_relay *r, struct slot *s, const struct obx_row *row)
{
    struct obx_row *copy = row_copy(row);
    if (!copy || obx_keycount_park(&r->busy_keys, s->key_hash, (int32_t)(s - r->slots)) != 0) {
        obx_free(copy);
        return false;
    }
    s->parked = copy;
    s->state = SLOT_PARKED;
    return true;
}

/* Key hash h has no record at Kafka any more, the last one delivered: its
 * first parked row goes now, if the relay may publish. */
static void produce_parked(struct obx_relay *r, uint64_t h, int64_t now)
{
    if (!r->recovered || r->draining || r->state == OBX_RELAY_WAIT_PG) {
        release_parked_of(r, h); /* fetched again once it may */
        return;
    }
    int32_t i = obx_keycount_unpark(&r->busy_keys, h);
    if (i < 0)
        return;
    struct slot *p = &r->slots[i];
    const char *reason = NULL;
    p->state = SLOT_PRODUCED;
    enum obx_produce_result pr = r->ops->produce(r->io, p->parked, p, &reason);
    if (pr == OBX_PRODUCE_OK) {
        obx_free(p->parked);
        p->parked = NULL;
        (void)obx_keycount_add(&r->busy_keys, h); /* it had a place: cannot fail */
        r->n_outstanding++;
        return;
    }
    if (pr == OBX_PRODUCE_BUSY) {
        slot_release(r, p);
        r->not_before = now + 100;
    } else {
        rejected(r, p, p->parked->key, p->parked->key_len, reason, now);
        obx_free(p->parked);
        p->parked = NULL;
    }
    release_parked_of(r, h); /* the rest of the key after it, by a fetch */
    after_release(r);
}

/* ---- events ---- */

void obx_relay_on_pg_ready(struct obx_relay *r, int64_t now)
{
    r->now = now;
    if (r->state != OBX_RELAY_WAIT_PG)
        return;
    set_state(r, OBX_RELAY_IDLE, "postgres ready");
    progress(r, now); /* the lock was just acquired: the clock starts now */
    r->want_fetch = true;
    cursor_clear(r); /* another relay may have sent or left rows meanwhile */
    r->not_before = 0;
    kick(r, now);
}

void obx_relay_on_pg_lost(struct obx_relay *r, int64_t now)
{
    r->now = now;
    if (r->state == OBX_RELAY_STOPPED || r->state == OBX_RELAY_WAIT_PG)
        return;
    /* A mark in flight may or may not have committed: mark those rows again
     * after the reconnect (the statement is idempotent). */
    unmark(r);
    fetch_gone(r);         /* the fetch in flight, if any */
    release_all_parked(r); /* never handed to Kafka: no relay lock, no publishing */
    if (r->set.log_mode) {
        /* The next session starts from the stored cursor, as a restart
         * does: another relay may have published and stored since. What
         * this one acknowledged is found in Kafka by the recovery pass,
         * which waits for the reports still outstanding. */
        for (int i = 0; i < r->set.max_in_flight; i++) {
            struct slot *s = &r->slots[i];
            if (s->state == SLOT_PRODUCED)
                s->orphan = true;
            else if (s->state != SLOT_FREE)
                slot_release(r, s);
        }
    }
    log_reset(r); /* in any mode: a relay in log mode may have taken over meanwhile */
    /* The relay lock went with the session: another relay may have
     * published since. The next acquisition runs the recovery pass again. */
    r->recovered = false;
    set_state(r, OBX_RELAY_WAIT_PG, "postgres connection lost");
    kick(r, now);
}

void obx_relay_on_recovered(struct obx_relay *r, bool ok, int64_t now)
{
    r->now = now;
    if (r->state != OBX_RELAY_RECOVERING)
        return;
    set_state(r, OBX_RELAY_IDLE, ok ? "recovery done" : "recovery failed");
    if (ok) {
        /* A possibly-persisted report that came during the pass may be of
         * a record the pass read past before it landed: one more pass. */
        r->recovered = r->unknowns == r->pass_unknowns;
        r->settled = r->pass_unknowns;
        r->want_fetch = true;
        cursor_clear(r); /* it may have marked rows, or left some */
        progress(r, now);
    } else {
        r->not_before = now + r->set.retry_backoff_ms;
    }
    kick(r, now);
}

static int compare_found(const void *a, const void *b)
{
    int64_t x = ((const struct found_row *)a)->id, y = ((const struct found_row *)b)->id;
    return (x > y) - (x < y);
}

int obx_relay_on_log_state(struct obx_relay *r, const struct obx_log_state *st)
{
    struct log_state *l = &r->log;
    /* Mark and delete mode after log mode read the stored cursor too (and
     * never write one): their full fetch leaves the rows it covers alone. */
    /* The records found, whether the session begins or a pass settled a
     * possibly-persisted report: rows in flight now are not among them
     * (found rows are only taken when fetched). */
    struct found_row *found = NULL;
    if (st->n_found > 0 && !(found = obx_calloc(st->n_found, sizeof(*found))))
        return -1;
    for (size_t i = 0; i < st->n_found; i++) {
        int64_t t = topic_index(r, st->found[i].topic);
        if (t < 0) {
            obx_free(found);
            return -1;
        }
        found[i] = (struct found_row){st->found[i].id, (uint32_t)t, st->found[i].partition,
                                      st->found[i].offset};
    }
    if (st->n_found > 1)
        qsort(found, st->n_found, sizeof(*found), compare_found);
    obx_free(l->found);
    l->found = found;
    l->n_found = st->n_found;
    if (l->loaded)
        return 0; /* the cursor is this session's own */
    log_reset(r);
    l->found = found; /* log_reset forgot them */
    l->n_found = st->n_found;
    l->has_stored = st->has_cursor;
    l->stored_seq = 0;
    l->stored_send = 0;
    l->stored_batch = st->has_cursor ? st->batch : 0;
    l->stored_hwm = st->hwm;
    l->writes = 0; /* the next write empties the table when it is due */
    obx_free(l->stored_snap);
    l->stored_snap = NULL;
    if (st->has_cursor && !(l->stored_snap = obx_strdup(st->snapshot)))
        return -1;
    for (size_t i = 0; i < st->n_held; i++) {
        const struct obx_log_held *h = &st->held[i];
        int64_t t = topic_index(r, h->topic);
        if (t < 0)
            return -1;
        size_t before = l->n_held;
        hold(r, h->from_id, (uint32_t)t, h->key, h->key_len);
        if (l->n_held == before)
            return -1;
        /* Lifted at once: the first claim of this session (from a full
         * fetch, which reads the held rows) covers them. */
        l->held[before].lifted = true;
        l->held[before].lift_send = l->sends;
    }
    /* Rows of held keys published since: their keys are not stored, so
     * they are listed while any rule lives. */
    for (size_t i = 0; i < st->n_also; i++)
        if (!also_add(l, st->also_sent[i], 0, 0))
            return -1;
    for (size_t i = 0; i < st->n_off; i++) {
        int64_t t = topic_index(r, st->off_topics[i]);
        struct log_offset *o = t < 0 ? NULL : log_offset_of(r, (uint32_t)t, st->off_partitions[i]);
        if (!o)
            return -1;
        o->stored = st->off_offsets[i];
    }
    /* Rows refused or failed in an earlier session of this process are
     * still held back (their entries outlive a lost session): the cursor
     * rows of this one must leave them out too. */
    for (size_t i = 0; i < r->n_blocked; i++) {
        const struct blocked *b = &r->blocked[i];
        size_t before = l->n_held;
        hold(r, b->id, b->topic, b->key, b->key_len);
        if (l->n_held == before && !held_now(r, b->id))
            return -1;
    }
    l->loaded = true;
    return 0;
}

/* Frees the slots of batch rows [from, to) that were not handed to Kafka;
 * a fetch already sent must not run ahead of them. */
static void release_rest(struct obx_relay *r, size_t from, size_t to)
{
    for (size_t j = from; j < to; j++)
        if (r->batch[j])
            slot_release(r, r->batch[j]);
    if (r->state == OBX_RELAY_FETCHING || r->fetch_riding)
        r->discard_fetch = true;
    cursor_clear(r); /* they are below hwm now */
}

/* Keeps a copy of the fetch's snapshot for the next keyset fetch. */
static bool keep_snapshot(struct obx_relay *r, const char *snapshot)
{
    size_t len = strlen(snapshot) + 1;
    if (len > r->snap_cap) {
        char *p = obx_realloc(r->snap, len);
        if (!p)
            return false;
        r->snap = p;
        r->snap_cap = len;
    }
    memcpy(r->snap, snapshot, len);
    return true;
}

/* The fetch in flight brought `n` rows in id order, of which the first
 * `n_take` were taken (the rest are left: see withheld()). Moves the cursor
 * on, or clears it when the rows taken do not cover everything it claims. */
static void cursor_advance(struct obx_relay *r, const struct obx_row *rows, size_t n, size_t n_take,
                           const char *snapshot)
{
    bool cut = n_take < n || n >= (size_t)r->fetch_limit; /* rows may lie beyond */
    int64_t last = n_take > 0 ? rows[n_take - 1].id : NO_ID;
    bool ok;
    if (r->fetch_keyset) {
        /* Late rows (at or below fetch_after) come first: all of them are
         * in if the first row not taken, or the last one taken, is above. */
        int64_t beyond = n_take < n ? rows[n_take].id : last;
        ok = !cut || beyond > r->fetch_after;
        if (ok && last > r->hwm)
            r->hwm = last;
    } else if (!cut) {
        /* Every unsent row but those excluded was taken: any hwm will do
         * that is at or above everything in flight or waiting. */
        ok = true;
        r->hwm = r->top_id > last ? r->top_id : last;
        if (r->fetch_max_ex > r->hwm)
            r->hwm = r->fetch_max_ex;
    } else {
        /* Rows above `last` were not looked at: only a cursor at `last`
         * holds, and only if nothing in flight or waiting lies above it. */
        ok = n_take > 0 && last >= r->fetch_max_ex;
        if (ok)
            r->hwm = last;
    }
    if (last > r->top_id)
        r->top_id = last;
    /* Log mode: the stored cursor covers everything up to its hwm that its
     * snapshot saw, and the keyset fetch would read those rows again from
     * a lower hwm. A full fetch that every uncovered row came back from may
     * take the stored hwm; one cut below it holds no cursor (the next one
     * is a full fetch again). */
    if (r->log.has_stored && ok) {
        if (!r->fetch_keyset && !cut && r->hwm < r->log.stored_hwm)
            r->hwm = r->log.stored_hwm;
        ok = r->hwm >= r->log.stored_hwm;
    }
    /* Cleared since this fetch was sent: what it did not return may lie
     * below hwm now (a row that was in flight then, a row its key's hold
     * kept out). */
    ok = ok && r->fetch_gen == r->cursor_gen;
    r->cursor_ok = ok && snapshot && keep_snapshot(r, snapshot);
}

/* A row whose payload the fetch left out for the byte budget: it and the
 * rows after it wait for the next fetch, which asks for fewer rows. (A
 * payload above the producer's limit is refused instead: oversize.) */
static bool withheld(const struct obx_relay *r, const struct obx_row *row)
{
    return row->oversize && (int64_t)row->payload_len <= r->set.max_payload;
}

void obx_relay_on_fetched(struct obx_relay *r, const struct obx_row *rows, size_t n,
                          const char *snapshot, int64_t now)
{
    size_t produced = 0, taken = 0;
    r->now = now;
    if (r->state != OBX_RELAY_FETCHING)
        return;
    set_state(r, OBX_RELAY_IDLE, "fetch done");
    if (r->discard_fetch) {
        /* Sent while the batch before it was produced, and that batch did not
         * all go out: these rows would overtake the ones it left behind. */
        r->discard_fetch = false;
        r->want_fetch = true;
        cursor_clear(r);
        kick(r, now);
        return;
    }
    if (r->draining) { /* fetched before the shutdown began: leave them */
        kick(r, now);
        return;
    }
    if (!r->recovered) {
        /* A possibly-persisted report came while this fetch was out: the
         * recovery pass goes first, and these rows may be of the uncertain
         * row's key. They are fetched again after it. */
        cursor_clear(r);
        r->want_fetch = true;
        kick(r, now);
        return;
    }
    if (n == 0 && r->in_use == 0)
        progress(r, now); /* caught up: nothing waits */
    if (failpoint(r, OBX_FP_FETCH_AFTER) != 0) {
        r->not_before = now + r->set.retry_backoff_ms;
        r->want_fetch = true;
        return;
    }
    /* A probe that was due when the fetch was sent: rows before it go as
     * usual; it goes alone. If the fetch passed its place without it, it
     * is no longer unsent (marked by the recovery pass, or deleted). Only
     * a full fetch sent once it was due can tell: one sent a moment before
     * its refusal (even within the same millisecond) excluded it. */
    int64_t probe_id =
        r->fetch_probe != NO_ID && find_block_by_id(r, r->fetch_probe) ? r->fetch_probe : NO_ID;
    if (probe_id != NO_ID && (n == 0 || rows[n - 1].id > probe_id)) {
        bool fetched = false;
        for (size_t i = 0; i < n && !fetched; i++)
            fetched = rows[i].id == probe_id;
        if (!fetched) {
            obx_info("relay: row %lld is no longer waiting to be sent; its key goes on",
                     (long long)probe_id);
            drop_block(r, probe_id);
            probe_id = NO_ID;
            r->want_fetch = true;
        }
    }
    if (r->n_blocked > 0 && !r->fetch_keyset)
        drop_settled(r, rows, n, n >= (size_t)r->fetch_limit);
    size_t n_take = 0;
    while (n_take < n && !withheld(r, &rows[n_take]))
        n_take++;
    /* The next fetch asks for as many rows as fit in relay.fetch_max_bytes
     * if they are as large as the largest payload seen now (the one left
     * out, else the largest taken). */
    size_t largest = n_take < n ? rows[n_take].payload_len : 1;
    for (size_t i = 0; i < n_take && n_take == n; i++)
        if (!rows[i].oversize && rows[i].payload_len > largest) /* oversize: never fetched */
            largest = rows[i].payload_len;
    int64_t fit = r->set.fetch_max_bytes / (int64_t)largest;
    r->bytes_limit = fit < 1 ? 1 : fit < r->set.batch_size ? (int)fit : r->set.batch_size;
    if (n_take < n)
        obx_debug("relay: row %lld has %zu payload bytes: fetching %d rows at a time",
                  (long long)rows[n_take].id, rows[n_take].payload_len, r->bytes_limit);
    cursor_advance(r, rows, n, n_take, snapshot);
    uint64_t seq = 0;
    if (r->set.log_mode) {
        seq = rec_push(r);
        if (seq == 0) { /* no record, no rows: they are fetched again */
            obx_error("relay: out of memory recording a fetch");
            cursor_clear(r);
            r->want_fetch = true;
            r->not_before = now + r->set.retry_backoff_ms;
            kick(r, now);
            return;
        }
        if (r->cursor_ok)
            rec_claim(r, seq, r->hwm, r->snap);
    }
    uint64_t gen_at_claim = r->cursor_gen;
    r->caught_up = n < (size_t)r->fetch_limit;
    schedule_look(r, n, now);
    /* Take a slot for every row first, so that the next statement can go to
     * Postgres now (its exclusions, or the cursor, cover these rows) and run
     * while we hand the rows to Kafka: Postgres does not wait for our CPU. */
    for (size_t i = 0; i < n_take; i++) {
        const struct obx_row *row = &rows[i];
        int64_t topic = topic_index(r, row->topic);
        r->batch[i] = NULL;
        if (topic < 0) {
            obx_error("relay: out of memory for topic names");
            cursor_clear(r); /* the rest was not taken */
            break;
        }
        if (r->n_blocked > 0 && held_back(r, row, (uint32_t)topic)) {
            cursor_clear(r); /* fetched, not taken: below hwm */
            continue;        /* a refused row of its key comes first */
        }
        struct slot *s = slot_alloc(r, row->id, (uint32_t)topic);
        if (!s) { /* cannot happen: the fetch limit was the free slot count */
            obx_error("relay: no free slot for row %lld", (long long)row->id);
            cursor_clear(r);
            break;
        }
        s->created_us = row->created_us;
        struct fetch_rec *rec = seq ? rec_of(r, seq) : NULL;
        s->seq = rec ? seq : 0;
        if (rec)
            rec->pending++; /* settled as it is delivered, held or released */
        r->batch[i] = s;
        taken = i + 1;
    }
    /* Rows fetched and not taken: the claim above does not hold. */
    if (seq && r->cursor_gen != gen_at_claim)
        claims_drop_from(r, seq);
    /* A full batch means more rows are likely waiting (a batch of
     * relay.batch_size, or of what the byte budget allows, is one). */
    if (n_take < n || (!r->caught_up && r->fetch_limit >= r->bytes_limit))
        r->want_fetch = true;
    kick(r, now);
    for (size_t i = 0; i < taken; i++) {
        const struct obx_row *row = &rows[i];
        struct slot *s = r->batch[i];
        if (!s)
            continue;
        if (r->n_blocked > 0 && held_back(r, row, s->topic)) {
            slot_release(r, s); /* its key was refused earlier in this batch */
            cursor_clear(r);
            continue;
        }
        s->key_hash = 0;
        if (r->set.log_mode && row->key)
            s->log_hash = obx_keycount_hash(s->topic, row->key, row->key_len);
        struct found_row fr;
        if (r->set.log_mode && r->log.n_found > 0 && take_found(r, row->id, &fr)) {
            /* A run before this one published it: taken as acknowledged. */
            log_settle(r, s, true);
            s->state = SLOT_ACKED;
            s->partition = fr.partition;
            s->offset = fr.offset;
            r->to_mark++;
            if (r->n_blocked > 0)
                unblock(r, s->id); /* it was held: its key goes on */
            continue;
        }
        if (r->set.one_per_key && row->key) {
            s->key_hash = obx_keycount_hash(s->topic, row->key, row->key_len);
            if (obx_keycount_busy(&r->busy_keys, s->key_hash)) {
                /* A record of its key is with Kafka: this row waits behind
                 * it, and goes once it is delivered. */
                if (park(r, s, row))
                    continue;
                /* No memory to keep it: a fetch after the report brings it
                 * again. A fetch on its way may bring the key's later rows
                 * without it. */
                slot_release(r, s);
                after_release(r);
                r->key_waits = true;
                continue;
            }
        }
        bool alone = row->id == probe_id;
        if (alone && r->n_outstanding > 0) {
            /* Rows before it are still out: it and the rest wait for the
             * next fetch, which kick() sends once their reports are in. */
            release_rest(r, i, taken);
            r->want_fetch = true;
            break;
        }
        const char *reason = NULL;
        enum obx_produce_result pr = r->ops->produce(r->io, row, s, &reason);
        if (pr == OBX_PRODUCE_OK) {
            if (s->key_hash && obx_keycount_add(&r->busy_keys, s->key_hash) != 0)
                obx_error("relay: more keys with Kafka than rows in flight (row %lld)",
                          (long long)row->id); /* cannot happen: sized for max_in_flight */
            struct blocked *b = r->n_blocked > 0 ? find_block_by_id(r, row->id) : NULL;
            if (b)
                b->retry_at = INT64_MAX; /* being retried: not due again until refused */
            r->n_outstanding++;
            produced++;
            if (alone) {
                obx_info("relay: trying row %lld alone", (long long)row->id);
                r->probe_id = row->id;
                release_rest(r, i + 1, taken);
                r->want_fetch = true;
                break;
            }
            continue;
        }
        if (pr == OBX_PRODUCE_BUSY) {
            /* Keep id order: the rest of the batch waits for the next fetch,
             * and a fetch already sent must not run ahead of it. */
            obx_warn("relay: Kafka queue full at row %lld; retrying shortly", (long long)row->id);
            release_rest(r, i, taken);
            r->not_before = now + 100;
            r->want_fetch = true;
            break;
        }
        rejected(r, s, row->key, row->key_len, reason, now);
    }
    if (r->set.log_mode)
        recs_settle(r); /* a fetch that handed nothing out settles at once */
    if (produced > 0 && failpoint(r, OBX_FP_PRODUCE_AFTER) != 0)
        r->not_before = now + r->set.retry_backoff_ms; /* as after a Kafka hiccup: pause */
    obx_debug("relay: fetched %zu rows, produced %zu, in flight %zu", n, produced, r->in_use);
    kick(r, now);
}

/* The mark in flight committed: its rows are done. */
static void mark_done(struct obx_relay *r, int64_t now)
{
    size_t marked = 0, dead = 0;
    if (r->set.log_mode)
        log_write_done(r);
    for (int i = 0; i < r->set.max_in_flight; i++) {
        struct slot *s = &r->slots[i];
        if (s->state == SLOT_MARKING || s->state == SLOT_DEAD_MARKING) {
            if (s->state == SLOT_MARKING)
                marked++;
            else
                dead++;
            slot_release(r, s);
        }
    }
    r->marked_total += marked;
    r->dead_total += dead;
    if (r->offsets_in_mark) {
        r->n_off = 0;
        r->offsets_due = now + OFFSETS_STORE_MS;
        r->offsets_in_mark = false;
    }
    progress(r, now);
    obx_debug("relay: marked %zu rows, dead-lettered %zu", marked, dead);
    set_state(r, OBX_RELAY_IDLE, "mark done");
    if (dead > 0)
        r->want_fetch = true; /* the rows behind them may go now */
}

void obx_relay_on_marked(struct obx_relay *r, int64_t now)
{
    r->now = now;
    if (r->state != OBX_RELAY_MARKING || r->fetch_riding)
        return;
    if (failpoint(r, OBX_FP_MARK_AFTER_COMMIT) != 0) {
        /* As if the COMMIT's answer was lost: mark again (idempotent). */
        obx_relay_on_query_failed(r, "injected error after commit", now);
        return;
    }
    mark_done(r, now);
    kick(r, now);
}

void obx_relay_on_mark_fetched(struct obx_relay *r, const struct obx_row *rows, size_t n,
                               const char *snapshot, int64_t now)
{
    r->now = now;
    if (r->state != OBX_RELAY_MARKING || !r->fetch_riding)
        return;
    if (failpoint(r, OBX_FP_MARK_AFTER_COMMIT) != 0) { /* as in obx_relay_on_marked */
        obx_relay_on_query_failed(r, "injected error after commit", now);
        return;
    }
    r->fetch_riding = false;
    mark_done(r, now);
    set_state(r, OBX_RELAY_FETCHING, "the fetch beside the mark");
    obx_relay_on_fetched(r, rows, n, snapshot, now);
}

void obx_relay_on_query_failed(struct obx_relay *r, const char *reason, int64_t now)
{
    r->now = now;
    if (r->state == OBX_RELAY_FETCHING) {
        obx_warn("relay: fetch failed: %s", reason);
        fetch_gone(r);
    } else if (r->state == OBX_RELAY_MARKING) {
        obx_warn("relay: mark failed: %s", reason);
        if (r->fetch_riding) /* and the fetch beside it */
            fetch_gone(r);
        unmark(r);
    } else {
        return;
    }
    r->not_before = now + r->set.retry_backoff_ms;
    set_state(r, OBX_RELAY_IDLE, "query failed");
    kick(r, now);
}

void obx_relay_on_delivery(struct obx_relay *r, void *opaque, enum obx_delivery outcome,
                           int32_t partition, int64_t offset, const char *key, size_t key_len,
                           const char *reason, int64_t now)
{
    struct slot *s = opaque;
    r->now = now;
    if (!s || s->state != SLOT_PRODUCED) {
        obx_error("relay: delivery report for an unknown or finished row");
        return;
    }
    if (s->orphan) {
        /* Handed out by a session that is gone: the next one's recovery
         * pass finds the record if it landed. */
        if (s->key_hash && obx_keycount_remove(&r->busy_keys, s->key_hash) == 0)
            release_parked_of(r, s->key_hash);
        r->n_outstanding--;
        slot_release(r, s);
        kick(r, now);
        return;
    }
    /* One record of a key at a time: is its key free now? */
    uint64_t key_hash = s->key_hash;
    bool key_free = key_hash && obx_keycount_remove(&r->busy_keys, key_hash) == 0;
    if (key_free && r->key_waits) {
        r->key_waits = false; /* rows left behind for their key: fetch them now */
        r->want_fetch = true;
    }
    r->n_outstanding--;
    bool was_probe = s->id == r->probe_id;
    if (was_probe)
        r->probe_id = NO_ID;
    if (outcome == OBX_DELIVERY_BATCH_REFUSED && was_probe)
        outcome = OBX_DELIVERY_REJECTED; /* refused alone: it is the row itself */
    switch (outcome) {
    case OBX_DELIVERED:
        log_settle(r, s, true);
        s->state = SLOT_ACKED;
        s->partition = partition;
        s->offset = offset;
        r->to_mark++;
        if (s->created_us > 0 && r->ops->acked)
            r->ops->acked(r->io, s->created_us);
        if (r->n_blocked > 0)
            unblock(r, s->id);
        break;
    case OBX_DELIVERY_RETRY:
    case OBX_DELIVERY_UNKNOWN: {
        /* Not persisted, or perhaps: the row stays unsent in Postgres and
         * is fetched again after the back-off; a refused row being retried
         * is due again then too (not stuck until a restart). Until it is
         * delivered (or found in Kafka), later rows of its key wait: one
         * fetched meanwhile, or already in a fetch on its way, would land
         * before it. */
        struct blocked *b = r->n_blocked > 0 ? find_block_by_id(r, s->id) : NULL;
        if (!b && (key || r->set.log_mode)) { /* log mode: a held row, key or none */
            block(r, s->id, s->topic, key, key_len, now);
            b = find_block_by_id(r, s->id);
        } else if (b)
            b->attempts++;
        if (b)
            b->retry_at = now + r->set.retry_backoff_ms;
        if (outcome == OBX_DELIVERY_UNKNOWN) {
            /* Publishing it again blindly could duplicate it: the recovery
             * pass reads Kafka first and marks it if it landed. */
            /* Such reports come in bursts (a whole request timed out):
             * one warning a second, the rest at debug. */
            obx_log(now - r->unknown_warned_at >= 1000 ? OBX_LOG_WARN : OBX_LOG_DEBUG,
                    "relay: row %lld may or may not be in Kafka (%s); the recovery pass checks "
                    "before it is published again",
                    (long long)s->id, reason ? reason : "unknown error");
            if (now - r->unknown_warned_at >= 1000)
                r->unknown_warned_at = now;
            r->recovered = false;
            r->unknowns++;
        } else {
            obx_warn("relay: row %lld not delivered: %s; will retry", (long long)s->id,
                     reason ? reason : "unknown error");
        }
        slot_release(r, s);
        cursor_clear(r); /* unsent below hwm: a full fetch finds it */
        r->want_fetch = true;
        r->not_before = now + r->set.retry_backoff_ms;
        break;
    }
    case OBX_DELIVERY_REJECTED:
        rejected(r, s, key, key_len, reason ? reason : "refused by Kafka", now);
        break;
    case OBX_DELIVERY_BATCH_REFUSED:
        batch_refused(r, s, key, key_len, reason ? reason : "refused by Kafka", now);
        break;
    }
    /* The key's next row goes once this one is delivered; after any other
     * outcome this one is fetched again, and its key's later rows after it. */
    if (key_free && outcome == OBX_DELIVERED)
        produce_parked(r, key_hash, now);
    else if (key_free)
        release_parked_of(r, key_hash);
    kick(r, now);
}

void obx_relay_tick(struct obx_relay *r, int64_t now)
{
    r->now = now;
    if (r->state == OBX_RELAY_STOPPED)
        return;
    if (now >= r->next_look_at)
        r->want_fetch = true;
    for (size_t i = 0; i < r->n_blocked; i++)
        if (r->blocked[i].retry_at <= now)
            r->want_fetch = true; /* a refused row is due for another try */
    kick(r, now);
}

void obx_relay_shutdown(struct obx_relay *r, int64_t now)
{
    r->now = now;
    if (r->draining || r->state == OBX_RELAY_STOPPED)
        return;
    r->draining = true;
    release_all_parked(r); /* not handed to Kafka yet: left for the next start */
    /* The last quarter (at most a second) is kept for the final mark. */
    int64_t reserve = r->set.shutdown_timeout_ms / 4 < 1000 ? r->set.shutdown_timeout_ms / 4 : 1000;
    r->hard_deadline = now + r->set.shutdown_timeout_ms;
    r->drain_deadline = r->hard_deadline - reserve;
    obx_info("relay: shutting down: %zu rows in flight, waiting up to %lldms", r->in_use,
             (long long)r->set.shutdown_timeout_ms);
    kick(r, now);
}

void obx_relay_fatal(struct obx_relay *r, const char *reason, int64_t now)
{
    r->now = now;
    if (r->state == OBX_RELAY_STOPPED)
        return;
    obx_error("relay: stopping after a fatal error: %s", reason);
    r->exit_code = 1;
    if (!r->draining)
        r->hard_deadline = now + r->set.shutdown_timeout_ms;
    r->draining = true;
    release_all_parked(r);
    r->drain_deadline = now;
    r->not_before = 0;
    kick(r, now);
}

void obx_relay_note_progress(struct obx_relay *r, int64_t now)
{
    progress(r, now);
}

/* What the relay is waiting for, for the stall report. */
static void describe_wait(const struct obx_relay *r, int64_t now, char *why, size_t len)
{
    long long in_state = (long long)((now - r->state_since) / 1000);
    size_t produced = r->in_use - r->to_mark;
    switch (r->state) {
    case OBX_RELAY_FETCHING:
    case OBX_RELAY_MARKING:
        snprintf(why, len, "waiting %llds for Postgres to answer the %s", in_state,
                 r->state == OBX_RELAY_FETCHING ? "fetch" : "mark");
        break;
    case OBX_RELAY_RECOVERING:
        snprintf(why, len, "the recovery pass has shown no progress for %llds", in_state);
        break;
    default:
        if (produced > 0)
            snprintf(why, len, "waiting for Kafka's delivery reports of %zu rows", produced);
        else
            snprintf(why, len, "%s for %llds with %zu rows in flight", state_names[r->state],
                     in_state, r->in_use);
        break;
    }
}

void obx_relay_check_stall(struct obx_relay *r, bool deps_ok, int64_t now)
{
    r->now = now;
    int64_t idle = now - r->last_progress;
    bool stalled = r->set.stall_timeout_ms > 0 && deps_ok && !r->draining &&
                   r->state != OBX_RELAY_WAIT_PG && r->state != OBX_RELAY_STOPPED &&
                   idle >= r->set.stall_timeout_ms;
    if (!stalled) {
        if (!deps_ok || r->state == OBX_RELAY_WAIT_PG)
            r->last_progress = now; /* waiting for a dependency is not a stall */
        r->stalled_ms = 0;
        return;
    }
    bool first = r->stalled_ms == 0;
    r->stalled_ms = idle;
    if (first || now - r->stall_logged_at >= r->set.stall_timeout_ms) {
        char why[160];
        describe_wait(r, now, why, sizeof(why));
        obx_error("relay: no progress for %llds: %s; /livez fails until it moves (restarting "
                  "outboxd is safe)",
                  (long long)(idle / 1000), why);
        r->stall_logged_at = now;
    }
}

int64_t obx_relay_stalled(const struct obx_relay *r, char *why, size_t len)
{
    if (r->stalled_ms > 0 && why)
        describe_wait(r, r->now, why, len);
    return r->stalled_ms;
}

int64_t obx_relay_last_progress(const struct obx_relay *r)
{
    return r->last_progress;
}

enum obx_relay_state obx_relay_state(const struct obx_relay *r)
{
    return r->state;
}

bool obx_relay_recovered(const struct obx_relay *r)
{
    return r->recovered;
}

size_t obx_relay_in_flight(const struct obx_relay *r)
{
    return r->in_use;
}

uint64_t obx_relay_fetches(const struct obx_relay *r, bool keyset)
{
    return r->fetches[keyset];
}

uint64_t obx_relay_marked_total(const struct obx_relay *r)
{
    return r->marked_total;
}

uint64_t obx_relay_dead_total(const struct obx_relay *r)
{
    return r->dead_total;
}

size_t obx_relay_blocked_keys(const struct obx_relay *r)
{
    return r->n_blocked;
}
