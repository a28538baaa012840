-- 0005's two-argument syncguard_release, for code deployed before this version: a
-- wrapper of the three-argument function that never grants, only wakes the first
-- waiter as before. Such code sends "SELECT syncguard_release(...), set_config(
-- 'synchronous_commit', 'off', true)": the set_config runs after the call and would
-- undo the 'on' a grant sets, leaving the grant's fence to a commit that does not wait
-- for its WAL flush. After release.sql.
CREATE OR REPLACE FUNCTION syncguard_release(p_lock_id text, p_tolerance_ms bigint)
RETURNS smallint
LANGUAGE sql AS $$
    SELECT syncguard_release(p_lock_id, p_tolerance_ms, false)
$$;
