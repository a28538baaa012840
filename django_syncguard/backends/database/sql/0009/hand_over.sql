-- syncguard_hand_over, six arguments: 0008's hand-over (same writes, same rules for who
-- is granted and who is only woken) with per-process grant channels
-- (specs/decisions.md, 48). What changes is who hears about a grant, and the return:
--   1. a grant to a ticket whose record names its process's channel (written by its
--      acquire, see acquire.sql) is NOTIFYed there alone, as
--      'g <ticket> <lock id> <fence> <expires> <key channel>': only that process wakes;
--      a record without one (a waiter of 0008's code) hears it on the key's channel as
--      '<ticket> <lock id> <fence> <expires>', as before;
--   2. unless p_watched (the caller's process checks the grant once its window is
--      over, syncguard_check_grant), the next live waiter is told that it is next: on
--      its process's channel 'n <ticket> <key channel>' (it re-checks after the
--      window, in case the grant lapses unclaimed), or, for a waiter of 0008's code,
--      the grant on the key's channel, from which such a process draws the same
--      conclusion. With p_watched nothing more is sent: the waiter after the grantee
--      is not woken at this hand-off at all;
--   3. it returns the ticket granted the key (NULL: nobody was granted, only woken).
-- Wake-ups without a grant ('<ticket>' on the key's channel) are unchanged. The caller
-- holds the key's advisory lock whenever p_grant is true (see 0008's hand_over.sql for
-- the rest: the claim deadline in expires_at_ms, the counter, synchronous_commit).
-- 0008's five-argument hand-over is dropped here: only 0008's functions called it, and
-- this migration replaces each of them.
CREATE OR REPLACE FUNCTION syncguard_hand_over(
    p_key text, p_now bigint, p_tolerance_ms bigint, p_grant boolean, p_queueing boolean,
    p_watched boolean
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_head record;
    v_next record;
    v_fence bigint;
    v_expires bigint;
    v_more boolean;
    v_channel text;
    v_grant text;
BEGIN
    SELECT * INTO v_head FROM syncguard_waiters w
        WHERE w.key = p_key AND w.live_until_ms > p_now ORDER BY w.arrival LIMIT 1;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF NOT p_grant OR v_head.grant_window_ms IS NULL THEN
        PERFORM pg_notify(syncguard_channel(p_key), v_head.ticket_id);
        RETURN NULL;
    END IF;
    SELECT greatest(coalesce(max(c.fence) FILTER (WHERE c.fence_key = v_head.fence_key), 0),
                    coalesce(max(c.fence) FILTER (WHERE c.fence_key = {{ floor_key }}), 0)) + 1
        INTO v_fence FROM syncguard_fence_counters c
        WHERE c.fence_key IN (v_head.fence_key, {{ floor_key }});
    IF v_head.clock THEN
        v_fence := greatest(v_fence, p_now);
    END IF;
    IF v_fence > v_head.max_fence THEN
        PERFORM pg_notify(syncguard_channel(p_key), v_head.ticket_id);
        RETURN NULL;
    END IF;
    v_expires := p_now + v_head.ttl_ms;
    v_more := p_queueing OR EXISTS (SELECT 1 FROM syncguard_waiters w
                                    WHERE w.key = p_key AND w.ticket_id <> v_head.ticket_id);
    INSERT INTO syncguard_locks AS l
            (key, lock_id, expires_at_ms, acquired_at_ms, fence, user_key, waiters, owner,
             grant_expires_at_ms, granted_to)
        VALUES (p_key, v_head.lock_id,
                least(v_expires, p_now + v_head.grant_window_ms - p_tolerance_ms), p_now,
                lpad(v_fence::text, {{ fence_digits }}, '0'), v_head.user_key, v_more,
                v_head.owner, v_expires, v_head.ticket_id)
        ON CONFLICT (key) DO UPDATE SET lock_id = excluded.lock_id,
            expires_at_ms = excluded.expires_at_ms, acquired_at_ms = excluded.acquired_at_ms,
            fence = excluded.fence, user_key = excluded.user_key, waiters = excluded.waiters,
            owner = excluded.owner, grant_expires_at_ms = excluded.grant_expires_at_ms,
            granted_to = excluded.granted_to
        WHERE l.expires_at_ms <= p_now - p_tolerance_ms;
    IF NOT FOUND THEN
        RETURN NULL;  -- a live lock holds the key: nothing to hand over
    END IF;
    INSERT INTO syncguard_fence_counters AS c (fence_key, fence, waiters, acquired_at_ms)
        VALUES (v_head.fence_key, v_fence, v_more, p_now)
        ON CONFLICT (fence_key) DO UPDATE SET
            fence = excluded.fence,
            acquired_at_ms = excluded.acquired_at_ms,
            waiters = excluded.waiters;
    DELETE FROM syncguard_waiters w WHERE w.key = p_key AND w.ticket_id = v_head.ticket_id;
    PERFORM set_config('synchronous_commit', 'on', true);
    v_channel := syncguard_channel(p_key);
    v_grant := v_head.ticket_id || ' ' || v_head.lock_id || ' ' || v_fence || ' ' || v_expires;
    IF v_head.process_channel IS NULL THEN
        PERFORM pg_notify(v_channel, v_grant);
        RETURN v_head.ticket_id;
    END IF;
    PERFORM pg_notify(v_head.process_channel, 'g ' || v_grant || ' ' || v_channel);
    IF p_watched THEN
        RETURN v_head.ticket_id;
    END IF;
    SELECT w.ticket_id, w.process_channel INTO v_next FROM syncguard_waiters w
        WHERE w.key = p_key AND w.live_until_ms > p_now ORDER BY w.arrival LIMIT 1;
    IF NOT FOUND THEN
        RETURN v_head.ticket_id;
    END IF;
    IF v_next.process_channel IS NULL THEN
        PERFORM pg_notify(v_channel, v_grant);
    ELSE
        PERFORM pg_notify(v_next.process_channel, 'n ' || v_next.ticket_id || ' ' || v_channel);
    END IF;
    RETURN v_head.ticket_id;
END;
$$;
DROP FUNCTION IF EXISTS syncguard_hand_over(text, bigint, bigint, boolean, boolean);
