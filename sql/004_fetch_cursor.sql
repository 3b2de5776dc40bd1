-- outboxd schema, version 4: each row remembers the transaction that wrote it.
--
-- Apply with: psql -v ON_ERROR_STOP=1 -f sql/004_fetch_cursor.sql (after
-- 003). Idempotent. Adds no work to rows already written (no table rewrite).
--
-- While a backlog drains, the relay fetches only ids above the highest one
-- it handed out, so a fetch costs the same with 10 or 10,000 rows in flight.
-- A transaction that commits late may still add rows below that id. Those
-- are exactly the rows whose writing transaction was still running when the
-- relay's previous fetch took its snapshot; the relay asks for them by this
-- column (pg_visible_in_snapshot), so none is skipped and, per key, none is
-- overtaken. The partial index keeps that question cheap: it holds unsent
-- rows only, and the relay reads just its newest end.

BEGIN;
SET LOCAL client_min_messages = warning;
DO $$ BEGIN PERFORM pg_advisory_xact_lock(1868724324, 0); END $$;

-- NULL for rows written before this file: their transactions ended long ago.
ALTER TABLE outbox.events ADD COLUMN IF NOT EXISTS xid xid8;
-- The top-level transaction id, as snapshots list them (also for rows
-- written inside a savepoint, and by a direct INSERT).
ALTER TABLE outbox.events ALTER COLUMN xid SET DEFAULT pg_current_xact_id();

CREATE INDEX IF NOT EXISTS events_unsent_xid_idx ON outbox.events (xid)
    WHERE sent_at IS NULL;

-- A row made unsent again (outboxd replay, or an operator's UPDATE ... SET
-- sent_at = NULL) is written anew by that transaction: it takes its id, so
-- the relay finds it as it finds a late commit. The relay's own marks never
-- fire it (WHEN is checked before any function call). A dead letter retried
-- is inserted again and takes the default.
CREATE OR REPLACE FUNCTION outbox.unsent_again() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    NEW.xid := pg_current_xact_id();
    RETURN NEW;
END
$$;
REVOKE ALL ON FUNCTION outbox.unsent_again() FROM PUBLIC;

CREATE OR REPLACE TRIGGER unsent_again
    BEFORE UPDATE OF sent_at ON outbox.events
    FOR EACH ROW WHEN (OLD.sent_at IS NOT NULL AND NEW.sent_at IS NULL)
    EXECUTE FUNCTION outbox.unsent_again();

INSERT INTO outbox.schema_migrations (version, name)
VALUES (4, '004_fetch_cursor') ON CONFLICT (version) DO NOTHING;

COMMIT;
