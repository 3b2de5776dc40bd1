/*
 * LD_PRELOAD helper for the benchmark: counts malloc/calloc/realloc calls of
 * a process, all threads (librdkafka's included), in a 64-bit counter kept
 * in the file $OBX_MALLOC_COUNT_FILE (mmapped), so the benchmark can read it
 * at any moment.
 */
#include <dlfcn.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

static atomic_ulong early_calls; /* before the file is mapped */
static atomic_ulong *calls = &early_calls;

__attribute__((constructor)) static void map_counter(void)
{
    const char *path = getenv("OBX_MALLOC_COUNT_FILE");
    if (!path)
        return;
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || ftruncate(fd, sizeof(atomic_ulong)) != 0)
        return;
    void *m = mmap(NULL, sizeof(atomic_ulong), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return;
    atomic_store((atomic_ulong *)m, atomic_load(&early_calls));
    calls = m;
}

/* dlsym itself may call calloc: serve that from a static buffer. */
static char bootstrap_buf[4096];
static size_t bootstrap_used;
static void *(*real_malloc)(size_t);
static void *(*real_calloc)(size_t, size_t);
static void *(*real_realloc)(void *, size_t);
static void (*real_free)(void *);

static void resolve(void)
{
    if (real_malloc)
        return;
    real_calloc = (void *(*)(size_t, size_t))dlsym(RTLD_NEXT, "calloc");
    real_realloc = (void *(*)(void *, size_t))dlsym(RTLD_NEXT, "realloc");
    real_free = (void (*)(void *))dlsym(RTLD_NEXT, "free");
    real_malloc = (void *(*)(size_t))dlsym(RTLD_NEXT, "malloc");
}

static int from_bootstrap(void *p)
{
    return (char *)p >= bootstrap_buf && (char *)p < bootstrap_buf + sizeof(bootstrap_buf);
}

void *malloc(size_t n)
{
    resolve();
    atomic_fetch_add_explicit(calls, 1, memory_order_relaxed);
    return real_malloc(n);
}

void *calloc(size_t n, size_t m)
{
    if (!real_calloc) {
        /* Called by dlsym while resolving: hand out zeroed static memory. */
        size_t want = (n * m + 15) & ~(size_t)15;
        if (bootstrap_used + want > sizeof(bootstrap_buf))
            return NULL;
        void *p = bootstrap_buf + bootstrap_used;
        bootstrap_used += want;
        return p;
    }
    atomic_fetch_add_explicit(calls, 1, memory_order_relaxed);
    return real_calloc(n, m);
}

void *realloc(void *p, size_t n)
{
    resolve();
    atomic_fetch_add_explicit(calls, 1, memory_order_relaxed);
    if (from_bootstrap(p)) {
        void *q = real_malloc(n);
        if (q)
            memcpy(q, p, n < sizeof(bootstrap_buf) ? n : sizeof(bootstrap_buf));
        return q;
    }
    return real_realloc(p, n);
}

void free(void *p)
{
    if (!p || from_bootstrap(p))
        return;
    resolve();
    real_free(p);
}
