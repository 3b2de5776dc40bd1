-- outboxd schema, version 11: the history the relay last saw the database on.
--
-- Apply with: psql -v ON_ERROR_STOP=1 -f sql/011_history.sql (after 010).
-- Idempotent. Nothing here touches outbox.events or enqueue().
--
-- Ids are unique within one history of the database. A failover to an
-- asynchronous standby, a point-in-time restore, a restored dump or a
-- logical-replication cut-over continues from an older state and can hand
-- out ids again whose records are already in Kafka. The relay keeps here
-- the server's system identifier (pg_control_system(); a restored dump or
-- a logical copy has another) and timeline (a promoted standby and a
-- point-in-time restore start a new one) as of its last session, and says
-- so when a session finds other ones: this row travels with the data
-- (replicated to a standby, in a backup), so a relay started after the
-- change sees it too. One row; written only when it changes.

BEGIN;
SET LOCAL client_min_messages = warning;
DO $$ BEGIN PERFORM pg_advisory_xact_lock(1868724324, 0); END $$;

CREATE TABLE IF NOT EXISTS outbox.history (
    one       boolean PRIMARY KEY DEFAULT true CHECK (one),
    system_id text NOT NULL,
    timeline  integer NOT NULL,
    seen_at   timestamptz NOT NULL DEFAULT now()
);
GRANT SELECT, INSERT, UPDATE ON outbox.history TO outboxd_relay;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (11, '011_history') ON CONFLICT (version) DO NOTHING;

COMMIT;
