"""The channel worker: a backend's wake-ups over a server channel.

Every server backend announces releases on a channel of its server (Redis pub/sub,
PostgreSQL ``LISTEN``/``NOTIFY``, a Firestore Listen stream). :class:`ChannelWorker`
is the one implementation of what they share; a :class:`Transport` supplies only how
to connect, subscribe, unsubscribe and read.

* **One thread and one connection per backend and process**, started by the first
  waiter and ended when nothing has been left to listen to for
  :data:`IDLE_CHANNEL_S` (or by :meth:`close`). The
  thread is the only code that touches the connection: waiters say which channels
  they need under a condition variable and poke the thread through a socket pair; it
  sleeps in a selector on the connection's socket (or, for a transport without one,
  is poked by it) and the socket pair.
* **Desired and actual subscriptions**: ``_channels`` (channel -> key) is what the
  waiters need; the thread subscribes what is missing and unsubscribes what is no
  longer needed, so a channel re-subscribed before its unsubscription went out costs
  nothing.
* **Confirmation**: a listener counts as subscribed once the server confirmed its
  channel. A transport that ``confirms_on_listen`` makes :meth:`listen` subscribe
  and wait for that (Redis, Firestore: cheap to confirm); otherwise (PostgreSQL) the
  channel is asked for when the backend queues the ticket (:meth:`queued`, no wait),
  and the listener is confirmed later and woken once, so that it tries again at once:
  a release before the subscription is seen by that attempt, one after it is heard.
* **Idle channels**: a channel whose last local waiter left stays subscribed for
  :data:`IDLE_CHANNEL_S` (at most the transport's ``idle_cap`` such channels, the
  longest idle go first), so a hot key costs no subscription per cycle.
* **States** (:class:`State`): a lost connection turns the worker ``DOWN`` and runs
  :meth:`~.listeners.WakeUps.connection_lost` (every listener polls from then on,
  and tries once at once); the thread reconnects with a bounded, jittered backoff
  (:func:`reconnect_delay_s`), subscribes again the channels that still have local
  waiters, and is ``CONNECTED`` once the server confirmed them all. A channel that
  accepts subscriptions but can never deliver (PostgreSQL behind a transaction
  pooler) makes it ``DEAF``: waiters poll for good.
* **Leading** (transports that ``let_waiters_read``): a thread that waits for its
  listener reads the connection itself meanwhile, one thread at a time, while the
  worker's thread sleeps on its socket pair and timers only (:meth:`wait_for`). A
  release meant for that waiter then wakes one thread, the one that goes on to enter
  the lock, rather than the worker's thread and then the waiter's: on two cores, a
  hand-off after a 20 ms hold spent about 0.1 ms on that second wake-up and the work
  before it. The leader handles whatever arrives as the worker's thread would (other
  waiters' wake-ups, confirmations, replies to the health check); the worker's thread
  still sends every subscription and runs the timers. Reads and sends take one lock.
  The leader leaves when woken, at its deadline, or when the worker takes the
  connection back to close it (after a failure the leader met, or one of its own);
  the worker's thread reads again at once when another waiter of the process needs
  it (the leader pokes it), else within :data:`LEAD_PARK_S`.
* **Fork**: a forked child starts from nothing (no thread, no connection); the
  parent's connection is neither closed nor finalized by the child, which would end
  it for the parent too.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import random
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..lifecycle import abandon
from . import tickets
from .listeners import Listener, WakeUps
from .tickets import Grant

#: A channel whose last local waiter left stays subscribed this long.
IDLE_CHANNEL_S = 30.0
#: The reconnect backoff: at once after a connection that lived, then from the
#: minimum, doubling, up to the maximum (each delay jittered to 50-100 %).
RECONNECT_MIN_S = 0.05
RECONNECT_MAX_S = 2.0
#: After the server refused a subscription (an ACL, for one), the next try.
REFUSED_RETRY_S = 60.0
#: A grant delivered here is claimed this long after it arrived, unless its holder
#: released it first (a release claims it too): a short hold costs no claim, and a
#: claim never competes with the waiter it woke. A quarter of the grant window leaves
#: three quarters for the claim to reach the server.
CLAIM_AFTER_S = tickets.GRANT_WINDOW_MS / 4000
#: A grant this process made (its release handed a key to a waiter) is checked this
#: long after it was made, unless this process saw the key move on meanwhile: if the
#: waiter never claimed it, the check grants the key on. The next waiter then needs
#: no message of its own at the hand-off (decision 48).
WATCH_AFTER_S = (tickets.GRANT_WINDOW_MS + tickets.RECHECK_MARGIN_MS) / 1000
#: The thread looks at its idle channels and the connection's health this often at least.
MAX_SELECT_S = 60.0
#: A wait shorter than this does not lead (see :meth:`ChannelWorker.wait_for`): taking
#: the connection and giving it back wakes the worker's thread twice, which the slices
#: of a wait with a cancel token (25 ms) would pay dozens of times a second.
LEAD_MIN_S = 0.05
#: While a waiter leads, the worker's thread wakes this often at least: a leader that
#: leaves after its own wake-up does not poke the thread when no other waiter of the
#: process needs it (the poke's wake-up would take the CPU from the thread that is
#: entering the lock), and the thread takes the connection back by then (and sees
#: the claim that wake-up scheduled, due :data:`CLAIM_AFTER_S` after it).
LEAD_PARK_S = 0.1
#: A leader waits this long at most for the lock that the worker's thread holds while
#: it sends (a subscription, a health check), then goes back to its selector.
LEAD_LOCK_S = 0.01


class State(enum.Enum):
    IDLE = "idle"  # no thread: nothing to listen to yet, or any more
    CONNECTING = "connecting"  # connecting, or subscribing again after a loss
    CONNECTED = "connected"  # connected, every channel subscribed again
    DOWN = "down"  # the connection broke or cannot be made: reconnecting
    DEAF = "deaf"  # the channel can never deliver here: waiters poll
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class Confirmed:
    """The server confirmed the subscription to ``channel``."""

    channel: str


@dataclass(frozen=True, slots=True)
class Message:
    """A release woke ``ticket_id`` on ``channel`` (with ``grant``: granted it the key;
    with ``recheck``: granted it to another ticket, this one being next)."""

    channel: str
    ticket_id: str
    grant: Grant | None = None
    recheck: bool = False


Event = Confirmed | Message


def process_message(payload: str, valid_channel: Callable[[str], bool] = bool) -> Message | None:
    """A message on a process's own channel (grants), as one on the key's channel that
    ends it: ``g <ticket> <lock id> <fence> <expires> <key channel>`` (the key was
    granted to that ticket) or ``n <ticket> <key channel>`` (that ticket is next after
    a grant: it re-checks once the grant's window is over). The key channel may hold
    spaces (a Redis lock hash names the key); ``valid_channel`` judges it. None for
    anything else (the caller logs it): nothing on this channel may be taken for a
    key's wake-up."""
    kind, _, rest = payload.partition(" ")
    if kind == "g":
        fields = rest.split(" ", 4)
        if len(fields) == 5 and valid_channel(fields[4]):
            grant = Grant.parse(fields[1:4])
            if grant is not None:
                return Message(fields[4], fields[0], grant)
    elif kind == "n":
        ticket, _, channel = rest.partition(" ")
        if valid_channel(channel):
            return Message(channel, ticket, recheck=True)
    return None


@dataclass(frozen=True, slots=True)
class GrantCheck:
    """What checking a grant this process made found (see ``ChannelWorker.watch``):
    ``left_ms`` > 0 when its window is not over yet on the server's clock; ``lapsed``
    when it lapsed unclaimed and the key was freed, ``granted`` the ticket the key then
    went to (None: nobody waits, or the check was not watched). Neither: the grant
    was claimed, or the key moved on."""

    lapsed: bool = False
    left_ms: int = 0
    granted: str | None = None


class Refused(Exception):
    """The server refused a subscription; retried after :data:`REFUSED_RETRY_S`."""


class Deaf(Exception):
    """The channel accepts subscriptions but will never deliver a message."""


class Connection(Protocol):
    """One connection of a transport, used by the worker's thread only."""

    def fileno(self) -> int | None:
        """The socket to wait on; None when the connection pokes the worker itself."""

    def subscribe(self, channels: Sequence[str]) -> Iterable[str]:
        """Ask for ``channels``; return those the server has already confirmed (the
        others are confirmed by a later :class:`Confirmed`)."""

    def unsubscribe(self, channels: Sequence[str]) -> None: ...

    def receive(self) -> list[Event]:
        """What arrived, without waiting; raises when the connection broke."""

    def check(self) -> float:
        """Check the connection's health; seconds until the next check. Raises when
        the connection is dead (a health probe went unanswered)."""

    def close(self) -> None: ...


class Transport(Protocol):
    """How one backend's channel is reached (see the module docstring)."""

    @property
    def confirms_on_listen(self) -> bool:
        """Whether :meth:`ChannelWorker.listen` subscribes and waits for the server's
        confirmation (else the backend asks when it queues a ticket)."""

    @property
    def idle_cap(self) -> int:
        """Idle channels kept subscribed at most."""

    @property
    def max_channels(self) -> int | None:
        """Channels subscribed at most (None: no limit); waiters beyond it poll."""

    @property
    def connection_name(self) -> str:
        """What the worker's log calls the connection ("Redis connection")."""

    @property
    def let_waiters_read(self) -> bool:
        """Whether a waiting thread may read the connection (see Leading in the
        module docstring): its :meth:`Connection.receive` never blocks and may run in
        any thread, one at a time."""

    @property
    def logger(self) -> logging.Logger:
        """The backend's logger, which the worker logs on."""

    def channel(self, key: str) -> str:
        """The channel a key's releases are announced on."""

    def connect(self, poke: Callable[[], None]) -> Connection:
        """A new connection (blocking, within the backend's timeouts); raises
        :class:`Deaf` or :class:`Refused` or any error."""


def reconnect_delay_s(failures: int) -> float:
    """The pause before reconnection attempt number ``failures`` + 1 in a row."""
    if failures <= 1:
        return 0.0
    delay: float = min(RECONNECT_MIN_S * 2.0 ** min(failures - 2, 16), RECONNECT_MAX_S)
    return delay * (0.5 + random.random() / 2)


class ChannelWorker(WakeUps):
    """Wake-ups over a :class:`Transport` (see the module docstring).

    ``timeout_s`` bounds how long :meth:`listen` waits for a confirmation, and how
    long :meth:`close` waits for the thread.
    """

    def __init__(self, name: str, transport: Transport, *, timeout_s: float) -> None:
        super().__init__(name)
        self.transport = transport
        self._timeout_s = timeout_s
        self._init_state()

    def _init_state(self) -> None:
        """A fresh state: at construction, and in a forked child."""
        # The condition guards what waiters read; ``_sent`` and ``_connection`` are
        # the thread's alone.
        self._cond = threading.Condition(threading.Lock())
        self._state = State.IDLE
        self._channels: dict[str, str] = {}  # channel -> key: to be subscribed
        self._idle: dict[str, float] = {}  # channel -> when its waiters left (oldest first)
        self._confirmed: set[str] = set()  # confirmed on the current connection
        # The connection's first batch, until confirmed (None: no connection yet).
        self._resubscribing: set[str] | None = None
        # Forgotten since the thread's last turn: unsubscribed then, and subscribed
        # again if a waiter wanted them back meanwhile.
        self._expired: set[str] = set()
        self._failures = 0  # broken or failed connections (waiters watch it)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._sent: set[str] = set()
        self._connection: Connection | None = None
        self._poke_r, self._poke_w = socket.socketpair()
        self._poke_r.setblocking(False)
        self._poke_w.setblocking(False)
        # Grants delivered here and not claimed yet, by lock id: (due, key, grant), in
        # arrival order, so by due time (see claim()).
        self._claims: dict[str, tuple[float, str, Grant]] = {}
        self._claims_lock = threading.Lock()
        # Grants this process made, by channel (one per key: a later grant of the key
        # implies the earlier one ended): channel -> (due, ticket), by due time.
        self._watches: dict[str, tuple[float, str]] = {}
        # When the thread looks at its timers next, at the latest (see watch()).
        self._timers_at = float("inf")
        # Leading (see wait_for): the listener whose thread reads the connection now
        # (None: the worker's thread does) and that thread's id; set under _cond. A
        # socket pair that wakes the leader; whether the connection is being taken
        # back (no new leader); what broke it under a leader (the thread raises it).
        # _io lock: one reader or sender of the connection at a time.
        self._io_lock = threading.Lock()
        self._leader: Listener | None = None
        self._leader_thread: int | None = None
        self._revoked = False
        self._lead_error: Exception | None = None
        self._lead_r, self._lead_w = socket.socketpair()
        self._lead_r.setblocking(False)
        self._lead_w.setblocking(False)
        # What leaders wait on, kept between leads (see _lead); built for the socket
        # pair above, so a forked child builds its own.
        self._lead_poll: _LeadPoll | None = None

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> State:
        return self._state

    @property
    def connected(self) -> bool:
        return self._state is State.CONNECTED

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until connected and resubscribed (True), closed or deaf, or for
        ``timeout_s`` at most."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._state is not State.CONNECTED:
                left = deadline - time.monotonic()
                if self._state in (State.DEAF, State.CLOSED) or left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def listening(self) -> frozenset[str]:
        """The channels the server confirmed on the current connection."""
        with self._cond:
            return frozenset(self._confirmed)

    def ready(self, key: str) -> bool:
        if not self._confirmed:
            return False  # nothing subscribed: no need to name the channel
        channel = self.transport.channel(key)
        with self._cond:
            return self._state is State.CONNECTED and channel in self._confirmed

    def close(self) -> None:
        """Stop the thread; it closes its connection. Waiters still registered poll."""
        with self._cond:
            if self._state is State.CLOSED:
                return
            self._state = State.CLOSED
            thread = self._thread
            self._cond.notify_all()
        self._stop.set()
        self.poke()
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._timeout_s + 1)
        if thread is None or not thread.is_alive():  # else it may still read the pairs
            for end in self._pair_ends():
                end.close()
        self.connection_lost()  # listeners still registered poll from now on

    def _pair_ends(self) -> tuple[socket.socket, ...]:
        """Both ends of both socket pairs (the worker's pokes, the leader's)."""
        return (self._poke_r, self._poke_w, self._lead_r, self._lead_w)

    def poke(self) -> None:
        """Wake the thread's selector (a full socket pair is a poke already)."""
        with contextlib.suppress(OSError):
            self._poke_w.send(b"\0")

    # ----------------------------------------------------------------- claims
    def claim(self, key: str, grant: Grant) -> None:
        """Claim a grant delivered to a waiter here :data:`CLAIM_AFTER_S` from now,
        in this thread, unless its holder released it first (:meth:`released`)."""
        with self._claims_lock:
            self._claims[grant.lock_id] = (time.monotonic() + CLAIM_AFTER_S, key, grant)

    def released(self, lock_id: str) -> None:
        with self._claims_lock:
            self._claims.pop(lock_id, None)

    def watch(self, channel: str, ticket_id: str, after_s: float = WATCH_AFTER_S) -> None:
        """This process's release (withdrawal, attempt) just granted the key of
        ``channel`` to ``ticket_id``: check in ``after_s`` whether the waiter claimed
        it, unless this process sees the key move on first (:meth:`settled`). Only
        called while this thread runs (the backend asks :attr:`watching`)."""
        due = time.monotonic() + after_s
        with self._claims_lock:
            self._watches.pop(channel, None)  # re-inserted last: the dict stays by due time
            self._watches[channel] = (due, ticket_id)
            sooner = due < self._timers_at
        if sooner:  # rare on a hot key: an earlier watch already bounds the thread's sleep
            self.poke()

    @property
    def watching(self) -> bool:
        """Whether a grant made now would be checked by :meth:`watch` (the thread runs
        and is connected; otherwise the release tells the next waiter instead)."""
        return self._state is State.CONNECTED

    def hold_back(self, key: str, now: float | None = None) -> float:
        if not self._watches:
            return 0.0
        watched = self._watches.get(self.transport.channel(key))
        if watched is None or not watched[1]:
            return 0.0
        # A watch made by a fresh grant is due WATCH_AFTER_S after it (a re-check of
        # an old grant is due sooner, so it holds nothing back).
        made = watched[0] - WATCH_AFTER_S
        now = time.monotonic() if now is None else now
        return max(0.0, made + tickets.QUEUE_AFTER_GRANT_MS / 1000 - now)

    def settled(self, channel: str) -> None:
        """This process acquired (or was granted) the key of ``channel``: any grant it
        made of that key earlier has ended (the key could not be had otherwise). The
        entry stays, emptied, until it is due: the thread's sleep is already bounded
        by it, so the next grant of the key (due later) needs no poke, which would wake
        this process's thread at the moment the grantee needs the CPU."""
        if channel in self._watches:
            with self._claims_lock:
                watched = self._watches.get(channel)
                if watched is not None:
                    self._watches[channel] = (watched[0], "")

    def _claim_due(self) -> float:
        """Claim the grants whose time has come, and check the grants this process
        made whose window is over; seconds until the next of either."""
        now, due, checks = time.monotonic(), [], []
        with self._claims_lock:
            while self._claims:
                lock_id, (at, key, grant) = next(iter(self._claims.items()))
                if at > now:
                    break
                del self._claims[lock_id]
                due.append((key, grant))
            while self._watches:
                channel, (at, ticket_id) = next(iter(self._watches.items()))
                if at > now:
                    break
                del self._watches[channel]
                if ticket_id:  # else settled
                    checks.append((channel, ticket_id))
            next_s = min(
                next(iter(self._claims.values()))[0] - now if self._claims else MAX_SELECT_S,
                next(iter(self._watches.values()))[0] - now if self._watches else MAX_SELECT_S,
            )
            self._timers_at = now + next_s
        for key, grant in due:
            try:
                self._claim_on_server(key, grant)
            except Exception as exc:  # the holder learns it at its release, if it lapses
                self.transport.logger.warning(
                    "Claiming a lock granted to a waiter of %s failed: %r.", self.name, exc
                )
        for channel, ticket_id in checks:
            try:
                self._run_grant_check(channel, ticket_id)
            except Exception as exc:  # the waiters' check-ins notice the lapse instead
                self.transport.logger.warning(
                    "Checking a grant made by %s failed: %r.", self.name, exc
                )
        return next_s

    def _run_grant_check(self, channel: str, ticket_id: str) -> None:
        """Check a grant whose window is over, and act on what the server found: one
        not over yet on its clock is checked again then; a new grant the check made
        is watched in turn."""
        found = self._check_grant_on_server(channel, ticket_id)
        if found is None:
            return
        if found.left_ms > 0:
            self.watch(channel, ticket_id, (found.left_ms + tickets.RECHECK_MARGIN_MS) / 1000)
        elif found.lapsed:
            self.transport.logger.info(
                "A lock granted to a waiter lapsed unclaimed; the key of %s goes on.", channel
            )
            if found.granted is not None:
                self.watch(channel, found.granted)

    def _claim_on_server(self, key: str, grant: Grant) -> None:
        """Send the claim of ``grant`` (backends that grant)."""

    def _check_grant_on_server(self, channel: str, ticket_id: str) -> GrantCheck | None:
        """Grant the key of ``channel`` on if its grant to ``ticket_id`` lapsed
        unclaimed (backends that watch their grants); None when it could not be
        checked."""
        return None

    def _pause(self, seconds: float) -> None:
        """Wait between connections (or until closed), claiming what comes due."""
        deadline = time.monotonic() + seconds
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._stop.wait(min(left, self._claim_due()))

    # ------------------------------------------------------------ channel hooks
    def _subscribe(self, key: str) -> bool:
        if self.transport.confirms_on_listen:
            return self.want(key, wait=True)
        # Asked for by the backend when the ticket is queued (see queued).
        channel = self.transport.channel(key)
        with self._cond:
            if self._state is State.CONNECTED and channel in self._confirmed:
                self._idle.pop(channel, None)
                return True
            return False

    def _subscribed(self, key: str) -> bool:
        return self._subscribe(key)

    def want(self, key: str, *, wait: bool) -> bool:
        """Ask the thread to subscribe ``key``'s channel; with ``wait``, block (at
        most ``timeout_s``) until the server confirmed it. True when confirmed."""
        channel = self.transport.channel(key)
        deadline = time.monotonic() + self._timeout_s
        with self._cond:
            if self._state in (State.CLOSED, State.DEAF) or not self._admit(channel, key):
                return False
            self._idle.pop(channel, None)
            failures = self._failures
            if self._state is State.CONNECTED and channel in self._confirmed:
                hot = True  # a hot key: nothing to send
            else:
                hot = False
                self._start()
        if hot:
            # A listener that registered while the channel's confirmation crossed it
            # is confirmed (and woken) now.
            self._confirm_listeners([key])
            return True
        self.poke()
        with self._cond:
            if not wait or self._state is State.DOWN:
                return False  # confirmed later (the listener is woken), or polls
            while not (self._state is State.CONNECTED and channel in self._confirmed):
                left = deadline - time.monotonic()
                gone = self._state in (State.CLOSED, State.DEAF, State.DOWN)
                if left <= 0 or gone or self._failures != failures:
                    return False
                self._cond.wait(left)
            return True

    def _admit(self, channel: str, key: str) -> bool:
        """Make ``channel`` wanted, within the transport's limit (caller holds
        ``_cond``)."""
        if channel in self._channels:
            return True
        limit = self.transport.max_channels
        if limit is not None and len(self._channels) >= limit:
            self._expire_idle(time.monotonic(), keep=0)
            if len(self._channels) >= limit:
                self.transport.logger.debug(
                    "%s listens to %d channels: this waiter polls.", self.name, limit
                )
                return False
        self._channels[channel] = key
        return True

    def _unsubscribe(self, key: str) -> None:
        # Lazily: the thread unsubscribes the channel once it has been idle a while.
        channel = self.transport.channel(key)
        with self._cond:
            if channel in self._channels and self._state is not State.CLOSED:
                self._idle.pop(channel, None)
                self._idle[channel] = time.monotonic()
                if len(self._idle) > self.transport.idle_cap:
                    # Beyond the cap at once; the thread sends the unsubscription.
                    self._expire_idle(time.monotonic())
                    self.poke()

    def queued(self, key: str) -> None:
        """A waiter of this process has just found ``key`` held: make sure its channel
        is subscribed (a transport that does not confirm on listen subscribes here, so
        that an attempt that finds the key free costs nothing). A ticket queued by a
        caller that registered no listener leaves the channel idle."""
        self.want(key, wait=False)
        if not self.waited_on(key):
            self._unsubscribe(key)

    def _expire_idle(self, now: float, *, keep: int | None = None) -> float:
        """Forget idle channels past :data:`IDLE_CHANNEL_S` or beyond ``keep``
        (default: the transport's cap); seconds until the next one is due (caller
        holds ``_cond``). A channel whose key has a waiter again stays."""
        cap = self.transport.idle_cap if keep is None else keep
        due, forgot = float("inf"), False
        while self._idle:
            channel, since = next(iter(self._idle.items()))
            if len(self._idle) <= cap and now - since < IDLE_CHANNEL_S:
                due = since + IDLE_CHANNEL_S - now
                break
            del self._idle[channel]
            if self.waited_on(self._channels.get(channel)):
                continue  # a waiter came back before its predecessor's unsubscribe
            del self._channels[channel]
            # At once: a waiter arriving now must not believe it still subscribed. The
            # thread unsubscribes it at its next turn (and subscribes it again if a
            # waiter wants it back by then); a reconnect no longer waits for it.
            self._confirmed.discard(channel)
            if self._resubscribing is not None:
                self._resubscribing.discard(channel)
            self._expired.add(channel)
            forgot = True
        if forgot:
            self._settle_state()
        return due

    def reset_after_fork(self) -> None:
        # The parent's thread does not exist here; its connection is the parent's.
        if self._connection is not None:
            abandon(self._connection)  # never closed nor finalized here
        for end in self._pair_ends():
            with contextlib.suppress(OSError):
                end.close()  # this process's copies: the parent keeps its own
        self._init_state()
        super().reset_after_fork()

    # ---------------------------------------------------------------- leading
    def wait_for(self, listener: Listener, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until ``listener``'s event is set (True),
        reading the connection in this thread meanwhile when the transport lets
        waiters read and no other thread leads (Leading, in the module docstring)."""
        taken = self._take_lead(listener, timeout_s)
        if taken is None:
            return listener._event.wait(timeout_s)
        deadline = time.monotonic() + timeout_s
        try:
            self._lead(listener, *taken, deadline)
        finally:
            self._give_lead()
        # Woken: at once. Otherwise the rest of the wait, the worker's thread reading.
        return listener._event.wait(max(deadline - time.monotonic(), 0.0))

    def _take_lead(self, listener: Listener, timeout_s: float) -> tuple[Connection, int] | None:
        """The connection and its descriptor, if this thread may lead now (it then
        does)."""
        if timeout_s < LEAD_MIN_S or not self.transport.let_waiters_read:
            return None
        with self._cond:
            connection = self._connection
            if (
                self._leader is not None
                or self._revoked
                or self._state is not State.CONNECTED
                or connection is None
            ):
                return None
            try:
                fd = connection.fileno()
            except Exception:  # closed under us: the worker's thread finds out
                return None
            if fd is None:
                return None
            self._leader, self._leader_thread = listener, threading.get_ident()
        self.poke()  # the worker's thread stops reading the connection
        return connection, fd

    def _lead(self, listener: Listener, connection: Connection, fd: int, deadline: float) -> None:
        """Read ``connection`` (open on ``fd``) until ``listener`` is woken, the
        deadline passes, or the worker takes the connection back.

        The leader waits on a poll object kept between leads (rebuilt for another
        descriptor): a selector built and closed for each lead cost the grantee a
        system call between its wake-up and its body. Without ``select.poll``
        (Windows), a selector per lead."""
        if not _HAS_POLL:
            with selectors.DefaultSelector() as selector:  # any descriptor, unlike select()
                try:
                    selector.register(fd, selectors.EVENT_READ)
                    selector.register(self._lead_r, selectors.EVENT_READ)
                except (OSError, ValueError):  # closed already: the worker's thread finds out
                    return
                self._lead_on(
                    listener,
                    connection,
                    fd,
                    deadline,
                    lambda left: [key.fd for key, _ in selector.select(left)],
                )
            return
        kept = self._lead_poll
        if kept is None or kept.fd != fd:
            try:
                kept = self._lead_poll = _LeadPoll(fd, self._lead_r.fileno())
            except (OSError, ValueError):  # closed already: the worker's thread finds out
                return
        self._lead_on(listener, connection, fd, deadline, kept.ready)

    def _lead_on(
        self,
        listener: Listener,
        connection: Connection,
        fd: int,
        deadline: float,
        ready_within: Callable[[float], list[int]],
    ) -> None:
        pair_fd = self._lead_r.fileno()
        while not listener._event.is_set() and not self._revoked:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            ready = ready_within(left)
            if pair_fd in ready:
                self._drain(self._lead_r)
            if fd in ready and not self._read_as_leader(connection, fd):
                return

    def _read_as_leader(self, connection: Connection, fd: int) -> bool:
        """Read and handle what arrived, as the worker's thread would; False when
        this thread must stop leading. Only while ``connection`` is still the worker's
        and still open on ``fd``: a send of the worker's thread that failed closes it,
        and its descriptor number may then name another socket."""
        if not self._io_lock.acquire(timeout=LEAD_LOCK_S):
            return True  # the worker's thread is sending: try again
        try:
            if self._revoked or self._connection is not connection:
                return False
            try:
                if connection.fileno() != fd:
                    return False
            except Exception:
                return False
            self._handle(connection.receive())
            return True
        except BaseException as exc:
            # Also an interrupt raised in this (the caller's) thread: what it had read
            # may be lost, so the worker's thread reconnects and every waiter tries
            # again once, as after a lost connection.
            with self._cond:
                self._lead_error = (
                    exc if isinstance(exc, Exception) else ConnectionError(f"interrupted: {exc!r}")
                )
            if not isinstance(exc, Exception):
                raise
            return False
        finally:
            self._io_lock.release()

    def _give_lead(self) -> None:
        with self._cond:
            self._leader = self._leader_thread = None
            self._cond.notify_all()  # a revocation waits for it
        with self._mutex:
            others = sum(len(waiting) for waiting in self._listeners.values()) > 1
        if others or self._lead_error is not None:
            self.poke()  # the worker's thread reads for them (or reconnects), at once

    def _revoke_lead(self) -> None:
        """Take the connection back from a leader, before closing it (the leader's
        reads never block: it leaves as soon as its socket pair wakes it)."""
        with self._cond:
            self._revoked = True
            deadline = time.monotonic() + self._timeout_s + 1
            while self._leader is not None and time.monotonic() < deadline:
                self._wake_leader()
                self._cond.wait(0.05)

    def _wake_leader(self) -> None:
        with contextlib.suppress(OSError):
            self._lead_w.send(b"\0")

    def signalled(self, listener: Listener) -> None:
        if listener is self._leader and self._leader_thread != threading.get_ident():
            self._wake_leader()  # another thread woke or nudged the leader

    def _yield_to_woken(self, woken: list[Listener]) -> None:
        if self._leader_thread == threading.get_ident() and all(
            listener is self._leader for listener in woken
        ):
            return  # the leader woke itself: nobody to hand the GIL to
        super()._yield_to_woken(woken)

    # ---------------------------------------------------------------- the thread
    def _start(self) -> None:
        """Start the thread unless it runs (caller holds ``_cond``)."""
        if self._state is State.CLOSED or (self._thread is not None and self._thread.is_alive()):
            return
        if self._state is State.IDLE:
            self._state = State.CONNECTING
        self._resubscribing = None  # connected only once this thread's batch is confirmed
        self._thread = threading.Thread(
            target=self._run, name=f"syncguard wake-ups {self.name}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        failures = 0  # in a row: connections that failed, or broke soon after opening
        while not self._stop.is_set() and self._still_needed() and self._mine():
            opened: float | None = None
            connection: Connection | None = None
            try:
                connection = self._connection = self.transport.connect(self.poke)
                opened = time.monotonic()
                self._serve(connection)
                return  # nothing listened to for a while, or closed
            except Deaf:
                self._deaf()
                return
            except Refused as exc:
                self._broken(exc)
                self._pause(REFUSED_RETRY_S)
                continue
            except Exception as exc:  # whatever broke the connection: report, retry
                self._broken(exc)
                lived = time.monotonic() - (opened or time.monotonic())
                failures = 1 if lived > RECONNECT_MAX_S else failures + 1
            finally:
                self._disconnect(connection)
            self._pause(reconnect_delay_s(failures))
            self._drain_pokes()

    def _mine(self) -> bool:
        """Whether this thread is still the worker's (a state rebuilt after a fork, or
        by a test pretending one, has a thread of its own)."""
        return self._thread is threading.current_thread()

    def _still_needed(self) -> bool:
        """Whether any channel is wanted; if not, the thread ends (a waiter that comes
        later starts another)."""
        with self._cond:
            self._expire_idle(time.monotonic())  # also while no connection can be made
            if self._channels or self._watches or self._state is State.CLOSED:
                return True
            self._end_thread()
            return False

    def _end_thread(self) -> None:
        """This thread ends: a waiter that comes later starts another (caller holds
        ``_cond``). A closed worker stays closed."""
        if self._state is not State.CLOSED:
            self._state = State.IDLE
        self._thread = None
        self._cond.notify_all()

    def _disconnect(self, connection: Connection | None) -> None:
        if self._connection is connection:
            # (Not a newer thread's connection: only this one's leader is sent away.)
            self._revoke_lead()
            self._connection = None
        if connection is not None:
            try:
                connection.close()
            except Exception as exc:
                self.transport.logger.debug("Closing the wake-ups of %s: %r", self.name, exc)

    def _serve(self, connection: Connection) -> None:
        """Subscribe again, then read and reconcile until there is nothing left to
        listen to or the worker is closed; raises when the connection breaks."""
        with self._cond:
            now = time.monotonic()
            for channel in list(self._idle):  # only channels with waiters come back
                self._idle[channel] = now - IDLE_CHANNEL_S
            self._expire_idle(now)
            batch = list(self._channels)
            self._expired = set()
            self._resubscribing = set(batch)
            if self._state is State.CLOSED:
                return
            if self._state is not State.CONNECTED:
                # Before any confirmation: a channel confirmed from here on is
                # confirmed on this connection (ready(), want() see it).
                self._state = State.CONNECTING
        self._sent = set(batch)  # this thread's: a thread that ended touches it no more
        self._unused_since: float | None = None  # since when nothing is wanted
        with self._io_lock:
            if batch:
                self._confirm(connection.subscribe(batch))
                self._handle_backlog(connection)
        with self._cond:
            self._revoked, self._lead_error = False, None  # a leader may read this one
            self._settle_state()
        fd = connection.fileno()
        with selectors.DefaultSelector() as selector, selectors.DefaultSelector() as parked:
            selector.register(self._poke_r, selectors.EVENT_READ)
            parked.register(self._poke_r, selectors.EVENT_READ)  # while a waiter leads
            if fd is not None:
                selector.register(fd, selectors.EVENT_READ)
            poked = True  # a waiter may have poked before the thread started
            while not self._stop.is_set() and self._mine():
                # The pokes before the read (a transport without a socket pokes once
                # it has queued a message: drained after the read, a poke that came
                # in between would be lost with its message), and only when there are
                # some: a wake-up by the socket needs no read of the pair.
                if poked:
                    self._drain_pokes()
                # Then deliver: a wake-up is what a waiter is waiting for.
                if self._leader is None:
                    with self._io_lock:
                        self._handle(connection.receive())
                with self._cond:
                    failed, self._lead_error = self._lead_error, None
                if failed is not None:
                    raise failed  # met by a leader: the connection is lost
                next_expiry = self._reconcile(connection)
                if next_expiry is None:
                    return
                with self._io_lock:
                    healthy_for = connection.check()
                timeout = min(next_expiry, healthy_for, MAX_SELECT_S, self._claim_due())
                if self._leader is None:
                    ready = selector.select(max(timeout, 0.0))
                else:  # until a poke, or LEAD_PARK_S at most: see there
                    ready = parked.select(max(min(timeout, LEAD_PARK_S), 0.0))
                poked = any(key.fileobj is self._poke_r for key, _ in ready)

    def _reconcile(self, connection: Connection) -> float | None:
        """Send what the waiters need; seconds until an idle channel (or the idle
        connection) is due, or None when nothing has been listened to for
        :data:`IDLE_CHANNEL_S` (the thread ends, and closes the connection)."""
        with self._cond:
            now = time.monotonic()
            next_expiry = self._expire_idle(now)
            wanted = set(self._channels)
            if wanted:
                self._unused_since = None
            else:
                # Kept a while like an idle channel: a waiter soon after needs no
                # new connection.
                self._unused_since = self._unused_since or now
                next_expiry = self._unused_since + IDLE_CHANNEL_S - now
                if (next_expiry <= 0 and not self._watches) or self._state is State.CLOSED:
                    self._end_thread()
                    return None
            expired, self._expired = self._expired, set()
            order = list(self._channels)
        # Expired ones go even if wanted again meanwhile: their confirmation was
        # forgotten, so they are subscribed (and confirmed) anew.
        with self._io_lock:  # a leader may be reading replies that touch _sent
            dropped = sorted((self._sent - wanted) | (self._sent & expired))
            if dropped:
                self._sent.difference_update(dropped)
                connection.unsubscribe(dropped)
            added = [channel for channel in order if channel not in self._sent]
            if added:
                self._sent.update(added)
                self._confirm(connection.subscribe(added))
            if dropped or added:
                self._handle_backlog(connection)
        return next_expiry

    def _handle_backlog(self, connection: Connection) -> None:
        """After a send (caller holds ``_io_lock``): what the driver read with its reply.
        psycopg keeps aside a notification that came before a statement's reply, and
        the socket is then empty: a leader, which reads only when its socket has data,
        would not see it until its wait ended (nor the worker's thread until its next
        turn). Where nothing is kept aside, a read that finds nothing."""
        self._handle(connection.receive())

    def _handle(self, events: list[Event]) -> None:
        confirmed = [event.channel for event in events if isinstance(event, Confirmed)]
        if confirmed:
            self._confirm(confirmed)
        for event in events:
            if isinstance(event, Message):
                with self._cond:
                    key = self._channels.get(event.channel)
                if key is None:
                    continue
                if event.grant is not None or event.recheck:
                    self.settled(event.channel)  # the key was granted again since
                if event.recheck:
                    self.recheck(key, event.ticket_id)
                else:
                    self.deliver(key, event.ticket_id, event.grant)

    def _confirm(self, channels: Iterable[str]) -> None:
        """The server confirmed ``channels``: their listeners are subscribed now, and
        those registered before are woken once (a release may have come first)."""
        channels = [channel for channel in channels if channel in self._sent]
        if not channels:
            return
        with self._cond:
            keys = [self._channels[c] for c in channels if c in self._channels]
            self._confirmed.update(c for c in channels if c in self._channels)
            if self._resubscribing is not None:
                self._resubscribing.difference_update(channels)
            self._settle_state()
        self._confirm_listeners(keys)

    def _confirm_listeners(self, keys: Iterable[str]) -> None:
        """The listeners of ``keys`` not yet confirmed are, now, and woken once."""
        for key in keys:
            for listener in self.listeners_of(key):
                if not listener.confirmed:
                    listener.confirmed = True
                    listener.wake()

    def _settle_state(self) -> None:
        """Connected once the reconnect's batch is confirmed (caller holds ``_cond``)."""
        if self._state is State.CONNECTING and self._resubscribing == set():
            self._state = State.CONNECTED
        self._cond.notify_all()

    def _drain_pokes(self) -> None:
        self._drain(self._poke_r)

    @staticmethod
    def _drain(pair_end: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while pair_end.recv(4096):
                pass

    def _broken(self, exc: BaseException) -> None:
        """The connection broke, or could not be made: waiters poll until it is back."""
        with self._cond:
            was = self._state
        if was is State.CLOSED:
            return
        # The log first: it then precedes whatever the woken waiters do and log.
        log, connection = self.transport.logger, self.transport.connection_name
        if was is not State.DOWN:
            log.warning(
                "Wake-ups of %s lost their %s (%r); waiters poll until it is back.",
                self.name,
                connection,
                exc,
            )
        else:
            log.debug("Wake-ups of %s still cannot open a %s: %r", self.name, connection, exc)
        with self._cond:
            was = self._state
            if was is State.CLOSED:
                return
            heard = bool(self._confirmed) or was is State.CONNECTED
            self._state = State.DOWN
            self._confirmed.clear()
            self._resubscribing = None
            self._failures += 1
            if heard:
                # With the state: a listener registered from now on has the new
                # generation, and is confirmed on the next connection.
                self.connection_lost()
            self._cond.notify_all()

    def _deaf(self) -> None:
        """Listeners were never healthy on this channel: nothing was lost."""
        self.reaches_other_processes = False
        with self._cond:
            if self._state is not State.CLOSED:
                self._state = State.DEAF
            self._confirmed.clear()
            self._thread = None
            self._cond.notify_all()


_HAS_POLL = hasattr(select, "poll")  # not on Windows


class _LeadPoll:
    """A poll object for a leader: the connection's descriptor and the socket pair
    that wakes the leader. Any event counts as ready, as a selector reports a hang-up
    or an error (the read that follows finds out which)."""

    __slots__ = ("_poller", "fd")

    def __init__(self, fd: int, pair_fd: int) -> None:
        self.fd = fd
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)
        self._poller.register(pair_fd, select.POLLIN)

    def ready(self, timeout_s: float) -> list[int]:
        """The descriptors ready within ``timeout_s`` (rounded up to a millisecond,
        as a selector rounds it, so a wait never spins)."""
        return [fd for fd, _ in self._poller.poll(math.ceil(timeout_s * 1000))]
