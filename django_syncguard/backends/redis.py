"""The Redis backend: one Lua script per operation, Redis server time, durable fences.

``LOCATION`` is a redis URL (``redis://``, ``rediss://`` for TLS, ``unix://``);
``KEY_PREFIX`` (default ``"syncguard"``, must not be empty) namespaces every key.
``OPTIONS``: the common ones, plus ``MAX_CONNECTIONS`` (pool size, default 50) and
``CLIENT_KWARGS`` (passed to ``redis.Redis.from_url``: ``username``, ``password``,
``ssl_ca_certs``...). Needs ``pip install "django-syncguard[redis]"``.

Key layout (``P`` is the prefix without trailing colons)::

    P:<key>          hash  f = last fence (never deleted, no TTL)
                           i = lock id, e = expires at (ms), a = acquired at (ms),
                           k = user key (only when <key> had to be hashed)
                           while waiters queue: q = how many, n = last arrival number,
                           w:<ticket id> = "<arrival> <live until ms>" for each
    P#id:<lock id>   string, the full name of the hash above, expiring with the lock

A release wakes the first live waiter with ``PUBLISH P:<key> <ticket id>``: the
channel is the lock hash's own name (channels and keys are separate namespaces);
:mod:`.redis_wakeups` holds the subscriber side.

Lock keys all start with ``P:`` and index keys with ``P#``, so no user key can land
on an index entry; the fence counter lives inside the key's own hash, so no user key
can land on another key's counter either. See ``specs/backends/redis.md``.
"""

from __future__ import annotations

import asyncio
import re
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, cast

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from ..cancellation import CancelToken
from ..constants import (
    BACKEND_LIMITS,
    CLEANUP_GUARD_MS,
    MAX_PAGE_SIZE,
    RESERVE_BYTES,
    TIME_TOLERANCE_MS,
)
from ..errors import (
    AuthFailed,
    Internal,
    InvalidArgument,
    LockError,
    NetworkTimeout,
    ServiceUnavailable,
)
from ..fencing import FENCE_MAX, fence_overflow_error, format_fence
from ..keys import generate_lock_id, make_storage_key
from ..results import AcquireResult, ExtendResult, LockPage, LockRecord, ReleaseResult
from ..waiting import WaitTicket, WakeUps
from .base import BaseLockBackend, mapping_option, positive_int_option

if TYPE_CHECKING:
    import redis

# System-check messages of this backend (see checks.py for the table of ids).
W010 = (
    "Lock backend {alias!r}: the Redis server runs without AOF persistence "
    "(appendonly no). After a restart its fence counters can go back to older values "
    "and hand out fences already used. Enable appendonly (appendfsync everysec or always)."
)
W011 = "Lock backend {alias!r}: could not check the server's setup: {error}"

LIMIT_BYTES = BACKEND_LIMITS["REDIS"]
RESERVE = RESERVE_BYTES["REDIS"]
DEFAULT_MAX_CONNECTIONS = 50

# Every script reads the clock of the Redis server: TIME -> whole Unix milliseconds.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# The queue of waiters lives in the lock hash itself (same key, same slot): fields
# 'w:<ticket id>' = '<arrival> <live until ms>', 'q' = how many there are (read with
# the lock fields, so an empty queue costs the hot path nothing) and 'n' = the last
# arrival number handed out. 'q' and 'n' go when the queue empties. These helpers
# read the whole hash (HGETALL): only when 'q' says somebody waits. Scripts define
# them inside the branch that needs them, so the path without waiters does not even
# create their closures.
_QUEUE = """
local function hdel_all(h, names)
  for j = 1, #names, 500 do
    redis.call('HDEL', h, unpack(names, j, math.min(j + 499, #names)))
  end
end
-- The live waiters of hash h as {ticket id = arrival}, their count, and the id of the
-- first; stale ones (live until <= now) are deleted.
local function queue_load(h, now)
  local all = redis.call('HGETALL', h)
  local live, stale, count, head, first = {}, {}, 0, nil, nil
  for j = 1, #all, 2 do
    local name = all[j]
    if string.sub(name, 1, 2) == 'w:' then
      local value = all[j + 1]
      local space = string.find(value, ' ', 1, true)
      local arrival = tonumber(string.sub(value, 1, space - 1))
      if tonumber(string.sub(value, space + 1)) > now then
        local id = string.sub(name, 3)
        live[id] = arrival
        count = count + 1
        if first == nil or arrival < first then
          head, first = id, arrival
        end
      else
        stale[#stale + 1] = name
      end
    end
  end
  hdel_all(h, stale)
  return live, count, head
end
-- Record the number of waiters (only when it changed); an empty queue leaves no field.
local function queue_store(h, count, stored)
  if count == stored then
    return
  end
  if count > 0 then
    redis.call('HSET', h, 'q', count)
  else
    redis.call('HDEL', h, 'q', 'n')
  end
end
-- The key is free: wake the first live waiter, if any (only it).
local function wake_next(h, now, stored)
  local _, count, head = queue_load(h, now)
  queue_store(h, count, stored)
  if head then
    -- pcall: an ACL that denies this user channels must not fail a release whose
    -- writes are done (its waiters cannot subscribe either: they poll).
    redis.pcall('PUBLISH', h, head)
  end
end
"""

