"""The database backend's wake-ups: ``LISTEN``/``NOTIFY`` on PostgreSQL, in-process on
SQLite.

On PostgreSQL, ``syncguard_release`` and ``syncguard_withdraw`` (migration 0005) send
``NOTIFY`` on the key's channel with the first live ticket's id as payload; the server
delivers it when the release commits. :class:`PostgresWakeUps` holds ONE dedicated
connection per backend and process (autocommit, from the same ``DATABASES`` settings as
the backend's own connections, or those of ``OPTIONS["LISTEN_DATABASE"]``), and a
daemon thread that owns it: it waits for notifications and hands each ticket id to
:meth:`~django_syncguard.waiting.WakeUps.deliver`, keeps channels nobody waits on for a
while (:data:`IDLE_CHANNEL_S`, at most :data:`IDLE_CHANNEL_CAP`) before ``UNLISTEN``,
and after a lost connection reconnects with a bounded backoff and listens again on
every channel that still has waiters.

A key's channel is LISTENed when a waiter of this process first finds the key held
(:meth:`PostgresWakeUps.queued`, called by the backend's acquire), not when it
registers: most lock calls find the key free and must not pay a round trip (and a
thread hand-off) for a channel they never use. Until the server has confirmed the
LISTEN, the waiter's listener is not healthy, so it polls; on confirmation it counts as
subscribed and is woken once, so it tries again right away: a release before the
LISTEN is seen by that attempt, one after it is heard. A waiter that registers when
the channel is already LISTENed is subscribed at once.

A transaction pooler (pgbouncer in transaction mode) accepts ``LISTEN`` and never
delivers a notification. So the first connection sends itself a probe: ``pg_notify``
on a private channel from a normal connection of the backend; if it does not arrive
within :data:`PROBE_S`, a warning says so (once) and waiters poll.

SQLite has no channel between processes: :class:`LocalWakeUps` wakes the waiters of
this process only, and never counts as reaching the others, so every waiter polls
(the first in line every 10 ms) and a wake-up only shortens the wait of a local one.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import random
import re
import secrets
import select
import threading
import time
from collections.abc import Callable, Iterable
from inspect import signature
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from ...waiting import WakeUps
from .connections import close_quietly

logger = logging.getLogger("django_syncguard.backends.database")

#: A channel no waiter of this process uses any more stays LISTENed this long, so that
#: a key waited on again soon costs no round trip.
IDLE_CHANNEL_S = 30.0
#: At most this many unused channels stay LISTENed (the longest unused go first):
#: PostgreSQL looks a notification's channel up in a list per session.
IDLE_CHANNEL_CAP = 1_000
#: How long the probe's own notification may take to come back before the listening
#: connection is judged deaf (a transaction pooler between us and the server).
PROBE_S = 1.0
#: Bounds of the backoff between reconnection attempts of the listener.
RECONNECT_MIN_S = 0.05
RECONNECT_MAX_S = 5.0
#: The listener thread looks at its unused channels at least this often.
LOOP_S = 1.0

_CHANNEL = re.compile(r"syncguard_[0-9a-z_]{1,53}")

DEAF_WARNING = (
    "Lock backend %r: the PostgreSQL connection that LISTENs for wake-ups did not "
    "receive its own probe notification within %.1f s: it probably goes through a "
    "transaction pooler (pgbouncer in transaction mode), which accepts LISTEN and "
    "never delivers notifications. Waiters of this process fall back to polling (the "
    "first in line every 10 ms). To fix it, point OPTIONS['LISTEN_DATABASE'] at a "
    "DATABASES alias that reaches the same database directly or through session "
    "pooling, or set OPTIONS['WAKE_UPS'] = False."
)
UNSUPPORTED_WARNING = (
    "Lock backend %r: wake-ups need psycopg 3.2 or newer (Connection.notifies with a "
    "timeout); waiters of this process fall back to polling."
)


def channel_name(storage_key: str) -> str:
    """The channel a key's wake-ups are sent on: ``syncguard_`` and 40 hex digits of the
    SHA-256 of its storage key (50 bytes, under PostgreSQL's 63). The SQL function
    ``syncguard_channel`` (migration 0005) computes the same."""
    return "syncguard_" + hashlib.sha256(storage_key.encode("utf-8")).hexdigest()[:40]


def _quoted(channel: str) -> str:
    """``channel`` as a quoted identifier (our names only: nothing to escape)."""
    if not _CHANNEL.fullmatch(channel):
        raise ValueError(f"not a channel of ours: {channel!r}")
    return f'"{channel}"'


def _statements(verb: str, channels: Iterable[str]) -> str:
    return "; ".join(f"{verb} {_quoted(channel)}" for channel in sorted(channels))


class DatabaseWakeUps(WakeUps):
    """What the database backend's wake-ups add to :class:`WakeUps`."""

    def queued(self, key: str) -> None:
        """A waiter of this process has just found ``key`` held (its ticket is
        queued): make sure its wake-ups will reach us."""


class LocalWakeUps(DatabaseWakeUps):
    """Wake-ups within this process only (SQLite): a release by another process never
    reaches these waiters, so they poll."""

    reaches_other_processes = False

    def ready(self, key: str) -> bool:
        # Registering costs no I/O, but a ticketed attempt reads the queue file: the
        # first attempt goes without one, so an uncontended lock() stays as cheap.
        return False

    def waiting_on(self, key: str) -> bool:
        """Whether a waiter of this process waits for ``key``."""
        with self._mutex:
            return bool(self._listeners.get(key))


class _Deaf(Exception):
    """The listening connection does not receive notifications."""


class PostgresWakeUps(DatabaseWakeUps):
    """LISTEN/NOTIFY wake-ups of one database backend in this process; see the module
    docstring.

    ``connect`` opens a new Django connection (autocommit, our timeouts) to listen on;
    ``probe`` sends ``pg_notify(channel, payload)`` through a normal connection of the
    backend; ``storage_key`` maps a key to its storage key; ``reply_timeout_s`` is the
    longest the thread can be busy with the server (connecting, probing, a reply),
    how long ``close()`` waits for it.
    """

    def __init__(
        self,
        name: str,
        *,
        connect: Callable[[], BaseDatabaseWrapper],
        probe: Callable[[str, str], None],
        storage_key: Callable[[str], str],
        reply_timeout_s: float,
    ) -> None:
        super().__init__(name)
        self._connect = connect
        self._probe_notify = probe
        self._storage_key = storage_key
        self._reply_timeout_s = reply_timeout_s
        self._probed = False
        self._init_state()

    def _init_state(self) -> None:
        """Thread, connection and channel state (also after a fork)."""
        self._cond = threading.Condition(threading.Lock())
        #: idle (no thread yet), connecting, connected, down (reconnecting), deaf, closed
        self._status = "idle"
        self._thread: threading.Thread | None = None
        self._listening: set[str] = set()  # confirmed on the current connection
        self._wanted: set[str] = set()  # to LISTEN on the next turn of the thread
        self._unused: dict[str, float] = {}  # channel -> when its last waiter left
        self._keys: dict[str, str] = {}  # channel -> key, for deliver()
        self._pid_of_connection: int | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # ------------------------------------------------------------ the contract
    @property
    def connected(self) -> bool:
        return self._status == "connected"

    def ready(self, key: str) -> bool:
        channel = channel_name(self._storage_key(key))
        with self._cond:
            return self._status == "connected" and channel in self._listening

    def _subscribe(self, key: str) -> bool:
        # No round trip here: True when the channel is LISTENed already; otherwise the
        # first contended attempt asks for it (queued) and the thread confirms the
        # key's listeners once the server has (see the module docstring).
        channel = channel_name(self._storage_key(key))
        with self._cond:
            if self._status != "connected" or channel not in self._listening:
                return False
            self._unused.pop(channel, None)
            return True

    def _subscribed(self, key: str) -> bool:
        return self._subscribe(key)

    def queued(self, key: str) -> None:
        channel = channel_name(self._storage_key(key))
        with self._cond:
            if self._status in ("deaf", "closed"):
                return
            self._unused.pop(channel, None)
            if channel in self._wanted:
                return
            if channel in self._listening and self._all_confirmed(key):
                return
            self._keys[channel] = key
            self._wanted.add(channel)
            if self._status == "idle":
                self._start()
            elif self._status == "connected":
                self._kick()
            # Down: the thread LISTENs it when it is back (a kick would cut its backoff).

    def _all_confirmed(self, key: str) -> bool:
        """Whether every waiter of ``key`` in this process counts as subscribed (one
        that registered while its channel's LISTEN was being confirmed may not)."""
        with self._mutex:
            return all(lst.confirmed for lst in self._listeners.get(key, {}).values())

    def _unsubscribe(self, key: str) -> None:
        # Lazily: the thread UNLISTENs the channel once it has been unused for a while.
        channel = channel_name(self._storage_key(key))
        with self._cond:
            if channel in self._listening or channel in self._wanted:
                self._unused[channel] = time.monotonic()

    def _confirm(self, channels: Iterable[str]) -> None:
        """The server confirmed LISTEN on ``channels``: the waiters of their keys that
        registered before are subscribed now, and woken once to try again (a release
        may have come before the LISTEN)."""
        with self._cond:
            keys = [self._keys[channel] for channel in channels if channel in self._keys]
        with self._mutex:
            waiting = [lst for key in keys for lst in self._listeners.get(key, {}).values()]
        for listener in waiting:
            if not listener.confirmed:
                listener.confirmed = True
                listener.wake()

    def close(self) -> None:
        """Stop the thread; it closes its connection."""
        with self._cond:
            if self._status == "closed":
                return
            self._status = "closed"
            thread = self._thread
            self._kick()
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self._reply_timeout_s + 1)
            if thread.is_alive():
                return  # stuck on the network: it may still read the pipe; leave it
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _reset_after_fork(self) -> None:
        # The parent's thread does not exist here, and its connection belongs to the
        # parent: drop it without closing (closing would end the parent's session).
        # The pipe is this process's copy: close it.
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._init_state()

    def listening(self) -> frozenset[str]:
        """The channels LISTENed on the current connection (for tests and operators)."""
        with self._cond:
            return frozenset(self._listening)

    @property
    def backend_pid(self) -> int | None:
        """The server process of the listening connection, while connected."""
        return self._pid_of_connection

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until the listener is connected (True), closed or deaf, or for
        ``timeout_s`` at most."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._status != "connected":
                left = deadline - time.monotonic()
                if self._status in ("deaf", "closed") or left <= 0:
                    return False
                self._cond.wait(left)
            return True

    # ------------------------------------------------------------ the thread
    def _start(self) -> None:
        """Start the listener thread (caller holds ``_cond``)."""
        self._status = "connecting"
        self._thread = threading.Thread(
            target=self._run, name=f"syncguard-listen-{self.name}", daemon=True
        )
        self._thread.start()

    def _kick(self) -> None:
        """Wake the thread from its wait on the socket."""
        with contextlib.suppress(OSError):  # full pipe: a wake-up is pending anyway
            os.write(self._wake_w, b"k")

    def _stopping(self) -> bool:
        with self._cond:
            return self._status == "closed"

    def _run(self) -> None:
        failures = 0  # in a row, since the last connection that worked
        while not self._stopping():
            wrapper: BaseDatabaseWrapper | None = None
            try:
                wrapper = self._connect()
                self._serve(wrapper.connection)
                return  # closed
            except _Deaf:
                # Listeners were never healthy on this connection: nothing was lost.
                self.reaches_other_processes = False
                with self._cond:
                    if self._status != "closed":
                        self._status = "deaf"
                    self._listening.clear()
                    self._cond.notify_all()
                return
            except Exception as exc:
                if self._lost(exc, failures + 1):
                    failures = 0
                    self.connection_lost()
                failures += 1
            finally:
                self._pid_of_connection = None
                if wrapper is not None:
                    close_quietly(wrapper)
            self._pause(min(RECONNECT_MIN_S * 2 ** min(failures - 1, 10), RECONNECT_MAX_S))

    def _lost(self, exc: Exception, failures: int) -> bool:
        """Mark the listener down; whether it had been connected (waiters must hear)."""
        with self._cond:
            was = self._status
            if was != "closed":
                self._status = "down"
            self._listening.clear()
            self._pid_of_connection = None
            self._cond.notify_all()
        if was == "connected":
            logger.warning(
                "Lock backend %r: the connection listening for wake-ups was lost (%r); "
                "waiters poll until it is back.",
                self.name,
                exc,
            )
        else:
            log = logger.warning if failures == 1 else logger.debug
            log("Lock backend %r: cannot listen for wake-ups (%r); retrying.", self.name, exc)
        return was == "connected"

    def _pause(self, seconds: float) -> None:
        """Sleep before reconnecting (with jitter), unless closed meanwhile."""
        seconds *= 0.5 + random.random() / 2
        with contextlib.suppress(OSError, ValueError):
            select.select([self._wake_r], [], [], seconds)
        self._drain_kicks()

    def _drain_kicks(self) -> None:
        with contextlib.suppress(OSError):
            while os.read(self._wake_r, 4096):
                pass

    def _serve(self, raw: Any) -> None:
        """Listen on ``raw`` until closed; raises when the connection fails."""
        if not _can_wait_for_notifies(raw):
            logger.warning(UNSUPPORTED_WARNING, self.name)
            raise _Deaf
        if not self._probed:
            self._probe(raw)
            self._probed = True
        # Every channel that has waiters now, or was asked for, again on this connection.
        with self._cond:
            waited = {channel for channel, key in self._keys.items() if self._has_waiters(key)}
            channels = self._wanted | waited
        if channels:
            self._execute(raw, _statements("LISTEN", channels))
        with self._cond:
            if self._status == "closed":
                return
            self._status = "connected"
            self._pid_of_connection = raw.info.backend_pid
            self._listening = set(channels)
            self._wanted -= channels
            self._cond.notify_all()
        self._confirm(channels)
        while True:
            self._turn(raw)
            try:
                ready, _, _ = select.select([raw.fileno(), self._wake_r], [], [], LOOP_S)
            except (OSError, ValueError):  # a closed pipe: close() ran
                ready = []
            if self._wake_r in ready:
                self._drain_kicks()
            if self._stopping():
                return
            self._receive(raw)

    def _turn(self, raw: Any) -> None:
        """One turn: LISTEN what was asked for, UNLISTEN what went unused."""
        with self._cond:
            listen = self._wanted - self._listening
            # Asked for again while already LISTENed: a waiter whose registration
            # crossed the confirmation (see queued); confirm it now.
            again = self._wanted & self._listening
            self._wanted.clear()
            drop = self._expired_unused()
            for channel in drop:
                self._listening.discard(channel)
                self._keys.pop(channel, None)
        if again:
            self._confirm(again)
        if not (listen or drop):
            return
        sql = "; ".join(
            s for s in (_statements("UNLISTEN", drop), _statements("LISTEN", listen)) if s
        )
        self._execute(raw, sql)
        with self._cond:
            self._listening |= listen
            self._cond.notify_all()
        self._confirm(listen)
        self._receive(raw)  # notifications read while the statement's reply came

    def _expired_unused(self) -> set[str]:
        """Unused channels to UNLISTEN now (caller holds ``_cond``): unused for longer
        than :data:`IDLE_CHANNEL_S`, or the oldest beyond :data:`IDLE_CHANNEL_CAP`. A
        channel whose key has a waiter again is in use (the waiter registered before it
        subscribed, so checking here, under ``_cond``, cannot miss it)."""
        now = time.monotonic()
        for channel in [c for c in self._unused if self._has_waiters(self._keys.get(c))]:
            del self._unused[channel]
        excess = len(self._unused) - IDLE_CHANNEL_CAP
        drop = set()
        for index, (channel, since) in enumerate(sorted(self._unused.items(), key=lambda i: i[1])):
            if index < excess or now - since >= IDLE_CHANNEL_S:
                drop.add(channel)
        for channel in drop:
            del self._unused[channel]
        return drop

    def _has_waiters(self, key: str | None) -> bool:
        if key is None:
            return False
        with self._mutex:
            return bool(self._listeners.get(key))

    def _receive(self, raw: Any) -> None:
        """Deliver every notification already received (no wait)."""
        for notify in raw.notifies(timeout=0):
            with self._cond:
                key = self._keys.get(notify.channel)
            if key is not None and notify.payload:
                self.deliver(key, notify.payload)
        if raw.closed or raw.broken:
            raise ConnectionError("the listening connection is closed")

    @staticmethod
    def _execute(raw: Any, sql: str) -> None:
        import psycopg

        # A cursor of psycopg's own (Django's cursor class may bind on the server), and
        # never prepared: several statements in one simple query, one round trip.
        with psycopg.Cursor(raw) as cursor:
            cursor.execute(sql.encode(), prepare=False)

    def _probe(self, raw: Any) -> None:
        """Raise :class:`_Deaf` unless a notification sent through a normal connection
        of the backend reaches ``raw`` within :data:`PROBE_S`."""
        channel = f"syncguard_probe_{secrets.token_hex(8)}"
        payload = secrets.token_hex(8)
        self._execute(raw, f"LISTEN {_quoted(channel)}")
        self._probe_notify(channel, payload)
        if not _wait_for(raw, channel, payload, PROBE_S):
            logger.warning(DEAF_WARNING, self.name, PROBE_S)
            raise _Deaf
        self._execute(raw, f"UNLISTEN {_quoted(channel)}")


