"""The database backend's class; the package docstring tells what it does."""

from __future__ import annotations

import copy
import logging
import math
import os
import select
import socket
import threading
import weakref
from collections.abc import Callable, Mapping
from contextlib import suppress
from functools import partial
from inspect import signature
from typing import Any, ClassVar, TypeVar, cast

from django.db import DEFAULT_DB_ALIAS, connections
from django.db import Error as DjangoDatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper

from ...cancellation import CancelToken, check_cancel
from ...constants import BACKEND_LIMITS, CLEANUP_GUARD_MS, RESERVE_BYTES, TIME_TOLERANCE_MS
from ...errors import Internal, InvalidArgument, NetworkTimeout, ServiceUnavailable
from ...fencing import FENCE_MAX, fence_overflow_error, format_fence
from ...keys import generate_lock_id, make_fence_key, make_storage_key
from ...liveness import is_live, system_clock_ms
from ...results import AcquireResult, ExtendResult, ReleaseResult
from ..base import BaseLockBackend, LockPage, LockRecord
from .errors import map_database_error

logger = logging.getLogger("django_syncguard.backends.database")

T = TypeVar("T")

SUPPORTED_VENDORS = ("postgresql", "sqlite")
LIMIT_BYTES = BACKEND_LIMITS["POSTGRES"]
RESERVE = RESERVE_BYTES["POSTGRES"]

# PostgreSQL ---------------------------------------------------------------------
# Server time in whole Unix milliseconds, read when the statement runs.
PG_NOW_MS = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"

PG_ACQUIRE = "SELECT * FROM syncguard_acquire(%s, %s, %s, %s, %s, %s, %s)"

# Functions installed by migration 0002; status 1 = done, 2 = expired, 0 = not found.
PG_RELEASE = "SELECT syncguard_release(%s, %s)"
PG_EXTEND = "SELECT * FROM syncguard_extend(%s, %s, %s)"

PG_IS_LOCKED = f"""
SELECT EXISTS (
    SELECT 1 FROM syncguard_locks WHERE key = %s AND expires_at_ms > {PG_NOW_MS} - %s
)
"""

# With CLEANUP_IN_IS_LOCKED: the same answer, and the key's record deleted when it
# expired more than the guard ago (the answer comes from the snapshot before it).
PG_IS_LOCKED_CLEANUP = f"""
WITH t AS (SELECT {PG_NOW_MS} AS now_ms),
swept AS (
    DELETE FROM syncguard_locks l USING t
    WHERE l.key = %s AND l.expires_at_ms < t.now_ms - %s
)
SELECT EXISTS (
    SELECT 1 FROM syncguard_locks l, t WHERE l.key = %s AND l.expires_at_ms > t.now_ms - %s
)
"""

LOCK_COLUMNS = "key, lock_id, expires_at_ms, acquired_at_ms, fence, user_key"

PG_LOOKUP = (
    f"SELECT {LOCK_COLUMNS} FROM syncguard_locks "
    f"WHERE {{column}} = %s AND expires_at_ms > {PG_NOW_MS} - %s"
)

PG_NOW = f"SELECT {PG_NOW_MS}"

# Housekeeping (admin inspector, syncguard_cleanup) ----------------------------------
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

# Deletes one batch of records expired before the cutoff. On PostgreSQL each doomed
# key's advisory lock is tried first (the one syncguard_acquire takes): a key being
# acquired right now is skipped, so acquire never sees its expired row vanish between
# its read and its write. The outer condition re-checks expiry at delete time.
PG_DELETE_EXPIRED = f"""
WITH t AS (SELECT {PG_NOW_MS} - %s AS cutoff),
doomed AS (
    SELECT c.key FROM (
        SELECT l.key FROM syncguard_locks l, t WHERE l.expires_at_ms < t.cutoff
        ORDER BY l.expires_at_ms LIMIT %s OFFSET 0
    ) c
    WHERE pg_try_advisory_xact_lock(1937337447, hashtext(c.key))
)
DELETE FROM syncguard_locks l USING t
WHERE l.key IN (SELECT key FROM doomed) AND l.expires_at_ms < t.cutoff
"""
LITE_DELETE_EXPIRED = (
    "DELETE FROM syncguard_locks WHERE key IN (SELECT key FROM syncguard_locks "
    "WHERE expires_at_ms < %s ORDER BY expires_at_ms LIMIT %s) AND expires_at_ms < %s"
)

