"""Acquires whose caller gave up, released in the background (issue 23, item 1;
``django_syncguard/orphans.py``).

Four processes each hold a connection to the server, the server stops answering
(Redis: ``SIGSTOP``; PostgreSQL: the stalling proxy holds every byte), and each
process acquires its own key: the call ends in ``NetworkTimeout`` after the operation
timeout, while the request sits in the server's socket (or the proxy). Once the
server answers again it runs those acquires and their locks are held by nobody for
the whole TTL (60 s here). The library chose their lock ids, and releases them: each
process's releaser releases exactly one lock, and no key stays locked.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connections

from django_syncguard import orphans
from django_syncguard.backends.database import DatabaseBackend
from django_syncguard.backends.memory import MemoryBackend
from django_syncguard.backends.redis import RedisBackend
from django_syncguard.errors import NetworkTimeout, ServiceUnavailable
from tests.support.orphan_workers import lose_an_acquire
from tests.support.proxy import FaultProxy
from tests.support.servers import RedisServer

PROCESSES = 4
TIMEOUTS = {"OPERATION_TIMEOUT_MS": 1_000, "CONNECT_TIMEOUT_MS": 1_000}


def orphaned_in_processes(
    backend_path: str,
    params: dict[str, Any],
    databases: dict[str, Any],
    pause: Callable[[], None],
    resume: Callable[[], None],
) -> tuple[list[Any], list[Any], float]:
    """Run the children; between their warm-up and their acquire the server is
    paused; once all four acquires failed it is resumed. Returns the failures, the
    final reports and the seconds from the resume to the last report."""
    ctx = multiprocessing.get_context("spawn")
    ready, paused, resumed = ctx.Barrier(PROCESSES + 1), ctx.Event(), ctx.Event()
    results = ctx.Queue()
    keys = [f"orphan:{n}" for n in range(PROCESSES)]
    procs = [
        ctx.Process(
            target=lose_an_acquire,
            args=(databases, backend_path, params, key, ready, paused, resumed, results),
        )
        for key in keys
    ]
    for proc in procs:
        proc.start()
    try:
        ready.wait(timeout=120)
        pause()
        paused.set()
        failed = [results.get(timeout=60) for _ in procs]
        resume()
        resumed.set()
        started = time.monotonic()
        done = [results.get(timeout=60) for _ in procs]
        elapsed = time.monotonic() - started
        for proc in procs:
            proc.join(timeout=60)
            assert proc.exitcode == 0
    finally:
        resume()
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
    errors = [r for r in failed + done if isinstance(r, BaseException)]
    assert errors == [], errors
    return failed, done, elapsed


def assert_every_orphan_released(failed: list[Any], done: list[Any], checker: Any) -> None:
    """The children's reports, and every key free as ``checker`` (closed here) sees it."""
    try:
        assert failed == [("failed", "NetworkTimeout")] * PROCESSES
        # Each process's acquire ran once the server answered again, and its releaser
        # removed that lock (release ok=True), within RELEASE_BOUND_S; nothing dropped.
        assert done == [("done", 1, 0, True)] * PROCESSES
        locked = [checker.is_locked(f"orphan:{n}") for n in range(PROCESSES)]
        assert locked == [False] * PROCESSES
    finally:
        checker.close()


@pytest.fixture
def paused_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    os.kill(server.process.pid, signal.SIGCONT)  # never leave it stopped
    server.destroy()


@pytest.mark.slow
def test_a_paused_redis_leaves_no_lock_to_callers_that_gave_up(paused_redis):
    pid = paused_redis.process.pid
    prefix = f"orphans{uuid.uuid4().hex[:6]}"
    params = {"LOCATION": paused_redis.url, "KEY_PREFIX": prefix, "OPTIONS": TIMEOUTS}
    failed, done, elapsed = orphaned_in_processes(
        "django_syncguard.backends.redis.RedisBackend",
        params,
        {},
        lambda: os.kill(pid, signal.SIGSTOP),
        lambda: os.kill(pid, signal.SIGCONT),
    )
    assert_every_orphan_released(failed, done, RedisBackend("checker", params))
    print(f"orphans released {elapsed:.2f} s after Redis resumed")


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=["postgres"])
def test_a_stalled_postgres_path_leaves_no_lock_to_callers_that_gave_up(postgres_server):
    proxy = FaultProxy(postgres_server.port).start()
    through_proxy = {**connections["postgres"].settings_dict, "PORT": str(proxy.port)}
    params = {"OPTIONS": {"DATABASE": "postgres", **TIMEOUTS}}
    try:
        failed, done, elapsed = orphaned_in_processes(
            "django_syncguard.backends.database.DatabaseBackend",
            params,
            {"postgres": through_proxy},
            proxy.stall,
            proxy.resume,
        )
    finally:
        proxy.stop()
    assert_every_orphan_released(failed, done, DatabaseBackend("checker", params))
    print(f"orphans released {elapsed:.2f} s after the path resumed")


