/*
 * obx-kafka-cluster: a real Apache Kafka cluster on loopback, for the tests,
 * the demo and the benchmarks. 1 or 3 nodes in KRaft mode, each a broker and
 * a controller in one JVM (a static quorum), run from the jars that
 * tests/kafka/pom.xml pins (tests/kafka/classpath.sh resolves them into
 * Maven's local repository and writes their classpath).
 *
 *   obx-kafka-cluster [-n NODES] [-t TOPIC:PARTITIONS[:key=value,...]]...
 *                     [-o key=value]... [-x] [-s] [-d DIR] [-k] [-f FILE]
 *                     [-c CLASSPATH_FILE] [-C CACHE_DIR] [-J JVM_OPTIONS]
 *
 *   -n   nodes, 1 or 3 (default 3): with 3, topics get 3 replicas and
 *        min.insync.replicas 2, as the internal topics do
 *   -t   a topic to create before "bootstrap" is printed
 *   -o   a broker setting for every node, after ours (so it wins)
 *   -x   a TCP proxy of ours in front of each client listener (tcp_proxy.h),
 *        for the cut, blackhole and heal commands
 *   -s   clients authenticate with SASL/PLAIN (users admin, the super user,
 *        and relay; passwords admin-secret and relay-secret) and a
 *        StandardAuthorizer allows what no ACL denies, for the acl command
 *   -d   the cluster's directory (made if missing, kept); default a new
 *        /tmp/obx-kafka-XXXXXX, removed at exit unless -k
 *   -f   where to write the client bootstrap list once the cluster is up
 *   -J   more JVM options for each node (after ours, so they win)
 *
 * Once every node is in the cluster's metadata and every topic has all its
 * replicas in sync, it prints "internal <list>" (the listener the brokers
 * use among themselves, which no proxy and no SASL is on: for tools that
 * must see the cluster whatever a test did to the clients' network) and
 * then "bootstrap <list>" (the clients' listener). Then it takes commands
 * on stdin, one a line, each answered "ok[ value]" or "error: why":
 *
 *   kill|stop|start|restart|pause|cont <node|all>
 *                          SIGKILL; SIGTERM and wait for a clean exit;
 *                          start a node that is down and wait until it is
 *                          in the metadata; stop then start; SIGSTOP; SIGCONT
 *   topic <name> <partitions> [key=value]...    create a topic
 *   leader <topic> <partition>        the partition's leader (-1: none)
 *   isr <topic> <partition>           its in-sync replicas, "1,2,3"
 *   wait-isr [ms]                     until every partition of every topic
 *                                     has a leader and all its replicas in
 *                                     sync (default 60000 ms)
 *   controller                        the active controller (the quorum's
 *                                     leader, from the nodes' quorum-state)
 *   coordinator <txn|group> <id>      the broker that coordinates the
 *                                     transactional id or group
 *   cut|blackhole|heal <node|all>     (-x) reset the clients' connections
 *                                     and refuse new ones; forward nothing;
 *                                     forward again
 *   acl <allow|deny|remove> <principal> <topic> <operation>      (-s)
 *   pid <node>                        the node's process id (0: down)
 *   nodes                             each node's state, "1:running 2:down ..."
 *
 * SIGTERM or SIGINT: kill every node (the data is thrown away) and exit 0.
 * Every node dies with this process (PR_SET_PDEATHSIG), so a test that
 * dies leaves no broker behind.
 *
 * Start-up costs two things once per machine, kept in the cache directory
 * (default: "cache" beside the classpath file): the nodes' storage
 * formatted by kafka.tools.StorageTool (copied for each cluster, as the
 * tests copy a migrated Postgres), and a class-data-sharing archive of the
 * broker's classes (which cuts a node's start from about 3 to 2 s of CPU).
 */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <librdkafka/rdkafka.h>

#include "tcp_proxy.h"

#ifndef OBX_KAFKA_CLASSPATH_FILE
#define OBX_KAFKA_CLASSPATH_FILE "kafka/classpath"
#endif

#define MAX_NODES     3
#define MAX_OVERRIDES 32
#define MAX_TOPICS    64
#define CLUSTER_ID    "b3V0Ym94ZC10ZXN0cy0wMQ" /* "outboxd-tests-01", base64url */
/* Changes with what goes into the cache: bump it when the format step or
 * the archive's recipe changes. */
#define CACHE_RECIPE "1"

enum node_state { NODE_DOWN, NODE_RUNNING, NODE_PAUSED };

static const char *const state_names[] = {"down", "running", "paused"};

struct node {
    int id;
    pid_t pid;
    enum node_state state;
    int client_port;     /* the broker's client listener */
    int proxy_port;      /* what clients are told to use: the proxy's, or client_port */
    int internal_port;   /* brokers among themselves, and our admin handle */
    int controller_port; /* the quorum */
    char dir[300];
};

static struct {
    int n;
    struct node nodes[MAX_NODES];
    char dir[256];
    bool own_dir, keep, proxy, sasl;
    char *classpath;
    char java[PATH_MAX];
    char cache[256];
    char storage_template[320];
    char cds_archive[320];
    const char *overrides[MAX_OVERRIDES];
    int noverrides;
    const char *jvm_opts;
    rd_kafka_t *admin;
    char bootstrap[512], internal[512];
} C;

static volatile sig_atomic_t stop_requested;

static void on_stop_signal(int sig)
{
    (void)sig;
    stop_requested = 1;
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR && !stop_requested) {
    }
}

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "obx-kafka-cluster: ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

static int parse_long(const char *s, long *out)
{
    char *end;
    if (!s || !*s)
        return -1;
    errno = 0;
    *out = strtol(s, &end, 10);
    return (errno || *end) ? -1 : 0;
}

/* Whether `port` (0: any) can be bound on 127.0.0.1 now; the bound port. */
static int try_port(int port)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    socklen_t len = sizeof(a);
    int got = -1;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        got = ntohs(a.sin_port);
    if (fd >= 0)
        close(fd);
    return got;
}

/* A TCP port that was free on 127.0.0.1 a moment ago, below the kernel's
 * ephemeral range: a port in that range can be taken, between our probe
 * and the node's bind or while a node is down for a restart, as the local
 * end of any outgoing connection (a node once failed to start with
 * "Address already in use" on its controller port). Never one handed out
 * before by this process. */
static int free_port(void)
{
    static int given[4 * MAX_NODES + 8];
    static unsigned n_given;
    static uint64_t seed;
    int lo = 0, hi = 0;
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
    if (f) {
        if (fscanf(f, "%d %d", &lo, &hi) != 2)
            lo = 0;
        fclose(f);
    }
    if (!seed)
        seed = (uint64_t)getpid() * 2654435761u ^ (uint64_t)now_ms();
    int first = lo - 12000 > 1024 ? lo - 12000 : 1024;
    for (int attempt = 0; lo > first && attempt < 500; attempt++) {
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        int port = first + (int)((seed >> 33) % (uint64_t)(lo - first));
        bool seen = false;
        for (unsigned i = 0; i < n_given; i++)
            seen = seen || given[i] == port;
        if (!seen && try_port(port) == port) {
            if (n_given < sizeof(given) / sizeof(given[0]))
                given[n_given++] = port;
            return port;
        }
    }
    return try_port(0); /* no range to stay below: any free one */
}

static int write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (!f)
        return -1;
    fputs(text, f);
    return fclose(f);
}

