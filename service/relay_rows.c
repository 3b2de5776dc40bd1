/* relay_rows: see relay_rows.h. */
#include "relay_rows.h"
#include "outboxd/alloc.h"
#include "outboxd/log.h"

#include <string.h>

static const char *const state_names[SEAT_STATES] = {"free", "produced",     "acked",  "marking",
                                                     "dead", "dead_marking", "parked", "sent"};

static const char *rows_state_name(enum seat_state s)
{
    return (unsigned)s < SEAT_STATES ? state_names[s] : "?";
}

/* Which moves are possible: allowed[from] is a bit set of destinations.
 * Every seat in use may go back to FREE (marked, or back unsent); that is
 * rows_release(), not a move. */
#define BIT(s) (1u << (s))
static const unsigned allowed[SEAT_STATES] = {
    [SEAT_FREE] = 0, /* rows_take() */
    [SEAT_PRODUCED] = BIT(SEAT_ACKED) | BIT(SEAT_DEAD) | BIT(SEAT_PARKED) | BIT(SEAT_SENT),
    [SEAT_ACKED] = BIT(SEAT_MARKING),
    [SEAT_MARKING] = BIT(SEAT_ACKED),
    [SEAT_DEAD] = BIT(SEAT_DEAD_MARKING),
    [SEAT_DEAD_MARKING] = BIT(SEAT_DEAD),
    [SEAT_PARKED] = BIT(SEAT_PRODUCED) | BIT(SEAT_DEAD),
    [SEAT_SENT] = BIT(SEAT_ACKED), /* committed; an abort releases it */
};

int rows_init(struct rows *rs, int32_t cap)
{
    memset(rs, 0, sizeof(*rs));
    rs->seat = obx_calloc((size_t)cap, sizeof(*rs->seat));
    if (!rs->seat)
        return -1;
    rs->cap = cap;
    for (int32_t i = 0; i < cap; i++)
        rs->seat[i].next_free = i + 1 < cap ? i + 1 : -1;
    rs->free_head = cap > 0 ? 0 : -1;
    rs->count[SEAT_FREE] = (size_t)cap;
    return 0;
}

void rows_free(struct rows *rs)
{
    for (int32_t i = 0; rs->seat && i < rs->cap; i++) {
        obx_free(rs->seat[i].reason);
        obx_free(rs->seat[i].parked);
    }
    obx_free(rs->seat);
    memset(rs, 0, sizeof(*rs));
}

struct seat *rows_take(struct rows *rs, int64_t id, uint32_t topic)
{
    if (rs->free_head < 0)
        return NULL;
    struct seat *s = &rs->seat[rs->free_head];
    rs->free_head = s->next_free;
    *s = (struct seat){.id = id,
                       .topic = topic,
                       .partition = -1,
                       .offset = -1,
                       .state = SEAT_PRODUCED,
                       .next_free = -1};
    rs->count[SEAT_FREE]--;
    rs->count[SEAT_PRODUCED]++;
    return s;
}

void rows_move(struct rows *rs, struct seat *s, enum seat_state to)
{
    if (!(allowed[s->state] & BIT(to))) {
        OBX_BUG("relay: refused move of row %lld from %s to %s", (long long)s->id,
                rows_state_name(s->state), rows_state_name(to));
        return;
    }
    rs->count[s->state]--;
    rs->count[to]++;
    s->state = to;
}

void rows_move_all(struct rows *rs, enum seat_state from, enum seat_state to)
{
    for (int32_t i = 0; i < rs->cap && rs->count[from] > 0; i++)
        if (rs->seat[i].state == from)
            rows_move(rs, &rs->seat[i], to);
}

void rows_release(struct rows *rs, struct seat *s)
{
    if (s->state == SEAT_FREE) {
        OBX_BUG("relay: seat %d released twice", (int)rows_index(rs, s));
        return;
    }
    if (s->orphan)
        rs->orphans--;
    obx_free(s->reason);
    obx_free(s->parked);
    rs->count[s->state]--;
    rs->count[SEAT_FREE]++;
    *s = (struct seat){.state = SEAT_FREE, .next_free = rs->free_head};
    rs->free_head = rows_index(rs, s);
}

void rows_orphan(struct rows *rs, struct seat *s)
{
    if (!s->orphan) {
        s->orphan = true;
        rs->orphans++;
    }
}

int64_t topics_index(struct topics *t, const char *name)
{
    if (t->last < t->n && strcmp(t->name[t->last], name) == 0)
        return t->last;
    for (size_t i = 0; i < t->n; i++)
        if (strcmp(t->name[i], name) == 0)
            return t->last = (uint32_t)i;
    if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 16;
        char **grown = obx_realloc(t->name, cap * sizeof(*grown));
        if (!grown)
            return -1;
        t->name = grown;
        t->cap = cap;
    }
    char *copy = obx_strdup(name);
    if (!copy)
        return -1;
    t->name[t->n] = copy;
    return t->last = (uint32_t)t->n++;
}

void topics_free(struct topics *t)
{
    for (size_t i = 0; i < t->n; i++)
        obx_free(t->name[i]);
    obx_free(t->name);
    memset(t, 0, sizeof(*t));
}

int part_offsets_init(struct part_offsets *o, size_t cap)
{
    memset(o, 0, sizeof(*o));
    o->topic = obx_calloc(cap, sizeof(*o->topic));
    o->partition = obx_calloc(cap, sizeof(*o->partition));
    o->offset = obx_calloc(cap, sizeof(*o->offset));
    o->cap = cap;
    return o->topic && o->partition && o->offset ? 0 : -1;
}

void part_offsets_free(struct part_offsets *o)
{
    obx_free(o->topic);
    obx_free(o->partition);
    obx_free(o->offset);
    memset(o, 0, sizeof(*o));
}

/* Room for twice as many partitions. */
static int part_offsets_grow(struct part_offsets *o)
{
    size_t cap = o->cap ? o->cap * 2 : 16;
    const char **t = obx_realloc(o->topic, cap * sizeof(*t));
    if (!t)
        return -1;
    o->topic = t;
    int32_t *p = obx_realloc(o->partition, cap * sizeof(*p));
    if (!p)
        return -1;
    o->partition = p;
    int64_t *v = obx_realloc(o->offset, cap * sizeof(*v));
    if (!v)
        return -1;
    o->offset = v;
    o->cap = cap;
    return 0;
}

int part_offsets_add(struct part_offsets *o, const char *topic, int32_t partition, int64_t offset)
{
    if (o->n == o->cap && part_offsets_grow(o) != 0)
        return -1;
    o->topic[o->n] = topic;
    o->partition[o->n] = partition;
    o->offset[o->n++] = offset;
    return 0;
}

void part_offsets_raise(struct part_offsets *o, const char *topic, int32_t partition,
                        int64_t offset)
{
    for (size_t i = 0; i < o->n; i++) {
        if (o->partition[i] == partition && o->topic[i] == topic) {
            if (offset > o->offset[i])
                o->offset[i] = offset;
            return;
        }
    }
    (void)part_offsets_add(o, topic, partition, offset);
}
