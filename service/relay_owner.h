/*
 * relay_owner: with relay.shards above 1, which of the slots this relay
 * owns, when to claim more or give some back, and the slot filters of its
 * statements. It reads the relay through a struct owner_view that relay.c
 * fills, sends no claim itself, and says what else is to change in a
 * struct owner_fx that relay.c applies right after the call.
 */
#ifndef OUTBOXD_RELAY_OWNER_H
#define OUTBOXD_RELAY_OWNER_H
#include "outboxd/relay.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The slots of relay.shards this relay owns (a row in flight has a seat: relay_rows.h). A claim
 * every CLAIM_EVERY_MS reads the members and this relay's share; a slot taken is recovered before
 * its rows are fetched; a surplus slot leaves the fetches at once and is given back once nothing of
 * this relay is in flight or unmarked (a quiet moment the relay makes by fetching nothing
 * meanwhile), so the next owner finds its rows marked or unsent. */
struct owner {
    int shards;    /* relay.shards */
    bool log_mode; /* relay.on_sent = log */
    bool known;    /* a claim answered in this session: `owned` holds */
    bool *owned;   /* [shards] */
    bool *leaving; /* [shards]: owned, to be given back */
    bool *seen;    /* [shards]: scratch for an answer */
    int n_owned, n_leaving;
    int members, share, free, other_shards;
    bool giving; /* the claim in flight gives `leaving` back */
    /* Log mode: free slots to take beyond ours. A relay in log mode takes
     * slots only with nothing in flight or unstored (its cursor then
     * starts again from the rows about every slot it owns), so it stops
     * fetching until then. */
    bool want_take;
    bool gave_all; /* the drain's last claim gave every slot back */
    int64_t want_take_since;
    int64_t take_again_at; /* a pause that did not become quiet: no take before */
    int64_t next_claim_at;
    int64_t next_quick_claim_at; /* the soonest claim that skips the wait */
    int64_t warned_at;           /* the last warning about another relay.shards */
    uint64_t moves;              /* slots taken or given back */
    char *fetch_text;            /* "{0,3}": owned but not leaving, for the fetches */
    char *mark_text;             /* "{0,3}": owned, for the stored offsets */
    char *give_text;             /* "{5}": leaving, for the claim */
    char *list_text;             /* "0,3": owned, for status */
    size_t text_cap;
};

/* What the owner reads of the relay, filled by relay.c for each call. */
struct owner_view {
    bool quiet;         /* nothing of ours in flight, unmarked or unstored, no report unresolved */
    bool recovered;     /* the recovery pass over the slots owned is done */
    bool found_pending; /* log mode: records the last pass found wait to be stored */
    bool log_waits_checkpoint; /* log mode: what is acknowledged waits for a fetch's checkpoint */
    bool draining;
    bool can_claim; /* the ops have a claim */
    enum obx_relay_state state;
    int64_t hard_deadline;
};

struct owner_fx {
    const char *clear_cursor; /* drop the cursor, for this reason (NULL: no) */
    const char *want_fetch;   /* a fetch is due, for this reason (NULL: no) */
    bool taken;               /* slots were taken: their recovery pass goes before their rows,
                               * and log mode's cursor starts again from the rows about them */
};

struct claim_due {
    const char *give; /* the slots it gives back, "{}" for none */
    bool take;        /* it may take free slots */
    bool giving;
    const char *why;
};

/* 0, or -1 out of memory (owner_free() undoes it). Nothing with one slot. */
int owner_init(struct owner *h, int shards, bool log_mode);
void owner_free(struct owner *h);
/* relay.shards above 1. */
bool owner_active(const struct owner *h);
/* The session ended: its locks went with it. */
void owner_lost(struct owner *h);
/* No fetch may go: the slots are not known yet, some wait to be given back
 * (the relay makes a quiet moment for them), or none is owned. */
bool owner_hold_fetch(const struct owner *h, const struct owner_view *v);
/* Slots wait to be given back or taken: what is in flight should be stored
 * at once, not after the delay that gathers acknowledgements. */
bool owner_want_quiet(const struct owner *h);
/* "{0,3}" for the fetches, the stored offsets; NULL with one slot. */
const char *owner_fetch_slots(const struct owner *h);
const char *owner_mark_slots(const struct owner *h);
/* Whether the fetches read every slot: they need no test of each row's. */
bool owner_fetch_every_slot(const struct owner *h);
/* Whether a claim is due (the first of a session, the periodic look, or
 * the give-back once quiet); if so, what it gives back and may take. */
bool owner_claim_due(struct owner *h, const struct owner_view *v, int64_t now,
                     struct claim_due *out, struct owner_fx *fx);
void owner_claim_sent(struct owner *h, bool giving);
/* A claim that failed may have moved locks before it did (advisory locks
 * are not undone with the statement): the next one reads them again. */
void owner_claim_failed(struct owner *h);
enum give_all { GIVE_ALL_NO, GIVE_ALL_WAIT, GIVE_ALL_SEND };
/* At the end of a drain, every slot back: SEND, a claim giving *give back
 * is to go (the drain ends at its answer); WAIT, an answer comes first. */
enum give_all owner_give_all_due(struct owner *h, const struct owner_view *v, int64_t now,
                                 const char **give, struct owner_fx *fx);
/* A claim's answer; false: unreadable (logged), the slots unknown. */
bool owner_claim_answered(struct owner *h, const struct obx_claim *c, bool draining, int64_t now,
                          struct owner_fx *fx);

#endif
