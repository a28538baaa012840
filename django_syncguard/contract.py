"""The backend contract as a type: what the rest of the package asks of a backend.

The core modules (the acquisition code, leases, decorators, the handler, telemetry,
signals, the inspector) are written against :class:`LockBackend`, never against a
module of ``backends/``: the bundled backends subclass
:class:`~django_syncguard.backends.base.BaseLockBackend`, which implements this
protocol, and the telemetry wrapper implements it by forwarding. See
``specs/contract.md`` (Operations, Housekeeping).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final, Protocol, cast

from .results import (
    AcquireResult,
    Capabilities,
    ExtendResult,
    LockInfo,
    LockInfoDebug,
    LockPage,
    ReleaseResult,
)

if TYPE_CHECKING:
    from .fence_floors import FenceState
    from .waiting import WaitTicket, WakeUps


def missing_operations(backend_cls: type) -> list[str]:
    """The contract operations ``backend_cls`` does not define (empty when it fits)."""
    return [name for name in OPERATIONS if not callable(getattr(backend_cls, name, None))]


class SanitizedLookups:
    """``lookup`` / ``alookup`` in terms of ``lookup_raw`` / ``alookup_raw``: what a
    backend and a wrapper of one share, so the sanitizing exists once."""

    def lookup_raw(
        self, *, key: str | None = None, lock_id: str | None = None, cancel: Any = None
    ) -> LockInfoDebug | None:
        raise NotImplementedError

    async def alookup_raw(
        self, *, key: str | None = None, lock_id: str | None = None, cancel: Any = None
    ) -> LockInfoDebug | None:
        raise NotImplementedError

    def lookup(
        self, *, key: str | None = None, lock_id: str | None = None, cancel: Any = None
    ) -> LockInfo | None:
        """Sanitized facts about the live lock on ``key`` or named by ``lock_id``.

        Exactly one of ``key`` / ``lock_id``. ``None`` when absent or expired.
        """
        raw = self.lookup_raw(key=key, lock_id=lock_id, cancel=cancel)
        return raw.sanitized() if raw else None

    async def alookup(
        self, *, key: str | None = None, lock_id: str | None = None, cancel: Any = None
    ) -> LockInfo | None:
        raw = await self.alookup_raw(key=key, lock_id=lock_id, cancel=cancel)
        return raw.sanitized() if raw else None


class LockBackend(Protocol):
    """A lock backend: single-attempt operations, sync and async, plus housekeeping."""

    @property
    def alias(self) -> str: ...

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def operation_timeout_ms(self) -> int: ...

    def acquire(self, key: str, ttl_ms: int = ..., *, cancel: Any = None) -> AcquireResult: ...

    async def aacquire(
        self, key: str, ttl_ms: int = ..., *, cancel: Any = None
    ) -> AcquireResult: ...

    def release(self, lock_id: str, *, cancel: Any = None) -> ReleaseResult: ...

    async def arelease(self, lock_id: str, *, cancel: Any = None) -> ReleaseResult: ...

    def extend(self, lock_id: str, ttl_ms: int, *, cancel: Any = None) -> ExtendResult: ...

    async def aextend(self, lock_id: str, ttl_ms: int, *, cancel: Any = None) -> ExtendResult: ...

    def is_locked(self, key: str, *, cancel: Any = None) -> bool: ...

    async def ais_locked(self, key: str, *, cancel: Any = None) -> bool: ...

    def lookup(
        self, *, key: str | None = None, lock_id: str | None = None, cancel: Any = None
    ) -> LockInfo | None: ...

    async def alookup(
        self, *, key: str | None = None, lock_id: str | None = None, cancel: Any = None
    ) -> LockInfo | None: ...

    def lookup_raw(
        self, *, key: str | None = None, lock_id: str | None = None, cancel: Any = None
    ) -> LockInfoDebug | None: ...

    async def alookup_raw(
        self, *, key: str | None = None, lock_id: str | None = None, cancel: Any = None
    ) -> LockInfoDebug | None: ...

    def list_locks(
        self, *, prefix: str = "", cursor: str | None = None, limit: int = 100
    ) -> LockPage: ...

    async def alist_locks(
        self, *, prefix: str = "", cursor: str | None = None, limit: int = 100
    ) -> LockPage: ...

    def delete_expired(self, *, batch_size: int = 500, dry_run: bool = False) -> Iterator[int]: ...

    def force_release(self, key: str, lock_id_hash: str) -> ReleaseResult: ...

    async def aforce_release(self, key: str, lock_id_hash: str) -> ReleaseResult: ...

    @classmethod
    def check_settings(cls, alias: str, params: Mapping[str, Any]) -> list[Any]: ...

    def check(self, **kwargs: Any) -> list[Any]: ...

    def deploy_check(self) -> list[Any]: ...

    def close(self, **kwargs: Any) -> None: ...


class QueueingBackend(LockBackend, Protocol):
    """A backend that keeps a queue of waiters per key (``specs/contract.md``, Waiting).

    A waiter's attempts carry its :class:`~django_syncguard.waiting.WaitTicket`; a
    release wakes the first live ticket through :attr:`wake_ups`, and a waiter that
    gives up withdraws its ticket. ``wake_ups`` is ``None`` while queues are off for
    the alias (``OPTIONS["WAKE_UPS"] = False``): waiters then back off on the timer.
    """

    @property
    def wake_ups(self) -> WakeUps | None: ...

    def acquire(
        self,
        key: str,
        ttl_ms: int = ...,
        *,
        cancel: Any = None,
        ticket: WaitTicket | None = None,
    ) -> AcquireResult: ...

    async def aacquire(
        self,
        key: str,
        ttl_ms: int = ...,
        *,
        cancel: Any = None,
        ticket: WaitTicket | None = None,
    ) -> AcquireResult: ...

    def withdraw(self, key: str, ticket_id: str) -> None: ...

    async def awithdraw(self, key: str, ticket_id: str) -> None: ...


class FenceKeeper(LockBackend, Protocol):
    """A backend that keeps a fence floor and can compact its counters
    (:mod:`django_syncguard.fence_floors`): every bundled backend."""

    def now_ms(self) -> int: ...

    def fence_state(self) -> FenceState: ...

    def fence_floor(self) -> int: ...

    def raise_fence_floor(self, fence: int) -> int: ...

    def compact_fences(
        self, *, idle_ms: int, batch_size: int = 500, dry_run: bool = False
    ) -> Iterator[int]: ...


def fence_keeper(backend: LockBackend) -> FenceKeeper | None:
    """``backend`` as a :class:`FenceKeeper`, or ``None`` for a backend without
    fence floors (a third-party one written to :class:`LockBackend`)."""
    if not all(callable(getattr(backend, name, None)) for name in _FENCE_KEEPING):
        return None
    return cast(FenceKeeper, backend)


_FENCE_KEEPING: Final = (
    "now_ms",
    "fence_state",
    "fence_floor",
    "raise_fence_floor",
    "compact_fences",
)


def queues_of(backend: LockBackend) -> tuple[QueueingBackend, WakeUps] | None:
    """``backend`` as a :class:`QueueingBackend`, with its wake-ups, when it keeps
    queues now; ``None`` for a backend without (a third-party one written to
    :class:`LockBackend`) or with queues turned off. The one place that asks."""
    wake_ups = getattr(backend, "wake_ups", None)
    if wake_ups is None or not callable(getattr(backend, "withdraw", None)):
        return None
    return cast(QueueingBackend, backend), wake_ups


#: The operations a class must define to be configured as a ``BACKEND``: the
#: protocol's methods (its properties are facts a backend may compute).
OPERATIONS: Final = tuple(
    name
    for name, value in vars(LockBackend).items()
    if not name.startswith("_") and not isinstance(value, property)
)
