-- syncguard_release, four arguments: 0008's three-argument release (the delete, its
-- statuses, the hand-over under a tried advisory lock) with two changes:
--   1. it sets synchronous_commit off for its own transaction itself, first (decision
--      47: a release need not wait for its WAL flush), so the caller's statement is a
--      plain call whose row carries every result; a grant sets it back on, as before;
--   2. p_watched: the caller's process checks a grant this release makes once its
--      window is over (syncguard_check_grant), so the hand-over tells nobody but the
--      grantee (hand_over.sql, 2), and o_granted and o_key report the ticket granted
--      and the key's storage key, for that check. Without p_watched both are NULL.
-- o_status: 1 released, 2 expired (the row exists but is not live), 0 not found.
-- The three-argument form of 0008's code is a wrapper of this one (release_legacy.sql).
CREATE OR REPLACE FUNCTION syncguard_release(
    p_lock_id text, p_tolerance_ms bigint, p_grant boolean, p_watched boolean,
    OUT o_status smallint, OUT o_granted text, OUT o_key text
) LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := {{ now_ms }};
    v_key text;
    v_waiters boolean;
    v_grant boolean := false;
    v_granted text;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    DELETE FROM syncguard_locks
        WHERE lock_id = p_lock_id AND expires_at_ms > v_now - p_tolerance_ms
        RETURNING key, waiters INTO v_key, v_waiters;
    IF NOT FOUND THEN
        PERFORM 1 FROM syncguard_locks WHERE lock_id = p_lock_id;
        o_status := CASE WHEN FOUND THEN 2 ELSE 0 END;
        RETURN;
    END IF;
    o_status := 1;
    IF NOT v_waiters THEN
        RETURN;
    END IF;
    IF p_grant THEN
        -- A try, never a wait: see 0008's release.sql (an acquire holding the
        -- advisory lock waits for this row's lock; that acquire grants instead).
        v_grant := pg_try_advisory_xact_lock({{ lock_class }}, hashtext(v_key));
    END IF;
    v_granted := syncguard_hand_over(v_key, v_now, p_tolerance_ms, v_grant, false, p_watched);
    IF p_watched AND v_granted IS NOT NULL THEN
        o_granted := v_granted;
        o_key := v_key;
    END IF;
END;
$$;
