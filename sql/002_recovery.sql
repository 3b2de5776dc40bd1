-- outboxd schema, version 2: crash recovery and dead letters.
--
-- Apply with: psql -v ON_ERROR_STOP=1 -f sql/002_recovery.sql (after 001).
-- Idempotent.

BEGIN;
SET LOCAL client_min_messages = warning;
DO $$ BEGIN PERFORM pg_advisory_xact_lock(1868724324, 0); END $$;

-- The Kafka offset of the last record outboxd confirmed per partition,
-- written in the same transaction that marks rows sent. On start-up outboxd
-- reads each partition after it: a record there carrying the outbox-id of a
-- still-unsent row was published by a run that crashed before marking it,
-- so the row is marked instead of published again.
CREATE TABLE IF NOT EXISTS outbox.kafka_offsets (
    topic           text NOT NULL,
    kafka_partition integer NOT NULL,
    last_offset     bigint NOT NULL,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, kafka_partition)
);

-- Rows Kafka refused for good (too large, unknown topic, ...) under
-- relay.on_reject = dead_letter: moved here with the reason, in the same
-- transaction that removes them from outbox.events.
CREATE TABLE IF NOT EXISTS outbox.dead_letters (
    id         bigint PRIMARY KEY,
    topic      text NOT NULL,
    key        text,
    payload    bytea,
    headers    jsonb NOT NULL,
    created_at timestamptz NOT NULL,
    failed_at  timestamptz NOT NULL DEFAULT now(),
    reason     text NOT NULL
);

REVOKE ALL ON outbox.kafka_offsets, outbox.dead_letters FROM PUBLIC;
GRANT SELECT, INSERT, UPDATE ON outbox.kafka_offsets TO outboxd_relay;
GRANT SELECT, INSERT ON outbox.dead_letters TO outboxd_relay;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (2, '002_recovery') ON CONFLICT (version) DO NOTHING;

COMMIT;
