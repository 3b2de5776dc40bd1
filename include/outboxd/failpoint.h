/*
 * failpoint: named crash-window injection points (DESIGN 1.4).
 *
 * OUTBOXD_FAILPOINTS="name=action[;name=action]" is read once at start-up.
 * Actions: crash (SIGKILL ourselves: no cleanup), crash@N (on the N-th hit),
 * error (the operation fails as if the dependency had failed, at every
 * hit), error@N (only at the N-th hit), sleep(MS).
 * An unarmed point costs one predictable branch.
 */
#ifndef OUTBOXD_FAILPOINT_H
#define OUTBOXD_FAILPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "outboxd/config.h"

enum obx_fp_id {
    OBX_FP_FETCH_AFTER = 0,       /* rows read, nothing produced */
    OBX_FP_PRODUCE_AFTER,         /* handed to librdkafka, no delivery report yet */
    OBX_FP_ACK_AFTER,             /* delivery reports in, rows not yet marked */
    OBX_FP_MARK_BEFORE_COMMIT,    /* mark statement about to be committed */
    OBX_FP_MARK_AFTER_COMMIT,     /* mark committed, result not yet processed */
    OBX_FP_RECOVER_AFTER_SCAN,    /* recovery read Kafka, nothing marked yet */
    OBX_FP_RECOVER_BEFORE_COMMIT, /* recovery's mark about to be committed */
    OBX_FP_TXN_BEFORE_COMMIT,     /* transaction's reports in, its commit not sent */
    OBX_FP_TXN_AFTER_COMMIT,      /* transaction committed, its rows not yet marked */
    OBX_FP_TXN_BEFORE_FENCE,      /* slots' lost owners named, their fence not begun */
    OBX_FP_COUNT
};

enum obx_fp_action {
    OBX_FP_OFF = 0,
    OBX_FP_CRASH,
    OBX_FP_ERROR,
    OBX_FP_SLEEP,
};

struct obx_fp_entry {
    enum obx_fp_action action;
    int64_t arg;  /* crash: hit number (1 = first); sleep: milliseconds */
    int64_t hits; /* times reached so far */
};

struct obx_failpoints {
    int armed; /* any entry not OFF */
    struct obx_fp_entry entry[OBX_FP_COUNT];
};

/* Parses a spec into `fps` (which it resets first). Empty or NULL spec = all
 * off. On error returns -1 with a sentence naming the bad part. */
int obx_failpoints_parse(struct obx_failpoints *fps, const char *spec, char *err,
                         size_t errlen) OBX_WARN_UNUSED;

const char *obx_failpoint_name(enum obx_fp_id id);

/* The process-wide table, filled once by main() before the loop starts. */
extern struct obx_failpoints obx_failpoints_active;

/* Reaches point `id` of `fps`: may kill the process or sleep. Returns -1 when
 * the action is `error`, else 0. */
int obx_failpoint_reach(struct obx_failpoints *fps, enum obx_fp_id id);

#define OBX_FAILPOINT(id)                                                                          \
    (obx_failpoints_active.armed ? obx_failpoint_reach(&obx_failpoints_active, (id)) : 0)

#endif