/* Reads a whole small file; NULL if it cannot. The caller frees. */
static char *read_text(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return NULL;
    size_t cap = 4096, len = 0;
    char *s = malloc(cap);
    for (size_t r; s && (r = fread(s + len, 1, cap - len - 1, f)) > 0;) {
        len += r;
        if (len + 1 == cap) {
            char *bigger = realloc(s, cap * 2);
            if (!bigger) {
                free(s);
                s = NULL;
                break;
            }
            s = bigger;
            cap *= 2;
        }
    }
    fclose(f);
    if (s)
        s[len] = '\0';
    return s;
}

/* In a child before exec: every descriptor but 0, 1 and 2 closed, so that
 * no node holds a socket of the proxy or a pipe of ours open. */
static void close_inherited(void)
{
    long max = sysconf(_SC_OPEN_MAX);
    for (int fd = 3; fd < (max > 0 && max < 65536 ? max : 65536); fd++)
        close(fd);
}

/* Runs argv to completion with stdout and stderr appended to log; returns
 * its exit status, or -1. */
static int run(char *const argv[], const char *log)
{
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        close_inherited();
        execv(argv[0], argv);
        _exit(127);
    }
    int status;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR)
            return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path) == 0 || errno == ENOENT ? 0 : -1;
}

static void remove_tree(const char *path)
{
    nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static int copy_tree(const char *from, const char *to, const char *log)
{
    char *const argv[] = {"/bin/cp", "-a", (char *)from, (char *)to, NULL};
    return run(argv, log);
}

/* The java to run: $JAVA_HOME/bin/java, else the first on PATH. */
static int find_java(void)
{
    const char *home = getenv("JAVA_HOME");
    if (home && *home) {
        snprintf(C.java, sizeof(C.java), "%s/bin/java", home);
        if (access(C.java, X_OK) == 0)
            return 0;
    }
    const char *path = getenv("PATH");
    while (path && *path) {
        size_t n = strcspn(path, ":");
        snprintf(C.java, sizeof(C.java), "%.*s/java", (int)n, path);
        if (n > 0 && access(C.java, X_OK) == 0)
            return 0;
        path += n + (path[n] == ':');
    }
    return -1;
}

static uint64_t fnv1a(uint64_t h, const void *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        h = (h ^ ((const unsigned char *)p)[i]) * 1099511628211ULL;
    return h;
}

/* --- nodes ------------------------------------------------------------- */

static const char *voters(const struct node *nodes, int n, char *buf, size_t len)
{
    size_t used = 0;
    buf[0] = '\0';
    for (int i = 0; i < n; i++)
        used += (size_t)snprintf(buf + used, used < len ? len - used : 0, "%s%d@127.0.0.1:%d",
                                 i ? "," : "", nodes[i].id, nodes[i].controller_port);
    return buf;
}

/* The server.properties of node nd of the n in nodes[]: written before
 * every start (the same each time: its ports are chosen once). `ours`
 * adds -s's SASL and authorizer and -o's settings. */
static int write_properties(const struct node *nd, const struct node *nodes, int n, bool ours)
{
    char path[400], v[256], text[8192];
    int rf = n < 3 ? n : 3, isr = n < 2 ? 1 : 2;
    int used = snprintf(
        text, sizeof(text),
        "# written by obx-kafka-cluster\n"
        "process.roles=broker,controller\n"
        "node.id=%d\n"
        "controller.quorum.voters=%s\n"
        "listeners=CLIENT://127.0.0.1:%d,INTERNAL://127.0.0.1:%d,CONTROLLER://127.0.0.1:%d\n"
        "advertised.listeners=CLIENT://127.0.0.1:%d,INTERNAL://127.0.0.1:%d\n"
        "listener.security.protocol.map=CLIENT:%s,INTERNAL:PLAINTEXT,CONTROLLER:PLAINTEXT\n"
        "controller.listener.names=CONTROLLER\n"
        "inter.broker.listener.name=INTERNAL\n"
        "log.dirs=%s/data\n"
        "auto.create.topics.enable=false\n"
        "num.partitions=1\n"
        "default.replication.factor=%d\n"
        "min.insync.replicas=%d\n"
        "offsets.topic.replication.factor=%d\n"
        "offsets.topic.num.partitions=1\n"
        "transaction.state.log.replication.factor=%d\n"
        "transaction.state.log.min.isr=%d\n"
        "transaction.state.log.num.partitions=1\n"
        "share.coordinator.state.topic.replication.factor=%d\n"
        "share.coordinator.state.topic.min.isr=%d\n"
        "group.initial.rebalance.delay.ms=0\n"
        /* A node killed with -9 is fenced after this, not the default 9 s:
         * fault tests wait less, and 500 ms heartbeats keep a loaded
         * machine from fencing a live node. */
        "broker.session.timeout.ms=4000\n"
        "broker.heartbeat.interval.ms=500\n"
        /* Threads for a few partitions on two cores, not a server's. */
        "num.network.threads=2\n"
        "num.io.threads=2\n"
        "background.threads=2\n"
        "num.replica.fetchers=1\n"
        "num.recovery.threads.per.data.dir=1\n"
        "log.cleaner.threads=1\n",
        nd->id, voters(nodes, n, v, sizeof(v)), nd->client_port, nd->internal_port,
        nd->controller_port, nd->proxy_port, nd->internal_port,
        ours && C.sasl ? "SASL_PLAINTEXT" : "PLAINTEXT", nd->dir, rf, isr, rf, rf, isr, rf, isr);
    if (ours && C.sasl)
        used += snprintf(text + used, sizeof(text) - (size_t)used,
                         "sasl.enabled.mechanisms=PLAIN\n"
                         "listener.name.client.plain.sasl.jaas.config="
                         "org.apache.kafka.common.security.plain.PlainLoginModule required "
                         "username=\"admin\" password=\"admin-secret\" "
                         "user_admin=\"admin-secret\" user_relay=\"relay-secret\";\n"
                         "authorizer.class.name="
                         "org.apache.kafka.metadata.authorizer.StandardAuthorizer\n"
                         /* The brokers and our tools come in on PLAINTEXT
                          * listeners, as ANONYMOUS. */
                         "super.users=User:ANONYMOUS;User:admin\n"
                         "allow.everyone.if.no.acl.found=true\n");
    for (int i = 0; ours && i < C.noverrides; i++)
        used += snprintf(text + used, sizeof(text) - (size_t)used, "%s\n", C.overrides[i]);
    if ((size_t)used >= sizeof(text))
        return -1;
    snprintf(path, sizeof(path), "%s/server.properties", nd->dir);
    return write_text(path, text);
}

/* Our JVM options, then -J's. Class data sharing when the archive exists;
 * C1 only (TieredStopAtLevel=1): most of a node's start is compiling, and a
 * few partitions on loopback never need C2's code (-J can undo it). */
static int jvm_args(char **argv, int argc, int max, char *buf, size_t buflen)
{
    static const char *const base[] = {
        "-Xms64m",
        "-Xmx512m",
        "-XX:+UseSerialGC",
        "-XX:TieredStopAtLevel=1",
        "-XX:-UsePerfData",
        "-Djava.awt.headless=true",
        "-Dorg.slf4j.simpleLogger.showDateTime=true",
        "-Dorg.slf4j.simpleLogger.dateTimeFormat=yyyy-MM-dd HH:mm:ss.SSS",
        /* Each client and server config is dumped at INFO, key by key. */
        "-Dorg.slf4j.simpleLogger.log.kafka.server.KafkaConfig=warn",
        "-Dorg.slf4j.simpleLogger.log.org.apache.kafka.common.config.AbstractConfig=warn",
        "-Dorg.slf4j.simpleLogger.log.org.apache.kafka.clients=warn",
        "-Dorg.slf4j.simpleLogger.log.org.apache.kafka.storage.internals.log.LogConfig=warn",
    };
    for (size_t i = 0; i < sizeof(base) / sizeof(base[0]) && argc < max; i++)
        argv[argc++] = (char *)base[i];
    if (access(C.cds_archive, R_OK) == 0 && argc < max) {
        static char cds[360];
        snprintf(cds, sizeof(cds), "-XX:SharedArchiveFile=%s", C.cds_archive);
        argv[argc++] = cds;
    }
    if (C.jvm_opts) {
        snprintf(buf, buflen, "%s", C.jvm_opts);
        for (char *tok = strtok(buf, " "); tok && argc < max; tok = strtok(NULL, " "))
            argv[argc++] = tok;
    }
    return argc;
}

static pid_t spawn_java(char **argv, const char *log, const char *cwd)
{
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        /* Dies with us: fork only from the main thread, which lives until
         * the end (PDEATHSIG follows the thread that forked). */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        int devnull = open("/dev/null", O_RDONLY);
        if (devnull >= 0)
            dup2(devnull, 0);
        if (cwd && chdir(cwd) != 0)
            _exit(126);
        close_inherited();
        execv(argv[0], argv);
        _exit(127);
    }
    return pid;
}

