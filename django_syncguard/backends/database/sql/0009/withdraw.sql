-- syncguard_withdraw, four arguments: 0008's withdrawal (a grant to the ticket goes
-- back and on to the next waiter; else the ticket leaves the queue, and a free key goes
-- to the new first waiter) with p_watched: the caller's process checks a grant this
-- withdrawal makes once its window is over (syncguard_check_grant), so the hand-over
-- tells nobody but the grantee (hand_over.sql, 2), and the function returns the ticket
-- granted the key. NULL: no grant, or not p_watched. 0008's three-argument form is a
-- wrapper of this one (withdraw_legacy.sql).
CREATE OR REPLACE FUNCTION syncguard_withdraw(
    p_key text, p_ticket text, p_tolerance_ms bigint, p_watched boolean
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint;
    v_granted text;
BEGIN
    PERFORM pg_advisory_xact_lock({{ lock_class }}, hashtext(p_key));
    v_now := {{ now_ms }};
    DELETE FROM syncguard_locks l WHERE l.key = p_key AND l.granted_to = p_ticket;
    IF NOT FOUND THEN
        DELETE FROM syncguard_waiters w WHERE w.key = p_key AND w.ticket_id = p_ticket;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
        PERFORM 1 FROM syncguard_locks l
            WHERE l.key = p_key AND l.expires_at_ms > v_now - p_tolerance_ms FOR KEY SHARE;
        IF FOUND THEN
            RETURN NULL;
        END IF;
    END IF;
    v_granted := syncguard_hand_over(p_key, v_now, p_tolerance_ms, true, false, p_watched);
    RETURN CASE WHEN p_watched THEN v_granted END;
END;
$$;
