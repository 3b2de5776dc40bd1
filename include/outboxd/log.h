/*
 * log: leveled, single-line logging to stderr, as text or JSON.
 *
 * The level is checked by the macros before any argument is evaluated. Lines
 * are written with one write(2), so lines from librdkafka's threads (which we
 * route to the loop anyway) never interleave mid-line.
 */
#ifndef OUTBOXD_LOG_H
#define OUTBOXD_LOG_H

#include <stddef.h>

enum obx_log_level {
    OBX_LOG_ERROR = 0,
    OBX_LOG_WARN = 1,
    OBX_LOG_INFO = 2,
    OBX_LOG_DEBUG = 3,
};

enum obx_log_format {
    OBX_LOG_TEXT = 0,
    OBX_LOG_JSON = 1,
};

/* Current threshold; read by the macros. Written only at start-up (and by
 * SIGHUP handling on the loop thread later). */
extern int obx_log_threshold;

void obx_log_setup(enum obx_log_level level, enum obx_log_format format);

const char *obx_log_level_name(enum obx_log_level level);

void obx_log_write(enum obx_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#define obx_log(level, ...)                                                                        \
    do {                                                                                           \
        if ((int)(level) <= obx_log_threshold)                                                     \
            obx_log_write((level), __VA_ARGS__);                                                   \
    } while (0)

/* A line that marks an event other programs may wait for: in the JSON
 * format it carries "event":"<event>" (a stable name, unlike the wording
 * of its message); the text format shows the message alone. `event` is a
 * string literal of lower-case letters and '_' (written unescaped). */
void obx_log_event_write(enum obx_log_level level, const char *event, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
#define obx_event(level, event, ...)                                                               \
    do {                                                                                           \
        if ((int)(level) <= obx_log_threshold)                                                     \
            obx_log_event_write((level), (event), __VA_ARGS__);                                    \
    } while (0)

#define obx_error(...) obx_log(OBX_LOG_ERROR, __VA_ARGS__)
#define obx_warn(...)  obx_log(OBX_LOG_WARN, __VA_ARGS__)
#define obx_info(...)  obx_log(OBX_LOG_INFO, __VA_ARGS__)
#define obx_debug(...) obx_log(OBX_LOG_DEBUG, __VA_ARGS__)

/* A state that cannot happen (a bug in outboxd): logged at error level as
 * "cannot happen: ...", which fails every integration test, and abort()s
 * in builds with OBX_ABORT_ON_BUG (Debug and sanitizer builds), so the
 * test that reached it stops right there with a core and a stack. */
void obx_bug(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
#define OBX_BUG(...) obx_bug(__FILE__, __LINE__, __VA_ARGS__)
#define OBX_ASSERT(cond, ...)                                                                      \
    do {                                                                                           \
        if (!(cond))                                                                               \
            obx_bug(__FILE__, __LINE__, __VA_ARGS__);                                              \
    } while (0)

#endif
