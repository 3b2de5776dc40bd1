-- outboxd schema, version 6: ids and writers the relay can trust.
--
-- Apply with: psql -v ON_ERROR_STOP=1 -f sql/006_writer_xid.sql (after 005).
-- Idempotent.
--
-- Per key, the relay publishes in id order, and enqueue's per-key lock makes
-- id order commit order only while ids are drawn one at a time: with an
-- identity cache above 1 each session draws from a block of its own, and a
-- later commit of a key can hold a lower id. The cache is pinned to 1 here,
-- and the relay refuses to start (and --check fails) if it is raised again.
--
-- The relay finds late commits by each row's xid, so that must be the
-- transaction that wrote the row in this cluster. A restore (pg_dump with
-- the column, COPY), logical replication or INSERT ... SELECT from another
-- outbox may supply another cluster's xid, which can lie ahead of this
-- cluster's: such a row would look late to every fetch and be published
-- again and again. A trigger puts the writer's own xid on every row inserted
-- (its WHEN test costs a comparison for rows that already have it, which is
-- every row enqueue writes; it fires for logical replication too), and
-- outbox.repair_writer_xids(), which the relay runs each time it takes the
-- relay lock, fixes rows that came in around it (a restore with triggers
-- disabled, rows written before this file). Until then the relay leaves
-- such rows out of its keyset fetch rather than hand them out again and
-- again.

BEGIN;
SET LOCAL client_min_messages = warning;
DO $$ BEGIN PERFORM pg_advisory_xact_lock(1868724324, 0); END $$;

-- Only when needed: the ALTER takes an exclusive lock on the table.
DO $$
BEGIN
    IF (SELECT seqcache FROM pg_catalog.pg_sequence
        WHERE seqrelid = pg_get_serial_sequence('outbox.events', 'id')::regclass) <> 1 THEN
        ALTER TABLE outbox.events ALTER COLUMN id SET CACHE 1;
    END IF;
END
$$;

-- sql/004's outbox.unsent_again() does what is needed: it gives NEW the
-- xid of the transaction that writes it.
CREATE OR REPLACE TRIGGER own_xid
    BEFORE INSERT ON outbox.events
    FOR EACH ROW WHEN (NEW.xid IS DISTINCT FROM pg_current_xact_id())
    EXECUTE FUNCTION outbox.unsent_again();
-- ALWAYS: it fires for logical replication's apply worker too
-- (session_replication_role = replica), which skips ordinary triggers.
ALTER TABLE outbox.events ENABLE ALWAYS TRIGGER own_xid;

-- Unsent rows whose xid this cluster's snapshot calls running or not yet
-- begun, though the rows are committed and visible: written elsewhere. They
-- take the xid of the transaction that repairs them, as if written now, so
-- the relay finds them once. Returns how many.
CREATE OR REPLACE FUNCTION outbox.repair_writer_xids() RETURNS bigint
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH s AS (SELECT pg_current_snapshot() AS snap),
    foreign_rows AS (
        -- Two index ranges of (xid, id): xids not begun, xids running.
        SELECT e.id FROM s, outbox.events e
        WHERE e.sent_at IS NULL
          AND (e.xid, e.id) >= (pg_snapshot_xmax(s.snap), (-9223372036854775807 - 1)::bigint)
        UNION ALL
        SELECT e.id FROM s, pg_snapshot_xip(s.snap) AS x(xid), outbox.events e
        WHERE e.sent_at IS NULL AND e.xid = x.xid),
    fixed AS (
        UPDATE outbox.events e SET xid = pg_current_xact_id()
        FROM foreign_rows f WHERE e.id = f.id
        RETURNING 1)
    SELECT count(*) FROM fixed;
$$;
REVOKE ALL ON FUNCTION outbox.repair_writer_xids() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.repair_writer_xids() TO outboxd_relay;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (6, '006_writer_xid') ON CONFLICT (version) DO NOTHING;

COMMIT;
