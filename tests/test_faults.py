"""Fault injection on every server backend: PostgreSQL, Redis, Firestore emulator.

Network faults go through ``tests/support/proxy.py``, a TCP proxy between a backend and the
session's server: latency, a stall (connections held open, no byte forwarded, like a
frozen server or middlebox: TCP keepalives still see a healthy peer), and a drop
(every connection reset). Crashes use servers of their own, never the session's:
worker processes take one key in a loop while the server is killed and restarted on
the same port and data (``tests/support/faults.py``).

What each backend does, as asserted below (timeouts of 1000 ms):

- Latency below the timeout: every operation works, only slower.
- Stalled path, any operation (sync or async): ``NetworkTimeout`` on every backend.
  Redis after OPERATION_TIMEOUT_MS (socket timeout), Firestore after it too (RPC
  deadline), PostgreSQL after OPERATION_TIMEOUT_MS + 1 s on an open connection
  (psycopg's bounded wait; statement_timeout never fires on a server that never got
  the statement) or CONNECT_TIMEOUT_MS (libpq: at least 2 s) on a new one.
- Every connection reset, then the next call: PostgreSQL raises
  ``ServiceUnavailable`` once (it finds the dead connection by using it) and the call
  after reconnects; Redis succeeds (the pool checks an idle connection before handing
  it out); Firestore succeeds (gRPC saw the reset and reconnects).
- Reset while a call waits for its reply: ``ServiceUnavailable`` at once, everywhere.
- Server killed mid-traffic and restarted on the same port and data: the workers see
  ``ServiceUnavailable`` (or ``NetworkTimeout``) only, the same backend objects carry
  on, no two workers ever hold the lock at once, and fences continue: PostgreSQL
  (commits are durable), Redis with AOF ``appendfsync always``, the emulator exported
  at a graceful stop and imported at start.
- Killed without persistence (Redis without AOF, the emulator): fences start again
  at 1, the documented limit.

Never a raw driver exception: every error is a ``django_syncguard.errors`` class
with the driver's exception chained as ``__cause__`` and ``context["cause"]``.
"""

from __future__ import annotations

import asyncio
import copy
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import suppress
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connections

from django_syncguard.backends.base import BaseLockBackend
from django_syncguard.backends.database import DatabaseBackend
from django_syncguard.backends.firestore import FirestoreBackend
from django_syncguard.backends.redis import RedisBackend
from django_syncguard.errors import LockError, NetworkTimeout, ServiceUnavailable
from django_syncguard.results import ReleaseResult
from tests.support.faults import OUTAGE_ERRORS, Outcome, crash_under_traffic
from tests.support.proxy import FaultProxy
from tests.support.servers import (
    FirestoreEmulator,
    PostgresServer,
    RedisServer,
    start_or_skip,
)

pytestmark = pytest.mark.slow

TIMEOUT_MS = 1_000
TIMEOUTS = {"OPERATION_TIMEOUT_MS": TIMEOUT_MS, "CONNECT_TIMEOUT_MS": TIMEOUT_MS}
#: The longest a stalled call may take by design: PostgreSQL waits for a reply
#: OPERATION_TIMEOUT_MS + 1 s, and libpq's connect_timeout is at least 2 s.
STALL_BOUND_S = {"postgres": 2.0, "redis": TIMEOUT_MS / 1000, "firestore": TIMEOUT_MS / 1000}
#: Slack on top of that bound: enough for a loaded machine, far below a hang.
MARGIN_S = 5.0
LATENCY_MS = 150  # a round trip pays it twice: 300 ms, well below the timeout
FIRST, SECOND = "000000000000001", "000000000000002"
PROJECT = "syncguard-test"
FIRESTORE_HOST = "FIRESTORE_EMULATOR_HOST"

# The proxied fixture asks for the session server a "harness" parameter names (which
# skips the test when it cannot start, or fails it in CI); conftest.py gives
# "postgres" its test DB.
on_every_server = pytest.mark.parametrize("harness", ["postgres", "redis", "firestore"])

#: After the proxy reset every connection, the next call on the same backend object:
#: None when it reconnects by itself and succeeds, else the error it raises (once).
AFTER_DROP: dict[str, type[LockError] | None] = {
    "postgres": None,  # a call checks its idle connection before sending
    "redis": None,  # the pool checks an idle connection before handing it out
    # gRPC usually saw the reset and reconnects; when it had not yet, the first call
    # fails with UNAVAILABLE ("Stream removed") and the next one reconnects.
    "firestore": None,
}
#: Backends whose first call after a drop may fail (once) with ServiceUnavailable.
MAY_FAIL_ONCE_AFTER_DROP = {"firestore"}


