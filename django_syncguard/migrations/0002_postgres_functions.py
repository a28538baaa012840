# PostgreSQL-only parts of the database backend's schema. A migration of its own:
# Django creates some indexes from deferred SQL at the end of a migration, so they
# only exist once 0001 has finished.

from django.db import migrations

# The acquire operation of the database backend on PostgreSQL, in one round trip.
# Under a transaction-scoped advisory lock on the storage key, concurrent acquirers
# of one key (including first acquirers of a key that has no counter row yet) run
# one after the other, and each reads what the previous one committed:
#   1. read the key's lock row and fence counter in one statement;
#   2. a live lock -> status 0 (contention), nothing written;
#   3. the next fence above p_max_fence -> status 2 (overflow), nothing written;
#   4. insert the lock, or replace the expired one; the replacement re-checks expiry,
#      so an extend that committed meanwhile (extend takes no advisory lock) is never
#      overwritten (status 0);
#   5. only then store the new counter value -> status 1.
# Only acquire inserts rows, and only under this advisory lock, so plain INSERTs
# cannot meet a conflicting row. Time is clock_timestamp(): the moment of the call,
# not the start of the transaction.
ACQUIRE_FUNCTION = """
CREATE OR REPLACE FUNCTION syncguard_acquire(
    p_key text, p_fence_key text, p_lock_id text, p_ttl_ms bigint,
    p_user_key text, p_max_fence bigint, p_tolerance_ms bigint,
    OUT o_status smallint, OUT o_fence bigint, OUT o_expires_at_ms bigint
) LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint;
    v_expires bigint;
    v_last bigint;
BEGIN
    o_status := 0;  -- contention unless we get through
    PERFORM pg_advisory_xact_lock(1937337447, hashtext(p_key));
    v_now := floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint;
    SELECT (SELECT l.expires_at_ms FROM syncguard_locks l WHERE l.key = p_key),
           (SELECT c.fence FROM syncguard_fence_counters c WHERE c.fence_key = p_fence_key)
        INTO v_expires, v_last;
    IF v_expires > v_now - p_tolerance_ms THEN
        RETURN;
    END IF;
    o_fence := coalesce(v_last, 0) + 1;
    IF o_fence > p_max_fence THEN
        o_status := 2;
        o_fence := NULL;
        RETURN;
    END IF;
    o_expires_at_ms := v_now + p_ttl_ms;
    IF v_expires IS NULL THEN
        INSERT INTO syncguard_locks (key, lock_id, expires_at_ms, acquired_at_ms, fence, user_key)
            VALUES (p_key, p_lock_id, o_expires_at_ms, v_now, lpad(o_fence::text, 15, '0'),
                    p_user_key);
    ELSE
        UPDATE syncguard_locks l SET lock_id = p_lock_id, expires_at_ms = o_expires_at_ms,
            acquired_at_ms = v_now, fence = lpad(o_fence::text, 15, '0'), user_key = p_user_key
            WHERE l.key = p_key AND l.expires_at_ms <= v_now - p_tolerance_ms;
        IF NOT FOUND THEN
            o_fence := NULL;
            o_expires_at_ms := NULL;
            RETURN;
        END IF;
    END IF;
    IF v_last IS NULL THEN
        INSERT INTO syncguard_fence_counters (fence_key, fence) VALUES (p_fence_key, o_fence);
    ELSE
        UPDATE syncguard_fence_counters c SET fence = o_fence WHERE c.fence_key = p_fence_key;
    END IF;
    o_status := 1;
END;
$$;
"""


# Release and extend: resolve the lock id, require the row to be live and delete or
# renew it, in one statement inside the function (the row lock of DELETE/UPDATE
# makes the check and the write atomic). Status 1: done; 2: the row exists but is no
# longer live ("expired"); 0: no such lock id ("not-found"). As functions, their
# plans are cached per session without protocol-level prepared statements, which
# keeps them safe behind pgbouncer's transaction pooling.
RELEASE_FUNCTION = """
CREATE OR REPLACE FUNCTION syncguard_release(p_lock_id text, p_tolerance_ms bigint)
RETURNS smallint
LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint;
BEGIN
    DELETE FROM syncguard_locks
        WHERE lock_id = p_lock_id AND expires_at_ms > v_now - p_tolerance_ms;
    IF FOUND THEN
        RETURN 1;
    END IF;
    PERFORM 1 FROM syncguard_locks WHERE lock_id = p_lock_id;
    RETURN CASE WHEN FOUND THEN 2 ELSE 0 END;
END;
$$;
"""

EXTEND_FUNCTION = """
CREATE OR REPLACE FUNCTION syncguard_extend(
    p_lock_id text, p_ttl_ms bigint, p_tolerance_ms bigint,
    OUT o_status smallint, OUT o_expires_at_ms bigint
) LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint;
BEGIN
    UPDATE syncguard_locks l SET expires_at_ms = v_now + p_ttl_ms
        WHERE l.lock_id = p_lock_id AND l.expires_at_ms > v_now - p_tolerance_ms;
    IF FOUND THEN
        o_status := 1;
        o_expires_at_ms := v_now + p_ttl_ms;
        RETURN;
    END IF;
    PERFORM 1 FROM syncguard_locks l WHERE l.lock_id = p_lock_id;
    o_status := CASE WHEN FOUND THEN 2 ELSE 0 END;
END;
$$;
"""

CREATE_FUNCTIONS = ACQUIRE_FUNCTION + RELEASE_FUNCTION + EXTEND_FUNCTION

DROP_FUNCTIONS = """
DROP FUNCTION IF EXISTS syncguard_acquire(text, text, text, bigint, text, bigint, bigint);
DROP FUNCTION IF EXISTS syncguard_release(text, bigint);
DROP FUNCTION IF EXISTS syncguard_extend(text, bigint, bigint);
"""


def _postgres_only(sql):
    def run(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(sql)

    return run


def _drop_like_indexes(apps, schema_editor):
    # Django adds varchar/text_pattern_ops ("_like") indexes for LIKE queries on
    # PostgreSQL. Lock operations only ever compare keys for equality: the extra
    # indexes would cost memory and write time per lock for nothing.
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema() "
            "AND tablename IN ('syncguard_locks', 'syncguard_fence_counters') "
            "AND indexname LIKE '%%\\_like'"
        )
        names = [row[0] for row in cursor.fetchall()]
    for name in names:
        schema_editor.execute(f'DROP INDEX IF EXISTS "{name}"')


class Migration(migrations.Migration):
    dependencies = [("django_syncguard", "0001_initial")]

    operations = [
        migrations.RunPython(_drop_like_indexes, migrations.RunPython.noop),
        migrations.RunPython(_postgres_only(CREATE_FUNCTIONS), _postgres_only(DROP_FUNCTIONS)),
    ]
