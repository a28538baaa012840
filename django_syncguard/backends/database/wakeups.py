"""The database backend's wake-ups: ``LISTEN``/``NOTIFY`` on PostgreSQL, in-process on
SQLite.

On PostgreSQL, ``syncguard_release`` and ``syncguard_withdraw`` send ``NOTIFY``,
delivered when the release commits. A waiter only woken hears its ticket id on the
key's channel (migration 0005). A grant goes to the grantee's process alone (0009): on
the channel of that process (:attr:`PostgresTransport.process_channel`, LISTENed first
on every listening connection, a new one in a forked child), as ``g <ticket> <lock id>
<fence> <expires> <key channel>``; a waiter of code before 0009 left no such channel
and hears ``<ticket> <lock id> <fence> <expires>`` on the key's (0008). The waiter
enters on the grant, and this process claims it from the channel's thread
(:meth:`PostgresWakeUps.claim`). The releasing process checks its grant once the
window is over (``ChannelWorker.watch``, :meth:`PostgresWakeUps.watch_grant`); a
releaser that cannot (its wake-ups are not connected) has the next waiter told ``n
<ticket> <key channel>`` on its process's channel instead, and it re-checks after the
window itself. :class:`PostgresWakeUps` is the package's
:class:`~django_syncguard.waiting.channels.ChannelWorker` over a
:class:`PostgresTransport`: ONE dedicated connection per backend and process
(autocommit, from the same ``DATABASES`` settings as the backend's own connections, or
those of ``OPTIONS["LISTEN_DATABASE"]``) on which the worker's thread runs ``LISTEN``
and ``UNLISTEN`` and reads notifications.

A key's channel is asked for when a waiter of this process first finds the key held
(:meth:`~django_syncguard.waiting.channels.ChannelWorker.queued`, called by the
backend's acquire): most lock calls find it free and pay nothing. The waiter does not
wait for the ``LISTEN``: until the server has confirmed it, its
listener is not healthy, so it polls; on confirmation it counts as subscribed and is
woken once, so it tries again right away: a release before the LISTEN is seen by that
attempt, one after it is heard.

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
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from inspect import signature
from typing import TYPE_CHECKING, Any, TypeAlias

from django.db.backends.base.base import BaseDatabaseWrapper

from ...keys import derived
from ...waiting import Grant, WakeUps
from ...waiting.channels import ChannelWorker, Deaf, Event, GrantCheck, Message, process_message
from .connections import close_quietly

if TYPE_CHECKING:
    from .operations import OnGrant

logger = logging.getLogger("django_syncguard.backends.database")

#: At most this many unused channels stay LISTENed (the longest unused go first):
#: PostgreSQL looks a notification's channel up in a list per session.
IDLE_CHANNEL_CAP = 1_000
#: How long the probe's own notification may take to come back before the listening
#: connection is judged deaf (a transaction pooler between us and the server).
PROBE_S = 1.0
#: The listening connection is checked for a close at least this often.
LOOP_S = 1.0

_CHANNEL = re.compile(r"syncguard_[0-9a-z_]{1,53}")
#: What a process's grant channel is named after: no key's channel (``syncguard_`` and
#: hex digits) nor the probe's starts with it.
PROCESS_CHANNEL_PREFIX = "syncguard_p_"
#: The storage keys of the channels this process watched a grant on, at most this many
#: (the oldest go first): the check needs the key, and a channel is a hash of it.
WATCHED_KEYS_CAP = 4_096

#: Checks a grant this process made: ``(storage key, ticket, watched) -> (status, ms
#: left, ticket granted now)`` (``syncguard_check_grant``'s row).
CheckGrant: TypeAlias = Callable[[str, str, bool], tuple[int, Any, Any]]

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

    def grant_channel(self) -> str | None:
        """Where a grant to a waiter of this process is announced (None: the key's
        channel, or no channel at all)."""
        return None

    def grant_hook(self) -> OnGrant | None:
        """What a statement sent now passes as ``on_grant`` so that this process checks
        a grant it makes (None: it cannot now; the next waiter is told instead)."""
        return None

    def key_settled(self, key: str) -> None:
        """This process has just acquired ``key``: grants of it made here have ended."""


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
        return self.waited_on(key)


class PostgresTransport:
    """``LISTEN``/``NOTIFY`` as a channel transport (see the module docstring).

    ``connect`` opens a new Django connection (autocommit, our timeouts) to listen on;
    ``probe`` sends ``pg_notify(channel, payload)`` through a normal connection of the
    backend; ``storage_key`` maps a key to its storage key.
    """

    confirms_on_listen = False
    # A waiting thread reads the notifications itself (Leading, waiting/channels.py):
    # the read never blocks (_Listening.receive), and a connection may be used by one
    # thread after another. Measured side by side (bench/contention.py, 8 processes and
    # 4 x 8 threads, holds of 1 and 20 ms, four alternations): hand-off p50 2.23 ->
    # 2.07 ms (8 x 20 ms) and 2.59 -> 2.35 ms (4 x 8 threads, 20 ms). Once tried and
    # left off (specs/backends/database.md, Wake-ups): the grantee's path was longer
    # then, and the threaded cells lost.
    let_waiters_read = True
    idle_cap = IDLE_CHANNEL_CAP
    max_channels: int | None = None
    connection_name = "PostgreSQL connection"
    logger = logger

    def __init__(
        self,
        name: str,
        *,
        connect: Callable[[], BaseDatabaseWrapper],
        probe: Callable[[str, str], None],
        storage_key: Callable[[str], str],
    ) -> None:
        self.name = name
        self._connect = connect
        self._probe_notify = probe
        self._storage_key = storage_key
        self._probed = False
        #: This process's own channel, for the grants made to its waiters (a grant
        #: wakes only the process it is for); see :meth:`new_process_channel`.
        self.process_channel = ""
        self.new_process_channel()

    def new_process_channel(self) -> None:
        """A channel of this process's own (again in a forked child: the parent's is
        the parent's): :data:`PROCESS_CHANNEL_PREFIX` and 32 random hex digits (44
        bytes, under PostgreSQL's 63)."""
        self.process_channel = PROCESS_CHANNEL_PREFIX + secrets.token_hex(16)

    def channel(self, key: str) -> str:
        return derived(
            key, PostgresTransport, "channel", lambda: channel_name(self._storage_key(key))
        )

    def connect(self, poke: Callable[[], None]) -> _Listening:
        wrapper = self._connect()
        try:
            raw = wrapper.connection
            if not _can_wait_for_notifies(raw):
                logger.warning(UNSUPPORTED_WARNING, self.name)
                raise Deaf
            if not self._probed:
                self._probe(raw)
                self._probed = True
            # The notify handler before the first LISTEN (after the probe, which waits
            # with notifies()): what psycopg reads with that statement's reply reaches it.
            listening = _Listening(wrapper, raw, self.process_channel)
            # First on the connection: LISTENed before any key's channel, so before the
            # confirmation that lets a waiter count on a grant reaching it.
            _execute(raw, f"LISTEN {_quoted(listening.own_channel)}")
        except BaseException:
            close_quietly(wrapper)
            raise
        return listening

    def _probe(self, raw: Any) -> None:
        """Raise :class:`Deaf` unless a notification sent through a normal connection
        of the backend reaches ``raw`` within :data:`PROBE_S`."""
        if not _hears(raw, self._probe_notify):
            logger.warning(DEAF_WARNING, self.name, PROBE_S)
            raise Deaf


