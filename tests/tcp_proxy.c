/*
 * The TCP proxy of obx-kafka-cluster (see tcp_proxy.h).
 */
#include "tcp_proxy.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define TP_MAX_CONNS 512
#define TP_BUF       65536

/* One client connection and the one it opened to the broker. buf[d] holds
 * bytes read from fd[d] and not yet written to fd[1 - d]. */
struct tp_conn {
    int fd[2]; /* 0 = the client's, 1 = to the broker */
    int listener;
    size_t off[2], len[2];
    char buf[2][TP_BUF];
};

static struct {
    pthread_t thread;
    bool running;
    int n;
    int listen_fd[TP_MAX_LISTENERS];
    int target_port[TP_MAX_LISTENERS];
    int wake[2]; /* a byte here: modes changed, or stop */
    /* Written by tp_set_mode under lock; the thread applies them and
     * raises `applied` to the generation it saw. */
    pthread_mutex_t lock;
    pthread_cond_t cond;
    enum tp_mode mode[TP_MAX_LISTENERS];
    unsigned long generation, applied;
    bool stop;
    /* The thread's own. */
    enum tp_mode active[TP_MAX_LISTENERS];
    struct tp_conn *conns[TP_MAX_CONNS];
    int nconns;
    unsigned long accepted; /* read by tp_connections under lock */
} tp = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};

static void set_nonblocking(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        (void)fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* Closes with a reset rather than a FIN: the peer sees ECONNRESET. */
static void close_reset(int fd)
{
    struct linger lg = {.l_onoff = 1, .l_linger = 0};
    (void)setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
    close(fd);
}

static void conn_close(int i, bool reset)
{
    struct tp_conn *c = tp.conns[i];
    for (int d = 0; d < 2; d++) {
        if (reset)
            close_reset(c->fd[d]);
        else
            close(c->fd[d]);
    }
    free(c);
    tp.conns[i] = tp.conns[--tp.nconns];
}

static int listen_on(int port)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    int one = 1;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(fd, 128) != 0) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    set_nonblocking(fd);
    return fd;
}

