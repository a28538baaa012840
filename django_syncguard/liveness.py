"""The one liveness predicate and the clocks that feed it."""

from __future__ import annotations

import time
from typing import Protocol

from .constants import TIME_TOLERANCE_MS


def is_live(expires_at_ms: int, now_ms: int, tolerance_ms: int = TIME_TOLERANCE_MS) -> bool:
    """True while a lock that expires at ``expires_at_ms`` still counts as held.

    Every backend and every operation uses this (with ``TIME_TOLERANCE_MS``), so a lock
    stays live until ``expires_at_ms + tolerance_ms`` wherever it is stored.
    """
    return expires_at_ms > now_ms - tolerance_ms


class Clock(Protocol):
    """Anything that returns the current Unix time in whole milliseconds."""

    def __call__(self) -> int: ...


def system_clock_ms() -> int:
    """The client's wall clock, in Unix milliseconds."""
    return time.time_ns() // 1_000_000


class FakeClock:
    """A clock that only moves when told to; for tests of client-time code.

    >>> clock = FakeClock(1_000); clock.advance(500); clock()
    1500
    """

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self.now_ms = start_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: int) -> None:
        self.now_ms += ms