# SQLite ---------------------------------------------------------------------------
# Time is the machine's clock, passed in; writers are serialised by SQLite's
# database lock, taken up front by BEGIN IMMEDIATE for the multi-statement acquire.
LITE_SELECT_LOCK = "SELECT expires_at_ms FROM syncguard_locks WHERE key = %s"
LITE_SELECT_FENCE = "SELECT fence FROM syncguard_fence_counters WHERE fence_key = %s"
LITE_UPSERT_LOCK = (
    f"INSERT INTO syncguard_locks ({LOCK_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s) "
    "ON CONFLICT (key) DO UPDATE SET lock_id = excluded.lock_id, "
    "expires_at_ms = excluded.expires_at_ms, acquired_at_ms = excluded.acquired_at_ms, "
    "fence = excluded.fence, user_key = excluded.user_key"
)
LITE_UPSERT_FENCE = (
    "INSERT INTO syncguard_fence_counters (fence_key, fence) VALUES (%s, %s) "
    "ON CONFLICT (fence_key) DO UPDATE SET fence = excluded.fence"
)
LITE_RELEASE = "DELETE FROM syncguard_locks WHERE lock_id = %s AND expires_at_ms > %s RETURNING 1"
LITE_EXTEND = (
    "UPDATE syncguard_locks SET expires_at_ms = %s "
    "WHERE lock_id = %s AND expires_at_ms > %s RETURNING expires_at_ms"
)
LITE_EXISTS_ID = "SELECT 1 FROM syncguard_locks WHERE lock_id = %s"
LITE_SWEEP_KEY = "DELETE FROM syncguard_locks WHERE key = %s AND expires_at_ms < %s"
LITE_LOOKUP = f"SELECT {LOCK_COLUMNS} FROM syncguard_locks WHERE {{column}} = %s"


class _PerThread(threading.local):
    connection: BaseDatabaseWrapper | None = None
    #: The cursor reused by every direct operation of this thread, and the driver
    #: connection it belongs to (a reconnect makes a new one).
    cursor: Any = None
    cursor_of: Any = None


