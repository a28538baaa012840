"""Two source trees of django_syncguard side by side in one run: is the new one slower?

    .venv/bin/python bench/package_ab.py [--old 90a6b4f] [--new .] [--rounds 4]
        [--cycles 1500] [--seconds 8] [--quick] [--out bench/reports/<date>-refactor-ab.md]

``--old REV`` is checked out into a temporary ``git worktree`` (removed at the end,
also on an error or Ctrl-C); ``--new PATH`` is a tree on disk (default: this checkout).
One Redis and one PostgreSQL server (``bench/contention.py``'s ``serve``: the test
harness's servers on free loopback ports, PostgreSQL with its durable defaults) serve
both trees for the whole run, each tree on a database of its own (``bench_old`` /
``bench_new``; Redis database 1 / 2), so neither tree's migrations, functions or
fence counters meet the other's.

Every measurement runs in a fresh subprocess whose ``PYTHONPATH`` puts the measured
tree's ``django_syncguard`` first (``bench.common.shadow_package``: only the package
comes from that tree; ``bench`` and ``tests`` come from this checkout), and checks
where it imported the package from. Per round, each cell runs once per tree, old and
new back to back, the order flipping every round (old-new, new-old, ...), so that the
drift of this shared 2-core machine hits both alike. The cells:

- **uncontended**: one client, on keys nobody else uses (64 in turn), on the memory
  backend (the control: no I/O), Redis and PostgreSQL: ``lock(fn, key=...)``, a
  ``@locked`` function, and ``backend.acquire`` + ``release``, interleaved cycle by
  cycle in a fresh random order, the backends built anew every 0.5 s of timed work
  (as ``bench/contention.py``'s uncontended measurement does: one PostgreSQL
  connection can run 5-25% faster than another for its whole life). ``--cycles``
  timed cycles per kind, backend, tree and round.
- **contention**: ``bench/contention.py``'s target cell, run by its own code: 8
  spawned processes, each looping ``lock(body, key=<one hot key>, ttl_ms=10_000,
  timeout_ms=5_000)`` with a 20 ms body, wake-ups on (the default), for ``--seconds``,
  on Redis and on PostgreSQL.

Only the public API that both trees share is used: ``lock``, ``locked``,
``AcquisitionTimeout``, the backend classes at their settings paths, and a backend's
``acquire`` / ``release`` / ``close``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # never ahead of the measured tree (see bench/contention.py)
    sys.path.insert(0, str(ROOT))

from bench.common import imported_from, shadow_package  # noqa: E402

DEFAULT_OLD = "90a6b4f"
SIDES = ("old", "new")
BACKENDS = ("memory", "redis", "postgres")
CONTENDED = ("redis", "postgres")
KINDS = ("lock()", "@locked", "acquire+release")
TITLES = {"memory": "memory (control)", "redis": "Redis", "postgres": "PostgreSQL"}
#: Redis database of each side: the two trees never share a key or a fence counter.
REDIS_DB = {"old": 1, "new": 2}
#: The contention cell: bench/contention.py's target (8 processes, 20 ms holds).
CLIENTS, HOLD_MS = 8, 20
KEYS = 64


# ================================================================ in a subprocess
def uncontended_cell(spec: dict[str, Any]) -> dict[str, Any]:
    """Timed cycles of every kind on every backend; latencies in ns, per kind."""
    from bench.common import configure_django, postgres_database
    from bench.contention import EPOCH_S, TIMEOUT_MS, TTL_MS, Target, make_backend

    pg = Target("postgres", port=spec["pg_port"], database=spec["database"])
    redis = Target("redis", location=spec["redis_url"])
    configure_django({"default": postgres_database(pg.port, name=pg.database)})
    from django.core.management import call_command

    call_command("migrate", "django_syncguard", verbosity=0)

    from django_syncguard import lock, locked
    from django_syncguard.backends.memory import MemoryBackend

    def build(backend: str, epoch: int) -> Any:
        alias = f"ab-{backend}-{epoch}"
        if backend == "memory":
            return MemoryBackend(alias, {})
        return make_backend(redis if backend == "redis" else pg, True, alias)

    def kinds(backend: Any) -> dict[str, Callable[[str], None]]:
        options = {"using": backend, "ttl_ms": TTL_MS, "timeout_ms": TIMEOUT_MS}

        @locked("ab:locked:<name>", **options)  # type: ignore[arg-type]
        def decorated(name: str) -> None:
            return None

        def with_lock(name: str) -> None:
            lock(lambda: None, key=f"ab:lock:{name}", **options)  # type: ignore[arg-type]

        def cycle(name: str) -> None:
            result = backend.acquire(f"ab:cycle:{name}", TTL_MS)
            backend.release(result.lock_id)

        return {"lock()": with_lock, "@locked": decorated, "acquire+release": cycle}

    cycles = spec["cycles"]
    out: dict[str, dict[str, list[int]]] = {}
    for name in BACKENDS:
        latencies: dict[str, list[int]] = {kind: [] for kind in KINDS}
        order = list(KINDS)
        epoch = 0
        while min(len(v) for v in latencies.values()) < cycles:
            epoch += 1
            backend = build(name, epoch)
            try:
                calls = kinds(backend)
                for kind in order:  # untimed: connections, scripts, plans
                    calls[kind]("warm-up")
                spent = 0
                while spent < EPOCH_S * 1e9 and min(len(v) for v in latencies.values()) < cycles:
                    random.shuffle(order)
                    for kind in order:
                        key = str(len(latencies[kind]) % KEYS)
                        began = time.perf_counter_ns()
                        calls[kind](key)
                        took = time.perf_counter_ns() - began
                        latencies[kind].append(took)
                        spent += took
            finally:
                backend.close()
        out[name] = {kind: values[:cycles] for kind, values in latencies.items()}
    return out


def contention_cell(spec: dict[str, Any]) -> dict[str, Any]:
    """bench/contention.py's cell (8 processes x 20 ms, wake-ups on) on one backend."""
    from bench.contention import Cell, Pool, Target, analyse

    if spec["backend"] == "redis":
        target = Target("redis", location=spec["redis_url"])
    else:
        target = Target("postgres", port=spec["pg_port"], database=spec["database"])
    pool = Pool(target, CLIENTS)
    try:
        data, start, deadline, drain = pool.run_cell(
            "on", CLIENTS, HOLD_MS, spec["seconds"], spec["key"]
        )
    finally:
        pool.close()
    cell = Cell(spec["backend"], "on", CLIENTS, HOLD_MS)
    analyse(cell, data, start, deadline)
    cell.drain_s = drain
    result = dataclasses.asdict(cell)
    result["waits"] = [c[2] for d in data for c in d["calls"] if c[3] == "acquired"]
    return result


