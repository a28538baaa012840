-- syncguard_acquire, ten arguments: 0005's acquire (queue, flags, statuses unchanged)
-- with fence continuity (django_syncguard.fence_floors). What changes:
--   1. the first statement also reads the alias's fence floor, the counter row whose
--      fence_key is {{ floor_key }} (no key's fence key can be that: it has a colon
--      and does not start with "fence:"), LEFT JOINed like the counter: no extra
--      round trip, and the counter and the floor come from one snapshot;
--   2. the new fence is greatest(counter, floor) + 1 and, when p_clock (the alias's
--      FENCES is "clock"), at least v_now, the server's clock in ms: the formula of
--      fence_floors.next_fence;
--   3. the counter write is always an upsert that sets fence and acquired_at_ms = v_now
--      (the key's last acquisition, which compaction compares with its cut-off), even
--      when the counter was read: compaction deletes counters without this advisory
--      lock, so the row read in step 1 may be gone by the write. A plain UPDATE would
--      then write nothing, and the next acquire, finding no counter, would start from
--      the floor and could hand out this fence again. Compaction raised the floor to
--      at least the deleted fence before deleting it, and the fence here is above the
--      fence read, so the inserted row carries the order on;
--   4. setting the counter's waiters flag (a ticket queued for a held key) is an
--      upsert for the same reason: the flag must not be lost with a counter deleted
--      between the read and the write (a row recreated so keeps the fence read and no
--      acquisition time, like a counter of a version before this one).
-- An acquire and compaction's delete on the same counter meet on its row lock: the
-- upsert waits for a delete that came first (then inserts), and the delete waits for
-- an upsert that came first (then finds the fence changed and keeps the row).
CREATE OR REPLACE FUNCTION syncguard_acquire(
    p_key text, p_fence_key text, p_lock_id text, p_ttl_ms bigint,
    p_user_key text, p_max_fence bigint, p_tolerance_ms bigint,
    p_ticket text, p_patience_ms bigint, p_clock boolean,
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
            INSERT INTO syncguard_waiters AS w (key, ticket_id, arrival, live_until_ms)
                VALUES (p_key, p_ticket, nextval('syncguard_waiters_arrival'),
                        v_now + p_patience_ms)
                ON CONFLICT (key, ticket_id) DO UPDATE SET
                    live_until_ms = excluded.live_until_ms,
                    arrival = CASE WHEN w.live_until_ms <= v_now THEN excluded.arrival
                                   ELSE w.arrival END
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
            (key, lock_id, expires_at_ms, acquired_at_ms, fence, user_key, waiters)
            VALUES (p_key, p_lock_id, o_expires_at_ms, v_now, lpad(o_fence::text, {{ fence_digits }}, '0'),
                    p_user_key, v_more);
    ELSE
        UPDATE syncguard_locks l SET lock_id = p_lock_id, expires_at_ms = o_expires_at_ms,
            acquired_at_ms = v_now, fence = lpad(o_fence::text, {{ fence_digits }}, '0'), user_key = p_user_key,
            waiters = v_more
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
