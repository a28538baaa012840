"""Mutual exclusion and fences across OS processes on one Redis server."""

from __future__ import annotations

import uuid

import pytest

from tests.support import workers
from tests.support.processes import run_in_processes

PROCESSES = 4


@pytest.mark.slow
def test_processes_hammering_one_key_never_overlap(redis_server):
    iterations = 150
    prefix = f"mp{uuid.uuid4().hex[:8]}"
    per_process = run_in_processes(
        workers.redis_hammer, lambda i: (redis_server.url, prefix, "hot", iterations), PROCESSES
    )
    records = sorted(r for process in per_process for r in process)
    total = PROCESSES * iterations
    assert [seen for seen, _ in records] == list(range(total))  # no lost update, no overlap
    fences = [fence for _, fence in records]  # in the order the sections ran
    assert fences == [f"{n:015d}" for n in range(1, total + 1)]
