/*
 * The sequence-checking layer of obx-mock-broker (see seq_proxy.h).
 *
 * Each connection the mock accepts is split with a socketpair: the mock gets
 * one end, this thread shuttles frames between the client's socket and the
 * other. Requests of a connection reach the mock one at a time, as a real
 * broker handles them, so the fate of every batch (stored or refused) is
 * known before the next one is looked at. Produce requests of an idempotent
 * producer are checked against the batches stored so far for their topic,
 * partition, producer id and epoch, with a real broker's rules:
 *
 *   - the same first and last sequence as one of the last 5 stored batches:
 *     a duplicate; answered with that batch's offset, nothing stored again;
 *   - an epoch older than the stored one: INVALID_PRODUCER_EPOCH;
 *   - a new epoch must start at sequence 0 (a producer id with no state
 *     here starts anywhere, as since Kafka 2.5; an id the mock hands out
 *     again at an epoch not above the stored one starts afresh, as a
 *     real broker never reissues one);
 *   - otherwise the first sequence must follow the last stored one:
 *     OUT_OF_ORDER_SEQUENCE_NUMBER, nothing stored.
 *
 * Only Produce v3..v8 with one partition and one batch per request (what
 * librdkafka sends) is checked; anything else is passed on and counted as
 * "unchecked".
 */
#include "seq_proxy.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define SP_MAX_BROKERS 16
#define SP_RING        5 /* batches a broker remembers per producer */

enum {
    ERR_REQUEST_TIMED_OUT = 7,
    ERR_NOT_ENOUGH_REPLICAS_AFTER_APPEND = 20,
    ERR_OUT_OF_ORDER_SEQUENCE_NUMBER = 45,
    ERR_INVALID_PRODUCER_EPOCH = 47,
};

#define SP_MAX_INJECTED 64

struct sp_buf {
    uint8_t *p;
    size_t off, len, cap; /* data is p[off..len) */
};

/* What a broker keeps per topic, partition and producer id. */
struct sp_seq {
    char *topic;
    int32_t partition;
    int64_t pid;
    int16_t epoch;
    int32_t last_seq;
    unsigned gen; /* bumped when the mock hands the producer id out anew */
    int n;        /* batches in ring, at most SP_RING */
    struct {
        int32_t first, last;
        int64_t offset;
    } ring[SP_RING];
};

enum sp_state { P_QUEUED, P_FORWARDED, P_ANSWERED };

struct sp_pending {
    struct sp_pending *next;
    enum sp_state state;
    int64_t arrived_ms, release_ms;
    uint8_t *req, *resp; /* whole frames, size prefix included */
    size_t req_len, resp_len;
    int16_t api_key, version;
    int32_t corr;
    bool no_response;   /* Produce with acks=0 */
    struct sp_seq *seq; /* a checked Produce forwarded to the mock */
    unsigned seq_gen;   /* seq->gen when it was checked */
    int16_t epoch;
    int32_t first_seq, last_seq;
    int16_t after_append_err; /* injected: stored, then answered this */
};

struct sp_conn {
    struct sp_conn *next;
    int cfd, mfd; /* client socket, our end of the mock's socketpair */
    int broker;   /* index into rtt/paused: broker id, 0 if unknown */
    struct sp_buf cin, cout, min, mout;
    struct sp_pending *head, *tail;
    bool forwarded; /* a request is with the mock */
    bool dead;
    bool client_gone; /* the client closed while a request was with the mock */
};

