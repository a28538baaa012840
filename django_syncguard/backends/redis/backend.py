"""The Redis backend: one Lua script per operation, Redis server time, durable fences.

``LOCATION`` is a redis URL (``redis://``, ``rediss://`` for TLS, ``unix://``);
``KEY_PREFIX`` (default ``"syncguard"``, must not be empty) namespaces every key.
``OPTIONS``: the common ones, plus ``MAX_CONNECTIONS`` (pool size, default 50) and
``CLIENT_KWARGS`` (passed to ``redis.Redis.from_url``: ``username``, ``password``,
``ssl_ca_certs``...). Needs ``pip install "django-syncguard[redis]"``.

Key layout (``P`` is the prefix without trailing colons)::

    P:<key>          hash  f = last fence, a = last acquired at (ms) (no TTL; both
                           kept after a release, deleted only by compaction)
                           while held: i = lock id, e = expires at (ms),
                           k = user key (only when <key> had to be hashed)
                           while waiters queue: q = how many, n = last arrival number,
                           w:<ticket id> = "<arrival> <live until ms>" for each
    P#id:<lock id>   string, the full name of the hash above, expiring with the lock
    P#floor          string, the alias's fence floor (absent: 0)

A new fence is ``max(f, floor) + 1``, and in clock mode (``OPTIONS["FENCES"]``,
default ``"clock"`` here) at least the server's clock in ms, all inside the acquire
script (:func:`django_syncguard.fence_floors.next_fence`).

A release wakes the first live waiter with ``PUBLISH P:<key> <ticket id>``: the
channel is the lock hash's own name (channels and keys are separate namespaces);
:mod:`.wakeups` holds the subscriber side.

The package: ``backend.py`` (this module: the operations and the SCAN
housekeeping), ``scripts.py`` (the Lua, one script per operation), ``client.py``
(the only module that builds connections and maps redis-py's errors) and
``wakeups.py`` (the pub/sub subscriber).

On a Redis Cluster (``OPTIONS["CLUSTER"] = True``) the index and the floor carry
the hash tag of the lock hash's slot (``P#id:{T}<lock id>``, one ``P#floor:{T}`` per
slot) and lock ids say that slot (:mod:`.slots`); release, extend and lookup by id
read the index first, then run their script on the index and the hash.

Lock keys all start with ``P:`` and index keys (and the floor) with ``P#``, so no
user key can land on an index entry or the floor; the fence counter lives inside the
key's own hash, so no user key can land on another key's counter either. See
``specs/backends/redis.md``.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

from django.core import checks

from ...cancellation import CancelToken
from ...constants import (
    BACKEND_LIMITS,
    CLEANUP_GUARD_MS,
    MAX_PAGE_SIZE,
    RESERVE_BYTES,
    TIME_TOLERANCE_MS,
)
from ...errors import InvalidArgument, LockError, ServiceUnavailable
from ...fence_floors import FenceMode, IdleCounter
from ...fencing import FENCE_MAX, fence_overflow_error, format_fence
from ...keys import generate_lock_id, make_storage_key
from ...orphans import note_maybe_written, note_sent
from ...owners import QueueStats
from ...results import AcquireResult, ExtendResult, LockPage, LockRecord, ReleaseResult
from ...waiting import Grant, WaitTicket, WakeUps, tickets
from ...waiting.channels import GrantCheck
from ..base import BaseLockBackend, option_ms
from . import slots
from .client import (
    CLIENT_OPTIONS,
    RedisClients,
    adirect_command,
    map_redis_error,
    no_script_error,
    redirect_errors,
    redis_error,
    redis_lost_reply_errors,
)
from .scripts import CLUSTER_SCRIPTS, SCRIPTS

if TYPE_CHECKING:
    import redis

    from .wakeups import RedisWakeUps

# System-check messages of this backend (see checks.py for the table of ids).
W010 = (
    "Lock backend {alias!r} (fence mode {mode!r}): the Redis server runs without AOF "
    "persistence (appendonly no). In clock mode (the default) a restart without "
    "persistence frees held locks early, but fenced writes stay safe: new fences start "
    "from the server's clock. In counter mode fences restart from 1, and fenced writes "
    "to existing rows are refused as stale until the counters pass them. Use clock mode "
    "(OPTIONS FENCES 'clock') or enable appendonly (appendfsync everysec or always); "
    "to recover after such a restart, run 'manage.py syncguard_fences raise-floor'."
)
W011 = "Lock backend {alias!r}: could not check the server's setup: {error}"
W014 = (
    "Lock backend {alias!r} (fence mode {mode!r}) runs on Redis {topology} without "
    "OPTIONS WAIT_REPLICAS: a failover can promote a replica that has not received the "
    "last acquires, and those locks are then free again while their holders still run. "
    "{fences}"
)
W014_FENCES = {
    "clock": (
        "Clock fences keep fenced writes safe across it (the new primary's fences start "
        "from its clock), but unfenced work can overlap."
    ),
    "counter": (
        "In counter mode the promoted replica's counters can also be behind: a fence "
        "can be handed out a second time (a fenced write with an equal fence is "
        "accepted), or fenced writes to rows written just before the failover are "
        "refused as stale."
    ),
}
W014_HINT = (
    "Set OPTIONS WAIT_REPLICAS (e.g. 1) so that acquire, extend and release return only "
    "once a replica has them, or accept the overlap (and keep FENCES 'clock')."
)

LIMIT_BYTES = BACKEND_LIMITS["REDIS"]
RESERVE = RESERVE_BYTES["REDIS"]

#: SCAN calls one inspector page may make before it returns what it found so far:
#: a namespace with many released keys (fence-only hashes) must not stall the page.
MAX_SCANS_PER_PAGE = 20

_GLOB_SPECIAL = re.compile(r"([\\*?\[\]])")


def _text(value: Any) -> str:
    """A reply's string (redis-py gives bytes unless told to decode)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _glob_escape(text: str) -> str:
    """``text`` as a literal inside a Redis glob pattern."""
    return _GLOB_SPECIAL.sub(r"\\\1", text)


#: Lock hash names a backend object remembers for its own locks on a cluster.
MAX_HELD_NAMES = 10_000

#: Keys whose names (lock hash, slot, floor) a backend object remembers (see
#: :meth:`RedisBackend._key_names`); past it, the memory starts again empty.
MAX_KEY_NAMES = 1024

