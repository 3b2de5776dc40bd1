-- outboxd schema, version 5: enqueue costs the application no more than a
-- plain INSERT, and works in a PREPAREd (two-phase) transaction.
--
-- Apply with: psql -v ON_ERROR_STOP=1 -f sql/005_no_notify.sql (after 004).
-- Idempotent. The new index is built while writers of outbox.events wait:
-- it holds unsent rows only, but its build reads the whole table (about a
-- second per million rows here).
--
-- Until now enqueue ended with pg_notify() to wake the relay. A transaction
-- that has notified takes one cluster-wide lock at commit and keeps it until
-- its commit record is flushed, so commits that could share one WAL flush
-- queue behind each other (the application ran at 0.4-0.6 of a plain INSERT
-- with durable commits), and PREPARE TRANSACTION refuses such a transaction.
-- The relay now looks for new rows itself, more often while rows keep
-- coming (relay.poll_interval): the writer's transaction carries nothing
-- but its row and the per-key lock.

BEGIN;
SET LOCAL client_min_messages = warning;
DO $$ BEGIN PERFORM pg_advisory_xact_lock(1868724324, 0); END $$;

-- Same call, same per-key serialization, no NOTIFY. The transaction-level
-- advisory lock passes to a prepared transaction and is held until COMMIT
-- PREPARED or ROLLBACK PREPARED, so a later writer of the key still takes
-- its id after that commit.
--
-- No SET search_path either: switching it on every call was a tenth of the
-- function's cost. Every name below is schema-qualified instead (functions,
-- types, the table), and the body has no operator, so a caller's
-- search_path cannot put objects of its own in this SECURITY DEFINER
-- function's way; the table's defaults, constraints and triggers are bound
-- when they are created.
CREATE OR REPLACE FUNCTION outbox.enqueue(p_topic text, p_key text, p_payload bytea,
                                          p_headers jsonb DEFAULT '{}'::jsonb)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
AS $$
DECLARE
    v_id bigint;
BEGIN
    IF p_key IS NOT NULL THEN
        PERFORM pg_catalog.pg_advisory_xact_lock(1868724324, pg_catalog.hashtext(p_key));
    END IF;
    INSERT INTO outbox.events (topic, key, payload, headers)
    VALUES (p_topic, p_key, p_payload, coalesce(p_headers, '{}'::pg_catalog.jsonb))
    RETURNING id INTO v_id;
    RETURN v_id;
END
$$;

CREATE OR REPLACE FUNCTION outbox.enqueue(p_topic text, p_key text, p_payload jsonb,
                                          p_headers jsonb DEFAULT '{}'::jsonb)
RETURNS bigint
LANGUAGE sql
SECURITY DEFINER
AS $$
    SELECT outbox.enqueue(p_topic, p_key,
                          pg_catalog.convert_to(p_payload::pg_catalog.text, 'UTF8'), p_headers);
$$;

CREATE OR REPLACE FUNCTION outbox.enqueue(p_topic text, p_key text, p_payload text,
                                          p_headers jsonb DEFAULT '{}'::jsonb)
RETURNS bigint
LANGUAGE sql
SECURITY DEFINER
AS $$
    SELECT outbox.enqueue(p_topic, p_key, pg_catalog.convert_to(p_payload, 'UTF8'), p_headers);
$$;

-- The relay's question for late commits, asked by (xid, id): the rows below
-- its cursor written by a transaction its last snapshot saw running. With
-- the id in the index the answer is a short range per transaction, however
-- many rows that transaction wrote above the cursor (a 200,000-row
-- transaction that commits while the relay is idle), and however long it
-- has been open (the old question, every xid from the snapshot's oldest
-- running one on, read every row written since an open transaction began).
CREATE INDEX IF NOT EXISTS events_unsent_xid_id_idx ON outbox.events (xid, id)
    WHERE sent_at IS NULL;
DROP INDEX IF EXISTS outbox.events_unsent_xid_idx;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (5, '005_no_notify') ON CONFLICT (version) DO NOTHING;

COMMIT;
