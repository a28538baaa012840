"""What is particular to the Redis backend (the contract suite covers the rest)."""

from __future__ import annotations

import asyncio
import random
import socket
import sys
import threading
import time
import uuid

import pytest
import redis

from django_syncguard import (
    AuthFailed,
    Internal,
    InvalidArgument,
    NetworkTimeout,
    ServiceUnavailable,
    generate_lock_id,
)
from django_syncguard.backends.redis import W010, RedisBackend, map_redis_error
from django_syncguard.handler import InvalidBackendError, LockHandler
from django_syncguard.waiting import WaitTicket
from tests.support.faults import wait_until
from tests.support.harness import RedisHarness
from tests.support.proxy import FaultProxy
from tests.support.servers import RedisServer


@pytest.fixture
def rh(redis_server):
    harness = RedisHarness()
    yield harness
    harness.close()


def backend_on(server: RedisServer, **options) -> RedisBackend:
    return RedisBackend("r", {"LOCATION": server.url, "OPTIONS": options})


def server_clock_passed(backend: RedisBackend, fence: int) -> bool:
    """Wait until the server's clock is past ``fence`` (a clock-mode fence runs ahead of
    the clock by the acquisitions made within one millisecond); True then."""
    wait_until(lambda: backend.now_ms() > fence, 5, f"the server's clock passes {fence}")
    return True


def command_calls(client: redis.Redis) -> dict[str, int]:
    """Commands the server ran since CONFIG RESETSTAT (besides that and this INFO)."""
    stats = client.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): int(value["calls"])
        for name, value in stats.items()
        if name not in ("cmdstat_info", "cmdstat_config|resetstat")
    }


# --------------------------------------------------------------- round trips
def test_each_operation_is_one_evalsha(rh):
    backend = rh.redis
    held = backend.acquire("rt", 10_000)  # the first calls load the scripts (NOSCRIPT)
    backend.release(held.lock_id)
    backend.is_locked("rt"), backend.lookup(key="rt"), backend.lookup(lock_id=held.lock_id)
    backend.extend(held.lock_id, 1_000)
    held = backend.acquire("rt", 10_000)
    # Each operation: the client sends one EVALSHA; everything else runs in its script.
    expected = [
        (lambda: backend.acquire("rt", 10_000), {"time": 1, "hmget": 1}),  # contended
        (lambda: backend.is_locked("rt"), {"time": 1, "hmget": 1}),
        (lambda: backend.lookup(key="rt"), {"time": 1, "hmget": 1}),
        (lambda: backend.lookup(lock_id=held.lock_id), {"time": 1, "get": 1, "hmget": 1}),
        (
            lambda: backend.extend(held.lock_id, 10_000),
            {"time": 1, "get": 1, "hmget": 1, "hset": 1, "pexpire": 1},
        ),
        (
            lambda: backend.release(held.lock_id),
            {"time": 1, "get": 1, "hmget": 1, "hdel": 1, "del": 1},
        ),
        (lambda: backend.release(held.lock_id), {"time": 1, "get": 1}),
        # A free key: the fence floor is read too (GET), in the same script.
        (
            lambda: backend.acquire("rt", 10_000),
            {"time": 1, "hmget": 1, "get": 1, "hset": 1, "set": 1},
        ),
    ]
    for operation, in_script in expected:
        backend.client.config_resetstat()
        operation()
        assert command_calls(backend.client) == {"evalsha": 1, **in_script}


