"""Shared machinery of the benchmarks: clients, timing, the printed table.

A *method* is a factory that, inside one client (thread or process), returns an
``(acquire, release)`` pair: ``acquire(key)`` returns a token or ``None`` when the key
is held, ``release(token)`` frees it. One *cycle* is a successful acquire followed by
its release. Every method of one run is measured against the same server, with the
same clients, keys and duration, so the ratios printed are side by side.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import platform
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Acquire = Callable[[str], Any]
Release = Callable[[Any], None]
MethodFactory = Callable[[int], tuple[Acquire, Release]]


class Report:
    """Lines printed as they come and kept for the report file."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, *lines: str) -> None:
        for line in lines:
            print(line, flush=True)
            self.lines.append(line)


@dataclass
class Sample:
    cycles: int = 0
    attempts: int = 0
    errors: int = 0  # acquire or release raised
    acquire_ns: list[int] = field(default_factory=list)
    release_ns: list[int] = field(default_factory=list)
    #: Acquire + release of each cycle, in ns (successful attempts only).
    cycle_ns: list[int] = field(default_factory=list)
    #: Time spent inside this method's calls (interleaved runs only; 0 otherwise).
    busy_ns: int = 0

    def merge(self, other: Sample) -> None:
        self.busy_ns += other.busy_ns
        self.cycles += other.cycles
        self.attempts += other.attempts
        self.errors += other.errors
        self.acquire_ns += other.acquire_ns
        self.release_ns += other.release_ns
        self.cycle_ns += other.cycle_ns


def run_client(factory: MethodFactory, client: int, shared: bool, seconds: float) -> Sample:
    """One client's loop: acquire, release, repeat, for ``seconds``.

    One untimed cycle on a key of its own comes first, so that opening connections
    (and loading scripts, compiling plans) is not counted as the first acquire.
    """
    acquire, release = factory(client)
    with contextlib.suppress(Exception):
        token = acquire(f"warmup:c{client}")
        if token is not None:
            release(token)
    sample = Sample()
    keys = ["shared"] if shared else [f"c{client}:k{n}" for n in range(64)]
    deadline = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < deadline:
        _timed_cycle(acquire, release, keys[n % len(keys)], sample)
        n += 1
    return sample


def run_interleaved(
    methods: dict[str, Callable[[Any], MethodFactory]], target: Any, cycles: int
) -> list[tuple[str, str, str, Sample]]:
    """One client that, at every step, makes one cycle of each method in a fresh
    random order: ``cycles`` steps on distinct keys, then as many on one shared key.

    Block-by-block runs (``run_matrix``) let each method meet a different moment of a
    shared machine: on this 2-core VM, the loopback round trip moved between 225 and
    370 µs within minutes, more than the differences measured. Here every method
    meets the same moments, cycle by cycle, so drift cannot favour one of them. Each
    cycle then starts right after another method's, though, which changes what it
    costs (bench/README.md): quote these ratios beside block runs, not instead of
    them. A method's cycles/s is its cycles over the time spent in its own calls
    (``Sample.busy_ns``).
    """
    import random

    rows: list[tuple[str, str, str, Sample]] = []
    for shared in (False, True):
        clients = {name: method(target)(0) for name, method in methods.items()}
        samples = {name: Sample() for name in methods}
        for acquire, release in clients.values():  # untimed warm-up cycle
            token = acquire("warmup:interleaved")
            if token is not None:
                release(token)
        order = list(clients)
        for step in range(cycles):
            key = "shared" if shared else f"k{step % 64}"
            random.shuffle(order)
            for name in order:
                _timed_cycle(*clients[name], key, samples[name])
        for sample in samples.values():
            sample.busy_ns = sum(sample.acquire_ns) + sum(sample.release_ns)
        keys = "shared" if shared else "distinct"
        rows += [("1 client, interleaved", keys, name, samples[name]) for name in methods]
    return rows