class _Listening:
    """The listening connection (a :class:`~django_syncguard.waiting.channels.Connection`).

    Notifications are read from libpq itself (``consume_input``, then ``notifies``
    until none is left), not through psycopg's ``notifies(timeout=0)``: that generator
    polls the socket twice and ends by raising and catching its timeout, about 33 µs
    more of a thread that slept through a lock's hold, on the hand-off's path
    (``bench/handoff_steps.py --backend postgres``). Only the worker's thread and a
    leader touch this connection, one at a time under its I/O lock. A notification
    that psycopg reads with a statement's reply (a ``LISTEN`` the worker sent) reaches
    :meth:`_set_aside` instead, and the next :meth:`receive` returns it first."""

    def __init__(self, wrapper: BaseDatabaseWrapper, raw: Any, own_channel: str = "") -> None:
        self.wrapper = wrapper
        self.raw = raw
        self.pid: int = raw.info.backend_pid
        self.own_channel = own_channel  # the process's grant channel
        self._pgconn = raw.pgconn
        self._encoding: str = raw.info.encoding
        self._aside: list[tuple[str, str]] = []
        raw.add_notify_handler(self._set_aside)

    def _set_aside(self, notify: Any) -> None:
        self._aside.append((notify.channel, notify.payload))

    def fileno(self) -> int:
        return int(self.raw.fileno())

    def subscribe(self, channels: Sequence[str]) -> Iterable[str]:
        _execute(self.raw, _statements("LISTEN", channels))
        return channels  # the statement's reply is the confirmation

    def unsubscribe(self, channels: Sequence[str]) -> None:
        _execute(self.raw, _statements("UNLISTEN", channels))

    def receive(self) -> list[Event]:
        events: list[Event] = []
        if self._aside:
            aside, self._aside = self._aside, []
            for channel, payload in aside:
                self._add(events, channel, payload)
        pgconn, encoding = self._pgconn, self._encoding
        try:
            pgconn.consume_input()  # never blocks: libpq's socket is non-blocking
            while (notify := pgconn.notifies()) is not None:
                self._add(events, notify.relname.decode(encoding), notify.extra.decode(encoding))
        except Exception:  # libpq on a connection closed or broken: OperationalError
            if not events:
                raise
            # What arrived before the close is delivered first; the close, next time.
        return events

    def _add(self, events: list[Event], channel: str, payload: str) -> None:
        if channel == self.own_channel:
            message = _own_message(payload)
            if message is not None:
                events.append(message)
        elif payload:
            events.append(_message(channel, payload))

    def check(self) -> float:
        return LOOP_S

    def close(self) -> None:
        with contextlib.suppress(ValueError):  # the handler refers to this object
            self.raw.remove_notify_handler(self._set_aside)
        close_quietly(self.wrapper)


