/*
 * libFuzzer target: the configuration parser and validator (file text,
 * then both passes). Any input must give 0 or -1 with a sentence, never a
 * crash, a leak or undefined behaviour.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "outboxd/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    if (!text)
        return 0;
    memcpy(text, data, size);
    text[size] = '\0'; /* the loader reads a C string, as from a file */
    struct obx_config cfg;
    char err[512];
    if (obx_config_init(&cfg) == 0) {
        if (obx_config_load_text(&cfg, text, "fuzz.conf", err, sizeof(err)) == 0)
            (void)obx_config_validate(&cfg, err, sizeof(err));
        obx_config_free(&cfg);
    }
    free(text);
    return 0;
}
