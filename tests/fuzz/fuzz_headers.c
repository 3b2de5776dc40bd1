/*
 * libFuzzer target: a fetched row's header arrays -> Kafka headers
 * (DESIGN 1.2). The input is split in two at its first byte's value: the
 * keys array and the values array, as the fetch would deliver them. An odd
 * first byte makes the record a CloudEvent (record.format = cloudevents).
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
    size_t split = data[0] < size ? data[0] : size - 1;
    const uint8_t *rest = data + 1;
    size_t rest_len = size - 1;
    if (split > rest_len)
        split = rest_len;
    char *keys = malloc(split ? split : 1), *vals = malloc(rest_len - split ? rest_len - split : 1);
    if (!keys || !vals) {
        free(keys);
        free(vals);
        return 0;
    }
    memcpy(keys, rest, split);
    memcpy(vals, rest + split, rest_len - split);
    struct obx_row row = {.id = 42, .topic = "t", .created_us = 1764589396123456};
    const struct obx_record_opts ce = {.format = OBX_RECORD_CLOUDEVENTS, .ce_source = "/fuzz"};
    const struct obx_record_opts *opts = (data[0] & 1) ? &ce : NULL;
    row.hdr_keys = keys;
    row.hdr_keys_len = split;
    row.hdr_values = vals;
    row.hdr_values_len = rest_len - split;
    rd_kafka_headers_t *hdrs = NULL;
    char err[256];
    if (obx_record_headers(&row, opts, &hdrs, err, sizeof(err)) == 0) {
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
        rd_kafka_headers_destroy(hdrs);
    }
    free(keys);
    free(vals);
    return 0;
}