# ------------------------------------------------------------ the releaser's rules
class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def redis_backend(redis_server) -> Iterator[RedisBackend]:
    prefix = f"orphans{uuid.uuid4().hex[:6]}"
    backend = RedisBackend("orphans", {"LOCATION": redis_server.url, "KEY_PREFIX": prefix})
    yield backend
    backend.close()


def releaser(backend: Any, clock: FakeClock) -> orphans.OrphanReleaser:
    """A releaser without its thread: the test runs its rounds."""
    built = orphans.OrphanReleaser(backend, clock=clock, autostart=False)
    backend.__dict__["_orphans_built"] = built
    return built


def test_an_adopted_lock_that_exists_is_released_in_one_round(redis_backend):
    clock = FakeClock()
    held = redis_backend.acquire("orphan:held", 60_000)
    rel = releaser(redis_backend, clock)
    assert rel.adopt(held.lock_id, "orphan:held", NetworkTimeout("lost")) is True
    assert rel.run_round() is True
    assert (rel.pending, rel.released, rel.dropped) == (0, 1, 0)
    assert redis_backend.is_locked("orphan:held") is False


def test_an_id_that_never_took_a_lock_is_dropped_after_the_settle_window(redis_backend):
    clock = FakeClock()
    rel = releaser(redis_backend, clock)
    rel.adopt("A" * 22, "orphan:never", NetworkTimeout("lost"))
    assert rel.run_round() is True  # answered "not found": the window opens
    (orphan,) = rel._pending.values()
    assert (orphan.misses, orphan.next_at) == (1, clock.now + 0.25)
    clock.now += 0.2
    assert rel.run_round() is True  # not due yet: not asked
    assert orphan.misses == 1
    clock.now += orphans.SETTLE_S - 0.2 - 0.001
    assert rel.run_round() is True
    assert (rel.pending, orphan.misses) == (1, 2)  # a late acquire could still land
    clock.now += 0.5  # past the next pause and the window
    assert rel.run_round() is True
    assert (rel.pending, rel.released, rel.dropped) == (0, 0, 0)


def test_what_redis_says_may_have_run():
    import redis.exceptions as errors
    from redis.sentinel import MasterNotFoundError

    backend = RedisBackend("orphans", {"LOCATION": "redis://127.0.0.1:1/0"})

    def may_have_run(cause: Exception) -> bool:
        return backend._acquire_may_have_run(NetworkTimeout("x", context={"cause": cause}))

    assert may_have_run(errors.TimeoutError("Timeout reading from socket")) is True
    assert may_have_run(errors.ConnectionError("Connection closed by server.")) is True
    assert may_have_run(errors.TimeoutError("Timeout connecting to server")) is False
    assert may_have_run(errors.ConnectionError("Error 111 connecting to 127.0.0.1:1.")) is False
    assert may_have_run(errors.MaxConnectionsError("Too many connections")) is False
    assert may_have_run(errors.ConnectionError("No connection available.")) is False
    assert may_have_run(errors.AuthenticationError("invalid password")) is False
    assert may_have_run(errors.BusyLoadingError("LOADING")) is False
    assert may_have_run(MasterNotFoundError("No master found for 'm'")) is False
    assert may_have_run(errors.ResponseError("TRYAGAIN")) is False
    assert backend._acquire_may_have_run(NetworkTimeout("no cause")) is False


