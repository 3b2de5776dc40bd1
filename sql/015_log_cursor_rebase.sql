-- outboxd schema, version 15: log mode's cursor carried across clusters,
-- and the xid repair in chunks.
--
-- Apply with: psql -v ON_ERROR_STOP=1 -f sql/015_log_cursor_rebase.sql
-- (after 014). Idempotent. enqueue() is untouched; a column without a
-- default is added to outbox.events (no rewrite), and the trigger that
-- gives rows their writer's xid keeps its WHEN test, so enqueue's rows
-- never fire it.
--
-- Log mode's cursor rows judge a row by its xid against their snapshots.
-- Both are numbers of one cluster. A restored dump keeps the rows' and the
-- cursor's old numbers together, but the new cluster hands out its own:
-- sql/006's repair gave every restored row that looked foreign this
-- cluster's xid, which the old snapshots read as committed long ago, so a
-- row the cursor had not covered (its writer ran when the cursor was
-- written, it committed before the dump) looked covered and was never
-- published. Logical replication writes every row with the subscriber's
-- xid, while the cursor rows it copies keep the publisher's snapshots.
--
-- So the cursor now knows which cluster its snapshots come from
-- (outbox.log_cursor_system), rows keep the xid they arrived with
-- (origin_xid, set by the own_xid trigger when it replaces one), and the
-- first repair on another cluster (each relay runs it when it takes the
-- lock or a slot) rebases the cursor before anything else touches the
-- rows: each row up to the cursor's highest id is judged by the newest
-- cursor row about it, with the xid it had there; the rows not covered get
-- the rebasing transaction's xid x, and a new cursor row about every slot
-- covers every row up to that id but those: its snapshot "x:2^62+3:x" sees
-- every xid committed but x. What was published stays published, nothing
-- the cursor had not covered is covered, and Kafka offsets are kept. The
-- repair then gives the rows whose xids this cluster has not reached yet
-- one of its own (still covered: they are not x), so that the snapshots
-- of the relay's next cursor rows see them committed too.
--
-- That repair wrote every such row in one statement: a restored outbox of
-- millions of rows outlasted the statement timeout, and the relay retried
-- it for ever. It now takes a limit (a relay alone asks for 10,000 rows a
-- statement, and again while it gets that many; the claim of slots still
-- repairs its slots' rows in one statement).

BEGIN;
SET LOCAL client_min_messages = warning;
DO $$ BEGIN PERFORM pg_advisory_xact_lock(1868724324, 0); END $$;

-- The cluster whose xids the cursor's snapshots are: one row.
CREATE TABLE IF NOT EXISTS outbox.log_cursor_system (
    one          boolean PRIMARY KEY DEFAULT true CHECK (one),
    system_id    text NOT NULL,
    rebased_at   timestamptz
);
REVOKE ALL ON outbox.log_cursor_system FROM PUBLIC;
GRANT SELECT ON outbox.log_cursor_system TO outboxd_relay;

-- The xid a row arrived with when the own_xid trigger replaced it: another
-- cluster's, for a row restored with triggers on or written by logical
-- replication. NULL for the rows written here (enqueue, INSERT). It holds
-- only while the row is the version its arrival wrote (xmin = xid): every
-- statement that gives a row another xid clears it, and a dump restored
-- elsewhere keeps it beside the xid it replaced (then xmin is the
-- restore's).
ALTER TABLE outbox.events ADD COLUMN IF NOT EXISTS origin_xid xid8;
-- outboxd replay and dead retry in log mode give a row a new xid.
GRANT UPDATE (origin_xid) ON outbox.events TO outboxd_relay;

CREATE OR REPLACE FUNCTION outbox.own_xid() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    NEW.origin_xid := NEW.xid;
    NEW.xid := pg_current_xact_id();
    RETURN NEW;
END
$$;
REVOKE ALL ON FUNCTION outbox.own_xid() FROM PUBLIC;

-- sql/004's trigger for a row made unsent again (mark mode) gives it a new
-- xid: the one it arrived with no longer holds either.
CREATE OR REPLACE FUNCTION outbox.unsent_again() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    NEW.xid := pg_current_xact_id();
    NEW.origin_xid := NULL;
    RETURN NEW;
END
$$;

CREATE OR REPLACE TRIGGER own_xid
    BEFORE INSERT ON outbox.events
    FOR EACH ROW WHEN (NEW.xid IS DISTINCT FROM pg_current_xact_id())
    EXECUTE FUNCTION outbox.own_xid();
ALTER TABLE outbox.events ENABLE ALWAYS TRIGGER own_xid;

-- This server's system identifier, or NULL where pg_control_system() is
-- not allowed (some managed services): then nothing is rebased.
CREATE OR REPLACE FUNCTION outbox.system_id() RETURNS text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN (SELECT system_identifier::text FROM pg_control_system());
EXCEPTION WHEN insufficient_privilege THEN
    RETURN NULL;
END
$$;

-- Rebases the log cursor when its snapshots are another cluster's (above).
-- Returns the number of rows it found not covered (published now).
CREATE OR REPLACE FUNCTION outbox.rebase_log_cursor() RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now    text := outbox.system_id();
    v_was    text;
    v_hwm    bigint;
    f        record;
    v_low    xid8;
    v_xid    xid8;
    v_late   bigint[];
BEGIN
    IF v_now IS NULL OR v_now = (SELECT system_id FROM outbox.log_cursor_system) THEN
        RETURN 0; -- the common case: one index read
    END IF;
    -- advance_cursor's lock: no relay with slots writes a cursor row now.
    PERFORM pg_advisory_xact_lock(1868724341, 0);
    v_was := (SELECT system_id FROM outbox.log_cursor_system);
    IF v_was = v_now THEN
        RETURN 0; -- another relay rebased it meanwhile
    END IF;
    -- First run after this file: a newest cursor row whose snapshot lies
    -- ahead of this cluster's is another cluster's; else the cursor is as
    -- old as the database's last history (sql/011), which travels with it
    -- (a relay writes that before it repairs: after a restore of a dump
    -- taken before this file, only the first test can tell).
    IF v_was IS NULL AND (SELECT pg_snapshot_xmax(c.snap) FROM outbox.log_cursor c
                          ORDER BY c.batch DESC LIMIT 1)
                         > pg_snapshot_xmax(pg_current_snapshot()) THEN
        v_was := 'unknown';
    END IF;
    v_was := coalesce(v_was, (SELECT system_id FROM outbox.history), v_now);
    IF v_was <> v_now AND EXISTS (SELECT FROM outbox.log_cursor) THEN
        v_hwm := (SELECT max(hwm) FROM outbox.log_cursor);
        SELECT * INTO f FROM outbox.log_floor(NULL, NULL);
        -- Each row with the xid it had where the cursor was written. What
        -- the floor covers, its own cursor row does (sql/009); the rest is
        -- tested row by row (CASE: in that order).
        v_late := ARRAY(
            SELECT e.id FROM outbox.events e,
                   LATERAL (SELECT CASE WHEN e.origin_xid IS NOT NULL AND e.xmin = e.xid::xid
                                        THEN e.origin_xid ELSE e.xid END AS xid) o
            WHERE e.sent_at IS NULL AND e.id <= v_hwm
              AND CASE WHEN f.hwm IS NOT NULL AND e.id <= f.hwm
                            AND pg_visible_in_snapshot(o.xid, f.snap)
                            AND NOT (e.topic = ANY (f.held_topics)) THEN false
                       ELSE NOT outbox.log_covers(e.id, e.topic, e.key, o.xid) END
            ORDER BY e.id);
        -- Below every running transaction: what every snapshot from now on
        -- sees committed. Read before this transaction has an xid.
        v_low := greatest(pg_snapshot_xmin(pg_current_snapshot())::text::bigint - 1, 3)::text::xid8;
        v_xid := pg_current_xact_id();
        UPDATE outbox.events e SET xid = v_xid, origin_xid = NULL
        WHERE e.id = ANY (v_late) AND e.sent_at IS NULL;
        -- A covered row that came with this very number (another cluster's).
        UPDATE outbox.events e SET xid = v_low, origin_xid = NULL
        WHERE e.xid = v_xid AND e.sent_at IS NULL AND NOT (e.id = ANY (v_late));
        INSERT INTO outbox.log_cursor (batch, hwm, snap, shards, slots)
        VALUES (coalesce((SELECT max(batch) FROM outbox.log_cursor), 0) + 1, v_hwm,
                (v_xid::text || ':4611686018427387907:' || v_xid::text)::pg_snapshot, 1, NULL);
        RAISE WARNING 'outbox: the log cursor''s snapshots are of system %, this is system %: '
                      'rebased (rows up to id % it had not covered, published now: %)',
                      v_was, v_now, v_hwm, cardinality(v_late);
    END IF;
    INSERT INTO outbox.log_cursor_system AS s (system_id, rebased_at)
    VALUES (v_now, CASE WHEN v_was <> v_now THEN now() END)
    ON CONFLICT (one) DO UPDATE SET system_id = excluded.system_id,
                                    rebased_at = coalesce(excluded.rebased_at, s.rebased_at);
    RETURN coalesce(cardinality(v_late), 0);
END
$$;
REVOKE ALL ON FUNCTION outbox.rebase_log_cursor() FROM PUBLIC;

-- sql/008's repair, with the rebase first and a limit (NULL: none): every
-- relay runs it when it takes the lock (every row) or slots (their rows),
-- before it reads the cursor. The rebase is about every row, whichever
-- slots were taken. Returns how many rows it repaired (the limit: maybe
-- more are left).
CREATE OR REPLACE FUNCTION outbox.repair_writer_xids(p_shards integer, p_slots integer[],
                                                     p_limit bigint)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_fixed bigint;
    v_log   boolean;
    v_low   xid8;
BEGIN
    PERFORM outbox.rebase_log_cursor();
    -- In log mode a row the cursor covers stays covered: it gets an xid
    -- that every snapshot from now on and every cursor row's sees
    -- committed (below their xmin: a rebase's row sees all but its own
    -- xid, its xmin), not this transaction's.
    v_log := EXISTS (SELECT FROM outbox.log_cursor);
    v_low := greatest(least(pg_snapshot_xmin(pg_current_snapshot())::text::bigint,
                            coalesce(pg_current_xact_id_if_assigned()::text::bigint,
                                     9223372036854775807),
                            coalesce((SELECT min(pg_snapshot_xmin(c.snap)::text::bigint)
                                      FROM outbox.log_cursor c), 9223372036854775807)) - 1,
                      3)::text::xid8;
    -- A statement of its own: its snapshot sees what the rebase wrote.
    WITH s AS (SELECT pg_current_snapshot() AS snap),
    foreign_rows AS (
        SELECT u.id FROM (
            -- Two index ranges of (xid, id): xids not begun, xids running.
            SELECT e.id, e.key FROM s, outbox.events e
            WHERE e.sent_at IS NULL
              AND (e.xid, e.id) >= (pg_snapshot_xmax(s.snap), (-9223372036854775807 - 1)::bigint)
            UNION ALL
            SELECT e.id, e.key FROM s, pg_snapshot_xip(s.snap) AS x(xid), outbox.events e
            WHERE e.sent_at IS NULL AND e.xid = x.xid) u
        WHERE p_slots IS NULL OR outbox.slot_of(u.key, u.id, p_shards) = ANY (p_slots)
        LIMIT p_limit),
    fixed AS (
        UPDATE outbox.events e
        SET xid = CASE WHEN v_log AND outbox.log_covers(e.id, e.topic, e.key, e.xid) THEN v_low
                       ELSE pg_current_xact_id() END,
            origin_xid = NULL
        FROM foreign_rows f
        WHERE e.id = f.id
        RETURNING 1)
    SELECT count(*) INTO v_fixed FROM fixed;
    RETURN v_fixed;
END
$$;
REVOKE ALL ON FUNCTION outbox.repair_writer_xids(integer, integer[], bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.repair_writer_xids(integer, integer[], bigint) TO outboxd_relay;

-- The two-argument form (claim_slots calls it) repairs every row it finds.
CREATE OR REPLACE FUNCTION outbox.repair_writer_xids(p_shards integer, p_slots integer[])
RETURNS bigint
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$ SELECT outbox.repair_writer_xids(p_shards, p_slots, NULL) $$;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (15, '015_log_cursor_rebase') ON CONFLICT (version) DO NOTHING;

COMMIT;