static int node_start(struct node *nd)
{
    char *argv[64], props[400], log[400], buf[1024];
    int argc = 0;
    if (write_properties(nd, C.nodes, C.n, true) != 0) {
        say("node %d: cannot write its properties", nd->id);
        return -1;
    }
    snprintf(props, sizeof(props), "%s/server.properties", nd->dir);
    snprintf(log, sizeof(log), "%s/kafka.log", nd->dir);
    argv[argc++] = C.java;
    argc = jvm_args(argv, argc, 56, buf, sizeof(buf));
    argv[argc++] = "-cp";
    argv[argc++] = C.classpath;
    argv[argc++] = "kafka.Kafka";
    argv[argc++] = props;
    argv[argc] = NULL;
    nd->pid = spawn_java(argv, log, nd->dir);
    if (nd->pid < 0)
        return -1;
    nd->state = NODE_RUNNING;
    return 0;
}

/* Reaps nodes that exited; says so of one nobody stopped. */
static void reap(void)
{
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (int i = 0; i < C.n; i++) {
            struct node *nd = &C.nodes[i];
            if (nd->pid != pid)
                continue;
            if (nd->state != NODE_DOWN)
                say("node %d exited by itself (%s %d); see %s/kafka.log", nd->id,
                    WIFEXITED(status) ? "status" : "signal",
                    WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status), nd->dir);
            nd->pid = 0;
            nd->state = NODE_DOWN;
        }
    }
}

/* Waits up to timeout_ms for the node's process to end. */
static bool wait_gone(struct node *nd, int timeout_ms)
{
    int64_t deadline = now_ms() + timeout_ms;
    while (nd->pid > 0) {
        int status;
        pid_t r = waitpid(nd->pid, &status, WNOHANG);
        if (r == nd->pid || (r < 0 && errno == ECHILD)) {
            nd->pid = 0;
            break;
        }
        if (now_ms() > deadline)
            return false;
        sleep_ms(20);
    }
    nd->state = NODE_DOWN;
    return true;
}

static void node_kill(struct node *nd)
{
    if (nd->pid <= 0)
        return;
    kill(nd->pid, SIGKILL);
    wait_gone(nd, 10000);
}

/* A clean stop: SIGTERM, and the broker's controlled shutdown moves its
 * leaderships first. One that cannot finish (no quorum left to tell) is
 * killed after timeout_ms; returns false then. */
static bool node_stop(struct node *nd, int timeout_ms)
{
    if (nd->pid <= 0)
        return true;
    if (nd->state == NODE_PAUSED)
        kill(nd->pid, SIGCONT);
    kill(nd->pid, SIGTERM);
    if (wait_gone(nd, timeout_ms))
        return true;
    say("node %d did not stop within %d ms; killed", nd->id, timeout_ms);
    node_kill(nd);
    return false;
}

/* --- the cache: formatted storage and the class-data archive ------------ */

static int format_storage(const char *dir, const char *log)
{
    char v[256], props[400], text[2048], data[380];
    snprintf(v, sizeof(v), "1@127.0.0.1:1,2@127.0.0.1:2,3@127.0.0.1:3");
    for (int id = 1; id <= MAX_NODES; id++) {
        /* Static voters: the formatted storage names no port, so one copy
         * serves clusters on any ports. */
        snprintf(data, sizeof(data), "%s/n%d", dir, id);
        snprintf(props, sizeof(props), "%s/format-%d.properties", dir, id);
        snprintf(text, sizeof(text),
                 "process.roles=broker,controller\nnode.id=%d\ncontroller.quorum.voters=%s\n"
                 "listeners=CLIENT://127.0.0.1:1,CONTROLLER://127.0.0.1:2\n"
                 "listener.security.protocol.map=CLIENT:PLAINTEXT,CONTROLLER:PLAINTEXT\n"
                 "inter.broker.listener.name=CLIENT\ncontroller.listener.names=CONTROLLER\n"
                 "log.dirs=%s\n",
                 id, v, data);
        if (write_text(props, text) != 0)
            return -1;
        char *argv[] = {C.java,
                        "-XX:TieredStopAtLevel=1",
                        "-XX:+UseSerialGC",
                        "-XX:-UsePerfData",
                        "-cp",
                        C.classpath,
                        "kafka.tools.StorageTool",
                        "format",
                        "-t",
                        CLUSTER_ID,
                        "-c",
                        props,
                        NULL};
        if (run(argv, log) != 0) {
            say("kafka.tools.StorageTool format failed; see %s", log);
            return -1;
        }
    }
    return 0;
}

static bool metadata_has_brokers(rd_kafka_t *rk, int want, int timeout_ms);

/* Runs one node from a copy of the storage with -XX:ArchiveClassesAtExit
 * until it serves, stops it cleanly, and keeps the archive its JVM wrote. */
static int make_cds_archive(const char *log)
{
    char from[340], data[320], props[330], tmp[360], dump[400], bs[64], err[256];
    struct node nd = {.id = 1};
    snprintf(nd.dir, sizeof(nd.dir), "%s/cds-scratch.%ld", C.cache, (long)getpid());
    snprintf(from, sizeof(from), "%s/n1", C.storage_template);
    snprintf(data, sizeof(data), "%s/data", nd.dir);
    snprintf(props, sizeof(props), "%s/server.properties", nd.dir);
    snprintf(tmp, sizeof(tmp), "%s.tmp.%ld", C.cds_archive, (long)getpid());
    snprintf(dump, sizeof(dump), "-XX:ArchiveClassesAtExit=%s", tmp);
    nd.client_port = nd.proxy_port = free_port();
    nd.internal_port = free_port();
    nd.controller_port = free_port();
    remove_tree(nd.dir);
    int rc = -1;
    if (mkdir(nd.dir, 0755) == 0 && copy_tree(from, data, log) == 0 &&
        write_properties(&nd, &nd, 1, false) == 0) {
        char *argv[] = {C.java,
                        "-Xms64m",
                        "-Xmx512m",
                        "-XX:+UseSerialGC",
                        "-XX:TieredStopAtLevel=1",
                        "-XX:-UsePerfData",
                        dump,
                        "-cp",
                        C.classpath,
                        "kafka.Kafka",
                        props,
                        NULL};
        nd.pid = spawn_java(argv, log, nd.dir);
    }
    if (nd.pid > 0) {
        nd.state = NODE_RUNNING;
        snprintf(bs, sizeof(bs), "127.0.0.1:%d", nd.internal_port);
        rd_kafka_conf_t *conf = rd_kafka_conf_new();
        rd_kafka_conf_set(conf, "bootstrap.servers", bs, err, sizeof(err));
        rd_kafka_conf_set(conf, "log_level", "0", err, sizeof(err));
        rd_kafka_t *rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, err, sizeof(err));
        bool up = rk && metadata_has_brokers(rk, 1, 60000);
        if (rk)
            rd_kafka_destroy(rk);
        if (!up)
            say("the node that makes the class-data archive did not come up; see %s", log);
        if (node_stop(&nd, 60000) && up && access(tmp, R_OK) == 0 &&
            rename(tmp, C.cds_archive) == 0)
            rc = 0;
    }
    node_kill(&nd);
    unlink(tmp);
    remove_tree(nd.dir);
    return rc;
}

