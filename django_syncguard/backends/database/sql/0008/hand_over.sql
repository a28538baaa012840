-- syncguard_hand_over: the key p_key has just become free (a release deleted its lock,
-- a withdrawal gave a grant back, an attempt found a lease that ran out or a grant that
-- lapsed); give it to the first live waiter. The caller holds the key's advisory lock
-- whenever p_grant is true, so no acquire, withdrawal or cleanup of the key interleaves.
--   With p_grant and a grant record on the first ticket (written by its acquire, see
--   acquire.sql), the lock is written for that ticket exactly as its acquire would
--   write it: its lock id, ttl, owner and user key, the next fence (above the key's
--   counter and the fence floor, in clock mode at least the server's now), plus
--   granted_to = the ticket and grant_expires_at_ms = the expiry its holder is told.
--   Until the waiter's process claims it (syncguard_claim), expires_at_ms holds the
--   claim deadline minus the tolerance (now + window - tolerance, or the real expiry if
--   that comes first): every reader that judges liveness by "expires_at_ms > now -
--   tolerance" then sees the grant gone at its deadline, with no tolerance, and no
--   reader needs to know about grants. The ticket leaves the queue, the counter moves
--   to the fence, synchronous_commit is set back to 'on' for this transaction (a
--   release statement sets it off before calling: the fence written here must survive
--   a crash, as an acquire's does), and NOTIFY carries '<ticket> <lock id> <fence>
--   <expires>'.
--   Otherwise (no p_grant, no record: a waiter of a version before grants, or a fence
--   that would pass p's maximum) the ticket is only woken: NOTIFY '<ticket>'.
-- p_queueing: the caller is about to queue a ticket of its own (an acquire attempt),
-- so the key's waiters flags must stay set.
CREATE OR REPLACE FUNCTION syncguard_hand_over(
    p_key text, p_now bigint, p_tolerance_ms bigint, p_grant boolean, p_queueing boolean
) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_head record;
    v_fence bigint;
    v_expires bigint;
    v_more boolean;
BEGIN
    SELECT * INTO v_head FROM syncguard_waiters w
        WHERE w.key = p_key AND w.live_until_ms > p_now ORDER BY w.arrival LIMIT 1;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF NOT p_grant OR v_head.grant_window_ms IS NULL THEN
        PERFORM pg_notify(syncguard_channel(p_key), v_head.ticket_id);
        RETURN false;
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
        RETURN false;
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
        RETURN false;  -- a live lock holds the key: nothing to hand over
    END IF;
    INSERT INTO syncguard_fence_counters AS c (fence_key, fence, waiters, acquired_at_ms)
        VALUES (v_head.fence_key, v_fence, v_more, p_now)
        ON CONFLICT (fence_key) DO UPDATE SET
            fence = excluded.fence,
            acquired_at_ms = excluded.acquired_at_ms,
            waiters = excluded.waiters;
    DELETE FROM syncguard_waiters w WHERE w.key = p_key AND w.ticket_id = v_head.ticket_id;
    PERFORM set_config('synchronous_commit', 'on', true);
    PERFORM pg_notify(syncguard_channel(p_key),
                      v_head.ticket_id || ' ' || v_head.lock_id || ' ' || v_fence || ' ' || v_expires);
    RETURN true;
END;
$$;
