/*
 * Unit tests of the HTTP endpoint parsing (listen address, request line).
 */
#include "outboxd/http.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <setjmp.h>
#include <cmocka.h>

#include "cmocka_alloc.h"

static void test_parse_listen(void **state)
{
    struct sockaddr_storage addr;
    char err[256];
    (void)state;
    assert_int_equal(obx_http_parse_listen("127.0.0.1:9187", &addr, err, sizeof(err)), 0);
    assert_int_equal(addr.ss_family, AF_INET);
    assert_int_equal(ntohs(((struct sockaddr_in *)&addr)->sin_port), 9187);
    assert_int_equal(obx_http_parse_listen("0.0.0.0:1", &addr, err, sizeof(err)), 0);
    assert_int_equal(obx_http_parse_listen("localhost:65535", &addr, err, sizeof(err)), 0);
    assert_int_equal(obx_http_parse_listen("[::1]:9187", &addr, err, sizeof(err)), 0);
    assert_int_equal(addr.ss_family, AF_INET6);

    static const char *const bad[] = {
        "9187",         ":9187",          "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:65536",
        "127.0.0.1:9x", "example.com:80", "[::1:80",    "1.2.3:80"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        err[0] = '\0';
        assert_int_equal(obx_http_parse_listen(bad[i], &addr, err, sizeof(err)), -1);
        assert_non_null(strstr(err, "http.listen"));
        assert_non_null(strstr(err, bad[i])); /* names the bad input */
    }
}

static int parse(const char *req, char *method, char *path)
{
    return obx_http_parse_request(req, strlen(req), method, 16, path, 64);
}

static void test_parse_request(void **state)
{
    char method[16], path[64];
    (void)state;
    assert_int_equal(parse("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", method, path), 1);
    assert_string_equal(method, "GET");
    assert_string_equal(path, "/metrics");
    assert_int_equal(parse("HEAD /readyz?verbose=1 HTTP/1.0\n\n", method, path), 1);
    assert_string_equal(method, "HEAD");
    assert_string_equal(path, "/readyz");
    /* Not complete yet: no empty line. */
    assert_int_equal(parse("GET /livez HTTP/1.1\r\nHost: x\r\n", method, path), 0);
    assert_int_equal(parse("", method, path), 0);
    /* Not HTTP. */
    assert_int_equal(parse("HELLO\r\n\r\n", method, path), -1);
    assert_int_equal(parse("GET metrics HTTP/1.1\r\n\r\n", method, path), -1);
    assert_int_equal(parse("GET /metrics SPDY/3\r\n\r\n", method, path), -1);
    assert_int_equal(parse("GET /metrics\r\n\r\n", method, path), -1);
    assert_int_equal(parse("AVERYLONGMETHODNAME / HTTP/1.1\r\n\r\n", method, path), -1);
    /* A path longer than the caller's buffer is refused, not cut. */
    char longpath[200] = "GET /";
    memset(longpath + 5, 'a', 100);
    strcpy(longpath + 105, " HTTP/1.1\r\n\r\n");
    assert_int_equal(parse(longpath, method, path), -1);
}

int main(void)
{
    use_cmocka_allocator();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_listen),
        cmocka_unit_test(test_parse_request),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
