-- outboxd schema, version 8: several active relays, each owning a share of
-- the keys (relay.shards).
--
-- Apply with: psql -v ON_ERROR_STOP=1 -f sql/008_shards.sql (after 007).
-- Idempotent. Nothing here touches outbox.events or enqueue(): the
-- application's writers never wait on it.
--
-- Keys hash into relay.shards slots (outbox.slot_of; a row without a key
-- goes by its id). Each relay holds a session-level advisory lock for every
-- slot it owns and publishes only rows of those slots, so a key is only
-- ever published by one relay at a time and per-key order holds across
-- relays. outbox.claim_slots(), called by each relay every 250 ms, counts
-- the relays (a shared member lock each), gives a relay's surplus back and
-- takes free slots up to its fair share. A relay gives a slot back only
-- when none of its rows is in flight or unmarked; one that takes a slot
-- runs the recovery pass for it before publishing it.
--
-- With several relays writing to the same Kafka partitions, one stored
-- offset per partition no longer bounds every relay's unmarked records:
-- relays with relay.shards above 1 keep one per slot, in
-- outbox.kafka_slot_offsets. A relay alone keeps outbox.kafka_offsets as
-- before (untouched here, so relays of the version before go on while this
-- file is applied).

BEGIN;
SET LOCAL client_min_messages = warning;
DO $$ BEGIN PERFORM pg_advisory_xact_lock(1868724324, 0); END $$;

-- The slot of a row: 0..p_shards-1. Computed by Postgres, so every relay
-- agrees whatever its platform. Inlined into the fetches' WHERE.
CREATE OR REPLACE FUNCTION outbox.slot_of(p_key text, p_id bigint, p_shards integer)
RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN p_shards <= 1 THEN 0
                ELSE (((pg_catalog.hashtextextended(coalesce(p_key, p_id::text), 0) % p_shards)
                       + p_shards) % p_shards)::integer END
$$;
GRANT EXECUTE ON FUNCTION outbox.slot_of(text, bigint, integer) TO outboxd_relay;

-- The Kafka offset of the last record confirmed per partition, for each
-- slot (of relay.shards = shards): written by the slot's owner with its
-- marks and recovery passes; a pass reads each partition from the lowest
-- offset of its slots (store.c, the recovery plan).
CREATE TABLE IF NOT EXISTS outbox.kafka_slot_offsets (
    topic           text NOT NULL,
    kafka_partition integer NOT NULL,
    shards          integer NOT NULL,
    slot            integer NOT NULL,
    last_offset     bigint NOT NULL,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, kafka_partition, shards, slot)
);
REVOKE ALL ON outbox.kafka_slot_offsets FROM PUBLIC;
GRANT SELECT, INSERT, UPDATE ON outbox.kafka_slot_offsets TO outboxd_relay;

-- Who owns which slot, for `outboxd status` and for recovery: a slot that
-- had an owner before the one running the pass may have records without a
-- stored offset on a partition (that owner died before storing one), so
-- recovery reads such a partition from its start; a slot taken for the
-- first time has published nothing under this count.
CREATE TABLE IF NOT EXISTS outbox.slot_owners (
    shards      integer NOT NULL,
    slot        integer NOT NULL,
    owner_pid   integer NOT NULL,
    owner_name  text NOT NULL DEFAULT '',
    owned_since timestamptz NOT NULL DEFAULT now(),
    handovers   bigint NOT NULL DEFAULT 0,
    -- The owner gave the slot back with nothing of it in flight or unmarked.
    given_back  boolean NOT NULL DEFAULT false,
    -- When the owner took it, the one before had given it back so (or there
    -- was none): no record of the slot can be missing a stored offset.
    taken_clean boolean NOT NULL DEFAULT true,
    PRIMARY KEY (shards, slot)
);
-- (A database that ran an earlier draft of this file has the table without them.)
ALTER TABLE outbox.slot_owners ADD COLUMN IF NOT EXISTS given_back boolean NOT NULL DEFAULT false;
ALTER TABLE outbox.slot_owners ADD COLUMN IF NOT EXISTS taken_clean boolean NOT NULL DEFAULT true;
REVOKE ALL ON outbox.slot_owners FROM PUBLIC;
GRANT SELECT, INSERT, UPDATE ON outbox.slot_owners TO outboxd_relay;

