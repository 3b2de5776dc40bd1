-- outboxd schema, version 9: log mode with several active relays
-- (relay.on_sent = log with relay.shards above 1).
--
-- Apply with: psql -v ON_ERROR_STOP=1 -f sql/009_log_slots.sql (after 008).
-- Idempotent. Nothing here touches outbox.events or enqueue(): the
-- application's writers never wait on it.
--
-- Each relay writes cursor rows for the slots it owns: a row now says
-- which slots its claim is about (slots, of a count of shards; NULL: every
-- row, as a relay alone writes). A row of the outbox is published when the
-- newest cursor row about its slot covers it (the row's slot under that
-- cursor row's own count: rows written under another relay.shards still
-- count after a change of it). Batch numbers order the rows of every relay:
-- a relay with slots takes the next one under a lock, in the transaction
-- that commits its row. A slot's owner gives it back only after the row
-- covering its last acknowledged record committed, and its next owner
-- reads that row (its cursor for the slot) before publishing the slot.
--
-- Compaction: a relay alone empties the table every few thousand rows, as
-- before; relays with slots delete the rows below the oldest row any slot
-- still needs. Offsets: relays with slots store them per slot in
-- outbox.kafka_slot_offsets (sql/008), as in mark mode, not in cursor rows.

BEGIN;
SET LOCAL client_min_messages = warning;
DO $$ BEGIN PERFORM pg_advisory_xact_lock(1868724324, 0); END $$;

ALTER TABLE outbox.log_cursor ADD COLUMN IF NOT EXISTS shards integer NOT NULL DEFAULT 1;
ALTER TABLE outbox.log_cursor ADD COLUMN IF NOT EXISTS slots integer[];

-- The newest cursor row about each slot of p_shards in p_slots (NULL:
-- every slot of the newest row's count, or just the newest row if that one
-- is about every row), merged into one that covers no row any of them
-- does not: the lowest hwm, a snapshot that sees only what all of theirs
-- saw (lowest xmin and xmax, every running xid of each), every held key
-- and every row listed as published. No row when a slot has no cursor row
-- of that count yet. Rows of another count are not looked at. What the
-- floor covers, some cursor row covered, and each only ever covers rows
-- that were published: the floor is for bounds and for reclaim, and the
-- exact test per row is outbox.log_covers(), needed only when not `whole`
-- (the floor is then the newest row, about every row). (No min() of xid8:
-- PostgreSQL 13 and 14 have none.)
CREATE OR REPLACE FUNCTION outbox.log_floor(p_shards integer, p_slots integer[],
                                            OUT hwm bigint, OUT snap pg_snapshot,
                                            OUT held_topics text[], OUT held_keys text[],
                                            OUT held_from bigint[], OUT also_sent bigint[],
                                            OUT whole boolean)
RETURNS SETOF record
LANGUAGE sql STABLE ROWS 1
SET search_path = pg_catalog, pg_temp
AS $$
    WITH n AS (SELECT c.shards, c.slots FROM outbox.log_cursor c ORDER BY c.batch DESC LIMIT 1),
    want AS (
        SELECT s AS slot, coalesce(p_shards, n.shards) AS shards, n.slots IS NULL AND p_slots IS NULL AS alone
        FROM n, unnest(coalesce(p_slots,
                                CASE WHEN n.slots IS NULL THEN ARRAY[0]
                                     ELSE ARRAY(SELECT generate_series(0, n.shards - 1)) END)) AS s),
    per AS (
        SELECT w.alone, c.* FROM want w
        LEFT JOIN LATERAL (
            SELECT l.* FROM outbox.log_cursor l
            WHERE l.slots IS NULL OR (NOT w.alone AND l.shards = w.shards AND w.slot = ANY (l.slots))
            ORDER BY l.batch DESC LIMIT 1) c ON true),
    -- Each cursor row once, however many slots it is about.
    r AS (SELECT DISTINCT ON (p.batch) p.* FROM per p WHERE p.batch IS NOT NULL ORDER BY p.batch),
    lim AS (SELECT (SELECT pg_snapshot_xmin(r.snap) FROM r ORDER BY 1 LIMIT 1) AS xmin,
                   (SELECT pg_snapshot_xmax(r.snap) FROM r ORDER BY 1 LIMIT 1) AS xmax,
                   (SELECT min(p.hwm) FROM per p) AS hwm,
                   (SELECT count(*) FROM per p WHERE p.batch IS NULL) AS missing,
                   (SELECT bool_and(p.alone) FROM per p) AS whole),
    held AS (SELECT array_agg(h.t ORDER BY h.f, h.t, h.k) AS t, array_agg(h.k ORDER BY h.f, h.t, h.k) AS k,
                    array_agg(h.f ORDER BY h.f, h.t, h.k) AS f
             FROM r, unnest(r.held_topics, r.held_keys, r.held_from) AS h(t, k, f))
    SELECT lim.hwm,
           (lim.xmin::text || ':' || lim.xmax::text || ':' ||
            coalesce((SELECT string_agg(x::text, ',' ORDER BY x)
                      FROM (SELECT DISTINCT x FROM r, pg_snapshot_xip(r.snap) AS x
                            WHERE x >= lim.xmin AND x < lim.xmax) u), ''))::pg_snapshot,
           coalesce(held.t, '{}'), coalesce(held.k, '{}'), coalesce(held.f, '{}'),
           ARRAY(SELECT DISTINCT a FROM r, unnest(r.also_sent) AS a ORDER BY 1),
           lim.whole
    FROM lim, held
    WHERE lim.missing = 0 AND lim.hwm IS NOT NULL