def _message(channel: str, payload: str) -> Message:
    """A notification as a message: ``<ticket id>`` (a wake-up), or a grant,
    ``<ticket id> <lock id> <fence> <expires>``."""
    ticket, *grant = payload.split(" ")
    return Message(channel, ticket, Grant.parse(grant) if grant else None)


def _own_message(payload: str) -> Message | None:
    """A notification on the process's channel, as a message on the key's channel it
    names (see :func:`~django_syncguard.waiting.channels.process_message`)."""
    message = process_message(payload, lambda channel: _CHANNEL.fullmatch(channel) is not None)
    if message is None:
        logger.debug("Ignored a malformed notification on the process channel: %r", payload[:200])
    return message


class PostgresWakeUps(ChannelWorker, DatabaseWakeUps):
    """LISTEN/NOTIFY wake-ups of one database backend in this process; see the module
    docstring. ``reply_timeout_s`` is the longest the thread can be busy with the
    server (connecting, probing, a reply): how long ``close()`` waits for it.
    ``claim`` claims a grant on the server (None: the backend does not grant);
    ``check_grant`` checks one this process made (see :meth:`watch_grant`)."""

    transport: PostgresTransport

    def __init__(
        self,
        transport: PostgresTransport,
        *,
        reply_timeout_s: float,
        claim: Callable[[Grant], bool] | None = None,
        check_grant: CheckGrant | None = None,
    ) -> None:
        super().__init__(transport.name, transport, timeout_s=reply_timeout_s)
        self._claim = claim
        self._check_grant = check_grant
        # channel -> storage key of the grants watched (see WATCHED_KEYS_CAP). Never
        # dropped when a check runs: a grant of the key made meanwhile may need it.
        self._watched_keys: OrderedDict[str, str] = OrderedDict()

    @property
    def process_channel(self) -> str:
        """Where grants for this process's waiters are NOTIFYed."""
        return self.transport.process_channel

    def _reset_after_fork(self) -> None:
        super()._reset_after_fork()
        self.transport.new_process_channel()  # the parent's is the parent's
        self._watched_keys = OrderedDict()

    def grant_channel(self) -> str | None:
        self._after_fork()  # a child that has not reset yet must not name the parent's
        return self.transport.process_channel

    def grant_hook(self) -> OnGrant | None:
        return self.watch_grant if self.watching else None

    def key_settled(self, key: str) -> None:
        if self._watches:  # nothing to look up on a process that made no grant
            self.settled(self.transport.channel(key))

    def watch_grant(self, storage_key: str, ticket_id: str) -> None:
        """A statement of this process (a release, withdrawal or attempt, sent while
        :attr:`watching`) granted the key stored as ``storage_key`` to ``ticket_id``
        and told nobody else: check it once its window is over
        (:meth:`~django_syncguard.waiting.channels.ChannelWorker.watch`)."""
        channel = channel_name(storage_key)
        with self._claims_lock:
            self._watched_keys[channel] = storage_key
            self._watched_keys.move_to_end(channel)
            if len(self._watched_keys) > WATCHED_KEYS_CAP:
                self._watched_keys.popitem(last=False)
        self.watch(channel, ticket_id)

    def _check_grant_on_server(self, channel: str, ticket_id: str) -> GrantCheck | None:
        """The window of a grant this process made is over: if it lapsed unclaimed,
        the server grants the key on (``syncguard_check_grant``). On this (the
        channel's) thread, through its own private connection of the backend, as a
        claim. A key forgotten (beyond :data:`WATCHED_KEYS_CAP`) is left to the
        waiters' check-ins."""
        with self._claims_lock:
            storage_key = self._watched_keys.get(channel)
        if storage_key is None or self._check_grant is None:
            logger.debug("A grant made here could not be checked: its key is forgotten.")
            return None
        status, left_ms, granted = self._check_grant(storage_key, ticket_id, self.watching)
        if status == 2:
            return GrantCheck(left_ms=int(left_ms))
        if status == 1:
            return GrantCheck(lapsed=True, granted=None if granted is None else str(granted))
        return GrantCheck()

    def _claim_on_server(self, key: str, grant: Grant) -> None:
        """Claim a grant delivered to a waiter of this process, from this (the
        channel's) thread, when the channel worker says it is due (``CLAIM_AFTER_S``
        after it arrived, unless the holder released it first). The statement goes
        through this thread's own private connection of the backend (connections are
        per thread: never the waiters', never the LISTEN one, whose session only reads
        notifications). A claim that fails means the grant lapsed (this process was
        slower than the grant window) or the hold already ended; a lapsed lock's
        release then reports it expired. The worker logs errors: they must not stop
        the thread that delivers every other wake-up."""
        if self._claim is not None and not self._claim(grant):
            logger.debug("A granted lock was gone when claimed (lapsed, or released).")

    @property
    def backend_pid(self) -> int | None:
        """The server process of the listening connection, while connected."""
        connection = self._connection
        if not self.connected or not isinstance(connection, _Listening):
            return None
        return connection.pid


