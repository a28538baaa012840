"""Fence modes, the fence floor and compaction of idle counters, on every backend
(``django_syncguard.fence_floors``; ``specs/guarantees.md``, Fence continuity)."""

from __future__ import annotations

import pytest

from django_syncguard import InvalidArgument
from django_syncguard.fence_floors import FLOOR_MAX, FenceState, next_fence
from django_syncguard.fencing import FENCE_MAX
from django_syncguard.waiting import PATIENCE_MS, WaitTicket
from tests.support.harness import HARNESSES, Harness

TTL = 60_000


@pytest.fixture
def build(kind):
    """Build harnesses of each kind, with options; all closed after the test."""
    built: list[Harness] = []

    def make(**options: object) -> Harness:
        built.append(HARNESSES[kind](**options))
        return built[-1]

    yield make
    for h in built:
        h.close()


def same_storage(h: Harness, **options: object):
    """Another backend object on ``h``'s storage, with ``options`` changed."""
    entry = dict(h.settings_entry)
    entry["OPTIONS"] = {**entry.get("OPTIONS", {}), **options}  # type: ignore[dict-item]
    params = {k: v for k, v in entry.items() if k != "BACKEND"}
    return type(h.backend)(f"{h.backend.alias}-again", params)


def take(backend, key: str) -> int:
    """Acquire and release ``key``; its fence as an int."""
    result = backend.acquire(key, TTL)
    assert result.ok, result
    assert backend.release(result.lock_id).ok is True
    return int(result.fence)


def test_the_next_fence_formula():
    assert next_fence(0, 0, None) == 1
    assert next_fence(7, 0, None) == 8
    assert next_fence(7, 20, None) == 21
    assert next_fence(7, 20, 1_000) == 1_000
    assert next_fence(5_000, 20, 1_000) == 5_001


# ------------------------------------------------------------------ modes
def test_fence_modes_default_by_backend(harness):
    default = "clock" if harness.name.startswith("redis") else "counter"
    entry = dict(harness.settings_entry)
    options = {k: v for k, v in entry.get("OPTIONS", {}).items() if k != "FENCES"}  # type: ignore[union-attr]
    params = {**{k: v for k, v in entry.items() if k != "BACKEND"}, "OPTIONS": options}
    assert type(harness.backend)("defaults", params).fence_mode == default


@pytest.mark.parametrize("mode", ["Clock", "", None, 1])
def test_a_bad_fence_mode_is_refused(harness, mode):
    with pytest.raises(InvalidArgument, match="OPTIONS\\['FENCES'\\] must be 'clock' or 'counter'"):
        same_storage(harness, FENCES=mode)


def test_counter_mode_counts_from_one(build):
    backend = build(FENCES="counter").backend
    assert [take(backend, "counted") for _ in range(3)] == [1, 2, 3]


def test_clock_mode_starts_at_the_servers_clock(build):
    h = build(FENCES="clock")
    before = h.now_ms()
    first = take(h.backend, "clocked")
    after = h.now_ms()
    assert before <= first <= after
    second = take(h.backend, "clocked")
    assert first < second <= max(first + 1, h.now_ms())


def test_clock_mode_goes_on_from_a_counter_ahead_of_the_clock(build):
    h = build(FENCES="clock")
    ahead = h.now_ms() + 10**9
    h.set_fence("ahead", ahead)
    assert take(h.backend, "ahead") == ahead + 1


def test_switching_modes_either_way_keeps_fences_increasing(build):
    h = build(FENCES="counter")
    assert take(h.backend, "switch") == 1
    clock = same_storage(h, FENCES="clock")
    try:
        before = h.now_ms()
        clocked = take(clock, "switch")
        assert clocked >= before
    finally:
        clock.close()
    assert take(h.backend, "switch") == clocked + 1


# ------------------------------------------------------------------ floor
def test_the_floor_lifts_every_key_and_never_goes_down(build):
    h = build(FENCES="counter")
    backend = h.backend
    assert take(backend, "below") == 1
    assert backend.fence_state() == FenceState(backend.alias, "counter", 0, 1)

    assert backend.raise_fence_floor(500) == 500
    assert backend.raise_fence_floor(100) == 500

    assert take(backend, "below") == 501
    assert take(backend, "fresh") == 501
    assert take(backend, "fresh") == 502
    assert backend.fence_state() == FenceState(backend.alias, "counter", 500, 502)


def test_the_floor_is_shared_by_every_backend_object_of_the_storage(build):
    h = build(FENCES="counter")
    other = same_storage(h)
    try:
        assert other.raise_fence_floor(41) == 41
        assert take(h.backend, "shared") == 42
        assert h.backend.fence_state().floor == 41
    finally:
        other.close()


def test_the_floor_applies_in_clock_mode_too(build):
    h = build(FENCES="clock")
    high = h.now_ms() + 10**9
    assert h.backend.raise_fence_floor(high) == high
    assert take(h.backend, "floored") == high + 1


def test_a_floor_at_the_top_is_refused(harness):
    with pytest.raises(InvalidArgument, match=f"from 0 to {FLOOR_MAX}"):
        harness.backend.raise_fence_floor(FENCE_MAX)


