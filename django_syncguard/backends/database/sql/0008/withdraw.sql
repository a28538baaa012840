-- syncguard_withdraw: 0005's withdrawal (same signature) with grants. A waiter gives up:
--   1. when the key was granted to its ticket (claimed or not: the waiter gave up before
--      it used the grant), that lock is deleted and the key goes on to the next live
--      waiter (syncguard_hand_over);
--   2. otherwise its ticket leaves the queue and, when it was there and the key is free
--      (no live lock: a lease that ran out or a grant that lapsed counts as free), the
--      key goes to the new first live waiter.
-- The advisory lock orders it with acquires; the FOR KEY SHARE read orders it with a
-- release (as in acquire). The statement runs with synchronous_commit as configured
-- (on): a grant made here is durable.
CREATE OR REPLACE FUNCTION syncguard_withdraw(
    p_key text, p_ticket text, p_tolerance_ms bigint
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint;
BEGIN
    PERFORM pg_advisory_xact_lock({{ lock_class }}, hashtext(p_key));
    v_now := {{ now_ms }};
    DELETE FROM syncguard_locks l WHERE l.key = p_key AND l.granted_to = p_ticket;
    IF FOUND THEN
        PERFORM syncguard_hand_over(p_key, v_now, p_tolerance_ms, true, false);
        RETURN;
    END IF;
    DELETE FROM syncguard_waiters w WHERE w.key = p_key AND w.ticket_id = p_ticket;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    PERFORM 1 FROM syncguard_locks l
        WHERE l.key = p_key AND l.expires_at_ms > v_now - p_tolerance_ms FOR KEY SHARE;
    IF FOUND THEN
        RETURN;
    END IF;
    PERFORM syncguard_hand_over(p_key, v_now, p_tolerance_ms, true, false);
END;
$$;