def _execute(raw: Any, sql: str) -> None:
    import psycopg

    # A cursor of psycopg's own (Django's cursor class may bind on the server), and
    # never prepared: several statements in one simple query, one round trip.
    with psycopg.Cursor(raw) as cursor:
        cursor.execute(sql.encode(), prepare=False)


def _can_wait_for_notifies(raw: Any) -> bool:
    """Whether the driver connection has psycopg 3.2's ``notifies(timeout=...)``
    (psycopg2's ``notifies`` is a list)."""
    try:
        return "timeout" in signature(raw.notifies).parameters
    except (AttributeError, TypeError, ValueError):
        return False


def delivers_notifications(
    connect: Callable[[], BaseDatabaseWrapper], notify: Callable[[str, str], None]
) -> bool:
    """Whether a connection from ``connect`` receives a notification sent by ``notify``
    (the deploy check's probe: one connection, opened and closed here)."""
    wrapper = connect()
    try:
        raw = wrapper.connection
        return _can_wait_for_notifies(raw) and _hears(raw, notify)
    finally:
        close_quietly(wrapper)


def _hears(raw: Any, notify: Callable[[str, str], None]) -> bool:
    """Whether ``raw`` receives, within :data:`PROBE_S`, a notification that ``notify``
    sends on a private channel (others that arrive meanwhile are dropped: nothing else
    is LISTENed yet)."""
    channel = f"syncguard_probe_{secrets.token_hex(8)}"
    payload = secrets.token_hex(8)
    _execute(raw, f"LISTEN {_quoted(channel)}")
    notify(channel, payload)
    deadline = time.monotonic() + PROBE_S
    heard = False
    while not heard and (left := deadline - time.monotonic()) > 0:
        # Outside the notifies() generator only may the connection run a statement:
        # the generator holds the connection's lock.
        got = list(raw.notifies(timeout=left, stop_after=1))
        heard = any(n.channel == channel and n.payload == payload for n in got)
    if heard:
        _execute(raw, f"UNLISTEN {_quoted(channel)}")
    return heard