#: How long WAIT waits for the replicas, when OPTIONS["WAIT_REPLICAS"] asks for some.
DEFAULT_WAIT_TIMEOUT_MS = 500

R = TypeVar("R", ReleaseResult, ExtendResult)


def _count_option(options: Mapping[str, Any], name: str) -> int:
    value = options.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 64:
        raise InvalidArgument(f"OPTIONS[{name!r}] must be an int from 0 to 64, not {value!r}.")
    return int(value)


class RedisBackend(BaseLockBackend):
    """Locks in Redis; see the module docstring."""

    backend_name = "redis"
    time_authority = "server"
    uses_key_prefix = True
    #: Counters live in memory: a restart without AOF or a failover can lose them, and
    #: clock mode keeps fences increasing anyway (specs/backends/redis.md, Fences).
    default_fence_mode: ClassVar[FenceMode] = "clock"
    known_options: ClassVar[frozenset[str]] = (
        BaseLockBackend.known_options | CLIENT_OPTIONS | {"WAIT_REPLICAS", "WAIT_TIMEOUT_MS"}
    )
    #: A paused server runs the scripts it has read once it resumes, even those of a
    #: connection the client closed on a timeout.
    abandoned_requests_run = True

    def __init__(self, alias: str = "default", params: Mapping[str, Any] | None = None) -> None:
        super().__init__(alias, params)
        if not self.location or not isinstance(self.location, str):
            raise InvalidArgument(f"Lock backend {alias!r}: LOCATION must be a redis:// URL.")
        self.prefix = self.key_prefix.rstrip(":")
        if not self.prefix or "#" in self.prefix:
            # With "#" allowed, the index key "a#id:<id>" of prefix "a" would be a lock
            # key of prefix "a#id" on the same server.
            raise InvalidArgument(
                "KEY_PREFIX must be non-empty and free of '#' for Redis: it keeps lock "
                f"keys apart from the lock-id index (got {self.key_prefix!r})."
            )
        #: On a Redis Cluster (``OPTIONS["CLUSTER"]``): per-slot floors and indexes,
        #: slot-encoded lock ids (see :mod:`.slots`).
        self.cluster = self.options.get("CLUSTER") is True
        if self.cluster and ("{" in self.prefix or "}" in self.prefix):
            # A brace in the prefix would be a hash tag: every key of the alias in one
            # slot, and the per-slot keys' tags ignored.
            raise InvalidArgument(
                f"KEY_PREFIX must be free of braces on a Redis Cluster (got {self.key_prefix!r})."
            )
        self.clients = RedisClients(
            alias,
            self.location,
            self.options,
            connect_timeout_ms=self.connect_timeout_ms,
            operation_timeout_ms=self.operation_timeout_ms,
            scripts=CLUSTER_SCRIPTS if self.cluster else SCRIPTS,
        )
        #: Replicas that must acknowledge each write (``WAIT``); 0: none asked.
        self.wait_replicas = _count_option(self.options, "WAIT_REPLICAS")
        self.wait_timeout_ms = option_ms(self.options, "WAIT_TIMEOUT_MS", DEFAULT_WAIT_TIMEOUT_MS)
        if self.wait_replicas and self.wait_timeout_ms >= self.operation_timeout_ms:
            raise InvalidArgument(
                f"OPTIONS['WAIT_TIMEOUT_MS'] ({self.wait_timeout_ms}) must be shorter than "
                f"OPERATION_TIMEOUT_MS ({self.operation_timeout_ms}): WAIT runs inside the "
                "operation's time."
            )
        #: On a cluster, the lock hash of each lock this object acquired and has not
        #: released (bounded): its release, extend and lookup by id skip the index read.
        self._held_names = _HeldNames()
        #: key -> (lock hash, user key argument, slot, floor key): what depends on the
        #: key alone, computed once per key (bounded: :data:`MAX_KEY_NAMES`).
        self._names: dict[str, tuple[str, str, int, str]] = {}
        #: The index key of a lock id on a single server is this + the id.
        self._index_head = f"{self.prefix}#id:"
        #: The scripts bound to the synchronous client: the same dict for the life of
        #: the clients (a cluster's are added when its client is built, on first use).
        self._sync_scripts: dict[str, Any] = self.clients.scripts()

    @property
    def _scripts(self) -> dict[str, Any]:
        """The scripts bound to the synchronous client (built first on a cluster)."""
        self.clients.sync()
        return self.clients.scripts()

    @property
    def client(self) -> redis.Redis:
        """The synchronous redis-py client (see :class:`~.client.RedisClients`)."""
        return self.clients.sync()

    # ------------------------------------------------------------------ keys
    @property
    def key_namespace(self) -> tuple[str, str]:
        """The store and prefix this alias's keys live under (the check W013 compares
        aliases: nested prefixes on one server share keys)."""
        return (self.location, self.prefix)

    def lock_key(self, key: str) -> str:
        """The hash holding ``key``'s lock fields and fence counter."""
        return (self._names.get(key) or self._key_names(key))[0]

    def _key_names(self, key: str) -> tuple[str, str, int, str]:
        """``key``'s lock hash, the user key an acquire stores (``""`` unless the hash
        name had to be hashed), the hash's slot and the floor key its acquire reads
        (a cluster's slot floor; elsewhere slot 0 and the alias's floor). They depend
        on the key alone: computed once per key, not once per operation (an
        uncontended acquire spent more on them than on the rest of its arguments)."""
        names = self._names.get(key)
        if names is None:
            lock_key = _lock_key(self.prefix, key)
            slot = slots.key_slot(lock_key) if self.cluster else 0
            floor_key = self.slot_floor_key(slot) if self.cluster else self.floor_key
            names = (lock_key, self._user_key_arg(key, lock_key), slot, floor_key)
            if len(self._names) >= MAX_KEY_NAMES:
                self._names.clear()  # (a race with another thread only recomputes)
            self._names[str(key)] = names  # a plain str: a Key's memo is not kept alive
        return names

    def index_key(self, lock_id: str) -> str:
        """The string naming the lock hash of ``lock_id``; on a cluster it carries the
        tag of the slot the lock id says (an id past the last slot: the tag of slot
        0, a key no acquire writes for that id)."""
        if not self.cluster:
            return self._index_head + lock_id
        return f"{self.prefix}#id:{slots.slot_tag(slots.lock_id_slot(lock_id) or 0)}{lock_id}"

    @property
    def floor_key(self) -> str:
        """The string holding the alias's fence floor (``P#``: no user key reaches it);
        on a cluster, see :meth:`slot_floor_key`."""
        return f"{self.prefix}#floor"

    def slot_floor_key(self, slot: int) -> str:
        """On a cluster, the floor of the keys of ``slot`` (one per slot: the acquire
        reads it in the lock hash's slot)."""
        names = self.__dict__.get("_floor_keys")
        if names is None:  # every slot's, once: floor reads and raises name them all
            names = [f"{self.prefix}#floor:{{{tag}}}" for tag in slots.tags()]
            self.__dict__["_floor_keys"] = names
        return str(names[slot])

    def _user_key_arg(self, key: str, lock_key: str) -> str:
        """The user key, stored only when the lock key had to be hashed."""
        return "" if lock_key == f"{self.prefix}:{key}" else key

    def _user_key(self, lock_key: bytes | str, stored: bytes) -> str:
        if stored:
            return stored.decode()
        return _text(lock_key)[len(self.prefix) + 1 :]

    # ------------------------------------------------------------- dispatch
    def _call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Script ``name`` on ``keys`` with ``args``: one ``EVALSHA`` with the script's
        digest, loaded and sent again where the server lacks it (a first call, a
        restart, ``SCRIPT FLUSH``), as redis-py's ``Script.__call__`` does without its
        work per call (copying the arguments, an import, an isinstance check through
        ``typing`` for pipelines); off a cluster, sent by ``RedisClients.send`` (on the
        thread's own connection, or :func:`~.client.direct_command`)."""
        script = self._sync_scripts.get(name) or self._scripts[name]
        client = script.registered_client
        send = client.execute_command if self.cluster else partial(self.clients.send, client)
        try:
            try:
                return send("EVALSHA", script.sha, len(keys), *keys, *args)
            except no_script_error():
                if self.cluster:
                    client.script_load(script.script)  # on every primary
                else:  # on the same connection: a thread holding one needs no second
                    send("SCRIPT", "LOAD", script.script)
                return send("EVALSHA", script.sha, len(keys), *keys, *args)
        except redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc

    def _write(self, name: str, keys: list[str], args: list[Any]) -> tuple[Any, int]:
        """A writing script, then ``WAIT`` on the same connection in the same round
        trip when replicas must acknowledge (``OPTIONS["WAIT_REPLICAS"]``): the reply,
        and how many replicas have the write (``wait_replicas`` when none are asked)."""
        if not self.wait_replicas:
            return self._call(name, keys, args), 0
        script = self._scripts[name]
        try:
            client = self._node_client(keys[0])
            pipe = self._wait_pipeline(client, script, keys, args)
            replies = pipe.execute(raise_on_error=False)
            if isinstance(replies[0], no_script_error()):
                # The script did not run (a restarted server, SCRIPT FLUSH): load it,
                # send the pair again.
                client.script_load(script.script)
                replies = self._wait_pipeline(client, script, keys, args).execute(
                    raise_on_error=False
                )
            if _demoted(replies):
                # The node is a replica now: reconnect (through Sentinel, to the
                # new primary) rather than keep asking it.
                client.connection_pool.disconnect()
            return _waited(replies)
        except redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc

    def _wait_pipeline(self, client: Any, script: Any, keys: list[str], args: list[Any]) -> Any:
        """The script and ``WAIT`` queued on one pipeline of ``client``: one round trip.
        (Not ``Script.__call__`` on the pipeline: its ``SCRIPT EXISTS`` before each
        execution is a round trip of its own.)"""
        pipe = client.pipeline(transaction=False)
        pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
        return pipe

    async def _awrite(self, name: str, keys: list[str], args: list[Any]) -> tuple[Any, int]:
        if not self.wait_replicas:
            return await self._acall(name, keys, args), 0
        scripts = self._async_scripts()
        script = scripts[name]
        try:
            client = scripts["_client"]
            if self.cluster:
                # WAIT counts the writes of its own connection: the script's, on the
                # node of the key's slot (a slot moved meanwhile: MOVED, unavailable).
                await client.initialize()  # the slot map (read once, on first use)
                node = client.get_node_from_key(keys[0])
                client = self.clients.async_node_client(node.host, node.port)
            replies = await self._wait_pipeline(client, script, keys, args).execute(
                raise_on_error=False
            )
            if isinstance(replies[0], no_script_error()):
                await client.script_load(script.script)
                replies = await self._wait_pipeline(client, script, keys, args).execute(
                    raise_on_error=False
                )
            return _waited(replies)
        except redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc

    def _node_client(self, key: str) -> redis.Redis:
        """The client for a pipeline that must stay on one connection (a script and its
        ``WAIT``): on a cluster, the plain client of the node serving ``key``'s slot."""
        if not self.cluster:
            return self.client
        cluster: Any = self.client
        node_client: redis.Redis = cluster.get_redis_connection(cluster.get_node_from_key(key))
        return node_client

    def _too_few(self, acks: int, what: str) -> ServiceUnavailable:
        return ServiceUnavailable(
            f"Redis ({self.alias!r}): {acks} of the {self.wait_replicas} replicas asked for "
            f"(WAIT_REPLICAS) acknowledged within {self.wait_timeout_ms} ms; {what}"
        )

    async def _acall(self, name: str, keys: list[str], args: list[Any]) -> Any:
        scripts = self._async_scripts()
        script, client = scripts[name], scripts["_client"]
        send = client.execute_command if self.cluster else partial(adirect_command, client)
        try:  # as _call does
            try:
                return await send("EVALSHA", script.sha, len(keys), *keys, *args)
            except no_script_error():
                await client.script_load(script.script)
                return await send("EVALSHA", script.sha, len(keys), *keys, *args)
        except redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc

    def _async_scripts(self) -> dict[str, Any]:
        """Scripts bound to an asyncio client of the running loop (clients are per loop)."""
        return self.clients.for_loop()

    def close(self, **kwargs: Any) -> None:
        super().close()  # the wake-ups first: their connection comes from the clients
        self.clients.close()

    # ----------------------------------------------------------- operations
    def _acquire_args(
        self, key: str, ttl_ms: int, ticket: WaitTicket | None
    ) -> tuple[list[str], list[Any], str]:
        lock_key, user_key, slot, floor_key = self._names.get(key) or self._key_names(key)
        if self.cluster:
            # The lock id says the hash's slot; index and floor carry its tag.
            lock_id = note_sent(slots.new_lock_id(slot))
            index = self.index_key(lock_id)
        else:
            lock_id = note_sent(generate_lock_id())
            index = self._index_head + lock_id
        # Every key the script touches is in KEYS, the floor too (Redis Cluster routes
        # and checks a script by its declared keys).
        keys = [lock_key, index, floor_key]
        args = [
            lock_id,
            ttl_ms,
            TIME_TOLERANCE_MS,
            FENCE_MAX,
            user_key,
            self.fence_mode,
            self._owner() or "",
        ]
        if ticket is not None:  # without one, the arguments are those of a plain acquire
            record = self._grant_record(args, keys)
            args += [ticket.id, ticket.patience_ms, record, self._watch_flag()]
        return keys, args, lock_id

    def _grant_record(self, args: list[Any], keys: list[str]) -> str:
        """What a release needs to grant the key to this waiter (``scripts.grant``):
        the lock id, index and floor of this attempt, and its ttl, fence mode, owner
        and user key; "" without grants. Under ``WAIT_REPLICAS`` there are none: a
        grant is written by the releaser's script, and the waiter could not learn
        whether the replicas have it (it waits for its wake-up and acquires itself)."""
        if not self.grants:
            return ""
        lock_id, ttl_ms, tolerance, fence_max, user_key, mode, owner = args
        return json.dumps(
            [
                lock_id,
                keys[1],
                keys[2],
                str(ttl_ms),
                mode,
                str(fence_max),
                owner,
                user_key,
                str(tolerance),
                str(tickets.GRANT_WINDOW_MS),
                self._process_channel(),
            ],
            separators=(",", ":"),
        )

    def _acquired(self, reply: list[Any], key: str, lock_id: str, keys: list[str]) -> AcquireResult:
        status = int(reply[0])
        if status == 2:
            raise fence_overflow_error(key)
        if status == 0:
            if len(reply) > 2:  # this attempt granted the key to the first waiter
                self._watch(keys[0], reply[2])
            return AcquireResult.locked(int(reply[1]) if len(reply) > 1 else None)
        self._settled(keys[0])
        if len(reply) > 3:  # the key had been granted to this waiter: the grant's lock
            lock_id = _text(reply[3])
        if self.cluster:
            self._held_names.remember(lock_id, keys[0])
        return AcquireResult(
            ok=True, lock_id=lock_id, expires_at_ms=int(reply[2]), fence=format_fence(int(reply[1]))
        )

    def _acquire(
        self, key: str, ttl_ms: int, cancel: CancelToken | None, ticket: WaitTicket | None = None
    ) -> AcquireResult:
        keys, args, lock_id = self._acquire_args(key, ttl_ms, ticket)
        reply, acks = self._write("acquire", keys, args)
        result = self._acquired(reply, key, lock_id, keys)
        if result.ok and acks < self.wait_replicas:
            # Undo: a lock a failover could lose must not be held by a caller told it
            # failed. (The undo is best effort: its own failure is the same error.)
            self._held_names.forget(lock_id)
            self._call("release", self._undo_keys(keys), [lock_id, TIME_TOLERANCE_MS])
            raise self._too_few(acks, "the lock was released again.")
        return result

    async def _aacquire(
        self, key: str, ttl_ms: int, cancel: CancelToken | None, ticket: WaitTicket | None = None
    ) -> AcquireResult:
        keys, args, lock_id = self._acquire_args(key, ttl_ms, ticket)
        reply, acks = await self._awrite("acquire", keys, args)
        result = self._acquired(reply, key, lock_id, keys)
        if result.ok and acks < self.wait_replicas:
            undo = self._undo_keys(keys)
            self._held_names.forget(lock_id)
            await self._acall("release", undo, [lock_id, TIME_TOLERANCE_MS])
            raise self._too_few(acks, "the lock was released again.")
        return result

    def _acquire_may_have_run(self, error: LockError) -> bool:
        """A timeout or a connection lost after the request was written; not a
        refused connection (redis-py says "connecting"), nor a reply of the server's
        (MOVED, TRYAGAIN, READONLY: the script did not run)."""
        cause = error.context.get("cause")
        lost, never_sent = redis_lost_reply_errors()
        return (
            isinstance(cause, lost)
            and not isinstance(cause, never_sent)
            and "connecting" not in str(cause).lower()
            and "no connection available" not in str(cause).lower()
        )

    def _undo_keys(self, acquire_keys: list[str]) -> list[str]:
        """The release script's KEYS for the lock an acquire with ``acquire_keys``
        (hash, index, floor) just took: the hash is known, no index read needed."""
        lock_key, index = acquire_keys[0], acquire_keys[1]
        return [index, lock_key] if self.cluster else [index]

    def _id_keys(self, lock_id: str) -> list[str] | None:
        """KEYS of the scripts that start from a lock id: the index; on a cluster the
        index and the lock hash it names, read first (the script must declare the hash;
        it checks again that the index still names it). ``None``: no such lock."""
        index = self.index_key(lock_id)
        if not self.cluster:
            return [index]
        slot = slots.lock_id_slot(lock_id)
        if slot is None:
            return None
        known = self._held_names.get(lock_id)
        if known is not None:
            return [index, known]
        try:
            name = self.client.get(index)
        except redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc
        return self._resolved(index, slot, name)

    async def _aid_keys(self, lock_id: str) -> list[str] | None:
        index = self.index_key(lock_id)
        if not self.cluster:
            return [index]
        slot = slots.lock_id_slot(lock_id)
        if slot is None:
            return None
        known = self._held_names.get(lock_id)
        if known is not None:
            return [index, known]
        try:
            name = await self.clients.async_client().get(index)
        except redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc
        return self._resolved(index, slot, name)

    @staticmethod
    def _resolved(index: str, slot: int, name: Any) -> list[str] | None:
        if name is None:
            return None
        lock_key = name.decode()
        # A hash in another slot cannot be this lock's (its acquire put both in one).
        return [index, lock_key] if slots.key_slot(lock_key) == slot else None

    @property
    def grants(self) -> bool:
        # Not under WAIT_REPLICAS: see _grant_record.
        return self.wake_ups_enabled and not self.wait_replicas

    def _process_channel(self) -> str:
        """This process's grant channel ("" on a cluster: grants go on the key's)."""
        built = self._built()
        channel = None if built is None else built.process_channel
        return channel if isinstance(channel, str) else ""

    def _watcher(self) -> RedisWakeUps | None:
        """The wake-ups that check this process's grants once their window is over
        (see ``ChannelWorker.watch``); None when they cannot now (not connected, a
        cluster: its waiters hear every grant of their key) or grants are off."""
        built = self._built()
        if built is None or self.cluster or not self.grants or not built.watching:
            return None
        return built

    def _watch_flag(self) -> str:
        """The scripts' argument: "1" when a grant they make is checked by this
        process (they then spare the next waiter its message), else ""."""
        return "1" if self._watcher() is not None else ""

    def _built(self) -> RedisWakeUps | None:
        """This backend's wake-ups if this process built them (a waiter did)."""
        return cast("RedisWakeUps | None", self._built_wake_ups())

    def _watch(self, lock_key: Any, ticket: Any) -> None:
        """A script of this process granted ``lock_key`` to ``ticket``: check it."""
        built = self._built()
        if built is not None:
            built.watch(_text(lock_key), _text(ticket))

    def _settled(self, lock_key: str) -> None:
        """This process holds ``lock_key`` now: its earlier grants of it have ended."""
        built = self._built()
        if built is not None:
            built.settled(lock_key)

    def check_grant(self, lock_key: str, ticket: str) -> GrantCheck:
        """Grant ``lock_key`` on if this process's grant of it to ``ticket`` lapsed
        unclaimed (the wake-ups' thread calls it once the grant's window is over)."""
        reply = self._call("check_grant", [lock_key], [ticket, self._watch_flag()])
        status = int(reply[0])
        if status == 2:  # the server's clock says the window is not over yet
            return GrantCheck(left_ms=int(reply[1]))
        if status == 1:
            granted = reply[1] if len(reply) > 1 else None
            return GrantCheck(lapsed=True, granted=None if granted is None else _text(granted))
        return GrantCheck()

    def granted(self, key: str, grant: Grant) -> None:
        """A release granted ``key`` to a waiter of this process (see :meth:`claim`)."""
        if self.cluster:
            self._held_names.remember(grant.lock_id, self.lock_key(key))

    def claim(self, grant: Grant) -> bool:
        """Claim a grant for the waiter it was delivered to, so that it does not lapse
        (the channel's thread calls it once the waiter is woken). False when it had
        lapsed, or was released already."""
        keys = self._id_keys(grant.lock_id)
        if keys is None:
            return False
        return int(self._call("claim", keys, [grant.lock_id, TIME_TOLERANCE_MS])[0]) == 1

    def _forget_clients_after_fork(self) -> None:
        # redis-py's pools notice the fork themselves (they compare the PID); the
        # locks of this backend's own that a parent thread may have held are replaced.
        self._held_names.reset_after_fork()
        self.clients.reset_after_fork()

    def _make_wake_ups(self) -> WakeUps:
        from .wakeups import RedisWakeUps

        return RedisWakeUps(self)

    def _withdraw(self, key: str, ticket_id: str) -> None:
        lock_key, flag = self.lock_key(key), self._watch_flag()
        reply = self._call("withdraw", [lock_key], [ticket_id, TIME_TOLERANCE_MS, flag])
        self._withdrawn(lock_key, reply)

    async def _awithdraw(self, key: str, ticket_id: str) -> None:
        lock_key, flag = self.lock_key(key), self._watch_flag()
        reply = await self._acall("withdraw", [lock_key], [ticket_id, TIME_TOLERANCE_MS, flag])
        self._withdrawn(lock_key, reply)

    def _withdrawn(self, lock_key: str, reply: Any) -> None:
        if isinstance(reply, bytes):  # the withdrawal granted the key to that ticket
            self._watch(lock_key, reply)

    @staticmethod
    def _released(reply: list[Any]) -> ReleaseResult:
        status = int(reply[0])
        if status == 1:
            return ReleaseResult(ok=True)
        return ReleaseResult(ok=False, reason="expired" if status == 2 else "not-found")

    # A release or an extend cannot be undone: too few acknowledgements say that a
    # failover now could bring back the released lock, or its earlier expiry.
    _RELEASE_UNSURE = "released here; a failover now could bring the lock back until its TTL."
    _EXTEND_UNSURE = "extended here; a failover now could bring back the earlier expiry."

    def _granted_on(self, reply: list[Any]) -> None:
        if len(reply) > 2:  # {1, ticket, lock hash}: the release granted the key on
            self._watch(reply[2], reply[1])

    def _release(self, lock_id: str, cancel: CancelToken | None) -> ReleaseResult:
        keys, args = self._id_keys(lock_id), [lock_id, TIME_TOLERANCE_MS, self._watch_flag()]
        if self.cluster:  # (only a cluster's acquires remember names)
            self._held_names.forget(lock_id)
        if keys is None:
            return ReleaseResult(ok=False, reason="not-found")
        reply, acks = self._write("release", keys, args)
        self._granted_on(reply)
        return self._acked(self._released(reply), acks, self._RELEASE_UNSURE)

    async def _arelease(self, lock_id: str, cancel: CancelToken | None) -> ReleaseResult:
        keys, args = await self._aid_keys(lock_id), [lock_id, TIME_TOLERANCE_MS, self._watch_flag()]
        if self.cluster:
            self._held_names.forget(lock_id)
        if keys is None:
            return ReleaseResult(ok=False, reason="not-found")
        reply, acks = await self._awrite("release", keys, args)
        self._granted_on(reply)
        return self._acked(self._released(reply), acks, self._RELEASE_UNSURE)

    def _acked(self, result: R, acks: int, what: str) -> R:
        if result.ok and acks < self.wait_replicas:
            raise self._too_few(acks, what)
        return result

    @staticmethod
    def _extended(reply: list[Any]) -> ExtendResult:
        status = int(reply[0])
        if status == 1:
            return ExtendResult(ok=True, expires_at_ms=int(reply[1]))
        return ExtendResult(ok=False, reason="expired" if status == 2 else "not-found")

    def _extend(self, lock_id: str, ttl_ms: int, cancel: CancelToken | None) -> ExtendResult:
        args, keys = [lock_id, TIME_TOLERANCE_MS, ttl_ms], self._id_keys(lock_id)
        if keys is None:
            return ExtendResult(ok=False, reason="not-found")
        reply, acks = self._write("extend", keys, args)
        return self._acked(self._extended(reply), acks, self._EXTEND_UNSURE)

    async def _aextend(self, lock_id: str, ttl_ms: int, cancel: CancelToken | None) -> ExtendResult:
        args, keys = [lock_id, TIME_TOLERANCE_MS, ttl_ms], await self._aid_keys(lock_id)
        if keys is None:
            return ExtendResult(ok=False, reason="not-found")
        reply, acks = await self._awrite("extend", keys, args)
        return self._acked(self._extended(reply), acks, self._EXTEND_UNSURE)

    def _is_locked_args(self, key: str) -> tuple[list[str], list[Any]]:
        guard = CLEANUP_GUARD_MS["server"] if self.cleanup_in_is_locked else 0
        return [self.lock_key(key)], [TIME_TOLERANCE_MS, guard]

    def _is_locked(self, key: str, cancel: CancelToken | None) -> bool:
        return bool(self._call("is_locked", *self._is_locked_args(key)))

    async def _ais_locked(self, key: str, cancel: CancelToken | None) -> bool:
        return bool(await self._acall("is_locked", *self._is_locked_args(key)))

    def _record_by_key(self, reply: list[Any], lock_key: str) -> LockRecord | None:
        if not reply:
            return None
        lock_id, expires, acquired, fence, user_key, owner = reply
        return self._record(lock_key, lock_id, expires, acquired, fence, user_key, owner)

    def _record_by_id(self, reply: list[Any]) -> LockRecord | None:
        if not reply:
            return None
        return self._record(*reply)

    def _record(
        self,
        lock_key: Any,
        lock_id: bytes,
        expires: bytes,
        acquired: bytes,
        fence: bytes,
        user_key: bytes,
        owner: bytes,
    ) -> LockRecord:
        return LockRecord(
            key=self._user_key(lock_key, user_key),
            lock_id=lock_id.decode(),
            expires_at_ms=int(expires),
            acquired_at_ms=int(acquired),
            fence=format_fence(int(fence)),
            # "": not recorded (RECORD_OWNER off, or a lock taken before labels).
            owner=owner.decode("utf-8", "replace") if owner else None,
        )

    def _lookup_by_key(self, key: str, cancel: CancelToken | None) -> LockRecord | None:
        lock_key = self.lock_key(key)
        reply = self._call("lookup_by_key", [lock_key], [TIME_TOLERANCE_MS])
        return self._record_by_key(reply, lock_key)

    async def _alookup_by_key(self, key: str, cancel: CancelToken | None) -> LockRecord | None:
        lock_key = self.lock_key(key)
        reply = await self._acall("lookup_by_key", [lock_key], [TIME_TOLERANCE_MS])
        return self._record_by_key(reply, lock_key)

    def _lookup_by_id(self, lock_id: str, cancel: CancelToken | None) -> LockRecord | None:
        args, keys = [lock_id, TIME_TOLERANCE_MS], self._id_keys(lock_id)
        if keys is None:
            return None
        return self._record_by_id(self._call("lookup_by_id", keys, args))

    async def _alookup_by_id(self, lock_id: str, cancel: CancelToken | None) -> LockRecord | None:
        args, keys = [lock_id, TIME_TOLERANCE_MS], await self._aid_keys(lock_id)
        if keys is None:
            return None
        reply = await self._acall("lookup_by_id", keys, args)
        return self._record_by_id(reply)

    # ---------------------------------------------------------- housekeeping
    # SCAN walks the server, or on a cluster each primary in turn: a walk's state is
    # (which node, SCAN's position on it), and its cursor says both.
    def _scan_nodes(self) -> list[redis.Redis]:
        """The clients SCAN walks: the server's; on a cluster each primary's, ordered by
        the first slot it serves (a failover hands those slots to the replica that
        takes over, so the order, and a cursor's node number, stay put)."""
        if not self.cluster:
            return [self.client]
        cluster: Any = self.client
        first: dict[str, tuple[int, Any]] = {}
        try:
            for slot, nodes in cluster.nodes_manager.slots_cache.items():
                known = first.get(nodes[0].name)
                if known is None or slot < known[0]:
                    first[nodes[0].name] = (slot, nodes[0])
            ordered = sorted(first.values(), key=lambda item: item[0])
            return [cluster.get_redis_connection(node) for _, node in ordered]
        except redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc

    def _scan(
        self, state: tuple[int, int], match: str, count: int
    ) -> tuple[tuple[int, int] | None, list[bytes]]:
        """One SCAN call at ``state`` (node number, position): the state to go on from
        (``None``: the walk is over) and the names it returned."""
        nodes = self._scan_nodes()
        node, position = state
        if node >= len(nodes):  # a cursor of a larger cluster: nothing left
            return None, []
        try:
            found, names = nodes[node].scan(position, match=match, count=count, _type="hash")
        except redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc
        found = int(found)
        if found:
            return (node, found), cast(list[bytes], names)
        return ((node + 1, 0) if node + 1 < len(nodes) else None), cast(list[bytes], names)

    def _state_text(self, state: tuple[int, int] | None) -> str | None:
        """A walk's state as a listing cursor: SCAN's position on a single server (as
        before clusters), ``<node>.<position>`` on a cluster."""
        if state is None:
            return None
        return f"{state[0]}.{state[1]}" if self.cluster else str(state[1])

    def _parse_state(self, cursor: str | None) -> tuple[int, int]:
        if cursor is None:
            return (0, 0)
        parts = cursor.split(".") if self.cluster else ["0", cursor]
        if len(parts) == 2 and all(p.isascii() and p.isdigit() for p in parts):
            return (int(parts[0]), int(parts[1]))
        raise InvalidArgument("cursor is not one this backend returned.")

    def _on_slots(
        self,
        slot_list: Iterable[int],
        queue: Callable[[Any, int], Any],
        again: Callable[[int], Any],
    ) -> list[Any]:
        """On a cluster: ``queue(pipeline, slot)`` for each slot, in one pipeline per
        node serving them; the replies in order of the nodes, then of ``slot_list``. A
        reply that says the slot is elsewhere (MOVED, ASK, TRYAGAIN: the command did not
        run) is replaced by ``again(slot)``, sent through the cluster client."""
        cluster: Any = self.client
        try:
            by_node: dict[str, tuple[Any, list[int]]] = {}
            for slot in slot_list:
                node = cluster.nodes_manager.get_node_from_slot(slot)
                by_node.setdefault(node.name, (node, []))[1].append(slot)
            replies: list[Any] = []
            for node, node_slots in by_node.values():
                pipe = cluster.get_redis_connection(node).pipeline(transaction=False)
                for slot in node_slots:
                    queue(pipe, slot)
                results = pipe.execute(raise_on_error=False)
                for slot, result in zip(node_slots, results, strict=True):
                    if isinstance(result, redirect_errors()):
                        result = again(slot)
                    elif isinstance(result, Exception):
                        raise result
                    replies.append(result)
        except redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc
        return replies

    def _per_slot(
        self, name: str, names: list[str], args: Callable[[list[str]], list[Any]]
    ) -> list[Any]:
        """The replies of script ``name`` over the hashes ``names``: one call on a
        single server; on a cluster one call per slot among them (a script's KEYS
        must share a slot), pipelined per node."""
        if not self.cluster:
            return [self._call(name, names, args(names))]
        groups: dict[int, list[str]] = {}
        for lock_key in names:
            groups.setdefault(slots.key_slot(lock_key), []).append(lock_key)
        script = self._scripts[name]
        return self._on_slots(
            groups,
            lambda pipe, slot: _queue_script(pipe, script, groups[slot], args(groups[slot])),
            lambda slot: self._call(name, groups[slot], args(groups[slot])),
        )

    def _pattern(self, prefix: str = "") -> str:
        """SCAN pattern of the lock hashes whose (unhashed) key starts with ``prefix``."""
        return f"{_glob_escape(self.prefix)}:{_glob_escape(prefix)}*"

    def _list_locks(self, prefix: str, cursor: str | None, limit: int) -> LockPage:
        state: tuple[int, int] | None = self._parse_state(cursor)
        match = self._pattern(prefix)
        records: list[LockRecord] = []
        now = None
        for _ in range(MAX_SCANS_PER_PAGE):
            assert state is not None
            state, names = self._scan(state, match, limit)
            if names:
                keys = [n.decode() for n in names]
                for reply in self._per_slot("list_live", keys, lambda _: [TIME_TOLERANCE_MS]):
                    now = max(now or 0, int(reply[0]))
                    rows = reply[1:]
                    for j in range(0, len(rows), 7):
                        records.append(self._record(*rows[j : j + 7]))
            if state is None or len(records) >= limit:
                break
        return LockPage(tuple(records), self._state_text(state), now or self.now_ms())

    def _queue_stats(self, keys: list[str]) -> dict[str, QueueStats]:
        # One script per slot (one for all on a single server), pipelined per node.
        by_hash = {self.lock_key(key): key for key in keys}
        stats: dict[str, QueueStats] = {}
        for reply in self._per_slot("queue_stats", list(by_hash), lambda _: []):
            for j in range(0, len(reply), 3):
                name, count, oldest = reply[j : j + 3]
                key = by_hash.get(_text(name))
                if key is not None:
                    stats[key] = QueueStats(int(count), int(oldest) if oldest else None)
        return stats

    def _expired_in_namespace(self, batch_size: int, dry_run: bool) -> Iterator[int]:
        state: tuple[int, int] | None = (0, 0)
        match = self._pattern()
        guard, flag = CLEANUP_GUARD_MS["server"], "1" if dry_run else "0"
        while state is not None:
            state, names = self._scan(state, match, batch_size)
            keys = [n.decode() for n in names]
            # COUNT is only a hint: one SCAN call may return more names than asked for
            # (a hash bucket is returned whole), and a batch must never exceed its size.
            for start in range(0, len(keys), batch_size):
                chunk = keys[start : start + batch_size]
                replies = self._per_slot("delete_expired", chunk, lambda _: [guard, flag])
                yield sum(int(reply) for reply in replies)

    def _count_expired(self) -> int:
        return sum(self._expired_in_namespace(MAX_PAGE_SIZE, dry_run=True))

    def _delete_expired(self, batch_size: int) -> Iterator[int]:
        # One pass over the namespace (SCAN, never KEYS): batches are what one SCAN
        # call returns, so a batch may delete nothing while later ones do.
        return self._expired_in_namespace(batch_size, dry_run=False)

    # ---------------------------------------------------------------- checks
    def now_ms(self) -> int:
        """The Redis server's clock, in Unix ms."""
        try:
            seconds, micros = self.client.time()
        except redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc
        return int(seconds) * 1000 + int(micros) // 1000

    def persistence(self) -> dict[str, Any]:
        """``INFO persistence`` of the server (for the deploy check); on a cluster, of
        the primary whose persistence is weakest (``aof_enabled`` 0 if any has it off:
        that one's counters are those a restart loses)."""
        try:
            infos: list[dict[str, Any]] = [node.info("persistence") for node in self._scan_nodes()]
        except redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc
        return min(infos, key=lambda info: int(info.get("aof_enabled", 0)))

    def deploy_check(self) -> list[Any]:
        messages = self._failover_check()
        try:
            info = self.persistence()
        except LockError as exc:
            warning = checks.Warning(W011.format(alias=self.alias, error=exc), id="syncguard.W011")
            return [warning, *messages]
        if not int(info.get("aof_enabled", 0)):
            message = W010.format(alias=self.alias, mode=self.fence_mode)
            messages.insert(0, checks.Warning(message, id="syncguard.W010"))
        return messages

    def _failover_check(self) -> list[Any]:
        """W014: a topology that fails over (Sentinel, Cluster) without WAIT_REPLICAS."""
        topology = self.clients.topology
        if topology == "server" or self.wait_replicas:
            return []
        fences = W014_FENCES[self.fence_mode]
        message = W014.format(
            alias=self.alias, mode=self.fence_mode, topology=topology.capitalize(), fences=fences
        )
        return [checks.Warning(message, hint=W014_HINT, id="syncguard.W014")]

    # ------------------------------------------------------ fence continuity
    # On a cluster the floor is one key per slot (the acquire reads it in the lock
    # hash's slot): raising it raises every slot's, and the alias's floor is the
    # smallest of them, what every key has at least.
    def _fence_floor(self) -> int:
        if self.cluster:
            cluster: Any = self.client
            floors = self._on_slots(
                range(slots.SLOTS),
                lambda pipe, slot: pipe.get(self.slot_floor_key(slot)),
                lambda slot: cluster.get(self.slot_floor_key(slot)),
            )
            return min(int(floor or 0) for floor in floors)
        try:
            floor = self.client.get(self.floor_key)
        except redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc
        return int(floor) if floor is not None else 0

    def _raise_fence_floor(self, fence: int) -> int:
        # A script: read, compare and write cannot interleave with another raise.
        if self.cluster:
            return min(self._raise_slot_floors(range(slots.SLOTS), fence))
        return int(self._call("raise_floor", [self.floor_key], [fence]))

    def _raise_slot_floors(self, slot_list: Iterable[int], fence: int) -> list[int]:
        """Raise the floor of each slot of ``slot_list`` to at least ``fence``; the
        floors now in force."""
        script = self._scripts["raise_floor"]
        replies = self._on_slots(
            slot_list,
            lambda pipe, slot: _queue_script(pipe, script, [self.slot_floor_key(slot)], [fence]),
            lambda slot: self._call("raise_floor", [self.slot_floor_key(slot)], [fence]),
        )
        return [int(reply) for reply in replies]

    def _raise_floor_before_delete(self, counters: list[IdleCounter], fence: int) -> None:
        # On a cluster, the floors the deleted counters' keys will read: their slots'.
        if not self.cluster:
            super()._raise_floor_before_delete(counters, fence)
            return
        self._raise_slot_floors(sorted({slots.key_slot(c.name) for c in counters}), fence)

    def _compaction_done(self, fence: int) -> None:
        # Every slot's floor to the largest fence compacted, as a single floor would
        # be: the alias's floor (the smallest) then says what the run raised.
        if self.cluster:
            self._raise_fence_floor(fence)

    def _highest_fence(self) -> int:
        state: tuple[int, int] | None = (0, 0)
        match, highest = self._pattern(), 0
        while state is not None:
            # Every counter is read (an operator's tool): pages as large as dry runs'.
            state, names = self._scan(state, match, MAX_PAGE_SIZE)
            if names:
                keys = [n.decode() for n in names]
                replies = self._per_slot("highest_fence", keys, lambda _: [])
                highest = max(highest, *(int(reply) for reply in replies))
        return highest

    def _idle_counters(
        self, cutoff_ms: int, cursor: str | None, limit: int, *, stamp: bool
    ) -> tuple[list[IdleCounter], str | None]:
        # One SCAN call and one script per batch (per slot on a cluster). COUNT is only
        # a hint and a reply can hold more names than ``limit``: the names of such a
        # reply are taken in slices of ``limit``, the rest carried in the cursor with
        # SCAN's next position, and SCAN goes on from that position once they are
        # done. (Repeating the SCAN call instead would walk other buckets once this
        # batch's deletes have shrunk the table, and skip counters: measured, 4 in 20
        # left behind.)
        state, pending = _parse_idle_cursor(cursor)
        if not pending and state is not None:
            state, names = self._scan(state, self._pattern(), limit)
            pending = sorted(n.decode() for n in names)
        chunk, rest = pending[:limit], pending[limit:]
        next_cursor = json.dumps([state, rest]) if rest or state else None
        if not chunk:
            return [], next_cursor
        args = [cutoff_ms, TIME_TOLERANCE_MS, "1" if stamp else "0"]
        counters = [
            IdleCounter(name=reply[j].decode(), fence=int(reply[j + 1]), guard=int(reply[j + 2]))
            for reply in self._per_slot("idle_counters", chunk, lambda _: args)
            for j in range(0, len(reply), 3)
        ]
        return counters, next_cursor

    def _delete_idle_counters(self, counters: list[IdleCounter], cutoff_ms: int) -> int:
        if not counters:
            return 0
        fences = {counter.name: counter.fence for counter in counters}
        replies = self._per_slot(
            "delete_idle",
            list(fences),
            lambda names: [cutoff_ms, TIME_TOLERANCE_MS, *(fences[name] for name in names)],
        )
        return sum(int(reply) for reply in replies)


def _demoted(replies: list[Any]) -> bool:
    """Whether a script + WAIT pipeline found a replica where a primary was."""
    wait_reply = replies[-1]
    return isinstance(wait_reply, Exception) and "with replica" in str(wait_reply)


def _waited(replies: list[Any]) -> tuple[Any, int]:
    """(the script's reply, the replicas WAIT counted) of a script + WAIT pipeline."""
    script_reply, wait_reply = replies
    if isinstance(script_reply, Exception):
        raise script_reply
    if isinstance(wait_reply, Exception):
        # The script ran (an acquire may have taken its lock) but WAIT failed (an ACL
        # without WAIT, say): the caller gets the error, the lock is released.
        note_maybe_written()
        raise wait_reply
    return script_reply, int(wait_reply)


def _queue_script(pipe: Any, script: Any, keys: list[str], args: list[Any]) -> None:
    """Queue ``script`` on a node's pipeline: the pipeline loads it first if the node
    lacks it (what ``Script.__call__`` does, without its cost per call: floors queue
    16,384 of these)."""
    pipe.scripts.add(script)
    pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)


