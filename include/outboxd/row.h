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
    size_t payload_len;  /* 0 when oversize */
    const char *headers; /* the headers object as JSON text (jsonb's own output) */
    size_t headers_len;  /* 0 = no headers, or oversize */
    /* Key, payload and headers as Postgres stores them (sql/016): what the
     * fetch's byte budget counts. A row above the fetch's budget for one
     * row comes without its payload and headers (oversize); above the
     * producer's limit it cannot be sent. */
    size_t bytes;
    bool oversize;
    int64_t created_us; /* created_at, Unix microseconds (0 if unknown) */
    bool has_slot;      /* the fetch said which slot of relay.shards it is of: */
    int32_t slot;
};

#endif