def _can_wait_for_notifies(raw: Any) -> bool:
    """Whether the driver connection has psycopg 3.2's ``notifies(timeout=...)``
    (psycopg2's ``notifies`` is a list)."""
    try:
        return "timeout" in signature(raw.notifies).parameters
    except (AttributeError, TypeError, ValueError):
        return False


def _wait_for(raw: Any, channel: str, payload: str, timeout_s: float) -> bool:
    """Whether the notification arrives on ``raw`` within ``timeout_s`` (others that
    arrive meanwhile are dropped: nothing else is LISTENed yet)."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        for notify in raw.notifies(timeout=left, stop_after=1):
            if notify.channel == channel and notify.payload == payload:
                return True
    return False


def delivers_notifications(
    connect: Callable[[], BaseDatabaseWrapper], notify: Callable[[str, str], None]
) -> bool:
    """Whether a connection from ``connect`` receives a notification sent by ``notify``
    (the deploy check's probe: one connection, opened and closed here)."""
    wrapper = connect()
    try:
        raw = wrapper.connection
        if not _can_wait_for_notifies(raw):
            return False
        channel = f"syncguard_probe_{secrets.token_hex(8)}"
        payload = secrets.token_hex(8)
        PostgresWakeUps._execute(raw, f"LISTEN {_quoted(channel)}")
        notify(channel, payload)
        return _wait_for(raw, channel, payload, PROBE_S)
    finally:
        close_quietly(wrapper)
