"""The Redis backend: one Lua script per operation, Redis server time, durable fences.

Settings name ``django_syncguard.backends.redis.RedisBackend``. The package, one
module per concern:

- ``backend.py``: ``RedisBackend``, the operations and the SCAN housekeeping (the
  key layout is described there);
- ``scripts.py``: the Lua scripts, each headed by its KEYS and ARGV;
- ``client.py``: ``RedisClients``, the only place that builds connections (the
  synchronous pool, one asyncio client per event loop, the wake-ups' pub/sub
  connection), and the mapping of redis-py's errors to ``LockError``;
- ``wakeups.py``: ``RedisWakeUps``, the pub/sub subscriber that wakes waiters;
- ``slots.py``: hash slots on a Redis Cluster (per-slot tags, slot-encoded lock ids).

See ``specs/backends/redis.md``.
"""

from .backend import MAX_SCANS_PER_PAGE, W010, W011, W014, RedisBackend
from .client import RedisClients, map_redis_error

__all__ = [
    "MAX_SCANS_PER_PAGE",
    "W010",
    "W011",
    "W014",
    "RedisBackend",
    "RedisClients",
    "map_redis_error",
]
