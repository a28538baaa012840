"""The operations object: what the database backend asks of a vendor.

As Django's ``connection.ops`` does for the ORM, one object per vendor holds the SQL
of every lock operation, and its class holds the facts the backend reports (its
name, whose clock counts) and how a private connection to it is set up. The backend
class picks one when it is built and has no vendor branches of its own.

An operations object runs its statements through ``run``, which hands it a cursor of
the calling thread's private connection and turns driver errors into ``LockError``
(``connections.py``). It returns plain values (statuses, rows); the backend turns
them into results. ``postgresql.py`` and ``sqlite.py`` are the two vendors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, TypeAlias, TypeVar, cast

from ...liveness import Clock, system_clock_ms
from ...results import TimeAuthority
from ...waiting import Grant, WaitTicket
from .sql import FLOOR_KEY

if TYPE_CHECKING:
    from .wakeups import DatabaseWakeUps

T = TypeVar("T")

#: A lock row as the driver returns it: the columns of ``LOCK_COLUMNS``, in order.
Row: TypeAlias = Sequence[Any]

#: What an acquire did, as ``syncguard_acquire`` (migration 0002) and the SQLite
#: path both report it.
LOCKED, ACQUIRED, FENCE_OVERFLOW = 0, 1, 2

#: ``(status, fence, expires_at_ms, queue_position, granted_lock_id)`` of an acquire;
#: the fence (an int) and the expiry are the new lock's when the status is ACQUIRED,
#: else None; the position is the caller's ticket's place among the key's live waiters
#: (0 = next) when the status is LOCKED and a ticket was queued, else None; the lock id
#: is that of a lock a release had granted to the caller's ticket (the attempt crossed
#: the grant: the answer is that lock), else None (the attempt's own lock id).
AcquireReply: TypeAlias = tuple[int, Any, Any, Any, Any]

#: Called with ``(storage key, ticket id)`` when a statement sent as watched granted
#: the key to that ticket and told nobody else (vendors that grant over a channel): the
#: caller's process checks the grant once its window is over (``ChannelWorker.watch``).
#: Passing one is what asks the statement to watch.
OnGrant: TypeAlias = Callable[[str, str], None]

LOCK_COLUMNS = "key, lock_id, expires_at_ms, acquired_at_ms, fence, user_key, owner"

# Housekeeping (admin inspector, syncguard_cleanup), the same SQL on every vendor.
# One page of live locks in key order (keyset pagination on the primary key index, so
# a page costs the same at the start and deep into 100,000 locks). The prefix test is
# an exact substring comparison: LIKE would need escaping and, on SQLite, ignores case.
LIST_PAGE = (
    f"SELECT {LOCK_COLUMNS} FROM syncguard_locks "
    "WHERE key > %s AND expires_at_ms > %s "
    "AND (substr(key, 1, %s) = %s OR substr(user_key, 1, %s) = %s) "
    "ORDER BY key LIMIT %s"
)
COUNT_EXPIRED = "SELECT count(*) FROM syncguard_locks WHERE expires_at_ms < %s"

# Fence continuity (django_syncguard.fence_floors; specs/backends/database.md, Fence
# continuity). The floor is the counter row FLOOR_KEY (see sql/__init__.py for why no
# key's counter can have that name); every statement over counters leaves it out.
FENCE_FLOOR = "SELECT fence FROM syncguard_fence_counters WHERE fence_key = %s"
HIGHEST_FENCE = "SELECT coalesce(max(fence), 0) FROM syncguard_fence_counters WHERE fence_key <> %s"

#: What a fence key starts with when it is not hashed (``keys.fence_key_of``): the
#: rest is the storage key of the key's lock row. A hashed fence key (a storage key of
#: 1695 to 1700 bytes, which the 512-byte keys of today never make) cannot be mapped
#: back to its lock row, so compaction never deletes such a counter.
FENCE_PREFIX = "fence:"

#: The condition under which compaction may delete the counter row ``{c}``: a fence
#: key it can map to a lock row (``{mapped}``, the vendor's test of the prefix), no
#: waiter (``{no_waiter}``, the vendor's test of its queue), last acquired before the
#: cut-off
#: (first parameter; a NULL time is never before it), and no live lock on the key (a
#: lock row expiring after ``{live_after}``, an SQL expression that may take
#: parameters of its own). SQLite adds its queue's condition.
IDLE_COUNTER = (
    "{mapped} AND {no_waiter} AND {c}.acquired_at_ms < %s "
    "AND NOT EXISTS (SELECT 1 FROM syncguard_locks l "
    f"WHERE l.key = substr({{c}}.fence_key, {len(FENCE_PREFIX) + 1}) "
    "AND l.expires_at_ms > {live_after})"
)


class Runner(Protocol):
    """Runs ``work(cursor)`` on the calling thread's private connection."""

    def __call__(self, work: Callable[[Any], T], /) -> T: ...


