/*
 * relay: see include/outboxd/relay.h.
 */
#include "outboxd/relay.h"
#include "outboxd/failpoint.h"
#include "outboxd/log.h"

#include <stdlib.h>
#include <string.h>

enum slot_state {
    SLOT_FREE = 0,
    SLOT_PRODUCED, /* handed to Kafka, delivery report pending */
    SLOT_ACKED,    /* persisted by Kafka, not yet marked */
    SLOT_MARKING,  /* in the mark statement now in flight */
};

struct slot {
    int64_t id;
    enum slot_state state;
    int32_t next_free; /* free-list link, -1 = end */
};

struct obx_relay {
    struct obx_relay_settings set;
    const struct obx_relay_ops *ops;
    void *io;
    enum obx_relay_state state;

    struct slot *slots;
    int32_t free_head;
    size_t in_use;    /* slots not FREE */
    size_t acked;     /* slots ACKED (waiting for a mark) */
    int64_t *scratch; /* max_in_flight ids: fetch exclusions or mark ids */

    bool want_fetch;       /* rows may be waiting: NOTIFY, poll, full batch */
    int64_t not_before;    /* back-off: no fetch or mark before this time */
    int64_t last_fetch_at; /* when the last fetch was sent (poll fallback) */

    bool draining;
    int64_t drain_deadline;
    int exit_code;
    uint64_t marked_total;
};

static const char *const state_names[] = {"wait_pg", "idle", "fetching", "marking", "stopped"};

const char *obx_relay_state_name(enum obx_relay_state s)
{
    return (unsigned)s < sizeof(state_names) / sizeof(state_names[0]) ? state_names[s] : "?";
}

/* Which moves are possible: allowed[from] is a bit set of destinations. */
#define BIT(s) (1u << (s))
static const unsigned allowed[] = {
    [OBX_RELAY_WAIT_PG] = BIT(OBX_RELAY_IDLE) | BIT(OBX_RELAY_STOPPED),
    [OBX_RELAY_IDLE] = BIT(OBX_RELAY_FETCHING) | BIT(OBX_RELAY_MARKING) | BIT(OBX_RELAY_WAIT_PG) |
                       BIT(OBX_RELAY_STOPPED),
    [OBX_RELAY_FETCHING] = BIT(OBX_RELAY_IDLE) | BIT(OBX_RELAY_WAIT_PG),
    [OBX_RELAY_MARKING] = BIT(OBX_RELAY_IDLE) | BIT(OBX_RELAY_WAIT_PG),
    [OBX_RELAY_STOPPED] = 0,
};

/* The one place the state changes. Refuses impossible moves (a bug). */
static void set_state(struct obx_relay *r, enum obx_relay_state to, const char *why)
{
    if (!(allowed[r->state] & BIT(to))) {
        obx_error("relay: refused state change %s -> %s (%s)", state_names[r->state],
                  state_names[to], why);
        return;
    }
    obx_debug("relay: %s -> %s (%s)", state_names[r->state], state_names[to], why);
    r->state = to;
}

void obx_relay_settings_from_config(struct obx_relay_settings *s, const struct obx_config *cfg)
{
    s->batch_size = cfg->batch_size;
    s->max_in_flight = cfg->max_in_flight;
    s->poll_interval_ms = cfg->poll_interval_ms;
    s->retry_backoff_ms = cfg->retry_backoff_ms;
    s->shutdown_timeout_ms = cfg->shutdown_timeout_ms;
}

int obx_relay_new(const struct obx_relay_settings *s, const struct obx_relay_ops *ops, void *io,
                  struct obx_relay **out)
{
    struct obx_relay *r = calloc(1, sizeof(*r));
    if (!r)
        return -1;
    r->set = *s;
    r->ops = ops;
    r->io = io;
    r->state = OBX_RELAY_WAIT_PG;
    r->slots = calloc((size_t)s->max_in_flight, sizeof(*r->slots));
    r->scratch = calloc((size_t)s->max_in_flight, sizeof(*r->scratch));
    if (!r->slots || !r->scratch) {
        obx_relay_free(r);
        return -1;
    }
    for (int32_t i = 0; i < s->max_in_flight; i++)
        r->slots[i].next_free = i + 1 < s->max_in_flight ? i + 1 : -1;
    r->free_head = 0;
    r->want_fetch = true;
    *out = r;
    return 0;
}

void obx_relay_free(struct obx_relay *r)
{
    if (!r)
        return;
    free(r->slots);
    free(r->scratch);
    free(r);
}

static struct slot *slot_alloc(struct obx_relay *r, int64_t id)
{
    struct slot *s;
    if (r->free_head < 0)
        return NULL;
    s = &r->slots[r->free_head];
    r->free_head = s->next_free;
    s->id = id;
    s->state = SLOT_PRODUCED;
    r->in_use++;
    return s;
}