def test_a_call_that_timed_out_leaves_no_late_reply_for_the_next_call(redis_server):
    # Scripts go out on the thread's connection without redis-py's per-command layers
    # (client.ThreadConnections): a connection whose reply did not come in time must be
    # closed, not handed to the next call, which would read the late reply as its own.
    with FaultProxy(redis_server.port) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}/0"
        options = {"OPERATION_TIMEOUT_MS": 300, "FENCES": "counter"}
        backend = RedisBackend("late", {"LOCATION": url, "KEY_PREFIX": "late", "OPTIONS": options})
        try:
            held = backend.acquire("late", 60_000)  # connected; the scripts are loaded
            assert backend.lookup(key="late").fence == held.fence == "000000000000001"
            assert backend.is_locked("free") is False
            accepted = proxy.accepted
            proxy.set_latency(250)  # a round trip: 500 ms, past the timeout
            with pytest.raises(NetworkTimeout):
                backend.lookup(key="late")  # its reply is on its way, late
            proxy.set_latency(0)
            # On that connection, the first reply would be the lookup's.
            assert backend.is_locked("free") is False
            assert backend.lookup(key="late").fence == "000000000000001"
            assert proxy.accepted == accepted + 1  # a new connection
            # The thread's own connection (client.ThreadConnections), opened again.
            pool = backend.client.connection_pool
            assert len(pool._available_connections) + len(pool._in_use_connections) == 1
        finally:
            backend.close()


async def test_an_async_call_that_timed_out_leaves_no_late_reply_for_the_next_call(redis_server):
    # The same for the asyncio client's path (client.adirect_command).
    with FaultProxy(redis_server.port) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}/0"
        options = {"OPERATION_TIMEOUT_MS": 300, "FENCES": "counter"}
        backend = RedisBackend("late", {"LOCATION": url, "KEY_PREFIX": "alate", "OPTIONS": options})
        try:
            held = await backend.aacquire("late", 60_000)
            assert (await backend.alookup(key="late")).fence == held.fence == "000000000000001"
            assert await backend.ais_locked("free") is False
            accepted = proxy.accepted
            proxy.set_latency(250)
            with pytest.raises(NetworkTimeout):
                await backend.alookup(key="late")
            proxy.set_latency(0)
            assert await backend.ais_locked("free") is False
            assert (await backend.alookup(key="late")).fence == "000000000000001"
            assert proxy.accepted == accepted + 1
        finally:
            await backend.clients.aclose()  # this loop's client, before the proxy goes
            backend.close()


def single_connection_backend(server: RedisServer) -> RedisBackend:
    """A backend whose redis-py clients keep one connection each."""
    options = {"CLIENT_KWARGS": {"single_connection_client": True}}
    prefix = f"single{uuid.uuid4().hex[:6]}"
    return RedisBackend(
        "single", {"LOCATION": server.url, "KEY_PREFIX": prefix, "OPTIONS": options}
    )


def test_a_single_connection_client_runs_the_scripts_on_its_connection(redis_server):
    backend = single_connection_backend(redis_server)
    try:
        connection = backend.client.connection
        assert connection is not None
        held = backend.acquire("one", 60_000)
        assert backend.lookup(lock_id=held.lock_id).fence == held.fence
        assert backend.release(held.lock_id).ok is True
        assert backend.client.connection is connection  # the same one throughout
        assert backend.client.connection_pool._created_connections == 1
    finally:
        backend.close()


async def test_a_single_connection_async_client_runs_the_scripts_on_its_connection(redis_server):
    backend = single_connection_backend(redis_server)
    try:
        held = await backend.aacquire("one", 60_000)
        client = backend.clients.async_client()
        connection = client.connection
        assert connection is not None
        assert (await backend.alookup(lock_id=held.lock_id)).fence == held.fence
        assert (await backend.arelease(held.lock_id)).ok is True
        assert client.connection is connection
        pool = client.connection_pool
        assert (list(pool._in_use_connections), pool._available_connections) == ([connection], [])
    finally:
        await backend.clients.aclose()
        backend.close()


