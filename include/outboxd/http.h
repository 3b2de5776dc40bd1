/*
 * http: a minimal HTTP/1.1 server on the libuv loop for /livez, /readyz and
 * /metrics (DESIGN: http.listen = HOST:PORT, empty = off).
 *
 * One request per connection, answered with `Connection: close`. Requests
 * are bounded (OBX_HTTP_MAX_REQUEST bytes of head, no body), every
 * connection has a deadline of OBX_HTTP_TIMEOUT_MS for reading the request
 * and writing the answer, and at most OBX_HTTP_MAX_CONNS are open at once
 * (more wait in the kernel backlog until one closes). A slow or hostile
 * client therefore costs a bounded amount of memory and never blocks the
 * loop that relays rows.
 */
#ifndef OUTBOXD_HTTP_H
#define OUTBOXD_HTTP_H

#include <stddef.h>
#include <sys/socket.h>
#include <uv.h>

#include "outboxd/buf.h"
#include "outboxd/config.h"

#define OBX_HTTP_MAX_REQUEST 8192
#define OBX_HTTP_TIMEOUT_MS  5000
#define OBX_HTTP_MAX_CONNS   32

/* Answers one GET or HEAD: write the body, set *status (200 by default) and
 * *content_type (text/plain by default). Runs on the loop thread. */
typedef void obx_http_handler(const char *path, struct obx_buf *body, int *status,
                              const char **content_type, void *arg);

struct obx_http;

/* Parses "HOST:PORT" (IPv4, [IPv6] or localhost; port 1-65535). */
int obx_http_parse_listen(const char *spec, struct sockaddr_storage *addr, char *err,
                          size_t errlen) OBX_WARN_UNUSED;

/* Reads the request line of a request head. Returns 1 when the head is
 * complete (method and path copied, path without its query string), 0 when
 * more bytes are needed, -1 when it is not a valid HTTP/1.x request. */
int obx_http_parse_request(const char *buf, size_t len, char *method, size_t method_len, char *path,
                           size_t path_len);

/* Starts listening. */
int obx_http_new(uv_loop_t *loop, const char *listen, obx_http_handler *handler, void *arg,
                 struct obx_http **out, char *err, size_t errlen) OBX_WARN_UNUSED;
/* Closes the listener and every open connection; freed by the loop. */
void obx_http_close(struct obx_http *h);

#endif
