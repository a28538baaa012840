-- 0008's twelve-argument syncguard_acquire, for code deployed before this version: a
-- wrapper of the fourteen-argument function whose grant record names no process
-- channel (such code LISTENs on the key's channel only, where its grants then go) and
-- that never watches a grant it makes (the hand-over tells the next waiter instead).
-- 0008's eleven-argument wrapper (and through it the older ones) call this one and so
-- go the same way. After acquire.sql: a LANGUAGE sql body is checked against the
-- fourteen-argument function when it is created.
CREATE OR REPLACE FUNCTION syncguard_acquire(
    p_key text, p_fence_key text, p_lock_id text, p_ttl_ms bigint,
    p_user_key text, p_max_fence bigint, p_tolerance_ms bigint,
    p_ticket text, p_patience_ms bigint, p_clock boolean, p_owner text,
    p_grant_window_ms bigint,
    OUT o_status smallint, OUT o_fence bigint, OUT o_expires_at_ms bigint,
    OUT o_position integer, OUT o_lock_id text
) LANGUAGE sql AS $$
    SELECT a.o_status, a.o_fence, a.o_expires_at_ms, a.o_position, a.o_lock_id
    FROM syncguard_acquire(
        p_key, p_fence_key, p_lock_id, p_ttl_ms, p_user_key, p_max_fence, p_tolerance_ms,
        p_ticket, p_patience_ms, p_clock, p_owner, p_grant_window_ms, NULL, false) a
$$;
