/*
 * libFuzzer target: the decoder of Postgres binary arrays (array_send
 * format) that the fetch's header columns arrive in.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "outboxd/record.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *buf = malloc(size ? size : 1); /* exact size: reads past it are caught */
    if (!buf)
        return 0;
    memcpy(buf, data, size);
    struct obx_array_iter it;
    if (obx_array_iter_init(&it, buf, size) >= 0) {
        const char *elem;
        size_t len;
        size_t total = 0;
        while (obx_array_iter_next(&it, &elem, &len) == 1)
            if (elem && len > 0)
                total += (unsigned char)elem[len - 1]; /* touch the last byte */
        if (total == SIZE_MAX) /* never: keeps the reads from being optimised away */
            abort();
    }
    free(buf);
    return 0;
}