class WakeUpHooks(NamedTuple):
    """What a vendor's wake-ups need from the backend."""

    #: A new, open connection of its own to listen on (PostgreSQL).
    listen: Callable[[], Any]
    #: Run ``work(cursor)`` on the calling thread's private connection, then close it
    #: (the listener's probe sends its ``pg_notify`` from the listener's thread, which
    #: needs no connection of that kind afterwards; PostgreSQL).
    run_once: Callable[[Callable[[Any], Any]], Any]
    #: The storage key of a key.
    storage_key: Callable[[str], str]
    #: The longest the listener's thread can be busy with the server (``close()``
    #: waits that long for it).
    reply_timeout_s: float
    #: Claim a grant delivered to a waiter of this process, from the listener's thread
    #: (vendors that grant; see ``DatabaseBackend.claim``).
    claim: Callable[[Grant], bool] | None = None
    #: Check a grant this process made once its window is over, from the listener's
    #: thread: ``(storage key, ticket, watched) -> (status, ms left, ticket granted
    #: now)`` (vendors that grant over a channel; see ``DatabaseBackend.check_grant``).
    check_grant: Callable[[str, str, bool], tuple[int, Any, Any]] | None = None


class StorageKeys(NamedTuple):
    """Where one user key's lock and fence counter are stored."""

    #: Primary key of the lock row.
    storage_key: str
    #: Primary key of the fence counter row.
    fence_key: str
    #: The user key, stored beside the row only when it differs from ``storage_key``.
    user_key: str | None


