/*
 * libFuzzer target: the OUTBOXD_FAILPOINTS spec parser.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "outboxd/failpoint.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *spec = malloc(size + 1);
    if (!spec)
        return 0;
    memcpy(spec, data, size);
    spec[size] = '\0';
    struct obx_failpoints fps;
    char err[256];
    (void)obx_failpoints_parse(&fps, spec, err, sizeof(err));
    free(spec);
    return 0;
}
