"""Shared machinery of the benchmarks: clients, timing, the printed table.

A *method* is a factory that, inside one client (thread or process), returns an
``(acquire, release)`` pair: ``acquire(key)`` returns a token or ``None`` when the key
is held, ``release(token)`` frees it. One *cycle* is a successful acquire followed by
its release. Every method of one run is measured against the same server, with the
same clients, keys and duration, so the ratios printed are side by side.
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Acquire = Callable[[str], Any]
Release = Callable[[Any], None]
MethodFactory = Callable[[int], tuple[Acquire, Release]]


@dataclass
class Sample:
    cycles: int = 0
    attempts: int = 0
    errors: int = 0  # acquire or release raised
    acquire_ns: list[int] = field(default_factory=list)
    release_ns: list[int] = field(default_factory=list)

    def merge(self, other: Sample) -> None:
        self.cycles += other.cycles
        self.attempts += other.attempts
        self.errors += other.errors
        self.acquire_ns += other.acquire_ns
        self.release_ns += other.release_ns


def run_client(factory: MethodFactory, client: int, shared: bool, seconds: float) -> Sample:
    """One client's loop: acquire, release, repeat, for ``seconds``."""
    acquire, release = factory(client)
    sample = Sample()
    keys = ["shared"] if shared else [f"c{client}:k{n}" for n in range(64)]
    deadline = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < deadline:
        key = keys[n % len(keys)]
        n += 1
        started = time.perf_counter_ns()
        sample.attempts += 1
        try:
            token = acquire(key)
        except Exception:
            sample.errors += 1
            continue
        acquired = time.perf_counter_ns()
        sample.acquire_ns.append(acquired - started)
        if token is None:
            continue
        try:
            release(token)
        except Exception:
            sample.errors += 1
            continue
        sample.release_ns.append(time.perf_counter_ns() - acquired)
        sample.cycles += 1
    return sample


def _process_main(
    setup: Callable[[], MethodFactory],
    client: int,
    shared: bool,
    seconds: float,
    start: Any,
    out: Any,
) -> None:
    factory = setup()
    start.wait()
    out.put(run_client(factory, client, shared, seconds))


def measure(setup: Callable[[], MethodFactory], mode: str, shared: bool, seconds: float) -> Sample:
    """Run one scenario: ``mode`` is ``"1 client"``, ``"8 threads"`` or ``"4 processes"``.

    ``setup`` is called once per process (it must be picklable for processes: a
    module-level function or a ``functools.partial`` of one).
    """
    total = Sample()
    if mode == "1 client":
        total.merge(run_client(setup(), 0, shared, seconds))
        return total
    if mode == "8 threads":
        factory = setup()
        results: list[Sample] = []
        barrier = threading.Barrier(8)

        def thread_main(client: int) -> None:
            barrier.wait()
            results.append(run_client(factory, client, shared, seconds))

        threads = [threading.Thread(target=thread_main, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for sample in results:
            total.merge(sample)
        return total
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(4), ctx.Queue()
    procs = [
        ctx.Process(target=_process_main, args=(setup, i, shared, seconds, start, out))
        for i in range(4)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        total.merge(out.get(timeout=seconds * 10 + 120))
    for p in procs:
        p.join()
    return total


def run_matrix(
    methods: dict[str, Callable[[str], MethodFactory]],
    target: str,
    modes: str,
    rounds: int,
    seconds: float,
) -> list[tuple[str, str, str, Sample]]:
    """Every method x mode x (distinct, shared) keys, methods interleaved ``rounds``
    times per scenario so that drift of a shared machine hits them alike.

    ``target`` is what each method's setup connects to (URL, port, host).
    """
    import functools

    rows: list[tuple[str, str, str, Sample]] = []
    for mode in modes.split(","):
        for shared in (False, True):
            samples = {name: Sample() for name in methods}
            for _ in range(rounds):
                for name, method in methods.items():
                    setup = functools.partial(method, target)
                    samples[name].merge(measure(setup, mode, shared, seconds / rounds))
            for name, sample in samples.items():
                rows.append((mode, "shared" if shared else "distinct", name, sample))
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
    rates = {(m, k, name): s.cycles / seconds for m, k, name, s in rows}
    for mode, keys, name, sample in rows:
        rate = sample.cycles / seconds
        base = rates.get((mode, keys, baseline)) or float("nan")
        line = f"| {mode} | {keys} | {name} | {rate:,.0f} | {rate / base:.2f} |"
        if also:
            other = rates.get((mode, keys, also)) or float("nan")
            line += f" {rate / other:.2f} |"
        for values in (sample.acquire_ns, sample.release_ns):
            line += f" {percentile_us(values, 50):,.0f} | {percentile_us(values, 99):,.0f} |"
        line += f" {sample.attempts / seconds:,.0f} | {sample.errors} |"
        print(line, flush=True)