static void slot_release(struct obx_relay *r, struct slot *s)
{
    if (s->state == SLOT_ACKED)
        r->acked--;
    s->state = SLOT_FREE;
    s->next_free = r->free_head;
    r->free_head = (int32_t)(s - r->slots);
    r->in_use--;
}

static void stop(struct obx_relay *r, const char *why)
{
    set_state(r, OBX_RELAY_STOPPED, why);
    if (r->state == OBX_RELAY_STOPPED)
        r->ops->stopped(r->io, r->exit_code);
}

/* Marks every ACKED slot. Returns true if a mark statement was sent. */
static bool start_mark(struct obx_relay *r, int64_t now)
{
    size_t n = 0;
    for (int i = 0; i < r->set.max_in_flight; i++)
        if (r->slots[i].state == SLOT_ACKED)
            r->scratch[n++] = r->slots[i].id;
    if (n == 0)
        return false;
    if (OBX_FAILPOINT(OBX_FP_ACK_AFTER) != 0 || OBX_FAILPOINT(OBX_FP_MARK_BEFORE_COMMIT) != 0) {
        r->not_before = now + r->set.retry_backoff_ms;
        return false;
    }
    if (r->ops->mark(r->io, r->scratch, n) != 0)
        return false;
    for (int i = 0; i < r->set.max_in_flight; i++)
        if (r->slots[i].state == SLOT_ACKED)
            r->slots[i].state = SLOT_MARKING;
    r->acked = 0;
    set_state(r, OBX_RELAY_MARKING, "acknowledged rows to mark");
    return true;
}

static bool start_fetch(struct obx_relay *r, int64_t now)
{
    size_t n = 0;
    int free_slots = r->set.max_in_flight - (int)r->in_use;
    int limit = free_slots < r->set.batch_size ? free_slots : r->set.batch_size;
    if (limit <= 0)
        return false;
    for (int i = 0; i < r->set.max_in_flight; i++)
        if (r->slots[i].state != SLOT_FREE)
            r->scratch[n++] = r->slots[i].id;
    if (r->ops->fetch(r->io, r->scratch, n, limit) != 0)
        return false;
    r->want_fetch = false;
    r->last_fetch_at = now;
    set_state(r, OBX_RELAY_FETCHING, "rows may be waiting");
    return true;
}

/* Decides what the idle connection does next. Called after every event. */
static void kick(struct obx_relay *r, int64_t now)
{
    if (r->state != OBX_RELAY_IDLE && r->state != OBX_RELAY_WAIT_PG)
        return;
    if (r->draining) {
        bool deadline_passed = now >= r->drain_deadline;
        /* Done when nothing is in flight, or at the deadline once nothing
         * acknowledged is left to mark (or no connection to mark it with). */
        if (r->in_use == 0 ||
            (deadline_passed && (r->acked == 0 || r->state == OBX_RELAY_WAIT_PG))) {
            if (r->in_use > 0)
                obx_warn("relay: stopping with %zu rows unconfirmed (%zu acknowledged but not "
                         "marked); they will be published again after a restart",
                         r->in_use, r->acked);
            stop(r, r->exit_code ? "fatal error" : "drained");
            return;
        }
    }
    if (r->state != OBX_RELAY_IDLE || now < r->not_before)
        return;
    if (r->acked > 0 && start_mark(r, now))
        return;
    if (!r->draining && r->want_fetch)
        start_fetch(r, now);
}

void obx_relay_on_pg_ready(struct obx_relay *r, int64_t now)
{
    if (r->state != OBX_RELAY_WAIT_PG)
        return;
    set_state(r, OBX_RELAY_IDLE, "postgres ready");
    r->want_fetch = true;
    r->not_before = 0;
    kick(r, now);
}

void obx_relay_on_pg_lost(struct obx_relay *r, int64_t now)
{
    if (r->state == OBX_RELAY_STOPPED || r->state == OBX_RELAY_WAIT_PG)
        return;
    /* A mark in flight may or may not have committed: mark those rows again
     * after the reconnect (the statement is idempotent). */
    for (int i = 0; i < r->set.max_in_flight; i++)
        if (r->slots[i].state == SLOT_MARKING) {
            r->slots[i].state = SLOT_ACKED;
            r->acked++;
        }
    set_state(r, OBX_RELAY_WAIT_PG, "postgres connection lost");
    kick(r, now);
}

