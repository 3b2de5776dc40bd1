-- outboxd schema, version 7: the outbox in partitions, and log mode's cursor.
--
-- Apply with: psql -v ON_ERROR_STOP=1 -f sql/007_partitions.sql (after 006).
-- Idempotent. Safe under load: the application's writers wait only for the
-- moment of the swap (step 3, a few milliseconds), never for a scan.
--
-- outbox.events becomes a table partitioned by id range. The rows it holds
-- now stay where they are, in the partition outbox.events_legacy (every id
-- below a bound set 100,000,000 above the highest id drawn so far; a
-- new install starts at 1); new
-- rows go to partitions of retention.partition_rows ids each, which the relay
-- creates ahead of the ids (outbox.upkeep_partitions) in every mode. Ids
-- jump once, to that bound: an identity has gaps anyway, and ids stay in
-- commit order per key.
--
-- Why partitions: in log mode (relay.on_sent = log) the relay writes
-- nothing per row; its progress is the cursor below, and space comes back a
-- whole partition at a time (outbox.reclaim_partitions): TRUNCATE or DROP
-- of a partition every row of which the stored cursor covers, past
-- retention. No row is updated or deleted, so none is left dead for vacuum,
-- and a held xmin horizon keeps nothing the relay reads. By id range, not
-- by time: the cursor is an id, so "every row of this partition is behind
-- the cursor" is one comparison of bounds plus a look at the few rows whose
-- writers the cursor's snapshot saw running; a time range would need every
-- row's id checked against it.
--
-- A DEFAULT partition catches rows no range partition takes (ids drawn
-- faster than the relay created partitions, or no relay running for a long
-- time; a dead letter put back with an id whose partition is gone), so an
-- application's INSERT never fails for want of a partition.

-- Step 1: a bound every id of the plain table stays below. NOT VALID takes
-- the table's lock only for a moment; rows inserted from now on are checked.
BEGIN;
SET LOCAL client_min_messages = warning;
DO $$ BEGIN PERFORM pg_advisory_xact_lock(1868724324, 0); END $$;
DO $$
DECLARE
    v_seq regclass := pg_get_serial_sequence('outbox.events', 'id')::regclass;
    v_last bigint;
    v_used boolean;
BEGIN
    IF (SELECT relkind FROM pg_class WHERE oid = 'outbox.events'::regclass) = 'p'
       OR EXISTS (SELECT FROM pg_constraint WHERE conrelid = 'outbox.events'::regclass
                  AND conname = 'events_before_partitions') THEN
        RETURN;
    END IF;
    EXECUTE format('SELECT last_value, is_called FROM %s', v_seq) INTO v_last, v_used;
    -- An identity never drawn from (a new install): no margin, ids from 1.
    IF v_used OR EXISTS (SELECT FROM outbox.events) THEN
        v_last := greatest(v_last, (SELECT max(id) FROM outbox.events)) + 100000000;
    ELSE
        v_last := 1;
    END IF;
    EXECUTE format('ALTER TABLE outbox.events ADD CONSTRAINT events_before_partitions'
                   ' CHECK (id < %s) NOT VALID', v_last);
END
$$;
COMMIT;

-- Step 2: the scan that proves it, while writers go on (SHARE UPDATE
-- EXCLUSIVE). The swap then needs no scan of its own.
BEGIN;
SET LOCAL client_min_messages = warning;
DO $$
BEGIN
    IF (SELECT relkind FROM pg_class WHERE oid = 'outbox.events'::regclass) = 'r' THEN
        ALTER TABLE outbox.events VALIDATE CONSTRAINT events_before_partitions;
    END IF;
END
$$;
COMMIT;

-- Step 3: the swap. The plain table becomes the partition below the bound.
BEGIN;
SET LOCAL client_min_messages = warning;
DO $$ BEGIN PERFORM pg_advisory_xact_lock(1868724324, 0); END $$;
DO $$
DECLARE
    v_bound bigint;
