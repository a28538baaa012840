"""Acquire+release cycles on PostgreSQL: our backend next to its floor and its peers.

    .venv/bin/python bench/postgres_locks.py [--seconds 2] [--memory-locks 20000] [--prepared]

Starts a throw-away PostgreSQL 15 with its default (durable) settings on a free
loopback port, and measures, side by side against that one server:

- ``syncguard``: ``DatabaseBackend.acquire`` + ``release`` (one statement each);
- ``floor``: two autocommit single-row writes, an expiry-aware upsert and a delete:
  the least a durable lock with expiry can cost (no fence, no lock id index);
- ``seeds``: the specification's transaction pattern (advisory lock, SELECT ... FOR
  UPDATE, two-step fence increment, upsert; release by SELECT ... FOR UPDATE +
  DELETE), statement by statement;
- ``advisory``: ``pg_try_advisory_lock`` / ``pg_advisory_unlock`` (django-pglocks'
  method), for context: it writes nothing, has no fence and no expiry, and a lock
  dies with its connection.

Each for 1 client, 8 threads and 4 processes, on distinct keys and one shared key.
Then the memory one held lock costs (rows, indexes, its fence counter).

Every method sends its statements the same way, so the ratios compare like with
like: by default as Django does out of the box (no prepared statements: each
statement is parsed and planned by the server every time); with ``--prepared``,
every connection prepares its statements on first use (psycopg's
``prepare_threshold=0``; for our backend, that option on the ``DATABASES`` alias).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    MethodFactory,
    configure_django,
    create_bench_database,
    machine,
    postgres_database,
    print_table,
    run_selected,
)
from tests.support.servers import PostgresServer  # noqa: E402

#: Set (to anything) when every method prepares its statements; an environment
#: variable so that the client processes of a run inherit it.
PREPARED_ENV = "SYNCGUARD_BENCH_PG_PREPARED"

NOW_MS = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"

PEER_TABLES = """
CREATE TABLE IF NOT EXISTS bench_floor (
    key text PRIMARY KEY, lock_id text NOT NULL, expires_at_ms bigint NOT NULL);
CREATE TABLE IF NOT EXISTS bench_seed_locks (
    key text PRIMARY KEY, lock_id text NOT NULL UNIQUE, expires_at_ms bigint NOT NULL,
    acquired_at_ms bigint NOT NULL, fence text NOT NULL, user_key text NOT NULL);
CREATE INDEX IF NOT EXISTS bench_seed_locks_expires ON bench_seed_locks (expires_at_ms);
CREATE TABLE IF NOT EXISTS bench_seed_fences (
    fence_key text PRIMARY KEY, fence bigint NOT NULL DEFAULT 0);
"""


def prepare_threshold() -> int | None:
    """psycopg's ``prepare_threshold`` for every connection of this run."""
    return 0 if os.environ.get(PREPARED_ENV) else None


def statements() -> str:
    """How this run sends statements, for the report."""
    if os.environ.get(PREPARED_ENV):
        return "every connection prepares its statements (prepare_threshold=0)"
    return "no prepared statements, as Django's default (prepare_threshold=None)"


def dsn(port: int) -> dict[str, Any]:
    return {"host": "127.0.0.1", "port": port, "user": "postgres", "dbname": "bench"}


def setup_django(port: int) -> None:
    configure_django({"default": postgres_database(port, prepare_threshold=prepare_threshold())})


# ------------------------------------------------------------------ methods
def syncguard(port: int) -> MethodFactory:
    setup_django(port)
    from django_syncguard.backends.database import DatabaseBackend

    backend = DatabaseBackend("bench", {"OPTIONS": {"DATABASE": "default"}})

    def factory(client: int):
        def acquire(key: str):
            result = backend.acquire(key, 30_000)
            return result.lock_id if result.ok else None

        def release(lock_id: str) -> None:
            backend.release(lock_id)

        return acquire, release

    return factory


