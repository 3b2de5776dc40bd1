/*
 * record: see include/outboxd/record.h.
 */
#include "outboxd/record.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

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

size_t obx_format_rfc3339(int64_t unix_us, char *buf, size_t len)
{
    time_t secs = (time_t)(unix_us / 1000000);
    long micros = (long)(unix_us % 1000000);
    if (micros < 0) {
        micros += 1000000;
        secs--;
    }
    struct tm tm;
    if (!gmtime_r(&secs, &tm)) {
        buf[0] = '\0';
        return 0;
    }
    int n = snprintf(buf, len, "%04d-%02d-%02dT%02d:%02d:%02d.%06ldZ", tm.tm_year + 1900,
                     tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, micros);
    return n > 0 && (size_t)n < len ? (size_t)n : 0;
}

static bool name_is(const char *k, size_t klen, const char *name)
{
    return klen == strlen(name) && memcmp(k, name, klen) == 0;
}

/* CloudEvents headers set by us whatever the row says. */
static bool ce_reserved(const char *k, size_t klen)
{
    return name_is(k, klen, "ce_specversion") || name_is(k, klen, "ce_id") ||
           name_is(k, klen, "ce_time");
}

int obx_record_headers(const struct obx_row *row, const struct obx_record_opts *opts,
                       rd_kafka_headers_t **out, char *err, size_t errlen)
{
    struct obx_array_iter keys, values;
    int nkeys = 0, nvalues = 0;
    char idbuf[24];
    size_t idlen = obx_format_id(row->id, idbuf);
    bool ce = opts && opts->format == OBX_RECORD_CLOUDEVENTS;
    bool own_source = false, own_type = false;

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
        if (ce) { /* a first pass: does the row name its own source and type? */
            struct obx_array_iter scan = keys;
            const char *k;
            size_t klen;
            while (obx_array_iter_next(&scan, &k, &klen) == 1) {
                own_source = own_source || (k && name_is(k, klen, "ce_source"));
                own_type = own_type || (k && name_is(k, klen, "ce_type"));
            }
        }
    }
    rd_kafka_headers_t *hdrs = rd_kafka_headers_new((size_t)nkeys + (ce ? 6 : 1));
    if (!hdrs) {
        snprintf(err, errlen, "row %lld: out of memory for headers", (long long)row->id);
        return -1;
    }
    rd_kafka_header_add(hdrs, "outbox-id", -1, idbuf, (ssize_t)idlen);
    if (ce) {
        rd_kafka_header_add(hdrs, "ce_specversion", -1, "1.0", 3);
        rd_kafka_header_add(hdrs, "ce_id", -1, idbuf, (ssize_t)idlen);
        if (!own_source)
            rd_kafka_header_add(hdrs, "ce_source", -1, opts->ce_source ? opts->ce_source : "", -1);
        if (!own_type)
            rd_kafka_header_add(hdrs, "ce_type", -1, row->topic, -1);
        char when[40];
        size_t wlen =
            row->created_us > 0 ? obx_format_rfc3339(row->created_us, when, sizeof(when)) : 0;
        if (wlen > 0)
            rd_kafka_header_add(hdrs, "ce_time", -1, when, (ssize_t)wlen);
    }
    for (int i = 0; i < nkeys; i++) {
        const char *k, *v;
        size_t klen, vlen;
        if (obx_array_iter_next(&keys, &k, &klen) != 1 ||
            obx_array_iter_next(&values, &v, &vlen) != 1 || !k) {
            rd_kafka_headers_destroy(hdrs);
            snprintf(err, errlen, "row %lld: malformed header element %d", (long long)row->id, i);
            return -1;
        }
        if (ce && ce_reserved(k, klen))
            continue;
        rd_kafka_header_add(hdrs, k, (ssize_t)klen, v, v ? (ssize_t)vlen : 0);
    }
    *out = hdrs;
    return 0;
}
