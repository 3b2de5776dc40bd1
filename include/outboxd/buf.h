/*
 * buf: a growable byte buffer for text built in pieces (HTTP responses,
 * /metrics). An allocation failure sets `oom` and later appends do nothing,
 * so callers check once at the end instead of after every append.
 */
#ifndef OUTBOXD_BUF_H
#define OUTBOXD_BUF_H

#include <stdbool.h>
#include <stddef.h>

struct obx_buf {
    char *data; /* NUL-terminated when len > 0 */
    size_t len, cap;
    bool oom;
};

void obx_buf_append(struct obx_buf *b, const char *s, size_t n);
void obx_buf_puts(struct obx_buf *b, const char *s);
void obx_buf_printf(struct obx_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Empties the buffer, keeping its memory. */
void obx_buf_reset(struct obx_buf *b);
void obx_buf_free(struct obx_buf *b);

#endif
