"""Admin inspector pages with 100,000 locks: ``list_locks`` time at each depth.

    .venv/bin/python bench/inspector_pages.py [--locks 100000] [--limit 100] [--repeat 30]

Starts a throw-away PostgreSQL and ``redis-server`` on free loopback ports (as the
other benchmarks do) and uses an SQLite file in a temporary directory. Each gets
``--locks`` live locks on keys ``scale:000001``..., written straight into the
backend's storage layout (one SQL statement; a server-side Lua loop on Redis), then:

- the first page, a page in the middle (after half the locks) and the last page are
  each timed ``--repeat`` times, interleaved, as an operator paging through the admin
  inspector would get them (``list_locks(cursor=..., limit=--limit)``, cursors taken
  from a walk of every page);
- ``walk``: every page from the first to the last, once;
- ``prefix``: the first page of a key prefix that only the last 100 locks have, for
  context: the prefix is a filter, not a range (see the report's notes).

PostgreSQL is measured twice: right after the bulk load, before any ``ANALYZE``
(autovacuum is kept off the table meanwhile), and once the table has statistics, as
autovacuum gives any table that has grown like this.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    configure_django,
    create_bench_database,
    machine,
    postgres_database,
)
from tests.support.servers import PostgresServer, RedisServer  # noqa: E402

HOUR_MS = 3_600_000
PREFIX_TAIL = 100  # locks that share the rare prefix, at the end of the key order

PG_FILL = f"""
INSERT INTO syncguard_locks (key, lock_id, expires_at_ms, acquired_at_ms, fence, user_key)
SELECT 'scale:' || lpad(g::text, 6, '0'), 'L' || lpad(g::text, 21, '0'), %s + {HOUR_MS}, %s,
       lpad(g::text, 15, '0'), NULL
FROM generate_series(1, %s) AS s(g)
"""

LITE_FILL = f"""
WITH RECURSIVE s(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM s WHERE g < %s)
INSERT INTO syncguard_locks (key, lock_id, expires_at_ms, acquired_at_ms, fence, user_key)
SELECT 'scale:' || printf('%%06d', g), 'L' || printf('%%021d', g), %s + {HOUR_MS}, %s,
       printf('%%015d', g), NULL
FROM s
"""

# Rows ARGV[1]..ARGV[2]: the lock hash and its lock-id index key, as the backend
# writes them. ARGV[3] prefix, ARGV[4] now ms, ARGV[5] an hour in ms.
REDIS_FILL = """
local prefix, now, hour = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
for n = tonumber(ARGV[1]), tonumber(ARGV[2]) do
  local name = prefix .. ':scale:' .. string.format('%06d', n)
  local lock_id = 'L' .. string.format('%021d', n)
  redis.call('HSET', name, 'f', n, 'i', lock_id, 'e', now + hour, 'a', now)
  redis.call('SET', prefix .. '#id:' .. lock_id, name, 'PX', hour)