class DatabaseBackend(BaseLockBackend):
    """Locks in a Django database; see the module docstring."""

    backend_name = "database"
    known_options: ClassVar[frozenset[str]] = BaseLockBackend.known_options | {"DATABASE"}

    def __init__(self, alias: str = "default", params: Mapping[str, Any] | None = None) -> None:
        super().__init__(alias, params)
        database = self.options.get("DATABASE", DEFAULT_DB_ALIAS)
        if not isinstance(database, str) or not database:
            raise InvalidArgument("OPTIONS['DATABASE'] must name an alias of DATABASES.")
        if database not in connections.settings:
            raise InvalidArgument(
                f"OPTIONS['DATABASE'] = {database!r} is not an alias of DATABASES "
                f"(configured: {', '.join(connections.settings)})."
            )
        self.database = database
        self.vendor: str = connections[database].vendor
        if self.vendor not in SUPPORTED_VENDORS:
            raise InvalidArgument(
                f"The database backend supports PostgreSQL and SQLite; DATABASES[{database!r}] "
                f"is {self.vendor}. Use the Redis or Firestore backend instead."
            )
        self.time_authority = "server" if self.vendor == "postgresql" else "client"  # type: ignore[misc]
        self.backend_name = "postgres" if self.vendor == "postgresql" else "sqlite"  # type: ignore[misc]
        self.capabilities = type(self.capabilities)(
            backend=self.backend_name,
            supports_fencing=True,
            time_authority=self.time_authority,
        )
        self.clock: Callable[[], int] = system_clock_ms
        self._local = _PerThread()
        # Open private connections, weakly: a thread's connection is closed when the
        # thread object goes away (see connection()), and must not be kept alive here.
        self._open: weakref.WeakSet[BaseDatabaseWrapper] = weakref.WeakSet()

    # ------------------------------------------------------------- connections
    def connection(self) -> BaseDatabaseWrapper:
        """This thread's private connection (created on first use, not yet opened)."""
        wrapper = self._local.connection
        if wrapper is None:
            source = connections[self.database]
            wrapper = type(source)(self._private_settings(source.settings_dict), self.database)
            if self.vendor == "postgresql":
                _bound_replies(wrapper, self.operation_timeout_ms / 1000 + REPLY_MARGIN_S)
            self._local.connection = wrapper
            self._open.add(wrapper)
            # Thread-per-request servers start and end threads all the time: close a
            # thread's connection once its thread is gone, rather than leak it.
            weakref.finalize(threading.current_thread(), _close_quietly, wrapper)
        return wrapper

    def _private_settings(self, settings_dict: Mapping[str, Any]) -> dict[str, Any]:
        """The alias's settings with our timeouts; autocommit, no request atomicity."""
        private = copy.deepcopy(dict(settings_dict))
        private["AUTOCOMMIT"] = True
        private["ATOMIC_REQUESTS"] = False
        private["CONN_MAX_AGE"] = None  # ours to keep; closed by close() or on errors
        private["CONN_HEALTH_CHECKS"] = False
        options = private.setdefault("OPTIONS", {})
        if self.vendor == "postgresql":
            options["connect_timeout"] = max(2, math.ceil(self.connect_timeout_ms / 1000))
            # A stalled server or a held row lock must not hang a lock call.
            settings = (
                f"-c statement_timeout={self.operation_timeout_ms} "
                f"-c lock_timeout={self.operation_timeout_ms} "
                f"-c idle_in_transaction_session_timeout={max(self.operation_timeout_ms, 1000)}"
            )
            options["options"] = f"{options.get('options', '')} {settings}".strip()
            options.setdefault("tcp_user_timeout", self.operation_timeout_ms)
            options.setdefault("keepalives", 1)
            options.setdefault("keepalives_idle", 5)
            options.setdefault("keepalives_interval", 2)
            options.setdefault("keepalives_count", 2)
        else:
            options["timeout"] = self.operation_timeout_ms / 1000  # SQLite busy timeout
        return private

    def close(self, **kwargs: Any) -> None:
        """Close every private connection this backend opened, in any thread."""
        for wrapper in list(self._open):
            _close_quietly(wrapper)
        self._open = weakref.WeakSet()
        self._local = _PerThread()

    def _run(self, work: Callable[[Any], T]) -> T:
        """Run ``work(cursor)`` on this thread's connection, mapping driver errors."""
        wrapper = self.connection()
        if wrapper.connection is not None and self.vendor == "postgresql":
            self._reconnect_if_gone(wrapper)
        try:
            if self._direct(wrapper):
                return work(self._direct_cursor(wrapper))
            with wrapper.cursor() as cursor:
                return work(cursor)
        except (DjangoDatabaseError, cast(Any, wrapper).Database.Error) as exc:
            error = map_database_error(exc, self.database)
            if isinstance(error, ServiceUnavailable | NetworkTimeout | Internal):
                # Reconnect on the next call: the connection may be broken or stuck.
                _close_quietly(wrapper)
            raise error from exc

    def _reconnect_if_gone(self, wrapper: BaseDatabaseWrapper) -> None:
        """Close this thread's idle connection if the server or a proxy has ended it
        (a restart, a pooler or the network reset it): the call then opens a new one
        instead of failing on the dead one. Nothing was in flight, so nothing is
        lost. A connection that died silently is left to the timeouts."""
        if _idle_connection_is_gone(wrapper.connection):
            logger.info(
                "Database %r: the server ended an idle connection; reconnecting.", self.database
            )
            _close_quietly(wrapper)

    def _direct_cursor(self, wrapper: BaseDatabaseWrapper) -> Any:
        """This thread's reusable cursor on the psycopg connection Django opened.

        Neither Django's cursor wrapper nor a new cursor per operation: each costs
        client CPU on every call (wrapping, copying the adapters map). Parameters are
        bound by the server (extended protocol, unnamed statement): no quoting in
        Python, still one round trip, and nothing that outlives the statement, so
        transaction pooling stays safe. Named prepared statements are used only if
        the alias's OPTIONS ask for them (``prepare_threshold``).
        """
        if wrapper.connection is None:
            wrapper.ensure_connection()
        raw = wrapper.connection
        local = self._local
        if local.cursor_of is not raw or local.cursor.closed:
            local.cursor = _server_binding_cursor(raw)
            local.cursor_of = raw
        return local.cursor

    def _direct(self, wrapper: BaseDatabaseWrapper) -> bool:
        """Bypass Django's cursor on PostgreSQL unless something watches the queries
        (DEBUG logging, ``CaptureQueriesContext``, execute wrappers of APM tools)."""
        return (
            self.vendor == "postgresql"
            and not wrapper.queries_logged
            and not wrapper.execute_wrappers
        )

    # ----------------------------------------------------------------- helpers
    def _storable(self, key: str) -> str:
        # PostgreSQL's text type cannot hold U+0000 at all (psycopg refuses to send it).
        if self.vendor == "postgresql" and "\x00" in key:
            raise InvalidArgument(
                "The database backend on PostgreSQL cannot store keys (or prefixes) that "
                "contain NUL (U+0000): PostgreSQL text has no NUL. Encode such keys first.",
                context={"key": key},
            )
        return key

    @staticmethod
    def storage_key(key: str) -> str:
        """The primary key of ``key``'s lock row."""
        return make_storage_key("", key, LIMIT_BYTES, RESERVE)

    def storage_keys(self, key: str) -> tuple[str, str, str | None]:
        """(lock storage key, fence key, user key if it differs from the storage key)."""
        storage_key = self.storage_key(key)
        fence_key = make_fence_key("", key, LIMIT_BYTES, RESERVE)
        return storage_key, fence_key, (key if storage_key != key else None)

    def now_ms(self) -> int:
        """The backend's time authority, now (server time on PostgreSQL)."""
        if self.vendor == "postgresql":
            return int(self._run(lambda c: _fetch_value(c, PG_NOW, [])))
        return self.clock()

    # --------------------------------------------------------------- acquire
    def _acquire(self, key: str, ttl_ms: int, cancel: CancelToken | None) -> AcquireResult:
        storage_key, fence_key, user_key = self.storage_keys(key)
        lock_id = generate_lock_id()
        if self.vendor == "postgresql":
            params = [
                storage_key,
                fence_key,
                lock_id,
                ttl_ms,
                user_key,
                FENCE_MAX,
                TIME_TOLERANCE_MS,
            ]
            # One statement: ``cancel`` was checked before dispatch. Checking it after
            # the commit would raise while holding a lock the caller never learns of.
            status, fence, expires = self._run(lambda c: _fetch_row(c, PG_ACQUIRE, params))
        else:
            status, fence, expires = self._run(
                lambda c: self._sqlite_acquire(
                    c, storage_key, fence_key, user_key, lock_id, ttl_ms, cancel, key
                )
            )
        if status == 2:
            raise fence_overflow_error(key)
        if status == 0:
            return AcquireResult.locked()
        return AcquireResult(
            ok=True, lock_id=lock_id, expires_at_ms=int(expires), fence=format_fence(int(fence))
        )

    def _sqlite_acquire(
        self,
        cursor: Any,
        storage_key: str,
        fence_key: str,
        user_key: str | None,
        lock_id: str,
        ttl_ms: int,
        cancel: CancelToken | None,
        key: str,
    ) -> tuple[int, int | None, int | None]:
        cursor.execute("BEGIN IMMEDIATE")
        try:
            now = self.clock()
            current = _fetch_value(cursor, LITE_SELECT_LOCK, [storage_key])
            if current is not None and is_live(int(current), now, TIME_TOLERANCE_MS):
                cursor.execute("ROLLBACK")
                return 0, None, None
            fence = int(_fetch_value(cursor, LITE_SELECT_FENCE, [fence_key]) or 0) + 1
            if fence > FENCE_MAX:
                cursor.execute("ROLLBACK")
                return 2, None, None
            check_cancel(cancel, {"key": key})  # after reads, before writes
            cursor.execute(
                LITE_UPSERT_LOCK,
                [storage_key, lock_id, now + ttl_ms, now, format_fence(fence), user_key],
            )
            cursor.execute(LITE_UPSERT_FENCE, [fence_key, fence])
            cursor.execute("COMMIT")
            return 1, fence, now + ttl_ms
        except BaseException:
            with suppress(Exception):
                cursor.execute("ROLLBACK")
            raise

    # --------------------------------------------------------------- release
    def _release(self, lock_id: str, cancel: CancelToken | None) -> ReleaseResult:
        if self.vendor == "postgresql":
            params = [lock_id, TIME_TOLERANCE_MS]
            status = self._run(lambda c: _fetch_value(c, PG_RELEASE, params))
            deleted, existed = status == 1, status == 2
        else:
            now = self.clock()

            def release(cursor: Any) -> tuple[int, bool]:
                cursor.execute(LITE_RELEASE, [lock_id, now - TIME_TOLERANCE_MS])
                if cursor.fetchone() is not None:
                    return 1, True
                return 0, _fetch_value(cursor, LITE_EXISTS_ID, [lock_id]) is not None

            deleted, existed = self._run(release)
        if deleted:
            return ReleaseResult(ok=True)
        return ReleaseResult(ok=False, reason="expired" if existed else "not-found")

    # ---------------------------------------------------------------- extend
    def _extend(self, lock_id: str, ttl_ms: int, cancel: CancelToken | None) -> ExtendResult:
        if self.vendor == "postgresql":
            params = [lock_id, ttl_ms, TIME_TOLERANCE_MS]
            status, expires = self._run(lambda c: _fetch_row(c, PG_EXTEND, params))
            existed = status == 2
        else:
            now = self.clock()

            def extend(cursor: Any) -> tuple[int | None, bool]:
                cursor.execute(LITE_EXTEND, [now + ttl_ms, lock_id, now - TIME_TOLERANCE_MS])
                row = cursor.fetchone()
                if row is not None:
                    return int(row[0]), True
                return None, _fetch_value(cursor, LITE_EXISTS_ID, [lock_id]) is not None

            expires, existed = self._run(extend)
        if expires is not None:
            return ExtendResult(ok=True, expires_at_ms=int(expires))
        return ExtendResult(ok=False, reason="expired" if existed else "not-found")

    # ------------------------------------------------------------- is_locked
    def _is_locked(self, key: str, cancel: CancelToken | None) -> bool:
        storage_key = self.storage_key(key)
        guard = CLEANUP_GUARD_MS[self.time_authority]
        if self.vendor == "postgresql":
            if self.cleanup_in_is_locked:
                params = [storage_key, guard, storage_key, TIME_TOLERANCE_MS]
                return bool(self._run(lambda c: _fetch_value(c, PG_IS_LOCKED_CLEANUP, params)))
            params = [storage_key, TIME_TOLERANCE_MS]
            return bool(self._run(lambda c: _fetch_value(c, PG_IS_LOCKED, params)))
        now = self.clock()

        def is_locked(cursor: Any) -> bool:
            expires = _fetch_value(cursor, LITE_SELECT_LOCK, [storage_key])
            if expires is None:
                return False
            cutoff = self._cleanup_cutoff(now)
            if self.cleanup_in_is_locked and int(expires) < cutoff:
                cursor.execute(LITE_SWEEP_KEY, [storage_key, cutoff])
            return is_live(int(expires), now, TIME_TOLERANCE_MS)

        return self._run(is_locked)

    # ---------------------------------------------------------------- lookup
    def _lookup_by_key(self, key: str, cancel: CancelToken | None) -> LockRecord | None:
        return self._lookup("key", self.storage_key(key))

    def _lookup_by_id(self, lock_id: str, cancel: CancelToken | None) -> LockRecord | None:
        return self._lookup("lock_id", lock_id)

    def _lookup(self, column: str, value: str) -> LockRecord | None:
        if self.vendor == "postgresql":
            sql = PG_LOOKUP.format(column=column)
            row = self._run(lambda c: _fetch_row(c, sql, [value, TIME_TOLERANCE_MS]))
        else:
            now = self.clock()
            row = self._run(lambda c: _fetch_row(c, LITE_LOOKUP.format(column=column), [value]))
            if row is not None and not is_live(int(row[2]), now, TIME_TOLERANCE_MS):
                row = None
        return None if row is None else _record(row)

    # ---------------------------------------------------------- housekeeping
    def _list_locks(self, prefix: str, cursor: str | None, limit: int) -> LockPage:
        now = self.now_ms()
        size = len(prefix)
        params = [cursor or "", now - TIME_TOLERANCE_MS, size, prefix, size, prefix, limit + 1]
        rows = self._run(lambda c: _fetch_all(c, LIST_PAGE, params))
        records = tuple(_record(row) for row in rows[:limit])
        more = len(rows) > limit
        return LockPage(records, rows[limit - 1][0] if more else None, now)

    def _count_expired(self) -> int:
        cutoff = self._cleanup_cutoff(self.now_ms())
        return int(self._run(lambda c: _fetch_value(c, COUNT_EXPIRED, [cutoff])))

    def _delete_expired_batch(self, batch_size: int) -> int:
        if self.vendor == "postgresql":
            params: list[Any] = [CLEANUP_GUARD_MS["server"], batch_size]
            sql = PG_DELETE_EXPIRED
        else:
            cutoff = self._cleanup_cutoff(self.clock())
            params, sql = [cutoff, batch_size, cutoff], LITE_DELETE_EXPIRED
        return int(self._run(lambda c: _row_count(c, sql, params)))

    # Async: the private connections are per thread, so any worker thread will do.
    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        from asgiref.sync import sync_to_async

        return await sync_to_async(fn, thread_sensitive=False)(*args)