def assert_mapped(exc: BaseException, expected: type[LockError]) -> None:
    """``exc`` is exactly ``expected``, from our errors module, with the driver's
    exception chained."""
    assert type(exc) is expected, f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"
    assert type(exc).__module__ == "django_syncguard.errors"
    cause = exc.__cause__
    assert cause is not None
    assert cause is exc.context["cause"]  # type: ignore[attr-defined]
    assert not type(cause).__module__.startswith("django_syncguard")


def own(server: Any) -> Any:
    """Start a server of the test's own, or skip (fail in CI) when it cannot run."""
    return start_or_skip(server, type(server).__name__)


# ------------------------------------------------------------ proxied backends
@dataclass
class Proxied:
    """A backend whose every connection goes through ``proxy``. Sync calls run in
    one worker thread (the database backend's connections are per thread), so that
    a hang fails the test instead of blocking it."""

    kind: str
    backend: BaseLockBackend
    proxy: FaultProxy
    executor: ThreadPoolExecutor

    def __call__(self, call: Callable[[], Any]) -> Any:
        return self.executor.submit(call).result(timeout=60)

    def start(self, call: Callable[[], Any]) -> Future[tuple[Any, float]]:
        """Start ``call()``; the future gives its result (or the exception it raised)
        and how long it took."""

        def measured() -> tuple[Any, float]:
            started = time.monotonic()
            try:
                outcome = call()
            except Exception as exc:
                outcome = exc
            return outcome, time.monotonic() - started

        return self.executor.submit(measured)

    def timed(self, call: Callable[[], Any]) -> tuple[Any, float]:
        limit = STALL_BOUND_S[self.kind] + MARGIN_S
        try:
            return self.start(call).result(timeout=limit)
        except FutureTimeout:
            pytest.fail(f"the call hung for more than {limit} s")

    def after_drop(self, call: Callable[[], Any]) -> Any:
        """``call()`` right after a drop: on a backend that may notice the reset only
        by using the connection, a first ``ServiceUnavailable`` is allowed, once."""
        if self.kind in MAY_FAIL_ONCE_AFTER_DROP:
            outcome, _ = self.timed(call)
            if not isinstance(outcome, Exception):
                return outcome
            assert_mapped(outcome, ServiceUnavailable)
        return self(call)

    def fails_within_bound(self, call: Callable[[], Any], expected: type[LockError]) -> None:
        outcome, elapsed = self.timed(call)
        assert isinstance(outcome, Exception), f"succeeded: {outcome!r}"
        assert_mapped(outcome, expected)
        assert elapsed < STALL_BOUND_S[self.kind] + MARGIN_S


def _firestore_options(**extra: Any) -> dict[str, Any]:
    suffix = uuid.uuid4().hex[:12]
    return {
        "PROJECT": PROJECT,
        "COLLECTION": f"faults_{suffix}",
        "FENCE_COLLECTION": f"faults_fences_{suffix}",
        **extra,
    }


def _warm_up_firestore(host: str, options: dict[str, Any], monkeypatch: Any) -> None:
    """The emulator's first requests take seconds (its JIT is cold): make them with
    a patient backend, so that timeouts under test mean the fault, not the warm-up."""
    with monkeypatch.context() as patch:
        patch.setenv(FIRESTORE_HOST, host)
        patient = FirestoreBackend(
            "warm-up", {"OPTIONS": {**options, "OPERATION_TIMEOUT_MS": 60_000}}
        )
        patient.release(patient.acquire("warm-up", 1_000).lock_id)
        patient.close()


