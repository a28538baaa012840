"""Mutual exclusion and fences across OS processes on the Firestore emulator."""

from __future__ import annotations

import uuid

import pytest

from tests.support import workers
from tests.support.harness import FirestoreHarness
from tests.support.processes import run_in_processes

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
    per_process = run_in_processes(
        workers.firestore_hammer,
        lambda i: (firestore_emulator.host, options, "hot", iterations),
        PROCESSES,
    )
    records = sorted(r for process in per_process for r in process)
    total = PROCESSES * iterations
    assert [seen for seen, _ in records] == list(range(total))  # no lost update, no overlap
    fences = [fence for _, fence in records]
    assert fences == [f"{n:015d}" for n in range(1, total + 1)]
