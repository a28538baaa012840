"""The retry schedule of ``lock()`` / ``locked()``: the specification's formulas.

Backends try once (specs/contract.md, Operations); the waiting loop
(:func:`~django_syncguard.acquisition.acquire_with_retry`) retries on contention at the delays this
module computes, and gives up when it says so. With ``attempt`` the 1-based number
of failed attempts::

    exponential: base = retry_delay_ms * 2 ** (attempt - 1)
    fixed:       base = retry_delay_ms
    equal jitter: delay = base / 2 + random() * base / 2
    full jitter:  delay = random() * base
    no jitter:    delay = base

then ``delay = min(delay, timeout_ms - elapsed)``. Total attempts are at most
``max_retries + 1``; once the time is used up (or the attempts are), the loop raises
``AcquisitionTimeout``. A delay of 0 (``retry_delay_ms=0``) retries at once rather
than ending the loop: only elapsed time ends it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from .constants import (
    DEFAULT_BACKOFF,
    DEFAULT_JITTER,
    DEFAULT_MAX_RETRIES,
    DEFAULT_RETRY_DELAY_MS,
    DEFAULT_TIMEOUT_MS,
)
from .errors import AcquisitionTimeout, InvalidArgument
from .keys import display_hash

Backoff = Literal["exponential", "fixed"]
Jitter = Literal["equal", "full", "none"]

# 2.0 ** 1023 is the largest power of two a float holds; past it the delay would be
# clamped to the remaining time anyway.
_MAX_EXPONENT = 1000

#: The jitter source of every schedule (tests pass their own).
rng = random.Random().random


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Validated retry options; ``InvalidArgument`` on construction when malformed."""

    max_retries: int = DEFAULT_MAX_RETRIES
    retry_delay_ms: float = DEFAULT_RETRY_DELAY_MS
    timeout_ms: float = DEFAULT_TIMEOUT_MS
    backoff: Backoff = DEFAULT_BACKOFF
    jitter: Jitter = DEFAULT_JITTER

    def __post_init__(self) -> None:
        if _not_number(self.max_retries, integral=True) or self.max_retries < 0:
            raise InvalidArgument(f"max_retries must be an int >= 0, not {self.max_retries!r}.")
        if _not_number(self.retry_delay_ms) or self.retry_delay_ms < 0:
            raise InvalidArgument(
                f"retry_delay_ms must be a number >= 0, not {self.retry_delay_ms!r}."
            )
        if _not_number(self.timeout_ms) or self.timeout_ms <= 0:
            raise InvalidArgument(f"timeout_ms must be a number > 0, not {self.timeout_ms!r}.")
        if self.backoff not in ("exponential", "fixed"):
            raise InvalidArgument(
                f"backoff must be 'exponential' or 'fixed', not {self.backoff!r}."
            )
        if self.jitter not in ("equal", "full", "none"):
            raise InvalidArgument(f"jitter must be 'equal', 'full' or 'none', not {self.jitter!r}.")

    def delay_ms(self, attempt: int, rng: Callable[[], float]) -> float:
        """Delay before retrying after the ``attempt``-th failed attempt (1-based),
        before clamping to the remaining time."""
        if self.backoff == "exponential":
            base = self.retry_delay_ms * 2.0 ** min(attempt - 1, _MAX_EXPONENT)
        else:
            base = float(self.retry_delay_ms)
        if self.jitter == "equal":
            return base / 2 + rng() * (base / 2)
        if self.jitter == "full":
            return rng() * base
        return base

    def longest_wait_ms(self) -> float:
        """How long, at most, the waiting loop waits between its first attempt and its
        last: ``timeout_ms``, or less when its ``max_retries`` delays add up to less
        (each delay is at most its base: every jitter only shortens it). The system
        check ``syncguard.W005`` compares it with the lease a killed holder leaves."""
        if self.backoff == "fixed":
            by_retries = float(self.retry_delay_ms) * self.max_retries
        else:  # the bases 1, 2, 4, ... times retry_delay_ms add up to 2 ** n - 1 times it
            by_retries = self.retry_delay_ms * (2.0 ** min(self.max_retries, _MAX_EXPONENT) - 1)
        return min(float(self.timeout_ms), by_retries)


def _not_number(value: Any, *, integral: bool = False) -> bool:
    kinds: tuple[type, ...] = (int,) if integral else (int, float)
    return isinstance(value, bool) or not isinstance(value, kinds) or value != value


@dataclass
class RetrySchedule:
    """One acquisition's retry budget: the attempts made and the time left."""

    policy: RetryPolicy
    clock: Callable[[], float]
    rng: Callable[[], float]
    key: str
    attempt: int = 0
    started: float = 0.0

    def start(self) -> None:
        self.started = self.clock()

    def next_delay_s(self) -> float:
        """After a failed attempt: seconds to wait, or ``AcquisitionTimeout``."""
        self.attempt += 1
        attempts = self.attempt
        if attempts > self.policy.max_retries:
            raise self._timeout(f"{attempts} attempts (max_retries={self.policy.max_retries})")
        remaining_s = self.remaining_s()
        if remaining_s <= 0:
            raise self._timeout(f"{self.policy.timeout_ms:g} ms ({attempts} attempts)")
        return min(self.policy.delay_ms(attempts, self.rng) / 1000, remaining_s)

    def remaining_s(self) -> float:
        return max(self.policy.timeout_ms / 1000 - (self.clock() - self.started), 0.0)

    def check_time(self) -> None:
        """``AcquisitionTimeout`` once ``timeout_ms`` has passed."""
        if self.remaining_s() <= 0:
            raise self._timeout(f"{self.policy.timeout_ms:g} ms ({self.attempt + 1} attempts)")

    def _timeout(self, after: str) -> AcquisitionTimeout:
        """The error for giving up; it names the key by its display hash (the raw key is
        in the context only, as logs and error trackers show messages)."""
        key_hash = display_hash(self.key)
        return AcquisitionTimeout(
            f"Lock on key {key_hash} still held after {after}.",
            context={"key": self.key, "key_hash": key_hash},
        )
