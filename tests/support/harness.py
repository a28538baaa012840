"""One harness per backend, so the contract suite runs unchanged on each.

A harness builds a fresh backend and can do what a test cannot do through the
public API: move the backend's notion of time forward (a fake clock, or ageing the
stored records on a server whose clock we do not control), and seed a fence counter.
"""

from __future__ import annotations

import threading
import uuid
from typing import TYPE_CHECKING, Any, ClassVar

from django_syncguard.backends.base import BaseLockBackend
from django_syncguard.backends.database import DatabaseBackend
from django_syncguard.backends.database.sqlite import QUEUE
from django_syncguard.backends.firestore import FirestoreBackend
from django_syncguard.backends.memory import MemoryBackend
from django_syncguard.backends.redis import RedisBackend
from django_syncguard.keys import normalize_and_validate_key
from django_syncguard.liveness import FakeClock
from django_syncguard.results import Capabilities

if TYPE_CHECKING:
    import redis


class Harness:
    name: ClassVar[str]
    #: What the backend must declare.
    capabilities: ClassVar[Capabilities]
    backend: BaseLockBackend
    #: The ``SYNCGUARD_BACKENDS`` entry that builds a backend on the same storage.
    settings_entry: dict[str, object]

    def build(self, alias: str, params: dict[str, object], cls: type[BaseLockBackend]) -> None:
        self.backend = cls(alias, params)
        self.settings_entry = {"BACKEND": f"{cls.__module__}.{cls.__name__}", **params}

    def now_ms(self) -> int:
        """The backend's time authority, now."""
        raise NotImplementedError

    def advance(self, ms: int) -> None:
        """Make every stored lock ``ms`` older, as if the authority's clock jumped."""
        raise NotImplementedError

    def set_fence(self, key: str, value: int) -> None:
        """Set the fence counter of ``key`` (the next acquire returns ``value + 1``)."""
        raise NotImplementedError

    def close(self) -> None:
        self.backend.close()


class MemoryHarness(Harness):
    name = "memory"
    capabilities = Capabilities("memory", supports_fencing=True, time_authority="client")

    def __init__(self, **options: object) -> None:
        self.clock = FakeClock()
        store = f"contract-{uuid.uuid4().hex}"
        params = {"LOCATION": store, "OPTIONS": {"CLOCK": self.clock, **options}}
        self.build(store, params, MemoryBackend)

    def now_ms(self) -> int:
        return self.clock()

    def advance(self, ms: int) -> None:
        self.clock.advance(ms)

    def delay_extends(self, monkeypatch: Any) -> threading.Event:
        """Make the backend's extends (an auto-extend's renewals) wait until the
        returned event is set. A test sets it once it has moved the fake clock: on a
        busy machine the move could otherwise come after the first renewal, which
        runs a third of the TTL later in real time."""
        go, extend = threading.Event(), self.backend.extend

        def extend_when_told(*args: Any, **kwargs: Any) -> Any:
            go.wait(5)
            return extend(*args, **kwargs)

        monkeypatch.setattr(self.backend, "extend", extend_when_told)
        return go

    def set_fence(self, key: str, value: int) -> None:
        assert isinstance(self.backend, MemoryBackend)
        self.backend._store.fences[normalize_and_validate_key(key)] = value

    def close(self) -> None:
        assert isinstance(self.backend, MemoryBackend)
        self.backend.reset()


class DatabaseHarness(Harness):
    """The database backend on a real database; time moves by ageing the rows."""

    database: ClassVar[str]

    def __init__(self, **options: object) -> None:
        params = {"OPTIONS": {"DATABASE": self.database, **options}}
        self.build(f"contract-{self.name}", params, DatabaseBackend)

    def now_ms(self) -> int:
        assert isinstance(self.backend, DatabaseBackend)
        return self.backend.now_ms()

    def execute(self, sql: str, params: list[object]) -> None:
        assert isinstance(self.backend, DatabaseBackend)
        with self.backend.connection().cursor() as cursor:
            cursor.execute(sql, params)

    def advance(self, ms: int) -> None:
        # An unclaimed grant's told expiry too (its deadline is in expires_at_ms).
        self.execute(
            "UPDATE syncguard_locks SET expires_at_ms = expires_at_ms - %s, "
            "acquired_at_ms = acquired_at_ms - %s, "
            "grant_expires_at_ms = grant_expires_at_ms - %s",
            [ms, ms, ms],
        )
        # Wait tickets too: a waiter that stopped checking in loses its place.
        self.execute("UPDATE syncguard_waiters SET live_until_ms = live_until_ms - %s", [ms])
        # And the counters' last acquisitions, for compaction (NULL stays NULL).
        self.execute(
            "UPDATE syncguard_fence_counters SET acquired_at_ms = acquired_at_ms - %s", [ms]
        )

    def set_fence(self, key: str, value: int) -> None:
        assert isinstance(self.backend, DatabaseBackend)
        fence_key = self.backend.storage_keys(normalize_and_validate_key(key))[1]
        self.execute(
            "INSERT INTO syncguard_fence_counters (fence_key, fence) VALUES (%s, %s) "
            "ON CONFLICT (fence_key) DO UPDATE SET fence = excluded.fence",
            [fence_key, value],
        )