$$;
REVOKE ALL ON FUNCTION outbox.log_floor(integer, integer[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.log_floor(integer, integer[]) TO outboxd_relay;

-- Whether the newest cursor row about a row's slot (under that cursor
-- row's count) covers it: at or below its hwm, seen committed by its
-- snapshot, and not a row of a key it holds unless listed as published.
-- The relay's statements inline the same test (store.c, COVERED); this is
-- for people and tools.
CREATE OR REPLACE FUNCTION outbox.log_covers(p_id bigint, p_topic text, p_key text, p_xid xid8)
RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT EXISTS (
        SELECT FROM (SELECT c.hwm, c.snap, c.held_topics, c.held_keys, c.held_from, c.also_sent
                     FROM outbox.log_cursor c
                     WHERE c.slots IS NULL OR outbox.slot_of(p_key, p_id, c.shards) = ANY (c.slots)
                     ORDER BY c.batch DESC LIMIT 1) c
        WHERE p_id <= c.hwm AND pg_visible_in_snapshot(p_xid, c.snap)
          AND NOT (EXISTS (SELECT FROM unnest(c.held_topics, c.held_keys, c.held_from)
                                        AS h(topic, key, from_id)
                           WHERE h.topic = p_topic AND p_id >= h.from_id
                             AND (h.key = p_key OR (h.key IS NULL AND p_id = h.from_id)))
                   AND p_id <> ALL (c.also_sent)))
$$;
REVOKE ALL ON FUNCTION outbox.log_covers(bigint, text, text, xid8) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.log_covers(bigint, text, text, xid8) TO outboxd_relay;

-- The rows not yet published, in any mode: unsent and not covered (above).
-- Read by index from the floor of every slot's cursor (ids above it, rows
-- of writers its snapshot did not see, rows of its held keys), each then
-- tested against its own slot's cursor row unless the floor is the one
-- row about every row. No cursor row at all (mark and delete mode): every
-- unsent row.
CREATE OR REPLACE VIEW outbox.unpublished AS
WITH c AS (SELECT * FROM outbox.log_floor(NULL, NULL))
SELECT e.* FROM c, outbox.events e
WHERE e.sent_at IS NULL AND e.id > c.hwm
  AND (c.whole OR NOT outbox.log_covers(e.id, e.topic, e.key, e.xid))
UNION ALL
SELECT e.* FROM c, outbox.events e
WHERE e.sent_at IS NULL AND (e.xid, e.id) >= (pg_snapshot_xmin(c.snap), (-9223372036854775807 - 1)::bigint)
  AND e.id <= c.hwm AND NOT pg_visible_in_snapshot(e.xid, c.snap)
  AND (c.whole OR NOT outbox.log_covers(e.id, e.topic, e.key, e.xid))
UNION ALL
SELECT e.* FROM c, outbox.events e
WHERE e.sent_at IS NULL AND e.id <= c.hwm AND pg_visible_in_snapshot(e.xid, c.snap)
  AND e.id >= coalesce((SELECT min(f) FROM unnest(c.held_from) f), c.hwm + 1)
  AND EXISTS (SELECT FROM unnest(c.held_topics, c.held_keys, c.held_from) AS h(topic, key, from_id)
              WHERE h.topic = e.topic AND e.id >= h.from_id
                AND (h.key = e.key OR (h.key IS NULL AND e.id = h.from_id)))
  AND e.id <> ALL (c.also_sent)
  AND (c.whole OR NOT outbox.log_covers(e.id, e.topic, e.key, e.xid))
UNION ALL
SELECT e.* FROM outbox.events e
WHERE e.sent_at IS NULL AND NOT EXISTS (SELECT FROM c)
  AND (NOT EXISTS (SELECT FROM outbox.log_cursor)
       OR NOT outbox.log_covers(e.id, e.topic, e.key, e.xid));

-- A cursor row with its slots. p_slots NULL: as advance_cursor() (a relay
-- alone). Otherwise the row is about the slots of p_slots this session
-- holds (a slot lost with a session is never claimed), its number is the
-- next after every relay's (the lock orders the writers' commits), the
-- offsets go to outbox.kafka_slot_offsets for each of its slots, and with
-- p_restart the rows no slot needs any longer are deleted (those below the
-- oldest of the newest rows about each slot). Returns 1, or 0 if the
-- session holds none of p_slots.
CREATE OR REPLACE FUNCTION outbox.advance_cursor(
    p_batch bigint, p_hwm bigint, p_snap pg_snapshot, p_held_topics text[],
    p_held_keys text[], p_held_from bigint[], p_also_sent bigint[], p_topics text[],
    p_partitions integer[], p_offsets bigint[], p_restart boolean,
    p_shards integer, p_slots integer[])
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_db oid;
    v_slots integer[];
    v_batch bigint;
    v_keep bigint;
