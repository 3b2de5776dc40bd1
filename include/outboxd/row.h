/*
 * row: one outbox row as the relay sees it. Plain data, no client library:
 * the relay core (relay.h) includes only this. pg fills it from a fetch
 * result (record.c), kafka makes a record of it.
 */
#ifndef OUTBOXD_ROW_H
#define OUTBOXD_ROW_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* A row borrowed from a fetch result: every pointer points into it. */
struct obx_row {
    int64_t id;
    const char *topic; /* NUL-terminated */
    const char *key;   /* NULL = no key */
    size_t key_len;
    const void *payload; /* NULL = tombstone, or oversize */
    size_t payload_len;  /* the stored length, also when oversize */
    bool oversize;       /* larger than the producer's limit: not fetched, cannot be sent */
    const char *headers; /* the headers object as JSON text (jsonb's own output) */
    size_t headers_len;  /* 0 = no headers */
    int64_t created_us;  /* created_at, Unix microseconds (0 if unknown) */
    bool has_slot;       /* the fetch said which slot of relay.shards it is of: */
    int32_t slot;
};

#endif
