/*
 * alloc: see include/outboxd/alloc.h.
 */
#include "outboxd/alloc.h"

#include <stdlib.h>
#include <string.h>

static const struct obx_allocator libc_allocator = {malloc, calloc, realloc, free};
static struct obx_allocator current = {malloc, calloc, realloc, free};

void obx_set_allocator(const struct obx_allocator *a)
{
    current = a ? *a : libc_allocator;
}

void *obx_malloc(size_t size)
{
    return current.malloc_fn(size);
}

void *obx_calloc(size_t count, size_t size)
{
    return current.calloc_fn(count, size);
}

void *obx_realloc(void *ptr, size_t size)
{
    return current.realloc_fn(ptr, size);
}

void obx_free(void *ptr)
{
    if (ptr)
        current.free_fn(ptr);
}

char *obx_strndup(const char *s, size_t n)
{
    size_t len = strnlen(s, n);
    char *copy = obx_malloc(len + 1);
    if (copy) {
        memcpy(copy, s, len);
        copy[len] = '\0';
    }
    return copy;
}

char *obx_strdup(const char *s)
{
    return obx_strndup(s, strlen(s));
}
