/*
 * keycount: an open-addressing table of 64-bit hashes with counts, linear
 * probing, and backward-shift deletion (no tombstones, so lookups stay
 * short however many keys come and go).
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
    if (!kc->hash || !kc->count) {
        obx_keycount_free(kc);
        return -1;
    }
    kc->cap = cap;
    return 0;
}

void obx_keycount_free(struct obx_keycount *kc)
{
    obx_free(kc->hash);
    obx_free(kc->count);
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

static size_t find(const struct obx_keycount *kc, uint64_t h)
{
    size_t mask = kc->cap - 1, i = (size_t)(h ^ (h >> 32)) & mask;
    while (kc->hash[i] && kc->hash[i] != h)
        i = (i + 1) & mask;
    return i;
}

bool obx_keycount_busy(const struct obx_keycount *kc, uint64_t h)
{
    return kc->cap > 0 && kc->hash[find(kc, h)] == h;
}

int obx_keycount_add(struct obx_keycount *kc, uint64_t h)
{
    size_t i = find(kc, h);
    if (kc->hash[i] == h) {
        kc->count[i]++;
        return 0;
    }
    if (2 * (kc->used + 1) > kc->cap)
        return -1;
    kc->hash[i] = h;
    kc->count[i] = 1;
    kc->used++;
    return 0;
}

uint32_t obx_keycount_remove(struct obx_keycount *kc, uint64_t h)
{
    if (kc->cap == 0)
        return 0;
    size_t mask = kc->cap - 1, i = find(kc, h);
    if (kc->hash[i] != h)
        return 0;
    if (--kc->count[i] > 0)
        return kc->count[i];
    /* Empty the place, then move later entries of its run back into it
     * when their home allows, so that no probe stops short of them. */
    kc->used--;
    for (size_t j = (i + 1) & mask;; j = (j + 1) & mask) {
        kc->hash[i] = 0;
        kc->count[i] = 0;
        if (!kc->hash[j])
            break;
        size_t home = (size_t)(kc->hash[j] ^ (kc->hash[j] >> 32)) & mask;
        /* j may move to i unless its home lies cyclically in (i, j]. */
        bool stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (stays)
            continue;
        kc->hash[i] = kc->hash[j];
        kc->count[i] = kc->count[j];
        i = j;
    }
    return 0;
}
