"""The database backend's own connections: one per thread, never Django's.

Each thread gets a private ``DatabaseWrapper`` built from a copy of the alias's
settings, in autocommit and with our timeouts, so a lock never joins the caller's
transaction. It is opened on first use and kept until ``close()``, or closed after
a connection error so that the next call reconnects. On a database across a
network (PostgreSQL), every wait for a reply is bounded, an idle connection that the
server or a proxy ended is noticed before a call is sent on it, and statements go
through a reused driver cursor unless something watches the queries. In a forked
child, the parent's connections are forgotten, never closed, and the child opens its
own (:meth:`PrivateConnections.forget_after_fork`; see :mod:`django_syncguard.lifecycle`).
See ``specs/backends/database.md``, Connections and transactions.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from contextlib import suppress
from functools import partial
from inspect import signature
from typing import Any, TypeVar, cast

from django.db import Error as DjangoDatabaseError
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from ...errors import Internal, NetworkTimeout, ServiceUnavailable
from ...lifecycle import abandon
from ..sockets import peer_ended
from .errors import map_database_error
from .operations import DatabaseOperations

logger = logging.getLogger("django_syncguard.backends.database")

T = TypeVar("T")

#: How much longer than OPERATION_TIMEOUT_MS the client waits for a reply: the
#: server's own statement_timeout answers first (and keeps the connection usable).
REPLY_MARGIN_S = 1.0


class _PerThread(threading.local):
    connection: BaseDatabaseWrapper | None = None
    #: The cursor reused by every direct operation of this thread, and the driver
    #: connection it belongs to (a reconnect makes a new one).
    cursor: Any = None
    cursor_of: Any = None


class PrivateConnections:
    """The private connections of one backend to the ``DATABASES`` alias ``database``.

    ``operations`` is the vendor's operations class: it sets the driver options and says
    whether the database is across a network and takes a direct cursor.
    """

    def __init__(
        self,
        database: str,
        operations: type[DatabaseOperations],
        *,
        connect_timeout_ms: int,
        operation_timeout_ms: int,
    ) -> None:
        self.database = database
        self.operations = operations
        self.connect_timeout_ms = connect_timeout_ms
        self.operation_timeout_ms = operation_timeout_ms
        self._local = _PerThread()
        #: Run on each new driver connection of a per-thread wrapper (the vendor's
        #: ``prepare_connection``; set by the backend once its operations exist).
        self.prepare: Callable[[Any], None] | None = None
        # Open private connections, weakly: a thread's connection is closed when the
        # thread object goes away (see connection()), and must not be kept alive here.
        self._open: weakref.WeakSet[BaseDatabaseWrapper] = weakref.WeakSet()
        # Driver connections whose startup settings (our server-side timeouts) did not
        # reach the server: a transaction pooler dropped them. Each operation on them
        # sets the timeouts for its own transaction (see run()).
        self._pooled: weakref.WeakSet[Any] = weakref.WeakSet()

    def connection(self) -> BaseDatabaseWrapper:
        """This thread's private connection (created on first use, not yet opened)."""
        wrapper = self._local.connection
        if wrapper is None:
            source = connections[self.database]
            wrapper = type(source)(self._private_settings(source.settings_dict), self.database)
            if self.operations.over_network:
                bound_replies(wrapper, self.operation_timeout_ms / 1000 + REPLY_MARGIN_S)
            if self.prepare is not None:
                after_connect(wrapper, self.prepare)
            if self.operations.over_network:
                after_connect(wrapper, self._note_pooler)
            self._local.connection = wrapper
            self._open.add(wrapper)
            # Thread-per-request servers start and end threads all the time: close a
            # thread's connection once its thread is gone, rather than leak it. Only
            # in this process: a forked child inherits the finalizer (it runs at the
            # child's exit at the latest), and the connection is the parent's.
            weakref.finalize(threading.current_thread(), close_if_ours, os.getpid(), wrapper)
        return wrapper

    def dedicated(self, database: str, application_name: str) -> BaseDatabaseWrapper:
        """A new connection of our own to the ``DATABASES`` alias ``database``, with
        the same settings as the per-thread ones, opened and closed by the caller (the
        PostgreSQL listener's), named ``application_name`` in ``pg_stat_activity``.
        Never from a pool: it keeps its session for itself. Its alias is not the
        alias's own (``"<alias>:syncguard-listen"``): it is not that alias's connection,
        and what watches the alias's connections (``connection_created`` receivers,
        test cases that allow some aliases only) has no business with it."""
        source = connections[database]
        private = self._private_settings(source.settings_dict)
        private["OPTIONS"].pop("pool", None)
        private["OPTIONS"]["application_name"] = application_name
        wrapper = type(source)(private, f"{database}:syncguard-listen")
        if self.operations.over_network:
            bound_replies(wrapper, self.operation_timeout_ms / 1000 + REPLY_MARGIN_S)
        return wrapper

    def run_once(self, work: Callable[[Any], T]) -> T:
        """:meth:`run`, then close this thread's connection (a thread that needs one
        only now and then, such as the listener's)."""
        try:
            return self.run(work)
        finally:
            close_quietly(self.connection())

    def _private_settings(self, settings_dict: Mapping[str, Any]) -> dict[str, Any]:
        """The alias's settings with our timeouts; autocommit, no request atomicity."""
        private = copy.deepcopy(dict(settings_dict))
        private["AUTOCOMMIT"] = True
        private["ATOMIC_REQUESTS"] = False
        private["CONN_MAX_AGE"] = None  # ours to keep; closed by close() or on errors
        private["CONN_HEALTH_CHECKS"] = False
        self.operations.connection_options(
            private.setdefault("OPTIONS", {}),
            connect_timeout_ms=self.connect_timeout_ms,
            operation_timeout_ms=self.operation_timeout_ms,
        )
        return private

    def close(self) -> None:
        """Close every private connection opened here, in any thread."""
        for wrapper in list(self._open):
            close_quietly(wrapper)
        self._open = weakref.WeakSet()
        self._local = _PerThread()

    def forget_after_fork(self) -> None:
        """In a forked child: drop every connection inherited from the parent without
        closing it (a close would end the parent's session: libpq sends Terminate),
        so that each thread opens its own on first use."""
        for wrapper in list(self._open):
            abandon(wrapper)
        self._open = weakref.WeakSet()
        self._local = _PerThread()

    def _note_pooler(self, raw: Any) -> None:
        if self.operations.startup_settings_lost(raw, self.operation_timeout_ms):
            logger.info(
                "Database %r: the server did not get the lock connection's startup "
                "settings (a transaction pooler?); each operation sets its timeouts "
                "in its own transaction.",
                self.database,
            )
            self._pooled.add(raw)

    def run(self, work: Callable[[Any], T]) -> T:
        """Run ``work(cursor)`` on this thread's connection, mapping driver errors."""
        wrapper = self.connection()
        if wrapper.connection is not None and self.operations.over_network:
            self._reconnect_if_gone(wrapper)
        try:
            if self.direct(wrapper):
                return self._bounded(wrapper, work, self._direct_cursor(wrapper))
            with wrapper.cursor() as cursor:
                return self._bounded(wrapper, work, cursor)
        except (DjangoDatabaseError, cast(Any, wrapper).Database.Error) as exc:
            error = map_database_error(exc, self.database)
            if isinstance(error, ServiceUnavailable | NetworkTimeout | Internal):
                # Reconnect on the next call: the connection may be broken or stuck.
                close_quietly(wrapper)
            raise error from exc

    def _bounded(self, wrapper: BaseDatabaseWrapper, work: Callable[[Any], T], cursor: Any) -> T:
        """``work(cursor)``; behind a pooler that dropped our startup settings, inside
        a transaction that first sets the server-side timeouts for itself alone
        (``SET LOCAL``: nothing outlives the transaction, so no other client of the
        pooler's server connection inherits them)."""
        raw = wrapper.connection
        if raw is None or raw not in self._pooled:
            return work(cursor)
        with raw.transaction():
            self.operations.set_local_timeouts(cursor, self.operation_timeout_ms)
            return work(cursor)

    def _reconnect_if_gone(self, wrapper: BaseDatabaseWrapper) -> None:
        """Close this thread's idle connection if the server or a proxy has ended it
        (a restart, a pooler or the network reset it): the call then opens a new one
        instead of failing on the dead one. Nothing was in flight, so nothing is
        lost. A connection that died silently is left to the timeouts."""
        if idle_connection_is_gone(wrapper.connection):
            logger.info(
                "Database %r: the server ended an idle connection; reconnecting.", self.database
            )
            close_quietly(wrapper)

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
            local.cursor = server_binding_cursor(raw)
            local.cursor_of = raw
        return local.cursor

    def direct(self, wrapper: BaseDatabaseWrapper) -> bool:
        """Bypass Django's cursor on PostgreSQL unless something watches the queries
        (DEBUG logging, ``CaptureQueriesContext``, execute wrappers of APM tools)."""
        return (
            self.operations.direct_cursor
            and not wrapper.queries_logged
            and not wrapper.execute_wrappers
        )