-- sql/006's repair, limited to the rows of some slots (p_slots NULL: every
-- row). A relay alone repairs every row when it takes the relay lock; a
-- relay with slots repairs those of the slots it takes (claim_slots),
-- since another relay may have a row of its own slots in flight, and a row
-- given a new xid would come back to that relay's next fetch. One
-- implementation: repair_writer_xids() now calls this one.
CREATE OR REPLACE FUNCTION outbox.repair_writer_xids(p_shards integer, p_slots integer[])
RETURNS bigint
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH s AS (SELECT pg_current_snapshot() AS snap),
    foreign_rows AS (
        -- Two index ranges of (xid, id): xids not begun, xids running.
        SELECT e.id, e.key FROM s, outbox.events e
        WHERE e.sent_at IS NULL
          AND (e.xid, e.id) >= (pg_snapshot_xmax(s.snap), (-9223372036854775807 - 1)::bigint)
        UNION ALL
        SELECT e.id, e.key FROM s, pg_snapshot_xip(s.snap) AS x(xid), outbox.events e
        WHERE e.sent_at IS NULL AND e.xid = x.xid),
    fixed AS (
        UPDATE outbox.events e SET xid = pg_current_xact_id()
        FROM foreign_rows f
        WHERE e.id = f.id
          AND (p_slots IS NULL OR outbox.slot_of(f.key, f.id, p_shards) = ANY (p_slots))
        RETURNING 1)
    SELECT count(*) FROM fixed;
