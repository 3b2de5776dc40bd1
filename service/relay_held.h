/*
 * relay_held: refused rows (relay.on_reject = retry, the rows of a refused
 * batch tried alone) and the later rows of their keys, or of their topic,
 * held back behind them. It knows no modes and no slots: it changes its
 * entries and says what else is to change in a struct held_fx, which
 * relay.c applies right after the call.
 */
#ifndef OUTBOXD_RELAY_HELD_H
#define OUTBOXD_RELAY_HELD_H
#include "outboxd/row.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* A refused row under relay.on_reject = retry, or a row whose whole batch
 * was refused (it is tried again alone before on_reject applies). */
struct held_back {
    int64_t id;
    int64_t retry_at;
    uint32_t topic;
    int attempts;
    bool alone;           /* tried alone (nothing else out): its batch was refused, or it was */
    bool whole_topic;     /* its topic refused it: every later row of the topic waits */
    bool behind_at_fetch; /* an earlier one of its key held it back in the fetch in flight */
    char *key;            /* owned; NULL = no key (only the row itself waits) */
    size_t key_len;
};

/* A topic held as a whole, in the index. */
struct held_topic {
    uint32_t topic;
    int64_t id;
};

struct held {
    struct held_back *entry; /* grown as needed */
    size_t n, cap;
    int64_t *lifted;          /* [cap]: see struct held_fx */
    int64_t retry_backoff_ms; /* relay.retry_backoff: the first pause, doubling */
    /* An index of the entries, so that a fetch's rows and a fetch's walk of
     * the entries are not each a walk of every entry (thousands of keys
     * held). Made by the HELD_INDEX_AFTER-th lookup after a change, for
     * HELD_INDEX_MIN entries or more; lookups walk the entries while there
     * is none (after a change, or out of memory). Each table has n_slots
     * slots (a power of two), each an entry's index + 1, 0 when empty. */
    bool indexed;
    int lookups_unindexed; /* since the last change */
    uint32_t *by_id;       /* an entry by its id */
    uint32_t *by_key;      /* the lowest-id entry of a topic and key */
    size_t n_slots;
    struct held_topic *whole; /* [cap]: the entries held as a whole topic */
    size_t n_whole;
};

/* What else is to change after a call, for relay.c to apply. */
struct held_fx {
    const char *clear_cursor; /* drop the cursor, for this reason (NULL: no) */
    const char *want_fetch;   /* a fetch is due, for this reason (NULL: no) */
    bool hold;                /* log mode: a rule for row hold_id, just held back */
    int64_t hold_id;
    uint32_t hold_topic;
    const char *hold_key; /* the caller's, valid until applied */
    size_t hold_key_len;
    size_t n_lifted; /* held rows whose key went on: lifted[0..n_lifted) */
};

void held_free(struct held *h);
struct held_back *held_find(struct held *h, int64_t id);
/* True if row `id` of `topic` and `key` must wait behind an earlier
 * refused row of its key, or of its topic when the topic refused it. */
bool held_holds(struct held *h, int64_t id, uint32_t topic, const char *key, size_t key_len);
/* Row `id` was delivered (logged) or is gone (dead-lettered, or no longer unsent): its
 * entry goes, and its key with it. */
void held_release(struct held *h, int64_t id, struct held_fx *fx);
void held_drop(struct held *h, int64_t id, struct held_fx *fx);
/* True if an earlier held row of its key, or of its topic refused as a
 * whole, holds `b` back too. */
bool held_behind_another(struct held *h, const struct held_back *b);
/* The row to try alone next: the lowest-id due one that no earlier refused
 * row of its key holds back. NULL if none. */
struct held_back *held_due_alone(struct held *h, int64_t now);
/* After a full fetch sent at `fetch_sent_at`: a held row that was due
 * when it was sent, that no earlier held row of its key held back in it
 * (one may have gone since), and whose place the answer passed without it,
 * is no longer unsent (the recovery pass found it in Kafka and marked it,
 * or another relay published it): its key goes on. `rows` are the
 * answer's n rows, `full`: it had as many as it asked for. */
void held_drop_gone(struct held *h, const struct obx_row *rows, size_t n, bool full,
                    int64_t fetch_sent_at, struct held_fx *fx);
/* Row `id` was refused or failed: retry it later, holding back its key
 * meanwhile. */
void held_hold_back(struct held *h, int64_t id, uint32_t topic, const char *key, size_t key_len,
                    int64_t now, struct held_fx *fx);
/* Row `id` refused for good, retried (relay.on_reject = retry, or no
 * memory for its dead letter): alone, with back-off, its key waiting. */
void held_refused(struct held *h, int64_t id, uint32_t topic, const char *key, size_t key_len,
                  int64_t now, struct held_fx *fx);
/* Whether row `id` is a later row of `topic`, held as a whole. */
bool held_behind_topic(struct held *h, uint32_t topic, int64_t id);
/* Row `id`'s topic (`topic_name`) refused it (it does not exist, the relay
 * may not write it, its name is invalid), relay.on_reject = retry, mark or
 * delete mode: the topic's rows wait behind its first refused row, held as
 * one entry (thousands of keys would make thousands), which is retried
 * alone with back-off; the other topics go on. Log mode holds by key (its
 * stored cursor has no rule for a whole topic). True: the row waits
 * behind an earlier one of the topic, held already. */
bool held_topic_refused(struct held *h, int64_t id, uint32_t topic, const char *topic_name,
                        const char *key, size_t key_len, const char *reason, int64_t now,
                        struct held_fx *fx);
/* The batch row `id` went in was refused for good, perhaps for another
 * record's sake (a batch is too large as a whole, or one record in it is):
 * its key waits while it is tried again alone, at once. */
void held_batch_refused(struct held *h, int64_t id, uint32_t topic, const char *topic_name,
                        const char *key, size_t key_len, const char *reason, int64_t now,
                        struct held_fx *fx);

#endif
