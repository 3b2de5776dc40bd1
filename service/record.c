/*
 * record: see include/outboxd/record.h.
 */
#include "outboxd/record.h"
#include "outboxd/alloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint32_t be32(const char *p)
{
    const unsigned char *u = (const unsigned char *)p;
    return ((uint32_t)u[0] << 24) | ((uint32_t)u[1] << 16) | ((uint32_t)u[2] << 8) | u[3];
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
    row->headers = NULL;
    row->headers_len = 0;
    /* Headers are never NULL in a row: the fetch left them out, and the
     * payload with them, for the row's size. */
    row->oversize = PQgetisnull(res, i, OBX_COL_HEADERS);
    if (!row->oversize) {
        /* jsonb's binary form: a version byte (1), then the text. */
        const char *h = PQgetvalue(res, i, OBX_COL_HEADERS);
        size_t hlen = (size_t)PQgetlength(res, i, OBX_COL_HEADERS);
        if (hlen < 1 || h[0] != 1) {
            snprintf(err, errlen, "fetch result row %d: headers are not jsonb version 1", i);
            return -1;
        }
        row->headers = h + 1;
        row->headers_len = hlen - 1;
    }
    if ((row->oversize && row->payload) || PQgetisnull(res, i, OBX_COL_ROW_BYTES) ||
        PQgetlength(res, i, OBX_COL_ROW_BYTES) != 8) {
        snprintf(err, errlen, "fetch result row %d: no size, or a payload without headers", i);
        return -1;
    }
    const char *size = PQgetvalue(res, i, OBX_COL_ROW_BYTES);
    row->bytes = (size_t)(((uint64_t)be32(size) << 32) | be32(size + 4));
    /* timestamptz in binary: microseconds since 2000-01-01 UTC. Only for
     * the latency histogram, so a missing value is just 0. */
    row->created_us = 0;
    if (!PQgetisnull(res, i, OBX_COL_CREATED_AT) && PQgetlength(res, i, OBX_COL_CREATED_AT) == 8) {
        const char *p = PQgetvalue(res, i, OBX_COL_CREATED_AT);
        int64_t pg_us = (int64_t)(((uint64_t)be32(p) << 32) | be32(p + 4));
        row->created_us = pg_us + OBX_PG_EPOCH_US;
    }
    row->has_slot = !PQgetisnull(res, i, OBX_COL_SLOT);
    row->slot = 0;
    if (row->has_slot) {
        if (PQgetlength(res, i, OBX_COL_SLOT) != 4) {
            snprintf(err, errlen, "fetch result row %d: slot is not an int4", i);
            return -1;
        }
        row->slot = (int32_t)be32(PQgetvalue(res, i, OBX_COL_SLOT));
    }
    return 0;
}

size_t obx_format_id(int64_t id, char *buf)
{
    /* Every row's outbox-id header and every id of a mark go through here:
     * digits by hand, not snprintf's format machinery. */
    char tmp[20];
    size_t n = 0, len = 0;
    uint64_t v = id < 0 ? (uint64_t)0 - (uint64_t)id : (uint64_t)id;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v > 0);
    if (id < 0)
        buf[len++] = '-';
    while (n > 0)
        buf[len++] = tmp[--n];
    buf[len] = '\0';
    return len;
}

bool obx_parse_id(const char *s, size_t len, int64_t *out)
{
    bool neg = len > 0 && s[0] == '-';
    size_t i = neg ? 1 : 0;
    if (i == len || len > 20)
        return false;
    /* Up to 2^63 in magnitude, the most negative id included. */
    uint64_t v = 0, max = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    for (; i < len; i++) {
        if (s[i] < '0' || s[i] > '9')
            return false;
        unsigned d = (unsigned)(s[i] - '0');
        if (v > (max - d) / 10)
            return false;
        v = v * 10 + d;
    }
    if (neg && v > 0)
        *out = v == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)v;
    else
        *out = (int64_t)v;
    return true;
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

/* ---- the headers object ---- */

void obx_headers_free(struct obx_headers *h)
{
    obx_free(h->v);
    obx_free(h->buf);
    memset(h, 0, sizeof(*h));
}

struct json {
    const char *p, *end;
    struct obx_headers *h;
    char *err;
    size_t errlen;
};

static int json_fail(struct json *j, const char *what)
{
    snprintf(j->err, j->errlen, "headers: %s at byte %ld", what, (long)(j->end - j->p));
    return -1;
}

static void skip_ws(struct json *j)
{
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
        j->p++;
}

/* Skips white space; if `c` comes next, takes it and the white space after
 * it. */
