-- 0007's eleven-argument syncguard_acquire, for code deployed before this version: now a
-- wrapper of the twelve-argument function that leaves no grant record (such code does
-- not know grants: its waiters are only woken, and acquire as before), so that both
-- keep one body. 0007's ten-argument wrapper (and through it the nine- and
-- seven-argument ones) call this one and so go the same way. After acquire.sql: a
-- LANGUAGE sql body is checked against the twelve-argument function when it is created.
CREATE OR REPLACE FUNCTION syncguard_acquire(
    p_key text, p_fence_key text, p_lock_id text, p_ttl_ms bigint,
    p_user_key text, p_max_fence bigint, p_tolerance_ms bigint,
    p_ticket text, p_patience_ms bigint, p_clock boolean, p_owner text,
    OUT o_status smallint, OUT o_fence bigint, OUT o_expires_at_ms bigint,
    OUT o_position integer
) LANGUAGE sql AS $$
    SELECT a.o_status, a.o_fence, a.o_expires_at_ms, a.o_position FROM syncguard_acquire(
        p_key, p_fence_key, p_lock_id, p_ttl_ms, p_user_key, p_max_fence, p_tolerance_ms,
        p_ticket, p_patience_ms, p_clock, p_owner, NULL) a
$$;
