/*
 * keycount: an open-addressing table of 64-bit hashes with counts and
 * queues of parked slots, linear probing, and backward-shift deletion (no
 * tombstones, so lookups stay short however many keys come and go).
 */
#include "outboxd/keycount.h"

#include <string.h>

#include "outboxd/alloc.h"

int obx_keycount_init(struct obx_keycount *kc, size_t most)
{
    size_t cap = 16;
    memset(kc, 0, sizeof(*kc));
    while (cap < 2 * most)
        cap *= 2;
    kc->hash = obx_calloc(cap, sizeof(*kc->hash));
    kc->count = obx_calloc(cap, sizeof(*kc->count));
    kc->head = obx_calloc(cap, sizeof(*kc->head));
    kc->tail = obx_calloc(cap, sizeof(*kc->tail));
    kc->next = obx_calloc(most ? most : 1, sizeof(*kc->next));
    if (!kc->hash || !kc->count || !kc->head || !kc->tail || !kc->next) {
        obx_keycount_free(kc);
        return -1;
    }
    kc->cap = cap;
    kc->most = most;
    return 0;
}

void obx_keycount_free(struct obx_keycount *kc)
{
    obx_free(kc->hash);
    obx_free(kc->count);
    obx_free(kc->head);
    obx_free(kc->tail);
    obx_free(kc->next);
    memset(kc, 0, sizeof(*kc));
}

uint64_t obx_keycount_hash(uint32_t topic, const char *key, size_t key_len)
{
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (int i = 0; i < 4; i++)
        h = (h ^ ((topic >> (8 * i)) & 0xff)) * 1099511628211ULL;
    for (size_t i = 0; i < key_len; i++)
        h = (h ^ (unsigned char)key[i]) * 1099511628211ULL;
    return h ? h : 1; /* 0 marks an empty place */
}

static size_t home(const struct obx_keycount *kc, uint64_t h)
{
    return (size_t)(h ^ (h >> 32)) & (kc->cap - 1);
}

static size_t find(const struct obx_keycount *kc, uint64_t h)
{
    size_t i = home(kc, h);
    while (kc->hash[i] && kc->hash[i] != h)
        i = (i + 1) & (kc->cap - 1);
    return i;
}

/* The place of h, made if new; cap when full. */
static size_t place(struct obx_keycount *kc, uint64_t h)
{
    size_t i = find(kc, h);
    if (kc->hash[i] == h)
        return i;
    if (2 * (kc->used + 1) > kc->cap)
        return kc->cap;
    kc->hash[i] = h;
    kc->count[i] = 0;
    kc->head[i] = kc->tail[i] = -1;
    kc->used++;
    return i;
}

/* Empties place i, then moves later entries of its run back into it when
 * their home allows, so that no probe stops short of them. */
static void forget(struct obx_keycount *kc, size_t i)
{
    size_t mask = kc->cap - 1;
    kc->used--;
    for (size_t j = (i + 1) & mask;; j = (j + 1) & mask) {
        kc->hash[i] = 0;
        if (!kc->hash[j])
            break;
        size_t h = home(kc, kc->hash[j]);
        /* j may move to i unless its home lies cyclically in (i, j]. */
        bool stays = i <= j ? (h > i && h <= j) : (h > i || h <= j);
        if (stays)
            continue;
        kc->hash[i] = kc->hash[j];
        kc->count[i] = kc->count[j];
        kc->head[i] = kc->head[j];
        kc->tail[i] = kc->tail[j];
        i = j;
    }
}

bool obx_keycount_busy(const struct obx_keycount *kc, uint64_t h)
{
    return kc->cap > 0 && kc->hash[find(kc, h)] == h;
}

int obx_keycount_add(struct obx_keycount *kc, uint64_t h)
{
    size_t i = place(kc, h);
    if (i == kc->cap)
        return -1;
    kc->count[i]++;
    return 0;
}

uint32_t obx_keycount_remove(struct obx_keycount *kc, uint64_t h)
{
    if (kc->cap == 0)
        return 0;
    size_t i = find(kc, h);
    if (kc->hash[i] != h || kc->count[i] == 0)
        return 0;
    uint32_t left = --kc->count[i];
    if (left == 0 && kc->head[i] < 0)
        forget(kc, i);
    return left;
}

int obx_keycount_park(struct obx_keycount *kc, uint64_t h, int32_t slot)
{
    size_t i = place(kc, h);
    if (i == kc->cap || slot < 0 || (size_t)slot >= kc->most)
        return -1;
    kc->next[slot] = -1;
    if (kc->tail[i] >= 0)
        kc->next[kc->tail[i]] = slot;
    else
        kc->head[i] = slot;
    kc->tail[i] = slot;
    return 0;
}

int32_t obx_keycount_unpark(struct obx_keycount *kc, uint64_t h)
{
    if (kc->cap == 0)
        return -1;
    size_t i = find(kc, h);
    if (kc->hash[i] != h || kc->head[i] < 0)
        return -1;
    int32_t slot = kc->head[i];
    kc->head[i] = kc->next[slot];
    if (kc->head[i] < 0) {
        kc->tail[i] = -1;
        if (kc->count[i] == 0)
            forget(kc, i);
    }
    return slot;
}
