"""Cleanup is safe beside live traffic, across OS processes, on every server backend.

Worker processes hammer acquire/release on a few hot keys and walk through many cold
ones, with short TTLs; some holders never release, so their records expire. Meanwhile
another process runs ``delete_expired`` with a small batch size in a loop. Every key
starts with an expired record, long past the cleanup guard, so from the first moment
cleanup's deletes race acquisitions that replace those same records.

Afterwards:

- every acquire answered ``ok`` or ``locked``, and nothing raised;
- each key's fences are distinct and follow real time: an acquisition that finished
  before another one started has the smaller fence;
- no live lock was deleted: every release by a holder still well within its TTL
  returned ``ok=True``;
- every fence counter survived: once all records are aged and cleaned up, the next
  acquire of each key returns the largest fence seen plus one;
- cleanup never made a free key look taken: every ``locked`` answer overlaps in time
  with some acquisition's lock (from the start of its acquire to the end of its
  release, or to its expiry plus the tolerance). On PostgreSQL this is what the
  advisory-lock try in the cleanup statement is for; on Firestore, acquire reading
  again when its guarded write finds the record changed (deleted by cleanup, say).

The run is bounded by iteration counts; no sleep orders anything. Every time is the
machine's wall clock, the clock the servers' own times come from.
"""

from __future__ import annotations

import bisect
import importlib
import multiprocessing
import random
import time
from collections import Counter, defaultdict
from typing import Any

import pytest

from django_syncguard.constants import TIME_TOLERANCE_MS
from tests.support.processes import run_in_processes

WORKERS = 4
HOT_KEYS = [f"hot:{n}" for n in range(6)]
#: Keys no worker takes: their abandoned records wait for the cleaner alone, so it
#: always has work while the traffic runs, however soon workers replace the others.
IDLE_KEYS = [f"idle:{n}" for n in range(20)]
#: Locks that are released: short, yet far longer than an acquire+release takes.
HOLD_TTL_MS = 3_000
#: Locks that are abandoned: expire at once, past the guard 2 s later.
ABANDON_TTL_MS = 50
ABANDON_RATE = 0.1
CLEANUP_BATCH = 3
#: Iterations per worker (one acquire, and its release unless abandoned): a few
#: seconds of each backend on a small machine. Even iterations take a random hot key;
#: odd ones the next cold key, each worker walking all of them once in an order of its
#: own, so that cold keys are taken throughout the run.
ITERATIONS = {"postgres": 1_200, "sqlite": 800, "redis": 2_400, "firestore": 60}
SEED_AGE_MS = 60_000
#: Server times are whole milliseconds: room for rounding when bounding a lock's life.
ROUNDING_NS = 20_000_000
MS = 1_000_000


