"""The Redis backend's client layer: the one place that builds connections.

:class:`RedisClients` turns an alias's settings (``LOCATION`` and the client
``OPTIONS``) into redis-py clients: the synchronous client and its pool, one asyncio
client per event loop (redis.asyncio binds a connection to its loop), and the
connection pool of the wake-ups' dedicated pub/sub connection. It registers the Lua
scripts on each client, and :func:`map_redis_error` turns redis-py's exceptions
into ``LockError``. Nothing else in the package imports redis-py (:func:`_redis`
imports it lazily, so the package imports without the extra): a new way to reach
the server (Sentinel, Cluster) is code in this module only.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import socket
import ssl
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

from django.core.exceptions import ImproperlyConfigured

from ...errors import (
    AuthFailed,
    Internal,
    InvalidArgument,
    LockError,
    NetworkTimeout,
    ServiceUnavailable,
)
from ...lifecycle import abandon
from ..base import mapping_option, positive_int_option
from ..event_loops import close_on_loop
from ..sockets import KeptPoll, peer_ended

if TYPE_CHECKING:
    import redis

#: The ``OPTIONS`` this module reads (the backend adds them to its known options).
CLIENT_OPTIONS = frozenset(
    {"MAX_CONNECTIONS", "CLIENT_KWARGS", "SENTINELS", "SENTINEL_KWARGS", "CLUSTER"}
)
DEFAULT_MAX_CONNECTIONS = 50

# Server replies that mean "not now" rather than "wrong".
_UNAVAILABLE_REPLIES = (
    "BUSY",
    "LOADING",
    "MASTERDOWN",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "OOM",
    "READONLY",
    # WAIT on a server that is a replica now: a primary demoted by a failover, reached
    # by a script that wrote nothing (so no READONLY dropped the connection first).
    "WAIT CANNOT BE USED WITH REPLICA",
    "NOREPLICAS",
    "MISCONF",
    # Leftover redirections (redis-py follows them; one that still arrives means the
    # cluster's layout changed under the call).
    "MOVED",
    "ASK",
)
_AUTH_REPLIES = (
    "NOAUTH",
    "WRONGPASS",
    "NOPERM",
    # A server that wants a password refuses a longer request than a few arguments
    # before it has one (a script's EVALSHA; redis-py before 8 sends no HELLO first,
    # which would have been told NOAUTH).
    "PROTOCOL ERROR: UNAUTHENTICATED",
)


def _redis() -> Any:
    """redis-py, imported on first use (the ``redis`` extra)."""
    try:
        import redis
    except ImportError as exc:
        raise ImproperlyConfigured(
            'The Redis lock backend needs redis-py: pip install "django-syncguard[redis]".'
        ) from exc
    return redis


def redis_error() -> tuple[type[Exception], ...]:
    """The classes of redis-py's exceptions (what :func:`map_redis_error` maps): its
    base class, and the cluster client's own base, which is not a ``RedisError``."""
    errors = _redis().exceptions
    return (errors.RedisError, errors.RedisClusterException)


def redis_response_error() -> type[Exception]:
    """redis-py's class of error replies (the wake-ups' reader tells them apart)."""
    error: type[Exception] = _redis().exceptions.ResponseError
    return error


def redirect_errors() -> tuple[type[Exception], ...]:
    """The replies that say a command did not run on this node and may go to the
    slot's owner (``MOVED``, ``ASK``, ``TRYAGAIN``): a reply of a pipeline sent to one
    node is sent again through the cluster client, which follows them."""
    errors = _redis().exceptions
    return (errors.AskError, errors.TryAgainError)


def no_script_error() -> type[Exception]:
    """redis-py's ``NOSCRIPT`` reply: the script is not loaded on that server."""
    error: type[Exception] = _redis().exceptions.NoScriptError
    return error


def redis_lost_reply_errors() -> tuple[tuple[type[Exception], ...], tuple[type[Exception], ...]]:
    """redis-py's errors of a reply that did not come (a timeout, a dropped
    connection), and those of its subclasses raised before anything was sent (a full
    pool, a refused login, a server still loading, no primary known to Sentinel)."""
    redis = _redis()
    errors = redis.exceptions
    from redis.sentinel import MasterNotFoundError

    never_sent: tuple[type[Exception], ...] = (
        errors.AuthenticationError,
        errors.BusyLoadingError,
        MasterNotFoundError,
    )
    if hasattr(errors, "MaxConnectionsError"):  # redis-py 5.1+
        never_sent += (errors.MaxConnectionsError,)
    return (errors.TimeoutError, errors.ConnectionError), never_sent


