/*
 * log: see include/outboxd/log.h.
 */
#include "outboxd/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int obx_log_threshold = OBX_LOG_INFO;
static enum obx_log_format log_format = OBX_LOG_TEXT;

static const char *const level_names[] = {"error", "warn", "info", "debug"};

void obx_log_setup(enum obx_log_level level, enum obx_log_format format)
{
    obx_log_threshold = (int)level;
    log_format = format;
}

const char *obx_log_level_name(enum obx_log_level level)
{
    if ((unsigned)level >= sizeof(level_names) / sizeof(level_names[0]))
        return "?";
    return level_names[level];
}

/* Appends `s` to buf[*len..cap) as the inside of a JSON string. Control
 * characters become \u00XX; bytes >= 0x80 pass through (messages are UTF-8 or
 * ASCII from our own code). Truncates silently at the buffer end. */
static void append_json_escaped(char *buf, size_t cap, size_t *len, const char *s)
{
    static const char hex[] = "0123456789abcdef";
    for (; *s && *len + 7 < cap; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            buf[(*len)++] = '\\';
            buf[(*len)++] = (char)c;
        } else if (c == '\n') {
            buf[(*len)++] = '\\';
            buf[(*len)++] = 'n';
        } else if (c < 0x20) {
            memcpy(buf + *len, "\\u00", 4);
            *len += 4;
            buf[(*len)++] = hex[c >> 4];
            buf[(*len)++] = hex[c & 15];
        } else {
            buf[(*len)++] = (char)c;
        }
    }
}

/* Copies s into out (cap bytes) with control characters as \xHH, so that
 * text a log line quotes (a topic, a key, a server message) can never start
 * a forged line of its own. */
static void escape_controls(char *out, size_t cap, const char *s)
{
    static const char hex[] = "0123456789abcdef";
    size_t o = 0;
    for (; *s && o + 5 < cap; s++) {
        unsigned char c = (unsigned char)*s;
        if (c < 0x20 || c == 0x7f) {
            out[o++] = '\\';
            out[o++] = 'x';
            out[o++] = hex[c >> 4];
            out[o++] = hex[c & 15];
        } else {
            out[o++] = (char)c;
        }
    }
    out[o] = '\0';
}

static void log_vwrite(enum obx_log_level level, const char *event, const char *fmt, va_list ap)
    __attribute__((format(printf, 3, 0)));
static void log_vwrite(enum obx_log_level level, const char *event, const char *fmt, va_list ap)
{
    char msg[2048];
    char safe[4096];
    char line[4096 + 64];
    char ts[40];
    struct timespec now;
    struct tm tm;
    size_t len;
    int n;

    n = vsnprintf(msg, sizeof(msg), fmt, ap);
    if (n < 0)
        return;
    /* Strip trailing newlines: libpq error messages end with one. */
    len = strlen(msg);
    while (len > 0 && (msg[len - 1] == '\n' || msg[len - 1] == '\r'))
        msg[--len] = '\0';

    clock_gettime(CLOCK_REALTIME, &now);
    gmtime_r(&now.tv_sec, &tm);
    n = (int)strftime(ts, sizeof(ts), "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(ts + n, sizeof(ts) - (size_t)n, ".%03ldZ", now.tv_nsec / 1000000);

    if (log_format == OBX_LOG_JSON) {
        /* Event names are our own identifiers: nothing in them to escape. */
        len =
            (size_t)snprintf(line, sizeof(line), "{\"ts\":\"%s\",\"level\":\"%s\",%s%s%s\"msg\":\"",
                             ts, obx_log_level_name(level), event ? "\"event\":\"" : "",
                             event ? event : "", event ? "\"," : "");
        append_json_escaped(line, sizeof(line), &len, msg);
        len += (size_t)snprintf(line + len, sizeof(line) - len, "\"}\n");
    } else {
        escape_controls(safe, sizeof(safe), msg);
        n = snprintf(line, sizeof(line), "%s %-5s %s\n", ts, obx_log_level_name(level), safe);
        len = n < (int)sizeof(line) ? (size_t)n : sizeof(line) - 1;
        line[len - 1] = '\n';
    }
    if (len >= sizeof(line))
        len = sizeof(line) - 1;
    /* One write per line; a short write to stderr is not worth retrying. */
    ssize_t w = write(STDERR_FILENO, line, len);
    (void)w;
}

void obx_log_write(enum obx_log_level level, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_vwrite(level, NULL, fmt, ap);
    va_end(ap);
}

void obx_log_event_write(enum obx_log_level level, const char *event, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_vwrite(level, event, fmt, ap);
    va_end(ap);
}

void obx_bug(const char *file, int line, const char *fmt, ...)
{
    char what[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    obx_log_write(OBX_LOG_ERROR, "cannot happen: %s (%s:%d)", what, file, line);
#ifdef OBX_ABORT_ON_BUG
    abort();
#endif
}
