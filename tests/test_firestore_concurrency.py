"""Mutual exclusion and fences across OS processes on the Firestore emulator."""

from __future__ import annotations

import multiprocessing
import uuid

import pytest

from tests import workers
from tests.harness import FirestoreHarness

PROCESSES = 4


@pytest.mark.slow
def test_processes_hammering_one_key_never_overlap(firestore_emulator):
    iterations = 25
    suffix = uuid.uuid4().hex[:8]
    options = {
        "PROJECT": FirestoreHarness.project,
        "COLLECTION": f"locks_{suffix}",
        "FENCE_COLLECTION": f"fences_{suffix}",
    }
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(PROCESSES), ctx.Queue()
    procs = [
        ctx.Process(
            target=workers.firestore_hammer,
            args=(firestore_emulator.host, options, "hot", iterations, barrier, results),
        )
        for _ in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    per_process = [results.get(timeout=300) for _ in procs]
    failures = [r for r in per_process if isinstance(r, BaseException)]
    assert failures == []
    records = sorted(r for process in per_process for r in process)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    total = PROCESSES * iterations
    assert [seen for seen, _ in records] == list(range(total))  # no lost update, no overlap
    fences = [fence for _, fence in records]
    assert fences == [f"{n:015d}" for n in range(1, total + 1)]
