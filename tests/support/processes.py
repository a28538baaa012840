"""Run a worker function in several spawned OS processes and collect what they report."""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable
from typing import Any


def run_in_processes(
    target: Callable[..., None],
    args_for: Callable[[int], tuple[Any, ...]],
    count: int = 4,
    timeout_s: float = 300,
) -> list[Any]:
    """Start ``count`` processes of ``target(*args_for(i), barrier, results)``; return
    what each put on ``results``. A worker reports an exception instead of dying, and
    any reported exception fails the test here."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(count), ctx.Queue()
    procs = [
        ctx.Process(target=target, args=(*args_for(i), barrier, results)) for i in range(count)
    ]
    for p in procs:
        p.start()
    collected = [results.get(timeout=timeout_s) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    failures = [r for r in collected if isinstance(r, BaseException)]
    assert failures == [], failures
    return collected


class Children:
    """Spawned processes that play different parts (``run_in_processes`` runs one
    part many times). :meth:`join` waits for each and checks its exit code; whatever
    still runs when the test ends (it failed midway) is terminated, by its handle."""

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.started: list[Any] = []

    def start(self, target: Callable[..., None], *args: Any) -> None:
        process = self.ctx.Process(target=target, args=args)
        process.start()
        self.started.append(process)

    def join(self, timeout_s: float = 60) -> None:
        for process in self.started:
            process.join(timeout=timeout_s)
            assert process.exitcode == 0

    def terminate(self) -> None:
        for process in self.started:
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)


def sigkill(process: Any, timeout_s: float = 10.0) -> None:
    """Kill ``process`` (a ``multiprocessing`` child) with SIGKILL and reap it."""
    os.kill(process.pid, signal.SIGKILL)
    process.join(timeout_s)
    assert process.exitcode == -signal.SIGKILL


#: ``lock()`` options of a waiter that makes no attempt of its own while it waits: only
#: a wake-up moves it (with :func:`quiet_check_ins`, its check-ins are as far off). A
#: test of who notices a lapsed grant needs it: a retry or a check-in that lands just
#: after the lapse (the default schedule's attempts are random) would take the key
#: before the notice under test, and the test would see nothing heard.
QUIET_WAITER: dict[str, Any] = {
    "retry_delay_ms": 60_000,
    "backoff": "fixed",
    "jitter": "none",
    "timeout_ms": 60_000,
}


def quiet_check_ins(monkeypatch: Any) -> None:
    """Check-ins of this process's waiters a minute apart (a ticket keeps the patience
    it was drawn with, so a queued waiter stays live for the usual 2 s)."""
    from django_syncguard.waiting import tickets

    monkeypatch.setattr(tickets, "CHECK_IN_MS", 60_000)


def assert_delayed_by_the_grant_window(
    entered: list[tuple[float, str]], released_at: float
) -> None:
    """The one hold in ``entered`` (when, fence) began about ``GRANT_WINDOW_MS`` after
    ``released_at``: the release granted the key to a waiter that was dead (it took
    fence 2), the grant lapsed unclaimed, and the next waiter took the key just after.
    Not the dead ticket's patience (2 s) nor a TTL."""
    from django_syncguard.waiting import GRANT_WINDOW_MS

    ((entered_at, fence),) = entered
    delay_s = entered_at - released_at
    print(f"killed first waiter delayed the key {delay_s * 1000:.0f} ms")
    window_s = GRANT_WINDOW_MS / 1000
    assert fence == "000000000000003"  # fence 2 went to the dead waiter's grant
    assert window_s <= delay_s < window_s + 0.5
