/*
 * check: `outboxd --check --live`, the configuration tried against the live
 * systems. Connects to Postgres and Kafka the way the relay would and
 * prints one actionable line per problem: unreachable, outbox schema
 * missing or older than this binary needs, privileges the configured role
 * lacks, topics that unsent rows wait for but that do not exist while the
 * brokers would not create them.
 *
 * Blocking calls with timeouts: it runs before any event loop exists.
 */
#ifndef OUTBOXD_CHECK_H
#define OUTBOXD_CHECK_H

#include <stdio.h>

#include "outboxd/config.h"

/* Seconds each system gets to answer. */
#define OBX_CHECK_TIMEOUT_S 10

/* Prints findings to `out`; returns the number of problems found. */
int obx_check_live(const struct obx_config *cfg, FILE *out);

#endif