static struct {
    bool running;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int wake[2];
    int nbrokers;
    int port[SP_MAX_BROKERS + 1]; /* port[id] for broker ids 1..nbrokers */
    /* under mu: */
    struct sp_conn *incoming;
    int rtt[SP_MAX_BROKERS + 1];
    bool paused[SP_MAX_BROKERS + 1];
    int busy[SP_MAX_BROKERS + 1]; /* connections with a request at the mock */
    unsigned long passes;         /* the thread's loop passes so far */
    unsigned long checked, out_of_order, duplicates, fenced, unchecked;
    int16_t injected[SP_MAX_INJECTED]; /* errors for the next Produce requests */
    int n_injected;
    bool stop;
    /* thread only: */
    struct sp_conn *conns;
    struct sp_seq **seqs;
    size_t nseqs, capseqs;
} sp = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .wake = {-1, -1}};

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static uint16_t get16(const uint8_t *p)
{
    return (uint16_t)((p[0] << 8) | p[1]);
}

static uint32_t get32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static uint64_t get64(const uint8_t *p)
{
    return ((uint64_t)get32(p) << 32) | get32(p + 4);
}

static uint8_t *put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
    return p + 2;
}

static uint8_t *put32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
    return p + 4;
}

static uint8_t *put64(uint8_t *p, uint64_t v)
{
    return put32(put32(p, (uint32_t)(v >> 32)), (uint32_t)v);
}

static void wake_thread(void)
{
    char c = 1;
    ssize_t r = write(sp.wake[1], &c, 1);
    (void)r; /* a full pipe wakes the thread anyway */
}

static int buf_append(struct sp_buf *b, const uint8_t *data, size_t n)
{
    if (b->off > 0 && b->off == b->len)
        b->off = b->len = 0;
    if (b->len + n > b->cap) {
        if (b->off > 0) {
            memmove(b->p, b->p + b->off, b->len - b->off);
            b->len -= b->off;
            b->off = 0;
        }
        if (b->len + n > b->cap) {
            size_t cap = b->cap ? b->cap : 65536;
            while (cap < b->len + n)
                cap *= 2;
            uint8_t *p = realloc(b->p, cap);
            if (!p)
                return -1;
            b->p = p;
            b->cap = cap;
        }
    }
    memcpy(b->p + b->len, data, n);
    b->len += n;
    return 0;
}

/* Read what fd has into b: 1 read something, 0 nothing now, -1 EOF/error. */
static int buf_read(struct sp_buf *b, int fd)
{
    uint8_t chunk[65536];
    ssize_t r = read(fd, chunk, sizeof(chunk));
    if (r > 0)
        return buf_append(b, chunk, (size_t)r) == 0 ? 1 : -1;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return 0;
    return -1;
}

static int buf_write(struct sp_buf *b, int fd)
{
    if (b->off == b->len)
        return 0;
    ssize_t w = write(fd, b->p + b->off, b->len - b->off);
    if (w < 0)
        return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : -1;
    b->off += (size_t)w;
    return 0;
}

/* The next whole frame in b (size prefix included), or NULL. */
static uint8_t *buf_frame(struct sp_buf *b, size_t *len)
{
    size_t have = b->len - b->off;
    if (have < 4)
        return NULL;
    size_t n = 4 + (size_t)get32(b->p + b->off);
    if (have < n)
        return NULL;
    uint8_t *f = malloc(n);
    if (!f)
        return NULL;
    memcpy(f, b->p + b->off, n);
    b->off += n;
    *len = n;
    return f;
}

static void pending_free(struct sp_pending *p)
{
    free(p->req);
    free(p->resp);
    free(p);
}

static void conn_free(struct sp_conn *c)
{
    if (c->cfd >= 0)
        close(c->cfd);
    if (c->mfd >= 0)
        close(c->mfd);
    while (c->head) {
        struct sp_pending *p = c->head;
        c->head = p->next;
        pending_free(p);
    }
    free(c->cin.p);
    free(c->cout.p);
    free(c->min.p);
    free(c->mout.p);
    free(c);
}

