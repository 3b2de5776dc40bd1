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
-- (outbox.log_cursor_system, filled when this file is applied), rows keep
-- the xid they arrived with (origin_xid, set by the own_xid trigger when it
-- replaces one), and the first repair on another cluster (each relay runs
-- it when it takes the lock or a slot) rebases the cursor before anything
-- else reads it. It reads the rows by id (a relay alone 10,000 a
-- statement, while the old cursor stands): each row up to the cursor's
-- highest id is judged by the newest cursor row about it with the xid it
-- had there; those not covered are noted, and a covered row whose xid this
-- cluster calls running or not yet begun gets one that every snapshot sees
-- committed. At the end the noted rows get the rebasing transaction's xid
-- x, and a new cursor row about every slot covers every row up to that id
-- but those: its snapshot is that transaction's own with x as running
-- (rows written again later, by outboxd replay, are not covered either).
-- What was published stays published, nothing the cursor had not covered
-- is covered, and Kafka offsets are kept.
--
-- The repair wrote every row it gave a new xid in one statement: a
-- restored outbox of millions of rows outlasted the statement timeout, and
-- the relay retried it for ever. It now takes a limit (a relay alone asks
-- for 10,000 rows a statement, and again while it gets that many; the
-- claim of slots still rebases and repairs in one statement).

BEGIN;
SET LOCAL client_min_messages = warning;
DO $$ BEGIN PERFORM pg_advisory_xact_lock(1868724324, 0); END $$;

