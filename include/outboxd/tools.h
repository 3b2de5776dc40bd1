/*
 * tools: the operator's subcommands, run instead of the relay and with the
 * same configuration (file < environment < -X):
 *
 *   outboxd status [--json]                 who relays, backlog, dead letters,
 *                                           what holds the xmin horizon; exit 1
 *                                           when not healthy
 *   outboxd dead list | retry ID... | drop ID...
 *   outboxd replay --topic T (--from-id N [--to-id M] | --since TIME) [--yes]
 *
 * Blocking libpq on one short-lived connection (no event loop: nothing else
 * runs). Bad arguments: one line on stderr, exit 2.
 */
#ifndef OUTBOXD_TOOLS_H
#define OUTBOXD_TOOLS_H

#include <stdbool.h>
#include <stdint.h>

#include "outboxd/config.h"

struct obx_tool_args {
    const char *tool; /* "status", "dead" or "replay" */
    const char *config_path;
    char **xargs; /* -X key=value, owned array of borrowed strings */
    int n_xargs;
    bool json, yes;
    const char *topic;
    int64_t from_id, to_id; /* 0 = not given */
    const char *since;
    char **words; /* what follows the tool's name: dead's action and ids */
    int n_words;
};

/* True if `name` is a subcommand. */
bool obx_tool_is(const char *name);

/* Parses argv (argv[0] = the tool's name). Returns 0, or 2 after one line
 * on stderr. */
int obx_tool_parse(int argc, char **argv, struct obx_tool_args *t);
void obx_tool_args_free(struct obx_tool_args *t);

/* Runs the tool; returns the exit status. */
int obx_tool_run(const struct obx_tool_args *t, const struct obx_config *cfg);

#endif
