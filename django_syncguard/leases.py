"""Leases: a held lock as the helpers hand it to your code.

A :class:`Lease` is what ``with locked(...) as lease`` yields and what
:func:`current_lock` returns inside a decorated view or task. It knows its key,
lock id and fence, can be extended or released, and, with ``auto_extend=True``,
renews itself in the background every third of its TTL. A lease whose lock is gone
(a renewal or explicit extend found it expired, or it had expired by release time)
is *lost*: ``lease.lost`` is true and a warning is logged. Writes guarded by its
fence will then be rejected by :func:`~django_syncguard.fencing.fenced_update`.

Each step sends its signal from :mod:`django_syncguard.signals` (acquired,
contended, extended, lost, released). The state changes are synchronous code
shared by both paths; they return the signals due and the sync or async caller
sends them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextvars import ContextVar, Token
from typing import Any

from django.dispatch import Signal

from . import signals
from .contract import LockBackend
from .errors import LockError
from .keys import display_hash
from .results import AcquireResult, ExtendResult, ReleaseResult
from .signals import Outgoing
from .ttl import validate_ttl

logger = logging.getLogger("django_syncguard.leases")

_held: ContextVar[tuple[Lease, ...]] = ContextVar("django_syncguard_held", default=())


def current_lock() -> Lease | None:
    """The innermost lease held by the running code (thread or task), or ``None``."""
    held = _held.get()
    return held[-1] if held else None


def push_current(lease: Lease) -> Token[tuple[Lease, ...]]:
    """Make ``lease`` the running code's innermost one; undo with :func:`pop_current`."""
    return _held.set((*_held.get(), lease))


def pop_current(token: Token[tuple[Lease, ...]]) -> None:
    """Undo the :func:`push_current` that returned ``token``."""
    _held.reset(token)


