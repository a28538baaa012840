"""An in-process backend: the whole contract, for tests and development only.

Locks live in this process's memory, so they exclude threads and tasks of one
process and nothing else. Every ``MemoryBackend`` with the same ``LOCATION`` (or,
without one, the same alias) shares one store, whichever thread built it.

``OPTIONS["CLOCK"]``: a callable (or dotted path to one) returning Unix ms; the
default is the system clock. Tests pass a :class:`~django_syncguard.liveness.FakeClock`
to move time without sleeping. The clock is the time authority (``"client"``).
"""

from __future__ import annotations

import dataclasses
import heapq
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from django.core import checks
from django.utils.module_loading import import_string

from ..cancellation import CancelToken, check_cancel
from ..constants import TIME_TOLERANCE_MS
from ..errors import InvalidArgument
from ..fence_floors import IdleCounter, next_fence
from ..fencing import FENCE_MAX, fence_overflow_error, format_fence
from ..keys import generate_lock_id
from ..liveness import Clock, is_live, system_clock_ms
from ..owners import QueueStats
from ..results import AcquireResult, ExtendResult, LockPage, LockRecord, ReleaseResult
from ..waiting import Grant, Queue, WaitTicket, WakeUps, queue_admits, queue_head
from ..waiting.queues import unclaimed_expiry
from .base import BaseLockBackend, BatchedCleanup


@dataclass(frozen=True, slots=True)
class _Request:
    """What a queued waiter's acquire would write: a release grants the key with it."""

    ttl_ms: int
    clock: bool  # fence mode "clock"
    owner: str | None


@dataclass(slots=True)
class _Granted:
    """The lock a release granted to a waiter's ticket: until the waiter's process
    claims it, its record carries :func:`~django_syncguard.waiting.queues.unclaimed_expiry`
    and ``expires_at_ms`` is the lease's (None once claimed). Kept until the lock goes,
    so that a withdrawal of the ticket gives the key back."""

    ticket_id: str
    lock_id: str
    expires_at_ms: int | None


@dataclass
class _Store:
    mutex: threading.Lock = field(default_factory=threading.Lock)
    locks: dict[str, LockRecord] = field(default_factory=dict)
    index: dict[str, str] = field(default_factory=dict)  # lock_id -> key
    fences: dict[str, int] = field(default_factory=dict)  # key -> last fence
    acquired: dict[str, int] = field(default_factory=dict)  # key -> last acquisition ms
    floor: int = 0  # the fence floor (fence_floors.py)
    queues: dict[str, Queue] = field(default_factory=dict)  # key -> its waiters
    arrivals: int = 0  # numbers queue entries in arrival order
    # key -> ticket -> (its arrival number, when that place was queued, ms)
    since: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    # key -> ticket -> what its acquire would write (waiters that accept grants)
    requests: dict[str, dict[str, _Request]] = field(default_factory=dict)
    granted: dict[str, _Granted] = field(default_factory=dict)  # key -> its grant
    wake_ups: WakeUps = field(default_factory=lambda: WakeUps("memory"))


_stores: dict[str, _Store] = {}
_stores_mutex = threading.Lock()


def _store(name: str) -> _Store:
    with _stores_mutex:
        return _stores.setdefault(name, _Store())


# System-check message of this backend (see checks.py for the table of ids).
W001 = (
    "Lock backend {alias!r} is the in-process MemoryBackend while DEBUG is False: "
    "it excludes nothing across processes."
)


