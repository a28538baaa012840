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
  on a connection from :meth:`~.client.RedisClients.pubsub_connection_pool`, and
  reads them off the socket itself where it can (:func:`~.client.socket_reader`).
* **Replies in flight**: a channel subscribed, unsubscribed and subscribed again
  before the server answered counts as confirmed only at the last reply.
* **Health**: after :data:`HEALTH_CHECK_S` without a byte from the server the
  subscriber sends ``PING``; no reply within the operation timeout counts as a lost
  connection (a half-open TCP connection would otherwise look idle forever).
* The worker never blocks in a socket read without data, so the socket timeout (the
  operation timeout) only bounds a reply that stopped half-way.

**On a Redis Cluster** the scripts publish with ``SPUBLISH`` (a shard channel: the
lock hash's name, in its slot), which only the node serving that slot (and its
replicas) delivers. :class:`_ClusterSubscriber` keeps one subscriber connection per
primary that serves a subscribed channel, sends ``SSUBSCRIBE`` to the slot's owner
as the backend's cluster client knows it, and shows the worker one file descriptor:
an ``epoll`` (``kqueue``) selector over those connections, readable when any of them
is. A slot that moves away (the server's ``sunsubscribe``, or a ``MOVED`` reply to a
subscription) counts as a lost connection: waiters poll, the worker reconnects, the
slot map is read again, and the channels are subscribed on their new owners.
"""

from __future__ import annotations

import logging
import selectors
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ...keys import generate_lock_id
from ...waiting.channels import (
    ChannelWorker,
    Confirmed,
    Event,
    GrantCheck,
    Message,
    Refused,
    process_message,
)
from ...waiting.tickets import Grant
from . import slots
from .client import pooled_connection, redirect_errors, redis_response_error, socket_reader

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
    let_waiters_read = True  # its receive() never blocks
    logger = logger

    def __init__(self, backend: RedisBackend) -> None:
        self._lock_key = backend.lock_key
        self._prefix = backend.prefix
        #: This process's own channel, for the grants made to its waiters (see
        #: ``scripts.grant``): a grant wakes only the process it is for. None on a
        #: cluster (a script can only publish in its slot: grants go on the key's
        #: shard channel there).
        self.process_channel: str | None = None
        self._timeout_s = backend.operation_timeout_ms / 1000
        self._new_pool = backend.clients.pubsub_connection_pool
        self._clients = backend.clients
        self._cluster = backend.cluster
        self._connections = 0
        self.new_process_channel()

    def new_process_channel(self) -> None:
        """A channel of this process's own (again in a forked child). ``P#``: no
        lock hash (a key's channel) is named like it."""
        if not self._cluster:
            self.process_channel = f"{self._prefix}#w:{generate_lock_id()}"

    @property
    def idle_cap(self) -> int:
        return MAX_IDLE_CHANNELS

    def channel(self, key: str) -> str:
        return self._lock_key(key)

    def connect(self, poke: Callable[[], None]) -> _Subscriber | _ClusterSubscriber:
        self._connections += 1
        if self._cluster:
            cluster: Any = self._clients.sync()
            if self._connections > 1:
                # A reconnect: the slot map may be what broke the last connection (a
                # slot moved, a primary failed over); read it again first.
                cluster.nodes_manager.initialize()
            return _ClusterSubscriber(self._clients, cluster, self._timeout_s)
        pool = self._new_pool()
        try:
            # Connects: AUTH, SELECT, within the backend's timeouts.
            subscriber = _Subscriber(pool, pooled_connection(pool, "SUBSCRIBE"), self._timeout_s)
            if self.process_channel is not None:
                # First on the connection: confirmed before any key's channel, so
                # before any ticket that names it is queued.
                subscriber.listen_own(self.process_channel)
            return subscriber
        except BaseException:
            pool.disconnect()
            raise


def _own_message(payload: str) -> Message | None:
    """A message on the process's channel, for the key whose lock hash ends it (see
    :func:`~django_syncguard.waiting.channels.process_message`)."""
    message = process_message(payload)
    if message is None:
        logger.debug("Ignored a malformed message on the process channel: %r", payload[:200])
    return message


class SlotMoved(ConnectionError):
    """A subscribed shard channel's slot is served elsewhere now: what was published
    there meanwhile is not heard here, as after a lost connection."""


class _Subscriber:
    """One subscriber connection (a :class:`~django_syncguard.waiting.channels.Connection`);
    with ``shard``, of shard channels (``SSUBSCRIBE``) on one node of a cluster."""

    def __init__(self, pool: Any, connection: Any, timeout_s: float, shard: bool = False) -> None:
        self.pool = pool
        self.connection = connection
        self.timeout_s = timeout_s
        self.prefix = "s" if shard else ""
        self.sent: set[str] = set()  # channels SUBSCRIBEd (and not UNSUBSCRIBEd)
        self.inflight: dict[str, int] = {}  # channel -> replies still to come
        self.heard = time.monotonic()
        self.ping_deadline: float | None = None
        self.failed: Exception | None = None
        self.own_channel: str | None = None  # the process's channel (grants), if any
        self._own_raw: bytes | None = None  # the same, as the server sends it
        # Replies read off the socket directly where it can be (see socket_reader);
        # else through redis-py's connection.
        self._socket = socket_reader(connection)

    def fileno(self) -> int:
        # redis-py has no public accessor for the socket; the selector needs it.
        return int(self.connection._sock.fileno())

    def subscribe(self, channels: Sequence[str]) -> Iterable[str]:
        self._send("subscribe", channels)
        return ()  # confirmed by the replies

    def unsubscribe(self, channels: Sequence[str]) -> None:
        self._send("unsubscribe", channels)

    def _send(self, command: str, channels: Sequence[str]) -> None:
        self.connection.send_command((self.prefix + command).upper(), *channels)
        for channel in channels:
            self.inflight[channel] = self.inflight.get(channel, 0) + 1
        if command == "subscribe":
            self.sent.update(channels)
        else:
            self.sent.difference_update(channels)

    def receive(self) -> list[Event]:
        if self.failed is not None:
            raise self.failed
        events: list[Event] = []
        try:
            try:
                for reply in self._replies():
                    self.heard, self.ping_deadline = time.monotonic(), None
                    event = self._event(reply)
                    if event is not None:
                        events.append(event)
            except redirect_errors() as exc:
                raise SlotMoved(f"a subscription went to a node that moved: {exc}") from exc
            except redis_response_error() as exc:
                raise Refused(str(exc)) from exc
        except Exception as exc:
            if not events:
                raise
            self.failed = exc  # what arrived before it is delivered first
        return events

    def _replies(self) -> Iterator[Any]:
        """The replies that have arrived, without waiting for more."""
        if self._socket is not None:
            return self._socket.replies()
        return self._redis_py_replies()

    def _redis_py_replies(self) -> Iterator[Any]:
        while self.connection.can_read(0):
            yield self.connection.read_response()

    def listen_own(self, channel: str) -> None:
        """Subscribe the process's own channel (grants), first on the connection."""
        self.own_channel = channel
        self._own_raw = self.connection.encoder.encode(channel)
        self.subscribe([channel])

    def _event(self, reply: Any) -> Event | None:
        if not isinstance(reply, list):
            return None  # PONG, outside subscribed mode
        raw_channel = reply[1] if len(reply) == 3 else None
        if type(raw_channel) is bytes and raw_channel == self._own_raw and reply[0] == b"message":
            # A grant to this process: the hand-off's path, so the payload alone is
            # decoded, as the encoder would (its layers cost the grantee ~20 µs on a
            # thread that slept through the hold). Replies as str (redis-py's own
            # reads with decode_responses) take the general path below.
            encoder = self.connection.encoder
            return _own_message(reply[2].decode(encoder.encoding, encoder.encoding_errors))
        decode = self.connection.encoder.decode
        kind = decode(reply[0], force=True)
        if kind == self.prefix + "message":
            channel = decode(reply[1], force=True)
            payload = decode(reply[2], force=True)
            if channel == self.own_channel:
                return _own_message(payload)
            # '<ticket id>', or a grant: '<ticket id> <lock id> <fence> <expires>'.
            ticket, *grant = payload.split(" ")
            return Message(channel, ticket, Grant.parse(grant) if grant else None)
        if kind not in (self.prefix + "subscribe", self.prefix + "unsubscribe"):
            return None  # ["pong", ""]
        kind = kind[len(self.prefix) :]
        channel = decode(reply[1], force=True)
        if kind == "unsubscribe" and channel not in self.inflight and channel in self.sent:
            # Not asked for: the server dropped it (a shard channel whose slot moved).
            raise SlotMoved(f"the server unsubscribed {channel!r}")
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


class _ClusterSubscriber:
    """The shard channels of a cluster: one :class:`_Subscriber` per primary that
    serves a subscribed channel, behind one selector (see the module docstring)."""

    def __init__(self, clients: Any, cluster: Any, timeout_s: float) -> None:
        self.clients = clients
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.nodes: dict[str, _Subscriber] = {}  # node name -> its connection
        self.where: dict[str, str] = {}  # channel -> node it was subscribed on
        self.selector = selectors.DefaultSelector()
        self.failed: Exception | None = None

    def fileno(self) -> int:
        # An epoll (kqueue) descriptor is readable while one of its sockets is.
        return int(self.selector.fileno())

    def _node(self, channel: str) -> str:
        """The name of the primary serving ``channel``'s slot, connected to."""
        node = self.cluster.nodes_manager.get_node_from_slot(slots.key_slot(channel))
        subscriber = self.nodes.get(node.name)
        if subscriber is None:
            pool = self.clients.node_pubsub_pool(node.host, node.port)
            try:
                subscriber = _Subscriber(
                    pool, pooled_connection(pool, "SSUBSCRIBE"), self.timeout_s, shard=True
                )
                self.selector.register(subscriber.fileno(), selectors.EVENT_READ)
            except BaseException:
                pool.disconnect()
                raise
            self.nodes[node.name] = subscriber
        return str(node.name)

    def subscribe(self, channels: Sequence[str]) -> Iterable[str]:
        for channel in channels:
            name = self.where[channel] = self._node(channel)
            # One command per channel: SSUBSCRIBE takes channels of one slot only.
            self.nodes[name].subscribe([channel])
        return ()

    def unsubscribe(self, channels: Sequence[str]) -> None:
        for channel in channels:
            name = self.where.pop(channel, None)
            if name is not None:
                self.nodes[name].unsubscribe([channel])

    def receive(self) -> list[Event]:
        if self.failed is not None:
            raise self.failed
        events: list[Event] = []
        for subscriber in list(self.nodes.values()):
            try:
                events.extend(subscriber.receive())
            except Exception as exc:
                if not events:
                    raise
                self.failed = exc  # what arrived before it is delivered first
                break
        return events

    def check(self) -> float:
        return min((s.check() for s in self.nodes.values()), default=HEALTH_CHECK_S)

    def close(self) -> None:
        self.selector.close()
        for subscriber in self.nodes.values():
            subscriber.close()


class RedisWakeUps(ChannelWorker):
    """Wake-ups over Redis pub/sub for one :class:`~.backend.RedisBackend` (see the
    module docstring)."""

    def __init__(self, backend: RedisBackend) -> None:
        self._redis_transport = RedisTransport(backend)
        super().__init__(
            f"redis {backend.alias!r}",
            self._redis_transport,
            timeout_s=backend.operation_timeout_ms / 1000,
        )
        self._backend = backend

    @property
    def process_channel(self) -> str | None:
        """Where grants for this process's waiters are published (None on a cluster)."""
        return self._redis_transport.process_channel

    def _reset_after_fork(self) -> None:
        super()._reset_after_fork()
        self._redis_transport.new_process_channel()  # the parent's is the parent's

    def claim(self, key: str, grant: Grant) -> None:
        self._backend.granted(key, grant)
        super().claim(key, grant)

    def _check_grant_on_server(self, channel: str, ticket_id: str) -> GrantCheck:
        return self._backend.check_grant(channel, ticket_id)  # the channel is the lock hash

    def _claim_on_server(self, key: str, grant: Grant) -> None:
        """A claim that finds the lock gone means the grant lapsed (this process was
        too slow for the grant window) or the hold ended without a release we saw;
        a lapsed lock's release then reports it expired."""
        if not self._backend.claim(grant):
            logger.debug("A granted lock was gone when claimed (lapsed, or released).")