# --------------------------------------------------------------- key layout
def test_user_keys_cannot_reach_index_or_fence_entries(rh):
    backend = rh.redis
    victim = backend.acquire("x", 60_000)
    assert victim.fence == "000000000000001"
    lookalikes = [
        f"id:{victim.lock_id}",  # the seeds' index key name of the victim's lock
        f"#id:{victim.lock_id}",
        "fence:x",
        f"fence:{rh.prefix}:x",  # the seeds' fence key name of "x"
        f"{rh.prefix}:x",
    ]
    for key in lookalikes:
        result = backend.acquire(key, 60_000)
        assert result.fence == "000000000000001", key  # a counter of its own
        assert backend.release(result.lock_id).ok
    # The victim's lock, index and counter are untouched.
    assert backend.lookup(lock_id=victim.lock_id).fence == "000000000000001"
    assert backend.release(victim.lock_id).ok
    assert backend.acquire("x", 60_000).fence == "000000000000002"


def test_layout_is_one_hash_and_one_index_key_per_held_lock(rh):
    backend = rh.redis
    result = backend.acquire("invoice:42", 60_000)
    keys = sorted(k.decode() for k in backend.client.scan_iter(match=f"{rh.prefix}*"))
    assert keys == [f"{rh.prefix}#id:{result.lock_id}", f"{rh.prefix}:invoice:42"]
    lock = backend.client.hgetall(f"{rh.prefix}:invoice:42")
    # 'o': the owner label (OPTIONS["RECORD_OWNER"], on by default).
    assert set(lock) == {b"f", b"i", b"e", b"a", b"o"}
    assert (lock[b"f"], lock[b"i"].decode()) == (b"1", result.lock_id)
    assert lock[b"o"].decode() == backend.lookup(key="invoice:42").owner
    assert backend.client.get(f"{rh.prefix}#id:{result.lock_id}") == (
        f"{rh.prefix}:invoice:42".encode()
    )
    assert backend.client.ttl(f"{rh.prefix}:invoice:42") == -1  # the counter never expires
    assert 60_000 < backend.client.pttl(f"{rh.prefix}#id:{result.lock_id}") <= 61_000
    backend.release(result.lock_id)
    # The counter and the last acquisition time stay (compaction reads the latter).
    assert backend.client.hgetall(f"{rh.prefix}:invoice:42") == {b"f": b"1", b"a": lock[b"a"]}
    assert backend.client.exists(f"{rh.prefix}#id:{result.lock_id}") == 0


def test_hashed_storage_keys_keep_the_raw_key(redis_server):
    # A prefix long enough that a 512-byte key must be hashed; the index keeps the full
    # lock-hash name (specs/backends/redis.md, Key layout).
    prefix = "p" * 480
    backend = RedisBackend("r", {"LOCATION": redis_server.url, "KEY_PREFIX": prefix})
    key = "k" * 512
    result = backend.acquire(key, 60_000)
    lock_key = backend.lock_key(key)
    assert len(lock_key) == len(prefix) + 1 + 22
    assert backend.lookup_raw(lock_id=result.lock_id).key == key
    assert backend.lookup_raw(key=key).lock_id == result.lock_id
    assert backend.extend(result.lock_id, 60_000).ok
    assert backend.release(result.lock_id).ok
    backend.client.delete(lock_key)
    backend.close()


# ---------------------------------------------------------- restarts and AOF
@pytest.mark.slow
def test_fences_keep_increasing_across_a_restart_with_aof():
    server = RedisServer(aof=True).start()
    backend = backend_on(server, FENCES="counter")  # counters alone carry the fences
    try:
        for expected in ("000000000000001", "000000000000002"):
            result = backend.acquire("k", 60_000)
            assert result.fence == expected
            backend.release(result.lock_id)
        server.restart()
        # The same backend object reconnects by itself (the pool replaces a connection
        # the server closed before sending anything on it).
        assert backend.acquire("k", 60_000).fence == "000000000000003"
        assert backend.deploy_check() == []
    finally:
        backend.close()
        server.destroy()