$$;
REVOKE ALL ON FUNCTION outbox.repair_writer_xids(integer, integer[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.repair_writer_xids(integer, integer[]) TO outboxd_relay;
CREATE OR REPLACE FUNCTION outbox.repair_writer_xids() RETURNS bigint
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$ SELECT outbox.repair_writer_xids(1, NULL) $$;

-- One relay's look at the members and its slots: gives p_give_back back
-- (slots it no longer has rows of in flight), and with p_take takes free
-- slots up to its fair share. Members are the sessions holding the shared
-- member lock for p_shards (taken here on the first call); ordered by pid,
-- the first p_shards % members get one slot more. If a member runs with
-- another relay.shards, other_shards names it and nothing is taken: two
-- counts would map a key to two owners. The slots it holds whose owner
-- row is not yet this session's (taken now, or by a call that failed after
-- taking the lock: advisory locks are not undone with it) are recorded in
-- outbox.slot_owners, and their rows repaired (below).
DROP FUNCTION IF EXISTS outbox.claim_slots(integer, integer[], boolean);
CREATE FUNCTION outbox.claim_slots(p_shards integer, p_give_back integer[],
                                              p_take boolean,
                                              OUT owned integer[], OUT members integer,
                                              OUT share integer, OUT free integer,
                                              OUT other_shards integer, OUT repaired bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_db oid := (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database());
    v_me integer := pg_catalog.pg_backend_pid();
    v_started timestamptz := (SELECT backend_start FROM pg_catalog.pg_stat_activity
                              WHERE pid = pg_catalog.pg_backend_pid());
    v_rank integer;
    v_slot integer;
    v_taken integer[];
BEGIN
    IF p_shards < 1 OR p_shards > 1024 THEN
        RAISE EXCEPTION 'relay.shards must be 1 to 1024, not %', p_shards;
    END IF;
    repaired := 0;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_locks
                   WHERE locktype = 'advisory' AND database = v_db AND classid = 1868724339
                     AND objid = p_shards AND objsubid = 2 AND pid = v_me AND granted) THEN
        PERFORM pg_catalog.pg_advisory_lock_shared(1868724339, p_shards);
    END IF;
    -- Given back with nothing in flight or unmarked (the relay waits for
    -- that): its next owner need not look for records without an offset.
    UPDATE outbox.slot_owners SET given_back = true
    WHERE shards = p_shards AND slot = ANY (coalesce(p_give_back, '{}')) AND owner_pid = v_me;
    PERFORM pg_catalog.pg_advisory_unlock(1868724340, s)
    FROM unnest(coalesce(p_give_back, '{}')) AS s
    WHERE EXISTS (SELECT FROM pg_catalog.pg_locks
                  WHERE locktype = 'advisory' AND database = v_db AND classid = 1868724340
                    AND objid = s AND objsubid = 2 AND pid = v_me AND granted);
    SELECT min(objid::integer) INTO other_shards FROM pg_catalog.pg_locks
    WHERE locktype = 'advisory' AND database = v_db AND classid = 1868724339 AND objsubid = 2
      AND granted AND objid <> p_shards;
    SELECT count(DISTINCT pid), count(DISTINCT pid) FILTER (WHERE pid < v_me)
    INTO members, v_rank FROM pg_catalog.pg_locks
    WHERE locktype = 'advisory' AND database = v_db AND classid = 1868724339
      AND objid = p_shards AND objsubid = 2 AND granted;
    share := p_shards / members + CASE WHEN v_rank < p_shards % members THEN 1 ELSE 0 END;
    owned := ARRAY(SELECT objid::integer FROM pg_catalog.pg_locks
                   WHERE locktype = 'advisory' AND database = v_db AND classid = 1868724340
                     AND objsubid = 2 AND pid = v_me AND granted ORDER BY 1);
    IF p_take AND other_shards IS NULL AND cardinality(owned) < share THEN
        -- Free slots, starting at a place of our own: relays that take at
        -- the same moment mostly try different ones.
        FOR v_slot IN
            SELECT g FROM generate_series(0, p_shards - 1) AS g
            WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_locks
                              WHERE locktype = 'advisory' AND database = v_db
                                AND classid = 1868724340 AND objid = g AND objsubid = 2
                                AND granted)
            ORDER BY (g - v_rank * (p_shards / members) + p_shards) % p_shards
        LOOP
            IF pg_catalog.pg_try_advisory_lock(1868724340, v_slot) THEN
                owned := owned || v_slot;
                EXIT WHEN cardinality(owned) >= share;
            END IF;
        END LOOP;
        owned := ARRAY(SELECT unnest(owned) ORDER BY 1);
    END IF;
    v_taken := ARRAY(SELECT s FROM unnest(owned) AS s
                     WHERE NOT EXISTS (SELECT FROM outbox.slot_owners o
                                       WHERE o.shards = p_shards AND o.slot = s
                                         AND o.owner_pid = v_me AND o.owned_since >= v_started
                                         AND NOT o.given_back));
    IF cardinality(v_taken) > 0 THEN
        INSERT INTO outbox.slot_owners AS o (shards, slot, owner_pid, owner_name)
        SELECT p_shards, s, v_me, coalesce(current_setting('application_name', true), '')
        FROM unnest(v_taken) AS s
        ON CONFLICT (shards, slot) DO UPDATE
            SET owner_pid = excluded.owner_pid, owner_name = excluded.owner_name,
                owned_since = now(), handovers = o.handovers + 1,
                taken_clean = o.given_back, given_back = false;
    END IF;
    -- Rows of the slots just taken that carry another cluster's xid take
    -- this one's now, before the relay's pass and first fetch of them:
    -- nobody has them in flight (their last owner is gone, or gave them
    -- back with nothing out).
    IF cardinality(v_taken) > 0 THEN
        repaired := outbox.repair_writer_xids(p_shards, v_taken);
    END IF;
    SELECT p_shards - count(DISTINCT objid) INTO free FROM pg_catalog.pg_locks
    WHERE locktype = 'advisory' AND database = v_db AND classid = 1868724340 AND objsubid = 2
      AND granted AND objid < p_shards;
END
$$;
REVOKE ALL ON FUNCTION outbox.claim_slots(integer, integer[], boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.claim_slots(integer, integer[], boolean) TO outboxd_relay;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (8, '008_shards') ON CONFLICT (version) DO NOTHING;

COMMIT;
