"""The database backend's class; the package docstring tells what it does."""

from __future__ import annotations

import copy
import logging
import os
import select
import socket
import threading
import weakref
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import replace
from functools import partial
from inspect import signature
from typing import Any, ClassVar, TypeVar, cast

from django.db import DEFAULT_DB_ALIAS, connections
from django.db import Error as DjangoDatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper

from ...cancellation import CancelToken, check_cancel
from ...constants import BACKEND_LIMITS, CLEANUP_GUARD_MS, RESERVE_BYTES, TIME_TOLERANCE_MS
from ...errors import Internal, InvalidArgument, NetworkTimeout, ServiceUnavailable
from ...fencing import fence_overflow_error, format_fence
from ...keys import generate_lock_id, make_fence_key, make_storage_key
from ...results import AcquireResult, ExtendResult, ReleaseResult, TimeAuthority
from ..base import BaseLockBackend, LockPage, LockRecord
from .errors import map_database_error
from .operations import FENCE_OVERFLOW, LOCKED, DatabaseOperations, Row, StorageKeys
from .postgresql import PostgresOperations
from .sqlite import SqliteOperations

logger = logging.getLogger("django_syncguard.backends.database")

T = TypeVar("T")

#: The operations object of each supported vendor, by ``connection.vendor``.
OPERATIONS: dict[str, type[DatabaseOperations]] = {
    ops.vendor: ops for ops in (PostgresOperations, SqliteOperations)
}
SUPPORTED_VENDORS = tuple(OPERATIONS)
LIMIT_BYTES = BACKEND_LIMITS["POSTGRES"]
RESERVE = RESERVE_BYTES["POSTGRES"]


class _PerThread(threading.local):
    connection: BaseDatabaseWrapper | None = None
    #: The cursor reused by every direct operation of this thread, and the driver
    #: connection it belongs to (a reconnect makes a new one).
    cursor: Any = None
    cursor_of: Any = None


class DatabaseBackend(BaseLockBackend):
    """Locks in a Django database; see the package docstring.

    The vendor's SQL and facts live in its operations object, ``self.ops``, picked
    once here from the vendor of the ``DATABASES`` alias.
    """

    known_options: ClassVar[frozenset[str]] = BaseLockBackend.known_options | {"DATABASE"}
    ops: DatabaseOperations

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
        vendor: str = connections[database].vendor
        if vendor not in OPERATIONS:
            raise InvalidArgument(
                f"The database backend supports PostgreSQL and SQLite; DATABASES[{database!r}] "
                f"is {vendor}. Use the Redis or Firestore backend instead."
            )
        self.ops = OPERATIONS[vendor](self._run)
        # base.py built these before the vendor was known (see the properties below).
        self.capabilities = replace(
            self.capabilities, backend=self.backend_name, time_authority=self.time_authority
        )
        self._local = _PerThread()
        # Open private connections, weakly: a thread's connection is closed when the
        # thread object goes away (see connection()), and must not be kept alive here.
        self._open: weakref.WeakSet[BaseDatabaseWrapper] = weakref.WeakSet()

    # The vendor's facts, read from its operations object rather than written over
    # the class variables base.py declares. base.py's __init__ reads them before
    # this __init__ has picked the vendor: until then the vendor-neutral
    # DatabaseOperations class answers.
    @property
    def backend_name(self) -> str:  # type: ignore[override]
        return self._facts.backend_name

    @property
    def time_authority(self) -> TimeAuthority:  # type: ignore[override]
        return self._facts.time_authority

    @property
    def _facts(self) -> DatabaseOperations | type[DatabaseOperations]:
        ops: DatabaseOperations | None = self.__dict__.get("ops")
        return DatabaseOperations if ops is None else ops

    @property
    def vendor(self) -> str:
        """``connection.vendor`` of the ``DATABASES`` alias: postgresql or sqlite."""
        return self.ops.vendor

    # ------------------------------------------------------------- connections
    def connection(self) -> BaseDatabaseWrapper:
        """This thread's private connection (created on first use, not yet opened)."""
        wrapper = self._local.connection
        if wrapper is None:
            source = connections[self.database]
            wrapper = type(source)(self._private_settings(source.settings_dict), self.database)
            if self.ops.over_network:
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
        self.ops.connection_options(
            private.setdefault("OPTIONS", {}),
            connect_timeout_ms=self.connect_timeout_ms,
            operation_timeout_ms=self.operation_timeout_ms,
        )
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
        if wrapper.connection is not None and self.ops.over_network:
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
            self.ops.direct_cursor and not wrapper.queries_logged and not wrapper.execute_wrappers
        )

    # ----------------------------------------------------------------- helpers
    def _storable(self, key: str) -> str:
        return self.ops.storable(key)

    @staticmethod
    def storage_key(key: str) -> str:
        """The primary key of ``key``'s lock row."""
        return make_storage_key("", key, LIMIT_BYTES, RESERVE)

    def storage_keys(self, key: str) -> StorageKeys:
        """(lock storage key, fence key, user key if it differs from the storage key)."""
        storage_key = self.storage_key(key)
        fence_key = make_fence_key("", key, LIMIT_BYTES, RESERVE)
        return StorageKeys(storage_key, fence_key, key if storage_key != key else None)

    def now_ms(self) -> int:
        """The backend's time authority, now (server time on PostgreSQL)."""
        return self.ops.now_ms()

    @property
    def _guard_ms(self) -> int:
        """How long past its expiry cleanup leaves a record alone."""
        return CLEANUP_GUARD_MS[self.time_authority]

    # ------------------------------------------------------------- operations
    def _acquire(self, key: str, ttl_ms: int, cancel: CancelToken | None) -> AcquireResult:
        lock_id = generate_lock_id()
        cancelled = partial(check_cancel, cancel, {"key": key})
        status, fence, expires = self.ops.acquire(
            self.storage_keys(key), lock_id, ttl_ms, cancelled
        )
        if status == FENCE_OVERFLOW:
            raise fence_overflow_error(key)
        if status == LOCKED:
            return AcquireResult.locked()
        return AcquireResult(
            ok=True, lock_id=lock_id, expires_at_ms=int(expires), fence=format_fence(int(fence))
        )

    def _release(self, lock_id: str, cancel: CancelToken | None) -> ReleaseResult:
        deleted, existed = self.ops.release(lock_id)
        if deleted:
            return ReleaseResult(ok=True)
        return ReleaseResult(ok=False, reason="expired" if existed else "not-found")

    def _extend(self, lock_id: str, ttl_ms: int, cancel: CancelToken | None) -> ExtendResult:
        expires, existed = self.ops.extend(lock_id, ttl_ms)
        if expires is not None:
            return ExtendResult(ok=True, expires_at_ms=int(expires))
        return ExtendResult(ok=False, reason="expired" if existed else "not-found")

    def _is_locked(self, key: str, cancel: CancelToken | None) -> bool:
        sweep_guard_ms = self._guard_ms if self.cleanup_in_is_locked else None
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

    def _count_expired(self) -> int:
        return self.ops.count_expired(self._cleanup_cutoff(self.now_ms()))

    def _delete_expired_batch(self, batch_size: int) -> int:
        return self.ops.delete_expired_batch(batch_size, self._guard_ms)

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


def _record(row: Row) -> LockRecord:
    storage_key, lock_id, expires, acquired, fence, user_key = row
    return LockRecord(
        key=user_key if user_key is not None else storage_key,
        lock_id=lock_id,
        expires_at_ms=int(expires),
        acquired_at_ms=int(acquired),
        fence=fence,
    )
