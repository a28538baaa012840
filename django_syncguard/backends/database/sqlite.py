"""SQLite: the embedded database for development; time is this machine's clock.

Every process of an SQLite database runs on one machine, so they share that clock.
Writers are serialised by SQLite's database lock. A live lock is answered from a read;
otherwise the multi-statement acquire decides under the queue file's write lock and
takes the database's only to write (``SqliteOperations._decide``: a key taken
meanwhile never meets a write lock of ours while its holder writes; with wait queues
off there is no queue file, and ``BEGIN IMMEDIATE`` takes the database's). Release and
extend are single ``DELETE`` / ``UPDATE ... RETURNING`` statements (SQLite 3.35 or
newer). See ``specs/backends/database.md``, Operations on SQLite.

Wait queues (fair waiting) live in a file of their own beside the database
(:func:`queue_file`), attached to each private connection as ``syncguard_queue``: a
waiter must queue its ticket while the key is held, and any commit to the database
file between a holder's first read and its first write in its transaction makes that
write fail at once ("database is locked"). A commit to the queue file does not.

A release grants the key to its first live waiter (decision 48): the lock is written
for that waiter in the release's transaction, named by the waiter's ticket id. A
waiter of this process gets the grant through :class:`LocalWakeUps` at once; a waiter
of another process finds it at its next poll, whose attempt claims the lock (renamed
with that attempt's lock id). Unclaimed, the grant is gone ``GRANT_WINDOW_MS`` after
it was made (``waiting.queues.unclaimed_expiry``).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from functools import partial
from typing import Any, ClassVar, TypeAlias, TypeVar

from django.core import checks
from django.db import OperationalError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created

from ...constants import TIME_TOLERANCE_MS
from ...errors import NetworkTimeout, ServiceUnavailable
from ...fence_floors import next_fence
from ...fencing import FENCE_MAX, format_fence
from ...lifecycle import track
from ...liveness import Clock, is_live, system_clock_ms
from ...results import TimeAuthority
from ...waiting import Grant, Queue, WaitTicket, queue_admits, queue_head
from ...waiting.queues import unclaimed_expiry
from .operations import (
    ACQUIRED,
    FENCE_OVERFLOW,
    FENCE_PREFIX,
    IDLE_COUNTER,
    LOCK_COLUMNS,
    LOCKED,
    AcquireReply,
    DatabaseOperations,
    OnGrant,
    Row,
    Runner,
    StorageKeys,
    WakeUpHooks,
    fetch_all,
    fetch_one,
    fetch_row,
    fetch_value,
    row_count,
)
from .sql import FLOOR_KEY
from .wakeups import DatabaseWakeUps, LocalWakeUps

T = TypeVar("T")

logger = logging.getLogger("django_syncguard.backends.database")

#: What a grant step did: ``(ticket, grant)``, or ``(ticket, None)`` when the first
#: waiter is only to be woken.
Granted: TypeAlias = tuple[str, Grant | None]

SELECT_LOCK = "SELECT expires_at_ms FROM syncguard_locks WHERE key = %s"
# The key's lock and who holds it: a lock granted to a waiter and not yet claimed by
# that waiter's next attempt is named by the waiter's ticket id (the waiter cannot
# know a lock id drawn by the releaser; its attempt renames the lock when it claims).
SELECT_HOLDER = "SELECT expires_at_ms, lock_id FROM syncguard_locks WHERE key = %s"
# The key's counter and the fence floor (a row of the same table, sql.FLOOR_KEY).
SELECT_FENCES = (
    "SELECT (SELECT fence FROM syncguard_fence_counters WHERE fence_key = %s), "
    "(SELECT fence FROM syncguard_fence_counters WHERE fence_key = %s)"
)
UPSERT_LOCK = (
    f"INSERT INTO syncguard_locks ({LOCK_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s) "
    "ON CONFLICT (key) DO UPDATE SET lock_id = excluded.lock_id, "
    "expires_at_ms = excluded.expires_at_ms, acquired_at_ms = excluded.acquired_at_ms, "
    "fence = excluded.fence, user_key = excluded.user_key, owner = excluded.owner"
)
UPSERT_FENCE = (
    "INSERT INTO syncguard_fence_counters (fence_key, fence, acquired_at_ms) "
    "VALUES (%s, %s, %s) ON CONFLICT (fence_key) DO UPDATE SET fence = excluded.fence, "
    "acquired_at_ms = excluded.acquired_at_ms"
)
RELEASE = (
    "DELETE FROM syncguard_locks WHERE lock_id = %s AND expires_at_ms > %s "
    "RETURNING key, coalesce(user_key, key)"
)

# The wait queue, in the attached queue file: the layout of the syncguard_waiters table
# that migration 0004 makes (that table, in the database file, stays empty on SQLite).
QUEUE_SCHEMA = "syncguard_queue"
QUEUE = f"{QUEUE_SCHEMA}.syncguard_waiters"
CREATE_QUEUE = (
    f"CREATE TABLE IF NOT EXISTS {QUEUE} (key text NOT NULL, ticket_id varchar(22) NOT NULL, "
    "arrival bigint NOT NULL, live_until_ms bigint NOT NULL, queued_at_ms bigint, "
    "grant_request text, PRIMARY KEY (key, ticket_id)) WITHOUT ROWID"
)
# A queue file made before queued_at_ms (the inspector's oldest wait) or grant_request
# (what a release grants the key with) gets the column when a connection attaches it;
# NULL in the rows written before, or by older code (such a waiter is only woken).
QUEUE_COLUMNS = f"PRAGMA {QUEUE_SCHEMA}.table_info(syncguard_waiters)"
ADDED_QUEUE_COLUMNS = {
    "queued_at_ms": f"ALTER TABLE {QUEUE} ADD COLUMN queued_at_ms bigint",
    "grant_request": f"ALTER TABLE {QUEUE} ADD COLUMN grant_request text",
}
SELECT_QUEUE = f"SELECT ticket_id, arrival, live_until_ms FROM {QUEUE} WHERE key = %s"
SELECT_REQUESTS = (
    f"SELECT ticket_id, arrival, live_until_ms, grant_request FROM {QUEUE} WHERE key = %s"
)
# A renewal keeps the ticket's queueing time; a new arrival number (the ticket came
# back after its place lapsed: it goes to the end) starts it again. The grant request
# is written once (NULL from a caller that takes no grant).
UPSERT_TICKET = (
    f"INSERT INTO {QUEUE} (key, ticket_id, arrival, live_until_ms, queued_at_ms, "
    "grant_request) VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (key, ticket_id) DO UPDATE SET "
    "queued_at_ms = CASE WHEN arrival = excluded.arrival THEN queued_at_ms "
    "ELSE excluded.queued_at_ms END, "
    "arrival = excluded.arrival, live_until_ms = excluded.live_until_ms, "
    "grant_request = coalesce(grant_request, excluded.grant_request)"
)
# A release with grants also says whether a live waiter is queued for the key: read in
# the same statement (from the queue file), so a release nobody waits for costs what
# it did.
RELEASE_QUEUED = (
    "DELETE FROM syncguard_locks WHERE lock_id = %s AND expires_at_ms > %s "
    f"RETURNING key, coalesce(user_key, key), EXISTS (SELECT 1 FROM {QUEUE} w "
    "WHERE w.key = syncguard_locks.key AND w.live_until_ms > %s)"
)
# The waiter's attempt claims the lock granted to its ticket: the lock takes this
# attempt's lock id and the lease's expiry. Parameters: lock id, ttl ms, storage key,
# ticket id, live after (now - tolerance).
CLAIM_CROSSED = (
    "UPDATE syncguard_locks SET lock_id = %s, expires_at_ms = acquired_at_ms + %s "
    "WHERE key = %s AND lock_id = %s AND expires_at_ms > %s RETURNING fence, expires_at_ms"
)
# Whether a live waiter is queued for the key of the lock a release names (read before
# the release, to make the release and the grant one transaction when one is).
WAITED = (
    f"SELECT EXISTS (SELECT 1 FROM syncguard_locks l JOIN {QUEUE} w ON w.key = l.key "
    "WHERE l.lock_id = %s AND w.live_until_ms > %s)"
)
# A waiter that gives up gives back the key granted to its ticket (claimed or not).
WITHDRAW_GRANT = (
    "DELETE FROM syncguard_locks WHERE key = %s AND lock_id = %s AND expires_at_ms > %s RETURNING 1"
)
DELETE_TICKET = f"DELETE FROM {QUEUE} WHERE key = %s AND ticket_id = %s"
# The first statement of a transaction that decides whether to write a key's lock:
# it takes the queue file's write lock (every such decision is made under it) and
# changes nothing. See SqliteOperations._decide.
LOCK_QUEUE_FILE = f"DELETE FROM {QUEUE} WHERE 0"
PRUNE_QUEUE = f"DELETE FROM {QUEUE} WHERE key = %s AND live_until_ms <= %s"
WITHDRAW = f"{DELETE_TICKET} RETURNING 1"
EXTEND = (
    "UPDATE syncguard_locks SET expires_at_ms = %s "
    "WHERE lock_id = %s AND expires_at_ms > %s RETURNING expires_at_ms"
)
EXISTS_ID = "SELECT 1 FROM syncguard_locks WHERE lock_id = %s"
SWEEP_KEY = "DELETE FROM syncguard_locks WHERE key = %s AND expires_at_ms < %s"
LOOKUP = f"SELECT {LOCK_COLUMNS} FROM syncguard_locks WHERE {{column}} = %s"

# One batch of cleanup. The statement holds the database lock, and acquire writes only
# in a transaction whose reads are still current (SqliteOperations._decide), so the
# two never interleave.
DELETE_EXPIRED = (
    "DELETE FROM syncguard_locks WHERE key IN (SELECT key FROM syncguard_locks "
    "WHERE expires_at_ms < %s ORDER BY expires_at_ms LIMIT %s) AND expires_at_ms < %s"
)

# Fence continuity (specs/backends/database.md, Fence continuity). Each statement, or
# the transaction of a batch, holds the database's write lock, and an acquire's write
# fails (and is tried again) when the database was written since its reads: none of
# them interleaves with an acquire.
RAISE_FLOOR = (
    "INSERT INTO syncguard_fence_counters (fence_key, fence) VALUES (%s, %s) "
    "ON CONFLICT (fence_key) DO UPDATE SET fence = max(fence, excluded.fence) "
    "RETURNING fence"
)
# Live tickets of the counter's key in the queue file (with queues on).
NO_LIVE_TICKET = (
    f" AND NOT EXISTS (SELECT 1 FROM {QUEUE} w "
    f"WHERE w.key = substr({{c}}.fence_key, {len(FENCE_PREFIX) + 1}) "
    "AND w.live_until_ms > %s)"
)
# Parameters: cut-off, live after (now - tolerance)[, now: with queues].
# substr(), not LIKE: SQLite's LIKE ignores case.
IDLE = IDLE_COUNTER.format(
    c="c",
    live_after="%s",
    mapped=f"substr(c.fence_key, 1, {len(FENCE_PREFIX)}) = '{FENCE_PREFIX}'",
    no_waiter="NOT c.waiters",
)
IDLE_WITH_QUEUE = IDLE + NO_LIVE_TICKET.format(c="c")
# One page: the counters after the cursor in key order, each with whether it is idle.
# Parameters: those of the condition, then cursor, floor key, limit + 1.
IDLE_PAGE = (
    "SELECT c.fence_key, c.fence, c.acquired_at_ms, coalesce({idle}, 0) "
    "FROM syncguard_fence_counters c WHERE c.fence_key > %s AND c.fence_key <> %s "
    "ORDER BY c.fence_key LIMIT %s"
)
# The stamp of one page (the keys after the cursor up to its last).
STAMP = (
    "UPDATE syncguard_fence_counters SET acquired_at_ms = %s WHERE acquired_at_ms IS NULL "
    "AND fence_key > %s AND fence_key <= %s AND fence_key <> %s"
)
# One counter of a batch. Parameters: fence key, fence, floor key, then the condition's.
DELETE_IDLE = (
    "DELETE FROM syncguard_fence_counters AS c "
    "WHERE c.fence_key = %s AND c.fence = %s AND c.fence_key <> %s AND {idle}"
)


#: Longest pause between two tries of acquire for SQLite's write lock (the first
#: pause is 1 ms, then each one doubles).
WRITE_LOCK_PAUSE_MAX_S = 0.02

#: How long a call waits for SQLite's write lock once the calling thread's own
#: transaction on the same database has written (or, without WAL, read): that
#: transaction then holds what the call needs, so waiting longer cannot help.
CALLER_TRANSACTION_WAIT_MS = 100

BLOCKED_BY_CALLER = (
    "Database {database!r} is SQLite, and this thread's transaction on it has written "
    "(or, without WAL, read): "
    "SQLite lets one writer in at a time, and the lock backend writes through its own "
    "connection, so this call would wait for your transaction, which waits for this "
    "call. Take the lock before the transaction writes (e.g. decorate the view, or open "
    "atomic() inside the locked code), or keep the locks in an SQLite database of their "
    "own (README: SQLite set-up). In a TestCase, the transaction is the test's own: run "
    "the tests on the memory backend."
)


# System-check message of this vendor (see checks.py for the table of ids).
W002 = (
    "Lock backend {alias!r} keeps its locks in the SQLite database DATABASES[{database!r}], "
    "whose OPTIONS['transaction_mode'] is {mode!r}: every atomic() block takes the "
    "database's write lock as it starts, and the lock backend writes through its own "
    "connection, so no lock can be taken or released inside such a block (it fails at "
    "once with ServiceUnavailable)."
)
W002_HINT = (
    "Leave transaction_mode at Django's default for this database, or keep the locks in "
    "an SQLite database of their own (README: SQLite set-up)."
)


class SqliteOperations(DatabaseOperations):
    """SQLite through the standard library's sqlite3; see the module docstring.

    SQLite has one writer at a time per database file. Once the calling thread's own
    transaction on the locks' database (its Django connection, not ours) has written,
    it holds the write lock until it ends, so a write of ours could only wait for it:
    such a call waits ``CALLER_TRANSACTION_WAIT_MS`` at most and then fails with
    ``ServiceUnavailable`` (``BLOCKED_BY_CALLER``) instead of stalling for the whole
    operation timeout. Before that first write (Django opens the transaction with a
    plain ``BEGIN``, which takes no lock), calls wait as usual: another request's
    write lock is ordinary contention. ``until_commit`` keeps releases out of it.
    """

    vendor: ClassVar[str] = "sqlite"
    backend_name: ClassVar[str] = "sqlite"
    time_authority: ClassVar[TimeAuthority] = "client"

    def __init__(
        self, run: Runner, clock: Clock = system_clock_ms, *, database: str, queues: bool = True
    ) -> None:
        self._wal_mode: bool | None = None
        bounded = self._bounded_under_caller_transaction(run)
        super().__init__(bounded, clock, database=database, queues=queues)
        self.prepare_process(database)  # already done at ready(), unless the alias is new

    @classmethod
    def prepare_process(cls, database: str) -> None:
        """Watch the application's transactions on ``database`` from the start: a
        backend built lazily, by a first lock call inside a transaction that has
        already written, would not have seen that write, and the call would wait out
        the busy timeout instead of failing fast (``BLOCKED_BY_CALLER``)."""
        watch_transaction_writes(database)

    def check(self, alias: str) -> list[Any]:
        """``syncguard.W002`` when every transaction on the locks' database takes its
        write lock up front. (``ATOMIC_REQUESTS`` alone is fine: a lock taken before the
        request's first write is taken at once, and released after the commit.)"""
        options = connections.settings[self.database].get("OPTIONS") or {}
        mode = str(options.get("transaction_mode") or "")
        if mode.upper() not in ("IMMEDIATE", "EXCLUSIVE"):
            return []
        message = W002.format(alias=alias, database=self.database, mode=mode)
        return [checks.Warning(message, hint=W002_HINT, id="syncguard.W002")]

    def _bounded_under_caller_transaction(self, run: Runner) -> Runner:
        def bounded_run(work: Callable[[Any], T]) -> T:
            if not caller_transaction_holds(self.database, wal=self._wal(run)):
                return run(work)
            try:
                return run(partial(_with_busy_timeout, CALLER_TRANSACTION_WAIT_MS, work))
            except NetworkTimeout as exc:  # "database is locked"
                message = BLOCKED_BY_CALLER.format(database=self.database)
                raise ServiceUnavailable(message, context={"cause": exc}) from exc

        return bounded_run

    def _wal(self, run: Runner) -> bool:
        """Whether the database is in WAL mode (asked once: the mode is the file's)."""
        if self._wal_mode is None:
            mode = run(lambda cursor: fetch_value(cursor, "PRAGMA journal_mode", []))
            self._wal_mode = str(mode).lower() == "wal"
        return self._wal_mode

    @classmethod
    def connection_options(
        cls, options: dict[str, Any], *, connect_timeout_ms: int, operation_timeout_ms: int
    ) -> None:
        options["timeout"] = operation_timeout_ms / 1000  # SQLite busy timeout

    def now_ms(self) -> int:
        return self.clock()

    #: A release grants the key to its first live waiter (decision 48). The waiters of
    #: other processes find their grant at their next poll (no channel reaches them);
    #: see specs/backends/database.md, SQLite, for what it costs and gains.
    grants: ClassVar[bool] = True

    @property
    def _grants(self) -> bool:
        """Grants are made here: this vendor grants and the backend keeps queues."""
        return self.queues and self.grants

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
        # (No channel between processes here: ``process_channel`` and ``on_grant`` are
        # never used; a grant wakes this process's waiter directly.)
        # A queued ticket leaves its grant request only when the backend asks for
        # grants (``grant_window_ms``): what the lock written for it will be.
        request = None
        if ticket is not None and grant_window_ms is not None and self._grants:
            request = json.dumps(
                [ttl_ms, int(clock), owner, keys.user_key, keys.fence_key, grant_window_ms],
                separators=(",", ":"),
            )
        return self.run(
            lambda c: self._acquire(
                c, keys, lock_id, ttl_ms, check_cancel, ticket, clock, owner, request
            )
        )

    def _acquire(
        self,
        cursor: Any,
        keys: StorageKeys,
        lock_id: str,
        ttl_ms: int,
        check_cancel: Callable[[], None],
        ticket: WaitTicket | None,
        clock: bool,
        owner: str | None = None,
        request: str | None = None,
    ) -> AcquireReply:
        """Acquire in one transaction that SQLite lets write only while its reads are
        current (:meth:`_decide`), unless a read before it finds the key held. A ticket
        for a held key, or one that is not first in line, is queued in a transaction of
        the queue file alone. With grants, a ticket that finds the key granted to it
        claims that lock instead, and an attempt that finds the key free behind another
        waiter grants it to that waiter first."""
        state, reply = self._decide_unless_held(
            cursor,
            keys.storage_key,
            ticket,
            lambda c: self._read_then_write(
                c, keys, lock_id, ttl_ms, check_cancel, ticket, clock, owner, request
            ),
        )
        if reply is not None:
            return reply
        if state == _GRANTED and ticket is not None:
            claimed = self._claim_crossed(cursor, keys, lock_id, ttl_ms, ticket, check_cancel)
            if claimed is not None:
                return claimed
        elif state == _BEHIND_GRANTABLE:
            # Free, and another waiter is first: a lease ran out, or a grant lapsed, and
            # this attempt is the first to notice. The key goes to that waiter now.
            self._grant_next(cursor, keys.user_key or keys.storage_key, keys.storage_key)
        if ticket is None:
            return LOCKED, None, None, None, None
        crossed, position = self._enqueue(cursor, keys.storage_key, ticket, request)
        if crossed:
            claimed = self._claim_crossed(cursor, keys, lock_id, ttl_ms, ticket, check_cancel)
            if claimed is not None:
                return claimed
            position = 0  # the grant lapsed meanwhile: try again soon
        return LOCKED, None, None, position, None

    def _decide_unless_held(
        self,
        cursor: Any,
        storage_key: str,
        ticket: WaitTicket | None,
        decide: Callable[[Any], tuple[T, bool]],
    ) -> tuple[str, T | None]:
        """``(_DECIDED, what decide returned)`` from :meth:`_decide`, unless a read
        outside any transaction finds the key's lock live (``_HELD``, or ``_GRANTED``
        when it was granted to ``ticket``) or another live waiter first in its queue
        (``_BEHIND``, or ``_BEHIND_GRANTABLE`` when the key is free for a grant to that
        waiter): then no write lock was taken, and the state comes with None.

        Tries do not wait for a write lock (busy timeout 0); between tries the key is
        read again, for as long as the connection's busy timeout allows (see
        :func:`_retry_while_locked`). So callers waiting for a held key never take a
        write lock, nor do waiters whose turn it is not."""

        def attempt(wait_ms: int) -> tuple[str, T | None]:
            now = self.clock()
            holder = fetch_row(cursor, SELECT_HOLDER, [storage_key])
            if holder is not None and is_live(int(holder[0]), now, TIME_TOLERANCE_MS):
                granted = ticket is not None and holder[1] == ticket.id
                return _GRANTED if granted else _HELD, None
            behind = self._behind(cursor, storage_key, ticket, now)
            if behind is not None:
                return behind, None
            return _DECIDED, self._decide(cursor, decide, wait_ms)

        return _retry_while_locked(cursor, attempt)

    def _decide_with_retries(self, cursor: Any, decide: Callable[[Any], tuple[T, bool]]) -> T:
        """:meth:`_decide`, tried again while a lock it needs is taken (see
        :func:`_retry_while_locked`). Every transaction that writes both files runs
        this way: no try waits for one file's write lock while it holds the other's
        (a wait there would hold up either the holders of other keys, who need the
        database's lock to write, or every waiter, who needs the queue file's)."""
        return _retry_while_locked(cursor, partial(self._decide, cursor, decide))

    def _decide(
        self, cursor: Any, decide: Callable[[Any], tuple[T, bool]], commit_wait_ms: int
    ) -> T:
        """One try of ``decide(cursor)``, which reads a key's lock and writes it or
        not: ``(result, whether it wrote)``; COMMIT when it wrote, else ROLLBACK.

        The transaction takes the queue file's write lock before it reads anything,
        and the database's only when ``decide`` writes to it (the release that grants
        and compaction's batches run here too: they write both files). Every decision
        to write a key's lock (acquire, grant, claim, a waiter's give-back) is made
        under the queue file's write lock, so no other decision takes the key between
        this read and this write; and a decision that finds the key taken meanwhile
        never holds the database's write lock. That matters to the key's new holder: its
        transaction may be between reading and writing, and SQLite fails such a write
        at once ("database is locked", no busy wait) while another connection holds
        the database's write lock. ``decide``'s write to the database is the same kind
        of write (it has read the lock first): when another connection holds the
        database's write lock, or committed since the read, it fails at once, and
        :func:`_retry_while_locked` tries again. Without queues there is no queue file:
        ``BEGIN IMMEDIATE`` takes the database's write lock from the start, as before
        queues, and a key taken between the read before it and this one meets it.

        The ``COMMIT`` waits as every commit does, for up to ``commit_wait_ms`` (what
        is left of the busy timeout the tries run without): a file in the rollback
        journal (the database, or a queue file whose switch to WAL failed) makes its
        commit wait for that file's readers to finish; under WAL a commit never
        waits."""
        try:
            # Inside the try: a BEGIN that fails (a transaction left open) rolls back.
            cursor.execute("BEGIN" if self.queues else "BEGIN IMMEDIATE")
            if self.queues:
                cursor.execute(LOCK_QUEUE_FILE)
            result, wrote = decide(cursor)
            if not wrote:
                cursor.execute("ROLLBACK")
            else:
                with _busy_timeout(cursor, commit_wait_ms):
                    cursor.execute("COMMIT")
        except BaseException:
            with suppress(Exception):
                cursor.execute("ROLLBACK")
            raise
        return result

    def _behind(
        self, cursor: Any, storage_key: str, ticket: WaitTicket | None, now: int
    ) -> str | None:
        """``_BEHIND`` when a live waiter other than ``ticket`` is first in the key's
        queue (``_BEHIND_GRANTABLE`` when that waiter left a grant request and this
        backend grants), else None (a read outside any transaction; the acquire's
        transaction decides again)."""
        if not self.queues:
            return None
        queue, requests = _read_requests(cursor, storage_key)
        head = queue_head(queue, now)
        if head is None or (ticket is not None and head == ticket.id):
            return None
        return _BEHIND_GRANTABLE if self._grants and requests.get(head) else _BEHIND

    @staticmethod
    def _granted_to(cursor: Any, storage_key: str, ticket_id: str, now: int) -> bool:
        """Whether the key's live lock is the one granted to ``ticket_id`` (claimed or
        not: a claim renames it only outside the grant's own process)."""
        holder = fetch_row(cursor, SELECT_HOLDER, [storage_key])
        return (
            holder is not None
            and holder[1] == ticket_id
            and is_live(int(holder[0]), now, TIME_TOLERANCE_MS)
        )

    @staticmethod
    def _live(cursor: Any, storage_key: str, now: int) -> bool:
        """Whether a live lock holds ``storage_key`` at ``now``."""
        expires = fetch_value(cursor, SELECT_LOCK, [storage_key])
        return expires is not None and is_live(int(expires), now, TIME_TOLERANCE_MS)

    def _read_then_write(
        self,
        cursor: Any,
        keys: StorageKeys,
        lock_id: str,
        ttl_ms: int,
        check_cancel: Callable[[], None],
        ticket: WaitTicket | None,
        clock: bool,
        owner: str | None = None,
        request: str | None = None,
    ) -> tuple[AcquireReply, bool]:
        """The acquire's reads and writes inside its transaction (:meth:`_decide`); the
        reply, and whether anything was written (to commit). The fence is
        ``next_fence`` of the counter and the floor, read together, and of this
        machine's clock in clock mode. A key granted to ``ticket`` since the first read
        is claimed."""
        now = self.clock()
        holder = fetch_row(cursor, SELECT_HOLDER, [keys.storage_key])
        live = holder is not None and is_live(int(holder[0]), now, TIME_TOLERANCE_MS)
        if live and ticket is not None and holder is not None and holder[1] == ticket.id:
            claimed = self._claim_crossed(
                cursor, keys, lock_id, ttl_ms, ticket, check_cancel, in_transaction=True
            )
            if claimed is not None:
                return claimed, True
        take, position, before, queue = _queue_rule(
            cursor, keys.storage_key, now, free=not live, ticket=ticket, stored=self.queues
        )
        if not take:
            check_cancel()  # before the queue's writes
            wrote = _write_queue(cursor, keys.storage_key, before, queue, now, request)
            return (LOCKED, None, None, position, None), wrote
        last, floor = fetch_one(cursor, SELECT_FENCES, [keys.fence_key, FLOOR_KEY])
        fence = next_fence(int(last or 0), int(floor or 0), now if clock else None)
        if fence > FENCE_MAX:
            return (FENCE_OVERFLOW, None, None, None, None), False
        check_cancel()  # after the reads, before the writes
        _write_queue(cursor, keys.storage_key, before, queue, now)
        cursor.execute(
            UPSERT_LOCK,
            [
                keys.storage_key,
                lock_id,
                now + ttl_ms,
                now,
                format_fence(fence),
                keys.user_key,
                owner,
            ],
        )
        cursor.execute(UPSERT_FENCE, [keys.fence_key, fence, now])
        return (ACQUIRED, fence, now + ttl_ms, None, None), True

    def _claim_crossed(
        self,
        cursor: Any,
        keys: StorageKeys,
        lock_id: str,
        ttl_ms: int,
        ticket: WaitTicket,
        check_cancel: Callable[[], None],
        *,
        in_transaction: bool = False,
    ) -> AcquireReply | None:
        """The key was granted to ``ticket`` while this attempt was on its way: claim
        that lock, which takes this attempt's ``lock_id`` and the lease's expiry (its
        acquisition time, the grant's, plus ``ttl_ms``). None when the grant lapsed or
        went meanwhile.

        Outside a transaction the claim commits without waiting for the disk
        (``synchronous = NORMAL`` for its one statement): it writes no fence (the grant
        that did was durable), and the power cut that could lose it also ends the
        holder, every process of an SQLite database being on one machine. Without it,
        a hand-off to another process cost one more synced commit than before grants."""
        check_cancel()  # before the write: unclaimed, the grant lapses by itself
        if in_transaction:
            now = self.clock()
            params = [lock_id, ttl_ms, keys.storage_key, ticket.id, now - TIME_TOLERANCE_MS]
            row = fetch_row(cursor, CLAIM_CROSSED, params)
        else:

            def claim(c: Any) -> tuple[Row | None, bool]:
                # The grant may have lapsed and the key gone to another caller since
                # the attempt read it: write only while it is still this ticket's.
                now = self.clock()
                if not self._granted_to(c, keys.storage_key, ticket.id, now):
                    return None, False
                params = [lock_id, ttl_ms, keys.storage_key, ticket.id, now - TIME_TOLERANCE_MS]
                claimed = fetch_row(c, CLAIM_CROSSED, params)
                return claimed, claimed is not None

            with _synchronous(cursor, "NORMAL"):
                row = self._decide_with_retries(cursor, claim)
        if row is None:
            return None
        return ACQUIRED, int(row[0]), int(row[1]), None, None  # renamed: this lock id

    def _enqueue(
        self, cursor: Any, storage_key: str, ticket: WaitTicket, request: str | None = None
    ) -> tuple[bool, int | None]:
        """Queue (or renew) ``ticket`` for the held key, in a transaction that writes
        the queue file only; its first statement, which prunes the key's stale
        tickets, takes that file's write lock before anything is read from it. Returns
        whether the key is granted to the ticket (then nothing is queued: a grant takes
        the queue file's write lock too, so this read sees it whole), and otherwise the
        ticket's place among the live waiters."""
        with _transaction(cursor, "BEGIN"):
            now = self.clock()
            cursor.execute(PRUNE_QUEUE, [storage_key, now])
            if self._grants and self._granted_to(cursor, storage_key, ticket.id, now):
                return True, None
            _, position, before, queue = _queue_rule(
                cursor, storage_key, now, free=False, ticket=ticket
            )
            _write_queue(cursor, storage_key, before, queue, now, request)
            return False, position

    def prepare_connection(self, raw: Any) -> None:
        """Attach the queue file to a new private connection (with queues on)."""
        if not self.queues:
            return
        raw.execute(f"ATTACH DATABASE ? AS {QUEUE_SCHEMA}", [queue_file(self._name())])
        # Readers of the queue never block its writers, and losing the last queue
        # changes to a power cut costs nothing: a waiter queues again at its next try.
        with suppress(OperationalError, sqlite3.OperationalError):
            raw.execute(f"PRAGMA {QUEUE_SCHEMA}.journal_mode = WAL")
        raw.execute(f"PRAGMA {QUEUE_SCHEMA}.synchronous = OFF")
        raw.execute(CREATE_QUEUE)
        for column, add in ADDED_QUEUE_COLUMNS.items():
            if column in _queue_columns(raw):
                continue
            try:
                raw.execute(add)
            except (OperationalError, sqlite3.OperationalError):
                # Another connection added it first: fine. Anything else ("database
                # is locked") fails this connection's set-up; the next call retries.
                if column not in _queue_columns(raw):
                    raise

    def _name(self) -> str:
        return str(connections[self.database].settings_dict["NAME"])

    def release(self, lock_id: str, *, on_grant: OnGrant | None = None) -> tuple[bool, bool]:
        now = self.clock()
        if not self._grants:
            return self._release_and_wake(lock_id, now)
        wake_ups = self._local()

        def release_and_grant(c: Any) -> tuple[tuple[Row | None, Granted | None], bool]:
            row = fetch_row(c, RELEASE, [lock_id, now - TIME_TOLERANCE_MS])
            if row is None:
                return (None, None), False
            key, storage_key, at = str(row[1]), str(row[0]), self.clock()
            return (row, self._grant(c, key, storage_key, at, wake_ups)), True

        def release(cursor: Any) -> tuple[Row | None, bool, Granted | None]:
            if not fetch_value(cursor, WAITED, [lock_id, now]):
                # Nobody waits: one statement, which says whether a waiter queued since.
                row = fetch_row(cursor, RELEASE_QUEUED, [lock_id, now - TIME_TOLERANCE_MS, now])
            else:
                # The release and the grant in one transaction: one commit, and no
                # attempt sees the key free in between.
                row, granted = self._decide_with_retries(cursor, release_and_grant)
                if row is not None:
                    return row, True, granted
            if row is None:
                return None, fetch_value(cursor, EXISTS_ID, [lock_id]) is not None, None
            return row, True, None

        deleted, existed, granted = self.run(release)  # (storage key, key[, waited])
        if deleted is None:
            return False, existed
        if granted is not None:
            if wake_ups is not None:
                wake_ups.deliver(str(deleted[1]), *granted)
        elif len(deleted) > 2 and deleted[2]:  # a waiter queued between the two reads
            self._hand_on(str(deleted[1]), str(deleted[0]))
        return True, True

    def _release_and_wake(self, lock_id: str, now: int) -> tuple[bool, bool]:
        """Release without grants: delete the lock, then wake its key's first waiter if
        it waits in this process."""
        params = [lock_id, now - TIME_TOLERANCE_MS]

        def release(cursor: Any) -> tuple[Row | None, bool]:
            row = fetch_row(cursor, RELEASE, params)
            if row is not None:
                return row, True
            return None, fetch_value(cursor, EXISTS_ID, [lock_id]) is not None

        deleted, existed = self.run(release)  # (storage key, key) of the deleted lock
        if deleted is None:
            return False, existed
        self._wake_next(str(deleted[1]), str(deleted[0]), now)
        return True, True

    def withdraw(
        self, keys: StorageKeys, key: str, ticket_id: str, *, on_grant: OnGrant | None = None
    ) -> None:
        if not self.queues:
            return
        params = [keys.storage_key, ticket_id]
        if self.run(lambda c: fetch_value(c, WITHDRAW, params)) is None:
            if not self._grants:
                return

            # Not queued: the key may have been granted to the ticket (claimed here, or
            # not yet by anyone). The waiter gave up: the lock goes, the key is granted on.
            def give_back(c: Any) -> tuple[bool, bool]:
                # Only while the key is still this ticket's: otherwise another caller
                # may hold it, whose write must not meet this one's write lock.
                now = self.clock()
                if not self._granted_to(c, keys.storage_key, ticket_id, now):
                    return False, False
                grant = [keys.storage_key, ticket_id, now - TIME_TOLERANCE_MS]
                gone = fetch_value(c, WITHDRAW_GRANT, grant) is not None
                return gone, gone

            if self.run(lambda c: self._decide_with_retries(c, give_back)):
                self._hand_on(key, keys.storage_key)
            return
        now = self.clock()
        if not self.run(lambda c: self._live(c, keys.storage_key, now)):
            if self._grants:
                self._hand_on(key, keys.storage_key)
            else:
                self._wake_next(key, keys.storage_key, now)

    def _local(self) -> LocalWakeUps | None:
        """This process's wake-ups for the database file (None: nobody waits here)."""
        return _local_wake_ups.by_path.get(queue_file(self._name())) if self.queues else None

    def _wake_next(self, key: str, storage_key: str, now: int) -> None:
        """Wake the first live waiter of the free ``key``, if it waits in this process
        (no other process can be reached: they poll). Without grants."""
        wake_ups = self._local()
        if wake_ups is None or not wake_ups.waiting_on(key):
            return
        head = queue_head(self.run(lambda c: _read_queue(c, storage_key)), now)
        if head is not None:
            wake_ups.deliver(key, head)

    def _hand_on(self, key: str, storage_key: str) -> None:
        """After a release or a withdrawal that freed ``key``: grant it to its first live
        waiter (:meth:`_grant_next`). The release is done whatever happens here: should
        the grant fail, the first waiter takes the key itself at its next poll."""
        try:
            self.run(lambda c: self._grant_next(c, key, storage_key))
        except Exception as exc:
            logger.warning("Granting a released key to its next waiter failed: %r", exc)

    def _grant_next(self, cursor: Any, key: str, storage_key: str) -> None:
        """Grant the free ``key`` to its first live waiter (:meth:`_decide`: read
        again and written in one transaction; nothing is granted, and the database's
        write lock is not taken, when the key was taken meanwhile), then tell that
        waiter if it waits in this process (a waiter elsewhere finds the grant at its
        next poll)."""
        wake_ups = self._local()

        def decide(c: Any) -> tuple[Granted | None, bool]:
            granted = self._grant(c, key, storage_key, self.clock(), wake_ups)
            return granted, granted is not None and granted[1] is not None

        granted = self._decide_with_retries(cursor, decide)
        if granted is not None and wake_ups is not None:
            head, grant = granted
            wake_ups.deliver(key, head, grant)

    def _grant(
        self, cursor: Any, key: str, storage_key: str, now: int, wake_ups: LocalWakeUps | None
    ) -> Granted | None:
        """Inside the grant's transaction: write the lock that the first live waiter's
        request asks for, named by its ticket id, and take the ticket out of the queue.
        Returns ``(ticket, grant)``, ``(ticket, None)`` when that waiter is only to be
        woken (no request: a waiter of an older version; or the fence would pass the
        maximum), or None (the key is held, or nobody waits).

        A waiter of this process is listening: the grant reaches it in this thread, so
        it is claimed as it is written (the lease's expiry). Otherwise the lock carries
        the unclaimed expiry, and lapses at the claim deadline unless the waiter's next
        attempt claims it."""
        if self._live(cursor, storage_key, now):
            return None
        queue, requests = _read_requests(cursor, storage_key)
        head = queue_head(queue, now)
        if head is None:
            return None
        request = requests.get(head)
        if not request:
            return head, None
        try:
            ttl_ms, clock, owner, user_key, fence_key, window_ms = json.loads(request)
        except (TypeError, ValueError):  # not a request of ours: only wake that waiter
            return head, None
        last, floor = fetch_one(cursor, SELECT_FENCES, [fence_key, FLOOR_KEY])
        fence = next_fence(int(last or 0), int(floor or 0), now if clock else None)
        if fence > FENCE_MAX:
            return head, None
        here = wake_ups is not None and any(
            listener.ticket_id == head for listener in wake_ups.listeners_of(key)
        )
        expires = now + int(ttl_ms)
        stored = expires if here else unclaimed_expiry(now, int(ttl_ms), int(window_ms))
        cursor.execute(
            UPSERT_LOCK, [storage_key, head, stored, now, format_fence(fence), user_key, owner]
        )
        cursor.execute(UPSERT_FENCE, [fence_key, fence, now])
        cursor.execute(DELETE_TICKET, [storage_key, head])
        return head, Grant(head, fence, expires)

    def make_wake_ups(self, name: str, hooks: WakeUpHooks) -> DatabaseWakeUps:
        # One registry per database file in this process: a release through any backend
        # on the file wakes the waiters of every other.
        path = queue_file(self._name())
        with _local_wake_ups.mutex:
            return _local_wake_ups.by_path.setdefault(path, LocalWakeUps(f"sqlite:{path}"))

    def extend(self, lock_id: str, ttl_ms: int) -> tuple[int | None, bool]:
        now = self.clock()

        def extend(cursor: Any) -> tuple[int | None, bool]:
            cursor.execute(EXTEND, [now + ttl_ms, lock_id, now - TIME_TOLERANCE_MS])
            row = cursor.fetchone()
            if row is not None:
                return int(row[0]), True
            return None, fetch_value(cursor, EXISTS_ID, [lock_id]) is not None

        return self.run(extend)

    def is_locked(self, storage_key: str, sweep_guard_ms: int | None) -> bool:
        now = self.clock()

        def is_locked(cursor: Any) -> bool:
            expires = fetch_value(cursor, SELECT_LOCK, [storage_key])
            if expires is None:
                return False
            if sweep_guard_ms is not None and int(expires) < now - sweep_guard_ms:
                cursor.execute(SWEEP_KEY, [storage_key, now - sweep_guard_ms])
            return is_live(int(expires), now, TIME_TOLERANCE_MS)

        return self.run(is_locked)

    def queue_stats(self, storage_keys: list[str]) -> list[Row]:
        if not self.queues:
            return []
        marks = ", ".join(["%s"] * len(storage_keys))
        sql = (
            f"SELECT key, count(*), min(queued_at_ms) FROM {QUEUE} WHERE key IN ({marks}) "
            "AND live_until_ms > %s GROUP BY key"
        )
        params = [*storage_keys, self.clock()]
        return self.run(lambda c: fetch_all(c, sql, params))

    def lookup(self, column: str, value: str) -> Row | None:
        now = self.clock()
        row = self.run(lambda c: fetch_row(c, LOOKUP.format(column=column), [value]))
        if row is not None and not is_live(int(row[2]), now, TIME_TOLERANCE_MS):
            return None
        return row

    def delete_expired_batch(self, batch_size: int, guard_ms: int) -> int:
        cutoff = self.clock() - guard_ms
        params = [cutoff, batch_size, cutoff]
        return self.run(lambda c: row_count(c, DELETE_EXPIRED, params))

    # ------------------------------------------------------- fence continuity
    def raise_fence_floor(self, fence: int) -> int:
        return int(self.run(lambda c: fetch_value(c, RAISE_FLOOR, [FLOOR_KEY, fence])))

    def _idle(self, cutoff_ms: int, now: int) -> tuple[str, list[Any]]:
        """Compaction's condition on the counter ``c`` at ``now``, and its parameters:
        with queues on, also no live ticket for the key in the queue file (SQLite keeps
        no waiters flag on the counter). Without queues that file is not attached, and
        this backend never looks at a queue anyway."""
        if self.queues:
            return IDLE_WITH_QUEUE, [cutoff_ms, now - TIME_TOLERANCE_MS, now]
        return IDLE, [cutoff_ms, now - TIME_TOLERANCE_MS]

    def idle_page(self, after: str, cutoff_ms: int, limit: int, stamp: bool) -> list[Row]:
        now = self.clock()
        idle, params = self._idle(cutoff_ms, now)
        sql = IDLE_PAGE.format(idle=idle)

        def page(cursor: Any) -> list[Row]:
            rows = fetch_all(cursor, sql, [*params, after, FLOOR_KEY, limit + 1])
            if stamp and rows:
                # The rows read show the counters as they were (NULL: not idle).
                last = rows[min(limit, len(rows)) - 1][0]
                cursor.execute(STAMP, [now, after, last, FLOOR_KEY])
            return rows

        return self.run(page)

    def delete_idle(self, counters: list[tuple[str, int]], cutoff_ms: int) -> int:
        now = self.clock()
        idle, params = self._idle(cutoff_ms, now)
        sql = DELETE_IDLE.format(idle=idle)
        rows = [[name, fence, FLOOR_KEY, *params] for name, fence in counters]

        def delete(cursor: Any) -> tuple[int, bool]:
            # One transaction for the batch (one commit): from its first delete it holds
            # the database's write lock, so no acquire runs between a counter's check
            # and its delete, and the queue file's, so no ticket is queued meanwhile.
            deleted = sum(row_count(cursor, sql, row) for row in rows)
            return deleted, deleted > 0

        return self.run(lambda c: self._decide_with_retries(c, delete))


@contextmanager
def _transaction(cursor: Any, begin: str) -> Iterator[None]:
    """``begin``, the block, then COMMIT; ROLLBACK (best effort) if the block raises."""
    cursor.execute(begin)
    try:
        yield
    except BaseException:
        with suppress(Exception):
            cursor.execute("ROLLBACK")
        raise
    cursor.execute("COMMIT")


@contextmanager
def _busy_timeout(cursor: Any, timeout_ms: int) -> Iterator[int]:
    """SQLite's busy timeout at ``timeout_ms`` for the block, then as it was; yields
    the one it replaced."""
    before = int(fetch_value(cursor, "PRAGMA busy_timeout", []))
    try:
        cursor.execute(f"PRAGMA busy_timeout = {int(timeout_ms)}")
        yield before
    finally:
        cursor.execute(f"PRAGMA busy_timeout = {before}")


@contextmanager
def _synchronous(cursor: Any, level: str) -> Iterator[None]:
    """SQLite's ``synchronous`` at ``level`` for the block (outside any transaction),
    then as it was."""
    before = int(fetch_value(cursor, "PRAGMA synchronous", []))
    cursor.execute(f"PRAGMA synchronous = {level}")
    try:
        yield
    finally:
        cursor.execute(f"PRAGMA synchronous = {before}")


def queue_file(name: str) -> str:
    """The queue file beside the SQLite database ``name`` (a path or a ``file:`` URI,
    which Django's connections accept)."""
    if name.startswith("file:"):
        path, mark, query = name.partition("?")
        return f"{path}-syncguard-queue{mark}{query}"
    if name == ":memory:" or not name:
        return name
    return os.path.abspath(name) + "-syncguard-queue"


def _read_queue(cursor: Any, storage_key: str) -> Queue:
    """The key's queue rows, as :func:`~django_syncguard.waiting.queue_admits` takes it."""
    cursor.execute(SELECT_QUEUE, [storage_key])
    return {str(ticket): (int(arrival), int(until)) for ticket, arrival, until in cursor.fetchall()}


def _queue_rule(
    cursor: Any,
    storage_key: str,
    now: int,
    *,
    free: bool,
    ticket: WaitTicket | None,
    stored: bool = True,
) -> tuple[bool, int | None, Queue, Queue]:
    """Read the key's queue (empty when queues are off: ``stored`` False) and apply
    the queue rule to it: ``(take, position, the queue as read, as it must be stored)``
    (see :func:`~django_syncguard.waiting.queue_admits`)."""
    queue = _read_queue(cursor, storage_key) if stored else {}
    before = dict(queue)
    arrival = max((number for number, _ in queue.values()), default=0) + 1
    take, position = queue_admits(queue, now, free=free, ticket=ticket, arrival=arrival)
    return take, position, before, queue


def _read_requests(cursor: Any, storage_key: str) -> tuple[Queue, dict[str, str | None]]:
    """The key's queue, as :func:`_read_queue`, and each ticket's grant request."""
    cursor.execute(SELECT_REQUESTS, [storage_key])
    queue: Queue = {}
    requests: dict[str, str | None] = {}
    for ticket, arrival, until, request in cursor.fetchall():
        queue[str(ticket)] = (int(arrival), int(until))
        requests[str(ticket)] = request
    return queue, requests


def _write_queue(
    cursor: Any, storage_key: str, before: Queue, after: Queue, now: int, request: str | None = None
) -> bool:
    """Store what the queue rule changed (a new place queued at ``now``, with the
    caller's grant ``request``: the rule changes no other ticket's place); whether it
    changed anything."""
    gone = [ticket for ticket in before if ticket not in after]
    changed = [(t, entry) for t, entry in after.items() if before.get(t) != entry]
    for ticket in gone:
        cursor.execute(DELETE_TICKET, [storage_key, ticket])
    for ticket, (arrival, until) in changed:
        cursor.execute(UPSERT_TICKET, [storage_key, ticket, arrival, until, now, request])
    return bool(gone or changed)


class _LocalRegistries:
    """The in-process wake-ups of each SQLite database file (see make_wake_ups)."""

    def __init__(self) -> None:
        self.by_path: dict[str, LocalWakeUps] = {}
        self.mutex = threading.Lock()
        track(self)

    def reset_after_fork(self) -> None:
        # A parent thread may have held the mutex at the fork; the registries in the
        # dict reset themselves (each is tracked too).
        self.mutex = threading.Lock()


_local_wake_ups = _LocalRegistries()

# What SqliteOperations._decide_unless_held found (see there).
_DECIDED, _HELD, _GRANTED, _BEHIND, _BEHIND_GRANTABLE = (
    "decided",
    "held",
    "granted",
    "behind",
    "behind, grantable",
)


def _retry_while_locked(cursor: Any, attempt: Callable[[int], T]) -> T:
    """``attempt(busy timeout)``, tried again while it fails with "database is
    locked", for as long as the connection's busy timeout allows (the attempt gets
    it: see ``SqliteOperations._decide``, its commit); no try waits for a write lock
    (busy timeout 0): between tries, the attempt reads the key again. SQLite's own wait
    would take the write lock as soon as the current writer commits, even when that
    writer has just taken the key, and a write after a read in the same transaction
    never waits anyway."""
    pause = 0.001
    with _busy_timeout(cursor, 0) as wait_ms:
        deadline = time.monotonic() + wait_ms / 1000
        while True:
            try:
                # What is left of the busy timeout: a commit that waits (see
                # SqliteOperations._decide) never takes the call past it.
                return attempt(max(1, int((deadline - time.monotonic()) * 1000)))
            except OperationalError as exc:
                if "is locked" not in str(exc) or time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(2 * pause, WRITE_LOCK_PAUSE_MAX_S)


def _with_busy_timeout(timeout_ms: int, work: Callable[[Any], T], cursor: Any) -> T:
    """``work(cursor)`` with SQLite's busy timeout at ``timeout_ms``, then as it was."""
    with _busy_timeout(cursor, timeout_ms):
        return work(cursor)


# Which transactions of the application's own connections have written --------------
# A Django connection to an SQLite database opens each transaction with a plain BEGIN
# (no lock) and takes SQLite's write lock at its first write. An execute wrapper on the
# connections of the locks' database notes both; it is installed when such a
# connection is created (Django's connection_created signal), and on a connection that
# already exists when a lock call first sees it (until its next BEGIN nothing is known,
# and calls wait as usual).

_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE", "CREATE", "DROP", "ALTER")
_READS = ("SELECT", "WITH")
_watched: set[str] = set()


class _WriteWatch:
    """An execute wrapper: whether the connection's open transaction has written, and
    whether it has read (under a rollback journal a read holds a shared lock until the
    transaction ends, which a writer's commit must wait for)."""

    def __init__(self) -> None:
        self.wrote = False
        self.read = False

    def __call__(self, execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
        verb = str(sql).lstrip()[:7].upper()
        if verb.startswith("BEGIN"):
            self.wrote = self.read = False
        elif verb.startswith(_WRITES):
            self.wrote = True
        elif verb.startswith(_READS):
            self.read = True
        return execute(sql, params, many, context)


def watch_transaction_writes(database: str) -> None:
    """Watch the application's connections to ``database`` from now on."""
    if database in _watched:
        return
    _watched.add(database)
    connection_created.connect(_on_connection_created, dispatch_uid="django_syncguard.sqlite")
    for connection in connections.all(initialized_only=True):
        _watch(connection)


def _on_connection_created(sender: Any, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
    if connection.alias in _watched and connection in connections.all(initialized_only=True):
        _watch(connection)  # the application's connection, not a private one of ours


def _watch(connection: BaseDatabaseWrapper) -> None:
    if connection.alias in _watched and not _watcher(connection):
        # First, not last: Django's execute_wrapper() pops the last wrapper when its
        # block ends, and a connection opened inside such a block (every request's,
        # under CONN_MAX_AGE=0) would otherwise lose the watch and keep the
        # application's wrapper for good. The watch only looks, so outermost is fine.
        connection.execute_wrappers.insert(0, _WriteWatch())


def _watcher(connection: BaseDatabaseWrapper) -> _WriteWatch | None:
    return next((w for w in connection.execute_wrappers if isinstance(w, _WriteWatch)), None)


def caller_transaction_holds(database: str, *, wal: bool) -> bool:
    """Whether this thread's Django connection to ``database`` is inside a transaction
    that holds what a writer needs: it has written, or, without WAL, read (no I/O)."""
    caller = next((c for c in connections.all(initialized_only=True) if c.alias == database), None)
    if caller is None or caller.connection is None or not caller.connection.in_transaction:
        return False
    _watch(caller)
    watch = _watcher(caller)
    return bool(watch and (watch.wrote or (watch.read and not wal)))


def _queue_columns(raw: Any) -> set[str]:
    """The columns of the attached queue file's table."""
    return {str(row[1]) for row in raw.execute(QUEUE_COLUMNS).fetchall()}
