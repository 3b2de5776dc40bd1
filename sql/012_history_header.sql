-- outboxd schema, version 12: the header name outbox-history is reserved.
--
-- Apply with: psql -v ON_ERROR_STOP=1 -f sql/012_history_header.sql (after
-- 011). Idempotent. Brief lock on outbox.events; no row is read or written.
--
-- outboxd puts the history of the database its session is on (the server's
-- system identifier and timeline, see 011) in a header named
-- outbox-history, right after outbox-id: ids are unique within one history,
-- so (outbox-history, outbox-id) tells two rows with one id apart after a
-- failover to an asynchronous standby or a restore. As with outbox-id
-- (003), a row carrying a header of that name is refused at write time, by
-- outbox.enqueue() and by a direct INSERT alike: readers take the first
-- one, and it must be the relay's. One constraint tests both names, at the
-- cost of the one it replaces.

BEGIN;
SET LOCAL client_min_messages = warning;
DO $$ BEGIN PERFORM pg_advisory_xact_lock(1868724324, 0); END $$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_constraint
                   WHERE conrelid = 'outbox.events'::regclass
                     AND conname = 'header_names_reserved_for_outboxd') THEN
        -- NOT VALID: rows already written are not checked (the relay's
        -- headers come first for them too).
        ALTER TABLE outbox.events ADD CONSTRAINT header_names_reserved_for_outboxd
            CHECK (NOT (headers ?| '{outbox-id,outbox-history}'::text[])) NOT VALID;
        ALTER TABLE outbox.events DROP CONSTRAINT IF EXISTS header_outbox_id_is_reserved_for_outboxd;
    END IF;
END
$$;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (12, '012_history_header') ON CONFLICT (version) DO NOTHING;

COMMIT;