@pytest.fixture
def proxied(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Proxied]:
    kind = request.node.callspec.params["harness"]
    server = request.getfixturevalue(
        {"postgres": "postgres_server", "redis": "redis_server", "firestore": "firestore_emulator"}[
            kind
        ]
    )
    proxy = FaultProxy(server.port).start()
    alias = f"faults_{uuid.uuid4().hex[:8]}"
    backend: BaseLockBackend
    if kind == "postgres":
        # The session's test database, reached through the proxy: the backend copies
        # the alias's settings when it opens its (per thread) connections.
        monkeypatch.setitem(connections["postgres"].settings_dict, "PORT", str(proxy.port))
        backend = DatabaseBackend(alias, {"OPTIONS": {"DATABASE": "postgres", **TIMEOUTS}})
    elif kind == "redis":
        url = f"redis://127.0.0.1:{proxy.port}/0"
        options = {**TIMEOUTS, "FENCES": "counter"}  # the tests count fences from 1
        backend = RedisBackend(alias, {"LOCATION": url, "KEY_PREFIX": alias, "OPTIONS": options})
    else:
        options = _firestore_options(**TIMEOUTS)
        _warm_up_firestore(server.host, options, monkeypatch)
        # Clients are built on first use (the async one per event loop) and read the
        # variable then: it names the proxy for the whole test.
        monkeypatch.setenv(FIRESTORE_HOST, proxy.host)
        backend = FirestoreBackend(alias, {"OPTIONS": options})
    executor = ThreadPoolExecutor(1, thread_name_prefix="faults")
    try:
        yield Proxied(kind, backend, proxy, executor)
    finally:
        proxy.stop()  # resets every connection: nothing can stay stuck on it
        backend.close()
        executor.shutdown(wait=True)


@on_every_server
def test_latency_below_the_timeout_slows_operations_down_but_they_work(harness, proxied):
    backend, proxy = proxied.backend, proxied.proxy
    warm = proxied(lambda: backend.acquire("warm", 60_000))  # connect, load scripts
    proxied(lambda: (backend.is_locked("warm"), backend.lookup(key="warm")))
    proxied(lambda: backend.lookup(lock_id=warm.lock_id))
    proxied(lambda: (backend.extend(warm.lock_id, 60_000), backend.release(warm.lock_id)))
    proxy.set_latency(LATENCY_MS)
    round_trip_s = 2 * LATENCY_MS / 1000 * 0.9  # request and reply each wait

    def slow(call: Callable[[], Any]) -> Any:
        outcome, elapsed = proxied.timed(call)
        assert not isinstance(outcome, Exception), repr(outcome)
        assert elapsed >= round_trip_s  # it did go through the slow path
        return outcome

    first = slow(lambda: backend.acquire("slow", 60_000))
    assert (first.ok, first.fence) == (True, FIRST)
    assert slow(lambda: backend.acquire("slow", 60_000)).ok is False
    assert slow(lambda: backend.is_locked("slow")) is True
    assert slow(lambda: backend.lookup(key="slow")).fence == FIRST
    assert slow(lambda: backend.lookup(lock_id=first.lock_id)).fence == FIRST
    assert slow(lambda: backend.extend(first.lock_id, 60_000)).ok is True
    assert slow(lambda: backend.release(first.lock_id)) == ReleaseResult(ok=True)
    assert slow(lambda: backend.acquire("slow", 60_000)).fence == SECOND


@on_every_server
def test_a_stalled_server_fails_every_operation_within_the_timeout(harness, proxied):
    backend, proxy = proxied.backend, proxied.proxy
    held = proxied(lambda: backend.acquire("stall", 60_000))
    assert held.fence == FIRST
    operations: dict[str, Callable[[], Any]] = {
        "acquire": lambda: backend.acquire("stall:other", 60_000),
        "release": lambda: backend.release(held.lock_id),
        "extend": lambda: backend.extend(held.lock_id, 60_000),
        "is_locked": lambda: backend.is_locked("stall"),
        "lookup by key": lambda: backend.lookup(key="stall"),
        "lookup by lock id": lambda: backend.lookup(lock_id=held.lock_id),
    }
    for name, operation in operations.items():
        # A connection is open and idle, then the path goes silent.
        assert proxied.after_drop(lambda: backend.is_locked("stall")) is True, name
        proxy.stall()
        proxied.fails_within_bound(operation, NetworkTimeout)
        # Discard the held request (a resumed proxy would deliver it late: a timed-out
        # call may still take effect), then let traffic through again.
        proxy.drop()
        proxy.resume()
    # The same backend object carries on: nothing stalled reached the server.
    assert proxied.after_drop(lambda: backend.lookup(key="stall")).fence == FIRST
    assert proxied(lambda: backend.release(held.lock_id)) == ReleaseResult(ok=True)
    assert proxied(lambda: backend.acquire("stall:other", 60_000)).fence == FIRST


