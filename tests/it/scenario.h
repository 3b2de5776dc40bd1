/*
 * Building blocks shared by the integration scenarios: deterministic rows,
 * writer threads, pre-filling, waiting for the relay.
 */
#ifndef OBX_IT_SCENARIO_H
#define OBX_IT_SCENARIO_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "harness.h"

/* The three topics the writers use. */
#define S_TOPICS ((const char *const[]){"it.a", "it.b", "it.c", NULL})

/* Row s of writer w: topic, key (sometimes NULL), binary payload with NUL
 * bytes (sometimes empty or NULL), headers incl. traceparent. */
struct s_row {
    char topic[16];
    char key[32];
    bool key_null;
    unsigned char payload[256];
    size_t payload_len;
    bool payload_null;
    char traceparent[64];
    char headers[256];
};
void s_gen(int w, int s, struct s_row *g);

/* A writer thread: `count` rows (0 = until *stop), rows_per_tx per
 * transaction. With `stop` set it survives lost connections. */
struct s_writer {
    struct h_env *env;
    int w;
    int count;
    int rows_per_tx;
    int hot_keys; /* if > 0: topic it.race, key hot-(s % hot_keys) */
    int pace_ms;  /* pause after each transaction (keeps long runs within the mock's limits) */
    atomic_int *stop;
    int written; /* committed rows */
    int failures;
    char error[256];
};
void *s_writer_main(void *arg);
/* Runs n writers to completion. */
void s_run_writers(struct s_writer *ws, int n);

/* Inserts `rows` rows into `topic` directly (50 keys, 'row N' payloads). */
void s_prefill(struct h_env *e, const char *topic, int rows);
/* A kill loop's count (OBX_KILLS, else `default_kills`) and its random
 * seed (OBX_SEED, else the time), seeded. */
void s_kill_loop_settings(int default_kills, int *kills, unsigned *seed);
/* Rows with sent_at set. */
int64_t s_sent_count(struct h_env *e);
/* Fails the test unless at least n rows are sent within timeout_ms. */
void s_wait_sent(struct h_env *e, int64_t n, int timeout_ms);
/* Fails the test unless no row is unsent within timeout_ms. */
void s_wait_drained(struct h_env *e, int timeout_ms);

#endif
