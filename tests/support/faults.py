"""Worker processes that take one key in a loop while their server is crashed and
restarted (``tests/test_faults.py``), and the parent's side of that experiment.

Each worker is a spawned OS process with its own backend object. It calls
``acquire`` / ``release`` directly (one attempt each, no helper retries) and keeps
going whatever happens to the server: a ``ServiceUnavailable`` or ``NetworkTimeout``
is counted and the loop carries on; any other exception ends the worker and is
reported, so that the test fails on it. For every hold it records the fence, when it
started holding (after ``acquire`` returned) and when it stopped (before calling
``release``), on the machine-wide monotonic clock, and whether it found another
worker inside the critical section.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: Errors a worker may see while its server is down; anything else fails the test.
OUTAGE_ERRORS = ("ServiceUnavailable", "NetworkTimeout")


def build_backend(kind: str, config: dict[str, Any]) -> Any:
    """A fresh backend in this process; ``config`` is what the parent passed."""
    options = config["options"]
    if kind == "postgres":
        from tests.support.workers import setup_django

        setup_django(config["databases"])
        from django_syncguard.backends.database import DatabaseBackend

        return DatabaseBackend("worker", {"OPTIONS": options})
    if kind == "redis":
        from django_syncguard.backends.redis import RedisBackend

        params = {"LOCATION": config["url"], "KEY_PREFIX": config["prefix"], "OPTIONS": options}
        return RedisBackend("worker", params)
    if kind == "firestore":
        os.environ["FIRESTORE_EMULATOR_HOST"] = config["host"]
        from django_syncguard.backends.firestore import FirestoreBackend

        return FirestoreBackend("worker", {"OPTIONS": options})
    raise ValueError(kind)


def lock_loop(
    kind: str,
    config: dict[str, Any],
    key: str,
    ttl_ms: int,
    index: int,
    stop: Any,
    acquired: Any,
    errors: Any,
    holder: Any,
    results: Any,
) -> None:
    """Acquire and release ``key`` until ``stop`` is set; report records or failure."""
    holds: list[tuple[str, int, int, int]] = []  # fence, from, to (ns), other holder seen
    outage: list[tuple[int, str]] = []  # when, error class
    try:
        from django_syncguard.errors import NetworkTimeout, ServiceUnavailable

        backend = build_backend(kind, config)

        def failed(exc: Exception) -> None:
            outage.append((time.monotonic_ns(), type(exc).__name__))
            with errors.get_lock():
                errors[index] += 1

        while not stop.is_set():
            try:
                result = backend.acquire(key, ttl_ms)
            except (ServiceUnavailable, NetworkTimeout) as exc:
                failed(exc)
                stop.wait(0.02)  # do not spin on a refused connection
                continue
            if not result.ok:
                continue
            start = time.monotonic_ns()
            with holder.get_lock():  # the critical section: is anyone else inside?
                other, holder.value = holder.value, index + 1
            with holder.get_lock():
                holder.value = 0
            end = time.monotonic_ns()
            holds.append((result.fence, start, end, other))
            with acquired.get_lock():
                acquired.value += 1
            try:
                backend.release(result.lock_id)
            except (ServiceUnavailable, NetworkTimeout) as exc:
                failed(exc)  # the lock stays until its TTL
        backend.close()
    except BaseException as exc:  # reported to the parent, which fails the test
        cause = exc.__cause__
        results.put(
            (
                "failed",
                index,
                f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}",
                f"{type(cause).__module__}.{type(cause).__qualname__}" if cause else None,
            )
        )
        return
    results.put(("ok", index, holds, outage))


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` (a cheap read of shared counters) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting until {what}")
        time.sleep(0.01)


@dataclass
class Outcome:
    """What the workers reported, and when the parent crashed and restored the server."""

    holds: list[tuple[str, int, int, int]]
    outage: list[tuple[int, str]]
    failures: list[tuple[Any, ...]]
    down_ns: int = 0
    up_ns: int = 0
    errors_per_worker: list[int] = field(default_factory=list)

    def fences_before_down(self) -> list[str]:
        return [fence for fence, start, _, _ in self.holds if start < self.down_ns]

    def fences_after_up(self) -> list[str]:
        return [fence for fence, start, _, _ in self.holds if start > self.up_ns]

    def summary(self) -> str:
        before, after = self.fences_before_down(), self.fences_after_up()
        return (
            f"{len(self.holds)} holds ({len(before)} before the crash, last fence "
            f"{max(before, default=None)}; {len(after)} after the restart, first fence "
            f"{min(after, default=None)}); errors {self.error_counts()} "
            f"per worker {self.errors_per_worker}; failures {self.failures}"
        )

    def error_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, name in self.outage:
            counts[name] = counts.get(name, 0) + 1
        return counts


def crash_under_traffic(
    kind: str,
    config: dict[str, Any],
    crash: Callable[[], None],
    restore: Callable[[], None],
    *,
    workers: int = 3,
    ttl_ms: int = 2_000,
    holds_per_phase: int = 25,
    key: str = "crash:hot",
) -> Outcome:
    """Run ``workers`` lock loops on ``key``; once they have taken it
    ``holds_per_phase`` times, ``crash()`` the server; once every worker has seen
    the outage, ``restore()`` it; once they have taken it ``holds_per_phase`` more
    times, stop them and return what they saw."""
    ctx = multiprocessing.get_context("spawn")
    stop, results = ctx.Event(), ctx.Queue()
    acquired, holder = ctx.Value("i", 0), ctx.Value("i", 0)
    errors = ctx.Array("i", workers)
    procs = [
        ctx.Process(
            target=lock_loop,
            args=(kind, config, key, ttl_ms, i, stop, acquired, errors, holder, results),
        )
        for i in range(workers)
    ]
    for proc in procs:
        proc.start()
    outcome = Outcome([], [], [])
    try:
        wait_until(lambda: acquired.value >= holds_per_phase, 120, "the workers took the lock")
        outcome.down_ns = time.monotonic_ns()
        seen = errors[:]
        crash()
        wait_until(
            lambda: all(now > then for now, then in zip(errors[:], seen, strict=True)),
            60,
            "every worker saw the outage",
        )
        restore()
        outcome.up_ns = time.monotonic_ns()
        target = acquired.value + holds_per_phase
        wait_until(lambda: acquired.value >= target, 120, "the workers took the lock again")
    finally:
        stop.set()
        reports = []
        for _ in procs:
            try:
                reports.append(results.get(timeout=60))
            except Exception as exc:  # a worker that never reported
                reports.append(("failed", None, f"no report: {exc!r}", None))
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    for report in reports:
        if report[0] == "ok":
            outcome.holds.extend(report[2])
            outcome.outage.extend(report[3])
        else:
            outcome.failures.append(report)
    outcome.errors_per_worker = list(errors[:])
    return outcome
