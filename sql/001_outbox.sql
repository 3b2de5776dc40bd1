-- outboxd schema, version 1: the outbox table, outbox.enqueue(), roles.
--
-- Apply with: psql -v ON_ERROR_STOP=1 -f sql/001_outbox.sql
-- Idempotent: applying it again changes nothing. Needs a role that may
-- create schemas and roles (the database owner plus CREATEROLE, or a
-- superuser). Files in sql/ are applied in file-name order.

BEGIN;

-- Serialize concurrent first-time installs of this file.
SET LOCAL client_min_messages = warning;
DO $$ BEGIN PERFORM pg_advisory_xact_lock(1868724324, 0); END $$;

CREATE SCHEMA IF NOT EXISTS outbox;

CREATE TABLE IF NOT EXISTS outbox.schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS outbox.events (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic      text NOT NULL CHECK (topic <> ''),
    key        text,
    payload    bytea,                    -- NULL = tombstone
    headers    jsonb NOT NULL DEFAULT '{}'::jsonb
               CHECK (jsonb_typeof(headers) = 'object'),
    -- The insert's own time, not the transaction's start (now()): the
    -- relay's lag and latency figures measure from here.
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    sent_at    timestamptz               -- NULL until Kafka acknowledged the record
);

-- The relay reads unsent rows in id order: keep that index small.
CREATE INDEX IF NOT EXISTS events_unsent_idx ON outbox.events (id) WHERE sent_at IS NULL;

-- enqueue: call inside the application's transaction.
--
-- Writers of the same key are serialized until commit by a transaction-level
-- advisory lock in outboxd's lock space (1868724324 = 'obxd'). So a second
-- writer of a key takes its id only after the first one committed: per key,
-- id order equals commit order, which is what the relay publishes in.
-- pg_notify is delivered at commit and never on rollback.
CREATE OR REPLACE FUNCTION outbox.enqueue(p_topic text, p_key text, p_payload bytea,
                                          p_headers jsonb DEFAULT '{}'::jsonb)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_id bigint;
BEGIN
    IF p_key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(1868724324, hashtext(p_key));
    END IF;
    INSERT INTO outbox.events (topic, key, payload, headers)
    VALUES (p_topic, p_key, p_payload, coalesce(p_headers, '{}'::jsonb))
    RETURNING id INTO v_id;
    PERFORM pg_notify('outboxd', '');
    RETURN v_id;
END
$$;

CREATE OR REPLACE FUNCTION outbox.enqueue(p_topic text, p_key text, p_payload jsonb,
                                          p_headers jsonb DEFAULT '{}'::jsonb)
RETURNS bigint
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT outbox.enqueue(p_topic, p_key, convert_to(p_payload::text, 'UTF8'), p_headers);
$$;

CREATE OR REPLACE FUNCTION outbox.enqueue(p_topic text, p_key text, p_payload text,
                                          p_headers jsonb DEFAULT '{}'::jsonb)
RETURNS bigint
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT outbox.enqueue(p_topic, p_key, convert_to(p_payload, 'UTF8'), p_headers);
$$;

-- Roles. outboxd_relay: what the relay needs and nothing else (read rows,
-- mark or delete them, read the schema version). outboxd_writer: may call
-- enqueue(); grant it to application roles. Neither has a password here:
--   ALTER ROLE outboxd_relay PASSWORD '...';   -- or use certificates
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outboxd_relay') THEN
        CREATE ROLE outboxd_relay LOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outboxd_writer') THEN
        CREATE ROLE outboxd_writer NOLOGIN;
    END IF;
END
$$;

REVOKE ALL ON SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox FROM PUBLIC;
GRANT USAGE ON SCHEMA outbox TO outboxd_relay, outboxd_writer;
GRANT SELECT ON outbox.schema_migrations TO outboxd_relay;
GRANT SELECT, DELETE ON outbox.events TO outboxd_relay;
GRANT UPDATE (sent_at) ON outbox.events TO outboxd_relay;
GRANT EXECUTE ON FUNCTION outbox.enqueue(text, text, bytea, jsonb),
                          outbox.enqueue(text, text, jsonb, jsonb),
                          outbox.enqueue(text, text, text, jsonb) TO outboxd_writer;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (1, '001_outbox') ON CONFLICT (version) DO NOTHING;

COMMIT;