def syncguard_durable_release(port: int) -> MethodFactory:
    """Our backend with a release that waits for its WAL flush (as before issue 24):
    the same connection, function and arguments, with the release's local
    ``synchronous_commit = off`` undone in the same statement."""
    setup_django(port)
    from django_syncguard.backends.database import DatabaseBackend
    from django_syncguard.backends.database.operations import fetch_value
    from django_syncguard.constants import TIME_TOLERANCE_MS

    backend = DatabaseBackend("bench-durable", {"OPTIONS": {"DATABASE": "default"}})
    # (0009: the function sets 'off' itself, first; the 'on' after the call undoes it)
    durable = (
        "SELECT syncguard_release(%s, %s, true, false), "
        "set_config('synchronous_commit', 'on', true)"
    )

    def factory(client: int):
        def acquire(key: str):
            result = backend.acquire(key, 30_000)
            return result.lock_id if result.ok else None

        def release(lock_id: str) -> None:
            params = [lock_id, TIME_TOLERANCE_MS]
            backend.ops.run(lambda c: fetch_value(c, durable, params))

        return acquire, release

    return factory


def _connection(port: int):
    import psycopg

    return psycopg.connect(**dsn(port), autocommit=True, prepare_threshold=prepare_threshold())


def floor(port: int) -> MethodFactory:
    from django_syncguard.keys import generate_lock_id

    def factory(client: int):
        conn = _connection(port)

        def acquire(key: str):
            lock_id = generate_lock_id()
            now = time.time_ns() // 1_000_000
            row = conn.execute(
                "INSERT INTO bench_floor AS f VALUES (%s, %s, %s) ON CONFLICT (key) DO UPDATE "
                "SET lock_id = EXCLUDED.lock_id, expires_at_ms = EXCLUDED.expires_at_ms "
                "WHERE f.expires_at_ms <= %s RETURNING 1",
                (key, lock_id, now + 30_000, now),
            ).fetchone()
            return (key, lock_id) if row else None

        def release(token) -> None:
            conn.execute("DELETE FROM bench_floor WHERE key = %s AND lock_id = %s", token)

        return acquire, release

    return factory


def seeds(port: int) -> MethodFactory:
    from django_syncguard.keys import generate_lock_id

    def factory(client: int):
        conn = _connection(port)

        def acquire(key: str):
            lock_id = generate_lock_id()
            with conn.transaction():
                now = conn.execute(f"SELECT {NOW_MS}").fetchone()[0]
                conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (key,))
                row = conn.execute(
                    "SELECT expires_at_ms FROM bench_seed_locks WHERE key = %s FOR UPDATE", (key,)
                ).fetchone()
                if row and row[0] > now - 1000:
                    return None
                conn.execute(
                    "INSERT INTO bench_seed_fences (fence_key, fence) VALUES (%s, 0) "
                    "ON CONFLICT (fence_key) DO NOTHING",
                    (f"fence:{key}",),
                )
                fence = conn.execute(
                    "UPDATE bench_seed_fences SET fence = fence + 1 WHERE fence_key = %s "
                    "RETURNING fence",
                    (f"fence:{key}",),
                ).fetchone()[0]
                conn.execute(
                    "INSERT INTO bench_seed_locks VALUES (%s, %s, %s, %s, %s, %s) "
                    "ON CONFLICT (key) DO UPDATE SET lock_id = EXCLUDED.lock_id, "
                    "expires_at_ms = EXCLUDED.expires_at_ms, "
                    "acquired_at_ms = EXCLUDED.acquired_at_ms, "
                    "fence = EXCLUDED.fence, user_key = EXCLUDED.user_key",
                    (key, lock_id, now + 30_000, now, f"{fence:015d}", key),
                )
            return lock_id

        def release(lock_id: str) -> None:
            with conn.transaction():
                now = conn.execute(f"SELECT {NOW_MS}").fetchone()[0]
                row = conn.execute(
                    "SELECT key, lock_id, expires_at_ms FROM bench_seed_locks "
                    "WHERE lock_id = %s FOR UPDATE",
                    (lock_id,),
                ).fetchone()
                if row and row[1] == lock_id and row[2] > now - 1000:
                    conn.execute("DELETE FROM bench_seed_locks WHERE key = %s", (row[0],))

        return acquire, release

    return factory


def advisory(port: int) -> MethodFactory:
    def factory(client: int):
        conn = _connection(port)

        def acquire(key: str):
            got = conn.execute("SELECT pg_try_advisory_lock(hashtext(%s))", (key,)).fetchone()[0]
            return key if got else None

        def release(key: str) -> None:
            conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (key,))

        return acquire, release

    return factory


METHODS = {
    "syncguard": syncguard,
    "durable-release": syncguard_durable_release,
    "floor": floor,
    "seeds": seeds,
    "advisory": advisory,
}


