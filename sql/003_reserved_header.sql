-- outboxd schema, version 3: the header name outbox-id is reserved.
--
-- Apply with: psql -v ON_ERROR_STOP=1 -f sql/003_reserved_header.sql (after
-- 002). Idempotent.
--
-- outboxd puts the row id in a Kafka header named outbox-id, first among the
-- record's headers; crash recovery and consumers read that first one. A user
-- header of the same name (often forwarded from an incoming message) would
-- be a second one that readers taking the last header mistake for ours, so
-- rows carrying it are refused at write time, by outbox.enqueue() and by a
-- direct INSERT alike.

BEGIN;
SET LOCAL client_min_messages = warning;
DO $$ BEGIN PERFORM pg_advisory_xact_lock(1868724324, 0); END $$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_constraint
                   WHERE conrelid = 'outbox.events'::regclass
                     AND conname = 'header_outbox_id_is_reserved_for_outboxd') THEN
        -- NOT VALID: rows already written are not checked (the relay reads
        -- the first outbox-id header, its own, for them too).
        ALTER TABLE outbox.events ADD CONSTRAINT header_outbox_id_is_reserved_for_outboxd
            CHECK (NOT (headers ? 'outbox-id')) NOT VALID;
    END IF;
END
$$;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (3, '003_reserved_header') ON CONFLICT (version) DO NOTHING;

COMMIT;