@pytest.mark.slow
def test_without_aof_fences_are_lost_and_the_deploy_check_says_so():
    server = RedisServer(aof=False).start()
    backend = backend_on(server, FENCES="counter")  # the mode whose fences restart
    try:
        [warning] = backend.deploy_check()
        assert warning.id == "syncguard.W010"
        assert warning.msg == W010.format(alias="r", mode="counter")
        backend.release(backend.acquire("k", 60_000).lock_id)
        server.restart()
        # What the warning is about: the counter started again.
        assert backend.acquire("k", 60_000).fence == "000000000000001"
    finally:
        backend.close()
        server.destroy()


@pytest.mark.slow
def test_without_aof_clock_fences_keep_increasing_across_a_restart():
    server = RedisServer(aof=False).start()
    backend = backend_on(server)  # the default mode: clock
    try:
        [warning] = backend.deploy_check()
        assert warning.msg == W010.format(alias="r", mode="clock")
        held = backend.acquire("k", 60_000)
        last = int(held.fence)
        server.restart()
        # The lock and its counter are gone; the server's clock is past the last fence
        # (a restart takes far longer than a millisecond), so the next one is above it.
        assert server_clock_passed(backend, last)
        assert backend.lookup(key="k") is None
        assert int(backend.acquire("k", 60_000).fence) > last
    finally:
        backend.close()
        server.destroy()


def test_deploy_check_reports_an_unreachable_server():
    backend = RedisBackend("r", {"LOCATION": "redis://127.0.0.1:1/0"})
    [warning] = backend.deploy_check()
    assert warning.id == "syncguard.W011"
    assert "Connection refused" in warning.msg


# --------------------------------------------------------------------- errors
def test_refused_connection_is_service_unavailable():
    backend = RedisBackend("dead", {"LOCATION": "redis://127.0.0.1:1/0"})
    with pytest.raises(ServiceUnavailable) as caught:
        backend.acquire("k", 1_000)
    assert isinstance(caught.value.__cause__, redis.exceptions.ConnectionError)
    assert "'dead'" in str(caught.value)


async def test_refused_connection_is_service_unavailable_async():
    backend = RedisBackend("dead", {"LOCATION": "redis://127.0.0.1:1/0"})
    with pytest.raises(ServiceUnavailable):
        await backend.aacquire("k", 1_000)


def test_silent_server_times_out_without_retrying():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
    backend = RedisBackend("silent", {"LOCATION": url, "OPTIONS": {"OPERATION_TIMEOUT_MS": 300}})
    started = time.monotonic()
    with pytest.raises(NetworkTimeout):
        backend.acquire("k", 1_000)
    assert time.monotonic() - started < 30  # bounded, and no retry loop behind it
    backend.close()
    silent.close()


@pytest.mark.slow
def test_wrong_password_is_auth_failed():
    server = RedisServer().start()
    admin = redis.Redis.from_url(server.url)
    admin.config_set("requirepass", "s3cret")
    try:
        with pytest.raises(AuthFailed):
            backend_on(server).acquire("k", 1_000)
        wrong = RedisBackend(
            "r", {"LOCATION": server.url, "OPTIONS": {"CLIENT_KWARGS": {"password": "nope"}}}
        )
        with pytest.raises(AuthFailed):
            wrong.is_locked("k")
        right = RedisBackend(
            "r", {"LOCATION": server.url, "OPTIONS": {"CLIENT_KWARGS": {"password": "s3cret"}}}
        )
        assert right.acquire("k", 1_000).ok
    finally:
        server.destroy()