@functools.cache
def _pool_wants_the_command_name() -> bool:
    """Whether redis-py's ``ConnectionPool.get_connection`` requires the command's name
    (before 5.3, which ignores it) rather than warn when given one (5.3 and later)."""
    parameter = inspect.signature(_redis().ConnectionPool.get_connection).parameters.get(
        "command_name"
    )
    return parameter is not None and parameter.default is inspect.Parameter.empty


def pooled_connection(pool: Any, command_name: str) -> Any:
    """``pool.get_connection()`` (awaitable for an asyncio pool), with the command's
    name where redis-py before 5.3 requires it."""
    if _pool_wants_the_command_name():
        return pool.get_connection(command_name)
    return pool.get_connection()


def direct_command(client: Any, *command: Any) -> Any:
    """``client.execute_command(*command)`` for a plain (not cluster) client, without
    redis-py's layers per command: a connection from the pool, the command sent, its
    reply read, the connection given back.

    What those layers add is not used here: the alias allows no retry (so the single
    attempt needs no retry loop), no script reply has a response callback, and
    redis-py's own per-command metrics are not recorded for these calls. They cost
    about 16 µs a command on a 2-vCPU VM, as much as a lock script runs on the server
    (``specs/backends/redis.md``, Client path). A connection whose reply did not come
    (a timeout, a drop, an interrupt) is closed by redis-py's connection itself before
    it goes back, so its next user cannot read the late reply as its own. A client
    that keeps one connection (``single_connection_client``) takes the usual path."""
    if client.connection is not None:
        return client.execute_command(*command)
    pool = client.connection_pool
    connection = pooled_connection(pool, command[0])
    try:
        connection.send_command(*command)
        return connection.read_response()
    finally:
        pool.release(connection)


class ThreadConnections:
    """Each thread's own connection of a plain server's synchronous pool, kept between
    that thread's script calls (``specs/backends/redis.md``, Client path; decision 54).

    :func:`direct_command` takes a connection from the pool and gives it back around
    every call; with redis-py 8 that costs about as much as the script runs on the
    server (its locks, a readiness poll of the socket, its metrics). A thread that
    holds its connection skips both. At most half the pool's ``max_connections``
    (rounded down) are held at once; a thread past that takes the pooled path, so
    threads that are alive but idle never exhaust the pool for the others.

    What the pool's hand-out would check is kept: a connection whose reply did not
    come (a timeout, a drop, an interrupt) is closed by redis-py's connection itself,
    or, interrupted between its request and its reply, before its next call; one the
    server ended before a call (a restart) or that redis-py marked for reconnection is
    closed, and opened again by that call (a RESP3 push waiting on it is left to the
    call's read, as the pool leaves it). A thread that
    ends gives its connection back to the pool (when the thread's local storage
    goes). In a forked child nothing inherited is used or given back: the backend's
    fork reset replaces this object, a process other than the one that built it (a
    fork that ran no hooks) takes the pooled path, and a holder finalized in another
    process than the one that took its connection does nothing."""

    def __init__(self, pool: Any, limit: int) -> None:
        self._pool = pool
        self.limit = limit
        self._pid = os.getpid()
        self._local = threading.local()
        self._holders: weakref.WeakSet[_Held] = weakref.WeakSet()
        self._lock = threading.Lock()

    def command(self, client: Any, *command: Any) -> Any:
        """``direct_command(client, *command)`` on the calling thread's connection."""
        held: _Held | None = getattr(self._local, "held", None)
        if held is None or os.getpid() != self._pid:  # (a fork that ran no hooks)
            held = self._hold()
            if held is None:
                return direct_command(client, *command)
        connection = held.connection
        if (
            held.busy
            or _stale(connection, held.poll)
            or (held.should_reconnect is not None and held.should_reconnect())
        ):
            connection.disconnect()  # the send below connects again
        packed = None if held.pack is None else _packed(held.pack, command)
        held.busy = True  # until the reply is read: an interrupt between leaves it set
        if packed is None:
            connection.send_command(*command)
        else:
            connection.send_packed_command(packed)
        try:
            reply = connection.read_response()
        except Exception:
            held.busy = False  # an error reply, read whole; or the connection closed itself
            raise
        held.busy = False
        return reply

    def _hold(self) -> _Held | None:
        """The calling thread's new held connection; None (the pooled path) past the
        limit, or in a process this object was not built in."""
        if len(self._holders) >= self.limit or os.getpid() != self._pid:
            return None
        held = _Held()
        with self._lock:  # a place first, the connection outside the lock
            if len(self._holders) >= self.limit:
                return None
            self._holders.add(held)
        try:
            connection = pooled_connection(self._pool, "EVALSHA")
        except BaseException:
            self._holders.discard(held)  # its place, at once (a traceback may keep it)
            raise
        finalizer = None
        try:
            held.connection = connection
            held.should_reconnect = getattr(connection, "should_reconnect", None)
            held.pack = _hiredis_packer(connection)
            finalizer = weakref.finalize(held, _give_back, self._pool, connection, self._pid)
            finalizer.atexit = False  # type: ignore[misc]  # none at exit: the process ends
            self._local.held = held
        except BaseException:  # an interrupt here: the connection goes back, once
            if finalizer is None:
                self._pool.release(connection)
            else:
                finalizer()
            raise
        return held

    @property
    def held(self) -> int:
        """How many threads hold a connection now."""
        return len(self._holders)


