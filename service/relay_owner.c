/*
 * relay_owner: several active relays (relay.shards > 1). Each key hashes
 * into one of relay.shards slots (outbox.slot_of, sql/008); a relay
 * publishes only the rows of the slots it holds an advisory lock for, and a
 * claim (outbox.claim_slots) every CLAIM_EVERY_MS moves slots so that each
 * relay holds its fair share. See relay_owner.h.
 *
 * Handover without loss, repeat or reorder: a relay gives a slot back only
 * when nothing of its own is in flight or unmarked (it stops fetching until
 * then), so the next owner finds each row of the slot either marked or
 * unsent, with no record of it on its way; and a relay runs the recovery
 * pass for the slots it takes before it fetches them (a crashed owner's
 * records that landed are found there, as after a takeover of the relay
 * lock).
 *
 * In log mode "unmarked" means acknowledged but not yet in a stored cursor
 * row, and a relay also takes slots only when quiet: its cursor rows are
 * about every slot it owns (sql/009; a partial checkpoint's, about some of
 * them only), so the checkpoints of its fetches must be too, and after a take it
 * starts its cursor again from the rows about each slot (relay.c,
 * obx_relay_on_log_state; relay_log.c, log_load).
 */
#include "relay_owner.h"
#include "outboxd/alloc.h"
#include "outboxd/log.h"

#include <stdio.h>
#include <string.h>

/* How often a relay looks at the members: bounds how long a relay that
 * joins waits for slots, and how long a crashed relay's slots wait for an
 * owner (once Postgres has ended its session). As often as a standby tries
 * the relay lock. */
#define CLAIM_EVERY_MS 250
/* The warning about another relay.shards, at most this often. */
#define OTHER_SHARDS_WARN_MS 10000
/* Log mode pauses its fetches to take slots; if what is in flight is not
 * all stored within this (a partition without a leader holds a record), it publishes
 * again and tries later, rather than hold its own slots still. */
#define TAKE_PAUSE_MAX_MS 2000
#define TAKE_RETRY_MS     5000

bool owner_active(const struct owner *h)
{
    return h->shards > 1;
}

/* The slots in `in` but not in `except` (may be NULL) as text into out:
 * "{0,3}" with `braces`, else "0,3". */
static void write_set(char *out, size_t cap, const bool *in, const bool *except, int n, bool braces)
{
    size_t o = 0;
    if (braces)
        out[o++] = '{';
    for (int i = 0; i < n; i++) {
        if (!in[i] || (except && except[i]))
            continue;
        int w = snprintf(out + o, cap - o, "%s%d", o > (braces ? 1u : 0u) ? "," : "", i);
        if (w < 0 || (size_t)w >= cap - o)
            break; /* cannot happen: text_cap fits every slot */
        o += (size_t)w;
    }
    if (braces)
        out[o++] = '}';
    out[o] = '\0';
}

/* Whether the fetches read the slots this relay will give back. Log mode
 * does: the whole checkpoints its fetches make must be about every slot of the
 * cursor rows it writes (mark_text), and it gives them back only once
 * nothing is in flight. */
static bool fetch_leaving(const struct owner *h)
{
    return h->log_mode;
}

static void shards_texts(struct owner *h)
{
    int n = h->shards;
    write_set(h->fetch_text, h->text_cap, h->owned, fetch_leaving(h) ? NULL : h->leaving, n, true);
    write_set(h->mark_text, h->text_cap, h->owned, NULL, n, true);
    write_set(h->give_text, h->text_cap, h->leaving, NULL, n, true);
    write_set(h->list_text, h->text_cap, h->owned, NULL, n, false);
}

int owner_init(struct owner *h, int shards, bool log_mode)
{
    h->shards = shards;
    h->log_mode = log_mode;
    if (!owner_active(h))
        return 0;
    size_t n = (size_t)shards;
    h->text_cap = n * 6 + 4; /* "1023," a slot, and the braces */
    h->owned = obx_calloc(n, sizeof(bool));
    h->leaving = obx_calloc(n, sizeof(bool));
    h->seen = obx_calloc(n, sizeof(bool));
    h->fetch_text = obx_malloc(h->text_cap);
    h->mark_text = obx_malloc(h->text_cap);
    h->give_text = obx_malloc(h->text_cap);
    h->list_text = obx_malloc(h->text_cap);
    if (!h->owned || !h->leaving || !h->seen || !h->fetch_text || !h->mark_text || !h->give_text ||
        !h->list_text)
        return -1;
    h->warned_at = INT64_MIN / 2;
    shards_texts(h);
    return 0;
}

void owner_free(struct owner *h)
{
    obx_free(h->owned);
    obx_free(h->leaving);
    obx_free(h->seen);
    obx_free(h->fetch_text);
    obx_free(h->mark_text);
    obx_free(h->give_text);
    obx_free(h->list_text);
}