@on_every_server
async def test_a_stalled_server_fails_an_async_operation_within_the_timeout(harness, proxied):
    backend, proxy = proxied.backend, proxied.proxy
    assert await backend.ais_locked("stall") is False  # this loop's connection is open
    proxy.stall()
    started = time.monotonic()
    with pytest.raises(NetworkTimeout) as caught:
        await asyncio.wait_for(backend.aacquire("stall", 60_000), STALL_BOUND_S[harness] + MARGIN_S)
    assert time.monotonic() - started < STALL_BOUND_S[harness] + MARGIN_S
    assert_mapped(caught.value, NetworkTimeout)
    proxy.drop()
    proxy.resume()
    # Async calls of the database backend run on executor threads, each with its own
    # connection: the next call may land on a thread whose idle connection the drop
    # reset, and must notice that before sending (AFTER_DROP) rather than fail.
    try:
        again = await backend.aacquire("stall", 60_000)
    except ServiceUnavailable:  # the reset noticed by using the connection, once
        assert harness in MAY_FAIL_ONCE_AFTER_DROP
        again = await backend.aacquire("stall", 60_000)
    assert again.fence == FIRST


@on_every_server
def test_dropped_connections_are_replaced_by_the_same_backend(harness, proxied):
    backend, proxy = proxied.backend, proxied.proxy
    held = proxied(lambda: backend.acquire("drop", 60_000))
    accepted = proxy.accepted

    proxy.drop()  # every open connection reset at once
    expected = AFTER_DROP[harness]
    if expected is not None:
        proxied.fails_within_bound(lambda: backend.is_locked("drop"), expected)
    assert proxied.after_drop(lambda: backend.is_locked("drop")) is True
    assert proxy.accepted > accepted  # on a new connection

    # Reset while a call waits for its reply: it fails at once, not at its timeout.
    proxy.stall()
    waiting = proxied.start(lambda: backend.acquire("drop:other", 60_000))
    proxy.wait_for_held_request()
    proxy.drop()
    proxy.resume()
    outcome, elapsed = waiting.result(timeout=STALL_BOUND_S[harness] + MARGIN_S)
    assert isinstance(outcome, Exception), f"succeeded: {outcome!r}"
    assert_mapped(outcome, ServiceUnavailable)
    assert elapsed < TIMEOUT_MS / 1000

    # The request never reached the server; the backend carries on.
    assert proxied.after_drop(lambda: backend.acquire("drop:other", 60_000)).fence == FIRST
    assert proxied(lambda: backend.release(held.lock_id)) == ReleaseResult(ok=True)
    assert proxied(lambda: backend.acquire("drop", 60_000)).fence == SECOND


# ----------------------------------------------------- crashes under traffic
def assert_exclusive_and_fences_continue(outcome: Outcome, workers: int = 3) -> None:
    """No worker saw anything but the outage errors; no two held the lock at once;
    fences are distinct, increase in acquisition order and continue past the crash."""
    print(outcome.summary())  # shown with -rP, and with any failure
    assert outcome.failures == []
    counts = outcome.error_counts()
    assert set(counts) <= set(OUTAGE_ERRORS), counts
    assert all(n > 0 for n in outcome.errors_per_worker), outcome.errors_per_worker
    fences = [fence for fence, _, _, _ in outcome.holds]
    assert len(fences) == len(set(fences)), "a fence was handed out twice"
    by_start = [fence for fence, _, _, _ in sorted(outcome.holds, key=lambda h: h[1])]
    assert by_start == sorted(fences), "fences do not increase in acquisition order"
    by_fence = sorted(outcome.holds)
    overlaps = [(a, b) for a, b in pairwise(by_fence) if a[2] > b[1]]
    assert overlaps == [], "two holders at once"
    assert [h for h in outcome.holds if h[3]] == [], "a worker found another inside"
    before, after = outcome.fences_before_down(), outcome.fences_after_up()
    assert before and after
    assert max(before) < min(after), (max(before), min(after))


def test_postgres_killed_mid_traffic_keeps_fences_and_exclusion(django_db_blocker):
    # synchronous_commit on: a commit's WAL is written before the client hears of it,
    # so a killed server loses no fence it handed out (with it off, PostgreSQL may).
    server = own(PostgresServer(settings=("fsync=off", "full_page_writes=off")))
    alias = f"faults_crash_{uuid.uuid4().hex[:8]}"
    settings_dict = {
        **copy.deepcopy(connections["postgres"].settings_dict),
        "NAME": "postgres",
        "PORT": str(server.port),
    }
    connections.settings[alias] = settings_dict
    try:
        with django_db_blocker.unblock():
            call_command("migrate", "django_syncguard", database=alias, verbosity=0)
            connections[alias].close()
        config = {"databases": {alias: settings_dict}, "options": {"DATABASE": alias, **TIMEOUTS}}
        outcome = crash_under_traffic("postgres", config, server.kill, server.start_again)
    finally:
        with suppress(AttributeError):
            del connections[alias]
        connections.settings.pop(alias, None)
        server.destroy()
    assert_exclusive_and_fences_continue(outcome)
    assert outcome.error_counts().get("ServiceUnavailable", 0) > 0