class _Held:
    """A thread's held connection (what the thread's local storage keeps alive)."""

    __slots__ = ("__weakref__", "busy", "connection", "pack", "poll", "should_reconnect")

    def __init__(self) -> None:
        self.connection: Any = None
        self.should_reconnect: Any = None
        self.pack: Any = None  # see _hiredis_packer
        self.poll = KeptPoll()  # for _stale
        self.busy = False


def _hiredis_packer(connection: Any) -> Any:
    """``hiredis.pack_command`` when ``connection`` packs commands with it anyway
    (redis-py's ``HiredisRespSerializer``, chosen when hiredis is installed) and its
    class sends commands as redis-py's does (a ``connection_class`` that overrides
    ``send_command`` keeps it), else None. redis-py's own ``pack`` first splits a
    command name that holds a space and copies every argument through a generator
    (turning a ``bytearray`` or ``memoryview`` into ``bytes``); our commands need
    neither (their names are separate arguments: ``"SCRIPT", "LOAD"``), and on a
    thread that slept through a hold that wrapper cost about 55 µs of the release's
    way to the socket (issue 24)."""
    redis = _redis()
    base = getattr(redis.connection, "AbstractConnection", redis.connection.Connection)
    if type(connection).send_command is not base.send_command:
        return None
    packer = getattr(connection, "_command_packer", None)
    if type(packer).__name__ != "HiredisRespSerializer":
        return None
    import hiredis

    return getattr(hiredis, "pack_command", None)


def _packed(pack: Any, command: tuple[Any, ...]) -> list[bytes] | None:
    """``command`` packed by ``pack``; None for an argument hiredis refuses, which
    redis-py's own path then reports as it does (``DataError``)."""
    try:
        return [pack(command)]
    except TypeError:
        return None


#: What a Redis server's socket shows when the server ended the connection: the end
#: of the stream, or a TLS alert record (0x15: close_notify). Anything else (a RESP3
#: push, such as redis-py 8's maintenance notifications) is left to the next read,
#: as redis-py's pool leaves it.
_GONE_MARKS = (b"", b"\x15")


def _stale(connection: Any, kept: KeptPoll) -> bool:
    """Whether the server ended ``connection`` between two calls (a restart, ``CLIENT
    KILL``, an idle timeout): what the pool's ``can_read`` finds before it hands a
    connection out."""
    sock = getattr(connection, "_sock", None)
    return sock is not None and peer_ended(sock, _GONE_MARKS, kept)


