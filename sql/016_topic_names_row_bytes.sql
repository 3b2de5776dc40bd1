-- outboxd schema, version 16: topic names Kafka accepts, and a row's size
-- as the relay's fetch counts it.
--
-- Apply with: psql -v ON_ERROR_STOP=1 -f sql/016_topic_names_row_bytes.sql
-- (after 015). Idempotent.
--
-- Topic names. Kafka takes a topic name of 1 to 249 of the characters
-- A-Z a-z 0-9 . _ - other than "." and "..", and librdkafka no handle over
-- 512 bytes. A row written for any other name can never be published: the
-- relay dead-letters it (or holds its key, relay.on_reject = retry) once a
-- broker has refused it. The trigger below refuses such a row when it is
-- written, in the writer's transaction, naming the topic. Not a CHECK: a
-- CHECK is tested at every UPDATE of the row, even NOT VALID, so a row
-- stored before this file with such a name would fail the relay's mark
-- (and with it every row of that mark). Rows already stored stay as they
-- are; the relay refuses them as before. A replica applying logical
-- replication and a restore (which creates triggers after the data) do not
-- run it: their rows were checked where they were written. A data-only
-- restore into a schema that has it does (pg_restore --data-only
-- --disable-triggers does not).
--
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

CREATE OR REPLACE FUNCTION outbox.topic_refused() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'outbox: Kafka accepts no topic named "%"', left(NEW.topic, 100)
        USING ERRCODE = 'check_violation',
              DETAIL = format('The name has %s bytes.', octet_length(NEW.topic)),
              HINT = 'A topic name is 1 to 249 of the characters A-Z a-z 0-9 . _ -,'
                     ' and not "." or "..".';
END
$$;
REVOKE ALL ON FUNCTION outbox.topic_refused() FROM PUBLIC;

-- WHEN is tested before any function call, so an accepted name costs only
-- the test (about 0.15 us a row: one length, one character class).
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_trigger WHERE tgrelid = 'outbox.events'::regclass
                   AND tgname = 'topic_name' AND tgparentid = 0) THEN
        SET LOCAL lock_timeout = '2s';
        CREATE TRIGGER topic_name
            BEFORE INSERT OR UPDATE OF topic ON outbox.events
            FOR EACH ROW
            WHEN (octet_length(NEW.topic) > 249 OR NEW.topic ~ '[^-A-Za-z0-9._]'
                  OR NEW.topic IN ('.', '..'))
            EXECUTE FUNCTION outbox.topic_refused();
        RESET lock_timeout;
    END IF;
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
