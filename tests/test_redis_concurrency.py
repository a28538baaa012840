"""Mutual exclusion and fences across OS processes on one Redis server."""

from __future__ import annotations

import multiprocessing
import uuid

import pytest

from tests import workers

PROCESSES = 4


@pytest.mark.slow
def test_processes_hammering_one_key_never_overlap(redis_server):
    iterations = 150
    prefix = f"mp{uuid.uuid4().hex[:8]}"
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(PROCESSES), ctx.Queue()
    procs = [
        ctx.Process(
            target=workers.redis_hammer,
            args=(redis_server.url, prefix, "hot", iterations, barrier, results),
        )
        for _ in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    records = sorted(r for _ in procs for r in results.get(timeout=300))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    total = PROCESSES * iterations
    assert [seen for seen, _ in records] == list(range(total))  # no lost update, no overlap
    fences = [fence for _, fence in records]  # in the order the sections ran
    assert fences == [f"{n:015d}" for n in range(1, total + 1)]