@pytest.mark.parametrize("operation", ["acquire", "aacquire"])
def test_a_user_without_permission_for_scripts_is_auth_failed(redis_server, operation):
    admin = redis.Redis.from_url(redis_server.url)
    admin.acl_setuser(
        "noscripts", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-evalsha"]
    )
    options = {"CLIENT_KWARGS": {"username": "noscripts", "password": "pw"}}
    backend = RedisBackend("r", {"LOCATION": redis_server.url, "OPTIONS": options})
    try:
        call = {
            "acquire": lambda: backend.acquire("k", 1_000),
            "aacquire": lambda: asyncio.run(backend.aacquire("k", 1_000)),
        }[operation]
        with pytest.raises(AuthFailed, match="no permissions to run the 'evalsha' command"):
            call()
    finally:
        backend.close()
        admin.acl_deluser("noscripts")
        admin.close()


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (redis.exceptions.ConnectionError("refused"), ServiceUnavailable),
        (redis.exceptions.BusyLoadingError("loading"), ServiceUnavailable),
        (redis.exceptions.TimeoutError("slow"), NetworkTimeout),
        (redis.exceptions.AuthenticationError("bad"), AuthFailed),
        (redis.exceptions.ResponseError("NOAUTH Authentication required."), AuthFailed),
        (redis.exceptions.ResponseError("WRONGPASS invalid username-password"), AuthFailed),
        (redis.exceptions.ResponseError("NOPERM this user has no permissions"), AuthFailed),
        (redis.exceptions.ResponseError("BUSY Redis is busy running a script"), ServiceUnavailable),
        (redis.exceptions.ResponseError("OOM command not allowed"), ServiceUnavailable),
        (redis.exceptions.ReadOnlyError("READONLY You can't write"), ServiceUnavailable),
        (redis.exceptions.ResponseError("ERR something odd"), Internal),
    ],
)
def test_redis_errors_are_mapped(error, expected):
    mapped = map_redis_error(error, "r")
    assert type(mapped) is expected
    assert mapped.context["cause"] is error


# -------------------------------------------------------------------- cleanup
def test_cleanup_in_is_locked_removes_lock_fields_but_keeps_the_fence(redis_server):
    harness = RedisHarness(CLEANUP_IN_IS_LOCKED=True)
    backend = harness.redis
    acquired_at = backend.lookup(lock_id=backend.acquire("old", 1_000).lock_id).acquired_at_ms
    harness.advance(1_000 + 1_500)  # inside the 2000 ms guard
    assert backend.is_locked("old") is False
    assert backend.client.hexists(backend.lock_key("old"), "i") == 1
    harness.advance(1_000)  # 2500 ms past expiry
    assert backend.is_locked("old") is False
    # The counter and the last acquisition time (aged with the lock) stay.
    acquired = str(acquired_at - 3_500).encode()
    assert backend.client.hgetall(backend.lock_key("old")) == {b"f": b"1", b"a": acquired}
    assert backend.acquire("old", 1_000).fence == "000000000000002"
    harness.close()


def test_cleanup_batches_stay_within_batch_size_when_scan_returns_more(rh):
    # SCAN's COUNT is a hint: a call returns whole hash buckets, so with 300 keys some
    # calls return more than one name for COUNT 1. Each batch must still be <= 1.
    for n in range(300):
        rh.redis.acquire(f"many:{n}", 1_000)
    rh.advance(60_000)

    batches = list(rh.redis.delete_expired(batch_size=1))

    assert sum(batches) == 300
    assert set(batches) == {1}


def test_is_locked_never_writes_without_cleanup(rh):
    rh.redis.acquire("k", 1_000)
    rh.advance(60_000)
    rh.redis.client.config_resetstat()
    assert rh.redis.is_locked("k") is False
    assert rh.redis.client.hexists(rh.redis.lock_key("k"), "i") == 1


# ---------------------------------------------------------- fence continuity
@pytest.fixture
def default_backend(redis_server):
    """A backend with the default options (clock fences), under a prefix of its own."""
    prefix = f"sg{uuid.uuid4().hex[:12]}"
    backend = RedisBackend("r", {"LOCATION": redis_server.url, "KEY_PREFIX": prefix})
    yield backend
    keys = list(backend.client.scan_iter(match=f"{prefix}[:#]*", count=1000))
    if keys:
        backend.client.delete(*keys)
    backend.close()


