"""Compaction beside four processes taking the same keys, on every server backend:
no key's fence ever goes back (``specs/guarantees.md``, Fence continuity).

The parent compacts in a loop (idle for 0 ms: any counter whose key is free at that
moment) while four spawned processes take three keys in turn; each holder appends its
key and fence to a log from inside its critical section, so the log lists each key's
holders in the order they held it. Halfway, each process waits (its keys released)
until compaction has deleted counters, so the second half always runs over compacted
keys. Counter mode: there the floor alone carries a compacted key's fences.
"""

from __future__ import annotations

import multiprocessing
import threading
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from django.db import connections
from django.utils.module_loading import import_string

from tests.support.fence_workers import cycle_keys
from tests.support.harness import FirestoreHarness
from tests.support.processes import run_in_processes

pytestmark = pytest.mark.slow

PROCESSES = 4
ITERATIONS = 40
KEYS = ["compact:a", "compact:b", "compact:c"]
DATABASE = "django_syncguard.backends.database.DatabaseBackend"


@pytest.fixture(
    params=[
        pytest.param(
            "postgres", marks=pytest.mark.django_db(transaction=True, databases=["postgres"])
        ),
        "redis",
        "firestore",
    ]
)
def setup(request) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    """(settings entry, environment, databases) the processes and the parent share."""
    suffix = uuid.uuid4().hex[:12]
    if request.param == "postgres":
        entry = {"BACKEND": DATABASE, "OPTIONS": {"DATABASE": "postgres", "FENCES": "counter"}}
        return entry, {}, {"postgres": dict(connections["postgres"].settings_dict)}
    if request.param == "redis":
        url = request.getfixturevalue("redis_server").url
        entry = {
            "BACKEND": "django_syncguard.backends.redis.RedisBackend",
            "LOCATION": url,
            "KEY_PREFIX": f"compact{suffix}",
            "OPTIONS": {"FENCES": "counter"},
        }
        return entry, {}, {}
    host = request.getfixturevalue("firestore_emulator").host
    options = {
        "PROJECT": FirestoreHarness.project,
        "COLLECTION": f"locks_{suffix}",
        "FENCE_COLLECTION": f"fences_{suffix}",
        "FENCES": "counter",
    }
    entry = {"BACKEND": "django_syncguard.backends.firestore.FirestoreBackend", "OPTIONS": options}
    return entry, {"FIRESTORE_EMULATOR_HOST": host}, {}


def test_compaction_beside_four_processes_never_sends_a_fence_back(setup, tmp_path: Path):
    entry, environ, databases = setup
    params = {k: v for k, v in entry.items() if k != "BACKEND"}
    observer = import_string(entry["BACKEND"])("compactor", params)
    log = tmp_path / "holders.log"
    stop, deleted, errors = threading.Event(), [], []
    compacted = multiprocessing.get_context("spawn").Event()

    def compact() -> None:
        while not stop.is_set():
            try:
                deleted.append(sum(observer.compact_fences(idle_ms=0, batch_size=2)))
            except Exception as exc:  # reported below
                errors.append(exc)
                return
            if sum(deleted):
                compacted.set()

    compactor = threading.Thread(target=compact)
    compactor.start()
    try:
        run_in_processes(
            cycle_keys,
            lambda i: (databases, entry, environ, KEYS, ITERATIONS, str(log), compacted),
            count=PROCESSES,
        )
    finally:
        stop.set()
        compactor.join()
        observer.close()

    assert errors == []
    assert sum(deleted) > 0, "no compaction interleaved: the test proved nothing"
    by_key: dict[str, list[int]] = defaultdict(list)
    for line in log.read_text().splitlines():
        key, fence = line.split()
        by_key[key].append(int(fence))
    assert sorted(by_key) == KEYS
    assert sum(map(len, by_key.values())) == PROCESSES * ITERATIONS
    for key, fences in by_key.items():
        assert fences == sorted(set(fences)), (key, fences)
    print(f"\n{sum(deleted)} counters compacted during {PROCESSES * ITERATIONS} acquisitions")