/* Formats the storage template and makes the archive if the cache lacks
 * them; racing processes wait for each other on a lock. */
static int prepare_cache(void)
{
    char lock[280], log[280];
    struct stat st;
    uint64_t h = fnv1a(1469598103934665603ULL, CACHE_RECIPE, sizeof(CACHE_RECIPE));
    h = fnv1a(h, C.classpath, strlen(C.classpath));
    char real[PATH_MAX];
    if (realpath(C.java, real) && stat(real, &st) == 0) {
        int64_t id[2] = {(int64_t)st.st_size, (int64_t)st.st_mtime};
        h = fnv1a(h, real, strlen(real));
        h = fnv1a(h, id, sizeof(id));
    }
    if (mkdir(C.cache, 0755) != 0 && errno != EEXIST) {
        say("cannot make the cache directory %s: %s", C.cache, strerror(errno));
        return -1;
    }
    snprintf(C.storage_template, sizeof(C.storage_template), "%s/storage-%016llx", C.cache,
             (unsigned long long)h);
    snprintf(C.cds_archive, sizeof(C.cds_archive), "%s/classes-%016llx.jsa", C.cache,
             (unsigned long long)h);
    if (access(C.storage_template, F_OK) == 0 && access(C.cds_archive, R_OK) == 0)
        return 0;
    snprintf(lock, sizeof(lock), "%s/prepare.lock", C.cache);
    snprintf(log, sizeof(log), "%s/prepare.log", C.cache);
    int fd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0 || flock(fd, LOCK_EX) != 0) {
        say("cannot lock %s: %s", lock, strerror(errno));
        if (fd >= 0)
            close(fd);
        return -1;
    }
    int rc = 0;
    int64_t t0 = now_ms();
    if (access(C.storage_template, F_OK) != 0) {
        char tmp[360];
        snprintf(tmp, sizeof(tmp), "%s.tmp.%ld", C.storage_template, (long)getpid());
        remove_tree(tmp);
        if (mkdir(tmp, 0755) != 0 || format_storage(tmp, log) != 0 ||
            rename(tmp, C.storage_template) != 0) {
            remove_tree(tmp);
            rc = -1;
        }
    }
    /* Without the archive nodes start all the same, only slower. */
    if (rc == 0 && access(C.cds_archive, R_OK) != 0 && make_cds_archive(log) != 0)
        say("no class-data archive (see %s); nodes start without one", log);
    if (now_ms() - t0 > 100)
        say("prepared %s in %lld ms (once per machine)", C.cache, (long long)(now_ms() - t0));
    flock(fd, LOCK_UN);
    close(fd);
    return rc;
}

/* --- the admin handle and what it asks the cluster ---------------------- */

static bool metadata_has_brokers(rd_kafka_t *rk, int want, int timeout_ms)
{
    int64_t deadline = now_ms() + timeout_ms;
    while (!stop_requested) {
        const struct rd_kafka_metadata *md = NULL;
        if (rd_kafka_metadata(rk, 0, NULL, &md, 1000) == RD_KAFKA_RESP_ERR_NO_ERROR) {
            int n = md->broker_cnt;
            rd_kafka_metadata_destroy(md);
            if (n >= want)
                return true;
        }
        if (now_ms() > deadline)
            return false;
        sleep_ms(100);
    }
    return false;
}

/* Metadata of every topic (internal ones too), or NULL after timeout_ms. */
static const struct rd_kafka_metadata *metadata(int timeout_ms)
{
    int64_t deadline = now_ms() + timeout_ms;
    while (!stop_requested) {
        const struct rd_kafka_metadata *md = NULL;
        if (rd_kafka_metadata(C.admin, 1, NULL, &md, 2000) == RD_KAFKA_RESP_ERR_NO_ERROR)
            return md;
        if (now_ms() > deadline)
            return NULL;
        sleep_ms(100);
    }
    return NULL;
}

static const rd_kafka_metadata_partition_t *find_partition(const struct rd_kafka_metadata *md,
                                                           const char *topic, long partition)
{
    for (int t = 0; t < md->topic_cnt; t++) {
        if (strcmp(md->topics[t].topic, topic) != 0 || md->topics[t].err)
            continue;
        for (int p = 0; p < md->topics[t].partition_cnt; p++)
            if (md->topics[t].partitions[p].id == partition)
                return &md->topics[t].partitions[p];
    }
    return NULL;
}

/* Whether every running node is a broker in the metadata. */
static bool brokers_listed(const struct rd_kafka_metadata *md)
{
    for (int i = 0; i < C.n; i++) {
        if (C.nodes[i].state != NODE_RUNNING)
            continue;
        bool listed = false;
        for (int b = 0; b < md->broker_cnt && !listed; b++)
            listed = md->brokers[b].id == C.nodes[i].id;
        if (!listed)
            return false;
    }
    return true;
}

static bool wait_brokers_listed(int timeout_ms)
{
    int64_t deadline = now_ms() + timeout_ms;
    while (!stop_requested) {
        const struct rd_kafka_metadata *md = metadata(2000);
        bool ok = md && brokers_listed(md);
        if (md)
            rd_kafka_metadata_destroy(md);
        if (ok)
            return true;
        if (now_ms() > deadline)
            return false;
        sleep_ms(100);
    }
    return false;
}

/* Partitions without a leader or with a replica out of sync (topic NULL:
 * of every topic); -1 if the metadata could not be had. */
static int partitions_not_in_sync(const char *topic, char *first, size_t first_len)
{
    const struct rd_kafka_metadata *md = metadata(2000);
    if (!md)
        return -1;
    int bad = 0;
    for (int t = 0; t < md->topic_cnt; t++) {
        const rd_kafka_metadata_topic_t *mt = &md->topics[t];
        if (topic && strcmp(mt->topic, topic) != 0)
            continue;
        if (topic && mt->err) {
            bad++;
            continue;
        }
        for (int p = 0; p < mt->partition_cnt; p++) {
            const rd_kafka_metadata_partition_t *mp = &mt->partitions[p];
            if (mp->leader >= 0 && mp->isr_cnt == mp->replica_cnt)
                continue;
            if (bad++ == 0 && first)
                snprintf(first, first_len, "%s [%d]: leader %d, %d of %d replicas in sync",
                         mt->topic, mp->id, mp->leader, mp->isr_cnt, mp->replica_cnt);
        }
    }
    if (topic && bad == 0) {
        bool seen = false;
        for (int t = 0; t < md->topic_cnt; t++)
            seen |= strcmp(md->topics[t].topic, topic) == 0 && md->topics[t].partition_cnt > 0;
        bad = seen ? 0 : 1;
    }
    rd_kafka_metadata_destroy(md);
    return bad;
}