def run_selected(
    methods: dict[str, Callable[[Any], MethodFactory]], target: Any, args: Any
) -> tuple[list[tuple[str, str, str, Sample]], str]:
    """The rows a benchmark script's arguments ask for (``--interleaved CYCLES``, else
    ``--modes`` in ``--rounds`` for ``--seconds``), and how they were measured."""
    if args.interleaved:
        how = (
            f"one client, {args.interleaved:,} steps per key mode, each method once per "
            "step in random order (cycles/s over each method's own time)"
        )
        return run_interleaved(methods, target, args.interleaved), how
    how = f"{args.seconds:g} s per method and scenario, in {args.rounds} interleaved rounds"
    return run_matrix(methods, target, args.modes, args.rounds, args.seconds), how


def _timed_cycle(acquire: Acquire, release: Release, key: str, sample: Sample) -> None:
    """One attempt on ``key``: acquire, and release what it got; both timed."""
    sample.attempts += 1
    started = time.perf_counter_ns()
    try:
        token = acquire(key)
    except Exception:
        sample.errors += 1
        return
    acquired = time.perf_counter_ns()
    sample.acquire_ns.append(acquired - started)
    if token is None:
        return
    try:
        release(token)
    except Exception:
        sample.errors += 1
        return
    released = time.perf_counter_ns()
    sample.release_ns.append(released - acquired)
    sample.cycle_ns.append(released - started)
    sample.cycles += 1


def parse_mode(mode: str) -> tuple[int, int]:
    """``(processes, threads per process)`` of a mode; 0 processes means in this process.

    ``"1 client"``, ``"8 threads"`` (in this process), ``"4 processes"`` (one client
    each) and ``"8 processes x 4 threads"`` (32 clients) are understood.
    """
    words = mode.split()
    try:
        if len(words) == 2 and words[1] in ("client", "clients") and int(words[0]) == 1:
            return 0, 1
        if len(words) == 2 and words[1] in ("thread", "threads"):
            return 0, int(words[0])
        if len(words) == 2 and words[1] in ("process", "processes"):
            return int(words[0]), 1
        if len(words) == 5 and words[1] in ("process", "processes") and words[2] == "x":
            return int(words[0]), int(words[3])
    except ValueError:
        pass
    raise ValueError(
        f"unknown mode {mode!r}: '1 client', 'N threads', 'N processes', 'N processes x T threads'"
    )


def run_threads(
    factory: MethodFactory,
    first_client: int,
    threads: int,
    shared: bool,
    seconds: float,
    ready: Callable[[], None] | None = None,
) -> Sample:
    """``threads`` clients of one factory in this process, started together."""
    if threads == 1 and ready is None:
        return run_client(factory, first_client, shared, seconds)
    results: list[Sample] = []
    barrier = threading.Barrier(threads + 1)

    def thread_main(client: int) -> None:
        barrier.wait()
        results.append(run_client(factory, client, shared, seconds))

    pool = [threading.Thread(target=thread_main, args=(first_client + i,)) for i in range(threads)]
    for t in pool:
        t.start()
    if ready is not None:
        ready()  # e.g. wait until every process of a pool is ready too
    barrier.wait()
    for t in pool:
        t.join()
    total = Sample()
    for sample in results:
        total.merge(sample)
    return total


def _setup_id(setup: Callable[[], MethodFactory]) -> bytes:
    return pickle.dumps(setup)


def _pool_worker(index: int, inbox: Any, out: Any, start: Any) -> None:
    """A pool process: run the tasks it is sent, keeping each method's setup."""
    factories: dict[bytes, MethodFactory] = {}
    while True:
        task = inbox.get()
        if task is None:
            return
        setup, threads, shared, seconds = task
        error = None
        try:
            key = _setup_id(setup)
            if key not in factories:
                factories[key] = setup()
            factory = factories[key]
        except Exception:
            error = traceback.format_exc()
        if error is not None:
            start.wait(timeout=600)  # let the others go on; the caller raises
            out.put(error)
            continue
        sample = run_threads(
            factory,
            index * threads,
            threads,
            shared,
            seconds,
            ready=lambda: start.wait(timeout=600),
        )
        out.put(sample)


