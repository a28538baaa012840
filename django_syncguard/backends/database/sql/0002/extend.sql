-- syncguard_extend: as release, with an UPDATE that renews the live row instead of
-- deleting it. Status 1 (with the new expiry), 2 (expired) or 0 (not found).
CREATE OR REPLACE FUNCTION syncguard_extend(
    p_lock_id text, p_ttl_ms bigint, p_tolerance_ms bigint,
    OUT o_status smallint, OUT o_expires_at_ms bigint
) LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := {{ now_ms }};
BEGIN
    UPDATE syncguard_locks l SET expires_at_ms = v_now + p_ttl_ms
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