BEGIN
    IF (SELECT relkind FROM pg_class WHERE oid = 'outbox.events'::regclass) = 'p' THEN
        RETURN;
    END IF;
    LOCK TABLE outbox.events IN ACCESS EXCLUSIVE MODE;
    v_bound := substring(pg_get_constraintdef(
                   (SELECT oid FROM pg_constraint WHERE conrelid = 'outbox.events'::regclass
                    AND conname = 'events_before_partitions')) FROM '< \(?(-?[0-9]+)')::bigint;

    ALTER TABLE outbox.events RENAME TO events_legacy;
    ALTER INDEX outbox.events_pkey RENAME TO events_legacy_pkey;
    ALTER INDEX outbox.events_unsent_idx RENAME TO events_legacy_unsent_idx;
    ALTER INDEX outbox.events_unsent_xid_id_idx RENAME TO events_legacy_unsent_xid_id_idx;
    -- The parent's triggers are cloned onto every partition, this one too.
    DROP TRIGGER own_xid ON outbox.events_legacy;
    DROP TRIGGER unsent_again ON outbox.events_legacy;
    ALTER TABLE outbox.events_legacy ALTER COLUMN id DROP IDENTITY;

    CREATE TABLE outbox.events (
        id         bigint GENERATED ALWAYS AS IDENTITY (START WITH 1 CACHE 1),
        topic      text NOT NULL CONSTRAINT events_topic_check CHECK (topic <> ''),
        key        text,
        payload    bytea,                -- NULL = tombstone
        headers    jsonb NOT NULL DEFAULT '{}'::jsonb
                   CONSTRAINT events_headers_check CHECK (jsonb_typeof(headers) = 'object'),
        created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
        sent_at    timestamptz,          -- mark mode: NULL until Kafka acknowledged the record
        xid        xid8 DEFAULT pg_current_xact_id(),
        CONSTRAINT events_pkey PRIMARY KEY (id)
    ) PARTITION BY RANGE (id);
    EXECUTE format('ALTER TABLE outbox.events ALTER COLUMN id RESTART WITH %s', v_bound);
    ALTER TABLE outbox.events ADD CONSTRAINT header_outbox_id_is_reserved_for_outboxd
        CHECK (NOT (headers ? 'outbox-id')) NOT VALID;
    CREATE INDEX events_unsent_idx ON outbox.events (id) WHERE sent_at IS NULL;
    CREATE INDEX events_unsent_xid_id_idx ON outbox.events (xid, id) WHERE sent_at IS NULL;
    CREATE TRIGGER unsent_again
        BEFORE UPDATE OF sent_at ON outbox.events
        FOR EACH ROW WHEN (OLD.sent_at IS NOT NULL AND NEW.sent_at IS NULL)
        EXECUTE FUNCTION outbox.unsent_again();
    CREATE TRIGGER own_xid
        BEFORE INSERT ON outbox.events
        FOR EACH ROW WHEN (NEW.xid IS DISTINCT FROM pg_current_xact_id())
        EXECUTE FUNCTION outbox.unsent_again();
    ALTER TABLE outbox.events ENABLE ALWAYS TRIGGER own_xid;

    -- No scan: the validated CHECK says every row lies below the bound.
    EXECUTE format('ALTER TABLE outbox.events ATTACH PARTITION outbox.events_legacy'
                   ' FOR VALUES FROM (MINVALUE) TO (%s)', v_bound);
    ALTER TABLE outbox.events_legacy DROP CONSTRAINT events_before_partitions;
    EXECUTE format('CREATE TABLE outbox.%I PARTITION OF outbox.events'
                   ' FOR VALUES FROM (%s) TO (%s)', 'events_' || v_bound, v_bound,
                   v_bound + 1000000);
    CREATE TABLE outbox.events_default PARTITION OF outbox.events DEFAULT;

    REVOKE ALL ON outbox.events FROM PUBLIC;
    GRANT SELECT, DELETE ON outbox.events TO outboxd_relay;
    GRANT UPDATE (sent_at) ON outbox.events TO outboxd_relay;
END
$$;
COMMIT;

