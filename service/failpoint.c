/*
 * failpoint: see include/outboxd/failpoint.h.
 */
#include "outboxd/failpoint.h"
#include "outboxd/log.h"

#include <signal.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

struct obx_failpoints obx_failpoints_active;

static const char *const fp_names[OBX_FP_COUNT] = {
    "fetch.after",           "produce.after",     "ack.after",
    "mark.before_commit",    "mark.after_commit", "recover.after_scan",
    "recover.before_commit", "txn.before_commit", "txn.after_commit",
    "txn.before_fence",
};

const char *obx_failpoint_name(enum obx_fp_id id)
{
    return (unsigned)id < OBX_FP_COUNT ? fp_names[id] : "?";
}

/* Parses digits in [s, end) as a positive integer. */
static int parse_count(const char *s, const char *end, int64_t *out)
{
    int64_t v = 0;
    if (s == end)
        return -1;
    for (; s < end; s++) {
        if (*s < '0' || *s > '9' || v > 1000000000)
            return -1;
        v = v * 10 + (*s - '0');
    }
    *out = v;
    return 0;
}

static int parse_one(struct obx_failpoints *fps, const char *s, const char *end, char *err,
                     size_t errlen)
{
    const char *eq = memchr(s, '=', (size_t)(end - s));
    int id = -1;
    struct obx_fp_entry e = {0};

    if (!eq) {
        snprintf(err, errlen, "OUTBOXD_FAILPOINTS: '%.*s' is not name=action", (int)(end - s), s);
        return -1;
    }
    for (int i = 0; i < OBX_FP_COUNT; i++)
        if (strlen(fp_names[i]) == (size_t)(eq - s) &&
            memcmp(fp_names[i], s, (size_t)(eq - s)) == 0)
            id = i;
    if (id < 0) {
        snprintf(err, errlen, "OUTBOXD_FAILPOINTS: unknown failpoint '%.*s'", (int)(eq - s), s);
        return -1;
    }
    const char *a = eq + 1;
    size_t alen = (size_t)(end - a);
    if (alen == 5 && memcmp(a, "crash", 5) == 0) {
        e.action = OBX_FP_CRASH;
        e.arg = 1;
    } else if (alen > 6 && memcmp(a, "crash@", 6) == 0 && parse_count(a + 6, end, &e.arg) == 0 &&
               e.arg > 0) {
        e.action = OBX_FP_CRASH;
    } else if (alen == 5 && memcmp(a, "error", 5) == 0) {
        e.action = OBX_FP_ERROR; /* arg 0: every hit */
    } else if (alen > 6 && memcmp(a, "error@", 6) == 0 && parse_count(a + 6, end, &e.arg) == 0 &&
               e.arg > 0) {
        e.action = OBX_FP_ERROR;
    } else if (alen > 7 && memcmp(a, "sleep(", 6) == 0 && end[-1] == ')' &&
               parse_count(a + 6, end - 1, &e.arg) == 0) {
        e.action = OBX_FP_SLEEP;
    } else {
        snprintf(err, errlen,
                 "OUTBOXD_FAILPOINTS: bad action '%.*s' for %s (crash, crash@N, error, error@N, "
                 "sleep(MS))",
                 (int)alen, a, fp_names[id]);
        return -1;
    }
    fps->entry[id] = e;
    fps->armed = 1;
    return 0;
}

int obx_failpoints_parse(struct obx_failpoints *fps, const char *spec, char *err, size_t errlen)
{
    memset(fps, 0, sizeof(*fps));
    if (!spec)
        return 0;
    for (const char *s = spec; *s;) {
        const char *end = strchr(s, ';');
        if (!end)
            end = s + strlen(s);
        if (end > s && parse_one(fps, s, end, err, errlen) != 0) {
            memset(fps, 0, sizeof(*fps));
            return -1;
        }
        s = *end ? end + 1 : end;
    }
    return 0;
}

int obx_failpoint_reach(struct obx_failpoints *fps, enum obx_fp_id id)
{
    struct obx_fp_entry *e = &fps->entry[id];
    e->hits++;
    switch (e->action) {
    case OBX_FP_CRASH:
        if (e->hits == e->arg) {
            obx_event(OBX_LOG_WARN, "failpoint", "failpoint %s: crash (hit %lld)", fp_names[id],
                      (long long)e->hits);
            raise(SIGKILL);
        }
        return 0;
    case OBX_FP_ERROR:
        if (e->arg != 0 && e->hits != e->arg)
            return 0;
        obx_event(OBX_LOG_WARN, "failpoint", "failpoint %s: injected error (hit %lld)",
                  fp_names[id], (long long)e->hits);
        return -1;
    case OBX_FP_SLEEP: {
        struct timespec ts = {e->arg / 1000, (long)(e->arg % 1000) * 1000000L};
        while (nanosleep(&ts, &ts) != 0) {
        }
        return 0;
    }
    case OBX_FP_OFF:
        break;
    }
    return 0;
}
