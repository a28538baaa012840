-- syncguard_claim: the waiter's process claims the key granted to it (its channel's
-- thread, as soon as the grant's NOTIFY arrives), so that the grant does not lapse: the
-- row gets the expiry its holder was told (grant_expires_at_ms) and loses the claim
-- deadline. Status 1: claimed (or claimed already, by the waiter's own attempt or an
-- extend); 2: the row exists but is not live (the grant lapsed, or the lease ran out);
-- 0: no such lock id (released, or taken over).
CREATE OR REPLACE FUNCTION syncguard_claim(p_lock_id text, p_tolerance_ms bigint)
RETURNS smallint
LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := {{ now_ms }};
BEGIN
    UPDATE syncguard_locks l
        SET expires_at_ms = l.grant_expires_at_ms, grant_expires_at_ms = NULL
        WHERE l.lock_id = p_lock_id AND l.expires_at_ms > v_now - p_tolerance_ms
          AND l.grant_expires_at_ms IS NOT NULL;
    IF FOUND THEN
        RETURN 1;
    END IF;
    PERFORM 1 FROM syncguard_locks l
        WHERE l.lock_id = p_lock_id AND l.expires_at_ms > v_now - p_tolerance_ms;
    IF FOUND THEN
        RETURN 1;
    END IF;
    PERFORM 1 FROM syncguard_locks l WHERE l.lock_id = p_lock_id;
    RETURN CASE WHEN FOUND THEN 2 ELSE 0 END;
END;
$$;