static bool wait_in_sync(const char *topic, int timeout_ms, char *why, size_t why_len)
{
    int64_t deadline = now_ms() + timeout_ms;
    why[0] = '\0';
    while (!stop_requested) {
        if (partitions_not_in_sync(topic, why, why_len) == 0)
            return true;
        if (now_ms() > deadline)
            return false;
        sleep_ms(100);
    }
    return false;
}

static rd_kafka_event_t *admin_wait(rd_kafka_queue_t *q, int timeout_ms)
{
    int64_t deadline = now_ms() + timeout_ms;
    while (!stop_requested && now_ms() < deadline) {
        rd_kafka_event_t *ev = rd_kafka_queue_poll(q, 200);
        if (ev)
            return ev;
    }
    return NULL;
}

/* Creates a topic with `nconf` "key=value" settings; 0, or -1 with why. */
static int create_topic(const char *name, int partitions, char **conf, int nconf, char *why,
                        size_t why_len)
{
    int rf = C.n < 3 ? C.n : 3;
    rd_kafka_NewTopic_t *nt = rd_kafka_NewTopic_new(name, partitions, rf, why, why_len);
    if (!nt)
        return -1;
    for (int i = 0; i < nconf; i++) {
        char *eq = strchr(conf[i], '=');
        if (!eq) {
            snprintf(why, why_len, "%s is not key=value", conf[i]);
            rd_kafka_NewTopic_destroy(nt);
            return -1;
        }
        *eq = '\0';
        rd_kafka_resp_err_t e = rd_kafka_NewTopic_set_config(nt, conf[i], eq + 1);
        *eq = '=';
        if (e) {
            snprintf(why, why_len, "%s: %s", conf[i], rd_kafka_err2str(e));
            rd_kafka_NewTopic_destroy(nt);
            return -1;
        }
    }
    rd_kafka_queue_t *q = rd_kafka_queue_new(C.admin);
    rd_kafka_CreateTopics(C.admin, &nt, 1, NULL, q);
    rd_kafka_NewTopic_destroy(nt);
    rd_kafka_event_t *ev = admin_wait(q, 30000);
    int rc = -1;
    if (!ev) {
        snprintf(why, why_len, "no answer to CreateTopics within 30 s");
    } else if (rd_kafka_event_error(ev)) {
        snprintf(why, why_len, "%s", rd_kafka_event_error_string(ev));
    } else {
        size_t cnt;
        const rd_kafka_topic_result_t **res =
            rd_kafka_CreateTopics_result_topics(rd_kafka_event_CreateTopics_result(ev), &cnt);
        if (cnt == 1 && rd_kafka_topic_result_error(res[0]) == 0)
            rc = 0;
        else if (cnt == 1)
            snprintf(why, why_len, "%s: %s", rd_kafka_err2name(rd_kafka_topic_result_error(res[0])),
                     rd_kafka_topic_result_error_string(res[0])
                         ? rd_kafka_topic_result_error_string(res[0])
                         : "");
        else
            snprintf(why, why_len, "CreateTopics answered %zu results", cnt);
    }
    if (ev)
        rd_kafka_event_destroy(ev);
    rd_kafka_queue_destroy(q);
    if (rc == 0 && !wait_in_sync(name, 30000, why, why_len)) {
        snprintf(why + strlen(why), why_len - strlen(why), " (not in sync within 30 s)");
        rc = -1;
    }
    return rc;
}

/* "name:partitions[:key=value,...]" from -t. */
static int create_topic_spec(char *spec, char *why, size_t why_len)
{
    char *conf[32];
    int nconf = 0;
    long parts = 1;
    char *colon = strchr(spec, ':');
    if (colon) {
        *colon = '\0';
        char *rest = colon + 1, *settings = strchr(rest, ':');
        if (settings) {
            *settings++ = '\0';
            for (char *tok = strtok(settings, ","); tok && nconf < 32; tok = strtok(NULL, ","))
                conf[nconf++] = tok;
        }
        if (parse_long(rest, &parts) != 0 || parts < 1) {
            snprintf(why, why_len, "bad partition count %s", rest);
            return -1;
        }
    }
    return create_topic(spec, (int)parts, conf, nconf, why, why_len);
}

static const struct {
    const char *name;
    rd_kafka_AclOperation_t op;
} acl_ops[] = {
    {"all", RD_KAFKA_ACL_OPERATION_ALL},       {"read", RD_KAFKA_ACL_OPERATION_READ},
    {"write", RD_KAFKA_ACL_OPERATION_WRITE},   {"describe", RD_KAFKA_ACL_OPERATION_DESCRIBE},
    {"create", RD_KAFKA_ACL_OPERATION_CREATE}, {"delete", RD_KAFKA_ACL_OPERATION_DELETE},
    {"alter", RD_KAFKA_ACL_OPERATION_ALTER},
};

/* acl allow|deny adds a binding; acl remove deletes those of the
 * principal, topic and operation, allowing or denying. */
static int change_acl(const char *perm, const char *principal, const char *topic, const char *op,
                      char *why, size_t why_len)
{
    rd_kafka_AclOperation_t operation = RD_KAFKA_ACL_OPERATION_UNKNOWN;
    for (size_t i = 0; i < sizeof(acl_ops) / sizeof(acl_ops[0]); i++)
        if (strcmp(acl_ops[i].name, op) == 0)
            operation = acl_ops[i].op;
    if (operation == RD_KAFKA_ACL_OPERATION_UNKNOWN) {
        snprintf(why, why_len,
                 "unknown operation %s (all, read, write, describe, create, delete or alter)", op);
        return -1;
    }
    bool remove = strcmp(perm, "remove") == 0;
    rd_kafka_AclPermissionType_t pt =
        strcmp(perm, "allow") == 0  ? RD_KAFKA_ACL_PERMISSION_TYPE_ALLOW
        : strcmp(perm, "deny") == 0 ? RD_KAFKA_ACL_PERMISSION_TYPE_DENY
        : remove                    ? RD_KAFKA_ACL_PERMISSION_TYPE_ANY
                                    : RD_KAFKA_ACL_PERMISSION_TYPE_UNKNOWN;
    if (pt == RD_KAFKA_ACL_PERMISSION_TYPE_UNKNOWN) {
        snprintf(why, why_len, "allow, deny or remove, not %s", perm);
        return -1;
    }
    rd_kafka_AclBinding_t *b =
        remove ? rd_kafka_AclBindingFilter_new(RD_KAFKA_RESOURCE_TOPIC, topic,
                                               RD_KAFKA_RESOURCE_PATTERN_LITERAL, principal, "*",
                                               operation, pt, why, why_len)
               : rd_kafka_AclBinding_new(RD_KAFKA_RESOURCE_TOPIC, topic,
                                         RD_KAFKA_RESOURCE_PATTERN_LITERAL, principal, "*",
                                         operation, pt, why, why_len);
    if (!b)
        return -1;
    rd_kafka_queue_t *q = rd_kafka_queue_new(C.admin);
    if (remove)
        rd_kafka_DeleteAcls(C.admin, &b, 1, NULL, q);
    else
        rd_kafka_CreateAcls(C.admin, &b, 1, NULL, q);
    rd_kafka_AclBinding_destroy(b);
    rd_kafka_event_t *ev = admin_wait(q, 30000);
    int rc = -1;
    if (!ev) {
        snprintf(why, why_len, "no answer to CreateAcls within 30 s");
    } else if (rd_kafka_event_error(ev)) {
        snprintf(why, why_len, "%s", rd_kafka_event_error_string(ev));
    } else if (remove) {
        size_t cnt;
        const rd_kafka_DeleteAcls_result_response_t **res =
            rd_kafka_DeleteAcls_result_responses(rd_kafka_event_DeleteAcls_result(ev), &cnt);
        const rd_kafka_error_t *e =
            cnt == 1 ? rd_kafka_DeleteAcls_result_response_error(res[0]) : NULL;
        if (cnt == 1 && !e)
            rc = 0;
        else
            snprintf(why, why_len, "%s", e ? rd_kafka_error_string(e) : "no result");
    } else {
        size_t cnt;
        const rd_kafka_acl_result_t **res =
            rd_kafka_CreateAcls_result_acls(rd_kafka_event_CreateAcls_result(ev), &cnt);
        const rd_kafka_error_t *e = cnt == 1 ? rd_kafka_acl_result_error(res[0]) : NULL;
        if (cnt == 1 && !e)
            rc = 0;
        else
            snprintf(why, why_len, "%s", e ? rd_kafka_error_string(e) : "no result");
    }
    if (ev)
        rd_kafka_event_destroy(ev);
    rd_kafka_queue_destroy(q);
    /* Each broker's authorizer takes the binding from the metadata log a
     * moment later; nothing answers when all have it. */
    if (rc == 0)
        sleep_ms(1000);
    return rc;
}

