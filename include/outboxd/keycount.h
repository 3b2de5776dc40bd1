/*
 * keycount: how many records of each (topic, key) are with Kafka now,
 * counted by a 64-bit hash of the pair. Sized once for the most records
 * that can be in flight; a hash collision only makes two keys wait for each
 * other, never lets one through.
 *
 * Used when a finite kafka.message.timeout.ms is set: librdkafka may then
 * time a record out while a later one of its partition is still sent, so
 * the relay gives Kafka one record of a key at a time (relay.c).
 */
#ifndef OUTBOXD_KEYCOUNT_H
#define OUTBOXD_KEYCOUNT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct obx_keycount {
    uint64_t *hash; /* 0 = empty */
    uint32_t *count;
    size_t cap; /* a power of two, at least twice the most entries */
    size_t used;
};

/* Room for `most` keys at once. Returns 0, or -1 out of memory. */
int obx_keycount_init(struct obx_keycount *kc, size_t most);
void obx_keycount_free(struct obx_keycount *kc);

uint64_t obx_keycount_hash(uint32_t topic, const char *key, size_t key_len);
bool obx_keycount_busy(const struct obx_keycount *kc, uint64_t h);
/* Counts one more record of h; -1 if `most` keys are counted already. */
int obx_keycount_add(struct obx_keycount *kc, uint64_t h);
/* Counts one fewer; returns how many are left (0 also when h was absent). */
uint32_t obx_keycount_remove(struct obx_keycount *kc, uint64_t h);

#endif
