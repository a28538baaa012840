"""Run a worker function in several spawned OS processes and collect what they report."""

from __future__ import annotations

import multiprocessing
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
    assert failures == []
    return collected
