-- syncguard_withdraw: a waiter gives up its place. When its ticket was there and the
-- key is free, NOTIFY the new first live ticket. The advisory lock orders it with
-- acquire; the FOR KEY SHARE read orders it with a release (as in acquire, step 2).
CREATE OR REPLACE FUNCTION syncguard_withdraw(
    p_key text, p_ticket text, p_tolerance_ms bigint
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint;
    v_head text;
BEGIN
    PERFORM pg_advisory_xact_lock({{ lock_class }}, hashtext(p_key));
    DELETE FROM syncguard_waiters w WHERE w.key = p_key AND w.ticket_id = p_ticket;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_now := {{ now_ms }};
    PERFORM 1 FROM syncguard_locks l
        WHERE l.key = p_key AND l.expires_at_ms > v_now - p_tolerance_ms FOR KEY SHARE;
    IF FOUND THEN
        RETURN;
    END IF;
    SELECT w.ticket_id INTO v_head FROM syncguard_waiters w
        WHERE w.key = p_key AND w.live_until_ms > v_now ORDER BY w.arrival LIMIT 1;
    IF FOUND THEN
        PERFORM pg_notify(syncguard_channel(p_key), v_head);
    END IF;
END;
$$;