#: KEYS[1] lock hash, KEYS[2] index key of the new lock id.
#: ARGV: lock id, ttl ms, tolerance ms, max fence, user key ("" when not hashed),
#: and for a caller with a wait ticket: ticket id, patience ms.
#: Returns {0} contention ({0, position} for a queued ticket), {2} fence overflow
#: (nothing written), {1, fence, expires}.
ACQUIRE = (
    _NOW
    + """
local cur = redis.call('HMGET', KEYS[1], 'i', 'e', 'f', 'q')
local free = not cur[1] or tonumber(cur[2]) <= now - tonumber(ARGV[3])
local ticket = ARGV[6] or ''
if not free and ticket == '' then
  return {0}
end
local fence = (tonumber(cur[3]) or 0) + 1
if free and fence > tonumber(ARGV[4]) then
  return {2}
end
local waiting = tonumber(cur[4]) or 0
if waiting > 0 or not free then
"""
    + _QUEUE
    + """
  local live, count, head = queue_load(KEYS[1], now)
  if free and (head == nil or head == ticket) then
    if live[ticket] then
      redis.call('HDEL', KEYS[1], 'w:' .. ticket)
      count = count - 1
    end
    queue_store(KEYS[1], count, waiting)
  elseif ticket == '' then
    queue_store(KEYS[1], count, waiting)
    return {0}
  else
    local mine = live[ticket]
    if mine == nil then
      mine = redis.call('HINCRBY', KEYS[1], 'n', 1)
      count = count + 1
    end
    redis.call('HSET', KEYS[1], 'w:' .. ticket, mine .. ' ' .. (now + tonumber(ARGV[7])))
    queue_store(KEYS[1], count, waiting)
    local ahead = 0
    for _, arrival in pairs(live) do
      if arrival < mine then
        ahead = ahead + 1
      end
    end
    return {0, ahead}
  end
end
local expires = now + tonumber(ARGV[2])
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[1], 'f', fence, 'i', ARGV[1], 'e', expires, 'a', now, 'k', ARGV[5])
else
  redis.call('HSET', KEYS[1], 'f', fence, 'i', ARGV[1], 'e', expires, 'a', now)
end
redis.call('SET', KEYS[2], KEYS[1], 'PX', tonumber(ARGV[2]) + tonumber(ARGV[3]))
return {1, fence, expires}
"""
)

# Release and extend resolve the index to the lock hash, require the hash to carry
# this lock id (specs/contract.md, Operations: the stored lock id is re-checked) and
# to be live, then mutate: all inside one script.
_RESOLVE = (
    _NOW
    + """
local lock = redis.call('GET', KEYS[1])
if not lock then
  return {0}
end
local cur = redis.call('HMGET', lock, 'i', 'e', 'q')
if cur[1] ~= ARGV[1] then
  return {0}
end
if tonumber(cur[2]) <= now - tonumber(ARGV[2]) then
  return {2}
end
"""
)

