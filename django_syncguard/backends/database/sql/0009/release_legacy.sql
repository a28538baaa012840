-- 0008's three-argument syncguard_release, for code deployed before this version: a
-- wrapper of the four-argument function that never watches its grants (such code does
-- not check them: the hand-over tells the next waiter instead, hand_over.sql, 2). Its
-- statement, "SELECT set_config('synchronous_commit', 'off', true),
-- syncguard_release(%s, %s, true)", sets the 'off' before the call, which the function
-- now does itself too: the same order. 0008's two-argument wrapper calls this one and
-- so goes the same way (it never grants). After release.sql: a LANGUAGE sql body is
-- checked against the four-argument function when it is created.
CREATE OR REPLACE FUNCTION syncguard_release(
    p_lock_id text, p_tolerance_ms bigint, p_grant boolean
) RETURNS smallint
LANGUAGE sql AS $$
    SELECT r.o_status FROM syncguard_release(p_lock_id, p_tolerance_ms, p_grant, false) r
$$;