static struct sp_seq *seq_find(const char *topic, size_t topic_len, int32_t partition, int64_t pid)
{
    for (size_t i = 0; i < sp.nseqs; i++) {
        struct sp_seq *s = sp.seqs[i];
        if (s->pid == pid && s->partition == partition && strlen(s->topic) == topic_len &&
            memcmp(s->topic, topic, topic_len) == 0)
            return s;
    }
    if (sp.nseqs == sp.capseqs) {
        size_t cap = sp.capseqs ? sp.capseqs * 2 : 64;
        struct sp_seq **v = realloc(sp.seqs, cap * sizeof(*v));
        if (!v)
            return NULL;
        sp.seqs = v;
        sp.capseqs = cap;
    }
    struct sp_seq *s = calloc(1, sizeof(*s));
    if (!s || !(s->topic = strndup(topic, topic_len))) {
        free(s);
        return NULL;
    }
    s->partition = partition;
    s->pid = pid;
    s->epoch = -1; /* nothing stored yet */
    sp.seqs[sp.nseqs++] = s;
    return s;
}

/* A Produce response of version v for one partition, made here. */
static int local_produce_response(struct sp_pending *p, const char *topic, size_t topic_len,
                                  int32_t partition, int16_t err, int64_t offset)
{
    size_t n = 4 + 4 + 4 + 2 + topic_len + 4 + 4 + 2 + 8 + 8 + 4;
    if (p->version >= 5)
        n += 8;
    if (p->version >= 8)
        n += 4 + 2;
    uint8_t *f = malloc(n), *w;
    if (!f)
        return -1;
    w = put32(f, (uint32_t)(n - 4));
    w = put32(w, (uint32_t)p->corr);
    w = put32(w, 1);
    w = put16(w, (uint16_t)topic_len);
    memcpy(w, topic, topic_len);
    w += topic_len;
    w = put32(w, 1);
    w = put32(w, (uint32_t)partition);
    w = put16(w, (uint16_t)err);
    w = put64(w, (uint64_t)offset);
    w = put64(w, (uint64_t)-1); /* log append time: CreateTime topics */
    if (p->version >= 5)
        w = put64(w, (uint64_t)-1); /* log start offset: not known here */
    if (p->version >= 8) {
        w = put32(w, 0);            /* record_errors */
        w = put16(w, (uint16_t)-1); /* error_message: null */
    }
    put32(w, 0); /* throttle_time_ms */
    p->resp = f;
    p->resp_len = n;
    return 0;
}

struct produce_req {
    const char *topic;
    size_t topic_len;
    int32_t partition;
    int64_t pid;
    int16_t epoch;
    int32_t first_seq, last_seq;
};

/* Parse a Produce request we can check; false for anything else. */
static bool parse_produce(const struct sp_pending *p, struct produce_req *r, bool *acks0)
{
    const uint8_t *f = p->req, *end = p->req + p->req_len, *q = f + 12;
    *acks0 = false;
    if (p->version < 3 || p->version > 8 || p->req_len < 14)
        return false;
    int16_t client_id_len = (int16_t)get16(q);
    q += 2 + (client_id_len > 0 ? client_id_len : 0);
    if (q + 2 > end)
        return false;
    int16_t txn_len = (int16_t)get16(q);
    q += 2 + (txn_len > 0 ? txn_len : 0);
    if (q + 2 + 4 + 4 + 2 > end)
        return false;
    *acks0 = get16(q) == 0;
    q += 2 + 4;
    if (get32(q) != 1)
        return false;
    q += 4;
    r->topic_len = get16(q);
    r->topic = (const char *)q + 2;
    q += 2 + r->topic_len;
    if (q + 4 + 4 + 4 > end || get32(q) != 1)
        return false;
    q += 4;
    r->partition = (int32_t)get32(q);
    int32_t records_len = (int32_t)get32(q + 4);
    const uint8_t *b = q + 8;
    if (records_len < 61 || b + records_len > end)
        return false;
    /* One RecordBatch (magic 2) filling the records field. */
    if (b[16] != 2 || 12 + (int64_t)get32(b + 8) != records_len)
        return false;
    r->pid = (int64_t)get64(b + 43);
    r->epoch = (int16_t)get16(b + 51);
    r->first_seq = (int32_t)get32(b + 53);
    int64_t last = (int64_t)r->first_seq + (int32_t)get32(b + 23);
    r->last_seq = (int32_t)(last > INT32_MAX ? last - INT32_MAX - 1 : last); /* wraps to 0 */
    return true;
}