#: How much longer than OPERATION_TIMEOUT_MS the client waits for a reply: the
#: server's own statement_timeout answers first (and keeps the connection usable).
REPLY_MARGIN_S = 1.0


def _bound_replies(wrapper: BaseDatabaseWrapper, timeout_s: float) -> None:
    """Make each wait for the server on ``wrapper``'s psycopg connections end after
    ``timeout_s``: a server, pooler or network path that accepts bytes and never
    answers must not hang a lock call. ``statement_timeout`` needs a server that
    runs the statement, and ``tcp_user_timeout`` and keepalives a peer that stops
    acknowledging. psycopg 3.2+ bounds ``Connection.wait`` (raising "wait timeout
    expired", a ``NetworkTimeout``; ``_run`` then closes the connection); with other
    drivers nothing changes."""
    new_connection = wrapper.get_new_connection

    def get_new_connection(conn_params: Any) -> Any:
        raw = new_connection(conn_params)
        wait = getattr(raw, "wait", None)
        if wait is not None and {"interval", "timeout"} <= set(signature(wait).parameters):
            raw.wait = partial(wait, timeout=timeout_s)
        return raw

    wrapper.get_new_connection = get_new_connection  # type: ignore[method-assign]


#: First bytes that can wait on an idle connection of ours once the server or a proxy
#: has ended it: end of file; a PostgreSQL ErrorResponse ("E": the FATAL message a
#: server sends before closing); a TLS alert record (0x15: close_notify). Anything
#: else (a notice, a parameter status, encrypted TLS data) leaves it in use.
_GONE_MARKS = (b"", b"E", b"\x15")