#: KEYS[1] index key. ARGV: lock id, tolerance ms.
#: Returns {1} released, {2} expired, {0} not found. The fence field stays. When
#: waiters queue ('q' > 0), the first live one is woken by PUBLISH.
RELEASE = (
    _RESOLVE
    + """
redis.call('HDEL', lock, 'i', 'e', 'a', 'k')
redis.call('DEL', KEYS[1])
local waiting = tonumber(cur[3]) or 0
if waiting > 0 then
"""
    + _QUEUE
    + """
  wake_next(lock, now, waiting)
end
return {1}
"""
)

#: KEYS[1] lock hash. ARGV: ticket id, tolerance ms.
#: Removes the ticket; when the key is free, wakes the (new) first live waiter.
#: Returns 1 when the ticket was queued, else 0.
WITHDRAW = (
    _NOW
    + _QUEUE
    + """
local cur = redis.call('HMGET', KEYS[1], 'i', 'e', 'q')
local waiting = tonumber(cur[3]) or 0
if waiting == 0 or redis.call('HDEL', KEYS[1], 'w:' .. ARGV[1]) == 0 then
  return 0
end
if cur[1] and tonumber(cur[2]) > now - tonumber(ARGV[2]) then
  queue_store(KEYS[1], waiting - 1, waiting)
else
  wake_next(KEYS[1], now, waiting)
end
return 1
"""
)

#: KEYS[1] index key. ARGV: lock id, tolerance ms, ttl ms.
#: Returns {1, expires}, {2} expired, {0} not found.
EXTEND = (
    _RESOLVE
    + """
local expires = now + tonumber(ARGV[3])
redis.call('HSET', lock, 'e', expires)
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) + tonumber(ARGV[2]))
return {1, expires}
"""
)

#: KEYS[1] lock hash. ARGV: tolerance ms, cleanup guard ms (0: never write).
#: Returns 1 when live. With a guard, removes the lock fields (never the fence) of a
#: lock expired longer ago than the guard, after deciding the answer.
IS_LOCKED = (
    _NOW
    + """
local cur = redis.call('HMGET', KEYS[1], 'i', 'e')
if not cur[1] then
  return 0
end
local expires = tonumber(cur[2])
if expires > now - tonumber(ARGV[1]) then
  return 1
end
local guard = tonumber(ARGV[2])
if guard > 0 and now - expires > guard then
  redis.call('HDEL', KEYS[1], 'i', 'e', 'a', 'k')
end
return 0
"""
)

#: KEYS[1] lock hash. ARGV: tolerance ms. Returns {} or {i, e, a, f, k}.
LOOKUP_BY_KEY = (
    _NOW
    + """
local cur = redis.call('HMGET', KEYS[1], 'i', 'e', 'a', 'f', 'k')
if not cur[1] or tonumber(cur[2]) <= now - tonumber(ARGV[1]) then
  return {}
end
return {cur[1], cur[2], cur[3], cur[4], cur[5] or ''}
"""
)

#: KEYS[1] index key. ARGV: lock id, tolerance ms. Returns {} or {hash, i, e, a, f, k}.
LOOKUP_BY_ID = (
    _NOW
    + """
local lock = redis.call('GET', KEYS[1])
if not lock then
  return {}
end
local cur = redis.call('HMGET', lock, 'i', 'e', 'a', 'f', 'k')
if cur[1] ~= ARGV[1] or tonumber(cur[2]) <= now - tonumber(ARGV[2]) then
  return {}
end
return {lock, cur[1], cur[2], cur[3], cur[4], cur[5] or ''}
"""
)

#: KEYS: lock hashes found by one SCAN. ARGV: tolerance ms.
#: Returns {now, name, i, e, a, f, k, name, i, ...} for the live locks among them.
LIST_LIVE = (
    _NOW
    + """
local out = {now}
for _, name in ipairs(KEYS) do
  local cur = redis.call('HMGET', name, 'i', 'e', 'a', 'f', 'k')
  if cur[1] and tonumber(cur[2]) > now - tonumber(ARGV[1]) then
    table.insert(out, name)
    for j = 1, 4 do table.insert(out, cur[j]) end
    table.insert(out, cur[5] or '')
  end
end
return out
"""
)