# Moves time for the Redis backend: ages every lock hash of one prefix (its expiry,
# its last acquisition time, kept after a release, so compaction sees old counters,
# and a grant's claim deadline), and the deadlines of its queued wait tickets ('w:<ticket id>' =
# '<arrival> <live until ms>').
_AGE_REDIS = """
local cursor = '0'
local ms = tonumber(ARGV[2])
repeat
  local page = redis.call('SCAN', cursor, 'MATCH', ARGV[1], 'COUNT', 1000)
  cursor = page[1]
  for _, key in ipairs(page[2]) do
    if redis.call('TYPE', key).ok == 'hash' then
      for _, field in ipairs({'e', 'a', 'g'}) do
        if redis.call('HEXISTS', key, field) == 1 then
          redis.call('HINCRBY', key, field, -ms)
        end
      end
      local all = redis.call('HGETALL', key)
      for j = 1, #all, 2 do
        if string.sub(all[j], 1, 2) == 'w:' then
          local space = string.find(all[j + 1], ' ', 1, true)
          local arrival = string.sub(all[j + 1], 1, space - 1)
          local untl = tonumber(string.sub(all[j + 1], space + 1)) - ms
          redis.call('HSET', key, all[j], arrival .. ' ' .. string.format('%d', untl))
        end
      end
    end
  end
until cursor == '0'
return 0
"""


class RedisHarness(Harness):
    """The Redis backend on the session's redis-server, under a prefix of its own."""

    name = "redis"
    capabilities = Capabilities("redis", supports_fencing=True, time_authority="server")
    url = ""  # set by the redis_server fixture (tests/conftest.py) while it runs

    def __init__(self, **options: object) -> None:
        self.prefix = f"sg{uuid.uuid4().hex[:12]}"
        # The contract suite counts fences from 1: counter mode unless a test asks.
        options = {"FENCES": "counter", **options}
        params = {"LOCATION": self.url, "KEY_PREFIX": self.prefix, "OPTIONS": options}
        self.build(f"contract-{self.prefix}", params, RedisBackend)

    @property
    def redis(self) -> RedisBackend:
        assert isinstance(self.backend, RedisBackend)
        return self.backend

    def now_ms(self) -> int:
        return self.redis.now_ms()

    def advance(self, ms: int) -> None:
        self.redis.client.eval(_AGE_REDIS, 0, f"{self.prefix}:*", ms)

    def set_fence(self, key: str, value: int) -> None:
        self.redis.client.hset(self.redis.lock_key(normalize_and_validate_key(key)), "f", value)

    def close(self) -> None:
        keys = list(self.redis.client.scan_iter(match=f"{self.prefix}[:#]*", count=1000))
        if keys:
            self.redis.client.delete(*keys)
        self.backend.close()


class RedisSentinelHarness(RedisHarness):
    """The Redis backend through Sentinel (a primary, its replica and three sentinels:
    the ``redis_sentinel`` fixture), which finds the primary for every connection."""

    name = "redis-sentinel"
    location = ""  # set by the redis_sentinel fixture (tests/conftest.py) while it runs
    sentinels: ClassVar[list[tuple[str, int]]] = []

    def __init__(self, **options: object) -> None:
        self.prefix = f"sg{uuid.uuid4().hex[:12]}"
        options = {"FENCES": "counter", "SENTINELS": self.sentinels, **options}
        params = {"LOCATION": self.location, "KEY_PREFIX": self.prefix, "OPTIONS": options}
        self.build(f"contract-{self.prefix}", params, RedisBackend)


class RedisClusterHarness(RedisHarness):
    """The Redis backend on the session's Redis Cluster (three primaries, a replica
    each), under a prefix of its own: the same suite, with keys in every slot."""

    name = "redis-cluster"
    url = ""  # set by the redis_cluster_harness fixture (tests/conftest.py)

    def __init__(self, **options: object) -> None:
        super().__init__(CLUSTER=True, **options)

    def primaries(self) -> list[redis.Redis]:
        """A client of each primary (ordered as the backend's SCAN walks them)."""
        return self.redis._scan_nodes()

    def advance(self, ms: int) -> None:
        # The ageing script SCANs the node it runs on and touches only its keys.
        for node in self.primaries():
            node.eval(_AGE_REDIS, 0, f"{self.prefix}:*", ms)

    def close(self) -> None:
        for node in self.primaries():
            keys = list(node.scan_iter(match=f"{self.prefix}[:#]*", count=1000))
            pipe = node.pipeline(transaction=False)
            for key in keys:  # one slot per command
                pipe.unlink(key)
            pipe.execute(raise_on_error=False)  # a key whose slot moved: left behind
        self.backend.close()


