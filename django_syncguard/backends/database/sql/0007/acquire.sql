-- syncguard_acquire, eleven arguments: 0006's acquire (queue, flags, fence continuity
-- and statuses unchanged) with the holder's owner label. What changes:
--   1. p_owner, the label (django_syncguard.owners; NULL when the alias does not record
--      owners), is written to syncguard_locks.owner with the lock, in the same INSERT
--      or UPDATE, so a taken-over row never keeps the previous holder's label;
--   2. a ticket's first INSERT into syncguard_waiters records queued_at_ms = v_now (the
--      server's clock), and so does a ticket that comes back after its place lapsed
--      (it goes to the end, so its wait starts again); a renewal keeps it. The admin
--      inspector shows the oldest live ticket's age from it.
-- Nothing else is read or written: no extra round trip, no extra row.
CREATE OR REPLACE FUNCTION syncguard_acquire(
    p_key text, p_fence_key text, p_lock_id text, p_ttl_ms bigint,
    p_user_key text, p_max_fence bigint, p_tolerance_ms bigint,
    p_ticket text, p_patience_ms bigint, p_clock boolean, p_owner text,
    OUT o_status smallint, OUT o_fence bigint, OUT o_expires_at_ms bigint,
    OUT o_position integer
) LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint;
    v_expires bigint;
    v_last bigint;
    v_floor bigint;
    v_queued boolean;
    v_flagged boolean;
    v_free boolean;
    v_head text;
    v_arrival bigint;
    v_more boolean := false;
BEGIN
    o_status := 0;  -- contention unless we get through
    PERFORM pg_advisory_xact_lock({{ lock_class }}, hashtext(p_key));
    v_now := {{ now_ms }};
    SELECT l.expires_at_ms, c.fence, coalesce(c.waiters, false), f.fence
        INTO v_expires, v_last, v_queued, v_floor
        FROM (SELECT) AS one
        LEFT JOIN syncguard_locks l ON l.key = p_key
        LEFT JOIN syncguard_fence_counters c ON c.fence_key = p_fence_key
        LEFT JOIN syncguard_fence_counters f ON f.fence_key = {{ floor_key }};
    v_free := v_expires IS NULL OR v_expires <= v_now - p_tolerance_ms;
    IF NOT v_free THEN
        IF p_ticket IS NULL THEN
            RETURN;
        END IF;
        SELECT l.expires_at_ms, l.waiters INTO v_expires, v_flagged FROM syncguard_locks l
            WHERE l.key = p_key FOR KEY SHARE;
        v_free := v_expires IS NULL OR v_expires <= v_now - p_tolerance_ms;
        IF NOT v_free AND NOT v_flagged THEN
            UPDATE syncguard_locks l SET waiters = true WHERE l.key = p_key;
        END IF;
    END IF;
    IF v_free AND v_queued THEN
        DELETE FROM syncguard_waiters w WHERE w.key = p_key AND w.live_until_ms <= v_now;
        SELECT w.ticket_id INTO v_head FROM syncguard_waiters w
            WHERE w.key = p_key ORDER BY w.arrival LIMIT 1;
        v_free := v_head IS NULL OR v_head IS NOT DISTINCT FROM p_ticket;
    END IF;
    IF NOT v_free THEN
        IF p_ticket IS NOT NULL THEN
            INSERT INTO syncguard_waiters AS w
                    (key, ticket_id, arrival, live_until_ms, queued_at_ms)
                VALUES (p_key, p_ticket, nextval('syncguard_waiters_arrival'),
                        v_now + p_patience_ms, v_now)
                ON CONFLICT (key, ticket_id) DO UPDATE SET
                    live_until_ms = excluded.live_until_ms,
                    arrival = CASE WHEN w.live_until_ms <= v_now THEN excluded.arrival
                                   ELSE w.arrival END,
                    queued_at_ms = CASE WHEN w.live_until_ms <= v_now THEN excluded.queued_at_ms
                                        ELSE w.queued_at_ms END
                RETURNING w.arrival INTO v_arrival;
            IF NOT v_queued THEN
                INSERT INTO syncguard_fence_counters (fence_key, fence, waiters)
                    VALUES (p_fence_key, coalesce(v_last, 0), true)
                    ON CONFLICT (fence_key) DO UPDATE SET waiters = true;
            END IF;
            SELECT count(*) INTO o_position FROM syncguard_waiters w
                WHERE w.key = p_key AND w.arrival < v_arrival AND w.live_until_ms > v_now;
        END IF;
        RETURN;
    END IF;
    o_fence := greatest(coalesce(v_last, 0), coalesce(v_floor, 0)) + 1;
    IF p_clock THEN
        o_fence := greatest(o_fence, v_now);
    END IF;
    IF o_fence > p_max_fence THEN
        o_status := 2;
        o_fence := NULL;
        RETURN;
    END IF;
    IF v_head IS NOT NULL THEN
        v_more := EXISTS (SELECT 1 FROM syncguard_waiters w
                          WHERE w.key = p_key AND w.ticket_id <> p_ticket);
    END IF;
    o_expires_at_ms := v_now + p_ttl_ms;
    IF v_expires IS NULL THEN
        INSERT INTO syncguard_locks
            (key, lock_id, expires_at_ms, acquired_at_ms, fence, user_key, waiters, owner)
            VALUES (p_key, p_lock_id, o_expires_at_ms, v_now, lpad(o_fence::text, {{ fence_digits }}, '0'),
                    p_user_key, v_more, p_owner);
    ELSE
        UPDATE syncguard_locks l SET lock_id = p_lock_id, expires_at_ms = o_expires_at_ms,
            acquired_at_ms = v_now, fence = lpad(o_fence::text, {{ fence_digits }}, '0'), user_key = p_user_key,
            waiters = v_more, owner = p_owner
            WHERE l.key = p_key AND l.expires_at_ms <= v_now - p_tolerance_ms;
        IF NOT FOUND THEN
            o_fence := NULL;
            o_expires_at_ms := NULL;
            RETURN;
        END IF;
    END IF;
    INSERT INTO syncguard_fence_counters AS c (fence_key, fence, waiters, acquired_at_ms)
        VALUES (p_fence_key, o_fence, v_more, v_now)
        ON CONFLICT (fence_key) DO UPDATE SET
            fence = excluded.fence,
            acquired_at_ms = excluded.acquired_at_ms,
            waiters = CASE WHEN v_queued AND NOT v_more THEN false ELSE c.waiters END;
    IF v_head IS NOT NULL THEN
        DELETE FROM syncguard_waiters w WHERE w.key = p_key AND w.ticket_id = p_ticket;
    END IF;
    o_status := 1;
END;
$$;
