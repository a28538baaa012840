"""The database backend's class; the package docstring tells what it does."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, ClassVar, TypeVar

from asgiref.sync import sync_to_async
from django.core.checks import CheckMessage
from django.db.backends.base.base import BaseDatabaseWrapper

from ...cancellation import CancelToken, check_cancel
from ...constants import BACKEND_LIMITS, RESERVE_BYTES, TIME_TOLERANCE_MS
from ...errors import InvalidArgument, LockError
from ...fence_floors import IdleCounter
from ...fencing import fence_overflow_error, format_fence
from ...keys import derived, fence_key_of, generate_lock_id, make_storage_key
from ...orphans import note_sent
from ...owners import QueueStats
from ...results import (
    AcquireResult,
    ExtendResult,
    LockPage,
    LockRecord,
    ReleaseResult,
    TimeAuthority,
)
from ...waiting import Grant, WaitTicket, WakeUps, tickets
from ..base import BaseLockBackend, BatchedCleanup
from .connections import REPLY_MARGIN_S, PrivateConnections, close_quietly
from .errors import may_have_run
from .operations import (
    FENCE_OVERFLOW,
    LOCKED,
    DatabaseOperations,
    OnGrant,
    Row,
    StorageKeys,
    WakeUpHooks,
)
from .target import Problem, check_errors, resolve, resolve_listen
from .wakeups import PROBE_S, DatabaseWakeUps

T = TypeVar("T")

LIMIT_BYTES = BACKEND_LIMITS["POSTGRES"]
RESERVE = RESERVE_BYTES["POSTGRES"]


class DatabaseBackend(BatchedCleanup, BaseLockBackend):
    """Locks in a Django database; see the package docstring.

    The vendor's SQL and facts live in its operations object, ``self.ops``, picked
    once here from the vendor of the ``DATABASES`` alias.
    """

    known_options: ClassVar[frozenset[str]] = BaseLockBackend.known_options | {
        "DATABASE",
        "LISTEN_DATABASE",
    }
    ops: DatabaseOperations

    def __init__(self, alias: str = "default", params: Mapping[str, Any] | None = None) -> None:
        super().__init__(alias, params)
        target = resolve(alias, self.options)
        if isinstance(target, Problem):
            raise InvalidArgument(target.message)
        self.database = target.database
        listen = resolve_listen(self.options, target)
        if isinstance(listen, Problem):
            raise InvalidArgument(listen.message)
        #: The ``DATABASES`` alias the wake-ups LISTEN through (PostgreSQL).
        self.listen_database = listen
        self.connections = PrivateConnections(
            self.database,
            target.operations,
            connect_timeout_ms=self.connect_timeout_ms,
            operation_timeout_ms=self.operation_timeout_ms,
        )
        self.ops = target.operations(
            self.connections.run, database=self.database, queues=self.wake_ups_enabled
        )
        self.connections.prepare = self.ops.prepare_connection
        # A server across a network may run an acquire whose reply never came back.
        self.abandoned_requests_run = self.ops.over_network

    @classmethod
    def check_settings(cls, alias: str, params: Mapping[str, Any]) -> list[CheckMessage]:
        """``syncguard.E004`` / ``syncguard.E005`` for the lock alias ``alias`` (its
        ``SYNCGUARD_BACKENDS`` entry is ``params``), without building a backend and
        without I/O: the judgement the constructor makes, as system-check errors."""
        return check_errors(alias, params)

    @classmethod
    def prepare_process(cls, alias: str, params: Mapping[str, Any]) -> None:
        """Let the vendor of the alias's database set up what it needs from the
        process's start (on SQLite: the watch of the application's transactions)."""
        target = resolve(alias, params.get("OPTIONS") or {})
        if not isinstance(target, Problem):
            target.operations.prepare_process(target.database)

    def _acquire_may_have_run(self, error: LockError) -> bool:
        return may_have_run(error)

    def check(self, **kwargs: Any) -> list[CheckMessage]:
        """What the vendor finds in the ``DATABASES`` alias's settings (no I/O)."""
        return self.ops.check(self.alias)

    def deploy_check(self) -> list[CheckMessage]:
        """What the vendor finds on the server: on PostgreSQL, whether a LISTENing
        connection hears notifications (``syncguard.W012`` when a transaction pooler
        swallows them). Nothing to ask with ``WAKE_UPS`` off."""
        if not self.wake_ups_enabled:
            return []
        return self.ops.deploy_check(self.alias, self._wake_up_hooks())

    # The vendor's facts, read from its operations object.
    @property
    def backend_name(self) -> str:
        return self.ops.backend_name

    @property
    def time_authority(self) -> TimeAuthority:
        return self.ops.time_authority

    @property
    def vendor(self) -> str:
        """``connection.vendor`` of the ``DATABASES`` alias: postgresql or sqlite."""
        return self.ops.vendor

    # ------------------------------------------------------------- connections
    def connection(self) -> BaseDatabaseWrapper:
        """This thread's private connection (created on first use, not yet opened)."""
        return self.connections.connection()

    def close(self, **kwargs: Any) -> None:
        """Close every private connection this backend opened, in any thread."""
        super().close()
        self.connections.close()

    def _forget_clients_after_fork(self) -> None:
        # The per-thread connections have no PID check of their own: without this,
        # the child would talk on the parent's sockets.
        self.connections.forget_after_fork()

    # ------------------------------------------------------------- wake-ups
    def _make_wake_ups(self) -> WakeUps:
        return self.ops.make_wake_ups(self.alias, self._wake_up_hooks())

    @property
    def grants(self) -> bool:
        """A release grants the key to the first live waiter (PostgreSQL, with
        wake-ups: this backend's waiters leave grant records)."""
        return self.wake_ups_enabled and self.ops.grants

    def claim(self, grant: Grant) -> bool:
        """Claim a grant delivered to a waiter of this process, so that it does not
        lapse (the listener's thread calls it once the waiter is woken, on that
        thread's own private connection). False when it had lapsed, or was released or
        taken over already."""
        return self.ops.claim(grant.lock_id) == 1

    def check_grant(self, storage_key: str, ticket_id: str, watched: bool) -> tuple[int, Any, Any]:
        """Check a grant this process made once its window is over (the listener's
        thread calls it, on that thread's own private connection): if it lapsed
        unclaimed, the key goes on to the next waiter (see ``syncguard_check_grant``)."""
        return self.ops.check_grant(storage_key, ticket_id, watched)

    def _built_wake_ups(self) -> DatabaseWakeUps | None:
        built = super()._built_wake_ups()
        return built if isinstance(built, DatabaseWakeUps) else None

    def _grant_hook(self) -> OnGrant | None:
        """``on_grant`` for a statement sent now: this process checks the grants it
        makes when its wake-ups are connected (else the next waiter is told)."""
        wake_ups = self._built_wake_ups()
        return None if wake_ups is None or not self.grants else wake_ups.grant_hook()

    def _queued(self, key: str) -> None:
        """A waiter's ticket was just queued: its wake-ups must reach this process (on
        PostgreSQL, LISTEN on the key's channel if that is not done yet)."""
        wake_ups = self.wake_ups
        if isinstance(wake_ups, DatabaseWakeUps):
            wake_ups.queued(key)

    def _wake_up_hooks(self) -> WakeUpHooks:
        # The longest the listener's thread can be busy with the server: connecting,
        # the probe (a reply, the notification's wait, one more reply).
        reply_timeout_s = (
            (self.connect_timeout_ms + 2 * self.operation_timeout_ms) / 1000
            + PROBE_S
            + REPLY_MARGIN_S
        )
        return WakeUpHooks(
            listen=self._listen_connection,
            run_once=self.connections.run_once,
            storage_key=self.storage_key,
            reply_timeout_s=reply_timeout_s,
            claim=self.claim if self.grants else None,
            check_grant=self.check_grant if self.grants else None,
        )

    def _listen_connection(self) -> BaseDatabaseWrapper:
        # Named for operators: which process and alias holds this LISTEN session.
        name = f"syncguard listen {os.getpid()} {self.alias}"[:63]
        wrapper = self.connections.dedicated(self.listen_database, name)
        try:
            wrapper.ensure_connection()
        except Exception:
            close_quietly(wrapper)
            raise
        return wrapper

    # ----------------------------------------------------------------- helpers
    def _storable(self, key: str) -> str:
        return self.ops.storable(key)

    @staticmethod
    def storage_keys(key: str) -> StorageKeys:
        """(lock storage key, fence key, user key if it differs from the storage key),
        the same for every database backend."""
        return derived(key, DatabaseBackend, "storage keys", partial(_storage_keys, key))

    @staticmethod
    def storage_key(key: str) -> str:
        """The primary key of ``key``'s lock row."""
        return DatabaseBackend.storage_keys(key).storage_key

    def now_ms(self) -> int:
        """The backend's time authority, now (server time on PostgreSQL)."""
        return self.ops.now_ms()

    # ------------------------------------------------------------- operations
    def _acquire(
        self, key: str, ttl_ms: int, cancel: CancelToken | None, ticket: WaitTicket | None = None
    ) -> AcquireResult:
        lock_id = note_sent(generate_lock_id())
        check_cancelled = partial(check_cancel, cancel, {"key": key})
        wake_ups = self._built_wake_ups()
        grants = self.grants
        status, fence, expires, position, granted = self.ops.acquire(
            self.storage_keys(key),
            lock_id,
            ttl_ms,
            check_cancelled,
            ticket,
            clock=self.fence_mode == "clock",
            owner=self._owner(),
            grant_window_ms=tickets.GRANT_WINDOW_MS if grants else None,
            process_channel=None if wake_ups is None else wake_ups.grant_channel(),
            on_grant=None if wake_ups is None or not grants else wake_ups.grant_hook(),
        )
        if status == FENCE_OVERFLOW:
            raise fence_overflow_error(key)
        if status == LOCKED:
            if ticket is not None:
                self._queued(key)
            return AcquireResult.locked(None if position is None else int(position))
        if wake_ups is not None:
            wake_ups.key_settled(key)  # the key was free: a grant of it made here ended
        if granted is not None:  # a release had granted the key to this ticket: its lock
            lock_id = str(granted)
        return AcquireResult(
            ok=True, lock_id=lock_id, expires_at_ms=int(expires), fence=format_fence(int(fence))
        )

    def _release(self, lock_id: str, cancel: CancelToken | None) -> ReleaseResult:
        deleted, existed = self.ops.release(lock_id, on_grant=self._grant_hook())
        if deleted:
            return ReleaseResult(ok=True)
        return ReleaseResult(ok=False, reason="expired" if existed else "not-found")

    def _withdraw(self, key: str, ticket_id: str) -> None:
        self.ops.withdraw(self.storage_keys(key), key, ticket_id, on_grant=self._grant_hook())

    def _extend(self, lock_id: str, ttl_ms: int, cancel: CancelToken | None) -> ExtendResult:
        expires, existed = self.ops.extend(lock_id, ttl_ms)
        if expires is not None:
            return ExtendResult(ok=True, expires_at_ms=int(expires))
        return ExtendResult(ok=False, reason="expired" if existed else "not-found")

    def _is_locked(self, key: str, cancel: CancelToken | None) -> bool:
        sweep_guard_ms = self._cleanup_guard_ms if self.cleanup_in_is_locked else None
        return self.ops.is_locked(self.storage_key(key), sweep_guard_ms)

    def _lookup_by_key(self, key: str, cancel: CancelToken | None) -> LockRecord | None:
        return self._lookup("key", self.storage_key(key))

    def _lookup_by_id(self, lock_id: str, cancel: CancelToken | None) -> LockRecord | None:
        return self._lookup("lock_id", lock_id)

    def _lookup(self, column: str, value: str) -> LockRecord | None:
        row = self.ops.lookup(column, value)
        return None if row is None else _record(row)

    # ---------------------------------------------------------- housekeeping
    def _list_locks(self, prefix: str, cursor: str | None, limit: int) -> LockPage:
        """Keyset pagination: a page is the ``limit`` live rows after the cursor (the
        last storage key of the previous page); one more row tells there is a next."""
        now = self.now_ms()
        rows = self.ops.list_page(cursor or "", now - TIME_TOLERANCE_MS, prefix, limit + 1)
        records = tuple(_record(row) for row in rows[:limit])
        more = len(rows) > limit
        return LockPage(records, rows[limit - 1][0] if more else None, now)

    def _queue_stats(self, keys: list[str]) -> dict[str, QueueStats]:
        by_storage = {self.storage_key(key): key for key in keys}
        rows = self.ops.queue_stats(list(by_storage))
        return {
            by_storage[str(storage_key)]: QueueStats(
                int(count), None if since is None else int(since)
            )
            for storage_key, count, since in rows
            if str(storage_key) in by_storage
        }

    def _count_expired(self) -> int:
        return self.ops.count_expired(self._cleanup_cutoff(self.now_ms()))

    def _delete_expired_batch(self, batch_size: int) -> int:
        return self.ops.delete_expired_batch(batch_size, self._cleanup_guard_ms)

    # ------------------------------------------------------- fence continuity
    # The floor is a row of syncguard_fence_counters (sql.FLOOR_KEY); the vendors'
    # SQL and why compaction cannot make a fence go back: specs/backends/database.md,
    # Fence continuity.
    def _fence_floor(self) -> int:
        return self.ops.fence_floor()

    def _raise_fence_floor(self, fence: int) -> int:
        return self.ops.raise_fence_floor(fence)

    def _highest_fence(self) -> int:
        return self.ops.highest_fence()

    def _idle_counters(
        self, cutoff_ms: int, cursor: str | None, limit: int, *, stamp: bool
    ) -> tuple[list[IdleCounter], str | None]:
        """Keyset pagination on the fence key, as ``_list_locks`` on the lock key: the
        cursor is the last fence key looked at; one row more than ``limit`` tells
        there is a next page. ``guard`` is the acquisition time as read."""
        rows = self.ops.idle_page(cursor or "", cutoff_ms, limit, stamp)
        idle = [
            IdleCounter(str(name), int(fence), None if acquired is None else int(acquired))
            for name, fence, acquired, is_idle in rows[:limit]
            if is_idle
        ]
        return idle, (str(rows[limit - 1][0]) if len(rows) > limit else None)

    def _delete_idle_counters(self, counters: list[IdleCounter], cutoff_ms: int) -> int:
        if not counters:
            return 0
        return self.ops.delete_idle([(c.name, c.fence) for c in counters], cutoff_ms)

    # Async: the private connections are per thread, so any worker thread will do.
    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await sync_to_async(fn, thread_sensitive=False)(*args)


def _record(row: Row) -> LockRecord:
    storage_key, lock_id, expires, acquired, fence, user_key, owner = row
    return LockRecord(
        key=user_key if user_key is not None else storage_key,
        lock_id=lock_id,
        expires_at_ms=int(expires),
        acquired_at_ms=int(acquired),
        fence=fence,
        owner=owner,
    )


def _storage_keys(key: str) -> StorageKeys:
    storage_key = make_storage_key("", key, LIMIT_BYTES, RESERVE)
    fence_key = fence_key_of("", storage_key, LIMIT_BYTES, RESERVE)
    # A plain str: the Key must not hold itself through its own cache.
    return StorageKeys(storage_key, fence_key, str(key) if storage_key != key else None)
