"""Acquire and hold: the one code path behind ``locked``, ``lock()`` and ``alock()``.

:class:`LockOptions` declares the acquisition options once; every entry point takes
them as keyword arguments (``**options: Unpack[LockOptions]``) and hands them to
:meth:`LockSpec.from_options`, which validates them (before any I/O) into a frozen
:class:`LockSpec`. :meth:`LockSpec.hold` / :meth:`LockSpec.ahold` then resolve the
backend, acquire in the waiting loop (:func:`acquire_with_retry`, the end of this
module) on the retry schedule of :mod:`~django_syncguard.retry`, yield the
:class:`~django_syncguard.leases.Lease` and always release it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any, Literal, Protocol, TypedDict

from . import signals
from .cancellation import CancelToken, asleep, sleep, validate_cancel
from .constants import DEFAULT_TTL_MS
from .contract import LockBackend, QueueingBackend, queues_of
from .errors import AcquisitionTimeout, InvalidArgument
from .handler import resolve_backend
from .keys import display_hash, normalize_and_validate_key
from .leases import Lease, pop_current, push_current
from .results import AcquireResult
from .retry import Backoff, Jitter, RetryPolicy, RetrySchedule
from .retry import rng as default_rng
from .signals import Outgoing
from .transactions import HoldStart, hold_start, release_after
from .ttl import validate_ttl
from .waiting import WaitSession, WaitTicket

OnContended = Literal["wait", "skip", "raise"]

logger = logging.getLogger("django_syncguard.acquisition")

ReleaseErrorHandler = Callable[[BaseException, dict[str, str]], Any]


class LockOptions(TypedDict, total=False):
    """The acquisition options of ``locked``, ``lock()`` and ``alock()``: the one list.

    Each default and check lives once, with the value that holds the option: the
    retry options in :class:`~django_syncguard.retry.RetryPolicy`, the others in
    :class:`LockSpec` (a test keeps both in step with this list). See
    ``specs/contract.md`` (Helpers) for what each one does.
    """

    using: str | LockBackend
    ttl_ms: int
    max_retries: int
    retry_delay_ms: float
    timeout_ms: float
    backoff: Backoff
    jitter: Jitter
    cancel: Any
    on_release_error: ReleaseErrorHandler | None
    auto_extend: bool
    until_commit: bool
    on_contended: OnContended


class Skipped(Exception):
    """``on_contended="skip"`` found the key held: the caller returns ``None``."""


@dataclass(frozen=True)
class LockSpec:
    """Validated :class:`LockOptions`; reads no settings."""

    using: str | LockBackend = "default"
    ttl_ms: int = DEFAULT_TTL_MS
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    cancel: CancelToken | None = None
    on_release_error: ReleaseErrorHandler | None = None
    auto_extend: bool = False
    until_commit: bool = True
    on_contended: OnContended = "wait"

    @classmethod
    def from_options(cls, caller: str, options: Mapping[str, Any]) -> LockSpec:
        """Build from the keyword options ``caller`` received; ``InvalidArgument``
        names any option that does not exist."""
        unknown = set(options) - OPTION_NAMES
        if unknown:
            raise InvalidArgument(
                f"{caller}() got unknown option(s) {', '.join(sorted(unknown))}; "
                f"the options are {', '.join(sorted(OPTION_NAMES))}."
            )
        retry = {name: options[name] for name in RETRY_OPTIONS if name in options}
        rest = {name: value for name, value in options.items() if name not in RETRY_OPTIONS}
        return cls(policy=RetryPolicy(**retry), **rest)

    def __post_init__(self) -> None:
        validate_ttl(self.ttl_ms)
        validate_cancel(self.cancel)
        if not isinstance(self.using, str) and not callable(getattr(self.using, "acquire", None)):
            raise InvalidArgument("using must be an alias of SYNCGUARD_BACKENDS or a backend.")
        if self.on_release_error is not None and not callable(self.on_release_error):
            raise InvalidArgument("on_release_error must be callable.")
        if not isinstance(self.auto_extend, bool):
            raise InvalidArgument("auto_extend must be True or False.")
        if not isinstance(self.until_commit, bool):
            raise InvalidArgument("until_commit must be True or False.")
        if self.on_contended not in ("wait", "skip", "raise"):
            raise InvalidArgument(
                f"on_contended must be 'wait', 'skip' or 'raise', not {self.on_contended!r}."
            )

    @contextmanager
    def hold(self, key: str) -> Iterator[Lease]:
        """Acquire (waiting as ``on_contended`` says), yield the lease, always release.

        Raises :class:`Skipped` when ``on_contended="skip"`` finds the key held.
        """
        key = normalize_and_validate_key(key)
        backend = resolve_backend(self.using)
        # What the end of the hold needs to find the transactions it waits for: read
        # before the wait, so that the end does not (see _end).
        start = hold_start() if self.until_commit else None
        attempts = _Attempts(backend, key)
        result = self._take(backend, key, attempts)
        lease = Lease(backend, key, result, self.ttl_ms)
        token = push_current(lease)
        try:
            # Inside the try: whatever a receiver does, the lock is released.
            signals.send(attempts.acquired(lease))
            if self.auto_extend:
                lease.start_renewal()
            yield lease
        finally:
            pop_current(token)
            self._end(lease, start)

    @asynccontextmanager
    async def ahold(self, key: str) -> AsyncIterator[Lease]:
        """Async twin of :meth:`hold`."""
        key = normalize_and_validate_key(key)
        backend = resolve_backend(self.using)
        attempts = _Attempts(backend, key)
        result = await self._atake(backend, key, attempts)
        lease = Lease(backend, key, result, self.ttl_ms)
        token = push_current(lease)
        try:
            # Inside the try: a cancelled send or a receiver still ends in a release.
            await signals.asend(attempts.acquired(lease))
            if self.auto_extend:
                lease.start_renewal(asynchronous=True)
            yield lease
        finally:
            pop_current(token)
            try:
                # Shielded: a cancelled task still releases its lock.
                await asyncio.shield(lease.arelease())
            except Exception as exc:
                self._release_failed(exc, lease)

    def _take(self, backend: LockBackend, key: str, attempts: _Attempts) -> AcquireResult:
        """One attempt (``"skip"``, ``"raise"``), or the waiting loop, with a queue
        ticket and wake-ups when the backend keeps queues (``"wait"``). Signals count
        attempts as the retry loop does: the queueing request a wait session adds to
        its first contended attempt is part of that attempt."""

        def counted(result: AcquireResult) -> AcquireResult:
            signals.send(attempts.count(result))
            return result

        def plain() -> AcquireResult:
            return counted(backend.acquire(key, self.ttl_ms, cancel=self.cancel))

        if self.on_contended != "wait":
            return self._checked_single(plain(), key)
        queues = queues_of(backend)
        if queues is None:
            return acquire_with_retry(plain, self.policy, key=key, cancel=self.cancel)
        queueing, wake_ups = queues

        def request(ticket: WaitTicket | None) -> AcquireResult:
            return queueing.acquire(key, self.ttl_ms, cancel=self.cancel, ticket=ticket)

        session = WaitSession(wake_ups, key)
        try:
            return acquire_with_retry(
                lambda: counted(session.attempt(request)),
                self.policy,
                key=key,
                cancel=self.cancel,
                session=session,
            )
        except BaseException:
            _withdraw(queueing, key, session)
            raise
        finally:
            session.close()

    async def _atake(self, backend: LockBackend, key: str, attempts: _Attempts) -> AcquireResult:
        """Async twin of :meth:`_take`."""

        async def counted(pending: Awaitable[AcquireResult]) -> AcquireResult:
            result = await pending
            await signals.asend(attempts.count(result))
            return result

        def plain() -> Awaitable[AcquireResult]:
            return counted(backend.aacquire(key, self.ttl_ms, cancel=self.cancel))

        if self.on_contended != "wait":
            return self._checked_single(await plain(), key)
        queues = queues_of(backend)
        if queues is None:
            return await aacquire_with_retry(plain, self.policy, key=key, cancel=self.cancel)
        queueing, wake_ups = queues

        async def request(ticket: WaitTicket | None) -> AcquireResult:
            return await queueing.aacquire(key, self.ttl_ms, cancel=self.cancel, ticket=ticket)

        session = WaitSession(wake_ups, key)
        try:
            return await aacquire_with_retry(
                lambda: counted(session.aattempt(request)),
                self.policy,
                key=key,
                cancel=self.cancel,
                session=session,
            )
        except BaseException:
            # Shielded: a cancelled waiter still gives its place up.
            await asyncio.shield(_awithdraw(queueing, key, session))
            raise
        finally:
            session.close()

    def _checked_single(self, result: AcquireResult, key: str) -> AcquireResult:
        if result.ok:
            return result
        if self.on_contended == "skip":
            raise Skipped(key)
        key_hash = display_hash(key)
        raise AcquisitionTimeout(
            f"Lock on key {key_hash} is held (on_contended='raise': one attempt, no wait).",
            context={"key": key, "key_hash": key_hash},
        )

    def _end(self, lease: Lease, start: HoldStart | None) -> None:
        """Release now, or, with ``until_commit`` inside ``transaction.atomic()``, when
        the running thread's transactions end (see :mod:`.transactions`). Meanwhile
        the lease stays the holder's: auto-extend keeps renewing it. ``start`` is what
        the hold read of the thread's connections when it began (None without
        ``until_commit``): listing them again here would cost the next holder, who
        waits for this release, tens of microseconds on a thread that slept through
        its hold (issue 24: 60 µs of a 1 ms Redis hand-off)."""
        transactions = [] if start is None else start.open_transactions()
        if not transactions:
            self._release(lease)
            return
        if logger.isEnabledFor(logging.DEBUG):  # the keyed hash costs a few µs
            logger.debug(
                "Lock on key %s: release deferred until %d transaction(s) end.",
                display_hash(lease.key),
                len(transactions),
            )
        release_after(partial(self._release, lease), transactions)

    def _release(self, lease: Lease) -> None:
        # The caller's cancel must not stop the release: it would leave the lock held.
        try:
            lease.release()
        except Exception as exc:
            self._release_failed(exc, lease)

    def _release_failed(self, exc: BaseException, lease: Lease) -> None:
        """Report a release error without masking the critical section's outcome."""
        if self.on_release_error is None:
            logger.warning(
                "Releasing the lock on key %s failed: %r. It will expire by its TTL.",
                display_hash(lease.key),
                exc,
            )
            return
        try:
            self.on_release_error(exc, {"key": lease.key, "lock_id": lease.lock_id})
        except Exception:
            logger.exception("on_release_error raised; ignored.")