static bool json_eat(struct json *j, char c)
{
    skip_ws(j);
    if (j->p >= j->end || *j->p != c)
        return false;
    j->p++;
    skip_ws(j);
    return true;
}

static int reserve(struct json *j, size_t more)
{
    struct obx_headers *h = j->h;
    if (h->buf_used + more <= h->buf_cap)
        return 0;
    /* Spans point into buf: grown only before a parse (see parse_into). */
    return json_fail(j, "out of memory");
}

static int hex4(const char *p, unsigned *out)
{
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        v <<= 4;
        if (c >= '0' && c <= '9')
            v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f')
            v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            v |= (unsigned)(c - 'A' + 10);
        else
            return -1;
    }
    *out = v;
    return 0;
}

/* The escape after a backslash at j->p, as a code point (a surrogate pair
 * joined). -1 after json_fail. */
static int json_escape(struct json *j, unsigned *cp)
{
    if (j->p >= j->end)
        return json_fail(j, "an escape cut short");
    static const char plain[] = "\"\\/bfnrt", meant[] = "\"\\/\b\f\n\r\t";
    char e = *j->p++;
    const char *at = e ? strchr(plain, e) : NULL;
    if (at) {
        *cp = (unsigned char)meant[at - plain];
        return 0;
    }
    if (e != 'u')
        return json_fail(j, "an unknown escape");
    if (j->end - j->p < 4 || hex4(j->p, cp) != 0)
        return json_fail(j, "a bad \\u escape");
    j->p += 4;
    if (*cp >= 0xdc00 && *cp <= 0xdfff)
        return json_fail(j, "a lone surrogate");
    if (*cp >= 0xd800 && *cp <= 0xdbff) { /* a surrogate pair */
        unsigned lo;
        if (j->end - j->p < 6 || j->p[0] != '\\' || j->p[1] != 'u' || hex4(j->p + 2, &lo) != 0 ||
            lo < 0xdc00 || lo > 0xdfff)
            return json_fail(j, "a lone surrogate");
        j->p += 6;
        *cp = 0x10000 + ((*cp - 0xd800) << 10) + (lo - 0xdc00);
    }
    return 0;
}