/* The session ended: its locks went with it. */
void owner_lost(struct owner *h)
{
    if (!owner_active(h))
        return;
    memset(h->owned, 0, (size_t)h->shards * sizeof(bool));
    memset(h->leaving, 0, (size_t)h->shards * sizeof(bool));
    h->n_owned = h->n_leaving = 0;
    h->members = h->share = 0;
    h->known = h->giving = h->want_take = false;
    shards_texts(h);
}

/* No fetch may go: the slots are not known yet, some wait to be given back
 * (the relay makes a quiet moment for them), or none is owned. */
bool owner_hold_fetch(const struct owner *h, const struct owner_view *v)
{
    if (!owner_active(h))
        return false;
    if (!h->known || h->n_owned == 0)
        return true;
    /* Log mode: acknowledged rows that no checkpoint covers are stored
     * only after a fetch that makes one, so one goes (its rows are of every
     * slot owned, leaving ones too: see shards_texts). */
    return (h->n_leaving > 0 || h->want_take) && !v->log_waits_checkpoint && !v->found_pending;
}

/* Slots wait to be given back or taken: what is in flight should be stored
 * at once, not after the delay that gathers acknowledgements. */
bool owner_want_quiet(const struct owner *h)
{
    return owner_active(h) && (h->n_leaving > 0 || h->want_take);
}

const char *owner_fetch_slots(const struct owner *h)
{
    return owner_active(h) ? h->fetch_text : NULL;
}

/* Whether this relay's fetches read every slot (fetch_text names them
 * all): a fetch then needs no test of each row's slot. */
bool owner_fetch_every_slot(const struct owner *h)
{
    int fetched = h->n_owned - (fetch_leaving(h) ? 0 : h->n_leaving);
    return owner_active(h) && h->known && fetched == h->shards;
}

const char *owner_mark_slots(const struct owner *h)
{
    return owner_active(h) ? h->mark_text : NULL;
}

/* Whether a claim is due: the first of a session, the periodic look, or
 * the give-back once nothing of ours is in flight or unmarked; if so, what
 * it gives back and whether it may take. */
bool owner_claim_due(struct owner *h, const struct owner_view *v, int64_t now,
                     struct claim_due *out, struct owner_fx *fx)
{
    if (h->want_take && !v->quiet && now - h->want_take_since > TAKE_PAUSE_MAX_MS) {
        obx_warn(
            "relay: free slots wait: what this relay has in flight was not stored within %d ms (a "
            "record waits for Kafka), so this relay publishes its own again and tries to "
            "take them in %d s",
            TAKE_PAUSE_MAX_MS, TAKE_RETRY_MS / 1000);
        h->want_take = false;
        h->take_again_at = now + TAKE_RETRY_MS;
        fx->want_fetch = "slots not taken now";
    }
    /* Nothing of ours in flight or unmarked, no report left unresolved and
     * the pass over our slots done: the slots go back clean (given_back),
     * and their next owner need not look for records of a last owner that
     * died before storing an offset (ours is a slot we took after such an
     * owner until our pass has looked). */
    bool give = h->n_leaving > 0 && v->quiet && v->recovered && !v->found_pending;
    /* Log mode takes only when quiet (see want_take), and then at once. */
    bool may_take = !h->log_mode || v->quiet;
    bool quick = give || (h->want_take && may_take && now >= h->next_quick_claim_at);
    if (!v->can_claim || (h->known && !quick && now < h->next_claim_at))
        return false;
    bool take = !give && !v->draining && h->n_leaving == 0 && h->other_shards == 0 && may_take;
    if (take && h->want_take)
        h->next_quick_claim_at = now + CLAIM_EVERY_MS / 5; /* a lost race does not spin */
    *out = (struct claim_due){.give = give ? h->give_text : "{}",
                              .take = take,
                              .giving = give,
                              .why = give ? "slots to give back" : "look at the slots"};
    return true;
}

void owner_claim_sent(struct owner *h, bool giving)
{
    h->giving = giving;
}

/* "0,3,5" into h->seen; false if it is not such a list of slots. */
static bool parse_owned(struct owner *h, const char *text)
{
    memset(h->seen, 0, (size_t)h->shards * sizeof(bool));
    for (const char *c = text; *c;) {
        long v = 0;
        const char *start = c;
        while (*c >= '0' && *c <= '9' && v <= h->shards)
            v = v * 10 + (*c++ - '0');
        if (c == start || v >= h->shards || (*c != ',' && *c != '\0'))
            return false;
        h->seen[v] = true;
        if (*c == ',')
            c++;
    }
    return true;
}

/* The surplus over the share leaves the fetches (the highest slots first),
 * to be given back at the next quiet moment. With `all`, every slot. */
static void choose_leaving(struct owner *h, bool all, struct owner_fx *fx)
{
    int keep = all ? 0 : h->share;
    int kept = 0;
    for (int i = 0; i < h->shards; i++) {
        if (!h->owned[i])
            continue;
        if (kept < keep) {
            kept++;
            continue;
        }
        if (!h->leaving[i]) {
            h->leaving[i] = true;
            h->n_leaving++;
        }
    }
    if (h->n_leaving > 0)
        fx->clear_cursor = "slots to give back";
}