class ClientPool:
    """``processes`` spawned processes kept for a whole run.

    Spawning (and importing Django, drivers and clients in) a process costs about a
    second of CPU; a pool pays it once, not once per method and round. Each process
    keeps the factory its ``setup`` returned, the way a long-lived worker would.
    """

    def __init__(self, processes: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.processes = processes
        self.inboxes = [ctx.Queue() for _ in range(processes)]
        self.out = ctx.Queue()
        self.start = ctx.Barrier(processes)
        self.procs = [
            ctx.Process(
                target=_pool_worker, args=(i, self.inboxes[i], self.out, self.start), daemon=True
            )
            for i in range(processes)
        ]
        for p in self.procs:
            p.start()

    def run(
        self, setup: Callable[[], MethodFactory], threads: int, shared: bool, seconds: float
    ) -> Sample:
        for inbox in self.inboxes:
            inbox.put((setup, threads, shared, seconds))
        total = Sample()
        errors = []
        for _ in self.procs:
            result = self.out.get(timeout=seconds * 10 + 600)
            if isinstance(result, str):
                errors.append(result)
            else:
                total.merge(result)
        if errors:
            raise RuntimeError(f"setup failed in a pool process:\n{errors[0]}")
        return total

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
                p.join(5)


def measure(
    setup: Callable[[], MethodFactory],
    mode: str,
    shared: bool,
    seconds: float,
    pool: ClientPool | None = None,
) -> Sample:
    """Run one scenario (see ``parse_mode`` for ``mode``).

    ``setup`` is called once per process (it must be picklable for processes: a
    module-level function or a ``functools.partial`` of one). Process modes run on
    ``pool`` when given (of that many processes), else on a pool made for this call.
    """
    processes, threads = parse_mode(mode)
    if processes == 0:
        return run_threads(setup(), 0, threads, shared, seconds)
    if pool is not None and pool.processes == processes:
        return pool.run(setup, threads, shared, seconds)
    own = ClientPool(processes)
    try:
        return own.run(setup, threads, shared, seconds)
    finally:
        own.close()


def run_matrix(
    methods: dict[str, Callable[[str], MethodFactory]],
    target: Any,
    modes: str | list[str],
    rounds: int,
    seconds: float,
) -> list[tuple[str, str, str, Sample]]:
    """Every method x mode x (distinct, shared) keys, methods interleaved ``rounds``
    times per scenario so that drift of a shared machine hits them alike.

    ``target`` is what each method's setup connects to (URL, port, host). Process
    modes share one pool of processes per process count for the whole matrix.
    """
    import functools

    mode_list = modes.split(",") if isinstance(modes, str) else list(modes)
    pools: dict[int, ClientPool] = {}
    rows: list[tuple[str, str, str, Sample]] = []
    try:
        for mode in mode_list:
            processes, _ = parse_mode(mode)
            if processes and processes not in pools:
                pools[processes] = ClientPool(processes)
            for shared in (False, True):
                samples = {name: Sample() for name in methods}
                for _ in range(rounds):
                    for name, method in methods.items():
                        setup = functools.partial(method, target)
                        samples[name].merge(
                            measure(setup, mode, shared, seconds / rounds, pools.get(processes))
                        )
                for name, sample in samples.items():
                    rows.append((mode, "shared" if shared else "distinct", name, sample))
    finally:
        for pool in pools.values():
            pool.close()
    return rows


def percentile_us(values: list[int], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0] / 1000
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1] / 1000


def machine() -> str:
    return (
        f"{platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{platform.platform()}"
    )


