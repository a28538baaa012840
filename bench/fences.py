"""Fence continuity (issue 21): what compacting idle fence counters frees, and what
clock mode and a fence floor cost an acquire + release.

    .venv/bin/python bench/fences.py [--keys 1000000] [--sample 10000]
        [--batch-sizes 500,2000,10000] [--recent-every 10] [--seconds 5] [--rounds 5]
        [--modes "1 client,8 processes"] [--backends memory,redis,postgres]
        [--parts compaction,throughput] [--out bench/reports/<date>-fences.md]

Starts a throw-away ``redis-server`` (no persistence) and a PostgreSQL 15 with its
durable defaults (fsync, synchronous_commit) on free loopback ports
(``tests/support/servers.py``), one after the other, and measures in one run:

1. **Compaction** (Redis, PostgreSQL). ``--keys`` single-use keys' counters are
   *seeded* in bulk, exactly as the backend leaves a key after its one acquire and
   release (PostgreSQL: one ``INSERT ... SELECT generate_series`` into
   ``syncguard_fence_counters``; Redis: pipelined ``HSET P:<key> f <fence> a <ms>``),
   one key in ``--recent-every`` acquired now, the others 30 days ago. Then
   ``backend.compact_fences(idle_ms=7 days, batch_size=B)`` for each ``--batch-sizes``
   B, on a fresh seed each: storage before and after (PostgreSQL:
   ``pg_total_relation_size`` after a plain VACUUM and after VACUUM FULL; Redis:
   ``INFO memory`` ``used_memory`` over an empty server), seconds per 10,000 counters
   deleted, the time per batch in each of compaction's three steps, and the server
   work per batch (Redis: EVALSHA and SCAN calls; PostgreSQL: transactions, and scans
   of the two tables from ``pg_stat_user_tables``). First ``--sample`` keys go through
   real ``acquire`` + ``release`` next to as many seeded ones: one real and one
   seeded counter side by side, storage per counter of each, and a compaction that
   must delete both alike.
2. **Throughput** (memory as the control, Redis, PostgreSQL). Four cells per backend:
   counter mode without a floor (the baseline), clock mode without a floor, counter
   mode and clock mode with the floor raised to 10**6, each cell on a namespace of its
   own (memory: a store; Redis: a ``KEY_PREFIX``; PostgreSQL: a database per floor,
   the key names apart per mode). Each for ``--modes`` (memory: 1 client only) and
   two key patterns: *fresh*, a key never used before in every cycle (each cycle
   creates a counter: the single-use keys of part 1) and *hot*, one key for every
   client. The cells alternate in ``--rounds`` rounds (the order rotated each round),
   so drift of a shared machine hits them alike; cycles/s, p50/p99 of a whole cycle,
   the ratio to the baseline over the whole run and its range over the rounds.

Prints each table as it is measured and writes them, after the machine table of
``bench/report.py``, to ``--out``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import functools
import itertools
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    ClientPool,
    MethodFactory,
    Report,
    Sample,
    configure_django,
    create_bench_database,
    measure,
    parse_mode,
    percentile_us,
    postgres_database,
)

TTL_MS = 30_000
DAY_MS = 86_400_000
#: Compaction's ``idle_ms``; seeded keys that are not recent were acquired OLD_MS ago.
IDLE_MS = 7 * DAY_MS
OLD_MS = 30 * DAY_MS
#: The floor the floor cells raise (below the clock: clock mode still decides there).
FLOOR = 10**6
#: HSETs per pipeline when seeding Redis.
REDIS_CHUNK = 10_000
#: Threads that run the real sample's acquire + release cycles.
SAMPLE_THREADS = 4

#: cell -> (fence mode, floor raised); the first is the baseline of every ratio.
CELLS: dict[str, tuple[str, bool]] = {
    "counter": ("counter", False),
    "clock": ("clock", False),
    "counter+floor": ("counter", True),
    "clock+floor": ("clock", True),
}
BASELINE = "counter"
PATTERNS = ("fresh", "hot")
#: PostgreSQL: Django alias -> database. ``default`` holds part 1's counters.
PG_DATABASES = {"default": "bench_compact", "nofloor": "bench_nofloor", "floor": "bench_floor"}
NOW_MS = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"


@dataclass(frozen=True)
class Target:
    """Where a cell's backend lives: ``kind`` memory, redis (``location``: its URL)
    or postgres (``port``)."""

    kind: str
    location: str = ""
    port: int = 0


def setup_django(port: int) -> None:
    configure_django(
        {alias: postgres_database(port, name=name) for alias, name in PG_DATABASES.items()}
    )


# ------------------------------------------------------------- throughput
_backends: dict[tuple[Target, str], Any] = {}


def cell_backend(target: Target, cell: str) -> Any:
    """The cell's backend in this process, built once (a pool process keeps it between
    rounds, as a long-lived worker would; PostgreSQL keeps its connection)."""
    built = _backends.get((target, cell))
    if built is not None:
        return built
    mode, floor = CELLS[cell]
    name = "fences-" + cell.replace("+", "-")
    options: dict[str, Any] = {"FENCES": mode}
    backend: Any
    if target.kind == "memory":
        from django_syncguard.backends.memory import MemoryBackend

        backend = MemoryBackend(name, {"LOCATION": name, "OPTIONS": options})
    elif target.kind == "redis":
        from django_syncguard.backends.redis import RedisBackend

        params = {"LOCATION": target.location, "KEY_PREFIX": name, "OPTIONS": options}
        backend = RedisBackend(name, params)
    else:
        setup_django(target.port)
        from django_syncguard.backends.database import DatabaseBackend

        # The floor is one row per database: the floor cells share one, the others
        # another; their keys are apart by name.
        options["DATABASE"] = "floor" if floor else "nofloor"
        backend = DatabaseBackend(name, {"OPTIONS": options})
    if floor:
        backend.raise_fence_floor(FLOOR)  # never lowers: every process may call it
    _backends[(target, cell)] = backend
    return backend


def cell_method(cell: str, target: Target) -> MethodFactory:
    """``bench.common``'s method for one cell: the key ``shared`` becomes the cell's
    hot key; any other key a key never used before (the *fresh* pattern)."""
    from django_syncguard.keys import generate_lock_id

    backend = cell_backend(target, cell)
    slug = cell.replace("+", "-")

    def factory(client: int) -> tuple[Callable[[str], Any], Callable[[Any], None]]:
        run = generate_lock_id()[:8]  # a new factory never reuses an old one's keys
        numbers = itertools.count()

        def acquire(key: str) -> Any:
            name = f"{slug}:hot" if key == "shared" else f"{slug}:{run}:{client}:{next(numbers)}"
            result = backend.acquire(name, TTL_MS)
            return result.lock_id if result.ok else None

        return acquire, backend.release

    return factory


@dataclass
class Cell:
    mode: str
    pattern: str
    cell: str
    sample: Sample
    rates: list[float]  # cycles/s of each round


def run_cells(target: Target, modes: list[str], rounds: int, seconds: float) -> list[Cell]:
    """Every cell x mode x pattern; per mode and pattern the cells alternate, each
    ``seconds / rounds`` per round, the order rotated by one every round."""
    pools: dict[int, ClientPool] = {}
    cells: list[Cell] = []
    names = list(CELLS)
    try:
        for mode in modes:
            processes, _ = parse_mode(mode)
            if processes and processes not in pools:
                pools[processes] = ClientPool(processes)
            for pattern in PATTERNS:
                results = {c: Cell(mode, pattern, c, Sample(), []) for c in names}
                for number in range(rounds):
                    shift = number % len(names)
                    for cell in names[shift:] + names[:shift]:
                        sample = measure(
                            functools.partial(cell_method, cell, target),
                            mode,
                            pattern == "hot",
                            seconds / rounds,
                            pools.get(processes),
                        )
                        results[cell].sample.merge(sample)
                        results[cell].rates.append(sample.cycles / (seconds / rounds))
                cells += results.values()
    finally:
        for pool in pools.values():
            pool.close()
    return cells


def throughput_table(title: str, cells: list[Cell], seconds: float) -> list[str]:
    lines = [
        f"### {title}",
        "",
        "| clients | keys | cell | cycles/s | x counter | per-round x counter | cycle p50 µs "
        "| cycle p99 µs | attempts/s | errors |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    base = {(c.mode, c.pattern): c for c in cells if c.cell == BASELINE}
    for c in cells:
        b = base[(c.mode, c.pattern)]
        rate = c.sample.cycles / seconds
        ratio = rate / (b.sample.cycles / seconds) if b.sample.cycles else float("nan")
        per_round = [r / br for r, br in zip(c.rates, b.rates, strict=True) if br]
        spread = f"{min(per_round):.2f}-{max(per_round):.2f}" if per_round else "n/a"
        lines.append(
            f"| {c.mode} | {c.pattern} | {c.cell} | {rate:,.0f} | **{ratio:.2f}** | {spread} "
            f"| {percentile_us(c.sample.cycle_ns, 50):,.0f} "
            f"| {percentile_us(c.sample.cycle_ns, 99):,.0f} "
            f"| {c.sample.attempts / seconds:,.0f} | {c.sample.errors} |"
        )
    return lines


def ratio_summary(results: dict[str, list[Cell]], seconds: float) -> list[str]:
    """One line per backend, clients and keys: the baseline's cycles/s and every other
    cell's ratio to it."""
    others = [c for c in CELLS if c != BASELINE]
    lines = [
        "| backend | clients | keys | counter cycles/s | " + " | ".join(others) + " |",
        "|---|---|---|--:|" + "--:|" * len(others),
    ]
    for backend, cells in results.items():
        by = {(c.mode, c.pattern, c.cell): c for c in cells}
        for mode, pattern in dict.fromkeys((c.mode, c.pattern) for c in cells):
            base = by[(mode, pattern, BASELINE)].sample.cycles / seconds
            ratios = [by[(mode, pattern, o)].sample.cycles / seconds / base for o in others]
            lines.append(
                f"| {backend} | {mode} | {pattern} | {base:,.0f} | "
                + " | ".join(f"{r:.2f}" for r in ratios)
                + " |"
            )
    return lines