/* At the end of a drain: with nothing in flight or unmarked, every slot
 * goes back clean (given_back), so that their next owners' passes read
 * Kafka from the stored offsets only, not from a partition's start as
 * after an owner that may have died before storing one. GIVE_ALL_SEND: a
 * claim giving every slot back is to go (*give), and the drain ends at its
 * answer; GIVE_ALL_WAIT: an answer is awaited first. */
enum give_all owner_give_all_due(struct owner *h, const struct owner_view *v, int64_t now,
                                 const char **give, struct owner_fx *fx)
{
    if (h->gave_all) /* the drain ends at the answer */
        return v->state == OBX_RELAY_CLAIMING && now < v->hard_deadline ? GIVE_ALL_WAIT
                                                                        : GIVE_ALL_NO;
    if (!owner_active(h) || !v->can_claim || !h->known || h->n_owned == 0 || !v->quiet ||
        !v->recovered || v->found_pending)
        return GIVE_ALL_NO;
    /* A look for rows, at the slots, or an empty cursor row still out:
     * its answer comes first (the rows of a fetch answered now are left). */
    if (v->state == OBX_RELAY_FETCHING || v->state == OBX_RELAY_CLAIMING ||
        v->state == OBX_RELAY_MARKING)
        return now < v->hard_deadline ? GIVE_ALL_WAIT : GIVE_ALL_NO;
    if (v->state != OBX_RELAY_IDLE)
        return GIVE_ALL_NO;
    h->gave_all = true;
    choose_leaving(h, true, fx);
    shards_texts(h);
    *give = h->give_text;
    return GIVE_ALL_SEND;
}

/* The answer's slots against what we held: given back, taken, or (never
 * expected: a lock goes only with the session) gone. */
static void apply_owned(struct owner *h, struct owner_fx *fx)
{
    int taken = 0, given = 0, gone = 0;
    for (int i = 0; i < h->shards; i++) {
        if (h->seen[i] && !h->owned[i])
            taken++;
        else if (!h->seen[i] && h->owned[i] && h->leaving[i])
            given++;
        else if (!h->seen[i] && h->owned[i])
            gone++;
        h->owned[i] = h->seen[i];
        if (!h->seen[i])
            h->leaving[i] = false;
    }
    h->n_owned = h->n_leaving = 0;
    for (int i = 0; i < h->shards; i++) {
        h->n_owned += h->owned[i];
        h->n_leaving += h->leaving[i];
    }
    h->moves += (uint64_t)(taken + given);
    if (gone > 0) {
        obx_error("relay: %d slots were no longer held by this relay; its cursor starts again",
                  gone);
        fx->clear_cursor = "slots gone";
    }
    if (given > 0)
        obx_event(OBX_LOG_INFO, "slots_given_back",
                  "relay: gave %d slots back; holds %d of %d (%d relays)", given, h->n_owned,
                  h->shards, h->members);
    if (taken > 0) {
        shards_texts(h);
        obx_event(OBX_LOG_INFO, "slots_taken",
                  "relay: took %d slots; holds %s (%d of %d, %d relays); recovering them first",
                  taken, h->list_text, h->n_owned, h->shards, h->members);
        fx->clear_cursor = "slots taken";
        fx->taken = true;
    }
}

bool owner_claim_answered(struct owner *h, const struct obx_claim *c, bool draining, int64_t now,
                          struct owner_fx *fx)
{
    h->giving = false;
    if (!parse_owned(h, c->owned ? c->owned : "")) {
        obx_error("relay: the claim of slots answered an unreadable list: %.64s", c->owned);
        h->known = false;
        return false;
    }
    h->members = c->members;
    h->share = c->share;
    h->free = c->free;
    h->other_shards = c->other_shards;
    apply_owned(h, fx);
    bool want = h->log_mode && h->other_shards == 0 && h->n_leaving == 0 && !draining &&
                h->n_owned < h->share && h->free > 0 && now >= h->take_again_at;
    if (want && !h->want_take)
        h->want_take_since = now;
    h->want_take = want;
    if (h->other_shards != 0) {
        if (now - h->warned_at >= OTHER_SHARDS_WARN_MS) {
            obx_error("relay: another relay of this outbox runs with relay.shards = %d, this one "
                      "with %d: a key would have two owners, so this relay gives its slots back "
                      "and publishes nothing until every relay has the same value",
                      h->other_shards, h->shards);
            h->warned_at = now;
        }
        choose_leaving(h, true, fx);
    } else if (h->n_owned - h->n_leaving > h->share) {
        choose_leaving(h, false, fx);
    }
    h->known = true;
    h->next_claim_at = now + CLAIM_EVERY_MS;
    shards_texts(h);
    return true;
}

/* A claim that failed may have moved locks before it did (advisory locks
 * are not undone with the statement): the next one reads them again. */
void owner_claim_failed(struct owner *h)
{
    h->known = false;
    h->giving = false;
}