static void accept_one(int l)
{
    /* Close-on-exec, as every socket here: a node started later (fork and
     * exec in this process) would keep a copy of it, and our close would
     * then never reach the client (the connection of a broker that shut
     * down stayed open to the relay, which waited for its answer). */
    int cfd = accept4(tp.listen_fd[l], NULL, NULL, SOCK_CLOEXEC);
    if (cfd < 0)
        return;
    if (tp.active[l] == TP_CUT || tp.nconns == TP_MAX_CONNS) {
        close_reset(cfd);
        return;
    }
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)tp.target_port[l])};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int bfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    /* A loopback connect succeeds or is refused at once (a broker that is
     * down): then the client is refused too, as it would be without us. */
    if (bfd < 0 || connect(bfd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        if (bfd >= 0)
            close(bfd);
        close_reset(cfd);
        return;
    }
    struct tp_conn *c = calloc(1, sizeof(*c));
    if (!c) {
        close(bfd);
        close_reset(cfd);
        return;
    }
    int one = 1;
    (void)setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    (void)setsockopt(bfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    set_nonblocking(cfd);
    set_nonblocking(bfd);
    c->fd[0] = cfd;
    c->fd[1] = bfd;
    c->listener = l;
    tp.conns[tp.nconns++] = c;
    pthread_mutex_lock(&tp.lock);
    tp.accepted++;
    pthread_mutex_unlock(&tp.lock);
}

/* Moves bytes of connection i as far as the sockets allow; false when a
 * side closed or failed (the caller closes the pair). */
static bool pump(struct tp_conn *c)
{
    for (int d = 0; d < 2; d++) {
        if (c->len[d] == 0) {
            ssize_t r = read(c->fd[d], c->buf[d], TP_BUF);
            if (r == 0)
                return false;
            if (r < 0 && errno != EAGAIN && errno != EINTR)
                return false;
            if (r > 0) {
                c->off[d] = 0;
                c->len[d] = (size_t)r;
            }
        }
        while (c->len[d] > 0) {
            ssize_t w = write(c->fd[1 - d], c->buf[d] + c->off[d], c->len[d]);
            if (w < 0 && (errno == EAGAIN || errno == EINTR))
                break;
            if (w <= 0)
                return false;
            c->off[d] += (size_t)w;
            c->len[d] -= (size_t)w;
        }
    }
    return true;
}

/* Takes the modes tp_set_mode wrote; a cut resets its connections. */
static bool apply_modes(void)
{
    char drain[64];
    while (read(tp.wake[0], drain, sizeof(drain)) > 0) {
    }
    pthread_mutex_lock(&tp.lock);
    bool stop = tp.stop;
    memcpy(tp.active, tp.mode, sizeof(tp.active));
    unsigned long gen = tp.generation;
    pthread_mutex_unlock(&tp.lock);
    for (int i = tp.nconns - 1; i >= 0; i--)
        if (stop || tp.active[tp.conns[i]->listener] == TP_CUT)
            conn_close(i, true);
    pthread_mutex_lock(&tp.lock);
    tp.applied = gen;
    pthread_cond_broadcast(&tp.cond);
    pthread_mutex_unlock(&tp.lock);
    return !stop;
}

static void *tp_main(void *arg)
{
    struct pollfd pfd[1 + TP_MAX_LISTENERS + 2 * TP_MAX_CONNS];
    (void)arg;
    for (;;) {
        int n = 0;
        pfd[n++] = (struct pollfd){.fd = tp.wake[0], .events = POLLIN};
        for (int l = 0; l < tp.n; l++)
            pfd[n++] = (struct pollfd){.fd = tp.listen_fd[l], .events = POLLIN};
        for (int i = 0; i < tp.nconns; i++) {
            struct tp_conn *c = tp.conns[i];
            bool open = tp.active[c->listener] == TP_OPEN;
            for (int d = 0; d < 2; d++) {
                short ev = 0;
                if (open && c->len[d] == 0)
                    ev |= POLLIN;
                if (open && c->len[1 - d] > 0)
                    ev |= POLLOUT;
                pfd[n++] = (struct pollfd){.fd = c->fd[d], .events = ev};
            }
        }
        if (poll(pfd, (nfds_t)n, 1000) < 0 && errno != EINTR)
            break;
        if (pfd[0].revents & POLLIN) {
            if (!apply_modes())
                break;
            continue; /* a cut closed connections: the entries below are stale */
        }
        /* From the last: closing i moves the last connection, already
         * seen, into its place. */
        for (int i = tp.nconns - 1; i >= 0; i--) {
            struct tp_conn *c = tp.conns[i];
            short r0 = pfd[1 + tp.n + 2 * i].revents, r1 = pfd[2 + tp.n + 2 * i].revents;
            if (tp.active[c->listener] != TP_OPEN)
                continue; /* a blackhole forwards nothing, not even a close */
            if ((r0 | r1) && !pump(c))
                conn_close(i, false);
        }
        for (int l = 0; l < tp.n; l++)
            if (pfd[1 + l].revents & POLLIN)
                accept_one(l);
    }
    for (int i = tp.nconns - 1; i >= 0; i--)
        conn_close(i, true);
    return NULL;
}

int tp_start(int n, const int *listen_ports, const int *target_ports)
{
    if (n < 1 || n > TP_MAX_LISTENERS || tp.running) {
        errno = EINVAL;
        return -1;
    }
    if (pipe2(tp.wake, O_NONBLOCK | O_CLOEXEC) != 0)
        return -1;
    for (int i = 0; i < n; i++) {
        tp.listen_fd[i] = listen_on(listen_ports[i]);
        tp.target_port[i] = target_ports[i];
        tp.mode[i] = tp.active[i] = TP_OPEN;
        if (tp.listen_fd[i] < 0) {
            int saved = errno;
            while (i-- > 0)
                close(tp.listen_fd[i]);
            close(tp.wake[0]);
            close(tp.wake[1]);
            errno = saved;
            return -1;
        }
    }
    tp.n = n;
    int rc = pthread_create(&tp.thread, NULL, tp_main, NULL);
    if (rc != 0) {
        for (int i = 0; i < n; i++)
            close(tp.listen_fd[i]);
        close(tp.wake[0]);
        close(tp.wake[1]);
        errno = rc;
        return -1;
    }
    tp.running = true;
    return 0;
}

static void wake_and_wait(void)
{
    /* Called with the lock held; returns with it held. */
    unsigned long gen = ++tp.generation;
    (void)!write(tp.wake[1], "x", 1);
    while (tp.applied < gen && tp.running)
        pthread_cond_wait(&tp.cond, &tp.lock);
}

void tp_set_mode(int i, enum tp_mode mode)
{
    if (!tp.running)
        return;
    pthread_mutex_lock(&tp.lock);
    for (int l = 0; l < tp.n; l++)
        if (i < 0 || i == l)
            tp.mode[l] = mode;
    wake_and_wait();
    pthread_mutex_unlock(&tp.lock);
}

unsigned long tp_connections(void)
{
    pthread_mutex_lock(&tp.lock);
    unsigned long n = tp.accepted;
    pthread_mutex_unlock(&tp.lock);
    return n;
}

void tp_stop(void)
{
    if (!tp.running)
        return;
    pthread_mutex_lock(&tp.lock);
    tp.stop = true;
    (void)!write(tp.wake[1], "x", 1);
    pthread_mutex_unlock(&tp.lock);
    pthread_join(tp.thread, NULL);
    tp.running = false;
    for (int l = 0; l < tp.n; l++)
        close(tp.listen_fd[l]);
    close(tp.wake[0]);
    close(tp.wake[1]);
}