def cell_main(spec_json: str, result_path: str) -> None:
    """A cell subprocess: check which package it imported, measure, write JSON."""
    spec = json.loads(spec_json)
    import django_syncguard

    if not imported_from(django_syncguard, Path(spec["tree"])):
        raise SystemExit(
            f"django_syncguard came from {django_syncguard.__file__}, not {spec['tree']}"
        )
    run = uncontended_cell if spec["cell"] == "uncontended" else contention_cell
    result = {"package": str(Path(django_syncguard.__file__).resolve().parent)}
    result["data"] = run(spec)
    Path(result_path).write_text(json.dumps(result))


# ===================================================================== the parent
@dataclasses.dataclass
class Tree:
    side: str
    path: Path
    label: str
    shadow: Path = Path()


@contextlib.contextmanager
def old_worktree(rev: str, scratch: Path) -> Iterator[Path]:
    """``rev`` checked out (detached) into a temporary worktree, removed afterwards."""
    path = scratch / "old-tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(path), rev],
        check=True,
    )
    try:
        yield path
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
            check=False,
        )


def describe(tree: Path) -> str:
    """The commit a tree is at, and whether it has changes."""
    head = subprocess.run(
        ["git", "-C", str(tree), "log", "-1", "--format=%h %s"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "--", "django_syncguard"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return f"{head[:72]}{' + uncommitted changes' if dirty else ''}" if head else str(tree)


def run_cell(tree: Tree, spec: dict[str, Any], scratch: Path, timeout_s: float) -> Any:
    """One cell in a subprocess of ``tree``; its data. The subprocess gets a session
    of its own, so that on Ctrl-C or a timeout exactly it (and its pool) is ended."""
    result = scratch / f"result-{tree.side}.json"
    result.unlink(missing_ok=True)
    env = dict(os.environ)
    env.pop("DJANGO_SETTINGS_MODULE", None)
    env["PYTHONPATH"] = os.pathsep.join([str(tree.shadow), str(ROOT)])
    spec = {**spec, "tree": str(tree.path)}
    argv = [
        sys.executable,
        str(Path(__file__)),
        "--cell",
        json.dumps(spec),
        "--result",
        str(result),
    ]
    process = subprocess.Popen(argv, env=env, start_new_session=True)
    try:
        code = process.wait(timeout_s)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        raise
    if code != 0 or not result.exists():
        raise RuntimeError(f"{spec['cell']} cell of the {tree.side} tree failed (exit {code})")
    return json.loads(result.read_text())["data"]


def pct(values: list[int], q: float) -> float:
    from bench.contention import pct as percentile

    return percentile(values, q)


def spread(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def uncontended_table(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Per backend and kind: latency percentiles over every round's cycles, and
    cycles/s over the time spent in them; new/old of both, with the spread of the
    per-round ratios of medians."""
    lines = [
        "| backend | call | old p50 / p95 / p99 µs | new p50 / p95 / p99 µs | old ops/s "
        "| new ops/s | **new/old p50** | per-round p50 ratios | new/old ops/s |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for backend in BACKENDS:
        for kind in KINDS:
            pooled = {s: [v for r in runs[s] for v in r[backend][kind]] for s in SIDES}
            if not all(pooled.values()):
                continue
            figures = {}
            for side in SIDES:
                values = pooled[side]
                figures[side] = (
                    [pct(values, q) / 1000 for q in (50, 95, 99)],
                    len(values) / (sum(values) / 1e9),
                )
            per_round = [
                statistics.median(n[backend][kind]) / statistics.median(o[backend][kind])
                for o, n in zip(runs["old"], runs["new"], strict=False)
            ]
            (old_p, old_rate), (new_p, new_rate) = figures["old"], figures["new"]
            lines.append(
                f"| {TITLES[backend]} | `{kind}` | {' / '.join(f'{v:,.0f}' for v in old_p)} "
                f"| {' / '.join(f'{v:,.0f}' for v in new_p)} | {old_rate:,.0f} | {new_rate:,.0f} "
                f"| **{new_p[0] / old_p[0]:.2f}** | {spread(per_round)} "
                f"| {new_rate / old_rate:.2f} |"
            )
    return lines


def contention_table(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> list[str]:
    """Per backend and side: acquisitions/s (mean of rounds), the wait distribution
    over every round's calls, hand-off p50 (median of rounds), utilization, timeouts."""
    lines = [
        "| backend | tree | acquisitions/s | wait p50 / p95 / p99 / longest ms "
        "| hand-off p50 ms | utilization | timeouts | errors |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    ratios = []
    for backend in CONTENDED:
        rates: dict[str, list[float]] = {}
        waits: dict[str, list[int]] = {}
        for side in SIDES:
            cells = runs[side][backend]
            if not cells:
                continue
            rates[side] = [c["acquisitions"] / c["window_s"] for c in cells]
            waits[side] = [w for c in cells for w in c["waits"]]
            longest = max(c["longest"] for c in cells)
            handoff = statistics.median(c["handoff_p50"] for c in cells)
            lines.append(
                f"| {TITLES[backend]} | {side} | {statistics.mean(rates[side]):,.1f} "
                f"| {' / '.join(f'{pct(waits[side], q) / 1e6:,.1f}' for q in (50, 95, 99))} "
                f"/ {longest / 1e6:,.0f} | {handoff / 1e6:.2f} "
                f"| {statistics.mean(c['utilization'] for c in cells):.1%} "
                f"| {sum(c['timeouts'] for c in cells)} | {sum(c['errors'] for c in cells)} |"
            )
        if len(rates) == 2:
            per_round = [n / o for o, n in zip(rates["old"], rates["new"], strict=False)]
            p50 = pct(waits["new"], 50) / pct(waits["old"], 50)
            p99 = pct(waits["new"], 99) / pct(waits["old"], 99)
            mean = statistics.mean(rates["new"]) / statistics.mean(rates["old"])
            ratios.append(
                f"| {TITLES[backend]} | **{mean:.2f}** | {spread(per_round)} "
                f"| {p50:.2f} | {p99:.2f} |"
            )
    return [
        *lines,
        "",
        "| backend | **new/old acquisitions/s** | per-round ratios | new/old wait p50 "
        "| new/old wait p99 |",
        "|---|--:|--:|--:|--:|",
        *ratios,
    ]


HOW = """\
- Both trees run against the same servers, each on a database of its own; every
  measurement is a fresh process of its tree (the path its `django_syncguard` was
  imported from is checked). In each round every cell runs once per tree, back to
  back, in the order old-new, then new-old in the next round, and so on.
- **Uncontended**: one client; `lock(fn, key=...)`, a `@locked` function and
  `backend.acquire` + `release` interleaved cycle by cycle in random order, on 64 keys
  in turn, the backend rebuilt (new connections) every 0.5 s of timed work. Latency is
  one whole cycle (acquire and release); ops/s = cycles / time spent in them.
  *Per-round p50 ratios*: the lowest and highest new/old ratio of the medians of one
  round; when that range straddles 1.00 the two trees are not told apart.
- **Contention**: `bench/contention.py`'s cell, by its code: 8 processes loop
  `lock(body, key=<one hot key>, ttl_ms=10_000, timeout_ms=5_000)`, body 20 ms, wake-ups
  on. Wait = from calling `lock()` to entering the body, over the calls that acquired
  (every round pooled); hand-off = from leaving a body while someone waits to the next
  body (median of the rounds' medians). The best possible is about 1 / (20 ms +
  hand-off) acquisitions/s.
- Ratios are new / old: below 1.00 is faster for latencies, slower for ops/s and
  acquisitions/s.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", default=DEFAULT_OLD, help=f"git revision (default {DEFAULT_OLD})")
    parser.add_argument("--new", type=Path, default=ROOT, help="a tree (default: this one)")
    parser.add_argument("--rounds", type=int, help="default 4 (--quick: 2)")
    parser.add_argument("--cycles", type=int, help="per kind, backend, tree, round (1500; 100)")
    parser.add_argument("--seconds", type=float, help="per contention cell (8; 1)")
    parser.add_argument("--quick", action="store_true", help="smoke run, under a minute")
    parser.add_argument(
        "--durable",
        action="store_true",
        help="PostgreSQL with fsync (its defaults, as bench/contention.py); default: the "
        "tests' settings, fsync off, so that flush times do not drown the code's cost",
    )
    parser.add_argument("--out", type=Path, help="also write the report (with the machine)")
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        cell_main(args.cell, args.result)
        return
    quick = args.quick
    rounds = args.rounds or (2 if quick else 4)
    cycles = args.cycles or (100 if quick else 1500)
    seconds = args.seconds or (1.0 if quick else 8.0)
    contention_rounds = 1 if quick and not args.rounds else rounds
    command = "python bench/package_ab.py " + " ".join(sys.argv[1:])
    # A plain `kill` ends the run as Ctrl-C does: the finally blocks stop the cell's
    # processes, the servers and remove the worktree.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from bench.contention import Section, serve
    from bench.report import background, machine_rows

    started = datetime.datetime.now(datetime.UTC)
    t0 = time.monotonic()
    load_start = background()
    scratch = Path(tempfile.mkdtemp(prefix="syncguard-ab-"))
    sections = {name: Section(name) for name in CONTENDED}
    uncontended: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
    contended: dict[str, dict[str, list[dict[str, Any]]]] = {
        s: {b: [] for b in CONTENDED} for s in SIDES
    }
    try:
        with contextlib.ExitStack() as stack:
            old_path = stack.enter_context(old_worktree(args.old, scratch))
            trees = {
                "old": Tree("old", old_path, f"`{args.old}`: {describe(old_path)}"),
                "new": Tree("new", args.new.resolve(), f"`{args.new}`: {describe(args.new)}"),
            }
            for tree in trees.values():
                tree.shadow = shadow_package(tree.path, scratch / f"path-{tree.side}")
            redis = stack.enter_context(serve("redis", sections["redis"]))
            pg = stack.enter_context(serve("postgres", sections["postgres"], args.durable))
            from bench.common import create_bench_database

            for side in SIDES:
                create_bench_database(pg.port, f"bench_{side}")

            def spec(side: str, cell: str, **extra: Any) -> dict[str, Any]:
                base = redis.location.rsplit("/", 1)[0]
                return {
                    "cell": cell,
                    "redis_url": f"{base}/{REDIS_DB[side]}",
                    "pg_port": pg.port,
                    "database": f"bench_{side}",
                    **extra,
                }

            for number in range(rounds):
                order = SIDES if number % 2 == 0 else SIDES[::-1]
                print(f"round {number + 1}/{rounds} ({' then '.join(order)})", flush=True)
                for side in order:
                    data = run_cell(
                        trees[side], spec(side, "uncontended", cycles=cycles), scratch, 600
                    )
                    uncontended[side].append(data)
                    medians = ", ".join(
                        f"{b} {statistics.median(data[b]['lock()']) / 1000:,.0f}" for b in BACKENDS
                    )
                    print(f"  {side} uncontended lock() p50 µs: {medians}", flush=True)
                if number >= contention_rounds:
                    continue
                for backend in CONTENDED:
                    for side in order:
                        key = f"hot-ab-{number}-{side}"
                        cell = run_cell(
                            trees[side],
                            spec(side, "contention", backend=backend, seconds=seconds, key=key),
                            scratch,
                            seconds * 5 + 600,
                        )
                        contended[side][backend].append(cell)
                        print(
                            f"  {side} {backend} 8 x 20 ms: "
                            f"{cell['acquisitions'] / cell['window_s']:,.1f} acq/s, wait p50 "
                            f"{cell['wait_p50'] / 1e6:.1f} ms, {cell['timeouts']} timeouts",
                            flush=True,
                        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    took = time.monotonic() - t0
    body = [
        "## Trees",
        "",
        f"- old: {trees['old'].label}",
        f"- new: {trees['new'].label}",
        "",
        f"{rounds} rounds; uncontended {cycles:,} cycles per call kind, backend, tree and "
        f"round; contention {seconds:g} s per cell, {contention_rounds} round(s). "
        f"Took {took / 60:.1f} min.",
        "",
        "## Uncontended: one client, cycle latency",
        "",
        *uncontended_table(uncontended),
        "",
        "## Contention: 8 processes x 20 ms on one key (wake-ups on)",
        "",
        *contention_table(contended),
        "",
        "## How it was measured",
        "",
        HOW,
    ]
    print("\n" + "\n".join(body))
    if args.out:
        head = [
            "# django_syncguard, old tree vs new tree (bench/package_ab.py)",
            "",
            f"`{command}`, started {started:%Y-%m-%d %H:%M} UTC.",
            "",
            *machine_rows(
                [(TITLES[name], section.server) for name, section in sections.items()],
                f"at the start: {load_start}; at the end: {background()}",
            ),
            "",
        ]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(head + body))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.pop("DJANGO_SETTINGS_MODULE", None)
    main()