def take_and_release(backend: RedisBackend, key: str) -> int:
    result = backend.acquire(key, 60_000)
    assert result.ok and backend.release(result.lock_id).ok
    return int(result.fence)


def test_clock_fences_are_the_default_and_outlive_a_lost_counter(default_backend, rh):
    backend = default_backend
    assert backend.fence_mode == "clock"
    fences = [take_and_release(backend, "lost") for _ in range(3)]
    assert fences[0] < fences[1] < fences[2]
    # The counter is lost, as with a restart without AOF or a failover that missed it.
    assert backend.client.delete(backend.lock_key("lost")) == 1
    assert server_clock_passed(backend, fences[2])
    assert take_and_release(backend, "lost") > fences[2]

    # The premise, in counter mode: the same loss starts the key's fences again.
    counted = rh.redis
    assert [take_and_release(counted, "lost") for _ in range(3)] == [1, 2, 3]
    assert counted.client.delete(counted.lock_key("lost")) == 1
    assert take_and_release(counted, "lost") == 1


def keys_touched(client: redis.Redis, run) -> set[str]:
    """The keys of every command that scripts ran on the server during ``run()``, as
    the server names them (MONITOR, then COMMAND GETKEYS on each). Keys and arguments
    must be free of spaces (MONITOR's lines are split on them)."""
    marker = f"done-{uuid.uuid4().hex}"
    touched: set[str] = set()
    with client.monitor() as monitor:
        run()
        client.echo(marker)
        while (seen := monitor.next_command())["command"] != f"ECHO {marker}":
            if seen["client_type"] != "lua":
                continue
            try:
                keys = client.command_getkeys(*seen["command"].split(" "))
            except redis.exceptions.ResponseError:  # TIME, PUBLISH: no key arguments
                continue
            touched.update(k if isinstance(k, str) else k.decode() for k in keys)
    return touched


def test_the_acquire_script_touches_only_the_keys_it_declares(rh, monkeypatch):
    # Redis Cluster routes a script by its KEYS (issue 22): the floor must be one.
    backend = rh.redis
    declared: list[str] = []
    call = backend._call

    def recording(name: str, keys: list[str], args: list[object]) -> object:
        if name == "acquire":
            declared.extend(keys)
        return call(name, keys, args)

    monkeypatch.setattr(backend, "_call", recording)
    backend.raise_fence_floor(10)
    ticket = WaitTicket.new()
    held = backend.acquire("declared", 60_000)
    assert declared[2] == f"{rh.prefix}#floor" == backend.floor_key

    def the_queue_path() -> None:
        assert backend.acquire("declared", 60_000, ticket=ticket).queue_position == 0
        assert backend.release(held.lock_id).ok
        assert backend.acquire("declared", 60_000, ticket=ticket).fence == "000000000000012"

    declared.clear()
    touched = keys_touched(backend.client, lambda: take_and_release(backend, "free"))
    touched |= keys_touched(backend.client, the_queue_path)
    index_keys = {k for k in touched if k.startswith(f"{rh.prefix}#id:")}
    assert touched - index_keys == {
        backend.lock_key("free"),
        backend.lock_key("declared"),
        backend.floor_key,
    }
    assert touched <= set(declared) | {backend.index_key(held.lock_id)}  # release's own