# ------------------------------------------------------------------- memory
def memory_per_lock(
    port: int, count: int, options: dict[str, Any] | None = None
) -> tuple[float, dict[str, int], float]:
    """Bytes one held lock adds: (by the main forks of the tables and their indexes,
    that sum by relation, by ``pg_total_relation_size`` of the two tables).

    The total also counts what the main forks do not: the free-space and visibility
    maps VACUUM creates, and TOAST (empty here). Both are measured from tables emptied
    by ``TRUNCATE`` + ``VACUUM FULL`` to the same tables holding ``count`` locks on
    distinct keys after a plain ``VACUUM`` (acquire only inserts: no dead rows to
    reclaim, the maps are written). ``options`` are more of the backend's OPTIONS;
    the locks stay held (for an hour) for the caller to inspect.
    """
    setup_django(port)
    from django.db import connection

    from django_syncguard.backends.database import DatabaseBackend

    backend = DatabaseBackend("memory", {"OPTIONS": {"DATABASE": "default", **(options or {})}})
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE syncguard_locks, syncguard_fence_counters")
        cursor.execute("VACUUM FULL syncguard_locks")
        cursor.execute("VACUUM FULL syncguard_fence_counters")
        before, total_before = _sizes(cursor), _total_size(cursor)
    for n in range(count):
        assert backend.acquire(f"invoice:{n:07d}", 3_600_000).ok
    backend.close()
    with connection.cursor() as cursor:
        cursor.execute("VACUUM syncguard_locks")
        cursor.execute("VACUUM syncguard_fence_counters")
        after, total_after = _sizes(cursor), _total_size(cursor)
    delta = {name: after[name] - before[name] for name in after}
    return sum(delta.values()) / count, delta, (total_after - total_before) / count


def _sizes(cursor) -> dict[str, int]:
    cursor.execute(
        "SELECT c.relname, pg_relation_size(c.oid) FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public' "
        "AND c.relname LIKE 'syncguard%%'"
    )
    return dict(cursor.fetchall())


def _total_size(cursor) -> int:
    cursor.execute(
        "SELECT pg_total_relation_size('syncguard_locks') "
        "+ pg_total_relation_size('syncguard_fence_counters')"
    )
    return int(cursor.fetchone()[0])


# --------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per method and scenario")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleave the methods this many times per scenario (cancels drift)",
    )
    parser.add_argument("--memory-locks", type=int, default=20_000, help="0 skips it")
    parser.add_argument("--modes", default="1 client,8 threads,4 processes")
    parser.add_argument(
        "--interleaved",
        type=int,
        metavar="CYCLES",
        help="instead of --modes: one client, every method in turn at each of CYCLES steps",
    )
    parser.add_argument(
        "--prepared", action="store_true", help="every method prepares its statements"
    )
    args = parser.parse_args()
    if args.prepared:
        os.environ[PREPARED_ENV] = "1"

    server = PostgresServer(settings=()).start()  # durable defaults: fsync, synchronous_commit
    try:
        import psycopg

        create_bench_database(server.port)
        setup_django(server.port)
        from django.core.management import call_command

        call_command("migrate", "django_syncguard", verbosity=0)
        with _connection(server.port) as conn:
            conn.execute(PEER_TABLES, prepare=False)

        rows, how = run_selected(METHODS, server.port, args)
        print(
            f"# PostgreSQL lock benchmark\n\n{machine()}; PostgreSQL 15 on 127.0.0.1, "
            f"default settings (fsync on, synchronous_commit on); {how}; "
            f"psycopg {psycopg.__version__}; {statements()}."
        )
        print_table("acquire + release cycles", rows, args.seconds, baseline="floor", also="seeds")
        if not args.memory_locks:
            return
        per_lock, delta, total = memory_per_lock(server.port, args.memory_locks)
        print(
            f"\n## memory\n\n{args.memory_locks:,} held locks on distinct keys: "
            f"{per_lock:.0f} bytes per lock (rows, indexes and fence counter; "
            f"{total:.0f} B by pg_total_relation_size, with the free-space and visibility "
            "maps), by relation:"
        )
        for name, size in sorted(delta.items()):
            print(f"- {name}: {size / args.memory_locks:.0f} B")
    finally:
        server.destroy()


if __name__ == "__main__":
    os.environ.pop("DJANGO_SETTINGS_MODULE", None)
    main()
