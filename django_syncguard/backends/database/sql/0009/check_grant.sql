-- syncguard_check_grant: run by the process whose release (withdrawal, attempt) granted
-- the key p_key to the ticket p_ticket, once the grant's window is over (its wake-ups'
-- thread; specs/decisions.md, 48). Such a grant told nobody but the grantee, so if the
-- grantee's process never claims it (it died), this check is what moves the key on.
--   o_status 0: the grant was claimed, or the key moved on (released, taken over,
--               granted again): nothing to do;
--   o_status 2: the grant is still unclaimed but its window is not over by the
--               server's clock: o_ms says in how many ms it is (check again then);
--   o_status 1: it lapsed unclaimed: the key goes to the first live waiter exactly as
--               an attempt that notices the lapse hands it on (syncguard_hand_over,
--               under the key's advisory lock), and o_granted is the ticket granted
--               now when p_watched (the caller checks that one in turn), else NULL.
-- An unclaimed grant's expires_at_ms is its claim deadline less the tolerance (0008's
-- hand_over.sql), so "lapsed" is the test every reader of liveness makes.
CREATE OR REPLACE FUNCTION syncguard_check_grant(
    p_key text, p_ticket text, p_tolerance_ms bigint, p_watched boolean,
    OUT o_status smallint, OUT o_ms bigint, OUT o_granted text
) LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint;
    v_expires bigint;
BEGIN
    o_status := 0;
    PERFORM pg_advisory_xact_lock({{ lock_class }}, hashtext(p_key));
    v_now := {{ now_ms }};
    SELECT l.expires_at_ms INTO v_expires FROM syncguard_locks l
        WHERE l.key = p_key AND l.granted_to = p_ticket AND l.grant_expires_at_ms IS NOT NULL;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF v_expires > v_now - p_tolerance_ms THEN
        o_status := 2;
        o_ms := v_expires + p_tolerance_ms - v_now;
        RETURN;
    END IF;
    o_status := 1;
    o_granted := syncguard_hand_over(p_key, v_now, p_tolerance_ms, true, false, p_watched);
    IF NOT p_watched THEN
        o_granted := NULL;
    END IF;
END;
$$;
