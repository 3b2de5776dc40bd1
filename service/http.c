/*
 * http: see include/outboxd/http.h.
 */
#include "outboxd/http.h"
#include "outboxd/alloc.h"
#include "outboxd/log.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

struct conn {
    struct obx_http *server;
    bool in_use;
    uv_tcp_t tcp;
    uv_timer_t timer;
    uv_write_t write;
    struct obx_buf resp;
    size_t len;
    int open_handles; /* tcp + timer: freed when both are closed */
    bool closing;
    bool answered;
    char req[OBX_HTTP_MAX_REQUEST];
};

/* Connections live in a pool allocated with the server: no allocation per
 * connection, and a flood waits in the kernel's backlog, not in our memory. */
struct obx_http {
    uv_tcp_t listener;
    obx_http_handler *handler;
    void *arg;
    struct conn conns[OBX_HTTP_MAX_CONNS];
    int n_conns;
    bool accept_pending; /* a connection waits for a free slot */
    bool closing;
    bool listener_closed;
};

static bool is_digit(char c)
{
    return c >= '0' && c <= '9';
}

int obx_http_parse_listen(const char *spec, struct sockaddr_storage *addr, char *err, size_t errlen)
{
    char host[64];
    const char *colon = strrchr(spec, ':');
    const char *port_s = colon ? colon + 1 : NULL;
    size_t host_len = colon ? (size_t)(colon - spec) : 0;
    long port = 0;

    if (!colon || host_len == 0 || host_len >= sizeof(host) || *port_s == '\0')
        goto bad;
    for (const char *p = port_s; *p; p++) {
        if (!is_digit(*p) || port > 65535)
            goto bad;
        port = port * 10 + (*p - '0');
    }
    if (port < 1 || port > 65535)
        goto bad;
    memcpy(host, spec, host_len);
    host[host_len] = '\0';
    memset(addr, 0, sizeof(*addr));
    if (host[0] == '[' && host[host_len - 1] == ']') {
        host[host_len - 1] = '\0';
        if (uv_ip6_addr(host + 1, (int)port, (struct sockaddr_in6 *)addr) != 0)
            goto bad;
        return 0;
    }
    if (strcmp(host, "localhost") == 0)
        strcpy(host, "127.0.0.1");
    if (uv_ip4_addr(host, (int)port, (struct sockaddr_in *)addr) != 0)
        goto bad;
    return 0;
bad:
    snprintf(err, errlen,
             "http.listen: '%s' is not HOST:PORT (e.g. 127.0.0.1:9187, 0.0.0.0:9187, "
             "[::1]:9187; empty turns the endpoints off)",
             spec);
    return -1;
}

int obx_http_parse_request(const char *buf, size_t len, char *method, size_t method_len, char *path,
                           size_t path_len)
{
    const char *end = NULL;
    /* The head ends with an empty line; accept bare LF as well as CRLF. */
    for (size_t i = 0; i + 1 < len && !end; i++) {
        if (buf[i] == '\n' && buf[i + 1] == '\n')
            end = buf + i;
        else if (i + 3 < len && memcmp(buf + i, "\r\n\r\n", 4) == 0)
            end = buf + i;
    }
    if (!end)
        return 0;
    const char *p = buf, *sp = memchr(p, ' ', (size_t)(end - p));
    if (!sp || sp == p || (size_t)(sp - p) >= method_len)
        return -1;
    memcpy(method, p, (size_t)(sp - p));
    method[sp - p] = '\0';
    p = sp + 1;
    sp = memchr(p, ' ', (size_t)(end - p));
    if (!sp || *p != '/')
        return -1;
    const char *q = memchr(p, '?', (size_t)(sp - p));
    const char *path_end = q ? q : sp;
    if ((size_t)(path_end - p) >= path_len)
        return -1;
    memcpy(path, p, (size_t)(path_end - p));
    path[path_end - p] = '\0';
    if ((size_t)(end - sp) < 9 || memcmp(sp + 1, "HTTP/1.", 7) != 0)
        return -1;
    return 1;
}

static void accept_one(struct obx_http *h);

static void server_maybe_free(struct obx_http *h)
{
    if (h->closing && h->listener_closed && h->n_conns == 0)
        obx_free(h);
}

static void on_conn_handle_closed(uv_handle_t *handle)
{
    struct conn *c = handle->data;
    if (--c->open_handles > 0)
        return;
    struct obx_http *h = c->server;
    obx_buf_free(&c->resp);
    memset(c, 0, sizeof(*c));
    h->n_conns--;
    if (h->accept_pending && !h->closing) {
        h->accept_pending = false;
        accept_one(h);
    }
    server_maybe_free(h);
}

static void conn_close(struct conn *c)
{
    if (c->closing)
        return;
    c->closing = true;
    uv_close((uv_handle_t *)&c->tcp, on_conn_handle_closed);
    uv_close((uv_handle_t *)&c->timer, on_conn_handle_closed);
}

static void on_timeout(uv_timer_t *t)
{
    struct conn *c = t->data;
    obx_debug("http: closing a connection after %dms without a complete exchange",
              OBX_HTTP_TIMEOUT_MS);
    conn_close(c);
}

static void on_written(uv_write_t *w, int status)
{
    struct conn *c = w->data;
    (void)status;
    conn_close(c); /* Connection: close */
}