/* The quorum's leader: of the running nodes' quorum-state files, the one
 * with the highest epoch that names a leader. */
static int active_controller(int timeout_ms)
{
    int64_t deadline = now_ms() + timeout_ms;
    while (!stop_requested) {
        long best_epoch = -1, leader = -1;
        for (int i = 0; i < C.n; i++) {
            char path[400];
            if (C.nodes[i].state != NODE_RUNNING)
                continue;
            snprintf(path, sizeof(path), "%s/data/__cluster_metadata-0/quorum-state",
                     C.nodes[i].dir);
            char *s = read_text(path);
            const char *l = s ? strstr(s, "\"leaderId\":") : NULL;
            const char *e = s ? strstr(s, "\"leaderEpoch\":") : NULL;
            if (l && e) {
                long lid = strtol(l + 11, NULL, 10), epoch = strtol(e + 14, NULL, 10);
                if (epoch > best_epoch) {
                    best_epoch = epoch;
                    leader = lid;
                }
            }
            free(s);
        }
        bool leader_runs = false;
        for (int i = 0; i < C.n; i++)
            leader_runs |= C.nodes[i].id == leader && C.nodes[i].state == NODE_RUNNING;
        if (leader_runs)
            return (int)leader;
        if (now_ms() > deadline)
            return -1;
        sleep_ms(100);
    }
    return -1;
}

/* Java's String.hashCode of an ASCII id, and Kafka's Utils.abs of it. */
static int32_t java_abs_hash(const char *s)
{
    uint32_t h = 0;
    for (; *s; s++)
        h = 31 * h + (unsigned char)*s;
    int32_t v = (int32_t)h;
    return v == INT32_MIN ? 0 : (v < 0 ? -v : v);
}

static int coordinator(const char *kind, const char *id, char *why, size_t why_len)
{
    const char *topic = strcmp(kind, "txn") == 0     ? "__transaction_state"
                        : strcmp(kind, "group") == 0 ? "__consumer_offsets"
                                                     : NULL;
    if (!topic) {
        snprintf(why, why_len, "txn or group, not %s", kind);
        return -1;
    }
    const struct rd_kafka_metadata *md = metadata(5000);
    int leader = -1, parts = 0;
    for (int t = 0; md && t < md->topic_cnt; t++)
        if (strcmp(md->topics[t].topic, topic) == 0 && !md->topics[t].err)
            parts = md->topics[t].partition_cnt;
    if (parts > 0) {
        const rd_kafka_metadata_partition_t *mp =
            find_partition(md, topic, java_abs_hash(id) % parts);
        leader = mp ? mp->leader : -1;
    }
    if (md)
        rd_kafka_metadata_destroy(md);
    if (parts == 0)
        snprintf(why, why_len, "%s does not exist yet (no client has asked for a coordinator)",
                 topic);
    else if (leader < 0)
        snprintf(why, why_len, "its partition of %s has no leader", topic);
    return parts > 0 && leader >= 0 ? leader : -1;
}

/* --- commands ----------------------------------------------------------- */

/* "all" or a node id: fills which[] and returns how many, or -1. */
static int parse_nodes(const char *s, struct node **which)
{
    long id;
    int n = 0;
    if (s && strcmp(s, "all") == 0) {
        for (int i = 0; i < C.n; i++)
            which[n++] = &C.nodes[i];
        return n;
    }
    if (parse_long(s, &id) != 0)
        return -1;
    for (int i = 0; i < C.n; i++)
        if (C.nodes[i].id == id)
            which[n++] = &C.nodes[i];
    return n == 1 ? 1 : -1;
}

static const char *start_nodes(struct node **which, int n, char *reply, size_t len)
{
    for (int i = 0; i < n; i++) {
        if (which[i]->state != NODE_DOWN)
            continue;
        if (node_start(which[i]) != 0) {
            snprintf(reply, len, "error: node %d did not start", which[i]->id);
            return reply;
        }
    }
    if (!wait_brokers_listed(90000)) {
        snprintf(reply, len, "error: not every running node is in the metadata within 90 s");
        return reply;
    }
    return "ok";
}