-- Step 4: log mode's cursor, and the partitions' upkeep.
BEGIN;
SET LOCAL client_min_messages = warning;
DO $$ BEGIN PERFORM pg_advisory_xact_lock(1868724324, 0); END $$;

-- Log mode's progress: one row per acknowledged batch, inserted (never
-- updated: no dead versions, however long a horizon is held). The newest
-- row says which rows are published: every row with id <= hwm whose writer
-- is visible in snap, except the rows of the held keys (topic, key, id at
-- or above from_id: refused or waiting behind a refused row) that are not
-- listed in also_sent. Each row stores the partitions' offsets that moved
-- since the row before; the first row after a TRUNCATE (the relay empties
-- the table every few thousand rows) stores them all. So the newest row
-- plus the offsets of all rows is the whole state.
CREATE TABLE IF NOT EXISTS outbox.log_cursor (
    batch            bigint PRIMARY KEY,
    hwm              bigint NOT NULL,
    snap             pg_snapshot NOT NULL,
    held_topics      text[] NOT NULL DEFAULT '{}',
    held_keys        text[] NOT NULL DEFAULT '{}',
    held_from        bigint[] NOT NULL DEFAULT '{}',
    also_sent        bigint[] NOT NULL DEFAULT '{}',
    topics           text[] NOT NULL DEFAULT '{}',
    kafka_partitions integer[] NOT NULL DEFAULT '{}',
    last_offsets     bigint[] NOT NULL DEFAULT '{}',
    written_at       timestamptz NOT NULL DEFAULT now()
);
REVOKE ALL ON outbox.log_cursor FROM PUBLIC;
GRANT SELECT, INSERT, UPDATE, TRUNCATE ON outbox.log_cursor TO outboxd_relay;

-- The rows not yet published, in any mode: unsent (sent_at NULL) and not
-- covered by the newest cursor row (log mode's; none in mark and delete
-- mode). Read by index: ids above the cursor, rows of writers its snapshot
-- did not see (from its xmin on), rows of its held keys.
CREATE OR REPLACE VIEW outbox.unpublished AS
WITH c AS (SELECT * FROM outbox.log_cursor ORDER BY batch DESC LIMIT 1)
SELECT e.* FROM c, outbox.events e WHERE e.sent_at IS NULL AND e.id > c.hwm
UNION ALL
SELECT e.* FROM c, outbox.events e
WHERE e.sent_at IS NULL AND (e.xid, e.id) >= (pg_snapshot_xmin(c.snap), (-9223372036854775807 - 1)::bigint)
  AND e.id <= c.hwm AND NOT pg_visible_in_snapshot(e.xid, c.snap)
UNION ALL
SELECT e.* FROM c, outbox.events e
WHERE e.sent_at IS NULL AND e.id <= c.hwm AND pg_visible_in_snapshot(e.xid, c.snap)
  AND e.id >= coalesce((SELECT min(f) FROM unnest(c.held_from) f), c.hwm + 1)
  AND EXISTS (SELECT FROM unnest(c.held_topics, c.held_keys, c.held_from) AS h(topic, key, from_id)
              WHERE h.topic = e.topic AND e.id >= h.from_id
                AND (h.key = e.key OR (h.key IS NULL AND e.id = h.from_id)))
  AND e.id <> ALL (c.also_sent)
UNION ALL
SELECT e.* FROM outbox.events e
WHERE e.sent_at IS NULL AND NOT EXISTS (SELECT FROM outbox.log_cursor);
REVOKE ALL ON outbox.unpublished FROM PUBLIC;
GRANT SELECT ON outbox.unpublished TO outboxd_relay;
-- outboxd replay and outboxd dead retry in log mode write a row again (a
-- new xid, which the cursor does not cover): the tools may run as the relay.
GRANT UPDATE (xid) ON outbox.events TO outboxd_relay;

