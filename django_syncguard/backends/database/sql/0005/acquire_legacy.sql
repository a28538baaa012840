-- 0002's seven-argument syncguard_acquire, for code deployed before this version: the
-- same answers (three columns), and the queue is respected (no ticket: a free key is
-- taken only when nobody waits). After acquire.sql: a LANGUAGE sql body is checked
-- against the nine-argument function when it is created.
CREATE OR REPLACE FUNCTION syncguard_acquire(
    p_key text, p_fence_key text, p_lock_id text, p_ttl_ms bigint,
    p_user_key text, p_max_fence bigint, p_tolerance_ms bigint,
    OUT o_status smallint, OUT o_fence bigint, OUT o_expires_at_ms bigint
) LANGUAGE sql AS $$
    SELECT a.o_status, a.o_fence, a.o_expires_at_ms FROM syncguard_acquire(
        p_key, p_fence_key, p_lock_id, p_ttl_ms, p_user_key, p_max_fence, p_tolerance_ms,
        NULL::text, NULL::bigint) a
$$;
