/*
 * obx-mock-broker: librdkafka's mock Kafka cluster in a process of its own,
 * so that tests can kill the relay while the "broker" lives on.
 *
 *   obx-mock-broker [-P] [-b BROKERS] [-t TOPIC:PARTITIONS]... [-f BOOTSTRAP_FILE]
 *
 * The bootstrap list is written to BOOTSTRAP_FILE (atomically) once the
 * cluster is up, and printed as "bootstrap <list>" on stdout. Control
 * commands, one per line on stdin, each answered "ok" or "error: ...":
 *
 *   down <broker|all>                 disconnect, refuse new connections
 *   up <broker|all>                   accept connections again
 *   rtt <broker|all> <ms>             add latency to every response
 *   topic <name> <partitions>         create a topic
 *   push-errors <apikey> <err>...     fail the next requests of an API
 *                                     (err by name, e.g. NOT_LEADER_FOR_PARTITION,
 *                                     or number; apikey 0 = Produce: with the
 *                                     checks on, REQUEST_TIMED_OUT and
 *                                     NOT_ENOUGH_REPLICAS_AFTER_APPEND store
 *                                     the batch first, as a broker does)
 *   clear-errors <apikey>
 *   topic-error <topic> <err>         Metadata answers this error for the
 *                                     topic (UNKNOWN_TOPIC_OR_PART = a topic
 *                                     that does not exist, auto-create off)
 *   leader <topic> <partition> <broker|-1>
 *   stats                             print the sequence checks' counters
 *
 * SIGTERM or SIGINT: destroy the cluster and exit 0.
 *
 * Every connection passes through a layer that checks an idempotent
 * producer's sequence numbers as a real broker does and carries the "rtt"
 * latency (seq_proxy.c); -P leaves it out: the bare mock, which stores
 * out-of-sequence batches and duplicates of retried ones.
 *
 * Limits of librdkafka 2.0.2's mock that remain (what tests cannot prove
 * here): about 5 MiB kept per partition, no replication (acks=all is one
 * copy), no read_committed filtering, no TLS/SASL.
 */
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <librdkafka/rdkafka.h>
#include <librdkafka/rdkafka_mock.h>

#include "seq_proxy.h"

/* The mock accepts connections with plain accept() and leaves Nagle on, so
 * responses stall behind delayed ACKs (~40 ms). A real broker sets
 * TCP_NODELAY; we do it here by wrapping accept(), which librdkafka imports
 * dynamically and so resolves to this definition. */
typedef int (*accept_fn)(int, struct sockaddr *, socklen_t *);
static accept_fn real_accept;

int accept(int fd, struct sockaddr *addr, socklen_t *len);
int accept(int fd, struct sockaddr *addr, socklen_t *len)
{
    int s = real_accept(fd, addr, len);
    if (s >= 0) {
        int one = 1;
        (void)setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    }
    return sp_wrap_accepted(fd, s);
}

static volatile sig_atomic_t stop_requested;

static void on_stop_signal(int sig)
{
    (void)sig;
    stop_requested = 1;
}

static int parse_int(const char *s, long *out)
{
    char *end;
    if (!s || !*s)
        return -1;
    errno = 0;
    *out = strtol(s, &end, 10);
    return (errno || *end) ? -1 : 0;
}

static int parse_broker(const char *s, int32_t *out)
{
    long v;
    if (s && strcmp(s, "all") == 0) {
        *out = -1;
        return 0;
    }
    if (parse_int(s, &v) != 0)
        return -1;
    *out = (int32_t)v;
    return 0;
}

/* Error code by name (without the RD_KAFKA_RESP_ERR_ prefix) or number. */
static int parse_error(const char *s, rd_kafka_resp_err_t *out)
{
    const struct rd_kafka_err_desc *descs;
    size_t cnt;
    long v;
    if (parse_int(s, &v) == 0) {
        *out = (rd_kafka_resp_err_t)v;
        return 0;
    }
    rd_kafka_get_err_descs(&descs, &cnt);
    for (size_t i = 0; i < cnt; i++) {
        if (descs[i].name && strcmp(descs[i].name, s) == 0) {
            *out = descs[i].code;
            return 0;
        }
    }
    return -1;
}

