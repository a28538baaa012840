"""Opt-in telemetry: ``with_telemetry(backend, on_event)`` wraps a backend.

The wrapper emits one :class:`LockEvent` per completed operation, with hashes of
the key / lock id (raw values only when ``include_raw`` allows). They are
``hash_key``'s, as ``LockInfo`` carries them, because events are data for programs;
a callback that writes them where people read them passes them through
``keys.display_hash_of`` first. The callback is
called synchronously but its return value is never awaited and its exceptions are
logged and dropped: telemetry never changes a lock operation's outcome. Operations
that raise emit nothing. Without the wrapper no hash is computed.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from .constants import DEFAULT_TTL_MS
from .contract import LockBackend, SanitizedLookups
from .keys import hash_key, normalize_and_validate_key
from .results import AcquireResult, ExtendResult, LockInfoDebug, ReleaseResult

logger = logging.getLogger("django_syncguard.telemetry")

EventType = Literal["acquire", "release", "extend", "is_locked", "lookup"]


@dataclass(frozen=True, slots=True)
class LockEvent:
    """One completed operation. ``reason``: ``"locked"`` for a contended acquire,
    ``"expired"`` / ``"not-found"`` for a failed release or extend when known."""

    type: EventType
    result: Literal["ok", "fail"]
    key_hash: str | None = None
    lock_id_hash: str | None = None
    reason: str | None = None
    key: str | None = None
    lock_id: str | None = None


IncludeRaw = bool | Callable[[LockEvent], bool]


class TelemetryBackend(SanitizedLookups):
    """A proxy for ``inner`` that reports each completed lock operation.

    The five operations and their lookups are wrapped; every other attribute and
    operation (capabilities, housekeeping, checks, ``close``) is the wrapped
    backend's own, reached through ``__getattr__``.
    """

    def __init__(
        self,
        inner: LockBackend,
        on_event: Callable[[LockEvent], Any],
        include_raw: IncludeRaw = False,
    ) -> None:
        self.inner = inner
        self.on_event = on_event
        self.include_raw = include_raw

    def __repr__(self) -> str:
        return f"<TelemetryBackend of {self.inner!r}>"

    def __getattr__(self, name: str) -> Any:
        # Only called for names this class does not define.
        return getattr(self.inner, name)

    def _emit(
        self,
        type_: EventType,
        ok: bool,
        *,
        key: str | None = None,
        lock_id: str | None = None,
        reason: str | None = None,
    ) -> None:
        try:
            event = LockEvent(
                type=type_,
                result="ok" if ok else "fail",
                key_hash=hash_key(normalize_and_validate_key(key)) if key is not None else None,
                lock_id_hash=hash_key(lock_id) if lock_id is not None else None,
                reason=reason,
            )
            raw = self.include_raw(event) if callable(self.include_raw) else self.include_raw
            if raw:
                event = replace(event, key=key, lock_id=lock_id)
            outcome = self.on_event(event)
            if inspect.iscoroutine(outcome):
                _run_detached(outcome)
        except Exception:
            logger.exception("Telemetry callback failed; the lock operation is unaffected.")

    # Each operation: forward, then report.
    def acquire(
        self, key: str, ttl_ms: int = DEFAULT_TTL_MS, *, cancel: Any = None, **ticket: Any
    ) -> AcquireResult:
        # ``ticket=`` (a waiter's) is passed on only when given: a wrapped backend
        # without queues need not know the argument.
        result = self.inner.acquire(key, ttl_ms, cancel=cancel, **ticket)
        self._acquired(key, result)
        return result

    async def aacquire(
        self, key: str, ttl_ms: int = DEFAULT_TTL_MS, *, cancel: Any = None, **ticket: Any
    ) -> AcquireResult:
        result = await self.inner.aacquire(key, ttl_ms, cancel=cancel, **ticket)
        self._acquired(key, result)
        return result

    def _acquired(self, key: str, result: AcquireResult) -> None:
        self._emit("acquire", result.ok, key=key, lock_id=result.lock_id, reason=result.reason)

    def release(self, lock_id: str, *, cancel: Any = None) -> ReleaseResult:
        result = self.inner.release(lock_id, cancel=cancel)
        self._emit("release", result.ok, lock_id=lock_id, reason=result.reason)
        return result

    async def arelease(self, lock_id: str, *, cancel: Any = None) -> ReleaseResult:
        result = await self.inner.arelease(lock_id, cancel=cancel)
        self._emit("release", result.ok, lock_id=lock_id, reason=result.reason)
        return result

    def extend(self, lock_id: str, ttl_ms: int, *, cancel: Any = None) -> ExtendResult:
        result = self.inner.extend(lock_id, ttl_ms, cancel=cancel)
        self._emit("extend", result.ok, lock_id=lock_id, reason=result.reason)
        return result

    async def aextend(self, lock_id: str, ttl_ms: int, *, cancel: Any = None) -> ExtendResult:
        result = await self.inner.aextend(lock_id, ttl_ms, cancel=cancel)
        self._emit("extend", result.ok, lock_id=lock_id, reason=result.reason)
        return result

    def is_locked(self, key: str, *, cancel: Any = None) -> bool:
        result = self.inner.is_locked(key, cancel=cancel)
        self._emit("is_locked", result, key=key)
        return result

    async def ais_locked(self, key: str, *, cancel: Any = None) -> bool:
        result = await self.inner.ais_locked(key, cancel=cancel)
        self._emit("is_locked", result, key=key)
        return result

    def lookup_raw(
        self, *, key: str | None = None, lock_id: str | None = None, cancel: Any = None
    ) -> LockInfoDebug | None:
        info = self.inner.lookup_raw(key=key, lock_id=lock_id, cancel=cancel)
        self._emit("lookup", info is not None, key=key, lock_id=lock_id)
        return info

    async def alookup_raw(
        self, *, key: str | None = None, lock_id: str | None = None, cancel: Any = None
    ) -> LockInfoDebug | None:
        info = await self.inner.alookup_raw(key=key, lock_id=lock_id, cancel=cancel)
        self._emit("lookup", info is not None, key=key, lock_id=lock_id)
        return info


_detached: set[asyncio.Task[Any]] = set()


def _run_detached(coro: Any) -> None:
    """Run an async callback's coroutine without awaiting it (nor letting it fail us)."""
    try:
        task = asyncio.get_running_loop().create_task(coro)
    except RuntimeError:
        coro.close()
        logger.warning("An async telemetry callback needs a running event loop; dropped.")
        return
    _detached.add(task)
    task.add_done_callback(_detached_done)


def _detached_done(task: asyncio.Task[Any]) -> None:
    _detached.discard(task)
    if not task.cancelled() and task.exception() is not None:
        logger.error("Async telemetry callback failed.", exc_info=task.exception())


def with_telemetry(
    backend: LockBackend,
    on_event: Callable[[LockEvent], Any],
    include_raw: IncludeRaw = False,
) -> TelemetryBackend:
    """Wrap ``backend`` so that every completed operation calls ``on_event(event)``."""
    return TelemetryBackend(backend, on_event, include_raw)
