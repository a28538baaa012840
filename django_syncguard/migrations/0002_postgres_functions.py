# PostgreSQL-only parts of the database backend's schema. A migration of its own:
# Django creates some indexes from deferred SQL at the end of a migration, so they
# only exist once 0001 has finished.

from django.db import migrations

# The acquire operation of the database backend on PostgreSQL, in one round trip.
# Under a transaction-scoped advisory lock on the storage key (so concurrent
# acquirers of one key, including first acquirers of a key with no counter row yet,
# run one after the other):
#   1. a live lock on the key -> status 0 (contention), nothing written;
#   2. the next fence above p_max_fence -> status 2 (overflow), nothing written;
#   3. insert the lock, or replace an expired one; the replacement re-checks expiry
#      so an extend that committed meanwhile is never overwritten (status 0);
#   4. only then store the new counter value -> status 1.
# Time is clock_timestamp(): the moment of the call, not of the transaction start.
ACQUIRE_FUNCTION = """
CREATE OR REPLACE FUNCTION syncguard_acquire(
    p_key text, p_fence_key text, p_lock_id text, p_ttl_ms bigint,
    p_user_key text, p_max_fence bigint, p_tolerance_ms bigint
) RETURNS TABLE (status smallint, fence bigint, expires_at_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint;
    v_expires bigint;
    v_fence bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(1937337447, hashtext(p_key));
    v_now := floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint;
    SELECT l.expires_at_ms INTO v_expires FROM syncguard_locks l WHERE l.key = p_key;
    IF FOUND AND v_expires > v_now - p_tolerance_ms THEN
        RETURN QUERY SELECT 0::smallint, NULL::bigint, NULL::bigint;
        RETURN;
    END IF;
    SELECT c.fence + 1 INTO v_fence FROM syncguard_fence_counters c
        WHERE c.fence_key = p_fence_key;
    IF NOT FOUND THEN
        v_fence := 1;
    END IF;
    IF v_fence > p_max_fence THEN
        RETURN QUERY SELECT 2::smallint, NULL::bigint, NULL::bigint;
        RETURN;
    END IF;
    INSERT INTO syncguard_locks AS l
        (key, lock_id, expires_at_ms, acquired_at_ms, fence, user_key)
        VALUES (p_key, p_lock_id, v_now + p_ttl_ms, v_now, lpad(v_fence::text, 15, '0'),
                p_user_key)
        ON CONFLICT (key) DO UPDATE SET
            lock_id = EXCLUDED.lock_id,
            expires_at_ms = EXCLUDED.expires_at_ms,
            acquired_at_ms = EXCLUDED.acquired_at_ms,
            fence = EXCLUDED.fence,
            user_key = EXCLUDED.user_key
        WHERE l.expires_at_ms <= v_now - p_tolerance_ms;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 0::smallint, NULL::bigint, NULL::bigint;
        RETURN;
    END IF;
    INSERT INTO syncguard_fence_counters AS c (fence_key, fence) VALUES (p_fence_key, v_fence)
        ON CONFLICT (fence_key) DO UPDATE SET fence = EXCLUDED.fence;
    RETURN QUERY SELECT 1::smallint, v_fence, v_now + p_ttl_ms;
END;
$$;
"""

DROP_ACQUIRE_FUNCTION = (
    "DROP FUNCTION IF EXISTS syncguard_acquire(text, text, text, bigint, text, bigint, bigint);"
)


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
        migrations.RunPython(
            _postgres_only(ACQUIRE_FUNCTION), _postgres_only(DROP_ACQUIRE_FUNCTION)
        ),
    ]
