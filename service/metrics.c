/*
 * metrics: see include/outboxd/metrics.h.
 */
#include "outboxd/metrics.h"
#include "outboxd/alloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <unistd.h>

/* From a few ms (linger) to minutes (an outage being caught up). */
static const double latency_bounds[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                        0.5,   1,      2.5,   5,    10,    30,   60,  300};
static const double batch_bounds[] = {1, 10, 50, 100, 250, 500, 1000, 2500, 5000, 10000};

void obx_histogram_init_latency(struct obx_histogram *h)
{
    memset(h, 0, sizeof(*h));
    h->bounds = latency_bounds;
    h->n_bounds = sizeof(latency_bounds) / sizeof(latency_bounds[0]);
}

void obx_histogram_init_batch(struct obx_histogram *h)
{
    memset(h, 0, sizeof(*h));
    h->bounds = batch_bounds;
    h->n_bounds = sizeof(batch_bounds) / sizeof(batch_bounds[0]);
}

void obx_labelled_free(struct obx_labelled *l)
{
    for (size_t i = 0; i < l->n; i++)
        obx_free(l->items[i].label);
    obx_free(l->items);
    memset(l, 0, sizeof(*l));
}

/* Adds one to the counter of `label`. Without memory for a new label the
 * event is counted under "_other" (kept as the first item once created). */
void obx_labelled_inc(struct obx_labelled *l, const char *label)
{
    if (l->last < l->n && strcmp(l->items[l->last].label, label) == 0) {
        l->items[l->last].value++;
        return;
    }
    for (size_t i = 0; i < l->n; i++) {
        if (strcmp(l->items[i].label, label) == 0) {
            l->items[i].value++;
            l->last = i;
            return;
        }
    }
    if (l->n >= OBX_LABELS_MAX && strcmp(label, "_other") != 0) {
        obx_labelled_inc(l, "_other");
        return;
    }
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 8;
        struct obx_label_counter *grown = obx_realloc(l->items, cap * sizeof(*grown));
        if (!grown)
            return; /* the event goes uncounted rather than the relay failing */
        l->items = grown;
        l->cap = cap;
    }
    char *copy = obx_strdup(label);
    if (!copy)
        return;
    l->items[l->n].label = copy;
    l->items[l->n].value = 1;
    l->last = l->n++;
}

void obx_histogram_observe(struct obx_histogram *h, double v)
{
    size_t i = 0;
    while (i < h->n_bounds && v > h->bounds[i])
        i++;
    h->counts[i]++;
    h->sum += v;
    h->count++;
}

void obx_histogram_observe_age(struct obx_histogram *h, int64_t created_us)
{
    struct timeval tv;
    gettimeofday(&tv, NULL);
    int64_t now_us = (int64_t)tv.tv_sec * 1000000 + tv.tv_usec;
    double age = (double)(now_us - created_us) / 1e6;
    /* created_at comes from the database's clock: a skew can make it look
     * like the future; count that as immediate. */
    obx_histogram_observe(h, age < 0 ? 0 : age);
}

/* ---- rendering ---- */

