/*
 * tools: see include/outboxd/tools.h.
 */
#include "outboxd/tools.h"
#include "outboxd/pgconn.h"
#include "outboxd/alloc.h"
#include "outboxd/http.h"
#include "outboxd/log.h"
#include "outboxd/store.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <libpq-fe.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define EXIT_UNHEALTHY 1
#define EXIT_USAGE     2
/* Older than this, the oldest unsent row makes the status "not healthy". */
#define STATUS_MAX_LAG_S 300

bool obx_tool_is(const char *name)
{
    return strcmp(name, "status") == 0 || strcmp(name, "dead") == 0 || strcmp(name, "replay") == 0;
}

static int usage_error(const char *tool, const char *what)
{
    fprintf(stderr, "outboxd %s: %s (see outboxd --help)\n", tool, what);
    return EXIT_USAGE;
}

/* A positive decimal id, ASCII digits only. */
static int parse_id(const char *s, int64_t *out)
{
    int64_t v = 0;
    if (!*s)
        return -1;
    for (; *s; s++) {
        if (*s < '0' || *s > '9' || v > (INT64_MAX - (*s - '0')) / 10)
            return -1;
        v = v * 10 + (*s - '0');
    }
    if (v <= 0)
        return -1;
    *out = v;
    return 0;
}

/* The words after the options, as each tool takes them. */
static int check_words(const struct obx_tool_args *t)
{
    if (strcmp(t->tool, "status") == 0 && t->n_words > 0)
        return usage_error(t->tool, "takes no arguments");
    if (strcmp(t->tool, "dead") == 0) {
        if (t->n_words < 1 ||
            (strcmp(t->words[0], "list") != 0 && strcmp(t->words[0], "retry") != 0 &&
             strcmp(t->words[0], "drop") != 0))
            return usage_error(t->tool, "say list, retry ID... or drop ID...");
        if (strcmp(t->words[0], "list") == 0 && t->n_words > 1)
            return usage_error(t->tool, "list takes no ids");
        if (strcmp(t->words[0], "list") != 0 && t->n_words < 2)
            return usage_error(t->tool, "name the dead letters' ids");
        for (int i = 1; i < t->n_words; i++) {
            int64_t id;
            if (parse_id(t->words[i], &id) != 0) {
                char what[160];
                snprintf(what, sizeof(what), "'%.60s' is not a row id", t->words[i]);
                return usage_error(t->tool, what);
            }
        }
    }
    if (strcmp(t->tool, "replay") == 0) {
        if (t->n_words > 0)
            return usage_error(t->tool, "takes options only");
        if (!t->topic || !t->topic[0])
            return usage_error(t->tool, "--topic is required");
        if (!t->from_id == !t->since)
            return usage_error(t->tool, "give --from-id N [--to-id M] or --since TIME");
        if (t->to_id && !t->from_id)
            return usage_error(t->tool, "--to-id goes with --from-id");
        if (t->to_id && t->to_id < t->from_id)
            return usage_error(t->tool, "--to-id is below --from-id");
        if (t->since) {
            /* Handed to Postgres as timestamptz: ISO 8601 characters only. */
            for (const char *p = t->since; *p; p++)
                if (!((*p >= '0' && *p <= '9') || strchr("-:T .Z+", *p)))
                    return usage_error(t->tool, "--since takes an ISO 8601 time, e.g. "
                                                "2026-12-01T10:00:00Z");
            if (strlen(t->since) < 10)
                return usage_error(t->tool, "--since takes an ISO 8601 time, e.g. "
                                            "2026-12-01T10:00:00Z");
        }
    }
    return 0;
}

