"""The waiting loop: attempts until the key is taken or the retry schedule gives up.

:class:`~django_syncguard.retry.RetrySchedule` says when the next counted attempt is
due and when to give up; this module makes the attempts. Without a wait session it
sleeps the backoff delay between attempts (``OPTIONS["WAKE_UPS"] = False``, or a
backend without queues). With one (:class:`~.session.WaitSession`) it pauses on the
waiter's listener, which may end the pause early (a release woke it, a check-in, a
poll): such an attempt is extra and uses up no retry, and the pause goes on until the
same due time. The attempt at the due time is always sent and always counts, so
``max_retries``, the delays and ``timeout_ms`` bound the wait exactly as the
formulas say, whether or not wake-ups are on.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from ..cancellation import CancelToken, asleep, sleep
from ..results import AcquireResult
from ..retry import RetryPolicy, RetrySchedule
from ..retry import rng as default_rng


class Pauses(Protocol):
    """What the loop asks of a wait session (:class:`~.session.WaitSession`)."""

    def pause(
        self, delay_s: float, remaining_s: float, cancel: CancelToken | None, position: int | None
    ) -> None: ...


class APauses(Protocol):
    """What the async loop asks of a wait session."""

    async def apause(
        self, delay_s: float, remaining_s: float, cancel: CancelToken | None, position: int | None
    ) -> None: ...


def acquire_with_retry(
    acquire: Callable[[], AcquireResult],
    policy: RetryPolicy,
    *,
    key: str,
    cancel: CancelToken | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleeper: Callable[[float, CancelToken | None], None] = sleep,
    rng: Callable[[], float] = default_rng,
    session: Pauses | None = None,
) -> AcquireResult:
    """Call ``acquire`` until it succeeds; ``AcquisitionTimeout`` when the schedule
    of ``policy`` gives up (see the module docstring)."""
    schedule = RetrySchedule(policy, clock, rng, key)
    schedule.start()
    result = acquire()
    while not result.ok:
        delay = schedule.next_delay_s()
        if session is None:
            sleeper(delay, cancel)
            result = acquire()
            continue
        due = clock() + delay
        while True:
            left = max(due - clock(), 0.0)
            session.pause(left, schedule.remaining_s(), cancel, result.queue_position)
            result = acquire()
            if result.ok or clock() >= due:
                break  # taken, or the schedule's attempt (counted by next_delay_s)
            schedule.check_time()
    return result


async def aacquire_with_retry(
    acquire: Callable[[], Awaitable[AcquireResult]],
    policy: RetryPolicy,
    *,
    key: str,
    cancel: CancelToken | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleeper: Callable[[float, CancelToken | None], Awaitable[None]] = asleep,
    rng: Callable[[], float] = default_rng,
    session: APauses | None = None,
) -> AcquireResult:
    """Async twin of :func:`acquire_with_retry`."""
    schedule = RetrySchedule(policy, clock, rng, key)
    schedule.start()
    result = await acquire()
    while not result.ok:
        delay = schedule.next_delay_s()
        if session is None:
            await sleeper(delay, cancel)
            result = await acquire()
            continue
        due = clock() + delay
        while True:
            left = max(due - clock(), 0.0)
            await session.apause(left, schedule.remaining_s(), cancel, result.queue_position)
            result = await acquire()
            if result.ok or clock() >= due:
                break
            schedule.check_time()
    return result