def cold_keys(iterations: int) -> list[str]:
    return [f"cold:{n:04d}" for n in range(iterations // 2)]


# ------------------------------------------------------- in the child processes
def _backend(entry: dict[str, Any], databases: dict[str, Any] | None):
    if databases is not None:
        from tests.support.workers import setup_django

        setup_django(databases)
    params = dict(entry)
    module, _, name = params.pop("BACKEND").rpartition(".")
    return getattr(importlib.import_module(module), name)("worker", params)


def participant(entry, databases, iterations, done, index, barrier, results) -> None:
    """Process 0 cleans up until every worker is done; the others are workers."""
    try:
        backend = _backend(entry, databases)
        if index == 0:
            report = _clean(backend, done, barrier)
        else:
            report = _work(backend, iterations, index, barrier)
            with done.get_lock():
                done.value += 1
    except Exception as exc:  # reported, not raised: a dead child would hang the parent
        report = {"role": "error", "process": index, "error": f"{type(exc).__name__}: {exc}"}
        if index:
            with done.get_lock():
                done.value += 1
    results.put(report)


def _clean(backend, done, barrier) -> dict[str, Any]:
    passes = batches = deleted = 0
    barrier.wait()
    while True:
        finished = done.value == WORKERS  # read first: one more pass after the last one
        for count in backend.delete_expired(batch_size=CLEANUP_BATCH):
            batches += 1
            deleted += count
        passes += 1
        if finished:
            return {"role": "cleaner", "passes": passes, "batches": batches, "deleted": deleted}


def _work(backend, iterations: int, index: int, barrier) -> dict[str, Any]:
    rng = random.Random(index)
    cold = cold_keys(iterations)
    rng.shuffle(cold)
    # (key, fence, acquire started, acquire finished, lock surely gone by), in ns.
    acquisitions: list[tuple[str, str, int, int, int]] = []
    refused: list[tuple[str, int, int]] = []  # (key, started, finished) of "locked"
    outcomes: Counter[str] = Counter()
    bad_releases: list[tuple[str, str, str]] = []
    late = 0
    barrier.wait()
    began = time.monotonic()
    for n in range(iterations):
        key = rng.choice(HOT_KEYS) if n % 2 == 0 else cold[n // 2]
        ttl = ABANDON_TTL_MS if rng.random() < ABANDON_RATE else HOLD_TTL_MS
        started = time.time_ns()
        result = backend.acquire(key, ttl)
        finished = time.time_ns()
        outcomes[f"acquire: {'ok' if result.ok else result.reason}"] += 1
        if not result.ok:
            refused.append((key, started, finished))
            continue
        if ttl == ABANDON_TTL_MS:  # never released: live until expiry + tolerance
            outcomes["abandoned"] += 1
            gone_by = finished + (ttl + TIME_TOLERANCE_MS) * MS + ROUNDING_NS
            acquisitions.append((key, result.fence, started, finished, gone_by))
            continue
        released = backend.release(result.lock_id)
        gone_by = time.time_ns()
        acquisitions.append((key, result.fence, started, finished, gone_by))
        if gone_by - started < HOLD_TTL_MS * MS // 2:  # well within its TTL
            outcomes[f"release: ok={released.ok}"] += 1
            if not released.ok:
                bad_releases.append((key, result.fence, str(released.reason)))
        else:
            late += 1  # a stall of over half the TTL: no promise to check
    return {
        "role": "worker",
        "acquisitions": acquisitions,
        "refused": refused,
        "outcomes": outcomes,
        "bad_releases": bad_releases,
        "late": late,
        "seconds": time.monotonic() - began,
    }


# ------------------------------------------------------------------ checks
def check_fences_follow_real_time(key: str, got: list[tuple[int, int, int]]) -> None:
    """``got``: (fence, started, finished) of every acquisition of ``key``."""
    fences = [fence for fence, _, _ in got]
    assert len(fences) == len(set(fences)), f"{key}: a fence was handed out twice"
    assert min(fences) > 1, f"{key}: its fence counter went back"
    latest_start = 0
    for fence, started, finished in sorted(got):
        # Every smaller fence went to an acquisition that started before this one
        # finished (had this one finished first, its fence would be the smaller).
        assert finished > latest_start, f"{key}: fence {fence} out of real-time order"
        latest_start = max(latest_start, started)


def unexplained_refusals(
    locks: list[tuple[int, int]], refused: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """The ``locked`` answers, (started, finished), that overlap no lock's
    (acquire started, surely gone by) of the same key."""
    locks = sorted(locks)
    starts = [start for start, _ in locks]
    latest_end, ends = 0, []
    for _, end in locks:
        latest_end = max(latest_end, end)
        ends.append(latest_end)
    out = []
    for started, finished in refused:
        i = bisect.bisect_right(starts, finished)  # locks begun before it finished
        if i == 0 or ends[i - 1] < started:
            out.append((started, finished))
    return out


# ------------------------------------------------------------------ the test
@pytest.mark.slow
@pytest.mark.parametrize("harness", ["postgres", "sqlite", "redis", "firestore"], indirect=True)
def test_cleanup_beside_live_traffic_never_deletes_a_live_lock_nor_a_fence(harness):
    backend = harness.backend
    iterations = ITERATIONS[harness.name]
    traffic_keys = HOT_KEYS + cold_keys(iterations)
    keys = traffic_keys + IDLE_KEYS
    # Every key starts as a lock abandoned long ago: fence 1, expired past the guard.
    for key in keys:
        assert backend.acquire(key, ABANDON_TTL_MS).fence == "000000000000001"
    harness.advance(SEED_AGE_MS)
    assert list(backend.delete_expired(dry_run=True)) == [len(keys)]

    databases = None
    if harness.name in ("postgres", "sqlite"):
        from django.db import connections

        alias = backend.database
        databases = {alias: dict(connections[alias].settings_dict)}
    done = multiprocessing.get_context("spawn").Value("i", 0)
    reports = run_in_processes(
        participant,
        lambda i: (harness.settings_entry, databases, iterations, done, i),
        count=WORKERS + 1,
    )
    # Nothing raised, in any process (process 0 is the cleaner).
    assert [r for r in reports if r["role"] == "error"] == []
    (cleaner,) = [r for r in reports if r["role"] == "cleaner"]
    workers = [r for r in reports if r["role"] == "worker"]

    # Only the expected outcomes.
    outcomes = sum((w["outcomes"] for w in workers), Counter())
    assert set(outcomes) <= {
        "acquire: ok",
        "acquire: locked",
        "abandoned",
        "release: ok=True",
        "release: ok=False",
    }, outcomes
    assert outcomes["acquire: ok"] > len(traffic_keys) // 2, outcomes
    # Cleanup really ran beside the traffic and deleted records.
    assert cleaner["deleted"] > 0, cleaner

    # No live lock was deleted: each timely release found its lock.
    assert [r for w in workers for r in w["bad_releases"]] == []
    assert outcomes["release: ok=True"] > outcomes["acquire: ok"] // 2, outcomes

    # Fences: distinct per key, and in real-time order of the acquisitions.
    by_key: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    locks: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for w in workers:
        for key, fence, started, finished, gone_by in w["acquisitions"]:
            by_key[key].append((int(fence), started, finished))
            locks[key].append((started, gone_by))
    for key, got in by_key.items():
        check_fences_follow_real_time(key, got)

    # Every "locked" had a lock to blame.
    refused: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for w in workers:
        for key, started, finished in w["refused"]:
            refused[key].append((started, finished))
    unexplained = {
        key: len(bad)
        for key, answers in refused.items()
        if (bad := unexplained_refusals(locks[key], answers))
    }
    assert unexplained == {}, f"free keys answered locked: {unexplained}"

    # Fence counters survived: age every record past the guard, clean up, and each
    # key's next fence follows the largest one seen (1, the seed, for keys not taken).
    harness.advance(SEED_AGE_MS)
    sum(backend.delete_expired())
    assert list(backend.delete_expired(dry_run=True)) == [0]
    for key in keys:
        seen = max((fence for fence, _, _ in by_key.get(key, ())), default=1)
        assert backend.acquire(key, HOLD_TTL_MS).fence == f"{seen + 1:015d}", key

    print(
        f"\n{harness.name}: {dict(outcomes)}; late releases "
        f"{sum(w['late'] for w in workers)}; cleaner {cleaner}; workers ran "
        f"{max(w['seconds'] for w in workers):.1f} s; unexplained 'locked' {unexplained}"
    )