static int16_t next_injected(void)
{
    int16_t err = 0;
    pthread_mutex_lock(&sp.mu);
    if (sp.n_injected > 0) {
        err = sp.injected[0];
        memmove(&sp.injected[0], &sp.injected[1], sizeof(sp.injected[0]) * (size_t)--sp.n_injected);
    }
    pthread_mutex_unlock(&sp.mu);
    return err;
}

/* Decide a Produce request: true = answered here (p->resp set). */
static bool check_produce(struct sp_pending *p)
{
    struct produce_req r;
    bool acks0;
    /* An injected error, as a broker has them: most are found before the
     * append (nothing stored); a replication timeout or too few replicas
     * after it come once the batch is in the log. */
    int16_t injected = next_injected();
    if (injected == ERR_REQUEST_TIMED_OUT || injected == ERR_NOT_ENOUGH_REPLICAS_AFTER_APPEND) {
        p->after_append_err = injected;
        injected = 0;
    }
    if (!parse_produce(p, &r, &acks0)) {
        pthread_mutex_lock(&sp.mu);
        sp.unchecked++;
        pthread_mutex_unlock(&sp.mu);
        p->no_response = acks0;
        return false;
    }
    p->no_response = acks0;
    if (injected)
        return acks0 ||
               local_produce_response(p, r.topic, r.topic_len, r.partition, injected, -1) == 0;
    if (r.pid < 0)
        return false; /* not an idempotent producer */
    struct sp_seq *s = seq_find(r.topic, r.topic_len, r.partition, r.pid);
    if (!s)
        return false;
    int16_t err = 0;
    int64_t offset = -1;
    bool local = false;
    unsigned long *counter = NULL;
    pthread_mutex_lock(&sp.mu);
    sp.checked++;
    pthread_mutex_unlock(&sp.mu);
    if (s->epoch >= 0 && r.epoch < s->epoch) {
        err = ERR_INVALID_PRODUCER_EPOCH;
        local = true;
        counter = &sp.fenced;
    } else if (s->epoch >= 0 && r.epoch == s->epoch) {
        for (int i = 0; i < s->n && !local; i++)
            if (s->ring[i].first == r.first_seq && s->ring[i].last == r.last_seq) {
                offset = s->ring[i].offset;
                local = true;
                counter = &sp.duplicates;
            }
        int32_t next = s->last_seq == INT32_MAX ? 0 : s->last_seq + 1; /* wraps to 0 */
        if (!local && r.first_seq != next) {
            err = ERR_OUT_OF_ORDER_SEQUENCE_NUMBER;
            local = true;
            counter = &sp.out_of_order;
        }
    } else if (s->epoch >= 0 && r.first_seq != 0) {
        err = ERR_OUT_OF_ORDER_SEQUENCE_NUMBER; /* a new epoch starts at 0 */
        local = true;
        counter = &sp.out_of_order;
    } /* a producer id with no state here: any sequence (Kafka 2.5 and later) */
    if (!local) {
        p->seq = s;
        p->seq_gen = s->gen;
        p->epoch = r.epoch;
        p->first_seq = r.first_seq;
        p->last_seq = r.last_seq;
        return false;
    }
    pthread_mutex_lock(&sp.mu);
    (*counter)++;
    pthread_mutex_unlock(&sp.mu);
    if (acks0)
        return true; /* nothing to answer */
    return local_produce_response(p, r.topic, r.topic_len, r.partition, err, offset) == 0;
}

