-- 0005's nine-argument syncguard_acquire, for code deployed before this version: now a
-- wrapper of the ten-argument function in counter mode (the mode such code has), so
-- that an acquire through it also starts above the fence floor, writes its counter
-- with an upsert and records acquired_at_ms. Keeping 0005's body instead would not be
-- only old, but unsafe once compaction runs: it ignores the floor, so a key whose
-- counter was compacted would start again from 1. 0005's seven-argument wrapper calls
-- this one and so goes the same way. After acquire.sql: a LANGUAGE sql body is checked
-- against the ten-argument function when it is created.
CREATE OR REPLACE FUNCTION syncguard_acquire(
    p_key text, p_fence_key text, p_lock_id text, p_ttl_ms bigint,
    p_user_key text, p_max_fence bigint, p_tolerance_ms bigint,
    p_ticket text, p_patience_ms bigint,
    OUT o_status smallint, OUT o_fence bigint, OUT o_expires_at_ms bigint,
    OUT o_position integer
) LANGUAGE sql AS $$
    SELECT a.o_status, a.o_fence, a.o_expires_at_ms, a.o_position FROM syncguard_acquire(
        p_key, p_fence_key, p_lock_id, p_ttl_ms, p_user_key, p_max_fence, p_tolerance_ms,
        p_ticket, p_patience_ms, false) a
$$;