def test_raising_the_floor_from_many_threads_ends_at_the_largest(rh):
    backend = rh.redis
    values = list(range(1, 401))
    random.Random(22).shuffle(values)
    threads = 8
    barrier = threading.Barrier(threads)
    seen: dict[int, list[tuple[int, int]]] = {}

    def raise_some(n: int) -> None:
        barrier.wait()
        seen[n] = [(value, backend.raise_fence_floor(value)) for value in values[n::threads]]

    workers = [threading.Thread(target=raise_some, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()

    assert backend.fence_state().floor == 400
    for answers in seen.values():
        floors = [floor for _, floor in answers]
        assert all(floor >= value for value, floor in answers)  # never below a raise
        assert floors == sorted(floors)  # never lowered by another thread's raise


def test_compaction_batches_stay_within_batch_size_when_scan_returns_more(rh):
    # As for cleanup: a SCAN reply larger than the batch is taken in slices.
    for n in range(300):
        take_and_release(rh.redis, f"many:{n}")
    rh.advance(60_000)

    batches = list(rh.redis.compact_fences(idle_ms=30_000, batch_size=1))

    assert sum(batches) == 300
    assert set(batches) == {1}
    assert rh.redis.fence_state().highest == 0


def backend_now(rh) -> int:
    return rh.redis.now_ms()


def test_one_compaction_deletes_every_idle_counter_while_the_table_shrinks(rh):
    # 20,000 idle counters in batches of 100: each batch's deletes shrink Redis's
    # table while SCAN walks it (bench/fences.py found a run leaving 4 in 20 behind
    # when a reply's remainder was fetched again by repeating the SCAN call).
    backend, old = rh.redis, backend_now(rh) - 86_400_000
    pipe = backend.client.pipeline(transaction=False)
    for n in range(20_000):
        pipe.hset(backend.lock_key(f"single:{n}"), mapping={"f": n + 1, "a": old})
    pipe.execute()

    assert sum(backend.compact_fences(idle_ms=60_000, batch_size=100)) == 20_000

    assert list(backend.client.scan_iter(match=f"{rh.prefix}:*", count=1000)) == []
    assert backend.fence_state().floor == 20_000


def test_a_compaction_cursor_from_elsewhere_is_refused(rh):
    with pytest.raises(InvalidArgument, match="cursor is not one this backend returned"):
        rh.redis._idle_counters(0, "12:abc", 10, stamp=False)


def test_compaction_spares_a_live_waiter_and_not_a_dead_one(rh):
    backend = rh.redis
    held = backend.acquire("waited", 60_000)
    # The release grants the key to the first waiter, which never claims it (its
    # process is gone): the grant lapses, and the second waiter is still queued.
    granted = WaitTicket(id=generate_lock_id(), patience_ms=60_000)
    ticket = WaitTicket(id=generate_lock_id(), patience_ms=60_000)
    assert backend.acquire("waited", 60_000, ticket=granted).queue_position == 0
    assert backend.acquire("waited", 60_000, ticket=ticket).queue_position == 1
    assert backend.release(held.lock_id).ok
    rh.advance(10_000)  # acquired 10 s ago; the waiter's place lasts 50 s more

    assert sum(backend.compact_fences(idle_ms=5_000)) == 0
    assert backend.client.hget(backend.lock_key("waited"), "q") == b"1"

    rh.advance(60_000)  # the waiter never came back (its process died)
    assert sum(backend.compact_fences(idle_ms=5_000)) == 1
    assert backend.client.exists(backend.lock_key("waited")) == 0
    assert backend.fence_state().floor == 2  # fence 2 went to the lapsed grant
    assert backend.acquire("waited", 60_000, ticket=ticket).fence == "000000000000003"


# -------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"LOCATION": "redis://x", "KEY_PREFIX": ""}, "KEY_PREFIX must be non-empty"),
        ({"LOCATION": "redis://x", "KEY_PREFIX": ":::"}, "KEY_PREFIX must be non-empty"),
        ({"LOCATION": "redis://x", "KEY_PREFIX": "a#id"}, "free of '#'"),
        ({}, "LOCATION must be a redis:// URL"),
        ({"LOCATION": "http://nope"}, "is not a redis URL"),
        ({"LOCATION": "redis://x", "OPTIONS": {"MAX_CONNECTIONS": 0}}, "MAX_CONNECTIONS"),
        ({"LOCATION": "redis://x", "OPTIONS": {"CLIENT_KWARGS": []}}, "CLIENT_KWARGS"),
    ],
)
def test_bad_configuration_is_refused(params, message):
    with pytest.raises(InvalidArgument, match=message):
        RedisBackend("r", params)