class MemoryBackend(BatchedCleanup, BaseLockBackend):
    """Thread-safe in-process locks with fences; see the module docstring."""

    backend_name = "memory"
    time_authority = "client"
    known_options: ClassVar[frozenset[str]] = BaseLockBackend.known_options | {"CLOCK"}

    def __init__(self, alias: str = "default", params: Mapping[str, Any] | None = None) -> None:
        super().__init__(alias, params)
        clock = self.options.get("CLOCK", system_clock_ms)
        if isinstance(clock, str):
            try:
                clock = import_string(clock)
            except Exception as exc:  # ImportError, or ValueError/TypeError for "." paths
                raise InvalidArgument(
                    f"OPTIONS['CLOCK'] = {clock!r} cannot be imported: {exc}"
                ) from exc
        if not callable(clock):
            raise InvalidArgument("OPTIONS['CLOCK'] must be a callable returning Unix ms.")
        self.clock: Clock = clock
        self._store = _store(self.location or alias)

    def check(self, **kwargs: Any) -> list[Any]:
        from django.conf import settings

        if settings.DEBUG:
            return []
        return [checks.Warning(W001.format(alias=self.alias), id="syncguard.W001")]

    def reset(self) -> None:
        """Forget every lock *and fence counter* of this store. Tests only: in any
        real backend fence counters are never reset."""
        with self._store.mutex:
            self._store.locks.clear()
            self._store.index.clear()
            self._store.fences.clear()
            self._store.acquired.clear()
            self._store.floor = 0
            self._store.queues.clear()
            self._store.since.clear()
            self._store.requests.clear()
            self._store.granted.clear()

    def _make_wake_ups(self) -> WakeUps:
        # Every release of this store happens in this process: waiters sleep on an
        # event that the release sets, the condition-variable pattern across backends.
        return self._store.wake_ups

    @property
    def grants(self) -> bool:
        # Every waiter is in this process: a grant reaches its waiter at once, and the
        # releasing call claims it for a waiter that is listening.
        return self.wake_ups_enabled

    def _acquire(
        self, key: str, ttl_ms: int, cancel: CancelToken | None, ticket: WaitTicket | None = None
    ) -> AcquireResult:
        store = self._store
        with store.mutex:
            now = self.clock()
            current = store.locks.get(key)
            free = current is None or not is_live(current.expires_at_ms, now, TIME_TOLERANCE_MS)
            if not free and ticket is not None:
                crossed = self._crossed(key, ticket, now)
                if crossed is not None:
                    return crossed
            if free and self._behind(key, ticket, now):
                # Free, and another waiter is first: a lease ran out, or a grant lapsed,
                # and this attempt is the first to notice. The key goes to that waiter.
                self._grant_next(key, now)
                current = store.locks.get(key)
                free = current is None or not is_live(current.expires_at_ms, now, TIME_TOLERANCE_MS)
            take, position = self._admit(key, now, free, ticket, ttl_ms)
            if not take:
                return AcquireResult.locked(position)
            fence = self._next_fence(key, now, self._clock_mode)
            if fence > FENCE_MAX:
                raise fence_overflow_error(key)
            check_cancel(cancel, {"key": key})  # last point before the write
            record = self._write(key, generate_lock_id(), now, now + ttl_ms, fence, self._owner())
            return AcquireResult(
                ok=True,
                lock_id=record.lock_id,
                expires_at_ms=record.expires_at_ms,
                fence=record.fence,
            )

    @property
    def _clock_mode(self) -> bool:
        return self.fence_mode == "clock"

    def _next_fence(self, key: str, now: int, clock: bool) -> int:
        """The key's next fence (``next_fence`` of its counter, the floor and, in clock
        mode, ``now``). Caller holds the mutex."""
        return next_fence(self._store.fences.get(key, 0), self._store.floor, now if clock else None)

    def _write(
        self, key: str, lock_id: str, now: int, expires_at_ms: int, fence: int, owner: str | None
    ) -> LockRecord:
        """Store a new lock on ``key`` (replacing a record that is no longer live), its
        index entry and the key's counter. Caller holds the mutex."""
        store = self._store
        current = store.locks.get(key)
        if current is not None:
            store.index.pop(current.lock_id, None)
        store.granted.pop(key, None)  # a lapsed grant taken over
        record = LockRecord(
            key=key,
            lock_id=lock_id,
            expires_at_ms=expires_at_ms,
            acquired_at_ms=now,
            fence=format_fence(fence),
            owner=owner,
        )
        store.fences[key] = fence
        store.acquired[key] = now
        store.locks[key] = record
        store.index[lock_id] = key
        return record

    def _behind(self, key: str, ticket: WaitTicket | None, now: int) -> bool:
        """Whether a live waiter other than ``ticket`` is first in ``key``'s queue.
        Caller holds the mutex."""
        queue = self._store.queues.get(key)
        if queue is None:
            return False
        head = queue_head(queue, now)
        return head is not None and (ticket is None or head != ticket.id)

    def _admit(
        self, key: str, now: int, free: bool, ticket: WaitTicket | None, ttl_ms: int
    ) -> tuple[bool, int | None]:
        """The queue rule (see :mod:`~django_syncguard.waiting`); a ticket queued here
        leaves what its acquire would write, for a release to grant the key with.
        Caller holds the mutex."""
        store = self._store
        queue = store.queues.get(key)
        if queue is None and (free or ticket is None):
            return free, None  # the common case: nobody waits
        queue = store.queues.setdefault(key, {})
        store.arrivals += 1
        take, position = queue_admits(queue, now, free=free, ticket=ticket, arrival=store.arrivals)
        if not take and ticket is not None and self.grants:
            requests = store.requests.setdefault(key, {})
            if ticket.id not in requests:
                requests[ticket.id] = _Request(ttl_ms, self._clock_mode, self._owner())
        # When each place still queued was handed out, for the inspector's oldest wait: a
        # renewal keeps it, a ticket that lapsed and came back (a new arrival) starts again.
        since = store.since.get(key, {})
        placed = {tid: since.get(tid, (0, now)) for tid in queue}
        store.since[key] = {
            tid: placed[tid] if placed[tid][0] == arrival else (arrival, now)
            for tid, (arrival, _) in queue.items()
        }
        self._prune_requests(key)
        return take, position

    def _prune_requests(self, key: str) -> None:
        """Forget the queue of ``key`` when it is empty, and the requests of tickets
        no longer in it. Caller holds the mutex."""
        store = self._store
        queue = store.queues.get(key)
        if not queue:
            store.queues.pop(key, None)
            store.since.pop(key, None)
            store.requests.pop(key, None)
            return
        requests = store.requests.get(key)
        if requests is not None:
            for ticket_id in [tid for tid in requests if tid not in queue]:
                del requests[ticket_id]

    def _crossed(self, key: str, ticket: WaitTicket, now: int) -> AcquireResult | None:
        """The key granted to ``ticket`` while its attempt was on the way: that lock,
        claimed (None when ``key`` is not held by a grant to ``ticket``). Caller holds
        the mutex and knows the key's record is live."""
        granted = self._store.granted.get(key)
        record = self._store.locks[key]
        if granted is None or granted.ticket_id != ticket.id or record.lock_id != granted.lock_id:
            return None
        self._claim(key, granted.lock_id, now)
        record = self._store.locks[key]
        return AcquireResult(
            ok=True,
            lock_id=record.lock_id,
            expires_at_ms=record.expires_at_ms,
            fence=record.fence,
        )

    def _claim(self, key: str, lock_id: str, now: int) -> bool:
        """Claim the grant ``lock_id`` of ``key``: its record gets the lease's expiry,
        unless it lapsed or went meanwhile (False). Caller holds the mutex."""
        store = self._store
        granted = store.granted.get(key)
        record = store.locks.get(key)
        if granted is None or record is None or not record.lock_id == granted.lock_id == lock_id:
            return False
        if not is_live(record.expires_at_ms, now, TIME_TOLERANCE_MS):
            return False
        if granted.expires_at_ms is not None:  # not claimed yet
            store.locks[key] = dataclasses.replace(record, expires_at_ms=granted.expires_at_ms)
            granted.expires_at_ms = None
        return True

    def _grant_next(self, key: str, now: int) -> None:
        """``key`` is free: grant it to its first live waiter if that waiter left a
        request (else, or at the fence's maximum, only wake it). A waiter listening
        here gets the grant at once, and this call claims it for that waiter. Caller
        holds the mutex."""
        store = self._store
        queue = store.queues.get(key)
        head = queue_head(queue, now) if queue is not None else None
        if head is None:
            self._prune_requests(key)
            return
        request = store.requests.get(key, {}).get(head)
        grant = None if request is None else self._grant(key, head, request, now)
        if grant is None:
            store.wake_ups.deliver(key, head)
        elif store.wake_ups.deliver(key, head, grant):
            self._claim(key, grant.lock_id, now)

    def _grant(self, key: str, head: str, request: _Request, now: int) -> Grant | None:
        """Write the lock ``request`` asks for on the free ``key``, for the waiter of
        ticket ``head``, who leaves the queue; None (nothing written) when the fence
        would pass the maximum. Caller holds the mutex."""
        store = self._store
        fence = self._next_fence(key, now, request.clock)
        if fence > FENCE_MAX:
            return None
        lock_id = generate_lock_id()
        expires = now + request.ttl_ms
        self._write(key, lock_id, now, unclaimed_expiry(now, request.ttl_ms), fence, request.owner)
        store.granted[key] = _Granted(head, lock_id, expires)
        queue = store.queues[key]
        del queue[head]
        store.since.get(key, {}).pop(head, None)
        self._prune_requests(key)
        return Grant(lock_id, fence, expires)

    def _withdraw(self, key: str, ticket_id: str) -> None:
        store = self._store
        with store.mutex:
            now = self.clock()
            granted = store.granted.get(key)
            if granted is not None and granted.ticket_id == ticket_id:
                # The waiter gave up after the key was granted to it: give it back.
                record, _ = self._owned(granted.lock_id, now)
                if record is not None:
                    self._drop(record)
                    self._grant_next(key, now)
                    return
            queue = store.queues.get(key)
            if queue is None or queue.pop(ticket_id, None) is None:
                return
            self._prune_requests(key)
            if key not in store.queues:
                return
            current = store.locks.get(key)
            if current is None or not is_live(current.expires_at_ms, now, TIME_TOLERANCE_MS):
                self._grant_next(key, now)

    def _queue_stats(self, keys: list[str]) -> dict[str, QueueStats]:
        with self._store.mutex:
            now = self.clock()
            stats = {}
            for key in keys:
                queue = self._store.queues.get(key, {})
                since = self._store.since.get(key, {})
                live = [
                    since.get(tid, (0, now))[1] for tid, (_, until) in queue.items() if until > now
                ]
                if live:
                    stats[key] = QueueStats(len(live), min(live))
            return stats

    def _owned(self, lock_id: str, now: int) -> tuple[LockRecord | None, str]:
        """The live record ``lock_id`` names, or ``None`` and why. Caller holds the mutex."""
        key = self._store.index.get(lock_id)
        record = self._store.locks.get(key) if key is not None else None
        if record is None or record.lock_id != lock_id:
            return None, "not-found"
        if not is_live(record.expires_at_ms, now, TIME_TOLERANCE_MS):
            return None, "expired"
        return record, ""

    def _release(self, lock_id: str, cancel: CancelToken | None) -> ReleaseResult:
        store = self._store
        with store.mutex:
            now = self.clock()
            record, reason = self._owned(lock_id, now)
            if record is None:
                return ReleaseResult(ok=False, reason=reason)  # type: ignore[arg-type]
            check_cancel(cancel, {"lock_id": lock_id})
            self._drop(record)
            self._grant_next(record.key, now)
            return ReleaseResult(ok=True)

    def _extend(self, lock_id: str, ttl_ms: int, cancel: CancelToken | None) -> ExtendResult:
        store = self._store
        with store.mutex:
            now = self.clock()
            record, reason = self._owned(lock_id, now)
            if record is None:
                return ExtendResult(ok=False, reason=reason)  # type: ignore[arg-type]
            check_cancel(cancel, {"lock_id": lock_id})
            renewed = dataclasses.replace(record, expires_at_ms=now + ttl_ms)
            store.locks[record.key] = renewed
            granted = store.granted.get(record.key)
            if granted is not None and granted.lock_id == lock_id:
                granted.expires_at_ms = None  # the holder's extend claims a grant
            return ExtendResult(ok=True, expires_at_ms=renewed.expires_at_ms)

    def _is_locked(self, key: str, cancel: CancelToken | None) -> bool:
        store = self._store
        with store.mutex:
            now = self.clock()
            record = store.locks.get(key)
            if record is None:
                return False
            live = is_live(record.expires_at_ms, now, TIME_TOLERANCE_MS)
            if self.cleanup_in_is_locked and self._sweepable(record, now):
                self._drop(record)
            return live

    def _drop(self, record: LockRecord) -> None:
        """Remove ``record``, its lock-id index entry and its grant, if it was one.
        Caller holds the mutex."""
        store = self._store
        del store.locks[record.key]
        store.index.pop(record.lock_id, None)
        granted = store.granted.get(record.key)
        if granted is not None and granted.lock_id == record.lock_id:
            del store.granted[record.key]

    def _sweepable(self, record: LockRecord, now: int) -> bool:
        """Expired by more than the cleanup guard: no extend can still be racing it."""
        return record.expires_at_ms < self._cleanup_cutoff(now)

    def _list_locks(self, prefix: str, cursor: str | None, limit: int) -> LockPage:
        with self._store.mutex:
            now = self.clock()
            keys = sorted(
                key
                for key, record in self._store.locks.items()
                if key.startswith(prefix)
                and (cursor is None or key > cursor)
                and is_live(record.expires_at_ms, now, TIME_TOLERANCE_MS)
            )
            records = tuple(self._store.locks[key] for key in keys[:limit])
        more = len(keys) > limit
        return LockPage(records, records[-1].key if more else None, now)

    def _expired(self, now: int) -> list[LockRecord]:
        return [r for r in self._store.locks.values() if self._sweepable(r, now)]

    def _count_expired(self) -> int:
        with self._store.mutex:
            return len(self._expired(self.clock()))

    def _delete_expired_batch(self, batch_size: int) -> int:
        with self._store.mutex:
            doomed = self._expired(self.clock())[:batch_size]
            for record in doomed:
                self._drop(record)
            return len(doomed)

    # ------------------------------------------------------ fence continuity
    def now_ms(self) -> int:
        return self.clock()

    def _fence_floor(self) -> int:
        return self._store.floor

    def _raise_fence_floor(self, fence: int) -> int:
        with self._store.mutex:
            self._store.floor = max(self._store.floor, fence)
            return self._store.floor

    def _highest_fence(self) -> int:
        with self._store.mutex:
            return max(self._store.fences.values(), default=0)

    def _idle(self, key: str, cutoff_ms: int, now: int) -> bool:
        """No live lock, no waiter, last acquired before ``cutoff_ms``. Caller holds
        the mutex."""
        store = self._store
        record = store.locks.get(key)
        if record is not None and is_live(record.expires_at_ms, now, TIME_TOLERANCE_MS):
            return False
        queue = store.queues.get(key)
        if queue is not None and queue_head(queue, now) is not None:
            return False  # a live waiter (lapsed places do not count)
        return store.acquired.get(key, cutoff_ms) < cutoff_ms

    def _idle_counters(
        self, cutoff_ms: int, cursor: str | None, limit: int, *, stamp: bool
    ) -> tuple[list[IdleCounter], str | None]:
        store = self._store
        with store.mutex:
            now = self.clock()
            # The next limit + 1 keys in order, without sorting them all each batch.
            after = (k for k in store.fences if cursor is None or k > cursor)
            keys = heapq.nsmallest(limit + 1, after)
            page = keys[:limit]
            if stamp:  # counters of before acquisition times were kept (none here)
                for key in page:
                    store.acquired.setdefault(key, now)
            idle = [
                IdleCounter(key, store.fences[key])
                for key in page
                if self._idle(key, cutoff_ms, now)
            ]
        return idle, (page[-1] if len(keys) > limit else None)

    def _delete_idle_counters(self, counters: list[IdleCounter], cutoff_ms: int) -> int:
        store = self._store
        deleted = 0
        with store.mutex:
            now = self.clock()
            for counter in counters:
                key = counter.name
                if store.fences.get(key) == counter.fence and self._idle(key, cutoff_ms, now):
                    del store.fences[key]
                    store.acquired.pop(key, None)
                    deleted += 1
        return deleted

    def _lookup_by_key(self, key: str, cancel: CancelToken | None) -> LockRecord | None:
        with self._store.mutex:
            record = self._store.locks.get(key)
            now = self.clock()
        if record is None or not is_live(record.expires_at_ms, now, TIME_TOLERANCE_MS):
            return None
        return record

    def _lookup_by_id(self, lock_id: str, cancel: CancelToken | None) -> LockRecord | None:
        with self._store.mutex:
            record, _ = self._owned(lock_id, self.clock())
        return record

    # Memory I/O never blocks: the async twins run inline, on the event loop.
    async def _aacquire(
        self, key: str, ttl_ms: int, cancel: CancelToken | None, ticket: WaitTicket | None = None
    ) -> AcquireResult:
        return self._acquire(key, ttl_ms, cancel, ticket)

    async def _awithdraw(self, key: str, ticket_id: str) -> None:
        self._withdraw(key, ticket_id)

    async def _arelease(self, lock_id: str, cancel: CancelToken | None) -> ReleaseResult:
        return self._release(lock_id, cancel)

    async def _aextend(self, lock_id: str, ttl_ms: int, cancel: CancelToken | None) -> ExtendResult:
        return self._extend(lock_id, ttl_ms, cancel)

    async def _ais_locked(self, key: str, cancel: CancelToken | None) -> bool:
        return self._is_locked(key, cancel)

    async def _alookup_by_key(self, key: str, cancel: CancelToken | None) -> LockRecord | None:
        return self._lookup_by_key(key, cancel)

    async def _alookup_by_id(self, lock_id: str, cancel: CancelToken | None) -> LockRecord | None:
        return self._lookup_by_id(lock_id, cancel)
