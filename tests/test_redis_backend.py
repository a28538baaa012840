"""What is particular to the Redis backend (the contract suite covers the rest)."""

from __future__ import annotations

import asyncio
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
from django_syncguard.backends.redis import RedisBackend, map_redis_error
from django_syncguard.handler import InvalidBackendError, LockHandler
from tests.support.faults import wait_until
from tests.support.harness import RedisHarness
from tests.support.servers import RedisServer


@pytest.fixture
def rh(redis_server):
    harness = RedisHarness()
    yield harness
    harness.close()


def backend_on(server: RedisServer, **options) -> RedisBackend:
    return RedisBackend("r", {"LOCATION": server.url, "OPTIONS": options})


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
        (lambda: backend.acquire("rt", 10_000), {"time": 1, "hmget": 1, "hset": 1, "set": 1}),
    ]
    for operation, in_script in expected:
        backend.client.config_resetstat()
        operation()
        assert command_calls(backend.client) == {"evalsha": 1, **in_script}


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
    assert set(lock) == {b"f", b"i", b"e", b"a"}
    assert (lock[b"f"], lock[b"i"].decode()) == (b"1", result.lock_id)
    assert backend.client.get(f"{rh.prefix}#id:{result.lock_id}") == (
        f"{rh.prefix}:invoice:42".encode()
    )
    assert backend.client.ttl(f"{rh.prefix}:invoice:42") == -1  # the counter never expires
    assert 60_000 < backend.client.pttl(f"{rh.prefix}#id:{result.lock_id}") <= 61_000
    backend.release(result.lock_id)
    assert backend.client.hgetall(f"{rh.prefix}:invoice:42") == {b"f": b"1"}
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
    backend = backend_on(server)
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
    backend = backend_on(server)
    try:
        [warning] = backend.deploy_check()
        assert warning.id == "syncguard.W010"
        assert "appendonly" in warning.msg
        backend.release(backend.acquire("k", 60_000).lock_id)
        server.restart()
        # What the warning is about: the counter started again.
        assert backend.acquire("k", 60_000).fence == "000000000000001"
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
    backend.acquire("old", 1_000)
    harness.advance(1_000 + 1_500)  # inside the 2000 ms guard
    assert backend.is_locked("old") is False
    assert backend.client.hexists(backend.lock_key("old"), "i") == 1
    harness.advance(1_000)  # 2500 ms past expiry
    assert backend.is_locked("old") is False
    assert backend.client.hgetall(backend.lock_key("old")) == {b"f": b"1"}
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
    assert kwargs["retry"].get_retries() == 0


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
    assert "'redis'" in next(m.msg for m in messages if m.id == "syncguard.W010")


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
