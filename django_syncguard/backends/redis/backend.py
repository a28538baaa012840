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

Lock keys all start with ``P:`` and index keys (and the floor) with ``P#``, so no
user key can land on an index entry or the floor; the fence counter lives inside the
key's own hash, so no user key can land on another key's counter either. See
``specs/backends/redis.md``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
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
from ...keys import derived, generate_lock_id, make_storage_key
from ...results import AcquireResult, ExtendResult, LockPage, LockRecord, ReleaseResult
from ...waiting import WaitTicket, WakeUps
from ..base import BaseLockBackend, option_ms
from .client import CLIENT_OPTIONS, RedisClients, map_redis_error, redis_error
from .scripts import SCRIPTS

if TYPE_CHECKING:
    import redis

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
        "In counter mode the promoted replica's counters can also be behind: fenced "
        "writes to rows written just before the failover are refused as stale."
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


def _glob_escape(text: str) -> str:
    """``text`` as a literal inside a Redis glob pattern."""
    return _GLOB_SPECIAL.sub(r"\\\1", text)


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
        self.clients = RedisClients(
            alias,
            self.location,
            self.options,
            connect_timeout_ms=self.connect_timeout_ms,
            operation_timeout_ms=self.operation_timeout_ms,
            scripts=SCRIPTS,
        )
        self._scripts = self.clients.scripts()
        #: Replicas that must acknowledge each write (``WAIT``); 0: none asked.
        self.wait_replicas = _count_option(self.options, "WAIT_REPLICAS")
        self.wait_timeout_ms = option_ms(self.options, "WAIT_TIMEOUT_MS", DEFAULT_WAIT_TIMEOUT_MS)
        if self.wait_replicas and self.wait_timeout_ms >= self.operation_timeout_ms:
            raise InvalidArgument(
                f"OPTIONS['WAIT_TIMEOUT_MS'] ({self.wait_timeout_ms}) must be shorter than "
                f"OPERATION_TIMEOUT_MS ({self.operation_timeout_ms}): WAIT runs inside the "
                "operation's time."
            )

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
        return derived(key, self.prefix, "redis lock key", partial(_lock_key, self.prefix, key))

    def index_key(self, lock_id: str) -> str:
        return f"{self.prefix}#id:{lock_id}"

    @property
    def floor_key(self) -> str:
        """The string holding the alias's fence floor (``P#``: no user key reaches it)."""
        return f"{self.prefix}#floor"

    def _user_key_arg(self, key: str, lock_key: str) -> str:
        """The user key, stored only when the lock key had to be hashed."""
        return "" if lock_key == f"{self.prefix}:{key}" else key

    def _user_key(self, lock_key: bytes | str, stored: bytes) -> str:
        if stored:
            return stored.decode()
        name = lock_key.decode() if isinstance(lock_key, bytes) else lock_key
        return name[len(self.prefix) + 1 :]

    # ------------------------------------------------------------- dispatch
    def _call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return self._scripts[name](keys=keys, args=args)
        except redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc

    def _write(self, name: str, keys: list[str], args: list[Any]) -> tuple[Any, int]:
        """A writing script, then ``WAIT`` on the same connection in the same round
        trip when replicas must acknowledge (``OPTIONS["WAIT_REPLICAS"]``): the reply,
        and how many replicas have the write (``wait_replicas`` when none are asked)."""
        if not self.wait_replicas:
            return self._call(name, keys, args), 0
        try:
            pipe = self.client.pipeline(transaction=False)
            self._scripts[name](keys=keys, args=args, client=pipe)
            pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)  # type: ignore[no-untyped-call]
            reply, acks = pipe.execute()
        except redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc
        return reply, int(acks)

    async def _awrite(self, name: str, keys: list[str], args: list[Any]) -> tuple[Any, int]:
        if not self.wait_replicas:
            return await self._acall(name, keys, args), 0
        scripts = self._async_scripts()
        try:
            pipe = scripts["_client"].pipeline(transaction=False)
            await scripts[name](keys=keys, args=args, client=pipe)
            pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
            reply, acks = await pipe.execute()
        except redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc
        return reply, int(acks)

    def _too_few(self, acks: int, what: str) -> ServiceUnavailable:
        return ServiceUnavailable(
            f"Redis ({self.alias!r}): {acks} of the {self.wait_replicas} replicas asked for "
            f"(WAIT_REPLICAS) acknowledged within {self.wait_timeout_ms} ms; {what}"
        )

    async def _acall(self, name: str, keys: list[str], args: list[Any]) -> Any:
        scripts = self._async_scripts()
        try:
            return await scripts[name](keys=keys, args=args)
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
        lock_key = self.lock_key(key)
        lock_id = generate_lock_id()
        # Every key the script touches is in KEYS, the floor too (Redis Cluster routes
        # and checks a script by its declared keys).
        keys = [lock_key, self.index_key(lock_id), self.floor_key]
        args = [
            lock_id,
            ttl_ms,
            TIME_TOLERANCE_MS,
            FENCE_MAX,
            self._user_key_arg(key, lock_key),
            self.fence_mode,
        ]
        if ticket is not None:  # without one, the arguments are those of a plain acquire
            args += [ticket.id, ticket.patience_ms]
        return keys, args, lock_id

    def _acquired(self, reply: list[Any], key: str, lock_id: str) -> AcquireResult:
        status = int(reply[0])
        if status == 2:
            raise fence_overflow_error(key)
        if status == 0:
            return AcquireResult.locked(int(reply[1]) if len(reply) > 1 else None)
        return AcquireResult(
            ok=True, lock_id=lock_id, expires_at_ms=int(reply[2]), fence=format_fence(int(reply[1]))
        )

    def _acquire(
        self, key: str, ttl_ms: int, cancel: CancelToken | None, ticket: WaitTicket | None = None
    ) -> AcquireResult:
        keys, args, lock_id = self._acquire_args(key, ttl_ms, ticket)
        reply, acks = self._write("acquire", keys, args)
        result = self._acquired(reply, key, lock_id)
        if result.ok and acks < self.wait_replicas:
            # Undo: a lock a failover could lose must not be held by a caller told it
            # failed. (The undo is best effort: its own failure is the same error.)
            self._call("release", [self.index_key(lock_id)], [lock_id, TIME_TOLERANCE_MS])
            raise self._too_few(acks, "the lock was released again.")
        return result

    async def _aacquire(
        self, key: str, ttl_ms: int, cancel: CancelToken | None, ticket: WaitTicket | None = None
    ) -> AcquireResult:
        keys, args, lock_id = self._acquire_args(key, ttl_ms, ticket)
        reply, acks = await self._awrite("acquire", keys, args)
        result = self._acquired(reply, key, lock_id)
        if result.ok and acks < self.wait_replicas:
            await self._acall("release", [self.index_key(lock_id)], [lock_id, TIME_TOLERANCE_MS])
            raise self._too_few(acks, "the lock was released again.")
        return result

    def _make_wake_ups(self) -> WakeUps:
        from .wakeups import RedisWakeUps

        return RedisWakeUps(self)

    def _withdraw(self, key: str, ticket_id: str) -> None:
        self._call("withdraw", [self.lock_key(key)], [ticket_id, TIME_TOLERANCE_MS])

    async def _awithdraw(self, key: str, ticket_id: str) -> None:
        await self._acall("withdraw", [self.lock_key(key)], [ticket_id, TIME_TOLERANCE_MS])

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

    def _release(self, lock_id: str, cancel: CancelToken | None) -> ReleaseResult:
        keys, args = [self.index_key(lock_id)], [lock_id, TIME_TOLERANCE_MS]
        reply, acks = self._write("release", keys, args)
        return self._acked(self._released(reply), acks, self._RELEASE_UNSURE)

    async def _arelease(self, lock_id: str, cancel: CancelToken | None) -> ReleaseResult:
        keys, args = [self.index_key(lock_id)], [lock_id, TIME_TOLERANCE_MS]
        reply, acks = await self._awrite("release", keys, args)
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
        args = [lock_id, TIME_TOLERANCE_MS, ttl_ms]
        reply, acks = self._write("extend", [self.index_key(lock_id)], args)
        return self._acked(self._extended(reply), acks, self._EXTEND_UNSURE)

    async def _aextend(self, lock_id: str, ttl_ms: int, cancel: CancelToken | None) -> ExtendResult:
        args = [lock_id, TIME_TOLERANCE_MS, ttl_ms]
        reply, acks = await self._awrite("extend", [self.index_key(lock_id)], args)
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
        lock_id, expires, acquired, fence, user_key = reply
        return self._record(lock_key, lock_id, expires, acquired, fence, user_key)

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
    ) -> LockRecord:
        return LockRecord(
            key=self._user_key(lock_key, user_key),
            lock_id=lock_id.decode(),
            expires_at_ms=int(expires),
            acquired_at_ms=int(acquired),
            fence=format_fence(int(fence)),
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
        args = [lock_id, TIME_TOLERANCE_MS]
        return self._record_by_id(self._call("lookup_by_id", [self.index_key(lock_id)], args))

    async def _alookup_by_id(self, lock_id: str, cancel: CancelToken | None) -> LockRecord | None:
        args = [lock_id, TIME_TOLERANCE_MS]
        reply = await self._acall("lookup_by_id", [self.index_key(lock_id)], args)
        return self._record_by_id(reply)

    # ---------------------------------------------------------- housekeeping
    def _scan(self, cursor: int, match: str, count: int) -> tuple[int, list[bytes]]:
        try:
            next_cursor, names = self.client.scan(cursor, match=match, count=count, _type="hash")
        except redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc
        return int(next_cursor), cast(list[bytes], names)

    def _pattern(self, prefix: str = "") -> str:
        """SCAN pattern of the lock hashes whose (unhashed) key starts with ``prefix``."""
        return f"{_glob_escape(self.prefix)}:{_glob_escape(prefix)}*"

    def _list_locks(self, prefix: str, cursor: str | None, limit: int) -> LockPage:
        if cursor is not None and not (cursor.isascii() and cursor.isdigit()):
            raise InvalidArgument("cursor is not one this backend returned.")
        position, match = int(cursor or 0), self._pattern(prefix)
        records: list[LockRecord] = []
        now = None
        for _ in range(MAX_SCANS_PER_PAGE):
            position, names = self._scan(position, match, limit)
            if names:
                reply = self._call("list_live", [n.decode() for n in names], [TIME_TOLERANCE_MS])
                now = int(reply[0])
                rows = reply[1:]
                for j in range(0, len(rows), 6):
                    records.append(self._record(*rows[j : j + 6]))
            if position == 0 or len(records) >= limit:
                break
        return LockPage(tuple(records), str(position) if position else None, now or self.now_ms())

    def _expired_in_namespace(self, batch_size: int, dry_run: bool) -> Iterator[int]:
        position, match = 0, self._pattern()
        guard, flag = CLEANUP_GUARD_MS["server"], "1" if dry_run else "0"
        while True:
            position, names = self._scan(position, match, batch_size)
            keys = [n.decode() for n in names]
            # COUNT is only a hint: one SCAN call may return more names than asked for
            # (a hash bucket is returned whole), and a batch must never exceed its size.
            for start in range(0, len(keys), batch_size):
                chunk = keys[start : start + batch_size]
                yield int(self._call("delete_expired", chunk, [guard, flag]))
            if position == 0:
                return

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
        """``INFO persistence`` of the server (for the deploy check)."""
        try:
            info: dict[str, Any] = self.client.info("persistence")
        except redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc
        return info

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
    def _fence_floor(self) -> int:
        try:
            floor = self.client.get(self.floor_key)
        except redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc
        return int(floor) if floor is not None else 0

    def _raise_fence_floor(self, fence: int) -> int:
        # A script: read, compare and write cannot interleave with another raise.
        return int(self._call("raise_floor", [self.floor_key], [fence]))

    def _highest_fence(self) -> int:
        position, match, highest = 0, self._pattern(), 0
        while True:
            # Every counter is read (an operator's tool): pages as large as dry runs'.
            position, names = self._scan(position, match, MAX_PAGE_SIZE)
            if names:
                keys = [n.decode() for n in names]
                highest = max(highest, int(self._call("highest_fence", keys, [])))
            if position == 0:
                return highest

    def _idle_counters(
        self, cutoff_ms: int, cursor: str | None, limit: int, *, stamp: bool
    ) -> tuple[list[IdleCounter], str | None]:
        # One SCAN call and one script per batch. COUNT is only a hint and a reply can
        # hold more names than ``limit``: the names of such a reply are taken in slices
        # of ``limit``, the rest carried in the cursor with SCAN's next position, and
        # SCAN goes on from that position once they are done. (Repeating the SCAN call
        # instead would walk other buckets once this batch's deletes have shrunk the
        # table, and skip counters: measured, 4 in 20 left behind.)
        position, pending = _parse_idle_cursor(cursor)
        if not pending:
            position, names = self._scan(position, self._pattern(), limit)
            pending = sorted(n.decode() for n in names)
        chunk, rest = pending[:limit], pending[limit:]
        next_cursor = json.dumps([position, rest]) if rest or position else None
        if not chunk:
            return [], next_cursor
        args = [cutoff_ms, TIME_TOLERANCE_MS, "1" if stamp else "0"]
        reply = self._call("idle_counters", chunk, args)
        counters = [
            IdleCounter(name=reply[j].decode(), fence=int(reply[j + 1]), guard=int(reply[j + 2]))
            for j in range(0, len(reply), 3)
        ]
        return counters, next_cursor

    def _delete_idle_counters(self, counters: list[IdleCounter], cutoff_ms: int) -> int:
        if not counters:
            return 0
        keys = [counter.name for counter in counters]
        args = [cutoff_ms, TIME_TOLERANCE_MS, *(counter.fence for counter in counters)]
        return int(self._call("delete_idle", keys, args))


def _parse_idle_cursor(cursor: str | None) -> tuple[int, list[str]]:
    """(SCAN position, names of its last reply still to do) from a compaction cursor."""
    if cursor is None:
        return 0, []
    try:
        position, rest = json.loads(cursor)
        if isinstance(position, int) and all(isinstance(name, str) for name in rest):
            return position, list(rest)
    except (ValueError, TypeError):
        pass
    raise InvalidArgument("cursor is not one this backend returned.")


def _lock_key(prefix: str, key: str) -> str:
    return make_storage_key(prefix, key, LIMIT_BYTES, RESERVE)