def test_redis_with_aof_killed_mid_traffic_keeps_fences_and_exclusion():
    server = own(RedisServer(aof=True))  # appendfsync always
    port = server.port

    def restart() -> None:
        server.start()
        assert server.port == port

    config = {"url": server.url, "prefix": f"crash{uuid.uuid4().hex[:8]}", "options": TIMEOUTS}
    try:
        outcome = crash_under_traffic("redis", config, server.kill, restart)
    finally:
        server.destroy()
    assert_exclusive_and_fences_continue(outcome)
    assert outcome.error_counts().get("ServiceUnavailable", 0) > 0


def test_redis_without_aof_killed_loses_its_fence_counters():
    # The documented limit (specs/backends/redis.md, check syncguard.W010).
    server = own(RedisServer(aof=False))
    port = server.port
    backend = None
    try:
        # Counter mode: the mode whose counters a restart without AOF sends back to 1.
        options = {**TIMEOUTS, "FENCES": "counter"}
        backend = RedisBackend("no-aof", {"LOCATION": server.url, "OPTIONS": options})
        fences = []
        for _ in range(3):
            result = backend.acquire("k", 60_000)
            fences.append(result.fence)
            backend.release(result.lock_id)
        assert fences == [FIRST, SECOND, "000000000000003"]
        [warning] = backend.deploy_check()
        assert warning.id == "syncguard.W010"
        server.kill()
        with pytest.raises(ServiceUnavailable) as caught:
            backend.acquire("k", 60_000)
        assert_mapped(caught.value, ServiceUnavailable)
        server.start()
        assert server.port == port
        assert backend.acquire("k", 60_000).fence == FIRST  # handed out again
    finally:
        if backend is not None:
            backend.close()
        server.destroy()


def test_firestore_emulator_stopped_mid_traffic_keeps_fences_through_an_export(monkeypatch):
    # The emulator keeps everything in memory. A graceful stop here is: traffic
    # frozen (the proxy stalls it, so nothing reaches the emulator after the
    # export), export, stop; then a start that imports the export.
    emulator = own(FirestoreEmulator())
    proxy = FaultProxy(emulator.port).start()
    options = _firestore_options(OPERATION_TIMEOUT_MS=2_000, CONNECT_TIMEOUT_MS=2_000)

    def stop() -> None:
        proxy.stall()
        emulator.import_data = emulator.export(PROJECT)
        emulator.stop_and_wait()
        proxy.resume()  # clients now find nothing behind the proxy

    try:
        _warm_up_firestore(emulator.host, options, monkeypatch)
        config = {"host": proxy.host, "options": options}
        outcome = crash_under_traffic("firestore", config, stop, emulator.start, ttl_ms=3_000)
    finally:
        proxy.stop()
        emulator.destroy()
    assert_exclusive_and_fences_continue(outcome)
    assert outcome.error_counts().get("ServiceUnavailable", 0) > 0


def test_firestore_emulator_killed_loses_its_fence_counters(monkeypatch):
    # SIGKILL leaves no export: a restarted emulator starts empty. (Use a real
    # Firestore database for anything that must survive; this is the emulator.)
    emulator = own(FirestoreEmulator())
    port = emulator.port
    monkeypatch.setenv(FIRESTORE_HOST, emulator.host)
    patient = {"OPERATION_TIMEOUT_MS": 60_000}  # the emulator's first requests are slow
    backend = None
    try:
        backend = FirestoreBackend("killed", {"OPTIONS": _firestore_options(**patient)})
        fences = []
        for _ in range(2):
            result = backend.acquire("k", 60_000)
            fences.append(result.fence)
            backend.release(result.lock_id)
        assert fences == [FIRST, SECOND]
        emulator.kill()
        emulator.start()
        assert emulator.port == port
        assert _acquire_once_reachable(backend, "k").fence == FIRST  # handed out again
    finally:
        if backend is not None:
            backend.close()
        emulator.destroy()


def _acquire_once_reachable(backend: BaseLockBackend, key: str) -> Any:
    """Acquire, letting gRPC's reconnection backoff run out first (each failure is
    ``ServiceUnavailable``, never anything else)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return backend.acquire(key, 60_000)
        except ServiceUnavailable as exc:
            assert_mapped(exc, ServiceUnavailable)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