class _HeldNames:
    """lock id -> lock hash name of the locks one backend object acquired on a
    cluster, so that its own release, extend and lookup by id send the script at once
    (the index read only tells the name, which the acquire knew). Safe to be wrong
    about: the script still checks that the index names that hash and that the hash
    is held by that id. Bounded: past :data:`MAX_HELD_NAMES`, the oldest entries go
    (a lock never released by this object costs one entry until then), and a miss
    only costs the index read. Thread-safe; a forked child builds its own backends."""

    def __init__(self) -> None:
        self._names: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, lock_id: str, name: str) -> None:
        with self._lock:
            self._names[lock_id] = name
            if len(self._names) > MAX_HELD_NAMES:
                self._names.popitem(last=False)

    def get(self, lock_id: str) -> str | None:
        with self._lock:
            return self._names.get(lock_id)

    def forget(self, lock_id: str) -> None:
        with self._lock:
            self._names.pop(lock_id, None)

    def reset_after_fork(self) -> None:
        """In a forked child: a new lock (a parent thread may have held this one at
        the fork). The names stay: hints the scripts check, whichever process asks."""
        self._lock = threading.Lock()


def _parse_idle_cursor(cursor: str | None) -> tuple[tuple[int, int] | None, list[str]]:
    """(SCAN state: node number and position, ``None`` once the walk is over; names of
    its last reply still to do) from a compaction cursor."""
    if cursor is None:
        return (0, 0), []
    try:
        state, rest = json.loads(cursor)
        if (
            (state is None or (len(state) == 2 and all(type(n) is int for n in state)))
            and isinstance(rest, list)
            and all(isinstance(name, str) for name in rest)
        ):
            return (None if state is None else (state[0], state[1])), list(rest)
    except (ValueError, TypeError):
        pass
    raise InvalidArgument("cursor is not one this backend returned.")


def _lock_key(prefix: str, key: str) -> str:
    return make_storage_key(prefix, key, LIMIT_BYTES, RESERVE)