/* The error code field of a one-partition Produce response, or NULL. */
static uint8_t *produce_response_error(uint8_t *resp, size_t len)
{
    uint8_t *q = resp + 8, *end = resp + len;
    if (q + 4 + 2 > end || get32(q) != 1)
        return NULL;
    q += 4;
    q += 2 + get16(q);
    if (q + 4 + 4 + 2 + 8 > end || get32(q) != 1)
        return NULL;
    return q + 8;
}

/* The mock answered a Produce request we forwarded: remember a stored
 * batch of a checked one, and give an injected after-append error. */
static void note_produce_response(struct sp_pending *p)
{
    uint8_t *e = produce_response_error(p->resp, p->resp_len);
    if (!e || get16(e) != 0)
        return;
    struct sp_seq *s = p->seq;
    int64_t offset = (int64_t)get64(e + 2);
    if (p->after_append_err) {
        put16(e, (uint16_t)p->after_append_err);
        put64(e + 2, (uint64_t)-1);
    }
    if (!s || p->seq_gen != s->gen)
        return; /* checked against a producer id since handed out anew */
    if (p->epoch != s->epoch) {
        s->epoch = p->epoch;
        s->n = 0;
    }
    if (s->n == SP_RING) {
        memmove(&s->ring[0], &s->ring[1], sizeof(s->ring[0]) * (SP_RING - 1));
        s->n--;
    }
    s->ring[s->n].first = p->first_seq;
    s->ring[s->n].last = p->last_seq;
    s->ring[s->n].offset = offset;
    s->n++;
    s->last_seq = p->last_seq;
}

/* The mock answered an InitProducerId request. librdkafka 2.0.2's mock
 * draws producer ids at random (1..900000 times 1000), so a new producer
 * can get the id of one that came before, at epoch 0. A real broker never
 * hands out an id again at an epoch not above the one it stored: forget
 * what the earlier producer left, or its last sequence would make the new
 * producer's first batch out of order. An epoch above the stored one is a
 * bump of the same producer and keeps its state (the older epoch fenced). */
static void note_init_pid_response(const struct sp_pending *p)
{
    /* Size, correlation id, the tagged fields of a flexible header (v2+),
     * then throttle_time_ms, error_code, producer_id, producer_epoch. */
    size_t at = 8 + (p->version >= 2 ? 1 : 0) + 4;
    if (p->resp_len < at + 2 + 8 + 2 || get16(p->resp + at) != 0)
        return;
    int64_t pid = (int64_t)get64(p->resp + at + 2);
    int16_t epoch = (int16_t)get16(p->resp + at + 10);
    for (size_t i = 0; i < sp.nseqs; i++) {
        struct sp_seq *s = sp.seqs[i];
        if (s->pid == pid && s->epoch >= epoch) {
            fprintf(stderr,
                    "seq-proxy: producer id %lld handed out again at epoch %d: what an earlier "
                    "producer left on %s [%d] is forgotten\n",
                    (long long)pid, epoch, s->topic, s->partition);
            s->epoch = -1;
            s->n = 0;
            s->gen++;
        }
    }
}

static int rtt_of(const struct sp_conn *c)
{
    pthread_mutex_lock(&sp.mu);
    int rtt = sp.rtt[c->broker];
    pthread_mutex_unlock(&sp.mu);
    return rtt;
}

/* Hand queued requests on, one at a time; answer what we can here. */
static void conn_pump(struct sp_conn *c, int64_t now)
{
    pthread_mutex_lock(&sp.mu);
    bool paused = sp.paused[c->broker];
    pthread_mutex_unlock(&sp.mu);
    for (struct sp_pending *p = c->head; p && !c->forwarded && !paused; p = p->next) {
        if (p->state != P_QUEUED)
            continue;
        if (p->api_key == 0 && check_produce(p)) {
            p->state = P_ANSWERED;
            p->release_ms = p->arrived_ms + rtt_of(c);
            continue;
        }
        if (buf_append(&c->mout, p->req, p->req_len) != 0) {
            c->dead = true;
            return;
        }
        if (p->no_response) {
            p->state = P_ANSWERED; /* nothing comes back; drop it in order */
            p->release_ms = now;
        } else {
            p->state = P_FORWARDED;
            c->forwarded = true;
        }
    }
    /* Release answers in request order once their latency has passed. */
    while (c->head && c->head->state == P_ANSWERED && c->head->release_ms <= now) {
        struct sp_pending *p = c->head;
        if (p->resp && buf_append(&c->cout, p->resp, p->resp_len) != 0) {
            c->dead = true;
            return;
        }
        c->head = p->next;
        if (!c->head)
            c->tail = NULL;
        pending_free(p);
    }
}

