-- syncguard_acquire, fourteen arguments: 0008's acquire (queue, flags, fence continuity,
-- owner, grant records, crossing a grant; statuses unchanged) with per-process grant
-- channels (specs/decisions.md, 48):
--   1. p_process_channel: the channel the waiter's process LISTENs on for its grants,
--      stored in the ticket's grant record (NULL: none; the grant is NOTIFYed on the
--      key's channel, as 0008 did);
--   2. p_watched: when this attempt finds the key free while another live ticket is
--      first and hands the key to it (0008's acquire.sql, 3), the caller's process
--      checks that grant once its window is over (syncguard_check_grant): the
--      hand-over tells nobody but the grantee, and o_granted reports the ticket
--      granted (NULL otherwise, and without p_watched).
-- 0008's twelve-argument form is a wrapper of this one (acquire_legacy.sql).
CREATE OR REPLACE FUNCTION syncguard_acquire(
    p_key text, p_fence_key text, p_lock_id text, p_ttl_ms bigint,
    p_user_key text, p_max_fence bigint, p_tolerance_ms bigint,
    p_ticket text, p_patience_ms bigint, p_clock boolean, p_owner text,
    p_grant_window_ms bigint, p_process_channel text, p_watched boolean,
    OUT o_status smallint, OUT o_fence bigint, OUT o_expires_at_ms bigint,
    OUT o_position integer, OUT o_lock_id text, OUT o_granted text
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
    v_granted_to text;
    v_held_id text;
    v_held_fence text;
    v_told bigint;
    v_granted text;
BEGIN
    o_status := 0;  -- contention unless we get through
    PERFORM pg_advisory_xact_lock({{ lock_class }}, hashtext(p_key));
    v_now := {{ now_ms }};
    SELECT l.expires_at_ms, l.granted_to, l.lock_id, l.fence, l.grant_expires_at_ms,
           c.fence, coalesce(c.waiters, false), f.fence
        INTO v_expires, v_granted_to, v_held_id, v_held_fence, v_told,
             v_last, v_queued, v_floor
        FROM (SELECT) AS one
        LEFT JOIN syncguard_locks l ON l.key = p_key
        LEFT JOIN syncguard_fence_counters c ON c.fence_key = p_fence_key
        LEFT JOIN syncguard_fence_counters f ON f.fence_key = {{ floor_key }};
    v_free := v_expires IS NULL OR v_expires <= v_now - p_tolerance_ms;
    IF NOT v_free AND p_ticket IS NOT NULL AND v_granted_to = p_ticket THEN
        -- Granted to this ticket while this attempt was on its way: the grant's lock
        -- is the answer, claimed here (its channel's claim may not have run yet).
        IF v_told IS NOT NULL THEN
            UPDATE syncguard_locks l SET expires_at_ms = v_told, grant_expires_at_ms = NULL
                WHERE l.key = p_key AND l.lock_id = v_held_id
                  AND l.grant_expires_at_ms IS NOT NULL;
            v_expires := v_told;
        END IF;
        o_status := 1;
        o_fence := v_held_fence::bigint;
        o_expires_at_ms := v_expires;
        o_lock_id := v_held_id;
        RETURN;
    END IF;
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
        IF NOT v_free THEN
            v_granted := syncguard_hand_over(
                p_key, v_now, p_tolerance_ms, true, p_ticket IS NOT NULL, p_watched);
            IF p_watched THEN
                o_granted := v_granted;
            END IF;
        END IF;
    END IF;
    IF NOT v_free THEN
        IF p_ticket IS NOT NULL THEN
            INSERT INTO syncguard_waiters AS w
                    (key, ticket_id, arrival, live_until_ms, queued_at_ms, lock_id, ttl_ms,
                     fence_key, user_key, owner, clock, max_fence, grant_window_ms,
                     process_channel)
                VALUES (p_key, p_ticket, nextval('syncguard_waiters_arrival'),
                        v_now + p_patience_ms, v_now, p_lock_id, p_ttl_ms, p_fence_key,
                        p_user_key, p_owner, p_clock, p_max_fence, p_grant_window_ms,
                        p_process_channel)
                ON CONFLICT (key, ticket_id) DO UPDATE SET
                    live_until_ms = excluded.live_until_ms,
                    arrival = CASE WHEN w.live_until_ms <= v_now THEN excluded.arrival
                                   ELSE w.arrival END,
                    queued_at_ms = CASE WHEN w.live_until_ms <= v_now THEN excluded.queued_at_ms
                                        ELSE w.queued_at_ms END,
                    lock_id = excluded.lock_id, ttl_ms = excluded.ttl_ms,
                    fence_key = excluded.fence_key, user_key = excluded.user_key,
                    owner = excluded.owner, clock = excluded.clock,
                    max_fence = excluded.max_fence, grant_window_ms = excluded.grant_window_ms,
                    process_channel = excluded.process_channel
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
            waiters = v_more, owner = p_owner, grant_expires_at_ms = NULL, granted_to = NULL
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
