-- outboxd schema, version 10: the cursor rows that can cover a row, found
-- once per statement instead of once per row.
--
-- Apply with: psql -v ON_ERROR_STOP=1 -f sql/010_log_newest.sql (after 009).
-- Idempotent. Nothing here touches outbox.events or enqueue().
--
-- With cursor rows about slots (sql/009) a row of the outbox is covered by
-- the newest cursor row about its slot. Looked up per row, that walked the
-- cursor rows down from the newest until one was about the row's slot: as
-- many as one relay had written since another's last, hundreds while a
-- relay drains and the others idle. With a backlog of 400,000 rows the
-- per-row walk made outbox.unpublished (and the relay's statements that
-- test the same) take minutes. The newest row about a row's slot is the
-- newest row about some (count, slot) pair: outbox.log_newest() lists
-- those, a handful of rows, and the test per row reads only them.

BEGIN;
SET LOCAL client_min_messages = warning;
DO $$ BEGIN PERFORM pg_advisory_xact_lock(1868724324, 0); END $$;

-- For every count of shards found in outbox.log_cursor and every slot of
-- that count, the newest cursor row about it (a row with slots NULL is
-- about every slot), each row once, newest first. The newest cursor row
-- about any outbox row is among them: it is about the row's slot under its
-- own count, and a newer row about that slot would be newer about the row.
CREATE OR REPLACE FUNCTION outbox.log_newest() RETURNS SETOF outbox.log_cursor
LANGUAGE sql STABLE ROWS 4 -- about one a relay: the planner's default of 1,000
                           -- priced the test per row of outbox.unpublished so
                           -- high that a plain session compiled it (JIT), for
                           -- 0.1 to 2 s a look
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT DISTINCT ON (c.batch) c.*
    FROM (SELECT DISTINCT l.shards FROM outbox.log_cursor l) k,
         generate_series(0, k.shards - 1) AS s(slot),
         LATERAL (SELECT l.* FROM outbox.log_cursor l
                  WHERE l.slots IS NULL OR (l.shards = k.shards AND s.slot = ANY (l.slots))
                  ORDER BY l.batch DESC LIMIT 1) c
    ORDER BY c.batch DESC
$$;
REVOKE ALL ON FUNCTION outbox.log_newest() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.log_newest() TO outboxd_relay;

-- sql/009's view, the same rows. The rows below the floor's hwm that its
-- snapshot did not see are read from the (xid, id) index, from the
-- snapshot's xmin (sql/009 read every entry of the id index below the hwm
-- for them: half a second a look on a table of 2,000,000 rows, and the
-- relay's maintenance session looks every few seconds in log mode). Each
-- row is then tested against the rows of outbox.log_newest() (read once)
-- instead of by outbox.log_covers(). No test per row when the floor is the
-- one row about every row (whole), nor without cursor rows (mark and
-- delete mode); with no floor while there are some (a slot has no cursor
-- row yet), every unsent row is tested.
CREATE OR REPLACE VIEW outbox.unpublished AS
WITH c AS (SELECT f.*, coalesce((SELECT min(h) FROM unnest(f.held_from) h), f.hwm + 1) AS held_lo
           FROM outbox.log_floor(NULL, NULL) f),
n AS MATERIALIZED (SELECT * FROM outbox.log_newest())
SELECT e.* FROM (
    SELECT e.* FROM c, outbox.events e WHERE e.sent_at IS NULL AND e.id > c.hwm
    UNION ALL
    -- Rows of writers its snapshot did not see, read from the (xid, id)
    -- index from the snapshot's xmin, for the row of c (none in mark and
    -- delete mode): the bound on id is written so that no index serves it
    -- (+ 0), as with it the planner walked the id index below the hwm
    -- instead (half a second a look on a table of 2,000,000 rows); the
    -- order keeps the subquery per row of c (a caller's conditions still
    -- reach it).
    SELECT b.* FROM c, LATERAL (
        SELECT e.* FROM outbox.events e
        WHERE e.sent_at IS NULL
          AND (e.xid, e.id) >= (pg_snapshot_xmin(c.snap), (-9223372036854775807 - 1)::bigint)
          AND e.id + 0 <= c.hwm AND NOT pg_visible_in_snapshot(e.xid, c.snap)
        ORDER BY e.xid, e.id) b
    UNION ALL
    SELECT e.* FROM c, outbox.events e
    WHERE e.sent_at IS NULL AND e.id >= c.held_lo AND e.id <= c.hwm
      AND pg_visible_in_snapshot(e.xid, c.snap)
      AND EXISTS (SELECT FROM unnest(c.held_topics, c.held_keys, c.held_from) AS h(topic, key, from_id)
                  WHERE h.topic = e.topic AND e.id >= h.from_id
                    AND (h.key = e.key OR (h.key IS NULL AND e.id = h.from_id)))
      AND e.id <> ALL (c.also_sent)
    UNION ALL
    SELECT e.* FROM outbox.events e
    WHERE e.sent_at IS NULL AND NOT EXISTS (SELECT FROM c)) e
WHERE (SELECT c.whole FROM c) IS TRUE
   OR NOT EXISTS (SELECT FROM n) -- mark and delete mode: no test per row
   OR e.id > (SELECT max(n.hwm) FROM n) -- above every cursor: a backlog's rows
   OR NOT EXISTS (
        SELECT FROM n cov
        WHERE cov.batch = (SELECT max(v.batch) FROM n v
                           WHERE v.slots IS NULL
                              OR outbox.slot_of(e.key, e.id, v.shards) = ANY (v.slots))
          AND e.id <= cov.hwm AND pg_visible_in_snapshot(e.xid, cov.snap)
          AND NOT (EXISTS (SELECT FROM unnest(cov.held_topics, cov.held_keys, cov.held_from)
                                         AS h(topic, key, from_id)
                           WHERE h.topic = e.topic AND e.id >= h.from_id
                             AND (h.key = e.key OR (h.key IS NULL AND e.id = h.from_id)))
                   AND e.id <> ALL (cov.also_sent)));

INSERT INTO outbox.schema_migrations (version, name)
VALUES (10, '010_log_newest') ON CONFLICT (version) DO NOTHING;

COMMIT;
