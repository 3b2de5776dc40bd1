/*
 * keycount: for each (topic, key), how many of its records are with Kafka
 * now and the rows parked behind them, counted by a 64-bit hash of the
 * pair. Sized once for the most rows that can be in flight, whose slot
 * numbers (0 to most - 1) name the parked rows. A hash collision only makes
 * two keys wait for each other, never lets one through.
 *
 * Used when a finite kafka.message.timeout.ms is set: librdkafka may then
 * time a record out while a later one of its partition is still sent, so
 * the relay gives Kafka one record of a key at a time and parks the key's
 * later rows, in id order, until the one before is acknowledged (relay.c).
 */
#ifndef OUTBOXD_KEYCOUNT_H
#define OUTBOXD_KEYCOUNT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct obx_keycount {
    uint64_t *hash; /* 0 = empty */
    uint32_t *count;
    int32_t *head, *tail; /* parked slots, -1 = none */
    int32_t *next;        /* [most]: the slot parked after a slot */
    size_t cap;           /* a power of two, at least twice the most entries */
    size_t used, most;
};

/* Room for `most` keys and slots. Returns 0, or -1 out of memory. */
int obx_keycount_init(struct obx_keycount *kc, size_t most);
void obx_keycount_free(struct obx_keycount *kc);

uint64_t obx_keycount_hash(uint32_t topic, const char *key, size_t key_len);
/* A record of h is with Kafka, or a row of h is parked. */
bool obx_keycount_busy(const struct obx_keycount *kc, uint64_t h);
/* Counts one more record of h; -1 if `most` keys are counted already. */
int obx_keycount_add(struct obx_keycount *kc, uint64_t h);
/* Counts one fewer; returns how many are left (0 also when h was absent). */
uint32_t obx_keycount_remove(struct obx_keycount *kc, uint64_t h);
/* Parks `slot` behind h's others; -1 if `most` keys are counted already. */
int obx_keycount_park(struct obx_keycount *kc, uint64_t h, int32_t slot);
/* The first slot parked for h, taken off its queue; -1 if none. */
int32_t obx_keycount_unpark(struct obx_keycount *kc, uint64_t h);

#endif
