-- syncguard_release, three arguments: 0005's delete and statuses; then, when the deleted
-- lock's flag says a waiter may be queued, the key goes to the first live waiter
-- (syncguard_hand_over): granted when p_grant is true and the key's advisory lock can be
-- had without waiting, else only woken.
-- Why a try: an acquire holds the advisory lock and then waits for this row's lock (its
-- FOR KEY SHARE read), while this function holds the row lock already; waiting for the
-- advisory lock here would deadlock. Such an acquire, once this release commits, finds
-- the key free and either takes it (it is first) or hands it to the first waiter
-- itself (acquire.sql, 3), so the key is granted either way.
-- p_grant: the caller's statement sets synchronous_commit off BEFORE calling (the
-- release's own commit need not wait for its WAL flush, decision 47), and a grant sets
-- it back on for the transaction: the fence it writes must be as durable as an
-- acquire's. Code before this version sets it off AFTER calling (it knew no grants), so
-- its two-argument form passes false (release_legacy.sql).
CREATE OR REPLACE FUNCTION syncguard_release(
    p_lock_id text, p_tolerance_ms bigint, p_grant boolean
) RETURNS smallint
LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := {{ now_ms }};
    v_key text;
    v_waiters boolean;
    v_grant boolean := false;
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
    IF p_grant THEN
        v_grant := pg_try_advisory_xact_lock({{ lock_class }}, hashtext(v_key));
    END IF;
    PERFORM syncguard_hand_over(v_key, v_now, p_tolerance_ms, v_grant, false);
    RETURN 1;
END;
$$;