def _streaming(provider: Any) -> bool:
    """Whether ``provider`` renews credentials while connections stay open (redis-py
    5.3+: Entra ID and the like): redis-py re-authenticates a connection when it goes
    back to the pool, which a held connection never does."""
    streaming = getattr(_redis().credentials, "StreamingCredentialProvider", None)
    return streaming is not None and isinstance(provider, streaming)


def _give_back(pool: Any, connection: Any, pid: int) -> None:
    """A held connection's thread ended: the connection goes back to the pool, only in
    the process that took it (a forked child forgets what it inherited)."""
    if os.getpid() == pid:
        pool.release(connection)


#: The most a :class:`SocketReader` reads at once.
_READ_SIZE = 65536


class SocketReader:
    """The replies waiting on a pub/sub connection, read from its socket by a hiredis
    reader without blocking (see :func:`socket_reader`)."""

    def __init__(self, sock: socket.socket, reader: Any) -> None:
        self._sock = sock
        self._fd = sock.fileno()
        self._reader = reader

    def replies(self) -> Iterator[Any]:
        """Each complete reply already received, in order; an error reply is raised
        (as redis-py's exception for it); a closed connection raises ConnectionError."""
        if self._sock.fileno() != self._fd:
            # Closed (by redis-py, when a send failed): its number may name another
            # socket by now, which must not be read.
            raise _redis().ConnectionError("The subscriber's connection is closed.")
        reader, more = self._reader, True
        while True:
            reply = reader.gets()
            if reply is False:
                if not more:
                    # The last read did not fill the buffer: the socket was empty then,
                    # and whatever came since makes the selector ready again. (One read
                    # fewer per wake-up: it would only end in BlockingIOError.)
                    return
                try:
                    data = os.read(self._fd, _READ_SIZE)
                except BlockingIOError:
                    return
                if not data:
                    raise _redis().ConnectionError("The Redis server closed the connection.")
                reader.feed(data)
                more = len(data) == _READ_SIZE
                continue
            if isinstance(reply, Exception):
                raise reply
            yield reply


def socket_reader(connection: Any) -> SocketReader | None:
    """A :class:`SocketReader` over ``connection``'s socket, or None where redis-py's
    own reads must do (``connection.can_read(0)``, ``read_response()``): without
    hiredis, over TLS, on a blocking socket (no operation timeout) or on Windows.

    Why: a subscriber reads after every wake-up, and redis-py's non-blocking read
    turns the socket's timeout off and on again around a ``recv`` that ends in an
    exception when nothing more came, twice a message. On a wake-up, after the
    process sat idle through a hold, that path cost the hand-off about 0.1 ms
    (``specs/backends/redis.md``, Client path). Socket errors surface as ``OSError``:
    the subscriber's connection counts as lost, as with redis-py's reads."""
    try:
        import hiredis
    except ImportError:
        return None
    sock = getattr(connection, "_sock", None)
    if sock is None or os.name == "nt" or isinstance(sock, ssl.SSLSocket):
        return None
    if sock.gettimeout() is None:
        return None  # a blocking descriptor: a read without data would wait
    reader = hiredis.Reader(
        protocolError=_redis().exceptions.InvalidResponse,
        replyError=connection._parser.parse_error,  # redis-py's exception per reply
    )
    return SocketReader(sock, reader)


async def adirect_command(client: Any, *command: Any) -> Any:
    """:func:`direct_command` for a ``redis.asyncio`` client (a cancelled call's
    connection is closed by redis-py's connection, as a timed-out one is)."""
    if client.single_connection_client:
        return await client.execute_command(*command)
    pool = client.connection_pool
    connection = await pooled_connection(pool, command[0])
    try:
        await connection.send_command(*command)
        return await connection.read_response()
    finally:
        await pool.release(connection)


def map_redis_error(exc: BaseException, alias: str) -> LockError:
    """The ``LockError`` for a redis-py exception."""
    redis = _redis()
    errors = redis.exceptions
    message = f"Redis ({alias!r}): {exc}"
    text = str(exc).upper()
    error_cls: type[LockError]
    # redis-py strips the reply's code when it maps it to a class of its own: NOPERM
    # arrives as NoPermissionError whose text no longer starts with "NOPERM".
    denied = errors.AuthenticationError | errors.AuthorizationError | errors.NoPermissionError
    if isinstance(exc, denied) or (
        isinstance(exc, errors.ResponseError) and text.startswith(_AUTH_REPLIES)
    ):
        error_cls = AuthFailed
    elif isinstance(exc, errors.TimeoutError):
        error_cls = NetworkTimeout
    elif isinstance(exc, (errors.ConnectionError, *_cluster_unavailable(errors))) or (
        isinstance(exc, errors.ResponseError) and text.startswith(_UNAVAILABLE_REPLIES)
    ):
        error_cls = ServiceUnavailable
    else:
        error_cls = Internal
    return error_cls(message, context={"cause": exc})


