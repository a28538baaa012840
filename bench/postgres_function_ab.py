"""The PL/pgSQL acquire and release of two revisions, side by side, cycle by cycle.

    .venv/bin/python bench/postgres_function_ab.py --before e39f7d5 [--cycles 20000] [--durable]

Starts a throw-away PostgreSQL 15, migrates one database with the migrations of the
``--before`` revision (``git archive`` into a temporary directory) and another with this
working tree's, then makes uncontended acquire + release cycles on distinct keys, one
client, alternating the two databases at each cycle (in turn first), on 64 keys used
in turn (as the distinct-keys clients of ``bench/postgres_locks.py``), with each
revision's own statements, sent as the backend sends them (psycopg, server-side
binding, unprepared). What it measures is the functions' cost and nothing else: no
Django, no lock ids checked, no Python of either revision. By default the server runs
without fsync (the functions' own time shows); ``--durable`` keeps PostgreSQL's
durable defaults, as ``bench/postgres_locks.py`` does.

Runs differ more than cycles within a run (each database has its own pages, plans
and autovacuum timing): on this project's 2-core machine, ``--before HEAD`` (the same
functions on both sides) gave ratios from 0.96 to 1.13. Run it several times and
compare the spread, not one ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.servers import PostgresServer  # noqa: E402

MIGRATE = """
import sys
sys.path.insert(0, {root!r})
import django
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["django_syncguard"],
    DATABASES={{"default": {{"ENGINE": "django.db.backends.postgresql", "NAME": {name!r},
        "USER": "postgres", "HOST": "127.0.0.1", "PORT": {port}}}}},
)
django.setup()
from django.core.management import call_command
call_command("migrate", "django_syncguard", verbosity=0)
"""

RELEASE = "SELECT syncguard_release(%s, %s)"


def acquire_sql(connection) -> tuple[str, int]:
    """The revision's acquire call: the widest ``syncguard_acquire`` it installed."""
    nargs = connection.execute(
        "SELECT max(pronargs) FROM pg_proc WHERE proname = 'syncguard_acquire'"
    ).fetchone()[0]
    return f"SELECT * FROM syncguard_acquire({', '.join(['%s'] * nargs)})", nargs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="a git revision of this repository")
    parser.add_argument("--cycles", type=int, default=20_000)
    parser.add_argument("--durable", action="store_true", help="fsync and synchronous_commit on")
    args = parser.parse_args()

    fast = ("fsync=off", "synchronous_commit=off", "full_page_writes=off")
    server = PostgresServer(settings=() if args.durable else fast).start()
    try:
        import psycopg

        admin = psycopg.connect(
            host="127.0.0.1", port=server.port, user="postgres", dbname="postgres", autocommit=True
        )
        with tempfile.TemporaryDirectory() as before_tree:
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", args.before],
                capture_output=True,
                check=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", before_tree], input=archive, check=True)
            for name, tree in (("before", before_tree), ("after", str(ROOT))):
                admin.execute(f'CREATE DATABASE "{name}"')
                code = MIGRATE.format(root=tree, name=name, port=server.port)
                subprocess.run([sys.executable, "-c", code], check=True, cwd=tempfile.gettempdir())
        cursors, calls = {}, {}
        for name in ("before", "after"):
            conn = psycopg.connect(
                host="127.0.0.1", port=server.port, user="postgres", dbname=name, autocommit=True
            )
            calls[name] = acquire_sql(conn)
            cursors[name] = psycopg.Cursor(conn)

        def cycle(name: str, n: int) -> tuple[float, float]:
            sql, nargs = calls[name]
            key, lock_id = f"invoice:{n % 64}", uuid.uuid4().hex[:22]
            params = [key, f"fence:{key}", lock_id, 30_000, None, 900_000_000_000_000, 1000]
            params += [None] * (nargs - len(params))  # no wait ticket
            cursor = cursors[name]
            start = time.perf_counter_ns()
            cursor.execute(sql, params)
            assert cursor.fetchone()[0] == 1
            acquired = time.perf_counter_ns()
            cursor.execute(RELEASE, [lock_id, 1000])
            assert cursor.fetchone()[0] == 1
            released = time.perf_counter_ns()
            return (acquired - start) / 1000, (released - acquired) / 1000

        for name in cursors:  # warm up: plans cached, pages in memory
            for n in range(1_000):
                cycle(name, n)
        samples: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
        for n in range(args.cycles):
            for name in ("before", "after") if n % 2 else ("after", "before"):
                samples[name].append(cycle(name, n))
        print(
            f"{args.cycles:,} cycles per revision, one client, 64 keys in turn, "
            f"{'durable' if args.durable else 'fsync off'}; p50 in µs\n"
        )
        print("| revision | acquire | release | cycle |\n|---|---|---|---|")
        medians = {}
        for name, rows in samples.items():
            acquire = statistics.median(a for a, _ in rows)
            release = statistics.median(r for _, r in rows)
            medians[name] = statistics.median(a + r for a, r in rows)
            label = args.before if name == "before" else "working tree"
            print(f"| {label} | {acquire:.1f} | {release:.1f} | {medians[name]:.1f} |")
        print(f"\nafter / before, per cycle: {medians['after'] / medians['before']:.3f}")
    finally:
        server.destroy()


if __name__ == "__main__":
    main()
