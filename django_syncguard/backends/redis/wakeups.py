"""Wake-ups of the Redis backend: pub/sub as a transport of the channel worker.

A release (or a withdrawal) that leaves waiters behind a free key publishes the first
live ticket's id on the lock hash's own name: ``PUBLISH P:<key> <ticket id>`` (see
``scripts.py``; pub/sub channels and keys are separate namespaces, and channels are not
scoped to a database number, which only costs a stray message: one for a ticket no
process holds wakes nobody). :class:`RedisWakeUps` is the subscriber side: the
package's :class:`~django_syncguard.waiting.channels.ChannelWorker` (one thread and one
connection per backend and process, idle channels, reconnection, fork) over
:class:`RedisTransport`.

What is Redis's own:

* **A plain redis-py connection, not ``PubSub``**: ``PubSub`` reconnects and
  resubscribes inside its reads (its retry callback), which would hide a lost
  connection, and a lost connection is exactly what the waiters must learn about: a
  wake-up published meanwhile is gone. :class:`_Subscriber` speaks the four pub/sub
  replies itself (``subscribe``, ``unsubscribe``, ``message``, ``pong``), on RESP2,
  on a connection from :meth:`~.client.RedisClients.pubsub_connection_pool`.
* **Replies in flight**: a channel subscribed, unsubscribed and subscribed again
  before the server answered counts as confirmed only at the last reply.
* **Health**: after :data:`HEALTH_CHECK_S` without a byte from the server the
  subscriber sends ``PING``; no reply within the operation timeout counts as a lost
  connection (a half-open TCP connection would otherwise look idle forever).
* The worker never blocks in a socket read without data, so the socket timeout (the
  operation timeout) only bounds a reply that stopped half-way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ...waiting.channels import ChannelWorker, Confirmed, Event, Message, Refused
from .client import redis_response_error

if TYPE_CHECKING:
    from .backend import RedisBackend

logger = logging.getLogger("django_syncguard.backends.redis")

#: At most this many idle channels stay subscribed (each costs the server a little).
MAX_IDLE_CHANNELS = 1024
#: After this long without a byte from the server the subscriber sends PING.
HEALTH_CHECK_S = 5.0


class RedisTransport:
    """Redis pub/sub as a channel transport: a key's channel is its lock hash's name."""

    confirms_on_listen = True
    max_channels: int | None = None
    connection_name = "Redis connection"
    logger = logger

    def __init__(self, backend: RedisBackend) -> None:
        self._lock_key = backend.lock_key
        self._timeout_s = backend.operation_timeout_ms / 1000
        self._new_pool = backend.clients.pubsub_connection_pool

    @property
    def idle_cap(self) -> int:
        return MAX_IDLE_CHANNELS

    def channel(self, key: str) -> str:
        return self._lock_key(key)

    def connect(self, poke: Callable[[], None]) -> _Subscriber:
        pool = self._new_pool()
        try:
            # Connects: AUTH, SELECT, within the backend's timeouts.
            return _Subscriber(pool, pool.get_connection(), self._timeout_s)
        except BaseException:
            pool.disconnect()
            raise


class _Subscriber:
    """One subscriber connection (a :class:`~django_syncguard.waiting.channels.Connection`)."""

    def __init__(self, pool: Any, connection: Any, timeout_s: float) -> None:
        self.pool = pool
        self.connection = connection
        self.timeout_s = timeout_s
        self.sent: set[str] = set()  # channels SUBSCRIBEd (and not UNSUBSCRIBEd)
        self.inflight: dict[str, int] = {}  # channel -> replies still to come
        self.heard = time.monotonic()
        self.ping_deadline: float | None = None
        self.failed: Exception | None = None

    def fileno(self) -> int:
        # redis-py has no public accessor for the socket; the selector needs it.
        return int(self.connection._sock.fileno())

    def subscribe(self, channels: Sequence[str]) -> Iterable[str]:
        self._send("SUBSCRIBE", channels)
        return ()  # confirmed by the replies

    def unsubscribe(self, channels: Sequence[str]) -> None:
        self._send("UNSUBSCRIBE", channels)

    def _send(self, command: str, channels: Sequence[str]) -> None:
        self.connection.send_command(command, *channels)
        for channel in channels:
            self.inflight[channel] = self.inflight.get(channel, 0) + 1
        if command == "SUBSCRIBE":
            self.sent.update(channels)
        else:
            self.sent.difference_update(channels)

    def receive(self) -> list[Event]:
        if self.failed is not None:
            raise self.failed
        events: list[Event] = []
        try:
            while self.connection.can_read(0):
                try:
                    reply = self.connection.read_response()
                except redis_response_error() as exc:
                    raise Refused(str(exc)) from exc
                self.heard, self.ping_deadline = time.monotonic(), None
                event = self._event(reply)
                if event is not None:
                    events.append(event)
        except Exception as exc:
            if not events:
                raise
            self.failed = exc  # what arrived before it is delivered first
        return events

    def _event(self, reply: Any) -> Event | None:
        if not isinstance(reply, list):
            return None  # PONG, outside subscribed mode
        decode = self.connection.encoder.decode
        kind = decode(reply[0], force=True)
        if kind == "message":
            return Message(decode(reply[1], force=True), decode(reply[2], force=True))
        if kind not in ("subscribe", "unsubscribe"):
            return None  # ["pong", ""]
        channel = decode(reply[1], force=True)
        left = self.inflight.get(channel, 1) - 1
        if left > 0:
            self.inflight[channel] = left
            return None  # a later SUBSCRIBE or UNSUBSCRIBE of it is still on its way
        self.inflight.pop(channel, None)
        if kind == "subscribe" and channel in self.sent:
            return Confirmed(channel)
        return None

    def check(self) -> float:
        now = time.monotonic()
        if self.ping_deadline is not None:
            if now >= self.ping_deadline:
                raise TimeoutError(f"no reply to PING within {self.timeout_s:g} s")
            return self.ping_deadline - now
        if now - self.heard >= HEALTH_CHECK_S:
            self.connection.send_command("PING")
            self.ping_deadline = now + self.timeout_s
            return self.timeout_s
        return self.heard + HEALTH_CHECK_S - now

    def close(self) -> None:
        self.pool.disconnect()


class RedisWakeUps(ChannelWorker):
    """Wake-ups over Redis pub/sub for one :class:`~.backend.RedisBackend` (see the
    module docstring)."""

    def __init__(self, backend: RedisBackend) -> None:
        super().__init__(
            f"redis {backend.alias!r}",
            RedisTransport(backend),
            timeout_s=backend.operation_timeout_ms / 1000,
        )
