/*
 * libFuzzer target: a row's headers object (jsonb's text) -> Kafka headers
 * (DESIGN 1.2). The first byte picks the record format (odd: CloudEvents);
 * the rest is the JSON text, as the fetch delivers it.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "outboxd/record.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    /* An exact-size copy: a read past the text is caught. */
    char *json = malloc(size - 1 ? size - 1 : 1);
    if (!json)
        return 0;
    memcpy(json, data + 1, size - 1);
    struct obx_row row = {.id = 42, .topic = "t", .created_us = 1764589396123456};
    row.headers = json;
    row.headers_len = size - 1;
    const struct obx_record_opts ce = {.format = OBX_RECORD_CLOUDEVENTS, .ce_source = "/fuzz"};
    const struct obx_record_opts *opts = (data[0] & 1) ? &ce : NULL;
    struct obx_headers scratch = {0};
    rd_kafka_headers_t *hdrs = NULL;
    char err[256];
    if (obx_record_headers(&row, opts, &scratch, &hdrs, err, sizeof(err)) == 0) {
        const void *v;
        size_t vlen;
        /* The relay's own header always comes first. */
        if (rd_kafka_header_get(hdrs, 0, "outbox-id", &v, &vlen) != RD_KAFKA_RESP_ERR_NO_ERROR ||
            vlen != 2 || memcmp(v, "42", 2) != 0)
            abort();
        /* A CloudEvent's id is the outbox id, whatever the row's headers say. */
        if (opts &&
            (rd_kafka_header_get(hdrs, 0, "ce_id", &v, &vlen) != RD_KAFKA_RESP_ERR_NO_ERROR ||
             vlen != 2 || memcmp(v, "42", 2) != 0))
            abort();
        /* Keys come in byte order. */
        for (size_t i = 1; i < scratch.n; i++) {
            const struct obx_header_span *a = &scratch.v[i - 1], *b = &scratch.v[i];
            size_t n = a->key_len < b->key_len ? a->key_len : b->key_len;
            int c = memcmp(a->key, b->key, n);
            if (c > 0 || (c == 0 && a->key_len > b->key_len))
                abort();
        }
        rd_kafka_headers_destroy(hdrs);
    }
    obx_headers_free(&scratch);
    free(json);
    return 0;
}
