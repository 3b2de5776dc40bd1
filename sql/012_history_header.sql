-- outboxd schema, version 12: the header name outbox-history is reserved,
-- ids move past those another history published, log mode's reclaim of
-- partitions locks what it tests and keeps keyless held rows, and a dead
-- letter is a row by id and created_at.
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

-- Moves the id identity past p_id, the highest outbox-id the relay's
-- recovery pass read in Kafka, when the database would hand that id out
-- again: it is on another history than the one that published it (a
-- failover to an asynchronous standby, a restore). Returns the next id
-- then, NULL when nothing moved (the usual case; it draws one id to look).
-- Ids drawn by writers between its two steps stay below the new start: it
-- leaves a margin of 10,000 above the id it drew. SECURITY DEFINER: the
-- relay role gets this and not UPDATE on the sequence.
CREATE OR REPLACE FUNCTION outbox.skip_ids_past(p_id bigint) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $$
DECLARE
    v_seq text := pg_get_serial_sequence('outbox.events', 'id');
    v_drawn bigint;
    v_next bigint;
BEGIN
    IF p_id IS NULL OR p_id > 9223372036854775807 - 1000000 THEN
        RETURN NULL;  -- an id set by hand near the end of bigint: not followed
    END IF;
    -- One at a time (relays sharing slots each send their own highest id):
    -- the second draws above what the first set, and moves nothing back.
    PERFORM pg_advisory_xact_lock(1868724324, 12);
    v_drawn := nextval(v_seq);
    IF v_drawn > p_id THEN
        RETURN NULL;
    END IF;
    v_next := greatest(p_id, v_drawn + 10000) + 1;
    PERFORM setval(v_seq, v_next, false);
    RETURN v_next;
END
$$;
REVOKE ALL ON FUNCTION outbox.skip_ids_past(bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.skip_ids_past(bigint) TO outboxd_relay;

-- Log mode's reclaim (sql/007, as 009 left it), two changes:
-- - it locks a partition before it tests it: a replay (outboxd replay,
--   dead retry) committed between the test and the DROP was dropped with
--   the partition; now the test waits for it, or the partition waits for a
--   later round (the function's lock_timeout, 50 ms);
-- - a held rule with no key holds its one row, as everywhere else (a
--   keyless row Kafka kept refusing was dropped with its partition).
-- Rewritten from its own definition, as 009 did.
DO $$
DECLARE
    v_def text := pg_get_functiondef('outbox.reclaim_partitions(interval)'::regprocedure);
    v_test text := E'        EXECUTE format(\n'
                   || $t$            'SELECT EXISTS (SELECT FROM %1$s e WHERE e.sent_at IS NULL'$t$;
    v_key text := $t$h.topic = e.topic AND h.key = e.key'$t$;
BEGIN
    IF position('IN ACCESS EXCLUSIVE MODE' IN v_def) > 0 THEN
        RETURN;
    END IF;
    IF position(v_test IN v_def) = 0 OR position(v_key IN v_def) = 0 THEN
        RAISE EXCEPTION 'outbox.reclaim_partitions is not the one of sql/007 and 009';
    END IF;
    v_def := replace(v_def, v_test,
        E'        BEGIN\n'
        || $t$            EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', p.rel);$t$
        || E'\n        EXCEPTION WHEN lock_not_available THEN\n'
        || E'            CONTINUE;\n'
        || E'        END;\n' || v_test);
    v_def := replace(v_def, v_key,
        $t$h.topic = e.topic'$t$ || E'\n'
        || $t$            '            AND (h.key = e.key OR (h.key IS NULL AND e.id = h.from_id))'$t$);
    EXECUTE v_def;
END
$$;

-- A dead letter is a row by its id and created_at: after a failover or a
-- restore a new row may carry the id of an old dead letter, and was
-- dropped (deleted from outbox.events, its letter refused by the id's
-- primary key, ON CONFLICT DO NOTHING). Re-inserting the same letter (a
-- mark repeated after a lost COMMIT) still does nothing.
DO $$
BEGIN
    IF (SELECT array_agg(a.attname ORDER BY a.attnum)
          FROM pg_constraint k
          JOIN pg_attribute a ON a.attrelid = k.conrelid AND a.attnum = ANY (k.conkey)
         WHERE k.conrelid = 'outbox.dead_letters'::regclass AND k.contype = 'p')
       = ARRAY['id']::name[] THEN
        ALTER TABLE outbox.dead_letters DROP CONSTRAINT dead_letters_pkey,
            ADD CONSTRAINT dead_letters_pkey PRIMARY KEY (id, created_at);
    END IF;
END
$$;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (12, '012_history_header') ON CONFLICT (version) DO NOTHING;

COMMIT;
