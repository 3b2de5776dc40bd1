-- outboxd schema, version 14: log mode keeps a floor across a change of
-- relay.shards.
--
-- Apply with: psql -v ON_ERROR_STOP=1 -f sql/014_log_floor_after_change.sql
-- (after 013). Idempotent. Nothing here touches outbox.events or enqueue().
--
-- outbox.log_floor() (sql/009) merges the newest cursor rows about the
-- slots of one count of shards. Right after relay.shards changed, a slot
-- of the new count has no cursor row yet, and it returned nothing: the
-- relay's full fetch, outbox.unpublished and the recovery pass then read
-- and tested every row of the outbox (0.4 s a statement for 400,000 rows,
-- past the statement timeout on a large outbox, where the relay could not
-- write the cursor row that ends it). Every row of the outbox is covered,
-- if at all, by the newest cursor row about its slot under some count,
-- which is one of outbox.log_newest(). Take a count whose slots all have
-- such a row (or a row about every slot): every row's newest cursor row is
-- at least as new as the oldest of those. So the rows of log_newest() from
-- there on, merged as before, are a floor: a row below it is covered by
-- its own newest row (or listed as published by one of them). Older rows (of a count used long ago) do not lower
-- it. With no such count there is still no floor.

BEGIN;
SET LOCAL client_min_messages = warning;
DO $$ BEGIN PERFORM pg_advisory_xact_lock(1868724324, 0); END $$;

-- As in sql/009, but when a slot asked for has no cursor row of its count
-- the floor merges the rows of outbox.log_newest() from batch `since` on:
-- for each count whose slots all have a newest row there, the oldest of
-- those; `since` is the highest of them.
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
    per0 AS (
        SELECT w.alone, c.* FROM want w
        LEFT JOIN LATERAL (
            SELECT l.* FROM outbox.log_cursor l
            WHERE l.slots IS NULL OR (NOT w.alone AND l.shards = w.shards AND w.slot = ANY (l.slots))
            ORDER BY l.batch DESC LIMIT 1) c ON true),
    -- Only when a slot asked for has no row: log_newest() and, per count
    -- found there, the oldest batch among its slots' newest rows.
    newest AS MATERIALIZED (
        SELECT * FROM outbox.log_newest() WHERE EXISTS (SELECT FROM per0 WHERE batch IS NULL)),
    since AS (
        SELECT max(k.oldest) AS batch FROM (
            SELECT c.shards, min(b.batch) AS oldest, bool_and(b.batch IS NOT NULL) AS complete
            FROM (SELECT DISTINCT shards FROM newest) c,
                 generate_series(0, c.shards - 1) AS s(slot),
                 LATERAL (SELECT max(v.batch) AS batch FROM newest v
                          WHERE v.slots IS NULL
                             OR (v.shards = c.shards AND s.slot = ANY (v.slots))) b
            GROUP BY c.shards) k
        WHERE k.complete),
    per AS (
        SELECT * FROM per0 p
        WHERE p.batch IS NOT NULL OR (SELECT batch FROM since) IS NULL
        UNION ALL
        SELECT false, v.* FROM newest v WHERE v.batch >= (SELECT batch FROM since)),
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

INSERT INTO outbox.schema_migrations (version, name)
VALUES (14, '014_log_floor_after_change') ON CONFLICT (version) DO NOTHING;

COMMIT;