def test_while_the_server_is_down_one_release_per_round_then_give_up():
    server = RedisServer().start()
    backend = RedisBackend(
        "orphans", {"LOCATION": server.url, "KEY_PREFIX": "down", "OPTIONS": TIMEOUTS}
    )
    server.destroy()  # nothing listens on the port any more
    clock = FakeClock()
    rel = releaser(backend, clock)
    for n in range(3):
        rel.adopt(f"{n}" * 22, f"orphan:{n}", NetworkTimeout("lost"))
    assert rel.run_round() is False  # the first release failed: the round stops there
    assert rel.pending == 3
    clock.now += orphans.GIVE_UP_S
    assert rel.run_round() is True  # given up without asking the server
    assert (rel.pending, rel.released, rel.dropped) == (0, 0, 3)
    backend.close()


def test_beyond_max_pending_an_acquire_is_left_to_its_ttl_and_logged(
    redis_backend, monkeypatch, caplog
):
    monkeypatch.setattr(orphans, "MAX_PENDING", 2)
    rel = releaser(redis_backend, FakeClock())
    caplog.set_level(logging.INFO, logger="django_syncguard.orphans")
    assert [rel.adopt(f"{n}" * 22, "orphan:many", NetworkTimeout("x")) for n in range(3)] == [
        True,
        True,
        False,
    ]
    assert rel.pending == 2
    assert caplog.records[-1].levelno == logging.WARNING
    assert "2 acquires already wait for release" in caplog.records[-1].getMessage()


def test_a_refused_connection_adopts_nothing():
    server = RedisServer().start()
    url = server.url
    server.destroy()
    backend = RedisBackend("orphans", {"LOCATION": url, "KEY_PREFIX": "refused"})
    with pytest.raises(ServiceUnavailable):
        backend.acquire("orphan:refused", 60_000)
    assert backend.orphans.pending == 0
    backend.close()


def test_an_embedded_store_adopts_nothing():
    backend = MemoryBackend("orphans")
    backend.acquire("k", 1_000)
    assert backend.abandoned_requests_run is False
    assert "_orphans_built" not in backend.__dict__


async def test_a_cancelled_async_acquire_on_a_stalled_server_is_released(redis_server):
    import asyncio

    proxy = FaultProxy(redis_server.port).start()
    params = {"LOCATION": f"redis://127.0.0.1:{proxy.port}/0", "KEY_PREFIX": "cancelled"}
    backend = RedisBackend("orphans", params)
    try:
        await backend.aacquire("warm-up", 1_000)  # this loop's connection, and the scripts
        proxy.stall()
        task = asyncio.ensure_future(backend.aacquire("orphan:cancelled", 60_000))
        await asyncio.get_running_loop().run_in_executor(None, proxy.wait_for_held_request)
        task.cancel()
        # redis-py's read timeout sometimes turns the cancellation into its own
        # TimeoutError (NetworkTimeout here): either way the request is out.
        with pytest.raises((asyncio.CancelledError, NetworkTimeout)):
            await task
        assert backend.orphans.pending == 1
        proxy.resume()  # the held acquire reaches Redis and takes the key
        assert await asyncio.get_running_loop().run_in_executor(None, backend.orphans.wait_idle, 30)
        assert backend.orphans.released == 1
        assert await backend.ais_locked("orphan:cancelled") is False
    finally:
        proxy.stop()
        backend.close()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_starts_with_no_pending_orphans_of_its_parent(redis_backend):
    from tests.test_fork import Forked

    rel = releaser(redis_backend, FakeClock())
    rel.adopt("P" * 22, "orphan:parent", NetworkTimeout("lost"))

    def child() -> list[Any]:
        mine = redis_backend.orphans
        return [mine is rel, mine.pending]

    forked = Forked(child)
    forked.go()
    assert forked.result() == [False, 0]
    assert redis_backend.orphans is rel and rel.pending == 1


def test_stop_all_ends_every_running_releaser():
    server = RedisServer().start()
    backend = RedisBackend(
        "orphans", {"LOCATION": server.url, "KEY_PREFIX": "stop", "OPTIONS": TIMEOUTS}
    )
    server.destroy()  # its releases fail: the thread would retry for GIVE_UP_S
    try:
        backend.orphans.adopt("S" * 22, "orphan:stop", NetworkTimeout("lost"))
        thread = backend.orphans._thread
        assert thread is not None and thread.is_alive()
        assert orphans.stop_all() == 1
        assert not thread.is_alive()
        assert orphans.stop_all() == 0
    finally:
        backend.close()
