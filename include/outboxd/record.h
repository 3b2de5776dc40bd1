/*
 * record: one outbox row and the Kafka record made from it (DESIGN 1.2).
 *
 * Rows come from the fetch query in binary result format, so payloads need
 * no hex decoding. The headers jsonb comes as jsonb's text output, which C
 * splits into Kafka headers (Postgres spends no per-row JSON work): keys in
 * byte order, string values unescaped, other values as their JSON text.
 */
#ifndef OUTBOXD_RECORD_H
#define OUTBOXD_RECORD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <libpq-fe.h>
#include <librdkafka/rdkafka.h>

#include "outboxd/config.h"
#include "outboxd/row.h"

/* Column order of the fetch queries (store.c). */
enum {
    OBX_COL_ID = 0,
    OBX_COL_TOPIC,
    OBX_COL_KEY,
    OBX_COL_PAYLOAD,
    OBX_COL_HEADERS, /* jsonb, binary: version byte 1, then its text; NULL: oversize */
    OBX_COL_CREATED_AT,
    OBX_COL_ROW_BYTES, /* bigint: the row's key, payload and headers as stored */
    OBX_COL_SNAPSHOT,  /* NULL, but in the one row without an id: the snapshot's text */
    OBX_COL_SLOT,      /* the row's slot in log mode's exact fetch with slots, else NULL */
    OBX_COL_COUNT
};

/* 2000-01-01 (Postgres' epoch) in Unix microseconds. */
#define OBX_PG_EPOCH_US 946684800000000LL

/* Reads row `i` of a fetch result (binary format). Returns 0, or -1 with a
 * sentence in err if the result does not have the expected shape. */
int obx_row_from_result(const PGresult *res, int i, struct obx_row *row, char *err,
                        size_t errlen) OBX_WARN_UNUSED;

/* The members of a headers object, parsed: reusable between rows. */
struct obx_header_span {
    const char *key, *value;
    size_t key_len, value_len;
};
struct obx_headers {
    struct obx_header_span *v; /* sorted by key bytes */
    size_t n, cap;
    char *buf; /* unescaped strings */
    size_t buf_used, buf_cap;
};
void obx_headers_free(struct obx_headers *h);

/* Splits a JSON object (as jsonb prints it, or any valid JSON object) into
 * h: key -> value, string values unescaped, other values (numbers, true,
 * false, null, arrays, objects) as their JSON text; keys in byte order, as
 * Postgres' COLLATE "C". Returns 0, or -1 with a sentence in err. */
int obx_headers_parse(const char *json, size_t len, struct obx_headers *h, char *err,
                      size_t errlen) OBX_WARN_UNUSED;

/* How records are made (record.format). */
struct obx_record_opts {
    int format;            /* enum obx_record_format */
    const char *ce_source; /* OBX_RECORD_CLOUDEVENTS: ce_source unless the row has one */
    const char *history;   /* "outbox-history": the session's server history; NULL = none */
};

/* Builds the Kafka headers of `row`: "outbox-id" first, then
 * "outbox-history" when opts has one (which history of the database's ids
 * the record belongs to: doc/contract.md), then each member of the row's
 * headers. Under CloudEvents (opts non-NULL), after those:
 * ce_specversion 1.0, ce_id (the outbox id), ce_source and ce_type (the
 * configured source and the topic, unless the row has its own), ce_time
 * (created_at, RFC 3339 UTC); a row header named ce_specversion, ce_id or
 * ce_time is left out (ours holds). The caller owns *out
 * (rd_kafka_producev takes it over on success). Returns 0, or -1 with a
 * sentence in err. */
int obx_record_headers(const struct obx_row *row, const struct obx_record_opts *opts,
                       struct obx_headers *scratch, rd_kafka_headers_t **out, char *err,
                       size_t errlen) OBX_WARN_UNUSED;

/* Writes Unix microseconds as RFC 3339 UTC ("2026-12-01T11:43:16.123456Z")
 * into buf (at least 28 bytes); returns the length. */
size_t obx_format_rfc3339(int64_t unix_us, char *buf, size_t len);

/* Writes id as decimal ASCII into buf (at least 21 bytes); returns length. */
size_t obx_format_id(int64_t id, char *buf);
/* Reads what obx_format_id writes (an optional '-', then digits, within
 * int64); false for anything else, overflow included. */
bool obx_parse_id(const char *s, size_t len, int64_t *out);

#endif