class Lease:
    """A lock held through ``lock()`` / ``locked()``; see the module docstring."""

    def __init__(self, backend: LockBackend, key: str, result: AcquireResult, ttl_ms: int) -> None:
        assert result.ok and result.lock_id is not None and result.expires_at_ms is not None
        self.backend = backend
        self.key = key
        self.lock_id: str = result.lock_id
        self.fence: str | None = result.fence
        self.expires_at_ms: int = result.expires_at_ms
        self.ttl_ms = ttl_ms
        self._mutex = threading.Lock()
        self._released = False
        self._lost = False
        # Local estimate of the expiry, for giving up on renewal after errors.
        self._deadline = time.monotonic() + ttl_ms / 1000
        self._renewer: _ThreadRenewer | None = None
        self._arenewer: asyncio.Task[None] | None = None
        # True while the renewal task sleeps: the only moment a release may cancel it.
        self._arenewer_idle = False

    def __repr__(self) -> str:
        state = "released" if self._released else "lost" if self._lost else "held"
        return f"<Lease key={self.key!r} fence={self.fence} {state}>"

    @property
    def lost(self) -> bool:
        """True once the lock is known to be gone while this lease still counted on it."""
        return self._lost

    @property
    def released(self) -> bool:
        return self._released

    # ------------------------------------------------------------------ extend
    def extend(self, ttl_ms: int | None = None) -> ExtendResult:
        """Reset the expiry to now + ``ttl_ms`` (default: the lease's TTL)."""
        ttl = validate_ttl(self.ttl_ms if ttl_ms is None else ttl_ms)
        result = self.backend.extend(self.lock_id, ttl)
        signals.send(self._extended(result, ttl))
        return result

    async def aextend(self, ttl_ms: int | None = None) -> ExtendResult:
        ttl = validate_ttl(self.ttl_ms if ttl_ms is None else ttl_ms)
        result = await self.backend.aextend(self.lock_id, ttl)
        await signals.asend(self._extended(result, ttl))
        return result

    def _extended(self, result: ExtendResult, ttl_ms: int) -> list[Outgoing]:
        """Record an extend's outcome; return the signals it calls for."""
        if result.ok and result.expires_at_ms is not None:
            self.expires_at_ms = result.expires_at_ms
            self._deadline = time.monotonic() + ttl_ms / 1000
            return self._signal(signals.lock_extended, expires_at_ms=result.expires_at_ms)
        if not self._released:
            return self._mark_lost("the lock had expired when extending it", reason="expired")
        return []

    # ----------------------------------------------------------------- release
    def release(self) -> ReleaseResult:
        """Release the lock. A second call returns ``ok=False`` without I/O."""
        if not self._begin_release():
            return ReleaseResult(ok=False)
        if self._renewer is not None:
            self._renewer.stop()
        result = self.backend.release(self.lock_id)
        signals.send(self._released_result(result))
        return result

    async def arelease(self) -> ReleaseResult:
        if not self._begin_release():
            return ReleaseResult(ok=False)
        if self._arenewer is not None:
            await self._stop_arenewer(self._arenewer)
        if self._renewer is not None:
            await asyncio.to_thread(self._renewer.stop)
        result = await self.backend.arelease(self.lock_id)
        await signals.asend(self._released_result(result))
        return result

    def _begin_release(self) -> bool:
        with self._mutex:
            first = not self._released
            self._released = True
        return first

    def _released_result(self, result: ReleaseResult) -> list[Outgoing]:
        """Record a release's outcome; return the signals it calls for (lost first)."""
        lost = []
        if not result.ok:
            lost = self._mark_lost("the lock had expired before it was released", reason="expired")
        return [*lost, *self._signal(signals.lock_released, ok=result.ok)]

    # ----------------------------------------------------------------- renewal
    def start_renewal(self, *, asynchronous: bool = False) -> None:
        """Renew every third of the TTL until released (a thread, or a task)."""
        interval = self.ttl_ms / 3000
        if asynchronous:
            self._arenewer = asyncio.get_running_loop().create_task(self._arenew(interval))
        else:
            self._renewer = _ThreadRenewer(self, interval)
            self._renewer.start()

    def _renew_outcome(
        self, result: ExtendResult | None, error: LockError | None
    ) -> tuple[bool, list[Outgoing]]:
        """Record one renewal; return whether to keep renewing and the signals due."""
        if self._released:
            return False, []
        if error is None and result is not None:
            return result.ok, self._extended(result, self.ttl_ms)
        if time.monotonic() >= self._deadline:
            why = f"renewal kept failing ({error.code if error else '?'}) until expiry"
            return False, self._mark_lost(why, reason="error")
        logger.warning(
            "Renewing the lock on key %s failed (%s); retrying.",
            display_hash(self.key),
            error.code if error else "?",
        )
        return True, []

    def _renew_once(self) -> bool:
        try:
            keep, due = self._renew_outcome(self.backend.extend(self.lock_id, self.ttl_ms), None)
        except LockError as exc:
            keep, due = self._renew_outcome(None, exc)
        signals.send(due)
        return keep

    async def _arenew(self, interval: float) -> None:
        while not self._released:
            self._arenewer_idle = True
            await asyncio.sleep(interval)
            self._arenewer_idle = False
            try:
                result = await self.backend.aextend(self.lock_id, self.ttl_ms)
                keep, due = self._renew_outcome(result, None)
            except LockError as exc:
                keep, due = self._renew_outcome(None, exc)
            await signals.asend(due)
            if not keep:
                return

    async def _stop_arenewer(self, task: asyncio.Task[None]) -> None:
        """Stop the renewal task: cancel it while it sleeps, else let its renewal end.

        Cancelling it mid-renewal could cut a ``lock_extended`` / ``lock_lost`` off
        half-way through its receivers; waiting keeps each signal whole and before
        ``lock_released``. A renewal answered after ``_begin_release`` is ignored by
        ``_renew_outcome``, and ``_arenew`` checks ``_released`` before sleeping again.
        """
        if self._arenewer_idle:
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    def _mark_lost(self, why: str, *, reason: str) -> list[Outgoing]:
        """Mark the lease lost (once); return the ``lock_lost`` signal when this was it."""
        with self._mutex:
            first = not self._lost
            self._lost = True
        if not first:
            return []
        logger.warning(
            "Lost the lock on key %s (fence %s): %s. Writes fenced with this fence "
            "will be rejected.",
            display_hash(self.key),
            self.fence,
            why,
        )
        return self._signal(signals.lock_lost, reason=reason)

    def _signal(self, signal: Signal, **extra: Any) -> list[Outgoing]:
        """``signal`` about this lease, with its hashes and fence (see ``signals``)."""
        return signals.prepare(
            signal, self.backend, key=self.key, lock_id=self.lock_id, fence=self.fence, **extra
        )


class _ThreadRenewer(threading.Thread):
    def __init__(self, lease: Lease, interval: float) -> None:
        super().__init__(name=f"syncguard-renew-{display_hash(lease.key)[:8]}", daemon=True)
        self.lease = lease
        self.interval = interval
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            if not self.lease._renew_once():
                return

    def stop(self) -> None:
        self._stop_event.set()
        if self is not threading.current_thread():
            self.join()