# ----------------------------------------------------------- compaction
def timed_hooks(backend: Any) -> dict[str, list[float]]:
    """Wrap the three steps compaction calls on ``backend`` (``fence_floors.compact``)
    so that each call's seconds are recorded: the page of idle counters, the floor
    raise, the guarded delete."""
    timings: dict[str, list[float]] = {"page": [], "floor": [], "delete": []}
    for attr, step in (
        ("_idle_counters", "page"),
        ("_raise_fence_floor", "floor"),
        ("_delete_idle_counters", "delete"),
    ):
        original = getattr(backend, attr)

        def timed(*args: Any, _original: Any = original, _step: str = step, **kw: Any) -> Any:
            started = time.perf_counter()
            try:
                return _original(*args, **kw)
            finally:
                timings[_step].append(time.perf_counter() - started)

        setattr(backend, attr, timed)
    return timings


def compact(backend: Any, idle_ms: int, batch_size: int) -> tuple[int, int, float]:
    """Run ``compact_fences`` to its end: (deleted, batches that deleted, seconds)."""
    started = time.perf_counter()
    batches = list(backend.compact_fences(idle_ms=idle_ms, batch_size=batch_size))
    return sum(batches), len(batches), time.perf_counter() - started


def real_cycles(backend: Any, name: str, count: int, width: int, *, release: bool = True) -> float:
    """``count`` keys ``<name>:<n>`` through one acquire and release each (or, without
    ``release``, held for an hour), in SAMPLE_THREADS threads; returns the seconds
    taken."""

    def run(numbers: range) -> None:
        for n in numbers:
            result = backend.acquire(f"{name}:{n:0{width}d}", 3_600_000 if not release else TTL_MS)
            assert result.ok, result
            if release:
                assert backend.release(result.lock_id).ok

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(SAMPLE_THREADS) as pool:
        step = -(-count // SAMPLE_THREADS)
        slices = [range(i, min(i + step, count)) for i in range(0, count, step)]
        for done in [pool.submit(run, numbers) for numbers in slices]:
            done.result()
    return time.perf_counter() - started


def recent_count(count: int, every: int) -> int:
    """How many of ``count`` seeded keys are recent: those with n % every == 0."""
    return -(-count // every)


@dataclass
class CompactionRun:
    """One compaction of a fresh seed; sizes in bytes."""

    batch_size: int
    seeded: int
    seed_s: float
    deleted: int
    batches: int
    seconds: float
    remaining: int
    before: int  # storage of the counters before (Redis: used_memory over empty)
    after: int  # after (PostgreSQL: after a plain VACUUM)
    after_full: int = 0  # PostgreSQL: after VACUUM FULL
    vacuum_s: float = 0.0
    full_s: float = 0.0
    steps: dict[str, list[float]] | None = None
    server: str = ""  # the server's work per batch, in words
    #: Seeded keys that were not recent but still have a counter after the run.
    old_left: int = 0
    #: What a second run, right after, deleted (run only when old counters were left).
    second_deleted: int = 0
    #: The counters ``before`` and ``after`` hold (0: ``seeded``, ``remaining``).
    before_n: int = 0
    after_n: int = 0


def compaction_table(runs: list[CompactionRun], postgres: bool) -> list[str]:
    head = (
        "| batch size | counters seeded | seeding s | deleted | left | of which old "
        "| a 2nd run deleted | batches | compaction s | **s per 10,000 deleted** "
        "| before: MiB | bytes/counter |"
    )
    rule = "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
    if postgres:
        head += (
            " after VACUUM: MiB | bytes/kept counter | VACUUM s | after VACUUM FULL: MiB "
            "| bytes/kept counter | VACUUM FULL s |"
        )
        rule += "--:|--:|--:|--:|--:|--:|"
    else:
        head += " after: MiB | bytes/kept counter |"
        rule += "--:|--:|"
    lines = [head, rule]
    for r in runs:
        per_10k = r.seconds / r.deleted * 10_000 if r.deleted else float("nan")
        before_n, after_n = r.before_n or r.seeded, max(r.after_n or r.remaining, 1)
        line = (
            f"| {r.batch_size:,} | {r.seeded:,} | {r.seed_s:.1f} | {r.deleted:,} "
            f"| {r.remaining:,} | {r.old_left:,} | {r.second_deleted:,} | {r.batches:,} "
            f"| {r.seconds:.1f} | **{per_10k:.2f}** "
            f"| {r.before / 2**20:,.1f} | {r.before / before_n:,.0f} "
            f"| {r.after / 2**20:,.1f} | {r.after / after_n:,.0f} |"
        )
        if postgres:
            line += (
                f" {r.vacuum_s:.1f} | {r.after_full / 2**20:,.1f} "
                f"| {r.after_full / after_n:,.0f} | {r.full_s:.1f} |"
            )
        lines.append(line)
    return lines


def steps_table(backend: str, runs: list[CompactionRun]) -> list[str]:
    lines = []
    for r in runs:
        steps = r.steps or {}
        cells = []
        for step in ("page", "floor", "delete"):
            values = steps.get(step, [])
            mean = sum(values) / len(values) * 1000 if values else float("nan")
            cells.append(f"{len(values):,} x {mean:,.1f}")
        lines.append(f"| {backend} | {r.batch_size:,} | " + " | ".join(cells) + f" | {r.server} |")
    return lines


# ------------------------------------------------------------------ Redis
def redis_used(client: Any) -> int:
    return int(client.info("memory")["used_memory"])


def redis_settled(client: Any, timeout_s: float = 10.0) -> int:
    """``used_memory`` once it stops changing (at most ``timeout_s``): after mass
    deletes the server shrinks its keyspace's hash table in its cron (10 times a
    second), a little later."""
    deadline = time.monotonic() + timeout_s
    last = redis_used(client)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = redis_used(client)
        if now == last:
            break
        last = now
    return last


def redis_calls(client: Any) -> dict[str, int]:
    """Calls per command so far (scripts' inner commands included)."""
    return {
        name.removeprefix("cmdstat_"): int(stats["calls"])
        for name, stats in client.info("commandstats").items()
    }


def seed_redis(
    client: Any, prefix: str, name: str, count: int, width: int, now_ms: int, every: int
) -> float:
    """Seed ``count`` released single-use keys ``<prefix>:<name>:<n>`` as the clock
    mode (Redis's default) leaves them: ``f`` = ``a`` = the acquisition's ms. Returns
    the seconds taken."""
    started = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for start in range(0, count, REDIS_CHUNK):
        for n in range(start, min(start + REDIS_CHUNK, count)):
            at = now_ms if n % every == 0 else now_ms - OLD_MS
            pipe.hset(f"{prefix}:{name}:{n:0{width}d}", mapping={"f": at, "a": at})
        pipe.execute()
    return time.perf_counter() - started


def redis_counters(client: Any, backend: Any, held: int = 0) -> int:
    """Lock hashes (each holds a counter): keys less the floor and the ``held``
    locks' lock-id index keys."""
    return int(client.dbsize()) - int(client.exists(backend.floor_key)) - held


def redis_compaction(url: str, args: argparse.Namespace, report: Report) -> list[CompactionRun]:
    import redis

    from django_syncguard.backends.redis import RedisBackend

    client = redis.Redis.from_url(url)
    width = max(7, len(str(max(args.keys, args.sample) - 1)))

    # -- the sample: real cycles next to seeded keys
    backend = RedisBackend("compact", {"LOCATION": url})
    # Warm up first (the threads' connections, the scripts), so that `used_memory`
    # deltas hold counters only; FLUSHALL keeps both.
    real_cycles(backend, "warm", SAMPLE_THREADS * 10, width)
    client.flushall()
    empty = redis_used(client)
    real_s = real_cycles(backend, "real", args.sample, width)
    after_real = redis_used(client)
    seed_s = seed_redis(
        client, backend.prefix, "seed", args.sample, width, backend.now_ms(), args.recent_every
    )
    after_seed = redis_used(client)
    shown = [
        f"{backend.prefix}:real:{0:0{width}d}",
        f"{backend.prefix}:seed:{0:0{width}d}",
        f"{backend.prefix}:seed:{1:0{width}d}",
    ]
    report(
        "### Redis: real and seeded counters",
        "",
        f"{args.sample:,} keys through `acquire` + `release` ({SAMPLE_THREADS} threads, "
        f"{real_s:.1f} s), then {args.sample:,} seeded keys (pipelined HSET, {seed_s:.2f} s):",
        "",
        "| key | how | hash after release (HGETALL) | encoding | MEMORY USAGE bytes |",
        "|---|---|---|---|--:|",
    )
    for name, how in zip(shown, ("real", "seeded, recent", "seeded, old"), strict=True):
        fields = {k.decode(): v.decode() for k, v in client.hgetall(name).items()}
        encoding = client.object("encoding", name)
        report(
            f"| `{name}` | {how} | `{fields}` | {encoding.decode()} | {client.memory_usage(name)} |"
        )
    deleted, _, _ = compact(backend, 0, 1000)
    report(
        "",
        f"`used_memory` per counter: real {(after_real - empty) / args.sample:.1f} bytes, "
        f"seeded {(after_seed - after_real) / args.sample:.1f} bytes. "
        f"`compact_fences(idle_ms=0)` then deleted {deleted:,} of the {2 * args.sample:,} "
        f"(left: {redis_counters(client, backend):,} counters).",
        "",
    )
    backend.close()

    runs = []
    expected_kept = recent_count(args.keys, args.recent_every) + args.held
    for batch_size in args.batch_sizes:
        client.flushall()
        backend = RedisBackend("compact", {"LOCATION": url})
        real_cycles(backend, "held", args.held, width, release=False)
        empty = redis_used(client)  # the held locks included
        seed_s = seed_redis(
            client, backend.prefix, "k", args.keys, width, backend.now_ms(), args.recent_every
        )
        before = redis_used(client) - empty
        steps = timed_hooks(backend)
        calls = redis_calls(client)
        deleted, batches, seconds = compact(backend, IDLE_MS, batch_size)
        after_calls = redis_calls(client)
        right_after = redis_used(client) - empty
        after = redis_settled(client) - empty
        remaining = redis_counters(client, backend, args.held)
        n = max(len(steps["page"]), 1)
        second = compact(backend, IDLE_MS, batch_size)[0] if remaining > expected_kept else 0

        def per_batch(*names: str, _a: Any = after_calls, _c: Any = calls, _n: int = n) -> float:
            return sum(_a.get(x, 0) - _c.get(x, 0) for x in names) / _n

        server = (
            f"{per_batch('evalsha', 'eval'):.1f} EVALSHA + {per_batch('scan'):.1f} SCAN; inside "
            f"the scripts {per_batch('hmget'):,.0f} HMGET + {per_batch('del'):,.0f} DEL"
        )
        runs.append(
            CompactionRun(
                batch_size,
                args.keys,
                seed_s,
                deleted,
                batches,
                seconds,
                remaining,
                before,
                after,
                steps=steps,
                server=server,
                old_left=remaining - expected_kept,
                second_deleted=second,
                before_n=args.keys,
                after_n=remaining - args.held,
            )
        )
        report(
            f"- batch size {batch_size:,}: deleted {deleted:,} in {seconds:.1f} s, "
            f"{remaining:,} left ({remaining - expected_kept:,} of them old; a second run "
            f"deleted {second:,}); {before / args.keys:.0f} -> "
            f"{right_after / max(remaining - args.held, 1):.0f} (right after) / "
            f"{after / max(remaining - args.held, 1):.0f} (settled) bytes per counter"
        )
        backend.close()
    client.flushall()
    report(
        "",
        "### Redis: compacting seeded single-use keys",
        "",
        f"`used_memory` over the server holding {args.held:,} live locks on other keys "
        f"(acquired for an hour, kept by compaction), with {args.keys:,} released keys "
        f"seeded, then after `compact_fences(idle_ms={IDLE_MS:,}, batch_size=B)` (once "
        f"`used_memory` stopped changing: the server shrinks its keyspace's table in its "
        f"cron), per seeded counter; 1 key in {args.recent_every} was acquired now and "
        "must be kept. "
        "*Left*: seeded counters and the held locks' hashes after the run; *of which old*: "
        "counters idle for 30 days that the run did not delete; *a 2nd run deleted*: what "
        "the same call, made again right after, deleted of those.",
        "",
        *compaction_table(runs, postgres=False),
        "",
    )
    return runs


# ------------------------------------------------------------- PostgreSQL
def pg_admin(port: int) -> Any:
    import psycopg

    return psycopg.connect(
        host="127.0.0.1",
        port=port,
        user="postgres",
        dbname=PG_DATABASES["default"],
        autocommit=True,
    )


def pg_value(conn: Any, sql: str, params: Any = None) -> Any:
    row = conn.execute(sql, params).fetchone()
    return row[0] if row else None


def pg_size(conn: Any) -> int:
    return int(pg_value(conn, "SELECT pg_total_relation_size('syncguard_fence_counters')"))


def pg_counters(conn: Any) -> int:
    """Counter rows, the floor row aside."""
    sql = "SELECT count(*) FROM syncguard_fence_counters WHERE fence_key LIKE 'fence:%'"
    return int(pg_value(conn, sql))


def pg_empty(conn: Any) -> None:
    conn.execute("TRUNCATE syncguard_fence_counters, syncguard_locks")
    conn.execute("VACUUM FULL syncguard_fence_counters")
    conn.execute("VACUUM FULL syncguard_locks")


def seed_postgres(conn: Any, name: str, count: int, width: int, every: int) -> float:
    """Seed ``count`` released single-use keys ``<name>:<n>`` as counter mode (the
    database backend's default) leaves them: fence 1, ``acquired_at_ms`` the
    acquisition's ms, no waiters; the fence key is ``fence:`` + the key (its unhashed
    form, ``keys.fence_key_of``). Returns the seconds taken."""
    started = time.perf_counter()
    conn.execute(
        "INSERT INTO syncguard_fence_counters (fence_key, fence, acquired_at_ms) "
        "SELECT 'fence:' || %(name)s || ':' || lpad(n::text, %(width)s, '0'), 1, "
        "CASE WHEN n %% %(every)s = 0 THEN t.now_ms ELSE t.now_ms - %(old)s END "
        f"FROM generate_series(0, %(count)s - 1) AS n, (SELECT {NOW_MS} AS now_ms) AS t",
        {"name": name, "width": width, "every": every, "old": OLD_MS, "count": count},
    )
    return time.perf_counter() - started


TABLES = ("syncguard_fence_counters", "syncguard_locks")


def pg_stats(conn: Any) -> dict[str, Any]:
    """Scan counters of the two tables and the database's transactions so far."""
    rows = conn.execute(
        "SELECT relname, seq_scan, seq_tup_read, coalesce(idx_scan, 0), "
        "coalesce(idx_tup_fetch, 0), n_tup_del FROM pg_stat_user_tables "
        "WHERE relname = ANY(%s)",
        [list(TABLES)],
    ).fetchall()
    stats: dict[str, Any] = {row[0]: row[1:] for row in rows}
    stats["xact"] = int(
        pg_value(
            conn,
            "SELECT xact_commit + xact_rollback FROM pg_stat_database "
            "WHERE datname = current_database()",
        )
    )
    return stats


def pg_stats_after(conn: Any, before: dict[str, Any], deleted: int) -> dict[str, Any]:
    """``pg_stats`` once the compaction's own statistics have arrived: a backend
    flushes them when idle, at most once a second, so wait (at most 30 s) until the
    deletes show."""
    deadline = time.monotonic() + 30
    while True:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        stats = pg_stats(conn)
        seen = stats["syncguard_fence_counters"][4] - before["syncguard_fence_counters"][4]
        if seen >= deleted or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def postgres_compaction(port: int, args: argparse.Namespace, report: Report) -> list[CompactionRun]:
    setup_django(port)
    from django_syncguard.backends.database import DatabaseBackend

    width = max(7, len(str(max(args.keys, args.sample) - 1)))
    conn = pg_admin(port)

    # -- the sample: real cycles next to seeded keys
    pg_empty(conn)
    backend = DatabaseBackend("compact", {"OPTIONS": {"DATABASE": "default"}})
    empty = pg_size(conn)
    real_s = real_cycles(backend, "real", args.sample, width)
    conn.execute("VACUUM syncguard_fence_counters")
    after_real = pg_size(conn)
    seed_s = seed_postgres(conn, "seed", args.sample, width, args.recent_every)
    conn.execute("VACUUM syncguard_fence_counters")
    after_seed = pg_size(conn)
    shown = [f"fence:real:{0:0{width}d}", f"fence:seed:{0:0{width}d}", f"fence:seed:{1:0{width}d}"]
    report(
        "### PostgreSQL: real and seeded counters",
        "",
        f"{args.sample:,} keys through `acquire` + `release` ({SAMPLE_THREADS} threads, "
        f"{real_s:.1f} s), then {args.sample:,} seeded keys (one INSERT ... SELECT "
        f"generate_series, {seed_s:.2f} s):",
        "",
        "| how | row of `syncguard_fence_counters` | pg_column_size(row) |",
        "|---|---|--:|",
    )
    for name, how in zip(shown, ("real", "seeded, recent", "seeded, old"), strict=True):
        row = conn.execute(
            "SELECT row_to_json(c)::text, pg_column_size(c.*) FROM syncguard_fence_counters c "
            "WHERE fence_key = %s",
            [name],
        ).fetchone()
        report(f"| {how} | `{row[0] if row else None}` | {row[1] if row else ''} |")
    locks = int(pg_value(conn, "SELECT count(*) FROM syncguard_locks"))
    deleted, _, _ = compact(backend, 0, 1000)
    report(
        "",
        f"`pg_total_relation_size` per counter after VACUUM: real "
        f"{(after_real - empty) / args.sample:.1f} bytes, seeded "
        f"{(after_seed - after_real) / args.sample:.1f} bytes; lock rows left after the "
        f"releases: {locks}. `compact_fences(idle_ms=0)` then deleted {deleted:,} of the "
        f"{2 * args.sample:,} (left: {pg_counters(conn):,} counters).",
        "",
    )
    backend.close()

    runs = []
    expected_kept = recent_count(args.keys, args.recent_every) + args.held
    for batch_size in args.batch_sizes:
        pg_empty(conn)
        backend = DatabaseBackend("compact", {"OPTIONS": {"DATABASE": "default"}})
        real_cycles(backend, "held", args.held, width, release=False)
        seed_s = seed_postgres(conn, "k", args.keys, width, args.recent_every)
        # VACUUM (ANALYZE): the visibility map written and statistics taken, as
        # autovacuum would have done on tables that grew over months.
        conn.execute("VACUUM (ANALYZE) syncguard_fence_counters")
        conn.execute("VACUUM (ANALYZE) syncguard_locks")
        before = pg_size(conn)
        steps = timed_hooks(backend)
        stats = pg_stats(conn)
        deleted, batches, seconds = compact(backend, IDLE_MS, batch_size)
        stats_after = pg_stats_after(conn, stats, deleted)
        remaining = pg_counters(conn)
        started = time.perf_counter()
        conn.execute("VACUUM syncguard_fence_counters")
        vacuum_s = time.perf_counter() - started
        after = pg_size(conn)
        started = time.perf_counter()
        conn.execute("VACUUM FULL syncguard_fence_counters")
        full_s = time.perf_counter() - started
        after_full = pg_size(conn)
        second = compact(backend, IDLE_MS, batch_size)[0] if remaining > expected_kept else 0
        backend.close()
        n = max(len(steps["page"]), 1)
        work = []
        for table, short in zip(TABLES, ("counters", "locks"), strict=True):
            seq, seq_rows, idx, idx_rows = (
                (stats_after[table][j] - stats[table][j]) / n for j in range(4)
            )
            work.append(
                f"{short}: {seq:.1f} seq scans ({seq_rows:,.0f} rows), {idx:,.1f} index "
                f"scans ({idx_rows:,.0f} rows)"
            )
        server = f"{(stats_after['xact'] - stats['xact']) / n:.1f} transactions; " + "; ".join(work)
        runs.append(
            CompactionRun(
                batch_size,
                args.keys,
                seed_s,
                deleted,
                batches,
                seconds,
                remaining,
                before,
                after,
                after_full,
                vacuum_s,
                full_s,
                steps,
                server,
                remaining - expected_kept,
                second,
                args.keys + args.held,
                remaining,
            )
        )
        report(
            f"- batch size {batch_size:,}: deleted {deleted:,} in {seconds:.1f} s, "
            f"{remaining:,} left; {before / (args.keys + args.held):.0f} -> "
            f"{after / max(remaining, 1):.0f} "
            f"(VACUUM) / {after_full / max(remaining, 1):.0f} (VACUUM FULL) bytes per counter"
        )
    pg_empty(conn)
    conn.close()
    report(
        "",
        "### PostgreSQL: compacting seeded single-use keys",
        "",
        f"`pg_total_relation_size('syncguard_fence_counters')` (heap, primary key index, "
        f"maps) with {args.keys:,} released keys seeded next to the counters of "
        f"{args.held:,} live locks on other keys (acquired for an hour, kept by "
        f"compaction), after `VACUUM (ANALYZE)` of both tables; then after "
        f"`compact_fences(idle_ms={IDLE_MS:,}, batch_size=B)` and a plain `VACUUM`, and "
        f"after `VACUUM FULL`; 1 key in {args.recent_every} was acquired now and must be "
        "kept. Bytes per counter: the size over the counters the table holds. Columns as "
        "in the Redis table.",
        "",
        *compaction_table(runs, postgres=True),
        "",
    )
    return runs


# ------------------------------------------------------------------- main
@dataclass
class Server:
    title: str
    target: Target
    line: str
    stop: Callable[[], None]


def start(kind: str) -> Server:
    from tests.support.servers import PostgresServer, RedisServer

    if kind == "memory":
        return Server("memory", Target("memory"), "", lambda: None)
    if kind == "redis":
        import redis

        server = RedisServer().start()
        version = redis.Redis.from_url(server.url).info("server")["redis_version"]
        line = f"redis-server {version} on 127.0.0.1, no persistence; redis-py {redis.__version__}"
        return Server("Redis", Target("redis", location=server.url), line, server.destroy)
    import psycopg

    pg = PostgresServer(settings=()).start()  # durable defaults: fsync, synchronous_commit
    try:
        version = ""
        for name in PG_DATABASES.values():
            version = create_bench_database(pg.port, name)
        setup_django(pg.port)
        from django.core.management import call_command

        for alias in PG_DATABASES:
            call_command("migrate", "django_syncguard", database=alias, verbosity=0)
    except BaseException:
        pg.destroy()
        raise
    line = (
        f"PostgreSQL {version} on 127.0.0.1, default settings (fsync on, synchronous_commit "
        f"on); psycopg {psycopg.__version__}, no prepared statements (Django's default)"
    )
    return Server("PostgreSQL", Target("postgres", port=pg.port), line, pg.destroy)


def csv_ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


HOW = """\
- **Seeding.** Part 1's counters are not made by a million acquire + release cycles
  (over half an hour on PostgreSQL with fsync): they are written in bulk in the layout
  the backend leaves after a release, and say so. The sample above each table shows a
  real counter next to seeded ones and their storage per counter; the sample's
  compaction must delete both alike. On PostgreSQL the real keys' index is larger: 4
  threads insert into 4 interleaved key ranges, so B-tree pages split in the middle
  (one thread in key order gives the seeded size; the heap is the same either way).
- **Storage.** PostgreSQL: `pg_total_relation_size` of `syncguard_fence_counters`.
  A plain VACUUM makes the deleted rows' space reusable but does not shrink the file
  (the kept rows are spread over every page); VACUUM FULL rewrites the table and its
  index (and locks the table meanwhile). Redis: `used_memory` less that of the empty
  server, so the keyspace's own tables are included.
- **Compaction steps.** `fence_floors.compact` calls three backend hooks per batch:
  read a page of idle counters, raise the floor, delete the page's counters that are
  still as read. Their time per call (count x mean ms) is measured by wrapping the
  hooks of the backend instance; the server's work per batch comes from the server's
  own counters (Redis `INFO commandstats`, PostgreSQL `pg_stat_user_tables` and
  `pg_stat_database`, autovacuum's work on the tables included).
- **Throughput.** A cycle is `acquire(key, ttl_ms=30000)` then `release(lock_id)`
  through the backend object. *1 client*: a thread of this process; *8 processes*:
  8 spawned processes, one client each, started together (`bench/common.py`).
  *fresh*: a new key every cycle; *hot*: one key per cell for every client (with 8
  clients most attempts find it held: attempts/s counts them). The ratio is the
  cell's cycles over the counter cell's in the same run; *per-round* gives the
  lowest and highest ratio of one round's cycles, each round measuring every cell
  back to back. Where that range straddles 1.00, the run cannot tell the cells apart.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000, help="counters seeded (part 1)")
    parser.add_argument("--sample", type=int, default=10_000, help="real acquire+release keys")
    parser.add_argument("--batch-sizes", type=csv_ints, default=[500, 2000, 10_000])
    parser.add_argument(
        "--recent-every", type=int, default=10, help="1 seeded key in N is recent (kept)"
    )
    parser.add_argument(
        "--held", type=int, default=1000, help="live locks on other keys during compaction"
    )
    parser.add_argument("--seconds", type=float, default=6.0, help="per cell and scenario")
    parser.add_argument("--rounds", type=int, default=8, help="the cells alternate this often")
    parser.add_argument("--modes", default="1 client,8 processes")
    parser.add_argument("--backends", default="memory,redis,postgres")
    parser.add_argument("--parts", default="compaction,throughput")
    parser.add_argument("--out", type=Path, help="default: bench/reports/<date>-fences.md")
    args = parser.parse_args()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    parts = {p.strip() for p in args.parts.split(",")}
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := set(backends) - {"memory", "redis", "postgres"}:
        parser.error(f"unknown backends: {sorted(unknown)}")
    if unknown := parts - {"compaction", "throughput"}:
        parser.error(f"unknown parts: {sorted(unknown)}")

    from bench.report import background, machine_rows

    started = datetime.datetime.now(datetime.UTC)
    out = args.out or ROOT / "bench" / "reports" / f"{started:%Y-%m-%d}-fences.md"
    command = " ".join(["python bench/fences.py", *sys.argv[1:]])
    t0 = time.monotonic()
    load_start = background()
    report = Report()
    servers: list[tuple[str, str]] = []
    throughput: dict[str, list[Cell]] = {}
    compaction: dict[str, list[CompactionRun]] = {}
    for kind in backends:
        server = start(kind)
        try:
            servers.append((server.title, server.line))
            report(f"## {server.title}", "")
            if "throughput" in parts:
                cells = run_cells(
                    server.target,
                    ["1 client"] if kind == "memory" else modes,
                    args.rounds,
                    args.seconds,
                )
                throughput[server.title] = cells
                report(
                    *throughput_table(f"{server.title}: acquire + release", cells, args.seconds),
                    "",
                )
            if "compaction" in parts and kind == "redis":
                compaction["Redis"] = redis_compaction(server.target.location, args, report)
            if "compaction" in parts and kind == "postgres":
                compaction["PostgreSQL"] = postgres_compaction(server.target.port, args, report)
        finally:
            for built in [b for key, b in _backends.items() if key[0] == server.target]:
                built.close()
            server.stop()
    took = time.monotonic() - t0
    summary = [
        "## Summary",
        "",
        f"Took {took / 60:.1f} min. Throughput: {args.seconds:g} s per cell and scenario in "
        f"{args.rounds} rounds; compaction: {args.keys:,} seeded keys, 1 in "
        f"{args.recent_every} recent, batch sizes {', '.join(map(str, args.batch_sizes))}.",
        "",
    ]
    if compaction:
        summary += [
            "Compaction, time per batch in each step (calls x mean ms) and the server's "
            "work per batch:",
            "",
            "| backend | batch size | page of idle counters | floor raise | delete "
            "| server work per batch |",
            "|---|--:|--:|--:|--:|---|",
        ]
        for backend, runs in compaction.items():
            summary += steps_table(backend, runs)
        summary.append("")
    if throughput:
        summary += [
            "Acquire + release: cycles/s of the counter cell (no floor) and each other "
            "cell's ratio to it:",
            "",
            *ratio_summary(throughput, args.seconds),
            "",
        ]
    summary += ["## How it was measured", "", HOW]
    print("\n" + "\n".join(summary))
    head = [
        "# Fence continuity: compaction and fence modes (bench/fences.py)",
        "",
        f"`{command}`, started {started:%Y-%m-%d %H:%M} UTC.",
        "",
        *machine_rows(servers, f"at the start: {load_start}; at the end: {background()}"),
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(head + summary + [""] + report.lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    os.environ.pop("DJANGO_SETTINGS_MODULE", None)
    main()