/* Code point cp as UTF-8 at dst (room for 4 bytes); returns the length. */
static size_t utf8_put(char *dst, unsigned cp)
{
    if (cp < 0x80) {
        dst[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        dst[0] = (char)(0xc0 | (cp >> 6));
        dst[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        dst[0] = (char)(0xe0 | (cp >> 12));
        dst[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        dst[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    dst[0] = (char)(0xf0 | (cp >> 18));
    dst[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    dst[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    dst[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* A string at j->p (its opening quote); its unescaped bytes go to the
 * scratch buffer. */
static int json_string(struct json *j, const char **out, size_t *out_len)
{
    struct obx_headers *h = j->h;
    if (j->p >= j->end || *j->p != '"')
        return json_fail(j, "a string expected");
    j->p++;
    char *dst = h->buf + h->buf_used;
    size_t n = 0;
    while (j->p < j->end && *j->p != '"') {
        unsigned char c = (unsigned char)*j->p++;
        if (c < 0x20)
            return json_fail(j, "a control character in a string");
        if (c != '\\') {
            if (reserve(j, n + 1) != 0)
                return -1;
            dst[n++] = (char)c;
            continue;
        }
        unsigned cp;
        if (json_escape(j, &cp) != 0 || reserve(j, n + 4) != 0)
            return -1;
        n += utf8_put(dst + n, cp);
    }
    if (j->p >= j->end)
        return json_fail(j, "a string not closed");
    j->p++;
    *out = dst;
    *out_len = n;
    h->buf_used += n;
    return 0;
}

/* Any other value: skipped over (strings and nesting respected); its text
 * is the value. */
static int json_skip_value(struct json *j)
{
    if (j->p < j->end && (*j->p == '{' || *j->p == '[')) {
        size_t depth = 0;
        while (j->p < j->end) {
            char c = *j->p++;
            if (c == '"') {
                while (j->p < j->end && *j->p != '"')
                    j->p += (*j->p == '\\' && j->p + 1 < j->end) ? 2 : 1;
                if (j->p >= j->end)
                    return json_fail(j, "a string not closed");
                j->p++;
            } else if (c == '{' || c == '[') {
                depth++;
            } else if ((c == '}' || c == ']') && --depth == 0) {
                return 0;
            }
        }
        return json_fail(j, "an array or object not closed");
    }
    const char *start = j->p; /* a number, true, false or null */
    while (j->p < j->end && ((*j->p >= '0' && *j->p <= '9') || (*j->p >= 'a' && *j->p <= 'z') ||
                             *j->p == '-' || *j->p == '+' || *j->p == '.' || *j->p == 'E'))
        j->p++;
    return j->p > start ? 0 : json_fail(j, "a value expected");
}

static int span_cmp(const void *a, const void *b)
{
    const struct obx_header_span *x = a, *y = b;
    size_t n = x->key_len < y->key_len ? x->key_len : y->key_len;
    int c = memcmp(x->key, y->key, n);
    if (c != 0)
        return c;
    return x->key_len < y->key_len ? -1 : x->key_len > y->key_len;
}

int obx_headers_parse(const char *json, size_t len, struct obx_headers *h, char *err, size_t errlen)
{
    /* Unescaped text is never longer than the JSON, and every member takes
     * at least 6 bytes ("":1,): size both once, so spans stay valid. */
    size_t max_members = len / 4 + 1;
    if (h->buf_cap < len + 1) {
        char *grown = obx_realloc(h->buf, len + 1);
        if (!grown) {
            snprintf(err, errlen, "headers: out of memory");
            return -1;
        }
        h->buf = grown;
        h->buf_cap = len + 1;
    }
    if (h->cap < max_members) {
        struct obx_header_span *grown = obx_realloc(h->v, max_members * sizeof(*grown));
        if (!grown) {
            snprintf(err, errlen, "headers: out of memory");
            return -1;
        }
        h->v = grown;
        h->cap = max_members;
    }
    h->n = 0;
    h->buf_used = 0;
    struct json j = {.p = json, .end = json + len, .h = h, .err = err, .errlen = errlen};
    if (!json_eat(&j, '{'))
        return json_fail(&j, "not an object");
    if (!json_eat(&j, '}')) {
        for (;;) {
            struct obx_header_span *m = &h->v[h->n];
            skip_ws(&j);
            if (h->n == h->cap)
                return json_fail(&j, "too many members");
            if (json_string(&j, &m->key, &m->key_len) != 0)
                return -1;
            if (!json_eat(&j, ':'))
                return json_fail(&j, "':' expected");
            if (j.p < j.end && *j.p == '"') {
                if (json_string(&j, &m->value, &m->value_len) != 0)
                    return -1;
            } else {
                const char *start = j.p;
                if (json_skip_value(&j) != 0)
                    return -1;
                m->value = start;
                m->value_len = (size_t)(j.p - start);
            }
            h->n++;
            if (json_eat(&j, ','))
                continue;
            if (json_eat(&j, '}'))
                break;
            return json_fail(&j, "',' or '}' expected");
        }
    }
    skip_ws(&j);
    if (j.p != j.end)
        return json_fail(&j, "bytes after the object");
    qsort(h->v, h->n, sizeof(*h->v), span_cmp);
    return 0;
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
                       struct obx_headers *scratch, rd_kafka_headers_t **out, char *err,
                       size_t errlen)
{
    char idbuf[24];
    size_t idlen = obx_format_id(row->id, idbuf);
    bool ce = opts && opts->format == OBX_RECORD_CLOUDEVENTS;
    bool own_source = false, own_type = false;
    size_t n = 0;

    if (row->headers_len > 0) {
        char why[160];
        if (obx_headers_parse(row->headers, row->headers_len, scratch, why, sizeof(why)) != 0) {
            snprintf(err, errlen, "row %lld: %s", (long long)row->id, why);
            return -1;
        }
        n = scratch->n;
        for (size_t i = 0; ce && i < n; i++) {
            own_source =
                own_source || name_is(scratch->v[i].key, scratch->v[i].key_len, "ce_source");
            own_type = own_type || name_is(scratch->v[i].key, scratch->v[i].key_len, "ce_type");
        }
    }
    rd_kafka_headers_t *hdrs = rd_kafka_headers_new(n + (ce ? 7 : 2));
    if (!hdrs) {
        snprintf(err, errlen, "row %lld: out of memory for headers", (long long)row->id);
        return -1;
    }
    rd_kafka_header_add(hdrs, "outbox-id", -1, idbuf, (ssize_t)idlen);
    if (opts && opts->history && opts->history[0])
        rd_kafka_header_add(hdrs, "outbox-history", -1, opts->history, -1);
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
    for (size_t i = 0; i < n; i++) {
        const struct obx_header_span *m = &scratch->v[i];
        if (ce && ce_reserved(m->key, m->key_len))
            continue;
        rd_kafka_header_add(hdrs, m->key, (ssize_t)m->key_len, m->value, (ssize_t)m->value_len);
    }
    *out = hdrs;
    return 0;
}