BEGIN
    IF p_slots IS NULL THEN
        RETURN outbox.advance_cursor(p_batch, p_hwm, p_snap, p_held_topics, p_held_keys,
                                     p_held_from, p_also_sent, p_topics, p_partitions,
                                     p_offsets, p_restart);
    END IF;
    v_db := (SELECT oid FROM pg_database WHERE datname = current_database());
    v_slots := ARRAY(SELECT s FROM unnest(p_slots) AS s
                     WHERE EXISTS (SELECT FROM pg_locks
                                   WHERE locktype = 'advisory' AND database = v_db
                                     AND classid = 1868724340 AND objid = s AND objsubid = 2
                                     AND pid = pg_backend_pid() AND granted)
                     ORDER BY 1);
    IF cardinality(v_slots) = 0 THEN
        RETURN 0;
    END IF;
    PERFORM pg_advisory_xact_lock(1868724341, 0);
    v_batch := coalesce((SELECT max(batch) FROM outbox.log_cursor), 0) + 1;
    INSERT INTO outbox.log_cursor (batch, hwm, snap, held_topics, held_keys, held_from,
                                   also_sent, shards, slots)
    VALUES (v_batch, p_hwm, p_snap, p_held_topics, p_held_keys, p_held_from, p_also_sent,
            p_shards, v_slots);
    INSERT INTO outbox.kafka_slot_offsets AS k (topic, kafka_partition, last_offset, shards, slot)
    SELECT t.topic, t.p, t.o, p_shards, s.slot
    FROM unnest(p_topics, p_partitions, p_offsets) AS t(topic, p, o), unnest(v_slots) AS s(slot)
    ON CONFLICT (topic, kafka_partition, shards, slot) DO UPDATE
       SET last_offset = greatest(k.last_offset, excluded.last_offset), updated_at = now();
    IF p_restart THEN
        -- Every row below the oldest of them is older than a row about each
        -- slot, so the newest row about any outbox row is above it. A slot
        -- with no row of this count yet keeps everything: rows written
        -- under another count may still be the newest about some of its
        -- rows.
        SELECT CASE WHEN bool_and(b IS NOT NULL) THEN min(b) END INTO v_keep
        FROM (SELECT (SELECT l.batch FROM outbox.log_cursor l
                      WHERE l.slots IS NULL OR (l.shards = p_shards AND g = ANY (l.slots))
                      ORDER BY l.batch DESC LIMIT 1) AS b
              FROM generate_series(0, p_shards - 1) AS g) n;
        IF v_keep IS NOT NULL THEN
            DELETE FROM outbox.log_cursor WHERE batch < v_keep;
        END IF;
    END IF;
    RETURN 1;
END
$$;
REVOKE ALL ON FUNCTION outbox.advance_cursor(bigint, bigint, pg_snapshot, text[], text[],
    bigint[], bigint[], text[], integer[], bigint[], boolean, integer, integer[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.advance_cursor(bigint, bigint, pg_snapshot, text[], text[],
    bigint[], bigint[], text[], integer[], bigint[], boolean, integer, integer[]) TO outboxd_relay;

-- Log mode's reclaim (sql/007) against the floor of every slot's cursor:
-- a partition goes once all of its rows are behind the newest cursor row
-- about each slot. Unchanged for a relay alone (the floor is its newest
-- row). The function is sql/007's with that one statement changed, so it
-- is rewritten from its own definition rather than spelled out again.
DO $$
DECLARE
    v_def text := pg_get_functiondef('outbox.reclaim_partitions(interval)'::regprocedure);
    v_old text := 'SELECT * INTO c FROM outbox.log_cursor ORDER BY batch DESC LIMIT 1;';
BEGIN
    IF position('outbox.log_floor(NULL, NULL)' IN v_def) > 0 THEN
        RETURN;
    END IF;
    IF position(v_old IN v_def) = 0 THEN
        RAISE EXCEPTION 'outbox.reclaim_partitions is not the one of sql/007_partitions.sql';
    END IF;
    EXECUTE replace(v_def, v_old, 'SELECT * INTO c FROM outbox.log_floor(NULL, NULL);');
END
$$;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (9, '009_log_slots') ON CONFLICT (version) DO NOTHING;

COMMIT;
