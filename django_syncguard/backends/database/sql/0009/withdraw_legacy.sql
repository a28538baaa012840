-- 0008's three-argument syncguard_withdraw (the signature of 0005), for code deployed
-- before this version: a wrapper of the four-argument function that never watches its
-- grants (the hand-over tells the next waiter instead). After withdraw.sql.
CREATE OR REPLACE FUNCTION syncguard_withdraw(
    p_key text, p_ticket text, p_tolerance_ms bigint
) RETURNS void
LANGUAGE sql AS $$
    SELECT syncguard_withdraw(p_key, p_ticket, p_tolerance_ms, false)
$$;
