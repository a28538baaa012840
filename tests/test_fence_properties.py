"""Fence continuity as a property, on every backend (hypothesis): any interleaving of
acquisitions, releases, compactions, floor raises, time passing and, on Redis in clock
mode, counters lost with their server never gives a key a fence that is not above
every earlier fence of that key (``specs/guarantees.md``, Fence continuity)."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.harness import (
    HARNESSES,
    Harness,
    MemoryHarness,
    RedisHarness,
)

TTL = 60_000
KEYS = 3
# Examples per backend and mode: the server backends pay a few round trips per step.
EXAMPLES = {
    "memory": 200,
    "sqlite": 40,
    "postgres": 40,
    "pgbouncer": 20,
    "redis": 40,
    "redis-sentinel": 15,
    "redis-cluster": 20,
    "firestore": 15,
}

KEY = st.integers(0, KEYS - 1)
# Acquisitions and releases come most often: a compaction or a lost counter matters
# between two acquisitions of one key.
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("acquire"), KEY),
        st.tuples(st.just("release"), KEY),
        st.tuples(st.just("cycle"), KEY),
        st.tuples(st.just("cycle"), KEY),
        st.tuples(st.just("compact"), st.sampled_from([0, 2_000, 10_000])),
        st.tuples(st.just("floor"), st.integers(-3, 3)),
        st.tuples(st.just("advance"), st.sampled_from([1_000, 5_000, 30_000])),
        st.tuples(st.just("lose"), KEY),
    ),
    min_size=1,
    max_size=24,
)


class Model:
    """One example: the keys, the fences seen, the locks we hold."""

    def __init__(self, h: Harness, mode: str, run: int) -> None:
        self.h, self.backend, self.mode = h, h.backend, mode
        self.keys = [f"prop{run}:{n}" for n in range(KEYS)]
        self.last: dict[str, int] = {}
        self.held: dict[str, str] = {}

    def step(self, action: str, arg: int) -> None:
        getattr(self, action)(arg)
        if isinstance(self.h, MemoryHarness):
            self.h.advance(1)  # time passes between steps on the fake clock too

    def cycle(self, n: int) -> None:
        self.acquire(n)
        self.release(n)

    def acquire(self, n: int) -> None:
        key = self.keys[n]
        if key in self.held:
            return
        result = self.backend.acquire(key, TTL)
        if not result.ok:  # a lock of ours aged past its TTL is free; still held here
            return
        fence = int(result.fence)
        assert fence > self.last.get(key, 0), (key, fence, self.last.get(key))
        self.last[key], self.held[key] = fence, result.lock_id

    def release(self, n: int) -> None:
        lock_id = self.held.pop(self.keys[n], None)
        if lock_id is not None:
            self.backend.release(lock_id)  # "expired" after time passed: fine

    def compact(self, idle_ms: int) -> None:
        list(self.backend.compact_fences(idle_ms=idle_ms))

    def floor(self, offset: int) -> None:
        # Near the fences of the keys: in counter mode the largest seen, in clock mode
        # the clock (a floor far above them would hide what the counters do).
        clock = self.mode == "clock"
        base = self.h.now_ms() if clock else max(self.last.values(), default=0)
        self.backend.raise_fence_floor(max(0, base + offset))

    def advance(self, ms: int) -> None:
        self.h.advance(ms)

    def lose(self, n: int) -> None:
        """Redis in clock mode only: the key's hash (lock and counter) is lost, as in a
        restart without persistence. The outage lasts until the server's clock has
        passed the key's last fence (the assumption of clock mode)."""
        if not isinstance(self.h, RedisHarness) or self.mode != "clock":
            return
        key = self.keys[n]
        self.h.redis.client.delete(self.h.redis.lock_key(key))
        self.held.pop(key, None)
        last = self.last.get(key, 0)
        while self.h.now_ms() <= last and self.backend.fence_floor() < last:
            time.sleep(0.001)  # the outage: real time on the server's clock

    def close(self) -> None:
        for lock_id in self.held.values():
            self.backend.release(lock_id)


@pytest.mark.parametrize("mode", ["clock", "counter"])
def test_no_interleaving_sends_a_fence_back(kind, mode):
    h = HARNESSES[kind](FENCES=mode)
    runs = itertools.count()

    @settings(
        max_examples=EXAMPLES[kind],
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        database=None,
    )
    @given(steps=STEPS)
    def check(steps: list[tuple[str, Any]]) -> None:
        model = Model(h, mode, next(runs))
        try:
            for action, arg in steps:
                model.step(action, arg)
        finally:
            model.close()

    try:
        check()
    finally:
        h.close()