#: KEYS: lock hashes found by one SCAN. ARGV: cleanup guard ms, 1 to only count.
#: Removes the lock fields (never the fence) of locks expired longer ago than the
#: guard, as IS_LOCKED's cleanup does; returns how many.
DELETE_EXPIRED = (
    _NOW
    + """
local n = 0
for _, name in ipairs(KEYS) do
  local cur = redis.call('HMGET', name, 'i', 'e')
  if cur[1] and tonumber(cur[2]) < now - tonumber(ARGV[1]) then
    n = n + 1
    if ARGV[2] ~= '1' then
      redis.call('HDEL', name, 'i', 'e', 'a', 'k')
    end
  end
end
return n
"""
)

#: SCAN calls one inspector page may make before it returns what it found so far:
#: a namespace with many released keys (fence-only hashes) must not stall the page.
MAX_SCANS_PER_PAGE = 20

SCRIPTS = {
    "acquire": ACQUIRE,
    "release": RELEASE,
    "withdraw": WITHDRAW,
    "extend": EXTEND,
    "is_locked": IS_LOCKED,
    "lookup_by_key": LOOKUP_BY_KEY,
    "lookup_by_id": LOOKUP_BY_ID,
    "list_live": LIST_LIVE,
    "delete_expired": DELETE_EXPIRED,
}

# Server replies that mean "not now" rather than "wrong".
_UNAVAILABLE_REPLIES = (
    "BUSY",
    "LOADING",
    "MASTERDOWN",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "OOM",
    "READONLY",
    "NOREPLICAS",
    "MISCONF",
)
_AUTH_REPLIES = ("NOAUTH", "WRONGPASS", "NOPERM")


_GLOB_SPECIAL = re.compile(r"([\\*?\[\]])")


def _glob_escape(text: str) -> str:
    """``text`` as a literal inside a Redis glob pattern."""
    return _GLOB_SPECIAL.sub(r"\\\1", text)


def _redis() -> Any:
    try:
        import redis
    except ImportError as exc:
        raise ImproperlyConfigured(
            'The Redis lock backend needs redis-py: pip install "django-syncguard[redis]".'
        ) from exc
    return redis


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
    elif isinstance(exc, errors.ConnectionError) or (
        isinstance(exc, errors.ResponseError) and text.startswith(_UNAVAILABLE_REPLIES)
    ):
        error_cls = ServiceUnavailable
    else:
        error_cls = Internal
    return error_cls(message, context={"cause": exc})