class FirestoreHarness(Harness):
    """The Firestore backend on the emulator, in collections of its own."""

    name = "firestore"
    capabilities = Capabilities("firestore", supports_fencing=True, time_authority="server")
    project = "syncguard-test"

    def __init__(self, **options: object) -> None:
        suffix = uuid.uuid4().hex[:12]
        options = {
            "PROJECT": self.project,
            "COLLECTION": f"locks_{suffix}",
            "FENCE_COLLECTION": f"fences_{suffix}",
            **options,
        }
        self.build(f"contract-{suffix}", {"OPTIONS": options}, FirestoreBackend)

    @property
    def firestore(self) -> FirestoreBackend:
        assert isinstance(self.backend, FirestoreBackend)
        return self.backend

    def now_ms(self) -> int:
        return self.firestore.now_ms()

    def advance(self, ms: int) -> None:
        # Lock fields, and the waiters' places (a waiter-only document has no lock).
        for snap in self.firestore.client.collection(self.firestore.collection).stream():
            data = snap.to_dict()
            # An unclaimed grant's lease too (its claim deadline is in expiresAtMs).
            fields = ("expiresAtMs", "acquiredAtMs", "grantExpiresAtMs")
            aged = {f: data[f] - ms for f in fields if f in data}
            if data.get("waiters"):
                aged["waiters"] = {
                    ticket_id: {**entry, "liveUntilMs": entry["liveUntilMs"] - ms}
                    for ticket_id, entry in data["waiters"].items()
                }
            snap.reference.update(aged)
        # Fence counters' last acquisition, for compaction (the floor has none; a
        # counter kept by a version before acquisition times has none either).
        for snap in self.firestore.client.collection(self.firestore.fence_collection).stream():
            acquired = snap.to_dict().get("acquiredAtMs")
            if acquired is not None:
                snap.reference.update({"acquiredAtMs": acquired - ms})

    def set_fence(self, key: str, value: int) -> None:
        # Without an acquisition time: a counter as kept before compaction existed.
        _, fence_ref = self.firestore._refs(normalize_and_validate_key(key))
        fence_ref.set({"fence": f"{value:015d}"})


class SqliteHarness(DatabaseHarness):
    name = "sqlite"
    capabilities = Capabilities("sqlite", supports_fencing=True, time_authority="client")
    database = "default"

    def advance(self, ms: int) -> None:
        super().advance(ms)
        if self.backend.wake_ups_enabled:  # the queue is in its own file (sqlite.py)
            self.execute(f"UPDATE {QUEUE} SET live_until_ms = live_until_ms - %s", [ms])

    def close(self) -> None:
        # The test databases' flush empties the database file, not the queue file.
        if self.backend.wake_ups_enabled:
            self.execute(f"DELETE FROM {QUEUE}", [])
        super().close()


class PostgresHarness(DatabaseHarness):
    name = "postgres"
    capabilities = Capabilities("postgres", supports_fencing=True, time_authority="server")
    database = "postgres"


class PgBouncerHarness(DatabaseHarness):
    """The database backend on PostgreSQL through PgBouncer in transaction pooling
    mode (the ``pgbouncer`` alias): what most production sites run."""

    name = "pgbouncer"
    capabilities = Capabilities("postgres", supports_fencing=True, time_authority="server")
    database = "pgbouncer"

    def __init__(self, **options: object) -> None:
        # As the README advises behind a transaction pooler: wake-ups LISTEN on a
        # direct connection (through PgBouncer, notifications never arrive).
        super().__init__(**{"LISTEN_DATABASE": "postgres", **options})


HARNESSES: dict[str, type[Harness]] = {
    "memory": MemoryHarness,
    "sqlite": SqliteHarness,
    "postgres": PostgresHarness,
    "pgbouncer": PgBouncerHarness,
    "redis": RedisHarness,
    "redis-sentinel": RedisSentinelHarness,
    "redis-cluster": RedisClusterHarness,
    "firestore": FirestoreHarness,
}

#: Which DATABASES alias each database-backed harness needs.
HARNESS_DATABASES: dict[str, list[str]] = {
    "sqlite": ["default"],
    "postgres": ["postgres"],
    # A mirror of "postgres": its test database is created through that alias.
    "pgbouncer": ["postgres", "pgbouncer"],
}

#: The fixture (tests/conftest.py) of the server each harness needs.
HARNESS_SERVERS = {
    "postgres": "postgres_server",
    "pgbouncer": "pgbouncer",
    "redis": "redis_server",
    "redis-sentinel": "redis_sentinel",
    "redis-cluster": "redis_cluster_harness",
    "firestore": "firestore_emulator",
}