def test_timeouts_and_single_attempt_are_set_on_the_pool():
    backend = RedisBackend(
        "r",
        {
            "LOCATION": "redis://x",
            "OPTIONS": {"CONNECT_TIMEOUT_MS": 1_500, "OPERATION_TIMEOUT_MS": 700},
        },
    )
    kwargs = backend.client.connection_pool.connection_kwargs
    assert kwargs["socket_connect_timeout"] == 1.5
    assert kwargs["socket_timeout"] == 0.7
    retry = kwargs["retry"]
    # (redis-py before 5.3 has no get_retries(): the floor's tox cell runs this too)
    assert (retry.get_retries() if hasattr(retry, "get_retries") else retry._retries) == 0


def test_missing_extra_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)
    handler = LockHandler(
        {"r": {"BACKEND": "django_syncguard.backends.redis.RedisBackend", "LOCATION": "redis://x"}}
    )
    with pytest.raises(InvalidBackendError, match=r'pip install "django-syncguard\[redis\]"'):
        handler["r"]


def test_release_of_unknown_lock_id_sends_one_command(rh):
    assert rh.redis.release(generate_lock_id()).reason == "not-found"


def test_check_deploy_warns_about_redis_without_aof(settings, redis_server):
    from django.core import checks

    settings.SYNCGUARD_BACKENDS = {
        "default": {"BACKEND": "django_syncguard.backends.memory.MemoryBackend"},
        "redis": {
            "BACKEND": "django_syncguard.backends.redis.RedisBackend",
            "LOCATION": redis_server.url,
        },
    }
    messages = checks.run_checks(tags=["syncguard"], include_deployment_checks=True)
    assert [m.id for m in messages if m.id.startswith("syncguard.W01")] == ["syncguard.W010"]
    [message] = [m.msg for m in messages if m.id == "syncguard.W010"]
    assert message == W010.format(alias="redis", mode="clock")
    assert message.startswith("Lock backend 'redis' (fence mode 'clock'): ")
    assert "fenced writes stay safe" in message
    assert "OPTIONS FENCES 'clock'" in message
    assert "manage.py syncguard_fences raise-floor" in message


def test_check_deploy_names_the_counter_mode_of_the_alias(settings, redis_server):
    from django.core import checks

    settings.SYNCGUARD_BACKENDS = {
        "default": {"BACKEND": "django_syncguard.backends.memory.MemoryBackend"},
        "counted": {
            "BACKEND": "django_syncguard.backends.redis.RedisBackend",
            "LOCATION": redis_server.url,
            "OPTIONS": {"FENCES": "counter"},
        },
    }
    messages = checks.run_checks(tags=["syncguard"], include_deployment_checks=True)
    [message] = [m.msg for m in messages if m.id == "syncguard.W010"]
    assert message == W010.format(alias="counted", mode="counter")
    assert message.startswith("Lock backend 'counted' (fence mode 'counter'): ")


def test_close_closes_the_async_client_of_every_loop(redis_server):
    """``close()`` closes the asyncio client of a loop running on another thread, on
    that loop, as well as the synchronous pool: the server sees both go."""
    name = f"sg-close-{uuid.uuid4().hex[:12]}"
    options = {"CLIENT_KWARGS": {"client_name": name}}
    backend = RedisBackend("close", {"LOCATION": redis_server.url, "OPTIONS": options})
    observer = redis.Redis.from_url(redis_server.url)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def connected() -> int:
        return sum(1 for client in observer.client_list() if client["name"] == name)

    try:
        assert backend.is_locked("k") is False
        ais_locked = asyncio.run_coroutine_threadsafe(backend.ais_locked("k"), loop)
        assert ais_locked.result(10) is False
        assert connected() == 2  # the synchronous pool's connection, the loop's
        backend.close()
        wait_until(lambda: connected() == 0, 10, "both connections are closed")
        assert connected() == 0
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        observer.close()