def print_table(
    title: str,
    rows: list[tuple[str, str, str, Sample]],
    seconds: float,
    baseline: str,
    also: str | None = None,
) -> None:
    """Print cycles/s and per-operation latency, with ratios to ``baseline`` (and ``also``)."""
    print(f"\n## {title}\n")
    header = f"| scenario | keys | method | cycles/s | x {baseline} |"
    header += f" x {also} |" if also else ""
    header += (
        " acquire p50 µs | acquire p99 µs | release p50 µs | release p99 µs | attempts/s | errors |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    rates = {(m, k, name): s.cycles / _elapsed(s, seconds) for m, k, name, s in rows}
    for mode, keys, name, sample in rows:
        rate = sample.cycles / _elapsed(sample, seconds)
        base = rates.get((mode, keys, baseline)) or float("nan")
        line = f"| {mode} | {keys} | {name} | {rate:,.0f} | {rate / base:.2f} |"
        if also:
            other = rates.get((mode, keys, also)) or float("nan")
            line += f" {rate / other:.2f} |"
        for values in (sample.acquire_ns, sample.release_ns):
            line += f" {percentile_us(values, 50):,.0f} | {percentile_us(values, 99):,.0f} |"
        line += f" {sample.attempts / _elapsed(sample, seconds):,.0f} | {sample.errors} |"
        print(line, flush=True)


def _elapsed(sample: Sample, seconds: float) -> float:
    """The seconds a sample's rates are over: the run's wall time, or in an
    interleaved run the method's own busy time."""
    return sample.busy_ns / 1e9 if sample.busy_ns else seconds


def postgres_database(port: int, *, name: str = "bench", **options: Any) -> dict[str, Any]:
    """A ``DATABASES`` entry for the benchmark database ``name`` on the loopback
    PostgreSQL; ``options`` are its ``OPTIONS``."""
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": "postgres",
        "HOST": "127.0.0.1",
        "PORT": str(port),
        "OPTIONS": options,
    }


def configure_django(
    databases: dict[str, dict[str, Any]], backends: dict[str, dict[str, Any]] | None = None
) -> None:
    """Django for a benchmark process: these ``DATABASES``, this app, nothing else.

    ``backends`` is ``SYNCGUARD_BACKENDS`` (default: one memory backend; the benchmarks
    mostly build their backends themselves and pass them as ``using=``)."""
    import django
    from django.conf import settings

    if settings.configured:
        return
    settings.configure(
        DATABASES=databases,
        INSTALLED_APPS=["django.contrib.contenttypes", "django_syncguard"],
        USE_TZ=True,
        SYNCGUARD_BACKENDS=backends
        or {"default": {"BACKEND": "django_syncguard.backends.memory.MemoryBackend"}},
    )
    django.setup()


def create_bench_database(port: int, name: str = "bench") -> str:
    """Create the database ``name`` on the loopback PostgreSQL at ``port``; return the
    server's version."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(
        host="127.0.0.1", port=port, user="postgres", dbname="postgres", autocommit=True
    ) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        row = admin.execute("SHOW server_version").fetchone()
    return str(row[0]) if row else "?"


def shadow_package(tree: Path, into: Path) -> Path:
    """A directory holding only ``django_syncguard``, a symlink to ``tree``'s; returned.

    Put first on ``sys.path`` (or ``PYTHONPATH``), it makes the package of ``tree`` the
    one imported while ``bench`` and ``tests`` still come from this checkout. Putting
    ``tree`` itself first would also take its ``bench/`` and ``tests/``, which may
    predate (or lack) the code that measures it.
    """
    package = tree.resolve() / "django_syncguard"
    if not (package / "__init__.py").is_file():
        raise SystemExit(f"{tree} has no django_syncguard package")
    into.mkdir(parents=True, exist_ok=True)
    (into / "django_syncguard").symlink_to(package, target_is_directory=True)
    return into


def imported_from(module: Any, tree: Path) -> bool:
    """Whether ``module`` (a package) was imported from ``tree``, symlinks resolved."""
    return Path(module.__file__).resolve().is_relative_to(tree.resolve())
