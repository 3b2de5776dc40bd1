-- outboxd schema, version 13: a slot remembers every lost owner whose
-- transactional producer nobody has fenced yet.
--
-- Apply with: psql -v ON_ERROR_STOP=1 -f sql/013_unfenced_owners.sql (after
-- 012). Idempotent. Nothing here touches outbox.events or enqueue().
--
-- With relay.transactions and relay.shards above 1, a relay that takes a
-- slot whose owner lost it (its session ended without giving it back)
-- fences that owner's transactional producer before its pass over the
-- slot. If it dies before that fence, the next taker saw only it as the
-- owner before, not the first one, whose zombie could still commit. So a
-- handover carries the owner before (when it did not give the slot back)
-- and the ones it had not fenced into `unfenced`; the claim names them all
-- to the taker (outbox.owners_to_fence()), and drops those it fenced.

BEGIN;
SET LOCAL client_min_messages = warning;
DO $$ BEGIN PERFORM pg_advisory_xact_lock(1868724324, 0); END $$;

-- Backend pids, newest first, 64 at most (the relay fences no more at once).
ALTER TABLE outbox.slot_owners ADD COLUMN IF NOT EXISTS unfenced integer[] NOT NULL DEFAULT '{}';

CREATE OR REPLACE FUNCTION outbox.slot_owners_handover() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.unfenced := ARRAY(
        SELECT u FROM unnest(CASE WHEN OLD.given_back THEN '{}'::integer[]
                                  ELSE ARRAY[OLD.owner_pid] END || OLD.unfenced)
                      WITH ORDINALITY AS x(u, n)
        WHERE u <> NEW.owner_pid
        GROUP BY u ORDER BY min(n) LIMIT 64);
    RETURN NEW;
END
$$;
DROP TRIGGER IF EXISTS slot_owners_handover ON outbox.slot_owners;
CREATE TRIGGER slot_owners_handover
    BEFORE UPDATE OF owner_pid, owned_since ON outbox.slot_owners
    FOR EACH ROW
    WHEN (OLD.owner_pid IS DISTINCT FROM NEW.owner_pid
          OR OLD.owned_since IS DISTINCT FROM NEW.owned_since)
    EXECUTE FUNCTION outbox.slot_owners_handover();

-- For the claim, after claim_slots(): the calling session fenced p_fenced,
-- which leave the slots it holds; returns the lost owners of those slots
-- still to fence. A pid is in `unfenced` only if its owner lost the slot
-- without giving it back: the trigger reads given_back as committed (the
-- claim's upsert waits for a give-back under way). But a give-back's
-- advisory unlock outlives its statement if that fails (a timeout), so a
-- pid that is a member of the count now (its lock read live, not from a
-- per-transaction snapshot) is left for later: a running relay is not
-- fenced, and one that reuses a lost owner's pid fences that owner's id
-- itself, with its own. Not the slots it gave back: their rows may be
-- another relay's to take at this moment.
DROP FUNCTION IF EXISTS outbox.forget_fenced(integer, integer[]);
CREATE OR REPLACE FUNCTION outbox.owners_to_fence(p_shards integer, p_fenced integer[])
RETURNS integer[]
LANGUAGE plpgsql AS $$
DECLARE
    v_me integer := pg_catalog.pg_backend_pid();
    v_db oid := (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database());
BEGIN
    p_fenced := coalesce(p_fenced, '{}');
    IF cardinality(p_fenced) > 0 THEN
        UPDATE outbox.slot_owners
        SET unfenced = ARRAY(SELECT u FROM unnest(unfenced) AS u WHERE u <> ALL (p_fenced))
        WHERE shards = p_shards AND owner_pid = v_me AND NOT given_back
          AND unfenced && p_fenced;
    END IF;
    RETURN ARRAY(SELECT DISTINCT u FROM outbox.slot_owners o, unnest(o.unfenced) AS u
                 WHERE o.shards = p_shards AND o.owner_pid = v_me AND NOT o.given_back
                   AND u <> v_me AND u <> ALL (p_fenced)
                   AND NOT EXISTS (SELECT FROM pg_catalog.pg_locks l
                                   WHERE l.locktype = 'advisory' AND l.database = v_db
                                     AND l.classid = 1868724339 AND l.objid = p_shards
                                     AND l.objsubid = 2 AND l.granted AND l.pid = u)
                 ORDER BY 1);
END
$$;
REVOKE ALL ON FUNCTION outbox.owners_to_fence(integer, integer[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.owners_to_fence(integer, integer[]) TO outboxd_relay;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (13, '013_unfenced_owners') ON CONFLICT (version) DO NOTHING;

COMMIT;
