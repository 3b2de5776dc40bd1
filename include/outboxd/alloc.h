/*
 * alloc: every heap allocation of outboxd's own goes through here, so that
 * the unit tests can route it to cmocka's checked allocator (leaks, double
 * frees and overruns then fail the test) while the daemon uses libc's.
 * Memory from a client library is still freed with that library's call
 * (PQfreemem, rd_kafka_mem_free...).
 */
#ifndef OUTBOXD_ALLOC_H
#define OUTBOXD_ALLOC_H

#include <stddef.h>

struct obx_allocator {
    void *(*malloc_fn)(size_t size);
    void *(*calloc_fn)(size_t count, size_t size);
    void *(*realloc_fn)(void *ptr, size_t size);
    void (*free_fn)(void *ptr);
};

/* Replaces the allocator; NULL restores libc's. Call before anything is
 * allocated (and free everything before switching back). */
void obx_set_allocator(const struct obx_allocator *a);

void *obx_malloc(size_t size);
void *obx_calloc(size_t count, size_t size);
void *obx_realloc(void *ptr, size_t size);
void obx_free(void *ptr);
char *obx_strdup(const char *s);
char *obx_strndup(const char *s, size_t n);

#endif