int obx_tool_parse(int argc, char **argv, struct obx_tool_args *t)
{
    static const struct option longopts[] = {
        {"config", required_argument, NULL, 'c'},  {"json", no_argument, NULL, 'j'},
        {"yes", no_argument, NULL, 'y'},           {"topic", required_argument, NULL, 't'},
        {"from-id", required_argument, NULL, 'f'}, {"to-id", required_argument, NULL, 'T'},
        {"since", required_argument, NULL, 's'},   {NULL, 0, NULL, 0},
    };
    memset(t, 0, sizeof(*t));
    t->tool = argv[0];
    t->xargs = obx_calloc((size_t)argc + 1, sizeof(char *));
    if (!t->xargs) {
        fprintf(stderr, "outboxd: out of memory\n");
        return 1;
    }
    optind = 1;
    int opt;
    while ((opt = getopt_long(argc, argv, "c:X:", longopts, NULL)) != -1) {
        bool status_ok = opt == 'c' || opt == 'X' || opt == 'j';
        bool replay_ok = opt == 'c' || opt == 'X' || opt == 'y' || opt == 't' || opt == 'f' ||
                         opt == 'T' || opt == 's';
        bool dead_ok = opt == 'c' || opt == 'X' || opt == 'j';
        if (opt == '?')
            return usage_error(t->tool, "bad option");
        if ((strcmp(t->tool, "status") == 0 && !status_ok) ||
            (strcmp(t->tool, "replay") == 0 && !replay_ok) ||
            (strcmp(t->tool, "dead") == 0 && !dead_ok))
            return usage_error(t->tool, "option not known to this command");
        switch (opt) {
        case 'c':
            t->config_path = optarg;
            break;
        case 'X':
            t->xargs[t->n_xargs++] = optarg;
            break;
        case 'j':
            t->json = true;
            break;
        case 'y':
            t->yes = true;
            break;
        case 't':
            t->topic = optarg;
            break;
        case 'f':
            if (parse_id(optarg, &t->from_id) != 0)
                return usage_error(t->tool, "--from-id takes a positive row id");
            break;
        case 'T':
            if (parse_id(optarg, &t->to_id) != 0)
                return usage_error(t->tool, "--to-id takes a positive row id");
            break;
        case 's':
            t->since = optarg;
            break;
        }
    }
    t->words = argv + optind;
    t->n_words = argc - optind;
    return check_words(t);
}

void obx_tool_args_free(struct obx_tool_args *t)
{
    obx_free(t->xargs);
    t->xargs = NULL;
}

/* ---- helpers ---- */

static PGconn *tool_connect(const struct obx_config *cfg, const char *tool)
{
    char app[64];
    snprintf(app, sizeof(app), "outboxd-%s", tool);
    PGconn *c = obx_pg_connect(cfg->pg_conninfo, app, 0);
    if (!c || PQstatus(c) != CONNECTION_OK) {
        char msg[300];
        snprintf(msg, sizeof(msg), "%s", c ? PQerrorMessage(c) : "out of memory");
        msg[strcspn(msg, "\n")] = '\0';
        fprintf(stderr, "outboxd %s: cannot connect to Postgres: %s\n", tool, msg);
        PQfinish(c);
        return NULL;
    }
    return c;
}

/* Runs `sql`; on failure prints the server's first line and returns NULL. */
static PGresult *run(PGconn *c, const char *tool, const char *sql, int n, const char *const *v,
                     ExecStatusType want)
{
    PGresult *r = PQexecParams(c, sql, n, NULL, v, NULL, NULL, 0);
    if (PQresultStatus(r) != want) {
        char msg[300];
        snprintf(msg, sizeof(msg), "%s", PQresultErrorMessage(r));
        msg[strcspn(msg, "\n")] = '\0';
        fprintf(stderr, "outboxd %s: %s\n", tool, msg);
        PQclear(r);
        return NULL;
    }
    return r;
}

/* "{1,2,3}" from the ids in words[1..n). */
static char *id_array(char **words, int n)
{
    size_t len = 3;
    for (int i = 1; i < n; i++)
        len += strlen(words[i]) + 1;
    char *a = obx_malloc(len);
    if (!a)
        return NULL;
    size_t o = 0;
    a[o++] = '{';
    for (int i = 1; i < n; i++)
        o += (size_t)snprintf(a + o, len - o, "%s%s", i > 1 ? "," : "", words[i]);
    a[o++] = '}';
    a[o] = '\0';
    return a;
}

