/*
 * buf: see include/outboxd/buf.h.
 */
#include "outboxd/buf.h"
#include "outboxd/alloc.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Makes room for `extra` more bytes plus a NUL. */
static bool reserve(struct obx_buf *b, size_t extra)
{
    if (b->oom)
        return false;
    if (b->len + extra + 1 <= b->cap)
        return true;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra + 1)
        cap *= 2;
    char *grown = obx_realloc(b->data, cap);
    if (!grown) {
        b->oom = true;
        return false;
    }
    b->data = grown;
    b->cap = cap;
    return true;
}

void obx_buf_append(struct obx_buf *b, const char *s, size_t n)
{
    if (!reserve(b, n))
        return;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = '\0';
}

void obx_buf_puts(struct obx_buf *b, const char *s)
{
    obx_buf_append(b, s, strlen(s));
}

void obx_buf_printf(struct obx_buf *b, const char *fmt, ...)
{
    va_list ap;
    int n;
    if (!reserve(b, 64))
        return;
    va_start(ap, fmt);
    n = vsnprintf(b->data + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->oom = true; /* an encoding error: treat as a failed append */
        return;
    }
    if ((size_t)n >= b->cap - b->len) {
        if (!reserve(b, (size_t)n))
            return;
        va_start(ap, fmt);
        vsnprintf(b->data + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
    }
    b->len += (size_t)n;
}

void obx_buf_reset(struct obx_buf *b)
{
    b->len = 0;
    b->oom = false;
    if (b->data)
        b->data[0] = '\0';
}

void obx_buf_free(struct obx_buf *b)
{
    obx_free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
    b->oom = false;
}
