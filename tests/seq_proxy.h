/*
 * The sequence-checking layer of obx-mock-broker.
 *
 * librdkafka 2.0.2's mock cluster stores whatever an idempotent producer
 * sends: a batch pipelined behind one it refused, a retry of a batch it has
 * already stored. A real broker refuses the first (OUT_OF_ORDER_SEQUENCE_NUMBER,
 * nothing stored) and answers the second with the first copy's offset
 * (stored once). This layer sits on every connection the mock accepts and
 * does what the broker would, so that tests meet real-broker behaviour.
 *
 * It also carries the simulated network latency ("rtt"): responses are held
 * in it, in order, rather than in the mock, so that the mock answers each
 * request at once and the layer always knows whether a batch was stored
 * before it looks at the next one.
 */
#ifndef OBX_TESTS_SEQ_PROXY_H
#define OBX_TESTS_SEQ_PROXY_H

#include <stdint.h>
#include <stdio.h>

/* Start the layer's thread. bootstraps is the mock's "host:port,..." list,
 * broker 1 first. Returns 0 or -1 (errno). */
int sp_start(const char *bootstraps);

/* Called for each connection the mock accepts on listen_fd: returns the
 * descriptor to give the mock instead of client_fd (or client_fd itself
 * when the layer is off or cannot take it). */
int sp_wrap_accepted(int listen_fd, int client_fd);

/* Latency added to every response of broker (-1 = all), in ms. */
void sp_set_rtt(int32_t broker, int ms);

/* Stop forwarding requests to broker (-1 = all) and wait (up to 2 s) until
 * none is being answered by the mock, so that taking the broker down never
 * leaves a batch the layer does not know the fate of. sp_resume undoes it. */
void sp_pause(int32_t broker);
void sp_resume(int32_t broker);

/* Errors for the next Produce requests, one each, in order, as a broker
 * gives them: REQUEST_TIMED_OUT and NOT_ENOUGH_REPLICAS_AFTER_APPEND after
 * storing the batch (replication did not finish), any other before
 * (nothing stored). Each is used by the next request whatever becomes of
 * it: an after-append error does nothing to a batch answered as a
 * duplicate or refused out of sequence (a broker appends neither). -1 when
 * more than 64 would wait. */
int sp_push_produce_errors(const int16_t *errs, int n);
void sp_clear_produce_errors(void);

/* One line of counters: batches checked, refused out of sequence, answered
 * as duplicates, fenced (old epoch), not checked (unparsed). */
void sp_print_stats(FILE *out);

void sp_stop(void);

#endif
