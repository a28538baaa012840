-- syncguard_release: resolve the lock id, require the row to be live and delete it,
-- in one statement inside the function (the row lock of DELETE makes the check and
-- the write atomic). Status 1: done; 2: the row exists but is no longer live
-- ("expired"); 0: no such lock id ("not-found"). As a function, its plan is cached
-- per session without protocol-level prepared statements, which keeps it safe behind
-- pgbouncer's transaction pooling.
CREATE OR REPLACE FUNCTION syncguard_release(p_lock_id text, p_tolerance_ms bigint)
RETURNS smallint
LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := {{ now_ms }};
BEGIN
    DELETE FROM syncguard_locks
        WHERE lock_id = p_lock_id AND expires_at_ms > v_now - p_tolerance_ms;
    IF FOUND THEN
        RETURN 1;
    END IF;
    PERFORM 1 FROM syncguard_locks WHERE lock_id = p_lock_id;
    RETURN CASE WHEN FOUND THEN 2 ELSE 0 END;
END;
$$;
