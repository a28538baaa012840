"""What the owner label (``OPTIONS["RECORD_OWNER"]``) costs per held lock.

    .venv/bin/python bench/owners_memory.py [--locks 20000]

Starts a throw-away ``redis-server`` and PostgreSQL (Debian's packages) on loopback
ports and, with the label recorded and without it:

- Redis: ``MEMORY USAGE`` (all samples) of one held lock's keys, the lock hash and its
  lock-id index key; and ``used_memory`` per lock over ``--locks`` held locks on
  distinct keys (as ``bench/redis_locks.py`` measures it);
- PostgreSQL: ``pg_column_size`` of one lock row, and bytes per held lock over
  ``--locks`` locks (rows, indexes and counters; as ``bench/postgres_locks.py``).

The label is the one this process writes (``HOST:PID thread:MainThread -``); its
length is printed beside the numbers. The issue's bar: a held lock costs at most its
figure without the label plus the label's bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import create_bench_database, machine  # noqa: E402
from bench.postgres_locks import memory_per_lock, setup_django  # noqa: E402
from tests.support.servers import PostgresServer, RedisServer  # noqa: E402

TTL_MS = 3_600_000


def redis_costs(url: str, count: int, record: bool) -> tuple[int, float, str | None]:
    """(MEMORY USAGE of one lock's two keys, used_memory per lock, the label)."""
    import redis

    from django_syncguard.backends.redis import RedisBackend

    client = redis.Redis.from_url(url)
    backend = RedisBackend("memory", {"LOCATION": url, "OPTIONS": {"RECORD_OWNER": record}})
    client.flushall()
    one = backend.acquire("invoice:0000000", TTL_MS)
    assert one.ok and one.lock_id is not None
    info = backend.lookup(key="invoice:0000000")
    assert info is not None
    usage = sum(
        int(client.memory_usage(name, samples=0) or 0)
        for name in ("syncguard:invoice:0000000", f"syncguard#id:{one.lock_id}")
    )
    client.flushall()
    before = int(client.info("memory")["used_memory"])
    for n in range(count):
        assert backend.acquire(f"invoice:{n:07d}", TTL_MS).ok
    per_lock = (int(client.info("memory")["used_memory"]) - before) / count
    client.flushall()
    backend.close()
    return usage, per_lock, info.owner


def postgres_costs(port: int, count: int, record: bool) -> tuple[int, float, float]:
    """(pg_column_size of one lock row, bytes per lock by the main forks, by
    pg_total_relation_size): ``bench/postgres_locks.py``'s measure, with the option."""
    from django.db import connection

    per_lock, _, total = memory_per_lock(port, count, {"RECORD_OWNER": record})
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_column_size(l.*) FROM syncguard_locks l WHERE key = 'invoice:0000000'"
        )
        row = int(cursor.fetchone()[0])
    return row, per_lock, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--locks", type=int, default=20_000, help="held locks per measure")
    args = parser.parse_args()
    print(f"# Owner labels: memory per held lock\n\n{machine()}; {args.locks:,} locks.\n")
    server = RedisServer().start()
    try:
        print("## Redis\n")
        for record in (False, True):
            usage, per_lock, label = redis_costs(server.url, args.locks, record)
            size = len(label.encode()) if label else 0
            print(
                f"- RECORD_OWNER={record}: MEMORY USAGE of one lock's hash + index key "
                f"{usage} B; used_memory {per_lock:.0f} B per lock; label {size} B {label!r}"
            )
    finally:
        server.destroy()
    pg = PostgresServer().start()
    try:
        create_bench_database(pg.port)
        setup_django(pg.port)
        from django.core.management import call_command

        call_command("migrate", "django_syncguard", verbosity=0)
        print("\n## PostgreSQL\n")
        for record in (False, True):
            row, main_forks, total = postgres_costs(pg.port, args.locks, record)
            print(
                f"- RECORD_OWNER={record}: pg_column_size of a lock row {row} B; "
                f"{main_forks:.0f} B per lock (rows, indexes, counter; {total:.0f} B by "
                "pg_total_relation_size)"
            )
    finally:
        pg.destroy()


if __name__ == "__main__":
    main()