static void conn_read_client(struct sp_conn *c, int64_t now)
{
    if (buf_read(&c->cin, c->cfd) < 0) {
        /* The mock may have stored the request it holds: hear its answer
         * before closing, so that a resent batch is recognised. */
        if (c->forwarded)
            c->client_gone = true;
        else
            c->dead = true;
        return;
    }
    size_t n;
    uint8_t *f;
    while ((f = buf_frame(&c->cin, &n)) != NULL) {
        struct sp_pending *p = calloc(1, sizeof(*p));
        if (!p || n < 12) {
            free(p);
            free(f);
            c->dead = true;
            return;
        }
        p->req = f;
        p->req_len = n;
        p->api_key = (int16_t)get16(f + 4);
        p->version = (int16_t)get16(f + 6);
        p->corr = (int32_t)get32(f + 8);
        p->arrived_ms = now;
        if (c->tail)
            c->tail->next = p;
        else
            c->head = p;
        c->tail = p;
    }
}

static void conn_read_mock(struct sp_conn *c, int64_t now)
{
    if (buf_read(&c->min, c->mfd) < 0) {
        c->dead = true; /* the mock closed it (broker down): so do we */
        return;
    }
    size_t n;
    uint8_t *f;
    while ((f = buf_frame(&c->min, &n)) != NULL) {
        struct sp_pending *p = c->head;
        while (p && p->state != P_FORWARDED)
            p = p->next;
        if (!p || n < 8 || (int32_t)get32(f + 4) != p->corr) {
            fprintf(stderr, "seq-proxy: a response the connection did not ask for\n");
            free(f);
            c->dead = true;
            return;
        }
        p->resp = f;
        p->resp_len = n;
        if (p->api_key == 0)
            note_produce_response(p);
        else if (p->api_key == 22)
            note_init_pid_response(p);
        p->state = P_ANSWERED;
        int64_t due = p->arrived_ms + rtt_of(c);
        p->release_ms = due > now ? due : now;
        c->forwarded = false;
    }
}

