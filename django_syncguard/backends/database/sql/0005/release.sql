-- syncguard_release: 0002's delete and statuses, then, when the deleted lock's flag
-- says a waiter may be queued, NOTIFY the first live ticket of its key (payload: the
-- ticket id). pg_notify is transactional: the waiter hears it once the release has
-- committed, never before. The DELETE's row lock pairs with acquire's FOR KEY SHARE
-- read (step 2 of acquire.sql): the flag and the ticket of a waiter queued while the
-- lock was held are always seen here. An uncontended release is the one statement of
-- 0002; nothing is sent when nobody waits.
CREATE OR REPLACE FUNCTION syncguard_release(p_lock_id text, p_tolerance_ms bigint)
RETURNS smallint
LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := {{ now_ms }};
    v_key text;
    v_waiters boolean;
    v_head text;
BEGIN
    DELETE FROM syncguard_locks
        WHERE lock_id = p_lock_id AND expires_at_ms > v_now - p_tolerance_ms
        RETURNING key, waiters INTO v_key, v_waiters;
    IF NOT FOUND THEN
        PERFORM 1 FROM syncguard_locks WHERE lock_id = p_lock_id;
        RETURN CASE WHEN FOUND THEN 2 ELSE 0 END;
    END IF;
    IF NOT v_waiters THEN
        RETURN 1;
    END IF;
    SELECT w.ticket_id INTO v_head FROM syncguard_waiters w
        WHERE w.key = v_key AND w.live_until_ms > v_now ORDER BY w.arrival LIMIT 1;
    IF FOUND THEN
        PERFORM pg_notify(syncguard_channel(v_key), v_head);
    END IF;
    RETURN 1;
END;
$$;