-- The relay's write of one cursor row. With p_restart the table is emptied
-- first, in the same transaction (the row then carries every partition's
-- offset): a row per batch, and no row ever deleted, so nothing is left
-- for vacuum. TRUNCATE waits for readers of the table (outboxd status);
-- rather than make the relay wait, the row is then added without it, and
-- the relay empties the table at a later row. A row of the same number
-- again (its first commit's answer was lost) replaces it. Returns 1.
CREATE OR REPLACE FUNCTION outbox.advance_cursor(
    p_batch bigint, p_hwm bigint, p_snap pg_snapshot, p_held_topics text[],
    p_held_keys text[], p_held_from bigint[], p_also_sent bigint[], p_topics text[],
    p_partitions integer[], p_offsets bigint[], p_restart boolean)
RETURNS integer
LANGUAGE plpgsql
AS $$
BEGIN
    IF p_restart THEN
        BEGIN
            PERFORM pg_catalog.set_config('lock_timeout', '100ms', true);
            TRUNCATE outbox.log_cursor;
        EXCEPTION WHEN lock_not_available THEN
            NULL;
        END;
    END IF;
    INSERT INTO outbox.log_cursor (batch, hwm, snap, held_topics, held_keys, held_from,
                                   also_sent, topics, kafka_partitions, last_offsets)
    VALUES (p_batch, p_hwm, p_snap, p_held_topics, p_held_keys, p_held_from, p_also_sent,
            p_topics, p_partitions, p_offsets)
    ON CONFLICT (batch) DO UPDATE
       SET hwm = excluded.hwm, snap = excluded.snap, held_topics = excluded.held_topics,
           held_keys = excluded.held_keys, held_from = excluded.held_from,
           also_sent = excluded.also_sent, topics = excluded.topics,
           kafka_partitions = excluded.kafka_partitions, last_offsets = excluded.last_offsets,
           written_at = excluded.written_at;
    RETURN 1;
END
$$;
REVOKE ALL ON FUNCTION outbox.advance_cursor(bigint, bigint, pg_snapshot, text[], text[],
    bigint[], bigint[], text[], integer[], bigint[], boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.advance_cursor(bigint, bigint, pg_snapshot, text[], text[],
    bigint[], bigint[], text[], integer[], bigint[], boolean) TO outboxd_relay;

-- Range partitions ahead of the ids: at least p_ahead partitions of p_rows
-- ids each above the last id drawn. A partition is created on its own and
-- then attached, which takes a lock writers do not wait on (SHARE UPDATE
-- EXCLUSIVE); attaching scans the DEFAULT partition, which holds nothing
-- while partitions stay ahead. If the default holds rows, new partitions
-- start above its highest id. Returns how many were created.
CREATE OR REPLACE FUNCTION outbox.upkeep_partitions(p_rows bigint, p_ahead integer)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '200ms'
AS $$
DECLARE
    v_last bigint;
    v_top bigint;
    v_lo bigint;
    v_made integer := 0;
BEGIN
    IF p_rows < 1 OR p_ahead < 1 THEN
        RAISE EXCEPTION 'outbox.upkeep_partitions: p_rows and p_ahead must be positive';
    END IF;
    EXECUTE format('SELECT last_value FROM %s',
                   pg_get_serial_sequence('outbox.events', 'id')) INTO v_last;
    SELECT max(substring(pg_get_expr(c.relpartbound, c.oid) FROM 'TO \(''?(-?[0-9]+)')::bigint)
      INTO v_top
      FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
     WHERE i.inhparent = 'outbox.events'::regclass
       AND pg_get_expr(c.relpartbound, c.oid) <> 'DEFAULT';
    v_top := greatest(v_top, (SELECT max(id) + 1 FROM outbox.events_default), v_last + 1);
    WHILE v_made < p_ahead * 2 AND v_top <= v_last + p_ahead * p_rows LOOP
        v_lo := v_top;
        EXECUTE format('CREATE TABLE outbox.%I (LIKE outbox.events INCLUDING DEFAULTS'
                       ' INCLUDING CONSTRAINTS)', 'events_' || v_lo);
        EXECUTE format('ALTER TABLE outbox.events ATTACH PARTITION outbox.%I'
                       ' FOR VALUES FROM (%s) TO (%s)', 'events_' || v_lo, v_lo, v_lo + p_rows);
        v_top := v_lo + p_rows;
        v_made := v_made + 1;
    END LOOP;
    RETURN v_made;
END
$$;
REVOKE ALL ON FUNCTION outbox.upkeep_partitions(bigint, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.upkeep_partitions(bigint, integer) TO outboxd_relay;

-- Log mode's reclaim: partitions every row of which the newest cursor row
-- covers, whose newest row was written more than p_keep ago. Each is
-- dropped, or emptied by TRUNCATE when the DROP cannot have its lock at
-- once (a DROP locks outbox.events itself, so writers would queue behind
-- it; TRUNCATE locks only the partition, which no writer uses: its ids are
-- all drawn). lock_timeout bounds how long anyone waits behind either; a
-- partition not reclaimed now is tried again at the next round. An emptied
-- partition is dropped at a later round. Returns how many partitions were
-- dropped or emptied.
CREATE OR REPLACE FUNCTION outbox.reclaim_partitions(p_keep interval)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '50ms'
AS $$
DECLARE
    c record;
    p record;
    v_busy boolean;
    v_empty boolean;
    v_done integer := 0;
BEGIN
    SELECT * INTO c FROM outbox.log_cursor ORDER BY batch DESC LIMIT 1;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    FOR p IN
        SELECT b.rel, b.hi
          FROM (SELECT i.inhrelid::regclass AS rel,
                       substring(pg_get_expr(cl.relpartbound, cl.oid)
                                 FROM 'TO \(''?(-?[0-9]+)')::bigint AS hi
                  FROM pg_inherits i JOIN pg_class cl ON cl.oid = i.inhrelid
                 WHERE i.inhparent = 'outbox.events'::regclass) b
         WHERE b.hi IS NOT NULL AND b.hi - 1 <= c.hwm
         ORDER BY b.hi
    LOOP
        -- Covered: no row whose writer the cursor's snapshot saw running or
        -- not yet begun (a range of the (xid, id) index, which in log mode
        -- holds every row; a row marked in mark mode is published anyway),
        -- no row of a held key, and the newest row older than p_keep.
        EXECUTE format(
            'SELECT EXISTS (SELECT FROM %1$s e WHERE e.sent_at IS NULL'
            '               AND e.xid >= pg_snapshot_xmin($1)'
            '               AND NOT pg_visible_in_snapshot(e.xid, $1))'
            '    OR coalesce((SELECT e.created_at > now() - $2 FROM %1$s e'
            '                 ORDER BY e.id DESC LIMIT 1), false)'
            '    OR (cardinality($3::text[]) > 0 AND EXISTS ('
            '          SELECT FROM %1$s e, unnest($3::text[], $4::text[], $5::bigint[])'
            '                 AS h(topic, key, from_id)'
            '          WHERE e.sent_at IS NULL AND h.topic = e.topic AND h.key = e.key'
            '            AND e.id >= h.from_id AND e.id <> ALL ($6::bigint[]))),'
            '       NOT EXISTS (SELECT FROM %1$s e)', p.rel)
          INTO v_busy, v_empty
          USING c.snap, p_keep, c.held_topics, c.held_keys, c.held_from, c.also_sent;
        IF v_busy AND NOT v_empty THEN
            CONTINUE;
        END IF;
        BEGIN
            EXECUTE format('DROP TABLE %s', p.rel);
        EXCEPTION WHEN lock_not_available THEN
            IF v_empty THEN
                CONTINUE;
            END IF;
            BEGIN
                EXECUTE format('TRUNCATE %s', p.rel);
            EXCEPTION WHEN lock_not_available THEN
                CONTINUE;
            END;
        END;
        v_done := v_done + 1;
    END LOOP;
    RETURN v_done;
END
$$;
REVOKE ALL ON FUNCTION outbox.reclaim_partitions(interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.reclaim_partitions(interval) TO outboxd_relay;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (7, '007_partitions') ON CONFLICT (version) DO NOTHING;

COMMIT;