static const char *reason_phrase(int status)
{
    switch (status) {
    case 200:
        return "OK";
    case 400:
        return "Bad Request";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 431:
        return "Request Header Fields Too Large";
    case 503:
        return "Service Unavailable";
    default:
        return "Internal Server Error";
    }
}

/* Writes the answer and closes once it is written (or at the deadline). */
static void respond(struct conn *c, const char *method, const char *path, int status)
{
    struct obx_buf body = {0};
    const char *ctype = "text/plain; charset=utf-8";
    bool head = method && strcmp(method, "HEAD") == 0;

    c->answered = true;
    uv_read_stop((uv_stream_t *)&c->tcp);
    if (status == 200)
        c->server->handler(path, &body, &status, &ctype, c->server->arg);
    else
        obx_buf_printf(&body, "%s\n", reason_phrase(status));
    if (body.oom) {
        obx_buf_free(&body);
        status = 500;
        obx_buf_puts(&body, "out of memory\n");
    }
    obx_buf_printf(&c->resp,
                   "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                   "Cache-Control: no-store\r\nConnection: close\r\n%s\r\n",
                   status, reason_phrase(status), ctype, body.len,
                   status == 405 ? "Allow: GET, HEAD\r\n" : "");
    if (!head && body.len > 0)
        obx_buf_append(&c->resp, body.data, body.len);
    obx_buf_free(&body);
    if (c->resp.oom) {
        conn_close(c);
        return;
    }
    uv_buf_t buf = uv_buf_init(c->resp.data, (unsigned)c->resp.len);
    c->write.data = c;
    if (uv_write(&c->write, (uv_stream_t *)&c->tcp, &buf, 1, on_written) != 0)
        conn_close(c);
}

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buf)
{
    struct conn *c = handle->data;
    (void)suggested;
    *buf = uv_buf_init(c->req + c->len, (unsigned)(sizeof(c->req) - c->len));
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    struct conn *c = s->data;
    char method[16], path[256];
    (void)buf;
    if (nread < 0) {
        conn_close(c); /* EOF or error before a complete request */
        return;
    }
    c->len += (size_t)nread;
    int rc = obx_http_parse_request(c->req, c->len, method, sizeof(method), path, sizeof(path));
    if (rc < 0) {
        respond(c, NULL, NULL, 400);
    } else if (rc == 0) {
        if (c->len == sizeof(c->req))
            respond(c, NULL, NULL, 431);
    } else if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0) {
        respond(c, NULL, NULL, 405);
    } else {
        respond(c, method, path, 200);
    }
}

/* Takes the pending connection into a free slot. libuv pauses the listener
 * while an accepted connection is not taken, so with every slot busy the
 * connection waits until one closes. */
static void accept_one(struct obx_http *h)
{
    struct conn *c = NULL;
    for (int i = 0; i < OBX_HTTP_MAX_CONNS && !c; i++)
        if (!h->conns[i].in_use)
            c = &h->conns[i];
    if (!c) {
        h->accept_pending = true;
        return;
    }
    memset(c, 0, sizeof(*c));
    c->server = h;
    c->in_use = true;
    uv_tcp_init(h->listener.loop, &c->tcp);
    uv_timer_init(h->listener.loop, &c->timer);
    c->tcp.data = c->timer.data = c;
    c->open_handles = 2;
    h->n_conns++;
    if (uv_accept((uv_stream_t *)&h->listener, (uv_stream_t *)&c->tcp) != 0) {
        conn_close(c);
        return;
    }
    uv_timer_start(&c->timer, on_timeout, OBX_HTTP_TIMEOUT_MS, 0);
    if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) != 0)
        conn_close(c);
}

static void on_connection(uv_stream_t *listener, int status)
{
    struct obx_http *h = listener->data;
    if (status < 0) {
        obx_warn("http: accept failed: %s", uv_strerror(status));
        return;
    }
    accept_one(h);
}

int obx_http_new(uv_loop_t *loop, const char *listen, obx_http_handler *handler, void *arg,
                 struct obx_http **out, char *err, size_t errlen)
{
    struct sockaddr_storage addr;
    int rc;
    if (obx_http_parse_listen(listen, &addr, err, errlen) != 0)
        return -1;
    struct obx_http *h = obx_calloc(1, sizeof(*h));
    if (!h) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    h->handler = handler;
    h->arg = arg;
    uv_tcp_init(loop, &h->listener);
    h->listener.data = h;
    if ((rc = uv_tcp_bind(&h->listener, (const struct sockaddr *)&addr, 0)) != 0 ||
        (rc = uv_listen((uv_stream_t *)&h->listener, 64, on_connection)) != 0) {
        snprintf(err, errlen, "http.listen: cannot listen on %s: %s", listen, uv_strerror(rc));
        h->closing = true;
        obx_http_close(h);
        return -1;
    }
    obx_info("http: serving /livez, /readyz and /metrics on %s", listen);
    *out = h;
    return 0;
}

static void on_listener_closed(uv_handle_t *handle)
{
    struct obx_http *h = handle->data;
    h->listener_closed = true;
    server_maybe_free(h);
}

void obx_http_close(struct obx_http *h)
{
    if (!h || h->listener_closed || uv_is_closing((uv_handle_t *)&h->listener))
        return;
    h->closing = true;
    for (int i = 0; i < OBX_HTTP_MAX_CONNS; i++)
        if (h->conns[i].in_use)
            conn_close(&h->conns[i]);
    uv_close((uv_handle_t *)&h->listener, on_listener_closed);
}
