-- outboxd schema, version 16: enqueue takes only topic names Kafka accepts,
-- and a row's size as the relay's fetch counts it.
--
-- Apply with: psql -v ON_ERROR_STOP=1 -f sql/016_topic_names_row_bytes.sql
-- (after 015). Idempotent. Nothing here touches outbox.events, but for a
-- development form's trigger, dropped below.
--
-- Topic names. Kafka takes a topic name of 1 to 249 of the characters
-- A-Z a-z 0-9 . _ - other than "." and "..", and librdkafka no handle over
-- 512 bytes. A row written for any other name can never be published: the
-- relay dead-letters it (or holds its key, relay.on_reject = retry) once a
-- broker has refused it. outbox.enqueue() now refuses such a row when it is
-- written, in the writer's transaction, naming the topic (SQLSTATE 23514).
-- The application's role may write rows only through it (sql/001).
--
-- In enqueue, not on the table: a CHECK is tested at every UPDATE of a row,
-- even NOT VALID, so a row stored before this file with such a name would
-- fail the relay's mark (and with it every row of that mark); and a trigger
-- with a WHEN test, or a CHECK, costs each INSERT statement its setup: 16
-- us a one-row transaction here (bench/enqueue BENCH_LAYERS=1: enqueue fell
-- from 0.83 to 0.76 of a plain INSERT), where this test costs about 5 (0.81
-- to 0.82; any form of it, a regular expression or ltrim(), costs the same
-- setup once a transaction). Rows written to the table directly (by its
-- owner, a restore, logical replication) are not tested: the relay refuses
-- them as before.

-- Row size. The relay's fetch bounds its memory by relay.fetch_max_bytes
-- (store.c): a row larger than its share comes without its payload and
-- headers, beside this size. Key and payload count their bytes as stored
-- (octet_length reads a TOAST pointer, not the value). Headers count
-- their stored size when stored uncompressed, else their size unpacked
-- (`|| '{}'` hands back the value decompressed, about 1 us for 5 kB, where
-- its text took 20): a compressed value's stored size says little of its
-- size (a header of 600,000 repeated characters stores in a few kB).

BEGIN;
SET LOCAL client_min_messages = warning;
DO $$ BEGIN PERFORM pg_advisory_xact_lock(1868724324, 0); END $$;

-- A first form of this file (never released) refused such names with a
-- trigger on the table: gone, if a development database has it.
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_trigger WHERE tgrelid = 'outbox.events'::regclass
               AND tgname = 'topic_name' AND tgparentid = 0) THEN
        SET LOCAL lock_timeout = '2s';
        DROP TRIGGER topic_name ON outbox.events;
        RESET lock_timeout;
    END IF;
END
$$;
DROP FUNCTION IF EXISTS outbox.topic_refused();

-- As in sql/005, with the topic tested first. No SET search_path (a tenth
-- of the call's cost, sql/005): every name is schema-qualified, operators
-- too, so a caller's search_path cannot put its own in this SECURITY
-- DEFINER function's way.
CREATE OR REPLACE FUNCTION outbox.enqueue(p_topic text, p_key text, p_payload bytea,
                                          p_headers jsonb DEFAULT '{}'::jsonb)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
AS $$
DECLARE
    v_id bigint;
BEGIN
    IF pg_catalog.octet_length(p_topic) OPERATOR(pg_catalog.>) 249
       OR p_topic OPERATOR(pg_catalog.~) '[^-A-Za-z0-9._]'
       OR p_topic OPERATOR(pg_catalog.=) '' OR p_topic OPERATOR(pg_catalog.=) '.'
       OR p_topic OPERATOR(pg_catalog.=) '..' THEN
        RAISE EXCEPTION 'outbox: Kafka accepts no topic named "%"', pg_catalog.left(p_topic, 100)
            USING ERRCODE = 'check_violation',
                  DETAIL = pg_catalog.format('The name has %s bytes.',
                                             pg_catalog.octet_length(p_topic)),
                  HINT = 'A topic name is 1 to 249 of the characters A-Z a-z 0-9 . _ -,'
                         ' and not "." or "..".';
    END IF;
    IF p_key IS NOT NULL THEN
        PERFORM pg_catalog.pg_advisory_xact_lock(1868724324, pg_catalog.hashtext(p_key));
    END IF;
    INSERT INTO outbox.events (topic, key, payload, headers)
    VALUES (p_topic, p_key, p_payload, coalesce(p_headers, '{}'::pg_catalog.jsonb))
    RETURNING id INTO v_id;
    RETURN v_id;
END
$$;

-- Inlined into the fetch: LANGUAGE sql, one expression, no SET clause (so
-- names are qualified), its volatility that of its parts.
CREATE OR REPLACE FUNCTION outbox.row_bytes(p_key text, p_payload bytea, p_headers jsonb)
RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT coalesce(pg_catalog.octet_length(p_payload), 0)::bigint
           + coalesce(pg_catalog.octet_length(p_key), 0)
           + coalesce(CASE WHEN pg_catalog.pg_column_compression(p_headers) IS NULL
                           THEN pg_catalog.pg_column_size(p_headers)
                           ELSE pg_catalog.pg_column_size(p_headers OPERATOR(pg_catalog.||)
                                                          '{}'::jsonb) END, 0)
$$;
GRANT EXECUTE ON FUNCTION outbox.row_bytes(text, bytea, jsonb) TO outboxd_relay;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (16, '016_topic_names_row_bytes') ON CONFLICT (version) DO NOTHING;

COMMIT;