static void *sp_thread(void *arg)
{
    (void)arg;
    struct pollfd *pfds = NULL;
    size_t cap = 0;
    for (;;) {
        pthread_mutex_lock(&sp.mu);
        bool stop = sp.stop;
        while (sp.incoming) {
            struct sp_conn *c = sp.incoming;
            sp.incoming = c->next;
            c->next = sp.conns;
            sp.conns = c;
        }
        pthread_mutex_unlock(&sp.mu);
        if (stop)
            break;

        int64_t now = now_ms();
        int timeout = 100;
        size_t n = 1;
        for (struct sp_conn *c = sp.conns; c; c = c->next) {
            conn_pump(c, now);
            if (c->head && c->head->state == P_ANSWERED) {
                int64_t wait = c->head->release_ms - now;
                if (wait < timeout)
                    timeout = wait < 0 ? 0 : (int)wait;
            }
            n += 2;
        }
        if (n > cap) {
            struct pollfd *v = realloc(pfds, n * 2 * sizeof(*v));
            if (!v) {
                fprintf(stderr, "seq-proxy: out of memory\n");
                abort();
            }
            pfds = v;
            cap = n * 2;
        }
        pfds[0] = (struct pollfd){.fd = sp.wake[0], .events = POLLIN};
        size_t i = 1;
        for (struct sp_conn *c = sp.conns; c; c = c->next) {
            pfds[i++] =
                (struct pollfd){.fd = c->client_gone ? -1 : c->cfd,
                                .events = POLLIN | (c->cout.len > c->cout.off ? POLLOUT : 0)};
            pfds[i++] = (struct pollfd){
                .fd = c->mfd, .events = POLLIN | (c->mout.len > c->mout.off ? POLLOUT : 0)};
        }
        if (poll(pfds, n, timeout) < 0 && errno != EINTR) {
            fprintf(stderr, "seq-proxy: poll: %s\n", strerror(errno));
            abort();
        }
        if (pfds[0].revents) {
            char drain[64];
            while (read(sp.wake[0], drain, sizeof(drain)) > 0)
                ;
        }
        now = now_ms();
        i = 1;
        for (struct sp_conn *c = sp.conns; c; c = c->next, i += 2) {
            if (pfds[i].revents & (POLLIN | POLLHUP | POLLERR))
                conn_read_client(c, now);
            if (!c->dead && (pfds[i + 1].revents & (POLLIN | POLLHUP | POLLERR)))
                conn_read_mock(c, now);
            if (c->client_gone) {
                c->dead = c->dead || !c->forwarded; /* answered, or the mock closed too */
                continue;
            }
            if (!c->dead)
                conn_pump(c, now);
            if (!c->dead && buf_write(&c->mout, c->mfd) < 0)
                c->dead = true;
            if (!c->dead && buf_write(&c->cout, c->cfd) < 0)
                c->dead = true;
        }
        /* Drop closed connections and publish who is busy with the mock. */
        int busy[SP_MAX_BROKERS + 1] = {0};
        for (struct sp_conn **pp = &sp.conns; *pp;) {
            struct sp_conn *c = *pp;
            if (c->dead) {
                *pp = c->next;
                conn_free(c);
                continue;
            }
            if (c->forwarded)
                busy[c->broker]++;
            pp = &c->next;
        }
        pthread_mutex_lock(&sp.mu);
        memcpy(sp.busy, busy, sizeof(busy));
        sp.passes++;
        pthread_cond_broadcast(&sp.cv);
        pthread_mutex_unlock(&sp.mu);
    }
    free(pfds);
    return NULL;
}

int sp_start(const char *bootstraps)
{
    /* "127.0.0.1:p1,127.0.0.1:p2,...": broker ids 1, 2, ... in that order. */
    const char *s = bootstraps;
    while (s && *s && sp.nbrokers < SP_MAX_BROKERS) {
        const char *colon = strchr(s, ':');
        if (!colon)
            break;
        sp.port[++sp.nbrokers] = atoi(colon + 1);
        s = strchr(colon, ',');
        if (s)
            s++;
    }
    if (pipe2(sp.wake, O_NONBLOCK | O_CLOEXEC) != 0)
        return -1;
    if (pthread_create(&sp.thread, NULL, sp_thread, NULL) != 0) {
        close(sp.wake[0]);
        close(sp.wake[1]);
        return -1;
    }
    sp.running = true;
    return 0;
}

int sp_wrap_accepted(int listen_fd, int client_fd)
{
    struct sockaddr_in sin;
    socklen_t len = sizeof(sin);
    int pair[2];
    if (!sp.running || client_fd < 0)
        return client_fd;
    int broker = 0;
    if (getsockname(listen_fd, (struct sockaddr *)&sin, &len) == 0 && sin.sin_family == AF_INET)
        for (int id = 1; id <= sp.nbrokers; id++)
            if (sp.port[id] == ntohs(sin.sin_port))
                broker = id;
    struct sp_conn *c = calloc(1, sizeof(*c));
    if (!c || socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
        free(c);
        fprintf(stderr, "seq-proxy: cannot wrap a connection: %s\n", strerror(errno));
        return client_fd;
    }
    c->cfd = client_fd;
    c->mfd = pair[0];
    c->broker = broker;
    (void)fcntl(client_fd, F_SETFL, fcntl(client_fd, F_GETFL) | O_NONBLOCK);
    (void)fcntl(pair[0], F_SETFL, fcntl(pair[0], F_GETFL) | O_NONBLOCK);
    pthread_mutex_lock(&sp.mu);
    c->next = sp.incoming;
    sp.incoming = c;
    pthread_mutex_unlock(&sp.mu);
    wake_thread();
    return pair[1];
}