def _idle_connection_is_gone(raw: Any) -> bool:
    """True when the server or a proxy has ended the idle driver connection ``raw``.

    Every call reads its reply to the end, so an idle connection has nothing to read
    unless the other side spoke since: a poll without waiting (about a microsecond)
    decides the common case, and only then is the first byte peeked at, on a copy of
    the file descriptor (the driver keeps its own).
    """
    try:
        fd = raw.fileno()
    except Exception:  # closed, or broken beyond telling
        return True
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(0):
            return False
    elif not select.select([fd], [], [], 0)[0]:  # Windows: no poll()
        return False
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            head = sock.recv(1, socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0))
    except BlockingIOError:
        return False
    except OSError:  # reset by the peer
        return True
    return head in _GONE_MARKS


def _server_binding_cursor(raw: Any) -> Any:
    """A cursor binding parameters on the server (psycopg 3), else the driver's own."""
    module = type(raw).__module__.partition(".")[0]
    if module == "psycopg":
        import psycopg

        return psycopg.Cursor(raw)
    return raw.cursor()


def _close_quietly(wrapper: BaseDatabaseWrapper) -> None:
    """Close a private connection from any thread (Django refuses cross-thread close
    unless sharing is allowed), ignoring errors of an already broken connection."""
    with suppress(Exception):
        wrapper.inc_thread_sharing()
    with suppress(Exception):
        wrapper.close()


def _record(row: Any) -> LockRecord:
    storage_key, lock_id, expires, acquired, fence, user_key = row
    return LockRecord(
        key=user_key if user_key is not None else storage_key,
        lock_id=lock_id,
        expires_at_ms=int(expires),
        acquired_at_ms=int(acquired),
        fence=fence,
    )


def _fetch_all(cursor: Any, sql: str, params: list[Any]) -> list[Any]:
    cursor.execute(sql, params)
    return list(cursor.fetchall())


def _row_count(cursor: Any, sql: str, params: list[Any]) -> int:
    cursor.execute(sql, params)
    return int(cursor.rowcount)


def _fetch_row(cursor: Any, sql: str, params: list[Any]) -> Any:
    cursor.execute(sql, params)
    return cursor.fetchone()


def _fetch_value(cursor: Any, sql: str, params: list[Any]) -> Any:
    row = _fetch_row(cursor, sql, params)
    return None if row is None else row[0]
