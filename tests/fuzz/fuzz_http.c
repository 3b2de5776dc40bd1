/*
 * libFuzzer target: the HTTP request-line parser and the http.listen
 * address parser.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "outboxd/http.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char method[16], path[256], err[256];
    /* Not NUL-terminated on purpose: the parser must respect `size`. */
    char *buf = malloc(size ? size : 1);
    if (!buf)
        return 0;
    memcpy(buf, data, size);
    (void)obx_http_parse_request(buf, size, method, sizeof(method), path, sizeof(path));
    free(buf);
    if (size < 128) {
        char spec[129];
        struct sockaddr_storage addr;
        memcpy(spec, data, size);
        spec[size] = '\0';
        (void)obx_http_parse_listen(spec, &addr, err, sizeof(err));
    }
    return 0;
}