static bool checking = true; /* the sequence-checking layer is on (not -P) */

static const char *run_command(rd_kafka_mock_cluster_t *mc, char *line)
{
    char *argv[32];
    int argc = 0;
    int32_t broker;
    long a, b;

    for (char *tok = strtok(line, " \t\r\n"); tok && argc < 32; tok = strtok(NULL, " \t\r\n"))
        argv[argc++] = tok;
    if (argc == 0)
        return NULL;
    if (strcmp(argv[0], "down") == 0 && argc == 2 && parse_broker(argv[1], &broker) == 0) {
        /* Let the mock answer what it has first: the checking layer must
         * know whether each batch was stored (see seq_proxy.h). Forwarding
         * stays paused until "up". */
        sp_pause(broker);
        return rd_kafka_mock_broker_set_down(mc, broker) ? "error: down failed" : "ok";
    }
    if (strcmp(argv[0], "up") == 0 && argc == 2 && parse_broker(argv[1], &broker) == 0) {
        int rc = rd_kafka_mock_broker_set_up(mc, broker);
        sp_resume(broker);
        return rc ? "error: up failed" : "ok";
    }
    if (strcmp(argv[0], "rtt") == 0 && argc == 3 && parse_broker(argv[1], &broker) == 0 &&
        parse_int(argv[2], &a) == 0) {
        if (!checking)
            return rd_kafka_mock_broker_set_rtt(mc, broker, (int)a) ? "error: rtt failed" : "ok";
        sp_set_rtt(broker, (int)a);
        return "ok";
    }
    if (strcmp(argv[0], "stats") == 0 && argc == 1) {
        sp_print_stats(stdout);
        return "ok";
    }
    if (strcmp(argv[0], "topic") == 0 && argc == 3 && parse_int(argv[2], &a) == 0)
        return rd_kafka_mock_topic_create(mc, argv[1], (int)a, 1) ? "error: topic create failed"
                                                                  : "ok";
    if (strcmp(argv[0], "leader") == 0 && argc == 4 && parse_int(argv[2], &a) == 0 &&
        parse_int(argv[3], &b) == 0)
        return rd_kafka_mock_partition_set_leader(mc, argv[1], (int32_t)a, (int32_t)b)
                   ? "error: leader failed"
                   : "ok";
    if (strcmp(argv[0], "push-errors") == 0 && argc >= 3 && parse_int(argv[1], &a) == 0) {
        rd_kafka_resp_err_t errs[30];
        int16_t codes[30];
        int n = 0;
        for (int i = 2; i < argc; i++, n++) {
            if (parse_error(argv[i], &errs[n]) != 0)
                return "error: unknown error code";
            codes[n] = (int16_t)errs[n];
        }
        if (checking && a == 0) /* Produce errors: stored or not as a broker does */
            return sp_push_produce_errors(codes, n) ? "error: too many errors waiting" : "ok";
        rd_kafka_mock_push_request_errors_array(mc, (int16_t)a, (size_t)n, errs);
        return "ok";
    }
    if (strcmp(argv[0], "topic-error") == 0 && argc == 3) {
        rd_kafka_resp_err_t err;
        if (parse_error(argv[2], &err) != 0)
            return "error: unknown error code";
        rd_kafka_mock_topic_set_error(mc, argv[1], err);
        return "ok";
    }
    if (strcmp(argv[0], "clear-errors") == 0 && argc == 2 && parse_int(argv[1], &a) == 0) {
        if (checking && a == 0)
            sp_clear_produce_errors();
        rd_kafka_mock_clear_request_errors(mc, (int16_t)a);
        return "ok";
    }
    return "error: unknown command or bad arguments";
}

static int write_bootstrap_file(const char *path, const char *servers)
{
    char tmp[4096];
    FILE *f;
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    f = fopen(tmp, "w");
    if (!f)
        return -1;
    fprintf(f, "%s\n", servers);
    if (fclose(f) != 0)
        return -1;
    return rename(tmp, path);
}