static void header(struct obx_buf *out, const char *name, const char *type, const char *help)
{
    obx_buf_printf(out, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void simple(struct obx_buf *out, const char *name, const char *type, const char *help,
                   double value)
{
    header(out, name, type, help);
    obx_buf_printf(out, "%s %.17g\n", name, value);
}

/* A label value with \, " and newline escaped as the text format requires. */
static void label_value(struct obx_buf *out, const char *s)
{
    for (; *s; s++) {
        if (*s == '\\')
            obx_buf_puts(out, "\\\\");
        else if (*s == '"')
            obx_buf_puts(out, "\\\"");
        else if (*s == '\n')
            obx_buf_puts(out, "\\n");
        else
            obx_buf_append(out, s, 1);
    }
}

static void labelled(struct obx_buf *out, const char *name, const char *label, const char *help,
                     const struct obx_labelled *l)
{
    header(out, name, "counter", help);
    for (size_t i = 0; l && i < l->n; i++) {
        obx_buf_printf(out, "%s{%s=\"", name, label);
        label_value(out, l->items[i].label);
        obx_buf_printf(out, "\"} %llu\n", (unsigned long long)l->items[i].value);
    }
}

static void histogram(struct obx_buf *out, const char *name, const char *help,
                      const struct obx_histogram *h)
{
    uint64_t cumulative = 0;
    struct obx_histogram empty;
    if (!h) {
        obx_histogram_init_batch(&empty); /* bounds do not matter without counts */
        h = &empty;
    }
    header(out, name, "histogram", help);
    for (size_t i = 0; i < h->n_bounds; i++) {
        cumulative += h->counts[i];
        obx_buf_printf(out, "%s_bucket{le=\"%g\"} %llu\n", name, h->bounds[i],
                       (unsigned long long)cumulative);
    }
    cumulative += h->counts[h->n_bounds];
    obx_buf_printf(out, "%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)cumulative);
    obx_buf_printf(out, "%s_sum %.17g\n%s_count %llu\n", name, h->sum, name,
                   (unsigned long long)h->count);
}

static double resident_bytes(void)
{
    /* /proc/self/statm: size resident shared ... in pages. */
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long size = 0, resident = 0;
    if (!f)
        return 0;
    if (fscanf(f, "%lu %lu", &size, &resident) != 2)
        resident = 0;
    fclose(f);
    return (double)resident * (double)sysconf(_SC_PAGESIZE);
}

static double cpu_seconds(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0)
        return 0;
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
           (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

/* What the relay did with rows: counters, gauges and histograms. */
static void render_rows(struct obx_buf *out, const struct obx_metrics_gauges *g)
{
    labelled(out, "outboxd_records_published_total", "topic",
             "Records Kafka acknowledged, by topic.", g->published);
    labelled(out, "outboxd_publish_errors_total", "reason",
             "Produce calls or deliveries that failed, by librdkafka error name.",
             g->publish_errors);
    simple(out, "outboxd_rows_marked_total", "counter",
           "Rows confirmed in Postgres after Kafka acknowledged them (marked sent, deleted, or "
           "covered by a cursor row in log mode).",
           (double)g->rows_marked);
    header(out, "outboxd_fetches_total", "counter",
           "Fetch statements sent, by kind: keyset (above the cursor, and late commits) or full "
           "(every unsent row but those in flight, when the cursor cannot tell).");
    obx_buf_printf(out, "outboxd_fetches_total{kind=\"keyset\"} %llu\n",
                   (unsigned long long)g->fetches_keyset);
    obx_buf_printf(out, "outboxd_fetches_total{kind=\"full\"} %llu\n",
                   (unsigned long long)g->fetches_full);
    simple(out, "outboxd_rows_dead_lettered_total", "counter",
           "Rows Kafka refused for good and moved to outbox.dead_letters.",
           (double)g->rows_dead_lettered);
    header(out, "outboxd_kafka_transactions_total", "counter",
           "Kafka transactions the relay ended (relay.transactions), by result.");
    obx_buf_printf(out, "outboxd_kafka_transactions_total{result=\"committed\"} %llu\n",
                   (unsigned long long)g->txn_committed);
    obx_buf_printf(out, "outboxd_kafka_transactions_total{result=\"aborted\"} %llu\n",
                   (unsigned long long)g->txn_aborted);
    simple(out, "outboxd_rows_recovered_total", "counter",
           "Rows the start-up recovery pass found already in Kafka and marked.",
           (double)g->rows_recovered);
    simple(out, "outboxd_ids_skipped_total", "counter",
           "Recovery passes that found an outbox-id in Kafka the database would hand out again "
           "(another history) and moved its ids past it.",
           (double)g->ids_skipped);
    simple(out, "outboxd_rows_purged_total", "counter", "Sent rows deleted by retention.",
           (double)g->rows_purged);
    simple(out, "outboxd_rows_in_flight", "gauge",
           "Rows handed to Kafka and not yet confirmed in Postgres.", (double)g->in_flight);
    simple(out, "outboxd_rows_in_flight_limit", "gauge", "relay.max_in_flight.",
           (double)g->in_flight_limit);
    simple(out, "outboxd_keys_held_back", "gauge",
           "Keys whose later rows wait behind a refused, failed or unresolved row.",
           (double)g->keys_held_back);
    simple(out, "outboxd_slots", "gauge", "relay.shards: the slots the keys hash into.",
           (double)g->slots);
    simple(out, "outboxd_slots_owned", "gauge", "Slots whose rows this relay publishes.",
           (double)g->slots_owned);
    simple(out, "outboxd_slot_members", "gauge",
           "Relays sharing the slots, as this relay last counted them.", (double)g->slot_members);
    simple(out, "outboxd_slot_moves_total", "counter",
           "Slots this relay took or gave back (rebalances).", (double)g->slot_moves);
    if (g->backlog_rows >= 0)
        simple(out, "outboxd_outbox_backlog_rows", "gauge",
               "Unsent rows in outbox.events (refreshed every few seconds).",
               (double)g->backlog_rows);
    if (g->lag_seconds >= 0)
        simple(out, "outboxd_outbox_lag_seconds", "gauge",
               "Age of the oldest unsent row (0 when none is waiting).", g->lag_seconds);
    if (g->slot_count > 0) {
        header(out, "outboxd_slot_backlog_rows", "gauge",
               "Unsent rows of each slot (relay.shards; counted by the owner of slot 0).");
        for (int i = 0; i < g->slot_count; i++)
            obx_buf_printf(out, "outboxd_slot_backlog_rows{slot=\"%d\"} %lld\n", i,
                           (long long)g->slot_backlog_rows[i]);
        header(out, "outboxd_slot_lag_seconds", "gauge",
               "Age of the oldest unsent row of each slot (0 when none is waiting).");
        for (int i = 0; i < g->slot_count; i++)
            obx_buf_printf(out, "outboxd_slot_lag_seconds{slot=\"%d\"} %.3f\n", i,
                           (double)g->slot_lag_ms[i] / 1000.0);
    }
    histogram(out, "outboxd_commit_to_ack_seconds",
              "From the row's created_at (its insert) to Kafka's acknowledgement.", g->ack_latency);
    histogram(out, "outboxd_fetch_batch_rows", "Rows returned by each fetch.", g->batch_rows);
}

/* The connections, readiness, progress and recovery. */
static void render_health(struct obx_buf *out, const struct obx_metrics_gauges *g)
{
    simple(out, "outboxd_postgres_connected", "gauge",
           "1 when the relay's Postgres connection is set up and usable.",
           g->postgres_connected ? 1 : 0);
    simple(out, "outboxd_postgres_reconnects_total", "counter",
           "Postgres connection attempts after the first one.", (double)g->pg_reconnects);
    simple(out, "outboxd_postgres_history_changes_total", "counter",
           "Sessions whose server was on another history (system identifier or timeline) than "
           "the last session's: a failover to a standby, a restore, a cut-over.",
           (double)g->pg_history_changes);
    simple(out, "outboxd_postgres_timeline", "gauge",
           "The timeline of the last Postgres server whose history could be read (0 before the "
           "first).",
           (double)g->pg_timeline);
    simple(out, "outboxd_kafka_connected", "gauge",
           "1 when the last metadata request to Kafka succeeded.", g->kafka_connected ? 1 : 0);
    simple(out, "outboxd_ready", "gauge", "1 when /readyz answers 200.", g->ready ? 1 : 0);
    simple(out, "outboxd_standby", "gauge",
           "1 while another outboxd holds the relay lock of this outbox and this one waits.",
           g->standby ? 1 : 0);
    simple(out, "outboxd_last_progress_timestamp_seconds", "gauge",
           "When the relay last made progress (a row marked, an empty fetch with nothing in "
           "flight, the relay lock acquired, recovery reading or done).",
           g->last_progress);
    simple(out, "outboxd_stalled", "gauge",
           "1 while no progress was made for relay.stall_timeout with Postgres and Kafka "
           "reachable (/livez fails).",
           g->stalled ? 1 : 0);
    simple(out, "outboxd_recovering", "gauge",
           "1 while a recovery pass reads Kafka before publishing.", g->recovering ? 1 : 0);
    simple(out, "outboxd_recovery_records_read", "gauge",
           "Records the running (or the last) recovery pass has read.",
           (double)g->recovery_records_read);
    simple(out, "outboxd_recovery_partitions_left", "gauge",
           "Partitions the running recovery pass has still to read.",
           (double)g->recovery_partitions_left);
    simple(out, "outboxd_draining", "gauge", "1 after SIGTERM/SIGINT, while in-flight rows finish.",
           g->draining ? 1 : 0);
}

void obx_metrics_render(struct obx_buf *out, const struct obx_metrics_gauges *g)
{
    header(out, "outboxd_build_info", "gauge", "Versions of outboxd and the libraries it runs on.");
    obx_buf_printf(out,
                   "outboxd_build_info{version=\"%s\",librdkafka=\"%s\",libpq=\"%d\","
                   "libuv=\"%s\"} 1\n",
                   OBX_VERSION, g->librdkafka_version ? g->librdkafka_version : "",
                   g->libpq_version, g->libuv_version ? g->libuv_version : "");
    render_rows(out, g);
    render_health(out, g);
    simple(out, "process_cpu_seconds_total", "counter", "User and system CPU time spent.",
           cpu_seconds());
    simple(out, "process_resident_memory_bytes", "gauge", "Resident memory size.",
           resident_bytes());
    simple(out, "process_start_time_seconds", "gauge", "Start time since the Unix epoch.",
           g->start_time);
}
