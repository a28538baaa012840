-- syncguard_acquire, seven arguments: the acquire operation of the database backend
-- on PostgreSQL, in one round trip. Under a transaction-scoped advisory lock on the
-- storage key, concurrent acquirers of one key (including first acquirers of a key
-- that has no counter row yet) run one after the other, and each reads what the
-- previous one committed:
--   1. read the key's lock row and fence counter in one statement;
--   2. a live lock -> status 0 (contention), nothing written;
--   3. the next fence above p_max_fence -> status 2 (overflow), nothing written;
--   4. insert the lock, or replace the expired one; the replacement re-checks expiry,
--      so an extend that committed meanwhile (extend takes no advisory lock) is never
--      overwritten (status 0);
--   5. only then store the new counter value -> status 1.
-- Only acquire inserts rows, and only under this advisory lock, so plain INSERTs
-- cannot meet a conflicting row. Time is clock_timestamp(): the moment of the call,
-- not the start of the transaction.
CREATE OR REPLACE FUNCTION syncguard_acquire(
    p_key text, p_fence_key text, p_lock_id text, p_ttl_ms bigint,
    p_user_key text, p_max_fence bigint, p_tolerance_ms bigint,
    OUT o_status smallint, OUT o_fence bigint, OUT o_expires_at_ms bigint
) LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint;
    v_expires bigint;
    v_last bigint;
BEGIN
    o_status := 0;  -- contention unless we get through
    PERFORM pg_advisory_xact_lock({{ lock_class }}, hashtext(p_key));
    v_now := {{ now_ms }};
    SELECT (SELECT l.expires_at_ms FROM syncguard_locks l WHERE l.key = p_key),
           (SELECT c.fence FROM syncguard_fence_counters c WHERE c.fence_key = p_fence_key)
        INTO v_expires, v_last;
    IF v_expires > v_now - p_tolerance_ms THEN
        RETURN;
    END IF;
    o_fence := coalesce(v_last, 0) + 1;
    IF o_fence > p_max_fence THEN
        o_status := 2;
        o_fence := NULL;
        RETURN;
    END IF;
    o_expires_at_ms := v_now + p_ttl_ms;
    IF v_expires IS NULL THEN
        INSERT INTO syncguard_locks (key, lock_id, expires_at_ms, acquired_at_ms, fence, user_key)
            VALUES (p_key, p_lock_id, o_expires_at_ms, v_now, lpad(o_fence::text, {{ fence_digits }}, '0'),
                    p_user_key);
    ELSE
        UPDATE syncguard_locks l SET lock_id = p_lock_id, expires_at_ms = o_expires_at_ms,
            acquired_at_ms = v_now, fence = lpad(o_fence::text, {{ fence_digits }}, '0'), user_key = p_user_key
            WHERE l.key = p_key AND l.expires_at_ms <= v_now - p_tolerance_ms;
        IF NOT FOUND THEN
            o_fence := NULL;
            o_expires_at_ms := NULL;
            RETURN;
        END IF;
    END IF;
    IF v_last IS NULL THEN
        INSERT INTO syncguard_fence_counters (fence_key, fence) VALUES (p_fence_key, o_fence);
    ELSE
        UPDATE syncguard_fence_counters c SET fence = o_fence WHERE c.fence_key = p_fence_key;
    END IF;
    o_status := 1;
END;
$$;
