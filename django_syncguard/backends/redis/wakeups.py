"""Wake-ups of the Redis backend: one pub/sub connection per backend and process.

A release (or a withdrawal) that leaves waiters behind a free key publishes the first
live ticket's id on the lock hash's own name: ``PUBLISH P:<key> <ticket id>`` (see
``scripts.py``; pub/sub channels and keys are separate namespaces, and channels are not
scoped to a database number, which only costs a stray message: one for a ticket no
process holds wakes nobody). :class:`RedisWakeUps` is the subscriber side: it
subscribes to the channels of the keys this process waits on and hands each message
to the waiter holding that ticket.

How it is built, and why:

* **One connection and one daemon reader thread** per backend and process, never one
  per waiter. The reader thread is the only code that touches the connection:
  redis-py connections (and its ``PubSub``) are not safe for a subscribe from one
  thread while another reads. Waiting threads say what they need under a condition
  variable, poke the reader through a socket pair, and wait for the server's
  confirmation of the ``SUBSCRIBE``.
* **A plain redis-py connection, not ``PubSub``**: ``PubSub`` reconnects and
  resubscribes inside its reads (its retry callback), which would hide a lost
  connection, and a lost connection is exactly what the waiters must learn about:
  a wake-up published meanwhile is gone. The reader speaks the four pub/sub replies
  itself (``subscribe``, ``unsubscribe``, ``message``, ``pong``), on RESP2.
* **The reader sleeps in a selector** on the connection's socket and the socket pair,
  so a subscription is sent at once and an idle connection costs nothing; it never
  blocks in a socket read without data, so the socket timeout (the operation
  timeout) only bounds a reply that stopped half-way.
* **Health**: after ``HEALTH_CHECK_S`` without a byte from the server the reader
  sends ``PING``; no reply within the operation timeout counts as a lost connection
  (a half-open TCP connection would otherwise look idle forever).
* **Lost connection**: ``connected`` turns False and :meth:`WakeUps.connection_lost`
  runs (every current listener polls from then on); the reader reconnects with a
  bounded, jittered backoff (at once the first time, then 50 ms doubling up to
  ``MAX_RECONNECT_DELAY_S``), resubscribes the keys that still have local waiters and,
  once the server confirmed them all, is ``connected`` again: listeners made from then
  on are healthy.
* **Lazy unsubscribe**: a channel whose last local waiter left stays subscribed for
  ``IDLE_CHANNEL_S`` (at most ``MAX_IDLE_CHANNELS`` such channels, the oldest go
  first), so a hot key does not cost a ``SUBSCRIBE`` and an ``UNSUBSCRIBE`` per cycle.
* **Fork**: a child starts with a fresh state, thread and connection (the parent's
  socket is only dropped, never shut down).
"""

from __future__ import annotations

import contextlib
import logging
import random
import selectors
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from ...waiting import WakeUps
from .client import redis_response_error

if TYPE_CHECKING:
    from .backend import RedisBackend

logger = logging.getLogger("django_syncguard.backends.redis")

#: A channel whose last local waiter left stays subscribed this long: the next waiter
#: of a hot key finds it confirmed and sends nothing.
IDLE_CHANNEL_S = 30.0
#: At most this many idle channels stay subscribed (each costs the server a little).
MAX_IDLE_CHANNELS = 1024
#: After this long without a byte from the server the reader sends PING.
HEALTH_CHECK_S = 5.0
#: The reconnect backoff: at once, then 50 ms doubling up to this (jittered).
FIRST_RECONNECT_DELAY_S = 0.05
MAX_RECONNECT_DELAY_S = 2.0
#: After the server refused a subscription (ACL ``NOPERM`` on channels), the next try.
REFUSED_RETRY_S = 60.0


class _Refused(Exception):
    """The server answered a pub/sub command with an error (ACL, for one)."""