static const char *run_command(char *line, char *reply, size_t len)
{
    char *argv[40];
    int argc = 0;
    struct node *which[MAX_NODES];
    char why[512];
    long a;

    for (char *tok = strtok(line, " \t\r\n"); tok && argc < 40; tok = strtok(NULL, " \t\r\n"))
        argv[argc++] = tok;
    if (argc == 0)
        return NULL;
    const char *cmd = argv[0];
    int nw = argc == 2 ? parse_nodes(argv[1], which) : -1;
    bool node_cmd = strcmp(cmd, "kill") == 0 || strcmp(cmd, "stop") == 0 ||
                    strcmp(cmd, "start") == 0 || strcmp(cmd, "restart") == 0 ||
                    strcmp(cmd, "pause") == 0 || strcmp(cmd, "cont") == 0 ||
                    strcmp(cmd, "cut") == 0 || strcmp(cmd, "blackhole") == 0 ||
                    strcmp(cmd, "heal") == 0 || strcmp(cmd, "pid") == 0;
    if (node_cmd && nw < 0) {
        snprintf(reply, len, "error: %s takes a node (1 to %d) or all", cmd, C.n);
        return reply;
    }
    reap();
    if (strcmp(cmd, "kill") == 0) {
        for (int i = 0; i < nw; i++)
            node_kill(which[i]);
        return "ok";
    }
    if (strcmp(cmd, "stop") == 0 || strcmp(cmd, "restart") == 0) {
        bool clean = true;
        /* All at once: stopped one by one, the last ones would wait for a
         * quorum that is gone. */
        for (int i = 0; i < nw; i++) {
            if (which[i]->state == NODE_PAUSED)
                kill(which[i]->pid, SIGCONT);
            if (which[i]->pid > 0)
                kill(which[i]->pid, SIGTERM);
        }
        for (int i = 0; i < nw; i++)
            clean &= node_stop(which[i], 60000);
        if (strcmp(cmd, "restart") == 0)
            return start_nodes(which, nw, reply, len);
        return clean ? "ok" : "ok killed after 60 s";
    }
    if (strcmp(cmd, "start") == 0)
        return start_nodes(which, nw, reply, len);
    if (strcmp(cmd, "pause") == 0 || strcmp(cmd, "cont") == 0) {
        bool pause = strcmp(cmd, "pause") == 0;
        for (int i = 0; i < nw; i++) {
            if (which[i]->state == NODE_DOWN)
                continue;
            kill(which[i]->pid, pause ? SIGSTOP : SIGCONT);
            which[i]->state = pause ? NODE_PAUSED : NODE_RUNNING;
        }
        return "ok";
    }
    if (strcmp(cmd, "cut") == 0 || strcmp(cmd, "blackhole") == 0 || strcmp(cmd, "heal") == 0) {
        if (!C.proxy)
            return "error: no proxy: start the cluster with -x";
        enum tp_mode m = strcmp(cmd, "cut") == 0         ? TP_CUT
                         : strcmp(cmd, "blackhole") == 0 ? TP_BLACKHOLE
                                                         : TP_OPEN;
        for (int i = 0; i < nw; i++)
            tp_set_mode(which[i]->id - 1, m);
        return "ok";
    }
    if (strcmp(cmd, "nodes") == 0 && argc == 1) {
        size_t used = (size_t)snprintf(reply, len, "ok");
        for (int i = 0; i < C.n && used < len; i++)
            used += (size_t)snprintf(reply + used, len - used, " %d:%s", C.nodes[i].id,
                                     state_names[C.nodes[i].state]);
        return reply;
    }
    if (strcmp(cmd, "pid") == 0) {
        snprintf(reply, len, "ok %ld", (long)which[0]->pid);
        return reply;
    }
    if (strcmp(cmd, "topic") == 0 && argc >= 3 && parse_long(argv[2], &a) == 0 && a > 0) {
        if (create_topic(argv[1], (int)a, argv + 3, argc - 3, why, sizeof(why)) != 0) {
            snprintf(reply, len, "error: topic %s: %s", argv[1], why);
            return reply;
        }
        return "ok";
    }
    if ((strcmp(cmd, "leader") == 0 || strcmp(cmd, "isr") == 0) && argc == 3 &&
        parse_long(argv[2], &a) == 0) {
        const struct rd_kafka_metadata *md = metadata(5000);
        const rd_kafka_metadata_partition_t *mp = md ? find_partition(md, argv[1], a) : NULL;
        if (!mp)
            snprintf(reply, len, "error: no partition %s [%ld] in the metadata", argv[1], a);
        else if (strcmp(cmd, "leader") == 0)
            snprintf(reply, len, "ok %d", mp->leader);
        else {
            size_t used = (size_t)snprintf(reply, len, "ok ");
            for (int i = 0; i < mp->isr_cnt && used < len; i++)
                used +=
                    (size_t)snprintf(reply + used, len - used, "%s%d", i ? "," : "", mp->isrs[i]);
        }
        if (md)
            rd_kafka_metadata_destroy(md);
        return reply;
    }
    if (strcmp(cmd, "wait-isr") == 0 && argc <= 2) {
        long ms = 60000;
        if (argc == 2 && parse_long(argv[1], &ms) != 0)
            return "error: wait-isr takes milliseconds";
        if (!wait_in_sync(NULL, (int)ms, why, sizeof(why))) {
            snprintf(reply, len, "error: not in sync within %ld ms: %s", ms, why);
            return reply;
        }
        return "ok";
    }
    if (strcmp(cmd, "controller") == 0 && argc == 1) {
        int id = active_controller(30000);
        if (id < 0)
            return "error: no running node is the quorum's leader within 30 s";
        snprintf(reply, len, "ok %d", id);
        return reply;
    }
    if (strcmp(cmd, "coordinator") == 0 && argc == 3) {
        int id = coordinator(argv[1], argv[2], why, sizeof(why));
        if (id < 0)
            snprintf(reply, len, "error: %s", why);
        else
            snprintf(reply, len, "ok %d", id);
        return reply;
    }
    if (strcmp(cmd, "acl") == 0 && argc == 5) {
        if (!C.sasl)
            return "error: no authorizer: start the cluster with -s";
        if (change_acl(argv[1], argv[2], argv[3], argv[4], why, sizeof(why)) != 0) {
            snprintf(reply, len, "error: acl: %s", why);
            return reply;
        }
        return "ok";
    }
    static const char *const mock_only[] = {"down",         "up",          "rtt",  "push-errors",
                                            "clear-errors", "topic-error", "stats"};
    for (size_t i = 0; i < sizeof(mock_only) / sizeof(mock_only[0]); i++)
        if (strcmp(cmd, mock_only[i]) == 0) {
            snprintf(reply, len, "error: %s is a command of the mock broker, not of a real cluster",
                     cmd);
            return reply;
        }
    return "error: unknown command or bad arguments";
}

/* --- start-up and the loop ---------------------------------------------- */

static void usage(const char *prog)
{
    fprintf(stderr,
            "usage: %s [-n 1|3] [-t topic:partitions[:key=value,...]]... [-o key=value]...\n"
            "       [-x] [-s] [-d dir] [-k] [-f bootstrap_file] [-c classpath_file]\n"
            "       [-C cache_dir] [-J jvm_options]\n",
            prog);
}

static int write_bootstrap_file(const char *path, const char *servers)
{
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    if (write_text(tmp, servers) != 0)
        return -1;
    return rename(tmp, path);
}

static void teardown(void)
{
    if (C.admin) {
        rd_kafka_destroy(C.admin);
        C.admin = NULL;
    }
    for (int i = 0; i < C.n; i++)
        if (C.nodes[i].pid > 0)
            kill(C.nodes[i].pid, SIGKILL);
    for (int i = 0; i < C.n; i++)
        wait_gone(&C.nodes[i], 10000);
    if (C.proxy)
        tp_stop();
    if (C.own_dir && !C.keep && C.dir[0])
        remove_tree(C.dir);
    else if (C.dir[0])
        say("kept %s", C.dir);
}

