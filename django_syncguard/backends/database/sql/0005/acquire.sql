-- syncguard_acquire, nine arguments: acquire with an optional wait ticket (p_ticket,
-- kept p_patience_ms). Two flags keep the queue off the uncontended path:
-- syncguard_fence_counters.waiters (the key may have tickets; read with the counter,
-- in the first statement) and syncguard_locks.waiters (a release must look for a
-- waiter to wake). Neither is ever false while the key has tickets; both may stay true
-- after they left. Under the key's advisory lock, as in 0002:
--   1. read the key's lock row, its fence counter and the counter's flag, in one
--      statement;
--   2. a live lock: without a ticket, status 0. With one, read the row again FOR KEY
--      SHARE: a release deleting it right now makes us wait for its commit (then the
--      key is free, go on at 3), and a release that comes after waits for ours, so it
--      sees our ticket and the row's flag, which we set if it was not;
--   3. a free key whose counter flag is set: drop the tickets past their
--      live_until_ms and find the first one by arrival. Someone else's ticket first:
--      status 0 (3b). Without the flag, the queue is not read at all;
--   3b. not taking it, with a ticket: insert it (arrival from a sequence) or renew its
--      live_until_ms (a ticket already queued and live keeps its arrival; one that was
--      dropped as stale comes back at the end), set the counter's flag if it was not,
--      and return o_position = live tickets ahead;
--   4-6. as in 0002 (overflow, insert or replace, counter); both flags of the new lock
--      say whether other tickets remain, and the caller's ticket leaves the queue.
-- The same queue rule, in Python, is django_syncguard.waiting.queue_admits (memory and
-- SQLite); tests/test_database_sql_files.py runs one script through both.
CREATE OR REPLACE FUNCTION syncguard_acquire(
    p_key text, p_fence_key text, p_lock_id text, p_ttl_ms bigint,
    p_user_key text, p_max_fence bigint, p_tolerance_ms bigint,
    p_ticket text, p_patience_ms bigint,
    OUT o_status smallint, OUT o_fence bigint, OUT o_expires_at_ms bigint,
    OUT o_position integer
) LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint;
    v_expires bigint;
    v_last bigint;
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
    SELECT l.expires_at_ms, c.fence, coalesce(c.waiters, false)
        INTO v_expires, v_last, v_queued
        FROM (SELECT) AS one
        LEFT JOIN syncguard_locks l ON l.key = p_key
        LEFT JOIN syncguard_fence_counters c ON c.fence_key = p_fence_key;
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
                UPDATE syncguard_fence_counters c SET waiters = true
                    WHERE c.fence_key = p_fence_key;
            END IF;
            SELECT count(*) INTO o_position FROM syncguard_waiters w
                WHERE w.key = p_key AND w.arrival < v_arrival AND w.live_until_ms > v_now;
        END IF;
        RETURN;
    END IF;
    o_fence := coalesce(v_last, 0) + 1;
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
    IF v_last IS NULL THEN
        INSERT INTO syncguard_fence_counters (fence_key, fence) VALUES (p_fence_key, o_fence);
    ELSIF v_queued AND NOT v_more THEN
        UPDATE syncguard_fence_counters c SET fence = o_fence, waiters = false
            WHERE c.fence_key = p_fence_key;
    ELSE
        UPDATE syncguard_fence_counters c SET fence = o_fence WHERE c.fence_key = p_fence_key;
    END IF;
    IF v_head IS NOT NULL THEN
        DELETE FROM syncguard_waiters w WHERE w.key = p_key AND w.ticket_id = p_ticket;
    END IF;
    o_status := 1;
END;
$$;