#: The option names, and those of them that :class:`RetryPolicy` holds.
OPTION_NAMES = frozenset(LockOptions.__annotations__)
RETRY_OPTIONS = frozenset(f.name for f in fields(RetryPolicy))


def _withdraw(backend: QueueingBackend, key: str, session: WaitSession) -> None:
    """Give up a queued ticket (best effort: an unreachable server drops it by its
    patience)."""
    if not session.queued or session.ticket is None:
        return
    try:
        backend.withdraw(key, session.ticket.id)
    except Exception as exc:
        logger.debug("Withdrawing a wait ticket on key %s failed: %r", display_hash(key), exc)


async def _awithdraw(backend: QueueingBackend, key: str, session: WaitSession) -> None:
    if not session.queued or session.ticket is None:
        return
    try:
        await backend.awithdraw(key, session.ticket.id)
    except Exception as exc:
        logger.debug("Withdrawing a wait ticket on key %s failed: %r", display_hash(key), exc)


class _Attempts:
    """Counts a hold's acquire attempts for ``lock_contended`` and ``lock_acquired``.

    Wrapping the attempt callable keeps the retry loop (``retry.py``) unaware of
    signals.
    """

    def __init__(self, backend: LockBackend, key: str) -> None:
        self.backend = backend
        self.key = key
        self.made = 0

    def count(self, result: AcquireResult) -> list[Outgoing]:
        """Record one attempt; a contended one calls for ``lock_contended``."""
        self.made += 1
        if result.ok:
            return []
        return signals.prepare(
            signals.lock_contended, self.backend, key=self.key, attempt=self.made
        )

    def acquired(self, lease: Lease) -> list[Outgoing]:
        """``lock_acquired`` for the lease the last attempt produced."""
        return lease._signal(
            signals.lock_acquired, expires_at_ms=lease.expires_at_ms, attempts=self.made
        )


# ------------------------------------------------------------------ the waiting loop
# RetrySchedule says when the next counted attempt is due and when to give up; the loop
# makes the attempts. Without a wait session it sleeps the backoff delay between
# attempts (OPTIONS["WAKE_UPS"] = False, or a backend without queues). With one it
# pauses on the waiter's listener, which may end the pause early (a release woke it, a
# check-in, a poll): such an attempt is extra and uses up no retry, and the pause goes
# on until the same due time. The attempt at the due time is always sent and always
# counts, so max_retries, the delays and timeout_ms bound the wait exactly as the
# formulas say, whether or not wake-ups are on (specs/decisions.md, 36).


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
    of ``policy`` gives up (see the comment above)."""
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