class RedisBackend(BaseLockBackend):
    """Locks in Redis; see the module docstring."""

    backend_name = "redis"
    time_authority = "server"
    uses_key_prefix = True
    known_options: ClassVar[frozenset[str]] = BaseLockBackend.known_options | {
        "MAX_CONNECTIONS",
        "CLIENT_KWARGS",
    }

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
        max_connections = positive_int_option(
            self.options, "MAX_CONNECTIONS", DEFAULT_MAX_CONNECTIONS
        )
        client_kwargs = mapping_option(self.options, "CLIENT_KWARGS")
        redis_py = _redis()
        self._client_kwargs: dict[str, Any] = {
            "socket_connect_timeout": self.connect_timeout_ms / 1000,
            "socket_timeout": self.operation_timeout_ms / 1000,
            # One attempt per call (specs/contract.md, Operations): a silently retried
            # acquire whose reply was lost would find its own lock and report contention.
            "retry": redis_py.retry.Retry(redis_py.backoff.NoBackoff(), 0),
            "retry_on_error": [],
            "max_connections": max_connections,
            **client_kwargs,
        }
        try:
            self.client: redis.Redis = redis_py.Redis.from_url(self.location, **self._client_kwargs)
        except ValueError as exc:
            raise InvalidArgument(f"LOCATION {self.location!r} is not a redis URL: {exc}") from exc
        self._scripts = {name: self.client.register_script(lua) for name, lua in SCRIPTS.items()}
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = (
            weakref.WeakKeyDictionary()
        )

    # ------------------------------------------------------------------ keys
    def lock_key(self, key: str) -> str:
        """The hash holding ``key``'s lock fields and fence counter."""
        return make_storage_key(self.prefix, key, LIMIT_BYTES, RESERVE)

    def index_key(self, lock_id: str) -> str:
        return f"{self.prefix}#id:{lock_id}"

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
        except self._redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc

    async def _acall(self, name: str, keys: list[str], args: list[Any]) -> Any:
        scripts = self._async_scripts()
        try:
            return await scripts[name](keys=keys, args=args)
        except self._redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc

    @staticmethod
    def _redis_error() -> type[Exception]:
        error: type[Exception] = _redis().exceptions.RedisError
        return error

    def _async_scripts(self) -> dict[str, Any]:
        """Scripts bound to an asyncio client of the running loop (clients are per loop)."""
        loop = asyncio.get_running_loop()
        scripts = self._async.get(loop)
        if scripts is None:
            client = _redis().asyncio.Redis.from_url(self.location, **self._client_kwargs)
            scripts = {name: client.register_script(lua) for name, lua in SCRIPTS.items()}
            scripts["_client"] = client
            self._async[loop] = scripts
        return scripts

    def close(self, **kwargs: Any) -> None:
        self.client.close()
        super().close()
        self._async = weakref.WeakKeyDictionary()

    # ----------------------------------------------------------- operations
    def _acquire_args(
        self, key: str, ttl_ms: int, ticket: WaitTicket | None
    ) -> tuple[list[str], list[Any], str]:
        lock_key = self.lock_key(key)
        lock_id = generate_lock_id()
        keys = [lock_key, self.index_key(lock_id)]
        args = [lock_id, ttl_ms, TIME_TOLERANCE_MS, FENCE_MAX, self._user_key_arg(key, lock_key)]
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
        return self._acquired(self._call("acquire", keys, args), key, lock_id)

    async def _aacquire(
        self, key: str, ttl_ms: int, cancel: CancelToken | None, ticket: WaitTicket | None = None
    ) -> AcquireResult:
        keys, args, lock_id = self._acquire_args(key, ttl_ms, ticket)
        return self._acquired(await self._acall("acquire", keys, args), key, lock_id)

    def _make_wake_ups(self) -> WakeUps:
        from .redis_wakeups import RedisWakeUps

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

    def _release(self, lock_id: str, cancel: CancelToken | None) -> ReleaseResult:
        reply = self._call("release", [self.index_key(lock_id)], [lock_id, TIME_TOLERANCE_MS])
        return self._released(reply)

    async def _arelease(self, lock_id: str, cancel: CancelToken | None) -> ReleaseResult:
        keys, args = [self.index_key(lock_id)], [lock_id, TIME_TOLERANCE_MS]
        return self._released(await self._acall("release", keys, args))

    @staticmethod
    def _extended(reply: list[Any]) -> ExtendResult:
        status = int(reply[0])
        if status == 1:
            return ExtendResult(ok=True, expires_at_ms=int(reply[1]))
        return ExtendResult(ok=False, reason="expired" if status == 2 else "not-found")

    def _extend(self, lock_id: str, ttl_ms: int, cancel: CancelToken | None) -> ExtendResult:
        args = [lock_id, TIME_TOLERANCE_MS, ttl_ms]
        return self._extended(self._call("extend", [self.index_key(lock_id)], args))

    async def _aextend(self, lock_id: str, ttl_ms: int, cancel: CancelToken | None) -> ExtendResult:
        args = [lock_id, TIME_TOLERANCE_MS, ttl_ms]
        return self._extended(await self._acall("extend", [self.index_key(lock_id)], args))

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
        except self._redis_error() as exc:
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
        except self._redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc
        return int(seconds) * 1000 + int(micros) // 1000

    def persistence(self) -> dict[str, Any]:
        """``INFO persistence`` of the server (for the deploy check)."""
        try:
            info: dict[str, Any] = self.client.info("persistence")
        except self._redis_error() as exc:
            raise map_redis_error(exc, self.alias) from exc
        return info

    def deploy_check(self) -> list[Any]:
        try:
            info = self.persistence()
        except LockError as exc:
            return [checks.Warning(W011.format(alias=self.alias, error=exc), id="syncguard.W011")]
        if not int(info.get("aof_enabled", 0)):
            return [checks.Warning(W010.format(alias=self.alias), id="syncguard.W010")]
        return []