void obx_relay_on_fetched(struct obx_relay *r, const struct obx_row *rows, size_t n, int64_t now)
{
    size_t produced = 0;
    if (r->state != OBX_RELAY_FETCHING)
        return;
    set_state(r, OBX_RELAY_IDLE, "fetch done");
    if (r->draining) { /* fetched before the shutdown began: leave them */
        kick(r, now);
        return;
    }
    if (OBX_FAILPOINT(OBX_FP_FETCH_AFTER) != 0) {
        r->not_before = now + r->set.retry_backoff_ms;
        r->want_fetch = true;
        return;
    }
    for (size_t i = 0; i < n; i++) {
        struct slot *s = slot_alloc(r, rows[i].id);
        if (!s) { /* cannot happen: the fetch limit was the free slot count */
            obx_error("relay: no free slot for row %lld", (long long)rows[i].id);
            break;
        }
        enum obx_produce_result pr = r->ops->produce(r->io, &rows[i], s);
        if (pr == OBX_PRODUCE_OK) {
            produced++;
            continue;
        }
        slot_release(r, s);
        if (pr == OBX_PRODUCE_BUSY) {
            /* Keep id order: the rest of the batch waits for the next fetch. */
            obx_warn("relay: Kafka queue full at row %lld; retrying shortly",
                     (long long)rows[i].id);
            r->not_before = now + 100;
            break;
        }
        r->not_before = now + r->set.retry_backoff_ms;
    }
    if (produced > 0)
        (void)OBX_FAILPOINT(OBX_FP_PRODUCE_AFTER);
    obx_debug("relay: fetched %zu rows, produced %zu, in flight %zu", n, produced, r->in_use);
    /* A full batch means more rows are likely waiting: fetch again at once,
     * overlapping with Kafka's round trips. */
    if (n > 0 && n == (size_t)r->set.batch_size)
        r->want_fetch = true;
    kick(r, now);
}

void obx_relay_on_marked(struct obx_relay *r, int64_t now)
{
    size_t n = 0;
    if (r->state != OBX_RELAY_MARKING)
        return;
    (void)OBX_FAILPOINT(OBX_FP_MARK_AFTER_COMMIT);
    for (int i = 0; i < r->set.max_in_flight; i++)
        if (r->slots[i].state == SLOT_MARKING) {
            slot_release(r, &r->slots[i]);
            n++;
        }
    r->marked_total += n;
    obx_debug("relay: marked %zu rows", n);
    set_state(r, OBX_RELAY_IDLE, "mark done");
    kick(r, now);
}

void obx_relay_on_query_failed(struct obx_relay *r, const char *reason, int64_t now)
{
    if (r->state == OBX_RELAY_FETCHING) {
        obx_warn("relay: fetch failed: %s", reason);
        r->want_fetch = true;
    } else if (r->state == OBX_RELAY_MARKING) {
        obx_warn("relay: mark failed: %s", reason);
        for (int i = 0; i < r->set.max_in_flight; i++)
            if (r->slots[i].state == SLOT_MARKING) {
                r->slots[i].state = SLOT_ACKED;
                r->acked++;
            }
    } else {
        return;
    }
    r->not_before = now + r->set.retry_backoff_ms;
    set_state(r, OBX_RELAY_IDLE, "query failed");
    kick(r, now);
}

void obx_relay_on_delivery(struct obx_relay *r, void *opaque, bool ok, int32_t partition,
                           int64_t offset, const char *reason, int64_t now)
{
    struct slot *s = opaque;
    if (!s || s->state != SLOT_PRODUCED) {
        obx_error("relay: delivery report for an unknown or finished row");
        return;
    }
    if (ok) {
        s->state = SLOT_ACKED;
        r->acked++;
        (void)partition;
        (void)offset;
    } else {
        /* Not persisted: the row stays unsent in Postgres and is fetched
         * again after the back-off. */
        obx_error("relay: row %lld not delivered: %s; will retry", (long long)s->id,
                  reason ? reason : "unknown error");
        slot_release(r, s);
        r->want_fetch = true;
        r->not_before = now + r->set.retry_backoff_ms;
    }
    kick(r, now);
}

void obx_relay_wakeup(struct obx_relay *r, int64_t now)
{
    r->want_fetch = true;
    kick(r, now);
}

void obx_relay_tick(struct obx_relay *r, int64_t now)
{
    if (r->state == OBX_RELAY_STOPPED)
        return;
    if (now - r->last_fetch_at >= r->set.poll_interval_ms)
        r->want_fetch = true;
    kick(r, now);
}

void obx_relay_shutdown(struct obx_relay *r, int64_t now)
{
    if (r->draining || r->state == OBX_RELAY_STOPPED)
        return;
    r->draining = true;
    r->drain_deadline = now + r->set.shutdown_timeout_ms;
    obx_info("relay: shutting down: %zu rows in flight, waiting up to %lldms", r->in_use,
             (long long)r->set.shutdown_timeout_ms);
    kick(r, now);
}

void obx_relay_fatal(struct obx_relay *r, const char *reason, int64_t now)
{
    if (r->state == OBX_RELAY_STOPPED)
        return;
    obx_error("relay: stopping after a fatal error: %s", reason);
    r->exit_code = 1;
    r->draining = true;
    r->drain_deadline = now;
    r->not_before = 0;
    kick(r, now);
}

enum obx_relay_state obx_relay_state(const struct obx_relay *r)
{
    return r->state;
}

size_t obx_relay_in_flight(const struct obx_relay *r)
{
    return r->in_use;
}

uint64_t obx_relay_marked_total(const struct obx_relay *r)
{
    return r->marked_total;
}