end
return 0
"""


def setup_django(pg_port: int, sqlite_path: str) -> None:
    lite = {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": sqlite_path,
        "OPTIONS": {"init_command": "PRAGMA journal_mode=WAL;"},
    }
    configure_django({"default": postgres_database(pg_port), "lite": lite})


def execute(backend: Any, sql: str, params: list[Any]) -> None:
    with backend.connection().cursor() as cursor:
        cursor.execute(sql, params)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.2f}"


def measure(backend: Any, limit: int, repeat: int, prefix: str) -> dict[str, Any]:
    """Walk every page, then time the first, middle and last pages (interleaved)."""
    cursors: list[str | None] = [None]
    started = time.perf_counter()
    listed = 0
    while True:
        page = backend.list_locks(cursor=cursors[-1], limit=limit)
        listed += len(page.records)
        if page.next_cursor is None:
            break
        cursors.append(page.next_cursor)
    walk = time.perf_counter() - started
    depths = {
        "first": cursors[0],
        "middle": cursors[len(cursors) // 2],
        "last": cursors[-1],
    }
    samples: dict[str, list[float]] = {name: [] for name in (*depths, "prefix")}
    calls: dict[str, Callable[[], Any]] = {
        name: (lambda c=cursor: backend.list_locks(cursor=c, limit=limit))
        for name, cursor in depths.items()
    }
    calls["prefix"] = lambda: backend.list_locks(prefix=prefix, limit=limit)
    for _ in range(repeat):
        for name, call in calls.items():
            t = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - t)
    prefix_page = backend.list_locks(prefix=prefix, limit=limit)
    return {
        "pages": len(cursors),
        "listed": listed,
        "walk": walk,
        "median": {name: statistics.median(v) for name, v in samples.items()},
        "p90": {name: statistics.quantiles(v, n=10)[-1] for name, v in samples.items()},
        "prefix_found": len(prefix_page.records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--locks", type=int, default=100_000)
    parser.add_argument("--limit", type=int, default=100, help="page size (the admin's is 100)")
    parser.add_argument("--repeat", type=int, default=30, help="timings per page (2 or more)")
    args = parser.parse_args()
    if args.repeat < 2:
        parser.error("--repeat must be at least 2: each page reports a median and a p90")
    prefix = f"scale:{(args.locks - PREFIX_TAIL + 1) // 100:04d}"  # e.g. scale:0999

    pg = PostgresServer().start()
    rs = RedisServer().start()
    tmp = tempfile.mkdtemp(prefix="syncguard-bench-")
    try:
        import redis

        pg_version = create_bench_database(pg.port)
        setup_django(pg.port, os.path.join(tmp, "bench.sqlite3"))
        from django.core.management import call_command

        from django_syncguard.backends.database import DatabaseBackend
        from django_syncguard.backends.redis import RedisBackend

        for alias in ("default", "lite"):
            call_command("migrate", "django_syncguard", database=alias, verbosity=0)

        rows: list[tuple[str, dict[str, Any]]] = []

        postgres = DatabaseBackend("pg", {"OPTIONS": {"DATABASE": "default"}})
        execute(postgres, "ALTER TABLE syncguard_locks SET (autovacuum_enabled = false)", [])
        now = postgres.now_ms()
        execute(postgres, PG_FILL, [now, now, args.locks])
        rows.append(
            ("PostgreSQL, no statistics yet", measure(postgres, args.limit, args.repeat, prefix))
        )
        execute(postgres, "ANALYZE syncguard_locks", [])
        execute(postgres, "ALTER TABLE syncguard_locks RESET (autovacuum_enabled)", [])
        rows.append(("PostgreSQL, analyzed", measure(postgres, args.limit, args.repeat, prefix)))

        sqlite = DatabaseBackend("lite", {"OPTIONS": {"DATABASE": "lite"}})
        now = sqlite.now_ms()
        execute(sqlite, LITE_FILL, [args.locks, now, now])
        rows.append(("SQLite", measure(sqlite, args.limit, args.repeat, prefix)))

        backend = RedisBackend("bench", {"LOCATION": rs.url})
        now = backend.now_ms()
        for first in range(1, args.locks + 1, 10_000):
            last = min(first + 9_999, args.locks)
            backend.client.eval(REDIS_FILL, 0, first, last, backend.prefix, now, HOUR_MS)
        rows.append(("Redis", measure(backend, args.limit, args.repeat, prefix)))
        redis_version = redis.Redis.from_url(rs.url).info("server")["redis_version"]

        print(
            f"# Admin inspector pages\n\n{machine()}; PostgreSQL {pg_version}, "
            f"redis-server {redis_version} and SQLite on 127.0.0.1 / a local file; "
            f"{args.locks:,} live locks; pages of {args.limit}; median (p90) of "
            f"{args.repeat} timings per page, in ms."
        )
        print(
            "\n| backend | first page | middle page | last page | pages | walk, all pages, s "
            "| rare prefix, first page (locks found) |"
        )
        print("|---|---|---|---|---|---|---|")
        for name, r in rows:
            cells = [
                f"{ms(r['median'][d])} ({ms(r['p90'][d])})" for d in ("first", "middle", "last")
            ]
            print(
                f"| {name} | {' | '.join(cells)} | {r['pages']:,} | {r['walk']:.2f} | "
                f"{ms(r['median']['prefix'])} ({r['prefix_found']}) |"
            )
            assert r["listed"] >= args.locks, (name, r["listed"])
        print(
            f"\nThe rare prefix is `{prefix}` ({PREFIX_TAIL} locks, last in key order). "
            "Redis pages (SCAN order) may hold more than the page size, and a prefix page "
            "stops after 20 SCAN calls with what it found."
        )
    finally:
        rs.destroy()
        pg.destroy()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    os.environ.pop("DJANGO_SETTINGS_MODULE", None)
    main()