def after_connect(wrapper: BaseDatabaseWrapper, prepare: Callable[[Any], None]) -> None:
    """Run ``prepare(driver connection)`` on each connection ``wrapper`` opens."""
    new_connection = wrapper.get_new_connection

    def get_new_connection(conn_params: Any) -> Any:
        raw = new_connection(conn_params)
        try:
            prepare(raw)
        except BaseException:
            with suppress(Exception):
                raw.close()
            raise
        return raw

    wrapper.get_new_connection = get_new_connection  # type: ignore[method-assign]


def bound_replies(wrapper: BaseDatabaseWrapper, timeout_s: float) -> None:
    """Make each wait for the server on ``wrapper``'s psycopg connections end after
    ``timeout_s``: a server, pooler or network path that accepts bytes and never
    answers must not hang a lock call. ``statement_timeout`` needs a server that
    runs the statement, and ``tcp_user_timeout`` and keepalives a peer that stops
    acknowledging. psycopg 3.2+ bounds ``Connection.wait`` (raising "wait timeout
    expired", a ``NetworkTimeout``; ``run`` then closes the connection); with other
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


def idle_connection_is_gone(raw: Any) -> bool:
    """True when the server or a proxy has ended the idle driver connection ``raw``
    (:func:`~django_syncguard.backends.sockets.peer_ended`, with PostgreSQL's last
    words)."""
    return peer_ended(raw, _GONE_MARKS)


def server_binding_cursor(raw: Any) -> Any:
    """A cursor binding parameters on the server (psycopg 3), else the driver's own."""
    module = type(raw).__module__.partition(".")[0]
    if module == "psycopg":
        import psycopg

        return psycopg.Cursor(raw)
    return raw.cursor()


def close_if_ours(pid: int, wrapper: BaseDatabaseWrapper) -> None:
    """:func:`close_quietly` in process ``pid``, the one that opened ``wrapper``; in a
    forked child, keep it untouched instead (see :mod:`django_syncguard.lifecycle`)."""
    if os.getpid() == pid:
        close_quietly(wrapper)
    else:
        abandon(wrapper)


def close_quietly(wrapper: BaseDatabaseWrapper) -> None:
    """Close a private connection from any thread (Django refuses cross-thread close
    unless sharing is allowed), ignoring errors of an already broken connection."""
    with suppress(Exception):
        wrapper.inc_thread_sharing()
    with suppress(Exception):
        wrapper.close()
