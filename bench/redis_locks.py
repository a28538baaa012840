"""Acquire+release cycles on Redis: our backend next to raw commands and two libraries.

    .venv/bin/python bench/redis_locks.py [--seconds 3] [--rounds 3] [--memory-locks 20000]
        [--methods "syncguard,redis-py Lock"]

Starts a throw-away ``redis-server`` (Debian's package) on a free loopback port and
measures, side by side against it:

- ``syncguard``: ``RedisBackend.acquire`` + ``release`` (one EVALSHA each, with fence,
  lock-id index and server-time expiry);
- ``syncguard pooled``: the same with a connection taken from the pool and given back
  around every call, as before each thread kept its own (decision 54);
- ``raw``: ``SET key token NX PX 30000`` + ``DEL key``: the two-round-trip floor (no
  ownership check on release, no fence);
- ``redis-py Lock``: ``redis.lock.Lock`` (SET NX PX, Lua release), no fence;
- ``python-redis-lock``: ``redis_lock.Lock`` (Lua scripts, a signal list), no fence;

for 1 client, 8 threads and 4 processes, distinct keys and one shared key; then the
memory one held lock costs, next to one ``SET NX PX`` key. The table gives each
method's rate over raw's and over redis-py Lock's (measured in the same run), and a
last line the ratio syncguard / redis-py Lock of the uncontended cycle (1 client,
distinct keys) with fences on (every acquire hands one out; they cannot be turned off).
``--methods`` measures fewer (a short run: ``syncguard,redis-py Lock``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import MethodFactory, machine, print_table, run_selected  # noqa: E402
from tests.support.servers import RedisServer  # noqa: E402

TTL_MS = 30_000


def syncguard(url: str, *, pooled: bool = False) -> MethodFactory:
    from django_syncguard.backends.redis import RedisBackend

    backend = RedisBackend("bench", {"LOCATION": url})
    if pooled:  # the path before decision 54: a connection from the pool per call
        backend.clients.threads = None

    def factory(client: int):
        def acquire(key: str):
            result = backend.acquire(key, TTL_MS)
            return result.lock_id if result.ok else None

        return acquire, backend.release

    return factory


def raw(url: str) -> MethodFactory:
    import redis

    from django_syncguard.keys import generate_lock_id

    client = redis.Redis.from_url(url)

    def factory(n: int):
        def acquire(key: str):
            name = f"raw:{key}"
            return name if client.set(name, generate_lock_id(), nx=True, px=TTL_MS) else None

        return acquire, client.delete

    return factory


def redis_py_lock(url: str) -> MethodFactory:
    import redis

    client = redis.Redis.from_url(url)

    def factory(n: int):
        def acquire(key: str):
            lock = client.lock(f"rpl:{key}", timeout=TTL_MS / 1000, blocking=False)
            return lock if lock.acquire(blocking=False) else None

        return acquire, lambda lock: lock.release()

    return factory


def python_redis_lock(url: str) -> MethodFactory:
    import logging

    import redis
    import redis_lock

    # It logs a warning for every busy non-blocking acquire: thousands a second.
    logging.getLogger("redis_lock").setLevel(logging.ERROR)
    client = redis.Redis.from_url(url)

    def factory(n: int):
        def acquire(key: str):
            lock = redis_lock.Lock(client, f"prl:{key}", expire=TTL_MS // 1000)
            return lock if lock.acquire(blocking=False) else None

        return acquire, lambda lock: lock.release()

    return factory


def syncguard_pooled(url: str) -> MethodFactory:
    return syncguard(url, pooled=True)


METHODS = {
    "syncguard": syncguard,
    "syncguard pooled": syncguard_pooled,
    "raw": raw,
    "redis-py Lock": redis_py_lock,
    "python-redis-lock": python_redis_lock,
}


def memory_per_lock(url: str, count: int) -> tuple[float, float]:
    """(bytes per held syncguard lock, bytes per SET NX PX key), by used_memory deltas."""
    import redis

    from django_syncguard.backends.redis import RedisBackend
    from django_syncguard.keys import generate_lock_id

    client = redis.Redis.from_url(url)
    backend = RedisBackend("memory", {"LOCATION": url})

    def used() -> int:
        return int(client.info("memory")["used_memory"])

    client.flushall()
    before = used()
    for n in range(count):
        assert backend.acquire(f"invoice:{n:07d}", 3_600_000).ok
    ours = (used() - before) / count
    client.flushall()
    before = used()
    for n in range(count):
        client.set(f"syncguard:invoice:{n:07d}", generate_lock_id(), nx=True, px=3_600_000)
    floor = (used() - before) / count
    client.flushall()
    return ours, floor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per method and scenario")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per scenario")
    parser.add_argument("--memory-locks", type=int, default=20_000, help="0 skips it")
    parser.add_argument("--modes", default="1 client,8 threads,4 processes")
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"some of: {', '.join(METHODS)}"
    )
    parser.add_argument(
        "--interleaved",
        type=int,
        metavar="CYCLES",
        help="instead of --modes: one client, every method in turn at each of CYCLES steps",
    )
    args = parser.parse_args()
    names = [name.strip() for name in args.methods.split(",") if name.strip()]
    unknown = sorted(set(names) - set(METHODS))
    if unknown or not names:
        parser.error(f"--methods: unknown {unknown}; known: {', '.join(METHODS)}")
    methods = {name: METHODS[name] for name in names}

    import redis

    server = RedisServer().start()
    try:
        version = redis.Redis.from_url(server.url).info("server")["redis_version"]
        rows, how = run_selected(methods, server.url, args)
        print(
            f"# Redis lock benchmark\n\n{machine()}; redis-server {version} on 127.0.0.1 "
            f"(no persistence); redis-py {redis.__version__}; {how}."
        )
        print_table(
            "acquire + release cycles", rows, args.seconds, baseline="raw", also="redis-py Lock"
        )
        uncontended = {
            name: sample.cycles / (sample.busy_ns / 1e9 if sample.busy_ns else args.seconds)
            for mode, keys, name, sample in rows
            if mode.startswith("1 client") and keys == "distinct"
        }
        if uncontended.get("syncguard") and uncontended.get("redis-py Lock"):
            ratio = uncontended["syncguard"] / uncontended["redis-py Lock"]
            print(
                f"\nUncontended acquire + release (1 client, distinct keys, fences on): "
                f"syncguard / redis-py Lock = {ratio:.2f}"
            )
        if not args.memory_locks:
            return
        ours, floor = memory_per_lock(server.url, args.memory_locks)
        print(
            f"\n## memory\n\n{args.memory_locks:,} held locks on distinct keys "
            f"(`invoice:0000000`...): {ours:.0f} bytes per lock (lock hash with its fence "
            f"counter, and its lock-id index key); one `SET NX PX` key of the same name: "
            f"{floor:.0f} bytes."
        )
    finally:
        server.destroy()


if __name__ == "__main__":
    os.environ.pop("DJANGO_SETTINGS_MODULE", None)
    main()
