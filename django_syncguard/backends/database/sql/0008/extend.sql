-- syncguard_extend: 0002's extend (same signature and statuses) that also claims a
-- grant: the renewed row's grant_expires_at_ms is cleared, so a later claim (the
-- waiter's channel, late) cannot move the expiry back to the one the grant told. A
-- grant that lapsed is not live, and answers 2 (expired) as an expired lease does.
CREATE OR REPLACE FUNCTION syncguard_extend(
    p_lock_id text, p_ttl_ms bigint, p_tolerance_ms bigint,
    OUT o_status smallint, OUT o_expires_at_ms bigint
) LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := {{ now_ms }};
BEGIN
    UPDATE syncguard_locks l SET expires_at_ms = v_now + p_ttl_ms, grant_expires_at_ms = NULL
        WHERE l.lock_id = p_lock_id AND l.expires_at_ms > v_now - p_tolerance_ms;
    IF FOUND THEN
        o_status := 1;
        o_expires_at_ms := v_now + p_ttl_ms;
        RETURN;
    END IF;
    PERFORM 1 FROM syncguard_locks l WHERE l.lock_id = p_lock_id;
    o_status := CASE WHEN FOUND THEN 2 ELSE 0 END;
END;
$$;