def _cluster_unavailable(errors: Any) -> tuple[type[Exception], ...]:
    """redis-py's cluster exceptions that mean "the cluster cannot serve this now":
    redis-py strips the reply's code from some (MOVED, ASK, TRYAGAIN, CLUSTERDOWN
    arrive as classes whose text lacks it), and raises others of its own (no node
    for a slot, a layout it could not load: ``RedisClusterException``). A cross-slot
    reply is this package's bug, not the cluster's state: it stays ``Internal``."""
    return (
        errors.AskError,  # MovedError too
        errors.TryAgainError,
        errors.ClusterError,  # ClusterDownError, MasterDownError
        errors.SlotNotCoveredError,
        errors.RedisClusterException,
    )


class RedisClients:
    """The clients of one backend object, built from its alias's settings.

    ``scripts`` (name -> Lua) are registered on every client built here: :meth:`scripts`
    for the synchronous client, :meth:`for_loop` for the running loop's.
    """

    def __init__(
        self,
        alias: str,
        location: str,
        options: Mapping[str, Any],
        *,
        connect_timeout_ms: int,
        operation_timeout_ms: int,
        scripts: Mapping[str, str],
    ) -> None:
        self.alias = alias
        self.location = location
        self.operation_timeout_s = operation_timeout_ms / 1000
        self._lua = dict(scripts)
        redis_py = _redis()
        max_connections = positive_int_option(options, "MAX_CONNECTIONS", DEFAULT_MAX_CONNECTIONS)
        self._kwargs: dict[str, Any] = {
            "socket_connect_timeout": connect_timeout_ms / 1000,
            "socket_timeout": self.operation_timeout_s,
            # One attempt per call (specs/contract.md, Operations): a silently retried
            # acquire whose reply was lost would find its own lock and report contention.
            "retry": redis_py.retry.Retry(redis_py.backoff.NoBackoff(), 0),
            "retry_on_error": [],
            "max_connections": max_connections,
            **mapping_option(options, "CLIENT_KWARGS"),
        }
        self.cluster = ClusterSettings.parse(location, options)
        self.sentinel = SentinelSettings.parse(location, options, self._kwargs)
        self._sync: Any = None
        self._scripts: dict[str, Any] = {}
        self._building = threading.Lock()
        if self.cluster is None:  # a cluster client connects as it is built: on first use
            try:
                if self.sentinel is None:
                    self._sync = redis_py.Redis.from_url(location, **self._kwargs)
                else:
                    self._sync = self.sentinel.master(redis_py.sentinel, self._kwargs)
            except ValueError as exc:
                raise InvalidArgument(f"LOCATION {location!r} is not a redis URL: {exc}") from exc
            self._register()
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Any]] = (
            weakref.WeakKeyDictionary()
        )
        self.threads = self._thread_connections()

    def _thread_connections(self) -> ThreadConnections | None:
        """Per-thread connections, for a plain server's client with a pool of its own
        (not Sentinel, whose pool follows failovers connection by connection; not a
        cluster; not ``single_connection_client``; not redis-py's client-side cache
        or a streaming credential provider, which need the pool's hand-outs)."""
        client = self._sync
        if self.topology != "server" or client is None or client.connection is not None:
            return None
        pool = client.connection_pool
        kwargs = getattr(pool, "connection_kwargs", {})
        if getattr(pool, "cache", None) is not None or _streaming(
            kwargs.get("credential_provider")
        ):
            return None
        limit = int(pool.max_connections) // 2  # what the pool allows (a URL may say)
        return ThreadConnections(pool, limit) if limit else None

    def send(self, client: Any, *command: Any) -> Any:
        """``client.execute_command(*command)`` for the synchronous plain client,
        without redis-py's layers per command: on the thread's own connection where
        there is one (:class:`ThreadConnections`), else :func:`direct_command`."""
        if self.threads is not None and client is self._sync:
            return self.threads.command(client, *command)
        return direct_command(client, *command)

    def reset_after_fork(self) -> None:
        """In a forked child (the backend's reset calls it): a new build lock, since a
        parent thread may have held this one at the fork, and new per-thread
        connections (the forking thread's inherited one is forgotten, never used)."""
        self._building = threading.Lock()
        if self.threads is not None:
            abandon(self.threads)
            self.threads = self._thread_connections()

    @property
    def topology(self) -> str:
        """``"server"`` (one server at ``LOCATION``), ``"sentinel"`` or ``"cluster"``."""
        if self.cluster is not None:
            return "cluster"
        return "server" if self.sentinel is None else "sentinel"

    def _register(self) -> None:
        self._scripts.update(
            {name: self._sync.register_script(lua) for name, lua in self._lua.items()}
        )

    def sync(self) -> redis.Redis:
        """The synchronous client (thread-safe: its pool hands each call a connection);
        a ``redis.cluster.RedisCluster`` on a cluster, typed as ``Redis`` since the
        backend calls only what both have. The cluster client is built on first use
        (it reads the slot map from the startup node as it is built): a cluster that
        cannot be reached then raises ``ServiceUnavailable``, and the next call tries
        again."""
        if self._sync is None:
            assert self.cluster is not None
            with self._building:
                if self._sync is None:
                    try:
                        client = self.cluster.client(_redis().cluster, self._kwargs)
                    except redis_error() as exc:
                        raise map_redis_error(exc, self.alias) from exc
                    except ValueError as exc:
                        message = f"LOCATION {self.location!r} is not a redis URL: {exc}"
                        raise InvalidArgument(message) from exc
                    self._sync = client
                    self._register()
        return cast("redis.Redis", self._sync)

    def scripts(self) -> dict[str, Any]:
        """The scripts, bound to the synchronous client (the same dict from first to
        last: a cluster's are added when its client is built)."""
        return self._scripts

    def for_loop(self) -> dict[str, Any]:
        """The scripts bound to the running loop's asyncio client (built on first use),
        and that client under ``"_client"``."""
        loop = asyncio.get_running_loop()
        scripts = self._loops.get(loop)
        if scripts is None:
            redis_py = _redis()
            if self.cluster is not None:
                client = self.cluster.client(redis_py.asyncio.cluster, self._kwargs)
            elif self.sentinel is None:
                client = redis_py.asyncio.Redis.from_url(self.location, **self._kwargs)
            else:
                client = self.sentinel.master(redis_py.asyncio.sentinel, self._kwargs)
            scripts = {name: client.register_script(lua) for name, lua in self._lua.items()}
            scripts["_client"] = client
            self._loops[loop] = scripts
        return scripts

    def async_client(self) -> Any:
        """The running loop's ``redis.asyncio.Redis``."""
        return self.for_loop()["_client"]

    def async_node_client(self, host: str, port: int) -> Any:
        """On a cluster, the running loop's plain asyncio client of one node (for a
        pipeline that must stay on one connection of that node: a script and its
        ``WAIT``), with the alias's credentials, TLS and timeouts."""
        scripts = self.for_loop()
        nodes: dict[tuple[str, int], Any] = scripts.setdefault("_nodes", {})
        client = nodes.get((host, port))
        if client is None:
            redis_py = _redis()
            url = redis_py.connection.parse_url(self.location)
            if url.pop("connection_class", None) is not None:  # rediss://
                url["ssl"] = True
            url.update(host=host, port=port)
            client = redis_py.asyncio.Redis(**{**self._kwargs, **url})
            nodes[(host, port)] = client
        return client

    def pubsub_connection_pool(self) -> Any:
        """A new pool of one connection, outside the backend's pool, for the wake-ups'
        subscriber: RESP2 (its reader parses pub/sub replies as plain arrays), and no
        health check of redis-py's (the reader pings after silence itself; redis-py
        would ping before commands only)."""
        kwargs = dict(self._kwargs)
        kwargs.pop("single_connection_client", None)  # a Redis() argument, not a pool's
        kwargs.update(max_connections=1, protocol=2, health_check_interval=0)
        if self.sentinel is not None:
            return self.sentinel.pool(_redis().sentinel, kwargs)
        return _redis().ConnectionPool.from_url(self.location, **kwargs)

    def node_pubsub_pool(self, host: str, port: int) -> Any:
        """On a cluster, a new pool of one pub/sub connection to the node at
        ``host:port`` (as :meth:`pubsub_connection_pool`: RESP2, no health check of
        redis-py's), with the alias's credentials, TLS and timeouts."""
        redis_py = _redis()
        kwargs = dict(self._kwargs)
        kwargs.pop("single_connection_client", None)
        url = redis_py.connection.parse_url(self.location)
        kwargs.update(url)
        kwargs.update(host=host, port=port, max_connections=1, protocol=2)
        kwargs.update(health_check_interval=0)
        return redis_py.ConnectionPool(**kwargs)

    def close(self) -> None:
        """Close the synchronous client and every loop's asyncio client, each on its loop."""
        if self._sync is not None:
            self._sync.close()
        loops, self._loops = self._loops, weakref.WeakKeyDictionary()
        for loop, scripts in list(loops.items()):
            for client in [scripts["_client"], *scripts.get("_nodes", {}).values()]:
                close_on_loop(loop, client.aclose, self.operation_timeout_s)

    async def aclose(self) -> None:
        """Close the running loop's asyncio client (the others stay)."""
        scripts = self._loops.pop(asyncio.get_running_loop(), None)
        if scripts is not None:
            for client in [scripts["_client"], *scripts.get("_nodes", {}).values()]:
                await client.aclose()