class DatabaseOperations(ABC):
    """One vendor's SQL and facts; see the module docstring. Each vendor's class
    states every fact below."""

    #: ``connection.vendor`` of the Django databases this class serves.
    vendor: ClassVar[str]
    #: What ``capabilities.backend`` reports.
    backend_name: ClassVar[str]
    #: Whose clock decides liveness: the server's, or this machine's.
    time_authority: ClassVar[TimeAuthority]
    #: The database is a server across a network: bound every wait for a reply, and
    #: poll an idle connection before sending on it (the server may have ended it).
    over_network: ClassVar[bool] = False
    #: Send statements on the driver's own cursor, reused, when nothing watches the
    #: queries (parameters bound by the server: no quoting in Python).
    direct_cursor: ClassVar[bool] = False
    #: A release grants the key to the first live waiter that left a grant record
    #: (``specs/decisions.md``, 48), when the backend keeps queues.
    grants: ClassVar[bool] = False
    #: The statement of :meth:`list_page` (a vendor that stores an expiry differently
    #: reads it with an expression of its own).
    list_page_sql: ClassVar[str] = LIST_PAGE

    def __init__(
        self, run: Runner, clock: Clock = system_clock_ms, *, database: str, queues: bool = True
    ) -> None:
        self.run = run
        #: This machine's clock, for a vendor whose time authority is the client.
        self.clock = clock
        #: The ``DATABASES`` alias the locks live in.
        self.database = database
        #: Whether the backend keeps wait queues (``OPTIONS["WAKE_UPS"]``).
        self.queues = queues

    def prepare_connection(self, raw: Any) -> None:
        """Set up a new private driver connection, before Django's own set-up."""
        return  # nothing by default

    @classmethod
    def prepare_process(cls, database: str) -> None:
        """Set up, when the app is ready, what this vendor needs in place from the
        process's start for locks in the ``DATABASES`` alias ``database`` (no I/O)."""
        return  # nothing by default

    @classmethod
    def startup_settings_lost(cls, raw: Any, operation_timeout_ms: int) -> bool:
        """Whether the server runs the new driver connection ``raw`` without the
        timeouts ``connection_options`` asked for (a pooler dropped them)."""
        return False

    @classmethod
    def set_local_timeouts(cls, cursor: Any, operation_timeout_ms: int) -> None:
        """Set the server-side timeouts for the current transaction only."""
        return

    @classmethod
    @abstractmethod
    def connection_options(
        cls, options: dict[str, Any], *, connect_timeout_ms: int, operation_timeout_ms: int
    ) -> None:
        """Set the driver ``OPTIONS`` of a private connection: our timeouts."""

    def check(self, alias: str) -> list[Any]:
        """System-check messages about the ``DATABASES`` alias, for the lock backend
        ``alias`` (no I/O)."""
        return []

    def storable(self, key: str) -> str:
        """``key`` if this vendor can store it, else ``InvalidArgument`` (no I/O)."""
        return key

    @abstractmethod
    def now_ms(self) -> int:
        """The time authority's clock, now, in Unix milliseconds."""

    @abstractmethod
    def acquire(
        self,
        keys: StorageKeys,
        lock_id: str,
        ttl_ms: int,
        check_cancel: Callable[[], None],
        ticket: WaitTicket | None = None,
        *,
        clock: bool,
        owner: str | None = None,
        grant_window_ms: int | None = None,
        process_channel: str | None = None,
        on_grant: OnGrant | None = None,
    ) -> AcquireReply:
        """Take the lock if no live one holds it and no live waiter is ahead of
        ``ticket`` (see ``AcquireReply`` and :mod:`django_syncguard.waiting`); queue the
        ticket otherwise. ``check_cancel`` raises ``Aborted`` when the caller cancelled;
        a vendor calls it where it can still back out without writing. The new fence
        is ``fence_floors.next_fence`` of the key's counter, the floor and, with
        ``clock`` (clock mode), the time authority's clock, all read in the acquire's
        atomic step; the counter is written with the acquisition's time. ``owner``
        (the holder's label, or None) is stored with the lock. With ``grant_window_ms``
        (vendors that grant), a queued ticket leaves a grant record: a release may write
        the lock for it, to be claimed within that window; ``process_channel`` (vendors
        with one) is where that grant is announced. With ``on_grant``, an attempt that
        hands the free key to another waiter first tells nobody else and reports it
        there (see ``OnGrant``)."""

    @abstractmethod
    def release(self, lock_id: str, *, on_grant: OnGrant | None = None) -> tuple[bool, bool]:
        """Delete the live lock ``lock_id``: ``(deleted, a record of it exists)``; once
        deleted, wake the key's first live waiter (``NOTIFY`` on PostgreSQL, this
        process's wake-ups on SQLite), or grant it the key. ``on_grant``: see
        ``OnGrant`` (a vendor without a channel never calls it)."""

    @abstractmethod
    def withdraw(
        self, keys: StorageKeys, key: str, ticket_id: str, *, on_grant: OnGrant | None = None
    ) -> None:
        """Take ``ticket_id`` out of the queue of ``key`` (stored under ``keys``); when
        the key is free, wake the new first live waiter, as ``release`` does."""

    @abstractmethod
    def make_wake_ups(self, name: str, hooks: WakeUpHooks) -> DatabaseWakeUps:
        """This vendor's wake-ups for the backend ``name`` (see ``wakeups.py``)."""

    def claim(self, lock_id: str) -> int:
        """Claim the grant ``lock_id`` (vendors that grant): 1 claimed (or claimed
        already), 2 it lapsed or expired, 0 not found."""
        raise NotImplementedError(f"{self.backend_name} does not grant")

    def check_grant(self, storage_key: str, ticket_id: str, watched: bool) -> tuple[int, Any, Any]:
        """Check a grant this process made once its window is over (vendors that grant
        over a channel): ``(0, None, None)`` claimed or moved on, ``(2, ms, None)`` its
        window ends in ms, ``(1, None, ticket or None)`` it lapsed and the key went on
        (to that ticket, reported when ``watched``)."""
        raise NotImplementedError(f"{self.backend_name} does not watch its grants")

    def deploy_check(self, alias: str, hooks: WakeUpHooks) -> list[Any]:
        """Check messages that need the server (``manage.py check --deploy``)."""
        return []

    @abstractmethod
    def extend(self, lock_id: str, ttl_ms: int) -> tuple[int | None, bool]:
        """Move the live lock's expiry to now + ``ttl_ms``: ``(new expiry or None, a
        record of it exists)``."""

    @abstractmethod
    def is_locked(self, storage_key: str, sweep_guard_ms: int | None) -> bool:
        """Whether a live lock holds the key. With ``sweep_guard_ms``, also delete the
        key's record when it expired longer ago than that (the answer is unchanged)."""

    @abstractmethod
    def lookup(self, column: str, value: str) -> Row | None:
        """The live lock row whose ``column`` (``key`` or ``lock_id``) is ``value``."""

    @abstractmethod
    def delete_expired_batch(self, batch_size: int, guard_ms: int) -> int:
        """Delete up to ``batch_size`` records expired more than ``guard_ms`` ago;
        return how many went."""

    def list_page(self, after: str, live_after: int, prefix: str, limit: int) -> list[Row]:
        """Up to ``limit`` rows with a key after ``after`` (in key order), expiring after
        ``live_after``, whose storage or user key starts with ``prefix``."""
        size = len(prefix)
        params = [after, live_after, size, prefix, size, prefix, limit]
        return self.run(lambda c: fetch_all(c, self.list_page_sql, params))

    def queue_stats(self, storage_keys: list[str]) -> list[Row]:
        """``(storage key, live waiters, earliest queued_at_ms or None)`` of each of
        ``storage_keys`` with a live waiter, in one statement (the inspector's page)."""
        return []

    def count_expired(self, cutoff: int) -> int:
        """How many records expired before ``cutoff``."""
        return int(self.run(lambda c: fetch_value(c, COUNT_EXPIRED, [cutoff])))

    # ------------------------------------------------------- fence continuity
    def fence_floor(self) -> int:
        """The alias's fence floor (0 when never raised)."""
        return int(self.run(lambda c: fetch_value(c, FENCE_FLOOR, [FLOOR_KEY])) or 0)

    @abstractmethod
    def raise_fence_floor(self, fence: int) -> int:
        """Set the floor row to the greater of itself and ``fence`` in one upsert (a
        first raise creates it); return the floor now in force."""

    def highest_fence(self) -> int:
        """The largest fence of any key's counter (0: none), the floor row aside."""
        return int(self.run(lambda c: fetch_value(c, HIGHEST_FENCE, [FLOOR_KEY])))

    @abstractmethod
    def idle_page(self, after: str, cutoff_ms: int, limit: int, stamp: bool) -> list[Row]:
        """The first ``limit`` + 1 counters with a fence key after ``after`` (in key
        order; the floor row aside) as ``(fence_key, fence, acquired_at_ms, idle)``,
        ``idle`` true when the counter meets compaction's condition (IDLE_COUNTER) as
        read. With ``stamp``, the first ``limit`` that have no acquisition time get the
        current one (their row here still shows NULL, and is not idle)."""

    @abstractmethod
    def delete_idle(self, counters: list[tuple[str, int]], cutoff_ms: int) -> int:
        """Delete each ``(fence_key, fence)`` counter whose fence is still that and that
        is still idle (IDLE_COUNTER) at its delete, atomically per counter with respect
        to acquires; return how many were deleted."""


def fetch_all(cursor: Any, sql: str, params: list[Any]) -> list[Row]:
    cursor.execute(sql, params)
    return list(cursor.fetchall())


def row_count(cursor: Any, sql: str, params: list[Any]) -> int:
    cursor.execute(sql, params)
    return int(cursor.rowcount)


def fetch_row(cursor: Any, sql: str, params: list[Any]) -> Row | None:
    cursor.execute(sql, params)
    return cast("Row | None", cursor.fetchone())


def fetch_one(cursor: Any, sql: str, params: list[Any]) -> Row:
    """The row of a statement that always returns one (a call of our functions)."""
    cursor.execute(sql, params)
    return cast(Row, cursor.fetchone())


def fetch_value(cursor: Any, sql: str, params: list[Any]) -> Any:
    row = fetch_row(cursor, sql, params)
    return None if row is None else row[0]
