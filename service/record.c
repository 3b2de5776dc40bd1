/*
 * record: see include/outboxd/record.h.
 */
#include "outboxd/record.h"

#include <stdio.h>
#include <string.h>

static uint32_t be32(const char *p)
{
    const unsigned char *u = (const unsigned char *)p;
    return ((uint32_t)u[0] << 24) | ((uint32_t)u[1] << 16) | ((uint32_t)u[2] << 8) | u[3];
}

/* Binary array layout (PostgreSQL array_send): int32 ndim, int32 has-nulls
 * flag, uint32 element type oid, then per dimension int32 size and int32
 * lower bound, then per element int32 length (-1 = NULL) and its bytes. */
int obx_array_iter_init(struct obx_array_iter *it, const char *data, size_t len)
{
    int32_t ndim, count;
    if (len < 12)
        return -1;
    ndim = (int32_t)be32(data);
    if (ndim == 0) {
        it->p = data + 12;
        it->end = data + len;
        it->remaining = 0;
        return 0;
    }
    if (ndim != 1 || len < 20)
        return -1;
    count = (int32_t)be32(data + 12);
    /* Every element takes at least its 4-byte length: a count the bytes
     * cannot hold is malformed (and would make callers size buffers by it;
     * found by fuzz_headers). */
    if (count < 0 || (size_t)count > (len - 20) / 4)
        return -1;
    it->p = data + 20;
    it->end = data + len;
    it->remaining = count;
    return count;
}

int obx_array_iter_next(struct obx_array_iter *it, const char **elem, size_t *len)
{
    int32_t n;
    if (it->remaining == 0)
        return 0;
    if (it->end - it->p < 4)
        return -1;
    n = (int32_t)be32(it->p);
    it->p += 4;
    if (n == -1) {
        *elem = NULL;
        *len = 0;
    } else {
        if (n < 0 || it->end - it->p < n)
            return -1;
        *elem = it->p;
        *len = (size_t)n;
        it->p += n;
    }
    it->remaining--;
    return 1;
}

int obx_row_from_result(const PGresult *res, int i, struct obx_row *row, char *err, size_t errlen)
{
    if (PQnfields(res) != OBX_COL_COUNT || PQfformat(res, OBX_COL_ID) != 1 ||
        PQgetisnull(res, i, OBX_COL_ID) || PQgetlength(res, i, OBX_COL_ID) != 8 ||
        PQgetisnull(res, i, OBX_COL_TOPIC)) {
        snprintf(err, errlen, "fetch result row %d does not have the expected columns", i);
        return -1;
    }
    const char *idp = PQgetvalue(res, i, OBX_COL_ID);
    row->id = (int64_t)(((uint64_t)be32(idp) << 32) | be32(idp + 4));
    row->topic = PQgetvalue(res, i, OBX_COL_TOPIC);
    row->key = PQgetisnull(res, i, OBX_COL_KEY) ? NULL : PQgetvalue(res, i, OBX_COL_KEY);
    row->key_len = (size_t)PQgetlength(res, i, OBX_COL_KEY);
    row->payload =
        PQgetisnull(res, i, OBX_COL_PAYLOAD) ? NULL : PQgetvalue(res, i, OBX_COL_PAYLOAD);
    row->payload_len = (size_t)PQgetlength(res, i, OBX_COL_PAYLOAD);
    /* A payload column NULL beside a length: too large to fetch. */
    row->oversize = !row->payload && !PQgetisnull(res, i, OBX_COL_PAYLOAD_LEN);
    if (row->oversize) {
        if (PQgetlength(res, i, OBX_COL_PAYLOAD_LEN) != 4) {
            snprintf(err, errlen, "fetch result row %d: payload length is not an int4", i);
            return -1;
        }
        row->payload_len = be32(PQgetvalue(res, i, OBX_COL_PAYLOAD_LEN));
    }
    if (PQgetisnull(res, i, OBX_COL_HDR_KEYS)) {
        row->hdr_keys = row->hdr_values = NULL;
        row->hdr_keys_len = row->hdr_values_len = 0;
    } else {
        row->hdr_keys = PQgetvalue(res, i, OBX_COL_HDR_KEYS);
        row->hdr_keys_len = (size_t)PQgetlength(res, i, OBX_COL_HDR_KEYS);
        row->hdr_values = PQgetvalue(res, i, OBX_COL_HDR_VALUES);
        row->hdr_values_len = (size_t)PQgetlength(res, i, OBX_COL_HDR_VALUES);
    }
    /* timestamptz in binary: microseconds since 2000-01-01 UTC. Only for
     * the latency histogram, so a missing value is just 0. */
    row->created_us = 0;
    if (!PQgetisnull(res, i, OBX_COL_CREATED_AT) && PQgetlength(res, i, OBX_COL_CREATED_AT) == 8) {
        const char *p = PQgetvalue(res, i, OBX_COL_CREATED_AT);
        int64_t pg_us = (int64_t)(((uint64_t)be32(p) << 32) | be32(p + 4));
        row->created_us = pg_us + OBX_PG_EPOCH_US;
    }
    return 0;
}

size_t obx_format_id(int64_t id, char *buf)
{
    int n = snprintf(buf, 21, "%lld", (long long)id);
    return n > 0 ? (size_t)n : 0;
}

int obx_record_headers(const struct obx_row *row, rd_kafka_headers_t **out, char *err,
                       size_t errlen)
{
    struct obx_array_iter keys, values;
    int nkeys = 0, nvalues = 0;
    char idbuf[24];
    size_t idlen = obx_format_id(row->id, idbuf);

    if (row->hdr_keys) {
        nkeys = obx_array_iter_init(&keys, row->hdr_keys, row->hdr_keys_len);
        nvalues = row->hdr_values
                      ? obx_array_iter_init(&values, row->hdr_values, row->hdr_values_len)
                      : -1;
        if (nkeys < 0 || nvalues != nkeys) {
            snprintf(err, errlen, "row %lld: malformed header arrays from the fetch query",
                     (long long)row->id);
            return -1;
        }
    }
    rd_kafka_headers_t *hdrs = rd_kafka_headers_new((size_t)nkeys + 1);
    if (!hdrs) {
        snprintf(err, errlen, "row %lld: out of memory for headers", (long long)row->id);
        return -1;
    }
    rd_kafka_header_add(hdrs, "outbox-id", -1, idbuf, (ssize_t)idlen);
    for (int i = 0; i < nkeys; i++) {
        const char *k, *v;
        size_t klen, vlen;
        if (obx_array_iter_next(&keys, &k, &klen) != 1 ||
            obx_array_iter_next(&values, &v, &vlen) != 1 || !k) {
            rd_kafka_headers_destroy(hdrs);
            snprintf(err, errlen, "row %lld: malformed header element %d", (long long)row->id, i);
            return -1;
        }
        rd_kafka_header_add(hdrs, k, (ssize_t)klen, v, v ? (ssize_t)vlen : 0);
    }
    *out = hdrs;
    return 0;
}