int main(int argc, char **argv)
{
    int brokers = 3, opt;
    const char *bootstrap_file = NULL;
    char errstr[512];
    char *topics[64];
    int ntopics = 0;
    struct sigaction sa;

    real_accept = (accept_fn)dlsym(RTLD_NEXT, "accept");
    if (!real_accept) {
        fprintf(stderr, "mock-broker: cannot find accept()\n");
        return 1;
    }
    while ((opt = getopt(argc, argv, "b:t:f:Ph")) != -1) {
        switch (opt) {
        case 'P':
            checking = false;
            break;
        case 'b':
            brokers = atoi(optarg);
            break;
        case 't':
            if (ntopics < 64)
                topics[ntopics++] = optarg;
            break;
        case 'f':
            bootstrap_file = optarg;
            break;
        default:
            fprintf(stderr, "usage: %s [-P] [-b brokers] [-t topic:partitions]... [-f file]\n",
                    argv[0]);
            return 2;
        }
    }

    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_stop_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sa.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &sa, NULL);

    rd_kafka_conf_t *conf = rd_kafka_conf_new();
    /* The host instance only owns the cluster; keep it quiet. */
    rd_kafka_conf_set(conf, "log_level", "3", errstr, sizeof(errstr));
    rd_kafka_t *rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, errstr, sizeof(errstr));
    if (!rk) {
        fprintf(stderr, "mock-broker: %s\n", errstr);
        return 1;
    }
    rd_kafka_mock_cluster_t *mc = rd_kafka_mock_cluster_new(rk, brokers);
    if (!mc) {
        fprintf(stderr, "mock-broker: cannot create the mock cluster\n");
        rd_kafka_destroy(rk);
        return 1;
    }
    for (int i = 0; i < ntopics; i++) {
        char *colon = strrchr(topics[i], ':');
        long parts = 1;
        if (colon) {
            *colon = '\0';
            if (parse_int(colon + 1, &parts) != 0 || parts < 1) {
                fprintf(stderr, "mock-broker: bad partition count in -t %s\n", topics[i]);
                return 2;
            }
        }
        if (rd_kafka_mock_topic_create(mc, topics[i], (int)parts, brokers < 3 ? brokers : 3)) {
            fprintf(stderr, "mock-broker: cannot create topic %s\n", topics[i]);
            return 1;
        }
    }
    const char *servers = rd_kafka_mock_cluster_bootstraps(mc);
    if (checking && sp_start(servers) != 0) {
        fprintf(stderr, "mock-broker: cannot start the sequence checks: %s\n", strerror(errno));
        return 1;
    }
    if (bootstrap_file && write_bootstrap_file(bootstrap_file, servers) != 0) {
        fprintf(stderr, "mock-broker: cannot write %s: %s\n", bootstrap_file, strerror(errno));
        return 1;
    }
    printf("bootstrap %s\n", servers);
    fflush(stdout);

    char line[1024];
    size_t used = 0;
    int stdin_open = 1;
    while (!stop_requested) {
        struct pollfd pfd = {.fd = STDIN_FILENO, .events = POLLIN};
        int n = poll(&pfd, stdin_open ? 1 : 0, 200);
        if (n <= 0 || !stdin_open)
            continue;
        ssize_t r = read(STDIN_FILENO, line + used, sizeof(line) - 1 - used);
        if (r <= 0) {
            stdin_open = 0; /* keep serving until a signal */
            continue;
        }
        used += (size_t)r;
        line[used] = '\0';
        char *nl;
        while ((nl = strchr(line, '\n')) != NULL) {
            *nl = '\0';
            const char *reply = run_command(mc, line);
            if (reply) {
                printf("%s\n", reply);
                fflush(stdout);
            }
            size_t rest = used - (size_t)(nl + 1 - line);
            memmove(line, nl + 1, rest + 1);
            used = rest;
        }
        if (used == sizeof(line) - 1)
            used = 0; /* an absurdly long line: drop it */
    }
    if (checking) {
        sp_print_stats(stderr);
        sp_stop();
    }
    rd_kafka_mock_cluster_destroy(mc);
    rd_kafka_destroy(rk);
    if (bootstrap_file)
        unlink(bootstrap_file);
    return 0;
}