@pytest.mark.parametrize("floor", [-1, "5", 5.0, True, None, FLOOR_MAX + 1])
def test_a_bad_floor_is_refused_before_any_io(no_io, floor):
    with pytest.raises(InvalidArgument, match="A fence floor must be an int"):
        no_io.raise_fence_floor(floor)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"idle_ms": -1}, "idle_ms must be an int"),
        ({"idle_ms": 1.5}, "idle_ms must be an int"),
        ({"idle_ms": 2**64}, "idle_ms must be an int from 0 to 3153600000000"),
        ({"idle_ms": 0, "batch_size": 0}, "batch_size"),
        ({"idle_ms": 0, "dry_run": "yes"}, "dry_run must be True or False"),
    ],
)
def test_bad_compaction_arguments_are_refused_before_any_io(no_io, arguments, message):
    with pytest.raises(InvalidArgument, match=message):
        no_io.compact_fences(**arguments)


# ------------------------------------------------------------- compaction
def idle_keys(h: Harness) -> dict[str, int]:
    """Three keys taken and released (fences 3, 1 and 8) and one still held (1)."""
    backend = h.backend
    for _ in range(3):
        take(backend, "idle:a")
    take(backend, "idle:b")
    h.set_fence("idle:c", 7)
    take(backend, "idle:c")
    assert backend.acquire("held", TTL).ok
    return {"idle:a": 3, "idle:b": 1, "idle:c": 8}


def test_compaction_deletes_idle_counters_after_raising_the_floor(build):
    h = build(FENCES="counter")
    backend = h.backend
    idle_keys(h)
    h.advance(10_000)
    h.set_fence("recent", 20)
    assert take(backend, "recent") == 21  # acquired after the cut-off: kept

    assert sum(backend.compact_fences(idle_ms=5_000)) == 3

    # The floor is the largest deleted fence; the highest counter left is "recent".
    assert backend.fence_state() == FenceState(backend.alias, "counter", 8, 21)
    assert take(backend, "idle:b") == 9  # its counter went: the floor carries it
    assert sum(backend.compact_fences(idle_ms=5_000)) == 0  # nothing idle is left


def test_a_dry_run_counts_and_writes_nothing(build):
    h = build(FENCES="counter")
    idle_keys(h)
    h.advance(10_000)

    assert list(h.backend.compact_fences(idle_ms=5_000, dry_run=True)) == [3]

    assert h.backend.fence_state().floor == 0
    assert take(h.backend, "idle:a") == 4


def test_compaction_keeps_a_held_lock_however_old(build):
    h = build(FENCES="counter")
    backend = h.backend
    held = backend.acquire("held-long", TTL)
    h.advance(10_000)
    assert backend.extend(held.lock_id, TTL).ok  # live, acquired long ago

    assert sum(backend.compact_fences(idle_ms=5_000)) == 0

    assert backend.release(held.lock_id).ok
    assert take(backend, "held-long") == 2


def test_compaction_goes_through_the_counters_in_batches(build):
    h = build(FENCES="counter")
    backend = h.backend
    for n in range(5):
        take(backend, f"batch:{n}")
    h.advance(10_000)

    counts = list(backend.compact_fences(idle_ms=5_000, batch_size=2))

    assert sum(counts) == 5 and all(0 <= c <= 2 for c in counts), counts
    assert backend.fence_state() == FenceState(backend.alias, "counter", 1, 0)


def test_a_counter_without_an_acquisition_time_is_stamped_then_compacted(build):
    h = build(FENCES="counter")
    backend = h.backend
    h.set_fence("legacy", 40)  # as kept by a version that stored no acquisition time

    assert list(backend.compact_fences(idle_ms=5_000, dry_run=True)) == [0]
    assert sum(backend.compact_fences(idle_ms=5_000)) == 0  # stamped now
    h.advance(10_000)
    assert sum(backend.compact_fences(idle_ms=5_000)) == 1

    assert backend.fence_state().floor == 40
    assert take(backend, "legacy") == 41


def test_compaction_in_clock_mode_raises_the_floor_too(build):
    # So that switching the alias to counter mode later stays safe.
    h = build(FENCES="clock")
    fence = take(h.backend, "clock-idle")
    h.advance(10_000)
    assert sum(h.backend.compact_fences(idle_ms=5_000)) == 1
    assert h.backend.fence_state().floor == fence
    counter = same_storage(h, FENCES="counter")
    try:
        assert take(counter, "clock-idle") == fence + 1
    finally:
        counter.close()


def test_a_key_whose_waiters_are_gone_is_compacted(build):
    # A waiter that withdrew, and one that died (its place lapsed): neither keeps the
    # counter (PostgreSQL's waiters flag stays set until the key is next taken).
    h = build(FENCES="counter")
    backend = h.backend
    for key in ("left:withdrew", "left:died"):
        held = backend.acquire(key, TTL)
        queued = WaitTicket.new()
        assert backend.acquire(key, TTL, ticket=queued).ok is False
        if key == "left:withdrew":
            backend.withdraw(key, queued.id)
        assert backend.release(held.lock_id).ok
    h.advance(PATIENCE_MS + 10_000)

    assert sum(backend.compact_fences(idle_ms=5_000)) == 2
    # The floor: 1, or 2 where the release granted the key (fence 2) to the waiter
    # that died, and the grant lapsed.
    assert take(backend, "left:died") == (3 if backend.grants else 2)


def test_compaction_never_raises_the_floor_to_the_maximum_fence(build):
    h = build(FENCES="counter")
    backend = h.backend
    h.set_fence("top", FENCE_MAX - 1)
    assert take(backend, "top") == FENCE_MAX  # the last fence this key can have
    h.advance(10_000)
    assert sum(backend.compact_fences(idle_ms=5_000)) == 1
    assert backend.fence_state().floor == FLOOR_MAX
    assert take(backend, "other") == FENCE_MAX  # one fence left for every key