static void set_for(int32_t broker, void (*fn)(int id, int v), int v)
{
    pthread_mutex_lock(&sp.mu);
    for (int id = 0; id <= sp.nbrokers; id++)
        if (broker < 0 || broker == id)
            fn(id, v);
    pthread_mutex_unlock(&sp.mu);
    wake_thread();
}

static void set_rtt(int id, int v)
{
    sp.rtt[id] = v;
}

static void set_paused(int id, int v)
{
    sp.paused[id] = v != 0;
}

void sp_set_rtt(int32_t broker, int ms)
{
    set_for(broker, set_rtt, ms);
}

void sp_pause(int32_t broker)
{
    if (!sp.running)
        return;
    set_for(broker, set_paused, 1);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 2;
    pthread_mutex_lock(&sp.mu);
    /* A pass that was under way may have forwarded a request before it saw
     * the pause, and published its count after: only a pass that started
     * after the pause counts (two passes from now). */
    unsigned long first = sp.passes + 2;
    for (;;) {
        int busy = 0;
        for (int id = 0; id <= sp.nbrokers; id++)
            if (broker < 0 || broker == id)
                busy += sp.busy[id];
        if ((busy == 0 && sp.passes >= first) ||
            pthread_cond_timedwait(&sp.cv, &sp.mu, &until) == ETIMEDOUT)
            break;
    }
    pthread_mutex_unlock(&sp.mu);
}

void sp_resume(int32_t broker)
{
    set_for(broker, set_paused, 0);
}

int sp_push_produce_errors(const int16_t *errs, int n)
{
    pthread_mutex_lock(&sp.mu);
    int room = SP_MAX_INJECTED - sp.n_injected;
    if (n > room) {
        pthread_mutex_unlock(&sp.mu);
        return -1;
    }
    memcpy(&sp.injected[sp.n_injected], errs, sizeof(*errs) * (size_t)n);
    sp.n_injected += n;
    pthread_mutex_unlock(&sp.mu);
    return 0;
}

void sp_clear_produce_errors(void)
{
    pthread_mutex_lock(&sp.mu);
    sp.n_injected = 0;
    pthread_mutex_unlock(&sp.mu);
}

void sp_print_stats(FILE *out)
{
    pthread_mutex_lock(&sp.mu);
    fprintf(out, "seq-check batches %lu out-of-order %lu duplicates %lu fenced %lu unchecked %lu\n",
            sp.checked, sp.out_of_order, sp.duplicates, sp.fenced, sp.unchecked);
    pthread_mutex_unlock(&sp.mu);
}

void sp_stop(void)
{
    if (!sp.running)
        return;
    pthread_mutex_lock(&sp.mu);
    sp.stop = true;
    pthread_mutex_unlock(&sp.mu);
    wake_thread();
    pthread_join(sp.thread, NULL);
    sp.running = false;
    while (sp.conns) {
        struct sp_conn *c = sp.conns;
        sp.conns = c->next;
        conn_free(c);
    }
    while (sp.incoming) {
        struct sp_conn *c = sp.incoming;
        sp.incoming = c->next;
        conn_free(c);
    }
    for (size_t i = 0; i < sp.nseqs; i++) {
        free(sp.seqs[i]->topic);
        free(sp.seqs[i]);
    }
    free(sp.seqs);
    close(sp.wake[0]);
    close(sp.wake[1]);
}