-- The cluster whose xids the cursor's snapshots are (one row), and a
-- rebase under way: to which cluster, the cursor's highest id and the
-- highest id there when it began, the next id its scan reads, and the
-- snapshot its cursor row will have.
CREATE TABLE IF NOT EXISTS outbox.log_cursor_system (
    one         boolean PRIMARY KEY DEFAULT true CHECK (one),
    system_id   text NOT NULL,
    rebased_at  timestamptz,
    rebasing_to text,
    rebase_hwm  bigint,
    rebase_top  bigint,
    rebase_next bigint,
    rebase_snap pg_snapshot
);
-- (A database that applied this file's first form, of e3e6554, has the
-- table without the rebase's columns.)
ALTER TABLE outbox.log_cursor_system ADD COLUMN IF NOT EXISTS rebasing_to text,
    ADD COLUMN IF NOT EXISTS rebase_hwm bigint, ADD COLUMN IF NOT EXISTS rebase_top bigint,
    ADD COLUMN IF NOT EXISTS rebase_next bigint, ADD COLUMN IF NOT EXISTS rebase_snap pg_snapshot;
REVOKE ALL ON outbox.log_cursor_system FROM PUBLIC;
GRANT SELECT ON outbox.log_cursor_system TO outboxd_relay;
-- The rows a rebase under way found not covered.
CREATE TABLE IF NOT EXISTS outbox.log_rebase_late (id bigint PRIMARY KEY);
REVOKE ALL ON outbox.log_rebase_late FROM PUBLIC;

-- The xid a row arrived with when the own_xid trigger replaced it: another
-- cluster's, for a row restored with triggers on or written by logical
-- replication. NULL for the rows written here (enqueue, INSERT). It holds
-- only while the row is the version its arrival wrote (xmin = xid): every
-- statement that gives a row another xid clears it, and a dump restored
-- elsewhere keeps it beside the xid it replaced (then xmin is the
-- restore's).
-- The ALTER takes an exclusive lock on outbox.events, which writers would
-- queue behind while it waits (behind a pg_dump, say): it waits 2 s at
-- most, and the file fails then (apply it again).
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = 'outbox.events'::regclass
                   AND attname = 'origin_xid' AND NOT attisdropped) THEN
        SET LOCAL lock_timeout = '2s';
        ALTER TABLE outbox.events ADD COLUMN origin_xid xid8;
        RESET lock_timeout;
    END IF;
END
$$;
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

-- This server's system identifier, or NULL where pg_control_system()
-- fails (not allowed on some managed services): then nothing is rebased,
-- and the server says why.
CREATE OR REPLACE FUNCTION outbox.system_id() RETURNS text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN (SELECT system_identifier::text FROM pg_control_system());
EXCEPTION WHEN OTHERS THEN
    RAISE WARNING 'outbox: cannot read the system identifier (%): log mode''s cursor is not '
                  'checked for another cluster', SQLERRM;
    RETURN NULL;
END
$$;

-- The cluster the cursor is of, where nothing says: this one, unless the
-- newest cursor row's snapshot lies ahead of this cluster's (it was copied
-- from a busier one).
CREATE OR REPLACE FUNCTION outbox.cursor_system_guess() RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN (SELECT pg_snapshot_xmax(c.snap) FROM outbox.log_cursor c
                      ORDER BY c.batch DESC LIMIT 1)
                     > pg_snapshot_xmax(pg_current_snapshot()) THEN 'unknown'
                ELSE outbox.system_id() END
$$;
REVOKE ALL ON FUNCTION outbox.cursor_system_guess() FROM PUBLIC;

-- Recorded as this file is applied, where there is a cursor: one copied
-- elsewhere from now on is known as this cluster's. With no cursor rows
-- nothing is recorded: rows loaded later (a data-only restore, a logical
-- subscription) bring their own.
INSERT INTO outbox.log_cursor_system (system_id)
SELECT outbox.cursor_system_guess()
WHERE outbox.cursor_system_guess() IS NOT NULL AND EXISTS (SELECT FROM outbox.log_cursor)
ON CONFLICT (one) DO NOTHING;

-- Rebases the log cursor when its snapshots are another cluster's (above),
-- p_limit rows a call (NULL: all). The first call takes the snapshot the
-- new cursor row will have (its own, with this transaction's xid as
-- running if it has one): every xid that ends after it is not covered,
-- such as a row written again by outboxd replay meanwhile. Each call reads
-- the rows by id; each up to the cursor's highest id is judged by its own
-- cursor row with the xid it had there, and those not covered go to
-- outbox.log_rebase_late; a covered row whose xid that snapshot does not
-- see committed gets one it does (below the xmin of it, of this call's
-- snapshot and of every cursor row: still covered if the old cursor is
-- read again), unless the row was written in this cluster since (its xmin
-- is its xid, one this cluster gave out); every row read loses the
-- origin_xid it arrived with. Until the last call the old cursor stands.
-- The last call gives the noted rows
-- its own xid and writes the cursor row, about every slot, up to that id.
-- Returns false while there is more to read.
CREATE OR REPLACE FUNCTION outbox.rebase_log_cursor(p_limit bigint) RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now  text := outbox.system_id();
    v_own  xid8 := pg_current_xact_id_if_assigned();
    v_base pg_snapshot := pg_current_snapshot(); -- before anything here writes
    s      outbox.log_cursor_system;
    f      record;
    v_low  xid8;
    v_xid  xid8;
    v_last bigint;
    v_read bigint;
    v_late bigint;
BEGIN
    IF v_now IS NULL OR EXISTS (SELECT FROM outbox.log_cursor_system c
                                WHERE c.system_id = v_now AND c.rebasing_to IS NULL) THEN
        RETURN true; -- the common case: one index read
    END IF;
    IF NOT EXISTS (SELECT FROM outbox.log_cursor) THEN
        -- No cursor (mark and delete mode, or none yet): nothing to rebase,
        -- and no record, so that cursor rows loaded later bring theirs.
        DELETE FROM outbox.log_cursor_system;
        RETURN true;
    END IF;
    -- advance_cursor's lock: no relay with slots writes a cursor row now.
    PERFORM pg_advisory_xact_lock(1868724341, 0);
    SELECT * INTO s FROM outbox.log_cursor_system;
    IF NOT FOUND THEN
        INSERT INTO outbox.log_cursor_system (system_id) VALUES (outbox.cursor_system_guess())
        RETURNING * INTO s;
    END IF;
    IF s.system_id = v_now AND s.rebasing_to IS NULL THEN
        RETURN true; -- another relay rebased it meanwhile
    END IF;
    IF s.rebasing_to IS DISTINCT FROM v_now OR s.rebase_snap IS NULL THEN
        -- (A rebase begun by this file's form of 046a384 kept no snapshot:
        -- it starts again.) The caller's own xid (a claim wrote before it) would be seen as
        -- committed by its own snapshot.
        IF v_own IS NOT NULL AND v_own < pg_snapshot_xmax(v_base) THEN
            v_base := (least(pg_snapshot_xmin(v_base), v_own)::text || ':'
                       || pg_snapshot_xmax(v_base)::text || ':'
                       || (SELECT string_agg(x::text, ',' ORDER BY x)
                           FROM (SELECT x FROM pg_snapshot_xip(v_base) AS x
                                 UNION SELECT v_own) u))::pg_snapshot;
        END IF;
        DELETE FROM outbox.log_rebase_late;
        UPDATE outbox.log_cursor_system
        SET rebasing_to = v_now, rebase_hwm = (SELECT max(hwm) FROM outbox.log_cursor),
            rebase_top = (SELECT max(id) FROM outbox.events),
            rebase_next = (-9223372036854775807 - 1), rebase_snap = v_base
        RETURNING * INTO s;
        RAISE WARNING 'outbox: the log cursor''s snapshots are of system %, this is system %: '
                      'rebasing it (rows up to id %)', s.system_id, v_now, s.rebase_hwm;
    END IF;
    SELECT * INTO f FROM outbox.log_floor(NULL, NULL);
    v_low := greatest(least(pg_snapshot_xmin(pg_current_snapshot())::text::bigint,
                            pg_snapshot_xmin(s.rebase_snap)::text::bigint,
                            coalesce(pg_current_xact_id_if_assigned()::text::bigint,
                                     9223372036854775807),
                            coalesce((SELECT min(pg_snapshot_xmin(c.snap)::text::bigint)
                                      FROM outbox.log_cursor c), 9223372036854775807)) - 1,
                      3)::text::xid8;
    WITH r AS (
        SELECT e.id, e.topic, e.key,
               CASE WHEN e.origin_xid IS NOT NULL AND e.xmin = e.xid::xid
                         AND e.xid < pg_snapshot_xmax(pg_current_snapshot()) THEN e.origin_xid
                    ELSE e.xid END AS was
        FROM outbox.events e
        WHERE e.sent_at IS NULL AND e.id >= s.rebase_next AND e.id <= s.rebase_top
        ORDER BY e.id LIMIT p_limit),
    judged AS (
        -- What the floor covers, its own cursor row does (sql/009); the
        -- rest is tested row by row (CASE: in that order). Rows above the
        -- cursor's highest id are not covered anyway.
        SELECT r.*, r.id <= s.rebase_hwm
                    AND CASE WHEN f.hwm IS NOT NULL AND r.id <= f.hwm
                                  AND pg_visible_in_snapshot(r.was, f.snap)
                                  AND NOT (r.topic = ANY (f.held_topics)) THEN false
                             ELSE NOT outbox.log_covers(r.id, r.topic, r.key, r.was) END AS late
        FROM r),
    noted AS (
        INSERT INTO outbox.log_rebase_late SELECT j.id FROM judged j WHERE j.late
        ON CONFLICT (id) DO NOTHING),
    kept AS (
        -- Tests of e, not j: a row written again while this waits for its
        -- lock is tested as it is then.
        UPDATE outbox.events e
        SET xid = CASE WHEN e.id <= s.rebase_hwm
                            AND NOT pg_visible_in_snapshot(e.xid, s.rebase_snap)
                            AND NOT (e.xmin = e.xid::xid
                                     AND e.xid < pg_snapshot_xmax(pg_current_snapshot()))
                       THEN v_low
                       ELSE e.xid END,
            origin_xid = NULL
        FROM judged j
        WHERE e.id = j.id AND NOT j.late
          AND (e.origin_xid IS NOT NULL
               OR (e.id <= s.rebase_hwm AND NOT pg_visible_in_snapshot(e.xid, s.rebase_snap)
                   AND NOT (e.xmin = e.xid::xid
                            AND e.xid < pg_snapshot_xmax(pg_current_snapshot())))))
    SELECT max(j.id), count(*) INTO v_last, v_read FROM judged j;
    IF p_limit IS NOT NULL AND v_read >= p_limit THEN
        UPDATE outbox.log_cursor_system SET rebase_next = v_last + 1;
        RETURN false;
    END IF;
    -- Read to the end: the noted rows get this transaction's xid, which the
    -- snapshot taken first does not see (it came after, or it is listed).
    v_xid := pg_current_xact_id();
    UPDATE outbox.events e SET xid = v_xid, origin_xid = NULL
    FROM outbox.log_rebase_late l WHERE e.id = l.id AND e.sent_at IS NULL;
    GET DIAGNOSTICS v_late = ROW_COUNT;
    INSERT INTO outbox.log_cursor (batch, hwm, snap, shards, slots)
    VALUES (coalesce((SELECT max(batch) FROM outbox.log_cursor), 0) + 1, s.rebase_hwm,
            s.rebase_snap, 1, NULL);
    DELETE FROM outbox.log_rebase_late;
    UPDATE outbox.log_cursor_system
    SET system_id = v_now, rebased_at = now(), rebasing_to = NULL, rebase_hwm = NULL,
        rebase_top = NULL, rebase_next = NULL, rebase_snap = NULL;
    RAISE WARNING 'outbox: the log cursor is rebased on system % (rows up to id % it had not '
                  'covered, published now: %)', v_now, s.rebase_hwm, v_late;
    RETURN true;
END
$$;
REVOKE ALL ON FUNCTION outbox.rebase_log_cursor(bigint) FROM PUBLIC;
DROP FUNCTION IF EXISTS outbox.rebase_log_cursor();

-- sql/008's repair, with the rebase first and a limit (NULL: none): every
-- relay runs it when it takes the lock (every row) or slots (their rows),
-- before it reads the cursor. The rebase is about every row, whichever
-- slots were taken. Returns how many rows it repaired (the limit: maybe
-- more are left), or -1 while a rebase goes on (p_limit rows a call).
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
    IF NOT outbox.rebase_log_cursor(p_limit) THEN
        RETURN -1; -- a rebase under way: ask again
    END IF;
    -- In log mode a row the cursor covers stays covered: it gets an xid
    -- that every snapshot from now on and every cursor row's sees
    -- committed (below their xmin, so never one they list as running),
    -- not this transaction's.
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
