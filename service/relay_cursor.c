/* relay_cursor: see relay_cursor.h. */
#include "relay_cursor.h"
#include "outboxd/log.h"

void cursor_clear(struct cursor *c, const char *why)
{
    if (c->state == CURSOR_VALID)
        obx_debug("relay: cursor dropped (%s): the next fetch is a full one", why);
    c->state = CURSOR_NONE;
    c->gen++;
}

void cursor_want_fetch(struct cursor *c, const char *why)
{
    if (c->fetch_due == FETCH_NOT_DUE)
        obx_debug("relay: fetch due (%s)", why);
    c->fetch_due = FETCH_DUE;
}

void cursor_full_fetch_due(struct cursor *c, const char *why)
{
    cursor_clear(c, why);
    cursor_want_fetch(c, why);
}
