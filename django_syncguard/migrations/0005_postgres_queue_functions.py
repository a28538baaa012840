# PostgreSQL only: the acquire, release and withdraw of fair, notified waiting (see
# django_syncguard/waiting.py and specs/backends/database.md, Queues and wake-ups).
# Still one statement per operation. The reverse restores migration 0002's functions.

from importlib import import_module

from django.db import migrations

# Migration 0002's definitions, which the reverse puts back.
_previous = import_module("django_syncguard.migrations.0002_postgres_functions")

# The channel a key's wake-ups are sent on: a hash of its storage key, so that any key
# fits PostgreSQL's 63-byte identifiers. django_syncguard.backends.database.wakeups
# computes the same name (channel_name) to LISTEN on it.
CHANNEL_FUNCTION = """
CREATE OR REPLACE FUNCTION syncguard_channel(p_key text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT 'syncguard_' || left(encode(sha256(convert_to(p_key, 'UTF8')), 'hex'), 40)
$$;
"""

# Acquire with an optional wait ticket (p_ticket, kept p_patience_ms). Two flags keep
# the queue off the uncontended path: syncguard_fence_counters.waiters (the key may
# have tickets; read with the counter, in the first statement) and
# syncguard_locks.waiters (a release must look for a waiter to wake). Neither is ever
# false while the key has tickets; both may stay true after they left. Under the key's
# advisory lock, as in 0002:
#   1. read the key's lock row, its fence counter and the counter's flag, in one
#      statement;
#   2. a live lock: without a ticket, status 0. With one, read the row again FOR KEY
#      SHARE: a release deleting it right now makes us wait for its commit (then the
#      key is free, go on at 3), and a release that comes after waits for ours, so it
#      sees our ticket and the row's flag, which we set if it was not;
#   3. a free key whose counter flag is set: drop the tickets past their
#      live_until_ms and find the first one by arrival. Someone else's ticket first:
#      status 0 (3b). Without the flag, the queue is not read at all;
#   3b. not taking it, with a ticket: insert it (arrival from a sequence) or renew its
#      live_until_ms (a ticket already queued and live keeps its arrival; one that was
#      dropped as stale comes back at the end), set the counter's flag if it was not,
#      and return o_position = live tickets ahead;
#   4-6. as in 0002 (overflow, insert or replace, counter); both flags of the new lock
#      say whether other tickets remain, and the caller's ticket leaves the queue.
ACQUIRE_FUNCTION = """
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
    PERFORM pg_advisory_xact_lock(1937337447, hashtext(p_key));
    v_now := floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint;
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
            VALUES (p_key, p_lock_id, o_expires_at_ms, v_now, lpad(o_fence::text, 15, '0'),
                    p_user_key, v_more);
    ELSE
        UPDATE syncguard_locks l SET lock_id = p_lock_id, expires_at_ms = o_expires_at_ms,
            acquired_at_ms = v_now, fence = lpad(o_fence::text, 15, '0'), user_key = p_user_key,
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
"""

# 0002's seven-argument acquire, for code deployed before this migration: the same
# answers (three columns), and the queue is respected (no ticket: a free key is taken
# only when nobody waits).
LEGACY_ACQUIRE_FUNCTION = """
CREATE OR REPLACE FUNCTION syncguard_acquire(
    p_key text, p_fence_key text, p_lock_id text, p_ttl_ms bigint,
    p_user_key text, p_max_fence bigint, p_tolerance_ms bigint,
    OUT o_status smallint, OUT o_fence bigint, OUT o_expires_at_ms bigint
) LANGUAGE sql AS $$
    SELECT a.o_status, a.o_fence, a.o_expires_at_ms FROM syncguard_acquire(
        p_key, p_fence_key, p_lock_id, p_ttl_ms, p_user_key, p_max_fence, p_tolerance_ms,
        NULL::text, NULL::bigint) a
$$;
"""

# Release: 0002's delete and statuses, then, when the deleted lock's flag says a waiter
# may be queued, NOTIFY the first live ticket of its key (payload: the ticket id).
# pg_notify is transactional: the waiter hears it once the release has committed, never
# before. The DELETE's row lock pairs with acquire's FOR KEY SHARE read (step 2 above):
# the flag and the ticket of a waiter queued while the lock was held are always seen
# here. An uncontended release is the one statement of 0002; nothing is sent when
# nobody waits.
RELEASE_FUNCTION = """
CREATE OR REPLACE FUNCTION syncguard_release(p_lock_id text, p_tolerance_ms bigint)
RETURNS smallint
LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint;
    v_key text;
    v_waiters boolean;
    v_head text;
BEGIN
    DELETE FROM syncguard_locks
        WHERE lock_id = p_lock_id AND expires_at_ms > v_now - p_tolerance_ms
        RETURNING key, waiters INTO v_key, v_waiters;
    IF NOT FOUND THEN
        PERFORM 1 FROM syncguard_locks WHERE lock_id = p_lock_id;
        RETURN CASE WHEN FOUND THEN 2 ELSE 0 END;
    END IF;
    IF NOT v_waiters THEN
        RETURN 1;
    END IF;
    SELECT w.ticket_id INTO v_head FROM syncguard_waiters w
        WHERE w.key = v_key AND w.live_until_ms > v_now ORDER BY w.arrival LIMIT 1;
    IF FOUND THEN
        PERFORM pg_notify(syncguard_channel(v_key), v_head);
    END IF;
    RETURN 1;
END;
$$;
"""

# Withdraw: a waiter gives up its place. When its ticket was there and the key is free,
# NOTIFY the new first live ticket. The advisory lock orders it with acquire; the
# FOR KEY SHARE read orders it with a release (as in acquire, step 2).
WITHDRAW_FUNCTION = """
CREATE OR REPLACE FUNCTION syncguard_withdraw(
    p_key text, p_ticket text, p_tolerance_ms bigint
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint;
    v_head text;
BEGIN
    PERFORM pg_advisory_xact_lock(1937337447, hashtext(p_key));
    DELETE FROM syncguard_waiters w WHERE w.key = p_key AND w.ticket_id = p_ticket;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_now := floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint;
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
"""

CREATE = (
    "CREATE SEQUENCE IF NOT EXISTS syncguard_waiters_arrival AS bigint;"
    + CHANNEL_FUNCTION
    + ACQUIRE_FUNCTION
    + LEGACY_ACQUIRE_FUNCTION
    + RELEASE_FUNCTION
    + WITHDRAW_FUNCTION
)

REVERSE = (
    """
DROP FUNCTION IF EXISTS syncguard_withdraw(text, text, bigint);
DROP FUNCTION IF EXISTS syncguard_acquire(text, text, text, bigint, text, bigint, bigint);
DROP FUNCTION IF EXISTS
    syncguard_acquire(text, text, text, bigint, text, bigint, bigint, text, bigint);
DROP FUNCTION IF EXISTS syncguard_channel(text);
DROP SEQUENCE IF EXISTS syncguard_waiters_arrival;
"""
    + _previous.ACQUIRE_FUNCTION
    + _previous.RELEASE_FUNCTION
)


def _postgres_only(sql):
    def run(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(sql)

    return run


class Migration(migrations.Migration):
    dependencies = [("django_syncguard", "0004_waiters")]

    operations = [
        migrations.RunPython(_postgres_only(CREATE), _postgres_only(REVERSE)),
    ]