class SentinelSettings:
    """How an alias reaches its primary through Redis Sentinel: ``LOCATION``
    ``redis://[user:password@]<service>/<db>`` (``rediss://`` for TLS to the data
    nodes) with ``OPTIONS["SENTINELS"]`` listing ``(host, port)`` pairs, and
    ``OPTIONS["SENTINEL_KWARGS"]`` for the connections to the sentinels themselves
    (their password, TLS...).

    Every connection asks a sentinel for the current primary when it connects, and a
    connection to a primary demoted since is dropped at its first ``READONLY`` reply
    (redis-py's ``SentinelManagedConnection``): after a failover, the next operation
    reaches the new primary; the ones in flight fail as ``ServiceUnavailable``."""

    def __init__(
        self, service: str, sentinels: list[tuple[str, int]], sentinel_kwargs: dict[str, Any]
    ) -> None:
        self.service = service
        self.sentinels = sentinels
        self.sentinel_kwargs = sentinel_kwargs
        self._managers: dict[Any, Any] = {}

    @classmethod
    def parse(
        cls, location: str, options: Mapping[str, Any], kwargs: dict[str, Any]
    ) -> SentinelSettings | None:
        """The settings of a Sentinel alias (``None`` without ``SENTINELS``); moves the
        URL's database, credentials and TLS into ``kwargs``, the data nodes' options."""
        if "SENTINELS" not in options:
            if "SENTINEL_KWARGS" in options:
                raise InvalidArgument("OPTIONS['SENTINEL_KWARGS'] needs OPTIONS['SENTINELS'].")
            return None
        sentinels = _sentinel_addresses(options["SENTINELS"])
        try:
            url = _redis().connection.parse_url(location)
        except ValueError as exc:
            raise InvalidArgument(f"LOCATION {location!r} is not a redis URL: {exc}") from exc
        service = url.pop("host", None)
        if not service or location.startswith("unix://"):
            raise InvalidArgument(
                f"LOCATION {location!r}: with SENTINELS, LOCATION is "
                "'redis://<service name>/<db>' (the name the sentinels monitor)."
            )
        url.pop("port", None)
        if url.pop("connection_class", None) is not None:  # rediss://
            url["ssl"] = True
        kwargs.update(url)
        # The sentinels get the same timeouts and the same single attempt as the data
        # nodes: a sentinel that does not answer must not stall an operation.
        sentinel_kwargs = {
            key: kwargs[key]
            for key in ("socket_connect_timeout", "socket_timeout", "retry", "retry_on_error")
        }
        sentinel_kwargs.update(mapping_option(options, "SENTINEL_KWARGS"))
        return cls(service, sentinels, sentinel_kwargs)

    def _manager(self, module: Any) -> Any:
        """One ``Sentinel`` per redis-py module (sync, asyncio): it holds the clients
        of the sentinels, shared by every pool of this alias."""
        manager = self._managers.get(module)
        if manager is None:
            manager = module.Sentinel(self.sentinels, sentinel_kwargs=self.sentinel_kwargs)
            self._managers[module] = manager
        return manager

    def master(self, module: Any, kwargs: dict[str, Any]) -> Any:
        """A client of the current primary (``module``: ``redis.sentinel`` or
        ``redis.asyncio.sentinel``)."""
        return self._manager(module).master_for(self.service, **kwargs)

    def pool(self, module: Any, kwargs: dict[str, Any]) -> Any:
        """A new connection pool of the current primary."""
        return module.SentinelConnectionPool(self.service, self._manager(module), **kwargs)