static int start_cluster(char **topics, int ntopics)
{
    char why[512];
    int64_t t0 = now_ms();
    for (int i = 0; i < C.n; i++) {
        struct node *nd = &C.nodes[i];
        char from[340], to[400], log[400];
        nd->id = i + 1;
        nd->client_port = free_port();
        nd->internal_port = free_port();
        nd->controller_port = free_port();
        nd->proxy_port = C.proxy ? free_port() : nd->client_port;
        snprintf(nd->dir, sizeof(nd->dir), "%s/n%d", C.dir, nd->id);
        if (mkdir(nd->dir, 0755) != 0 && errno != EEXIST) {
            say("cannot make %s: %s", nd->dir, strerror(errno));
            return -1;
        }
        snprintf(from, sizeof(from), "%s/n%d", C.storage_template, nd->id);
        snprintf(to, sizeof(to), "%s/data", nd->dir);
        snprintf(log, sizeof(log), "%s/kafka.log", nd->dir);
        if (copy_tree(from, to, log) != 0) {
            say("cannot copy the formatted storage to %s", to);
            return -1;
        }
    }
    if (C.proxy) {
        int listen[MAX_NODES], target[MAX_NODES];
        for (int i = 0; i < C.n; i++) {
            listen[i] = C.nodes[i].proxy_port;
            target[i] = C.nodes[i].client_port;
        }
        if (tp_start(C.n, listen, target) != 0) {
            say("cannot start the proxy: %s", strerror(errno));
            return -1;
        }
    }
    size_t bu = 0, iu = 0;
    for (int i = 0; i < C.n; i++) {
        bu += (size_t)snprintf(C.bootstrap + bu, sizeof(C.bootstrap) - bu, "%s127.0.0.1:%d",
                               i ? "," : "", C.nodes[i].proxy_port);
        iu += (size_t)snprintf(C.internal + iu, sizeof(C.internal) - iu, "%s127.0.0.1:%d",
                               i ? "," : "", C.nodes[i].internal_port);
    }
    for (int i = 0; i < C.n; i++)
        if (node_start(&C.nodes[i]) != 0) {
            say("node %d did not start", C.nodes[i].id);
            return -1;
        }
    char err[512];
    rd_kafka_conf_t *conf = rd_kafka_conf_new();
    rd_kafka_conf_set(conf, "bootstrap.servers", C.internal, err, sizeof(err));
    rd_kafka_conf_set(conf, "log_level", "2", err, sizeof(err));
    /* A paused node's requests time out and the next try asks another. */
    rd_kafka_conf_set(conf, "socket.timeout.ms", "5000", err, sizeof(err));
    rd_kafka_conf_set(conf, "allow.auto.create.topics", "false", err, sizeof(err));
    C.admin = rd_kafka_new(RD_KAFKA_PRODUCER, conf, err, sizeof(err));
    if (!C.admin) {
        say("admin client: %s", err);
        return -1;
    }
    if (!wait_brokers_listed(120000)) {
        say("not every node is in the metadata within 120 s; see %s/n*/kafka.log", C.dir);
        return -1;
    }
    int64_t ready = now_ms();
    for (int i = 0; i < ntopics; i++) {
        char copy[512];
        snprintf(copy, sizeof(copy), "%s", topics[i]);
        if (create_topic_spec(copy, why, sizeof(why)) != 0) {
            say("topic %s: %s", topics[i], why);
            return -1;
        }
    }
    say("%d node%s up in %lld ms, %d topic%s in %lld ms more; %s", C.n, C.n == 1 ? "" : "s",
        (long long)(ready - t0), ntopics, ntopics == 1 ? "" : "s", (long long)(now_ms() - ready),
        C.dir);
    return 0;
}

static char *read_classpath(const char *file)
{
    char *cp = read_text(file);
    if (!cp) {
        say("cannot read the classpath file %s: %s (tests/kafka/classpath.sh writes it)", file,
            strerror(errno));
        return NULL;
    }
    cp[strcspn(cp, "\r\n")] = '\0';
    if (!*cp) {
        say("%s is empty", file);
        free(cp);
        return NULL;
    }
    return cp;
}

int main(int argc, char **argv)
{
    const char *classpath_file = OBX_KAFKA_CLASSPATH_FILE, *bootstrap_file = NULL;
    const char *cache = NULL;
    char *topics[MAX_TOPICS];
    int ntopics = 0, opt;
    long n = 3;
    struct sigaction sa;

    while ((opt = getopt(argc, argv, "n:t:o:xsd:kf:c:C:J:h")) != -1) {
        switch (opt) {
        case 'n':
            if (parse_long(optarg, &n) != 0 || (n != 1 && n != 3)) {
                fprintf(stderr, "obx-kafka-cluster: -n is 1 or 3, not %s\n", optarg);
                return 2;
            }
            break;
        case 't':
            if (ntopics == MAX_TOPICS) {
                fprintf(stderr, "obx-kafka-cluster: at most %d topics\n", MAX_TOPICS);
                return 2;
            }
            topics[ntopics++] = optarg;
            break;
        case 'o':
            if (C.noverrides == MAX_OVERRIDES || !strchr(optarg, '=')) {
                fprintf(stderr, "obx-kafka-cluster: -o takes key=value (at most %d)\n",
                        MAX_OVERRIDES);
                return 2;
            }
            C.overrides[C.noverrides++] = optarg;
            break;
        case 'x':
            C.proxy = true;
            break;
        case 's':
            C.sasl = true;
            break;
        case 'd':
            if (strlen(optarg) >= sizeof(C.dir) - 40) {
                fprintf(stderr, "obx-kafka-cluster: -d: the directory's name is too long\n");
                return 2;
            }
            snprintf(C.dir, sizeof(C.dir), "%s", optarg);
            break;
        case 'k':
            C.keep = true;
            break;
        case 'f':
            bootstrap_file = optarg;
            break;
        case 'c':
            classpath_file = optarg;
            break;
        case 'C':
            cache = optarg;
            break;
        case 'J':
            C.jvm_opts = optarg;
            break;
        default:
            usage(argv[0]);
            return 2;
        }
    }
    if (optind != argc) {
        usage(argv[0]);
        return 2;
    }
    C.n = (int)n;

    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_stop_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sa.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &sa, NULL);

    if (find_java() != 0) {
        say("no java on PATH (nor in $JAVA_HOME/bin): Kafka 4 needs Java 17 or later "
            "(apt-get install openjdk-17-jre-headless; scripts/deps does)");
        return 1;
    }
    C.classpath = read_classpath(classpath_file);
    if (!C.classpath)
        return 1;
    if (cache && strlen(cache) >= sizeof(C.cache) - 40) {
        say("-C: the cache directory's name is too long");
        free(C.classpath);
        return 2;
    }
    if (cache) {
        snprintf(C.cache, sizeof(C.cache), "%s", cache);
    } else {
        const char *slash = strrchr(classpath_file, '/');
        int dirlen = slash ? (int)(slash - classpath_file) : 1;
        snprintf(C.cache, sizeof(C.cache), "%.*s/cache", dirlen, slash ? classpath_file : ".");
    }
    if (prepare_cache() != 0) {
        free(C.classpath);
        return 1;
    }
    if (!C.dir[0]) {
        snprintf(C.dir, sizeof(C.dir), "/tmp/obx-kafka-XXXXXX");
        if (!mkdtemp(C.dir)) {
            say("mkdtemp: %s", strerror(errno));
            free(C.classpath);
            return 1;
        }
        C.own_dir = true;
    } else if (mkdir(C.dir, 0755) != 0 && errno != EEXIST) {
        say("cannot make %s: %s", C.dir, strerror(errno));
        free(C.classpath);
        return 1;
    }

    if (start_cluster(topics, ntopics) != 0 || stop_requested) {
        teardown();
        free(C.classpath);
        return 1;
    }
    if (bootstrap_file && write_bootstrap_file(bootstrap_file, C.bootstrap) != 0) {
        say("cannot write %s: %s", bootstrap_file, strerror(errno));
        teardown();
        free(C.classpath);
        return 1;
    }
    printf("internal %s\nbootstrap %s\n", C.internal, C.bootstrap);
    fflush(stdout);

    char line[2048], reply[1024];
    size_t used = 0;
    bool stdin_open = true;
    while (!stop_requested) {
        struct pollfd pfd = {.fd = STDIN_FILENO, .events = POLLIN};
        int r = poll(&pfd, stdin_open ? 1 : 0, 200);
        reap();
        if (r <= 0 || !stdin_open)
            continue;
        ssize_t got = read(STDIN_FILENO, line + used, sizeof(line) - 1 - used);
        if (got <= 0) {
            stdin_open = false; /* keep serving until a signal */
            continue;
        }
        used += (size_t)got;
        line[used] = '\0';
        char *nl;
        while ((nl = strchr(line, '\n')) != NULL) {
            *nl = '\0';
            const char *answer = run_command(line, reply, sizeof(reply));
            if (answer) {
                printf("%s\n", answer);
                fflush(stdout);
            }
            size_t rest = used - (size_t)(nl + 1 - line);
            memmove(line, nl + 1, rest + 1);
            used = rest;
        }
        if (used == sizeof(line) - 1)
            used = 0; /* an absurdly long line: drop it */
    }
    teardown();
    free(C.classpath);
    return 0;
}