static void human_age(int64_t s, char *buf, size_t len)
{
    if (s < 120)
        snprintf(buf, len, "%llds", (long long)s);
    else if (s < 7200)
        snprintf(buf, len, "%lldm", (long long)(s / 60));
    else if (s < 172800)
        snprintf(buf, len, "%lldh%02lldm", (long long)(s / 3600), (long long)(s % 3600 / 60));
    else
        snprintf(buf, len, "%lldd", (long long)(s / 86400));
}

/* A JSON string (ASCII control characters and non-ASCII escaped). */
static void json_str(FILE *out, const char *s)
{
    fputc('"', out);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(out, "\\%c", *p);
        else if (*p < 0x20 || *p >= 0x7f)
            fprintf(out, "\\u%04x", *p);
        else
            fputc(*p, out);
    }
    fputc('"', out);
}

/* ---- status ---- */

/* What the relay's own /metrics says (when http.listen answers). */
struct relay_view {
    bool reachable;
    double keys_held_back, last_progress, ready, stalled, in_flight;
};

static double metric(const char *body, const char *name, double fallback)
{
    size_t n = strlen(name);
    for (const char *p = body; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
        if (strncmp(p, name, n) == 0 && p[n] == ' ')
            return strtod(p + n + 1, NULL);
    return fallback;
}

static void read_relay_view(const struct obx_config *cfg, struct relay_view *v)
{
    struct sockaddr_storage addr;
    char err[200];
    memset(v, 0, sizeof(*v));
    if (!cfg->http_listen || !cfg->http_listen[0] ||
        obx_http_parse_listen(cfg->http_listen, &addr, err, sizeof(err)) != 0)
        return;
    if (addr.ss_family == AF_INET) { /* a wildcard bind answers on loopback */
        struct sockaddr_in *in = (struct sockaddr_in *)&addr;
        if (in->sin_addr.s_addr == htonl(INADDR_ANY))
            in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    }
    int fd = socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return;
    socklen_t alen =
        addr.ss_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
    struct pollfd pfd = {.fd = fd, .events = POLLOUT};
    if ((connect(fd, (struct sockaddr *)&addr, alen) != 0 && errno != EINPROGRESS) ||
        poll(&pfd, 1, 1000) != 1) {
        close(fd);
        return;
    }
    static const char req[] = "GET /metrics HTTP/1.0\r\nHost: outboxd\r\n\r\n";
    if (write(fd, req, sizeof(req) - 1) != (ssize_t)(sizeof(req) - 1)) {
        close(fd);
        return;
    }
    static char body[1 << 18];
    size_t used = 0;
    pfd.events = POLLIN;
    while (used + 1 < sizeof(body) && poll(&pfd, 1, 1000) == 1) {
        ssize_t r = read(fd, body + used, sizeof(body) - 1 - used);
        if (r <= 0)
            break;
        used += (size_t)r;
    }
    close(fd);
    body[used] = '\0';
    if (!strstr(body, "outboxd_ready"))
        return;
    v->reachable = true;
    v->keys_held_back = metric(body, "outboxd_keys_held_back", 0);
    v->last_progress = metric(body, "outboxd_last_progress_timestamp_seconds", 0);
    v->ready = metric(body, "outboxd_ready", 0);
    v->stalled = metric(body, "outboxd_stalled", 0);
    v->in_flight = metric(body, "outboxd_rows_in_flight", 0);
}

/* What `outboxd status` reads from Postgres, and what is wrong. */
struct status_data {
    PGresult *sessions, *backlog, *topics, *dead, *xmin, *slot, *tuples;
    PGresult *by_slot; /* relay.shards above 1: unsent rows by slot; else NULL */
    struct relay_view rv;
    long long unsent, n_dead;
    double lag;
    char problems[4][120];
    int n_problems;
};

static bool status_read(PGconn *c, const struct obx_tool_args *t, const struct obx_config *cfg,
                        struct status_data *d)
{
    d->sessions = run(c, t->tool, obx_store_sql_relay_sessions(), 0, NULL, PGRES_TUPLES_OK);
    d->backlog = run(c, t->tool, obx_store_sql_backlog(), 0, NULL, PGRES_TUPLES_OK);
    d->topics = run(c, t->tool, obx_store_sql_waiting(), 0, NULL, PGRES_TUPLES_OK);
    d->dead = run(c, t->tool, obx_store_sql_dead_summary(), 0, NULL, PGRES_TUPLES_OK);
    d->xmin = run(c, t->tool, obx_store_sql_oldest_xmin(), 0, NULL, PGRES_TUPLES_OK);
    d->slot = run(c, t->tool, obx_store_sql_oldest_slot(), 0, NULL, PGRES_TUPLES_OK);
    d->tuples = run(c, t->tool, obx_store_sql_events_tuples(), 0, NULL, PGRES_TUPLES_OK);
    if (!d->sessions || !d->backlog || !d->topics || !d->dead || !d->xmin || !d->slot || !d->tuples)
        return false;
    if (cfg->shards > 1) {
        char shards[16];
        snprintf(shards, sizeof(shards), "%d", cfg->shards);
        const char *v[] = {shards};
        d->by_slot = run(c, t->tool, obx_store_sql_waiting_by_slot(), 1, v, PGRES_TUPLES_OK);
        if (!d->by_slot)
            return false;
    }
    read_relay_view(cfg, &d->rv);
    d->unsent = strtoll(obx_store_col(d->backlog, 0, "rows"), NULL, 10);
    d->lag = strtod(obx_store_col(d->backlog, 0, "oldest_seconds"), NULL);
    d->n_dead = strtoll(obx_store_col(d->dead, 0, "rows"), NULL, 10);
    int n_active = 0;
    for (int i = 0; i < PQntuples(d->sessions); i++)
        n_active += obx_store_col_true(d->sessions, i, "active");
    size_t len = sizeof(d->problems[0]);
    if (n_active == 0)
        snprintf(d->problems[d->n_problems++], len, "no outboxd holds the relay lock");
    if (d->lag > STATUS_MAX_LAG_S)
        snprintf(d->problems[d->n_problems++], len, "the oldest unsent row waits for %.0fs",
                 d->lag);
    if (d->rv.reachable && d->rv.stalled > 0)
        snprintf(d->problems[d->n_problems++], len, "the relay reports a stall");
    if (d->rv.reachable && d->rv.ready == 0)
        snprintf(d->problems[d->n_problems++], len, "the relay is not ready");
    return true;
}

static void status_free(struct status_data *d)
{
    PQclear(d->sessions);
    PQclear(d->backlog);
    PQclear(d->topics);
    PQclear(d->dead);
    PQclear(d->xmin);
    PQclear(d->slot);
    PQclear(d->tuples);
    PQclear(d->by_slot);
}

/* The part of `status --json` that Postgres's own views say. */
static void status_json_horizon(FILE *o, const struct status_data *d)
{
    if (PQntuples(d->xmin) == 1) {
        fprintf(o, ",\"oldest_xmin\":{\"pid\":%s,\"age\":%s,\"application_name\":",
                obx_store_col(d->xmin, 0, "pid"), obx_store_col(d->xmin, 0, "xmin_age"));
        json_str(o, obx_store_col(d->xmin, 0, "application_name"));
        fputs(",\"state\":", o);
        json_str(o, obx_store_col(d->xmin, 0, "state"));
        fprintf(o, ",\"transaction_seconds\":%s,\"query\":",
                obx_store_col(d->xmin, 0, "transaction_seconds"));
        json_str(o, obx_store_col(d->xmin, 0, "query"));
        fputc('}', o);
    } else {
        fputs(",\"oldest_xmin\":null", o);
    }
    if (PQntuples(d->slot) == 1) {
        fputs(",\"oldest_slot\":{\"name\":", o);
        json_str(o, obx_store_col(d->slot, 0, "slot_name"));
        fprintf(o, ",\"age\":%s}", obx_store_col(d->slot, 0, "xmin_age"));
    } else {
        fputs(",\"oldest_slot\":null", o);
    }
    if (PQntuples(d->tuples) == 1)
        fprintf(o, ",\"events_live_tuples\":%s,\"events_dead_tuples\":%s,\"last_vacuum\":\"%s\"",
                obx_store_col(d->tuples, 0, "live"), obx_store_col(d->tuples, 0, "dead"),
                obx_store_col(d->tuples, 0, "last_vacuum"));
}

static void status_json(FILE *o, const struct status_data *d)
{
    fprintf(o, "{\"healthy\":%s,\"problems\":[", d->n_problems ? "false" : "true");
    for (int i = 0; i < d->n_problems; i++) {
        fputs(i ? "," : "", o);
        json_str(o, d->problems[i]);
    }
    fputs("],\"relays\":[", o);
    for (int i = 0; i < PQntuples(d->sessions); i++) {
        fprintf(o, "%s{\"pid\":%s,\"application_name\":", i ? "," : "",
                obx_store_col(d->sessions, i, "pid"));
        json_str(o, obx_store_col(d->sessions, i, "application_name"));
        fputs(",\"client\":", o);
        json_str(o, obx_store_col(d->sessions, i, "client"));
        fprintf(o, ",\"session_start\":\"%s\",\"active\":%s,\"slots\":[%s]}",
                obx_store_col(d->sessions, i, "started"),
                obx_store_col_true(d->sessions, i, "active") ? "true" : "false",
                obx_store_col(d->sessions, i, "slots"));
    }
    fprintf(o, "],\"unsent_rows\":%lld,\"oldest_unsent_seconds\":%.3f,\"unsent_by_topic\":{",
            d->unsent, d->lag);
    for (int i = 0; i < PQntuples(d->topics); i++) {
        fputs(i ? "," : "", o);
        json_str(o, obx_store_col(d->topics, i, "topic"));
        fprintf(o, ":%s", obx_store_col(d->topics, i, "rows"));
    }
    fputc('}', o);
    if (d->by_slot) {
        fputs(",\"unsent_by_slot\":{", o);
        for (int i = 0; i < PQntuples(d->by_slot); i++)
            fprintf(o, "%s\"%s\":{\"rows\":%s,\"oldest_seconds\":%s}", i ? "," : "",
                    obx_store_col(d->by_slot, i, "slot"), obx_store_col(d->by_slot, i, "rows"),
                    obx_store_col(d->by_slot, i, "oldest_seconds"));
        fputc('}', o);
    }
    fprintf(o, ",\"dead_letters\":%lld", d->n_dead);
    const struct relay_view *rv = &d->rv;
    if (rv->reachable)
        fprintf(o,
                ",\"relay_metrics\":{\"keys_held_back\":%.0f,\"rows_in_flight\":%.0f,"
                "\"last_progress_unix\":%.3f,\"ready\":%s,\"stalled\":%s}",
                rv->keys_held_back, rv->in_flight, rv->last_progress,
                rv->ready > 0 ? "true" : "false", rv->stalled > 0 ? "true" : "false");
    else
        fputs(",\"relay_metrics\":null", o);
    status_json_horizon(o, d);
    fputs("}\n", o);
}

/* The relays connected, the rows waiting and the dead letters, as text. */
static void status_text_rows(const struct status_data *d)
{
    char age[32];
    printf("relays:\n");
    if (PQntuples(d->sessions) == 0)
        printf("  none connected\n");
    for (int i = 0; i < PQntuples(d->sessions); i++) {
        const char *name = obx_store_col(d->sessions, i, "application_name");
        human_age(strtoll(obx_store_col(d->sessions, i, "session_seconds"), NULL, 10), age,
                  sizeof(age));
        const char *slots = obx_store_col(d->sessions, i, "slots");
        printf("  %-7s %s from %s, pid %s, session since %s (%s)%s%s\n",
               obx_store_col_true(d->sessions, i, "active") ? "active" : "standby",
               name[0] ? name : "(no name)", obx_store_col(d->sessions, i, "client"),
               obx_store_col(d->sessions, i, "pid"), obx_store_col(d->sessions, i, "started"), age,
               slots[0] ? ", slots " : "", slots);
    }
    human_age((int64_t)d->lag, age, sizeof(age));
    printf("unsent:   %lld rows%s%s\n", d->unsent, d->unsent ? ", oldest waiting " : "",
           d->unsent ? age : "");
    for (int i = 0; i < PQntuples(d->topics) && i < 10; i++)
        printf("  %-30s %s\n", obx_store_col(d->topics, i, "topic"),
               obx_store_col(d->topics, i, "rows"));
    if (PQntuples(d->topics) > 10)
        printf("  (%d more topics)\n", PQntuples(d->topics) - 10);
    for (int i = 0; d->by_slot && i < PQntuples(d->by_slot) && i < 16; i++) {
        human_age(strtoll(obx_store_col(d->by_slot, i, "oldest_seconds"), NULL, 10), age,
                  sizeof(age));
        printf("  slot %-4s %s rows, oldest waiting %s\n", obx_store_col(d->by_slot, i, "slot"),
               obx_store_col(d->by_slot, i, "rows"), age);
    }
    if (d->by_slot && PQntuples(d->by_slot) > 16)
        printf("  (%d more slots with unsent rows; --json lists them all)\n",
               PQntuples(d->by_slot) - 16);
    human_age(strtoll(obx_store_col(d->dead, 0, "newest_seconds"), NULL, 10), age, sizeof(age));
    printf("dead letters: %lld%s%s%s\n", d->n_dead, d->n_dead ? " (newest " : "",
           d->n_dead ? age : "", d->n_dead ? " ago; outboxd dead list)" : "");
}

/* What the relay's /metrics and Postgres's views say, as text. */
static void status_text_health(const struct obx_config *cfg, const struct status_data *d)
{
    char age[32];
    const struct relay_view *rv = &d->rv;
    if (rv->reachable) {
        char since[32] = "never";
        if (rv->last_progress > 0)
            human_age((int64_t)((double)time(NULL) - rv->last_progress), since, sizeof(since));
        printf("relay (%s): %s%s, %.0f rows in flight, %.0f keys held back, last progress %s%s\n",
               cfg->http_listen, rv->ready > 0 ? "ready" : "not ready",
               rv->stalled > 0 ? ", STALLED" : "", rv->in_flight, rv->keys_held_back, since,
               rv->last_progress > 0 ? " ago" : "");
    } else {
        printf("relay: its /metrics at %s does not answer from here (keys held back and the last "
               "progress unknown)\n",
               cfg->http_listen && cfg->http_listen[0] ? cfg->http_listen : "(http.listen off)");
    }
    if (PQntuples(d->xmin) == 1) {
        const char *app = obx_store_col(d->xmin, 0, "application_name");
        human_age(strtoll(obx_store_col(d->xmin, 0, "transaction_seconds"), NULL, 10), age,
                  sizeof(age));
        printf("xmin horizon: held by pid %s (%s, %s, transaction open %s, xmin age %s): %s\n",
               obx_store_col(d->xmin, 0, "pid"), app[0] ? app : "no application name",
               obx_store_col(d->xmin, 0, "state"), age, obx_store_col(d->xmin, 0, "xmin_age"),
               obx_store_col(d->xmin, 0, "query"));
    } else {
        printf("xmin horizon: no session holds a snapshot\n");
    }
    if (PQntuples(d->slot) == 1)
        printf("replication slot holding the horizon: %s (age %s)\n",
               obx_store_col(d->slot, 0, "slot_name"), obx_store_col(d->slot, 0, "xmin_age"));
    if (PQntuples(d->tuples) == 1)
        printf("outbox.events: %s live tuples, %s dead, last vacuum %s\n",
               obx_store_col(d->tuples, 0, "live"), obx_store_col(d->tuples, 0, "dead"),
               obx_store_col(d->tuples, 0, "last_vacuum"));
}

static int status(const struct obx_tool_args *t, const struct obx_config *cfg)
{
    PGconn *c = tool_connect(cfg, t->tool);
    if (!c)
        return EXIT_UNHEALTHY;
    struct status_data d = {0};
    int rc = EXIT_UNHEALTHY;
    if (status_read(c, t, cfg, &d)) {
        rc = d.n_problems ? EXIT_UNHEALTHY : 0;
        if (t->json) {
            status_json(stdout, &d);
        } else {
            printf("outboxd status: %s\n", rc ? "NOT HEALTHY" : "healthy");
            for (int i = 0; i < d.n_problems; i++)
                printf("  problem: %s\n", d.problems[i]);
            status_text_rows(&d);
            status_text_health(cfg, &d);
        }
    }
    status_free(&d);
    PQfinish(c);
    return rc;
}

/* ---- dead letters ---- */

static int dead_list(PGconn *c, const struct obx_tool_args *t)
{
    const char *const limit[OBX_DEAD_TOOL_NPARAMS] = {[OBX_DEAD_TOOL_ARG] = "1000"};
    PGresult *r =
        run(c, t->tool, obx_store_sql_dead_list(), OBX_DEAD_TOOL_NPARAMS, limit, PGRES_TUPLES_OK);
    if (!r)
        return 1;
    if (t->json)
        fputs("[", stdout);
    else if (PQntuples(r) == 0)
        printf("no dead letters\n");
    else
        printf("%-12s %-24s %-16s %8s %7s  %s\n", "id", "topic", "key", "bytes", "age", "reason");
    for (int i = 0; i < PQntuples(r); i++) {
        char age[32];
        human_age(strtoll(obx_store_col(r, i, "age_seconds"), NULL, 10), age, sizeof(age));
        bool no_key = obx_store_col_true(r, i, "no_key");
        if (t->json) {
            printf("%s{\"id\":%s,\"topic\":", i ? "," : "", obx_store_col(r, i, "id"));
            json_str(stdout, obx_store_col(r, i, "topic"));
            fputs(",\"key\":", stdout);
            if (no_key)
                fputs("null", stdout);
            else
                json_str(stdout, obx_store_col(r, i, "key"));
            fputs(",\"reason\":", stdout);
            json_str(stdout, obx_store_col(r, i, "reason"));
            printf(",\"age_seconds\":%s,\"bytes\":%s}", obx_store_col(r, i, "age_seconds"),
                   obx_store_col(r, i, "bytes"));
        } else {
            printf("%-12s %-24s %-16s %8s %7s  %s\n", obx_store_col(r, i, "id"),
                   obx_store_col(r, i, "topic"), no_key ? "(none)" : obx_store_col(r, i, "key"),
                   obx_store_col(r, i, "bytes"), age, obx_store_col(r, i, "reason"));
        }
    }
    if (t->json)
        fputs("]\n", stdout);
    PQclear(r);
    return 0;
}

/* retry or drop: every id must be a dead letter, or nothing happens. */
static int dead_act(PGconn *c, const struct obx_tool_args *t, bool retry)
{
    char *ids = id_array(t->words, t->n_words);
    if (!ids) {
        fprintf(stderr, "outboxd dead: out of memory\n");
        return 1;
    }
    const char *const v[OBX_DEAD_TOOL_NPARAMS] = {[OBX_DEAD_TOOL_ARG] = ids};
    int rc = 1;
    PGresult *r = NULL;
    PGresult *begun = run(c, t->tool, "BEGIN", 0, NULL, PGRES_COMMAND_OK);
    if (!begun)
        goto out;
    PQclear(begun);
    r = run(c, t->tool, obx_store_sql_dead_existing(), OBX_DEAD_TOOL_NPARAMS, v, PGRES_TUPLES_OK);
    if (!r)
        goto rollback;
    for (int i = 1; i < t->n_words; i++) {
        int found = 0;
        for (int k = 0; k < PQntuples(r); k++)
            found += strcmp(obx_store_col(r, k, "id"), t->words[i]) == 0;
        if (!found) {
            fprintf(stderr, "outboxd dead: no dead letter has id %s; nothing changed\n",
                    t->words[i]);
            goto rollback;
        }
        if (found > 1 && retry) {
            /* Rows of two histories of the database (a failover, a
             * restore): one id cannot go back into outbox.events twice. */
            fprintf(stderr,
                    "outboxd dead: %d dead letters have id %s (rows of two histories of the "
                    "database, told apart by created_at); put one back by hand (SQL) or drop "
                    "them; nothing changed\n",
                    found, t->words[i]);
            goto rollback;
        }
    }
    PQclear(r);
    r = run(c, t->tool, retry ? obx_store_sql_dead_retry() : obx_store_sql_dead_drop(),
            OBX_DEAD_TOOL_NPARAMS, v, PGRES_TUPLES_OK);
    if (!r)
        goto rollback;
    PGresult *done = run(c, t->tool, "COMMIT", 0, NULL, PGRES_COMMAND_OK);
    if (!done)
        goto out;
    PQclear(done);
    obx_info("dead: %s %d row%s: %s", retry ? "put back in line" : "dropped", PQntuples(r),
             PQntuples(r) == 1 ? "" : "s", ids);
    printf("%s %d dead letter%s%s\n", retry ? "retried" : "dropped", PQntuples(r),
           PQntuples(r) == 1 ? "" : "s",
           retry ? " (back in outbox.events with their ids; the relay publishes them)" : "");
    rc = 0;
    goto out;
rollback:
    PQclear(PQexec(c, "ROLLBACK"));
out:
    PQclear(r);
    obx_free(ids);
    return rc;
}

static int dead(const struct obx_tool_args *t, const struct obx_config *cfg)
{
    PGconn *c = tool_connect(cfg, "dead");
    if (!c)
        return 1;
    int rc = strcmp(t->words[0], "list") == 0 ? dead_list(c, t)
                                              : dead_act(c, t, strcmp(t->words[0], "retry") == 0);
    PQfinish(c);
    return rc;
}

/* ---- replay ---- */

static int replay(const struct obx_tool_args *t, const struct obx_config *cfg)
{
    char from[24], to[24];
    snprintf(from, sizeof(from), "%lld", (long long)(t->from_id ? t->from_id : 1));
    snprintf(to, sizeof(to), "%lld", (long long)(t->to_id ? t->to_id : INT64_MAX));
    const char *const v[OBX_REPLAY_NPARAMS] = {[OBX_REPLAY_TOPIC] = t->topic,
                                               [OBX_REPLAY_FROM] = from,
                                               [OBX_REPLAY_TO] = to,
                                               [OBX_REPLAY_SINCE] =
                                                   t->since ? t->since : "-infinity"};
    PGconn *c = tool_connect(cfg, "replay");
    if (!c)
        return 1;
    int rc = 1;
    PGresult *plan =
        run(c, t->tool, obx_store_sql_replay_plan(), OBX_REPLAY_NPARAMS, v, PGRES_TUPLES_OK);
    if (!plan)
        goto out;
    long long n = strtoll(obx_store_col(plan, 0, "rows"), NULL, 10);
    if (n == 0) {
        printf("nothing to replay: no sent row of topic %s in that range%s\n", t->topic,
               cfg->on_sent == OBX_ON_SENT_DELETE ? " (relay.on_sent = delete keeps none)" : "");
        rc = 0;
        goto out;
    }
    printf("replay: %lld sent rows of topic %s, ids %s to %s, created %s to %s, will be published "
           "again with their ids\n",
           n, t->topic, obx_store_col(plan, 0, "first_id"), obx_store_col(plan, 0, "last_id"),
           obx_store_col(plan, 0, "first_created"), obx_store_col(plan, 0, "last_created"));
    if (!t->yes) {
        if (!isatty(STDIN_FILENO)) {
            fprintf(stderr, "outboxd replay: not confirmed: add --yes (stdin is not a terminal)\n");
            rc = EXIT_USAGE;
            goto out;
        }
        printf("type yes to go on: ");
        fflush(stdout);
        char answer[16] = "";
        if (!fgets(answer, sizeof(answer), stdin) || strcmp(answer, "yes\n") != 0) {
            printf("nothing changed\n");
            rc = 1;
            goto out;
        }
    }
    PGresult *r = run(c, t->tool, obx_store_sql_replay(), OBX_REPLAY_NPARAMS, v, PGRES_COMMAND_OK);
    if (!r)
        goto out;
    obx_info("replay: %s rows of topic %s marked unsent for publishing again", PQcmdTuples(r),
             t->topic);
    printf("replay: %s rows queued again; the relay publishes them in id order\n", PQcmdTuples(r));
    PQclear(r);
    rc = 0;
out:
    PQclear(plan);
    PQfinish(c);
    return rc;
}

int obx_tool_run(const struct obx_tool_args *t, const struct obx_config *cfg)
{
    if (strcmp(t->tool, "status") == 0)
        return status(t, cfg);
    if (strcmp(t->tool, "dead") == 0)
        return dead(t, cfg);
    return replay(t, cfg);
}