class RedisWakeUps(WakeUps):
    """Wake-ups over Redis pub/sub for one :class:`~.backend.RedisBackend` (see the
    module docstring)."""

    def __init__(self, backend: RedisBackend) -> None:
        super().__init__(f"redis {backend.alias!r}")
        self._lock_key = backend.lock_key
        self._timeout_s = backend.operation_timeout_ms / 1000
        # One connection, outside the backend's pool, speaking RESP2 (see the client
        # layer); the reader checks its health itself.
        self._new_pool = backend.clients.pubsub_connection_pool
        self._init_state()

    def _init_state(self) -> None:
        """A fresh state: at construction, and in a forked child."""
        # The condition guards every field below that waiters read; the reader alone
        # touches the connection and ``_sent`` / ``_inflight`` / ``_resubscribing``.
        self._cond = threading.Condition(threading.Lock())
        self._channels: dict[str, str] = {}  # channel -> user key, all to be subscribed
        self._idle_since: dict[str, float] = {}  # channel -> when its waiters left (oldest first)
        self._confirmed: set[str] = set()  # subscribed, as the server confirmed
        self._dirty = False  # a waiter added a channel the reader has not sent yet
        self._up = False  # connected, every resubscription confirmed
        self._down = False  # the last connection broke or failed: waiters poll
        self._failures = 0  # counts broken or failed connections
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: Any = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        # Reader-thread state of the current connection.
        self._sent: set[str] = set()  # channels SUBSCRIBEd (and not UNSUBSCRIBEd)
        self._inflight: dict[str, int] = {}  # channel -> replies still to come
        self._resubscribing: set[str] = set()  # the reconnect's batch, until confirmed
        self._opened_at: float | None = None  # when the current connection opened

    # ------------------------------------------------------------------ state
    @property
    def connected(self) -> bool:
        return self._up

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until the channel is connected (and resubscribed) or ``timeout_s``
        passed; whether it is connected. The reader starts with the first waiter."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._up:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return False
                self._cond.wait(remaining)
            return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._up = False
            self._cond.notify_all()
            thread = self._thread
        self._stop.set()
        self._poke()
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._timeout_s + 1)
            if thread.is_alive():
                return  # it exits on its own; it still reads the socket pair
        self._wake_r.close()
        self._wake_w.close()

    def ready(self, key: str) -> bool:
        with self._cond:
            return self._up and self._lock_key(key) in self._confirmed

    # ------------------------------------------------------------ channel hooks
    def _subscribe(self, key: str) -> bool:
        return self._await_channel(key)

    def _subscribed(self, key: str) -> bool:
        return self._await_channel(key)

    def _unsubscribe(self, key: str) -> None:
        channel = self._lock_key(key)
        with self._cond:
            if channel in self._channels:
                # Kept for IDLE_CHANNEL_S; the reader unsubscribes it later, unless a
                # waiter comes back first (this call may also arrive after that
                # waiter's _subscribe: the reader checks for local waiters again).
                self._idle_since.pop(channel, None)
                self._idle_since[channel] = time.monotonic()

    def _await_channel(self, key: str) -> bool:
        """True once the server confirmed the subscription to ``key``'s channel (at
        most the operation timeout); False when the channel is down: poll."""
        channel = self._lock_key(key)
        deadline = time.monotonic() + self._timeout_s
        with self._cond:
            if self._closed:
                return False
            self._channels[channel] = key
            self._idle_since.pop(channel, None)
            if self._up and channel in self._confirmed:
                return True  # a hot key: nothing to send
            self._dirty = True
            self._start_locked()
            self._poke()
            if self._down:
                return False  # the reader is reconnecting; this waiter polls
            failures = self._failures
            while not (self._up and channel in self._confirmed):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed or self._failures != failures:
                    return False
                self._cond.wait(remaining)
            return True

    def _reset_after_fork(self) -> None:
        # The parent's thread does not exist here, and its connection and socket
        # pair are the parent's: drop them without a shutdown, which would end them
        # for the parent too.
        self._init_state()

    # ----------------------------------------------------------------- reader
    def _start_locked(self) -> None:
        if self._closed or (self._thread is not None and self._thread.is_alive()):
            return
        self._thread = threading.Thread(
            target=self._run, name=f"syncguard wake-ups {self.name}", daemon=True
        )
        self._thread.start()

    def _poke(self) -> None:
        """Wake the reader's selector (a full socket pair is already a poke)."""
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _drain_pokes(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass

    def _run(self) -> None:
        # Started by the first waiter, the reader keeps a connection up until close():
        # after an outage the next waiter then finds it back, subscribed or not.
        failures = 0  # in a row: connections that failed, or broke soon after they opened
        while not self._stop.is_set():
            self._opened_at = None
            try:
                self._serve()
            except _Refused as exc:
                self._broken(exc)
                self._stop.wait(REFUSED_RETRY_S)
                continue
            except Exception as exc:  # whatever broke the connection: report, retry
                self._broken(exc)
                lived = time.monotonic() - (self._opened_at or time.monotonic())
                # A connection that lived a while broke: reconnect at once. One that
                # failed or broke at once (a server refusing us) backs off further.
                failures = 1 if lived > MAX_RECONNECT_DELAY_S else failures + 1
            if failures > 1:
                delay = min(FIRST_RECONNECT_DELAY_S * 2 ** (failures - 2), MAX_RECONNECT_DELAY_S)
                self._stop.wait(delay * (0.5 + random.random() / 2))
        self._disconnect()

    def _disconnect(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            try:
                pool.disconnect()
            except Exception as exc:
                logger.debug("Closing the wake-up connection of %s: %r", self.name, exc)

    def _broken(self, exc: BaseException) -> None:
        """The connection broke (or could not be made): waiters poll until it is back."""
        self._disconnect()
        with self._cond:
            was_up = self._up
            first = not self._down
            self._up = False
            self._down = True
            self._confirmed.clear()
            self._failures += 1
            self._cond.notify_all()
            stopping = self._closed
        # The log first: it then precedes whatever the woken waiters do and log.
        if first and not stopping:
            logger.warning(
                "Wake-ups of %s lost their Redis connection (%r); waiters poll until it is back.",
                self.name,
                exc,
            )
        elif not stopping:
            logger.debug("Wake-ups of %s still cannot connect: %r", self.name, exc)
        if was_up:
            self.connection_lost()

    def _connect(self) -> Any:
        if self._pool is None:
            self._pool = self._new_pool()
        conn = self._pool.get_connection()  # connects: AUTH, SELECT, within the timeouts
        self._opened_at = time.monotonic()
        self._sent, self._inflight, self._resubscribing = set(), {}, set()
        with self._cond:
            # Only keys with local waiters are worth resubscribing; idle channels go.
            for channel in list(self._idle_since):
                del self._idle_since[channel]
                if not self._waited_on(self._channels[channel]):
                    del self._channels[channel]
            batch = list(self._channels)
            self._dirty = False
            self._down = False
            if not batch:
                self._up = True
                self._cond.notify_all()
        if batch:
            self._send(conn, "SUBSCRIBE", batch)
            self._resubscribing = set(batch)
        return conn

    def _waited_on(self, key: str) -> bool:
        with self._mutex:
            return key in self._listeners

    def _send(self, conn: Any, command: str, channels: list[str]) -> None:
        conn.send_command(command, *channels)
        for channel in channels:
            self._inflight[channel] = self._inflight.get(channel, 0) + 1
        if command == "SUBSCRIBE":
            self._sent.update(channels)
        else:
            self._sent.difference_update(channels)

    def _serve(self) -> None:
        """Connect, then read and reconcile until stopped; raises when the connection
        breaks."""
        conn = self._connect()
        sock = conn._sock  # redis-py has no public accessor; the selector needs it
        with selectors.DefaultSelector() as selector:
            selector.register(sock, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            heard = time.monotonic()
            ping_deadline: float | None = None
            while not self._stop.is_set():
                self._reconcile(conn)
                while conn.can_read(0):
                    try:
                        reply = conn.read_response()
                    except redis_response_error() as exc:
                        raise _Refused(str(exc)) from exc
                    self._handle(conn, reply)
                    heard, ping_deadline = time.monotonic(), None
                now = time.monotonic()
                if ping_deadline is not None and now >= ping_deadline:
                    raise TimeoutError(f"no reply to PING within {self._timeout_s:g} s")
                if ping_deadline is None and now - heard >= HEALTH_CHECK_S:
                    conn.send_command("PING")
                    ping_deadline = now + self._timeout_s
                due = ping_deadline if ping_deadline is not None else heard + HEALTH_CHECK_S
                selector.select(max(min(due, self._next_expiry()) - now, 0.0))
                self._drain_pokes()

    def _next_expiry(self) -> float:
        with self._cond:
            if len(self._idle_since) > MAX_IDLE_CHANNELS:
                return 0.0
            for since in self._idle_since.values():
                return since + IDLE_CHANNEL_S
        return float("inf")

    def _reconcile(self, conn: Any) -> None:
        """Send what the waiters asked for: SUBSCRIBE new channels, UNSUBSCRIBE idle
        ones past their time (or beyond the cap)."""
        now = time.monotonic()
        expired: list[str] = []
        with self._cond:
            while self._idle_since:
                channel, since = next(iter(self._idle_since.items()))
                crowded = len(self._idle_since) > MAX_IDLE_CHANNELS
                if not crowded and now - since < IDLE_CHANNEL_S:
                    break
                del self._idle_since[channel]
                if self._waited_on(self._channels[channel]):
                    continue  # a waiter came back before its predecessor's unsubscribe
                del self._channels[channel]
                # Before the UNSUBSCRIBE is sent: a waiter arriving now must not
                # believe the channel still subscribed.
                self._confirmed.discard(channel)
                expired.append(channel)
            added: list[str] = []
            if self._dirty:
                self._dirty = False
                added = [channel for channel in self._channels if channel not in self._sent]
        expired = [channel for channel in expired if channel in self._sent]
        if expired:
            self._send(conn, "UNSUBSCRIBE", expired)
        if added:
            self._send(conn, "SUBSCRIBE", added)

    def _handle(self, conn: Any, reply: Any) -> None:
        """One reply of the pub/sub connection."""
        if not isinstance(reply, list):
            return  # PONG, outside subscribed mode
        decode = conn.encoder.decode
        kind = decode(reply[0], force=True)
        if kind == "message":
            channel, ticket_id = decode(reply[1], force=True), decode(reply[2], force=True)
            with self._cond:
                key = self._channels.get(channel)
            if key is not None:
                self.deliver(key, ticket_id)
            return
        if kind not in ("subscribe", "unsubscribe"):
            return  # ["pong", ""]
        channel = decode(reply[1], force=True)
        left = self._inflight.get(channel, 1) - 1
        if left > 0:
            self._inflight[channel] = left
            return  # a later SUBSCRIBE or UNSUBSCRIBE of this channel is still on its way
        self._inflight.pop(channel, None)
        subscribed = kind == "subscribe" and channel in self._sent
        with self._cond:
            if subscribed and channel in self._channels:
                self._confirmed.add(channel)
            self._resubscribing.discard(channel)
            if not self._resubscribing:
                self._up = True  # connected, and every key waited on resubscribed
            self._cond.notify_all()