def _sentinel_addresses(value: Any) -> list[tuple[str, int]]:
    """``OPTIONS["SENTINELS"]`` as ``(host, port)`` pairs, or ``InvalidArgument``."""
    pairs: list[tuple[str, int]] = []
    if isinstance(value, list | tuple) and value:
        for item in value:
            if not (isinstance(item, list | tuple) and len(item) == 2):
                break
            host, port = item
            if not (isinstance(host, str) and host) or isinstance(port, bool):
                break
            if not (isinstance(port, int) and 0 < port < 65536):
                break
            pairs.append((host, port))
        else:
            return pairs
    raise InvalidArgument(
        f"OPTIONS['SENTINELS'] must be a non-empty list of (host, port) pairs, not {value!r}."
    )


class ClusterSettings:
    """How an alias reaches a Redis Cluster: ``OPTIONS["CLUSTER"] = True`` with
    ``LOCATION`` naming one startup node (``redis://host:port/0``; the cluster has
    database 0 only); the client discovers the others and the slot map from it.

    The clients keep the alias's single attempt per call: ``retry`` allows no retry
    of a command that failed on a connection error or timeout (a retried acquire
    whose reply was lost would find its own lock), while the ``MOVED`` and ``ASK``
    redirections, which say the command did not run, are followed as redis-py does.
    ``MAX_CONNECTIONS`` bounds each node's pool."""

    def __init__(self, location: str) -> None:
        self.location = location

    @classmethod
    def parse(cls, location: str, options: Mapping[str, Any]) -> ClusterSettings | None:
        """The settings of a cluster alias (``None`` unless ``CLUSTER`` is True)."""
        value = options.get("CLUSTER", False)
        if not isinstance(value, bool):
            raise InvalidArgument(f"OPTIONS['CLUSTER'] must be True or False, not {value!r}.")
        if not value:
            return None
        if "SENTINELS" in options:
            raise InvalidArgument(
                "OPTIONS['CLUSTER'] and OPTIONS['SENTINELS'] exclude each other: a cluster "
                "fails over by itself."
            )
        if location.startswith("unix://"):
            raise InvalidArgument(f"LOCATION {location!r}: a cluster is reached over TCP.")
        try:
            url = _redis().connection.parse_url(location)
        except ValueError as exc:
            raise InvalidArgument(f"LOCATION {location!r} is not a redis URL: {exc}") from exc
        if int(url.get("db", 0) or 0) != 0:
            raise InvalidArgument(f"LOCATION {location!r}: a Redis Cluster has database 0 only.")
        return cls(location)

    def client(self, module: Any, kwargs: dict[str, Any]) -> Any:
        """A cluster client (``module``: ``redis.cluster`` or ``redis.asyncio.cluster``)
        with the data nodes' options ``kwargs``."""
        kwargs = dict(kwargs)
        kwargs.pop("single_connection_client", None)
        if module.__name__.startswith("redis.asyncio"):
            # The asyncio client wants its own Retry class.
            redis_py = _redis()
            kwargs["retry"] = redis_py.asyncio.retry.Retry(redis_py.backoff.NoBackoff(), 0)
        return module.RedisCluster.from_url(self.location, **kwargs)
