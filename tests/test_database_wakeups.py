"""Wake-ups and fair queues of the database backend, on real PostgreSQL and SQLite.

PostgreSQL: a release NOTIFYs the first live waiter, heard by one LISTEN connection per
backend and process (``wakeups.PostgresWakeUps``), across processes; a lost listener
makes waiters poll until it is back; a listener that cannot hear (a transaction pooler)
is detected by a probe. SQLite: no channel between processes, so waiters poll, and
their queue (in a file beside the database) still serves them in arrival order.
Waits for events are bounded by generous timeouts, never slept.
"""

from __future__ import annotations

import copy
import logging
import multiprocessing
import os
import random
import select
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from unittest.mock import ANY

import pytest
from django.core.management import call_command
from django.db import connections

from django_syncguard import (
    Internal,
    InvalidArgument,
    current_lock,
    generate_lock_id,
    lock,
    signals,
)
from django_syncguard.backends.database import DatabaseBackend
from django_syncguard.backends.database import wakeups as wakeups_module
from django_syncguard.backends.database.postgresql import RELEASE
from django_syncguard.backends.database.sqlite import QUEUE, queue_file
from django_syncguard.backends.database.wakeups import DEAF_WARNING, channel_name
from django_syncguard.constants import TIME_TOLERANCE_MS
from django_syncguard.errors import ServiceUnavailable
from django_syncguard.fencing import FENCE_MAX
from django_syncguard.liveness import FakeClock
from django_syncguard.results import AcquireResult
from django_syncguard.waiting import GRANT_WINDOW_MS, Grant, WaitTicket
from django_syncguard.waiting import channels as channels_module
from django_syncguard.waiting import session as session_module
from django_syncguard.waiting import tickets as tickets_module
from django_syncguard.waiting.channels import Message
from django_syncguard.waiting.tickets import QUEUE_AFTER_GRANT_MS
from tests.support import wakeup_workers
from tests.support.faults import wait_until
from tests.support.harness import SqliteHarness
from tests.support.leading import assert_the_worker_reads_again, record_deliveries
from tests.support.processes import (
    QUIET_WAITER,
    assert_delayed_by_the_grant_window,
    quiet_check_ins,
    sigkill,
)
from tests.support.proxy import FaultProxy

TTL = 60_000
WAKE_S = 10.0  # generous bound for an event that must arrive; never slept
on_postgres = pytest.mark.django_db(transaction=True, databases=["postgres"])
on_sqlite = pytest.mark.django_db(transaction=True, databases=["default"])
LOGGER = "django_syncguard.backends.database"


def build(database: str, **options: Any) -> DatabaseBackend:
    """A backend of its own (its own listener), under an alias no other test uses."""
    alias = f"wake-{uuid.uuid4().hex[:8]}"
    return DatabaseBackend(alias, {"OPTIONS": {"DATABASE": database, **options}})


@pytest.fixture
def pg() -> Iterator[DatabaseBackend]:
    backend = build("postgres")
    yield backend
    backend.close()


@pytest.fixture
def other() -> Iterator[DatabaseBackend]:
    """Another backend on the same database: holders and releasers."""
    backend = build("postgres")
    yield backend
    backend.close()


def databases() -> dict[str, dict[str, Any]]:
    """The parent's test databases, for the children."""
    return {alias: dict(connections[alias].settings_dict) for alias in ("default", "postgres")}


def reply(queue: Any) -> Any:
    got = queue.get(timeout=wakeup_workers.PATIENCE_S)
    if isinstance(got, BaseException):
        raise got
    return got


def query(backend: DatabaseBackend, sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
    with backend.connection().cursor() as cursor:
        cursor.execute(sql, params)
        return list(cursor.fetchall())


@pytest.fixture
def alias_to(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Add a ``DATABASES`` alias: the ``postgres`` alias's settings with changes."""
    added: list[str] = []

    def add(**changes: Any) -> str:
        name = f"alias-{uuid.uuid4().hex[:8]}"
        settings_dict = copy.deepcopy(connections["postgres"].settings_dict)
        settings_dict.update(changes)
        monkeypatch.setitem(connections.settings, name, settings_dict)
        added.append(name)
        return name

    yield add
    for name in added:
        connections[name].close()


# ------------------------------------------------------------------ PostgreSQL
def queue_and_subscribe(backend: DatabaseBackend, key: str, ticket: WaitTicket) -> Any:
    """Register ``ticket``'s listener and queue it on the held ``key``. The first
    contended attempt LISTENs on the key's channel; the listener is healthy once the
    server confirmed, and it is woken then, to try again (as a waiter would)."""
    listener = backend.wake_ups.listen(key, ticket.id)
    assert not backend.acquire(key, TTL, ticket=ticket).ok
    if not listener.healthy:
        assert listener.wait(WAKE_S, None) is True  # subscribed: try again
        assert not backend.acquire(key, TTL, ticket=ticket).ok
    assert listener.healthy
    return listener


@on_postgres
def test_a_release_in_another_process_wakes_a_waiter_here(pg, children):
    to_parent, from_parent = children.ctx.Queue(), children.ctx.Queue()
    children.start(wakeup_workers.pg_holder, databases(), "wake:cross", to_parent, from_parent)
    assert reply(to_parent) == ("held", "000000000000001")
    ticket = WaitTicket.new()
    listener = queue_and_subscribe(pg, "wake:cross", ticket)
    try:
        generation = pg.wake_ups.generation
        queued = pg.acquire("wake:cross", TTL, ticket=ticket)
        assert queued == AcquireResult(ok=False, reason="locked", queue_position=0)
        from_parent.put("release")
        assert listener.wait(WAKE_S, None) is True
        assert reply(to_parent) == ("released", True)
        assert pg.acquire("wake:cross", TTL, ticket=ticket).fence == "000000000000002"
        # Woken by the NOTIFY, not by a lost connection.
        assert pg.wake_ups.generation == generation
    finally:
        listener.close()
    children.join()


@on_postgres
def test_an_uncontended_lock_never_listens(pg):
    assert lock(lambda: current_lock().fence, key="wake:free", using=pg) == "000000000000001"
    assert pg.wake_ups.listening() == frozenset()
    assert pg.wake_ups.backend_pid is None  # no LISTEN connection was even opened


def waiting_lock(backend: DatabaseBackend, key: str) -> tuple[threading.Thread, dict[str, Any]]:
    """A thread that waits for ``key`` with ``lock()``; the dict gets ``"queued"`` (an
    event, set at its first contended attempt) and then its ``"fence"``."""
    queued = threading.Event()
    outcome: dict[str, Any] = {"queued": queued}

    def contended(sender: Any, alias: str, attempt: int, **kwargs: Any) -> None:
        if alias == backend.alias:
            queued.set()

    def run() -> None:
        signals.lock_contended.connect(contended, weak=False)
        try:
            outcome["fence"] = lock(
                lambda: current_lock().fence,  # type: ignore[union-attr]
                key=key,
                using=backend,
                ttl_ms=TTL,
                timeout_ms=60_000,
                max_retries=1_000_000,  # a waiter that polls tries every 10 ms
            )
        except Exception as exc:
            outcome["error"] = exc
        finally:
            signals.lock_contended.disconnect(contended)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


@on_postgres
def test_a_killed_listener_connection_means_polling_until_it_is_back(pg, other):
    held = other.acquire("wake:killed", TTL)
    wake_ups = pg.wake_ups
    thread, outcome = waiting_lock(pg, "wake:killed")
    try:
        assert outcome["queued"].wait(WAKE_S)
        wait_until(
            lambda: channel_name("wake:killed") in wake_ups.listening(), WAKE_S, "subscribed"
        )
        killed, generation = wake_ups.backend_pid, wake_ups.generation
        assert query(other, "SELECT pg_terminate_backend(%s)", [killed]) == [(True,)]
        wait_until(lambda: wake_ups.generation > generation, WAKE_S, "the loss was noticed")
        other.release(held.lock_id)
    finally:
        thread.join(WAKE_S * 3)
    assert outcome.get("error") is None
    assert outcome["fence"] == "000000000000002"
    # Back, on a new session, and a new waiter is woken by a release again.
    assert wake_ups.wait_connected(WAKE_S)
    assert wake_ups.backend_pid not in (None, killed)
    held = other.acquire("wake:killed", TTL)
    listener = queue_and_subscribe(pg, "wake:killed", WaitTicket.new())
    try:
        other.release(held.lock_id)
        assert listener.wait(WAKE_S, None) is True
    finally:
        listener.close()


@on_postgres
def test_a_waiter_whose_listener_cannot_reconnect_acquires_by_polling(other, alias_to):
    # The listener goes through a TCP proxy: a reset ends its session, and while the
    # proxy holds every byte no new session can start, so no NOTIFY can reach us.
    with FaultProxy(int(connections["postgres"].settings_dict["PORT"])) as proxy:
        backend = build("postgres", LISTEN_DATABASE=alias_to(PORT=str(proxy.port)))
        try:
            wake_ups = backend.wake_ups
            held = other.acquire("wake:cut", TTL)
            thread, outcome = waiting_lock(backend, "wake:cut")
            assert outcome["queued"].wait(WAKE_S)
            assert wake_ups.wait_connected(WAKE_S)
            generation = wake_ups.generation
            proxy.stall()
            proxy.drop()
            wait_until(lambda: wake_ups.generation > generation, WAKE_S, "the loss was noticed")
            assert not wake_ups.connected
            other.release(held.lock_id)
            thread.join(WAKE_S * 3)
            assert outcome.get("error") is None
            assert outcome["fence"] == "000000000000002"
            assert not wake_ups.connected  # acquired while nothing could be heard
            proxy.resume()
            assert wake_ups.wait_connected(WAKE_S * 3)
        finally:
            backend.close()


@on_postgres
def test_no_wake_up_is_lost_when_releases_race_queued_attempts(pg, other):
    """Many rounds of a release racing a waiter's attempt, each started after random
    delays: whenever the attempt queued the ticket, the release must wake it."""
    rounds = 1_000
    rng = random.Random(20261124)
    start, finish = threading.Barrier(2, timeout=WAKE_S), threading.Barrier(2, timeout=WAKE_S)
    held: list[Any] = [None]
    stop = threading.Event()

    def spin(microseconds: int) -> None:
        end = time.perf_counter() + microseconds / 1e6
        while time.perf_counter() < end:
            pass

    def releaser() -> None:
        try:
            while True:
                start.wait()
                if stop.is_set():
                    return
                spin(rng.randrange(0, 600))
                released.append(other.release(held[0].lock_id).ok)
                finish.wait()
        except threading.BrokenBarrierError:
            return  # the test ended early
        except Exception as exc:  # reported by the assertion on ``released``
            released.append(exc)
            finish.abort()

    # Subscribe to the key's channel once; it stays LISTENed while the rounds use it.
    warm_up, first = other.acquire("wake:race", TTL), WaitTicket.new()
    queue_and_subscribe(pg, "wake:race", first).close()
    pg.withdraw("wake:race", first.id)
    other.release(warm_up.lock_id)
    released: list[bool] = []
    thread = threading.Thread(target=releaser, daemon=True)
    thread.start()
    outcomes = {"queued": 0, "free": 0}
    try:
        for _ in range(rounds):
            held[0] = other.acquire("wake:race", TTL)
            ticket = WaitTicket.new()
            listener = pg.wake_ups.listen("wake:race", ticket.id)
            try:
                assert listener.healthy
                start.wait()
                spin(rng.randrange(0, 600))
                got = pg.acquire("wake:race", TTL, ticket=ticket)
                finish.wait()
                if not got.ok:
                    outcomes["queued"] += 1
                    assert listener.wait(WAKE_S, None) is True, "a wake-up was lost"
                    got = pg.acquire("wake:race", TTL, ticket=ticket)
                else:
                    outcomes["free"] += 1
                assert got.ok
                assert pg.release(got.lock_id).ok
            finally:
                listener.close()
        stop.set()
        start.wait()
    finally:
        stop.set()
        start.abort()
        finish.abort()
        thread.join(WAKE_S)
    assert released == [True] * rounds, released[-1:]
    assert outcomes["queued"] > 0, outcomes  # the race did queue waiters
    assert outcomes["queued"] + outcomes["free"] == rounds


@on_postgres
def test_one_listen_connection_per_process_whatever_the_number_of_waiters(pg, other):
    keys = [f"wake:many:{n % 5}" for n in range(40)]
    for key in set(keys):
        other.acquire(key, TTL)

    def wait_for(key: str) -> Any:
        ticket = WaitTicket.new()
        listener = pg.wake_ups.listen(key, ticket.id)
        assert not pg.acquire(key, TTL, ticket=ticket).ok
        assert listener.healthy or listener.wait(WAKE_S, None)
        return listener

    with ThreadPoolExecutor(8) as pool:
        listeners = list(pool.map(wait_for, keys))
    try:
        assert [listener.healthy for listener in listeners] == [True] * len(keys)
        name = f"syncguard listen {os.getpid()} {pg.alias}"
        sql = "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
        assert query(other, sql, [name]) == [(pg.wake_ups.backend_pid,)]
        assert pg.wake_ups.listening() == {channel_name(key) for key in set(keys)}
    finally:
        for listener in listeners:
            listener.close()


@on_postgres
async def test_an_async_waiter_is_woken_by_a_release(pg, other):
    held = await other.aacquire("wake:async", TTL)
    ticket = WaitTicket.new()
    listener = await pg.wake_ups.alisten("wake:async", ticket.id)
    try:
        assert (await pg.aacquire("wake:async", TTL, ticket=ticket)).queue_position == 0
        assert await listener.await_wake(WAKE_S, None) is True  # subscribed: try again
        assert listener.healthy
        assert (await pg.aacquire("wake:async", TTL, ticket=ticket)).queue_position == 0
        assert (await other.arelease(held.lock_id)).ok
        assert await listener.await_wake(WAKE_S, None) is True
        assert (await pg.aacquire("wake:async", TTL, ticket=ticket)).fence == "000000000000002"
    finally:
        listener.close()


def queued_leader(backend: DatabaseBackend, other: DatabaseBackend, key: str, name: str) -> tuple:
    """``key`` held by ``other``, a ticket of ``backend`` queued first behind it, and a
    thread named ``name`` waiting for that ticket's wake-up, reading the listening
    connection itself (leading): (listener, held lock, thread, outcome)."""
    wake_ups = backend.wake_ups
    held = other.acquire(key, TTL)
    listener = queue_and_subscribe(backend, key, WaitTicket.new())
    outcome: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: outcome.setdefault("woken", listener.wait(WAKE_S, None)), name=name
    )
    thread.start()
    wait_until(lambda: wake_ups._leader is listener, WAKE_S, "the waiting thread leads")
    return listener, held, thread, outcome


@on_postgres
def test_a_waiting_thread_reads_its_own_grant_then_the_worker_reads_again(pg, other, monkeypatch):
    wake_ups = pg.wake_ups
    deliveries = record_deliveries(wake_ups, monkeypatch)
    leader, held, thread, outcome = queued_leader(pg, other, "wake:lead", "first-waiter")
    try:
        assert other.release(held.lock_id).ok
        thread.join(WAKE_S)
        # Read and delivered by the waiting thread itself: no second thread woken.
        assert outcome == {"woken": True}
        assert deliveries == [(leader.ticket_id, "first-waiter")]
        assert leader.grant is not None
        assert wake_ups._leader is None
        assert_the_worker_reads_again(pg, "wake:lead", leader, deliveries, TTL)
    finally:
        leader.close()


@on_postgres
def test_a_listening_connection_lost_under_a_leader_wakes_it_and_comes_back(pg, other):
    wake_ups = pg.wake_ups
    listener, held, thread, outcome = queued_leader(pg, other, "wake:lead-lost", "leading")
    try:
        failures = wake_ups._failures
        killed = wake_ups.backend_pid
        assert query(other, "SELECT pg_terminate_backend(%s)", [killed]) == [(True,)]
        thread.join(WAKE_S)
        # The leader met the closed connection; the worker reconnected; the waiter was
        # woken by the loss (it tries once at once, then polls until healthy again).
        assert outcome == {"woken": True}
        assert wake_ups.wait_connected(WAKE_S) is True
        assert wake_ups._failures == failures + 1
        assert wake_ups.backend_pid not in (None, killed)
        assert wake_ups._leader is None
        assert listener.healthy is False  # registered before the loss
        assert other.release(held.lock_id).ok
    finally:
        listener.close()


@on_postgres
def test_a_notification_read_with_a_listen_s_reply_reaches_the_leader(pg, other, monkeypatch):
    # psycopg keeps aside a notification that arrives before a statement's reply, and
    # the socket is empty after it. The leader reads only when its socket has data: the
    # worker, which sent the statement, must hand the notification on.
    monkeypatch.setattr(channels_module, "LEAD_LOCK_S", 0)  # the leader never waits for
    # the worker's lock: it goes back to its poll at once, as after a long LISTEN
    wake_ups = pg.wake_ups
    leader, held, thread, outcome = queued_leader(pg, other, "wake:backlog-a", "leading")
    listening = wake_ups._connection
    subscribe = listening.subscribe

    def release_first(channels):
        assert other.release(held.lock_id).ok
        select.select([listening.fileno()], [], [], WAKE_S)  # its NOTIFY came first
        return subscribe(channels)  # read with LISTEN's reply, and kept aside

    monkeypatch.setattr(listening, "subscribe", release_first)
    held_b, theirs = other.acquire("wake:backlog-b", TTL), WaitTicket.new()
    follower = wake_ups.listen("wake:backlog-b", theirs.id)
    try:
        # Its first contended attempt makes the worker LISTEN on the key's channel.
        assert pg.acquire("wake:backlog-b", TTL, ticket=theirs).queue_position == 0
        thread.join(WAKE_S)
        assert outcome == {"woken": True}
        assert leader.grant is not None
    finally:
        follower.close()
        leader.close()
        other.release(held_b.lock_id)


@on_postgres
def test_a_notification_read_with_the_first_listen_s_reply_is_received(pg, other, monkeypatch):
    # The listening connection's first LISTEN (its process's channel) may come back
    # with a notification psycopg read before the reply: the connection's notify
    # handler must be registered by then, or psycopg keeps it where no read looks.
    transport = pg.wake_ups.transport
    extra = f"syncguard_{uuid.uuid4().hex}"  # as a key's channel
    execute = wakeups_module._execute

    def notified_first(raw: Any, sql: str) -> None:
        if sql == f"LISTEN {wakeups_module._quoted(transport.process_channel)}":
            execute(raw, f"LISTEN {wakeups_module._quoted(extra)}")
            other.ops.run(lambda c: c.execute("SELECT pg_notify(%s, 'marker')", [extra]))
            # It arrived before the LISTEN is sent (else the case is not replayed).
            assert select.select([raw.fileno()], [], [], WAKE_S)[0]
        execute(raw, sql)

    monkeypatch.setattr(wakeups_module, "_execute", notified_first)
    listening = transport.connect(lambda: None)
    try:
        assert listening.receive() == [Message(extra, "marker")]
        assert listening.receive() == []
    finally:
        listening.close()


def _forked_waiter(backend: DatabaseBackend, key: str, ticket: WaitTicket, reports: Any) -> None:
    """In a forked child: subscribe on the inherited wake-ups, report, wait for a wake.
    The parent queued the ticket for us; our attempt keeps its place and rewrites its
    grant record with this process's grant channel (a new one: the parent's is the
    parent's)."""
    try:
        wake_ups = backend.wake_ups
        listener = wake_ups.listen(key, ticket.id)
        assert not backend.acquire(key, TTL, ticket=ticket).ok
        subscribed = listener.wait(WAKE_S, None)
        channel = wake_ups.process_channel
        reports.put(("listening", subscribed and listener.healthy, wake_ups.backend_pid, channel))
        reports.put(("woken", listener.wait(WAKE_S, None)))
        wake_ups.close()
    except Exception as exc:
        reports.put(exc)


# Forking while the wake-up reader thread runs is the point of the test; Python 3.12+
# warns about any fork of a threaded process.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@on_postgres
def test_a_forked_child_listens_on_its_own_connection_and_leaves_the_parent_s(pg, other):
    parent = pg.wake_ups
    held = other.acquire("wake:fork", TTL)
    ctx = multiprocessing.get_context("fork")
    reports = ctx.Queue()
    theirs = WaitTicket.new()
    assert other.acquire("wake:fork", TTL, ticket=theirs).queue_position == 0
    mine = WaitTicket.new()
    listener = queue_and_subscribe(pg, "wake:fork", mine)  # second in line
    try:
        parents_pid = parent.backend_pid
        child = ctx.Process(target=_forked_waiter, args=(pg, "wake:fork", theirs, reports))
        child.start()
        try:
            _, healthy, childs_pid, childs_channel = reply(reports)
            assert healthy is True
            assert childs_pid not in (None, parents_pid)
            assert childs_channel.startswith("syncguard_p_")
            assert childs_channel != parent.process_channel
            # The child's ticket is first in line, then ours: each release wakes its own.
            assert other.release(held.lock_id).ok
            assert reply(reports) == ("woken", True)
            got = other.acquire("wake:fork", TTL, ticket=theirs)
            assert other.release(got.lock_id).ok
            assert listener.wait(WAKE_S, None) is True  # the parent's session is intact
            assert (parent.backend_pid, listener.healthy) == (parents_pid, True)
        finally:
            child.join(WAKE_S)
            if child.is_alive():
                child.terminate()
        assert child.exitcode == 0
    finally:
        listener.close()


@on_postgres
def test_a_withdrawal_wakes_the_next_waiter(pg, other):
    held = other.acquire("wake:withdraw", TTL)
    first, second = WaitTicket.new(), WaitTicket.new()
    assert other.acquire("wake:withdraw", TTL, ticket=first).queue_position == 0
    listener = queue_and_subscribe(pg, "wake:withdraw", second)
    try:
        # Grants the key to ``first`` (fence 2), not to us; we are only nudged to
        # re-check after its window.
        assert other.release(held.lock_id).ok
        assert listener.wait(0, None) is False
        # ``first`` gives up: its grant goes back, and the key is granted to us.
        other.withdraw("wake:withdraw", first.id)
        assert listener.wait(WAKE_S, None) is True
        assert listener.grant is not None and listener.grant.fence == 3
        got = pg.acquire("wake:withdraw", TTL, ticket=second)  # crosses the grant
        assert (got.fence, got.lock_id) == ("000000000000003", listener.grant.lock_id)
    finally:
        listener.close()


def lock_row(backend: DatabaseBackend, key: str) -> dict[str, Any] | None:
    """The lock row of ``key`` as stored (a grant's columns included), or None."""
    rows = query(
        backend,
        "SELECT lock_id, fence, granted_to, grant_expires_at_ms FROM syncguard_locks "
        "WHERE key = %s",
        [backend.storage_key(key)],
    )
    if not rows:
        return None
    lock_id, fence, granted_to, told = rows[0]
    return {"lock_id": lock_id, "fence": fence, "granted_to": granted_to, "told": told}


@on_postgres
def test_a_grant_from_another_process_lets_a_waiter_enter_without_another_acquire(
    pg, children, monkeypatch
):
    """A holder in another process releases; the release grants the key to our waiter
    (the first in line) and its NOTIFY carries the lock: ``lock()`` enters its body on
    it, sending no acquire after the release, and the channel's thread claims the
    grant on the server meanwhile."""
    key = "wake:granted"
    to_parent, from_parent = children.ctx.Queue(), children.ctx.Queue()
    children.start(wakeup_workers.pg_holder, databases(), key, to_parent, from_parent)
    assert reply(to_parent) == ("held", "000000000000001")
    statuses: list[int] = []  # every acquire this backend sends, by its status
    settled = threading.Event()  # an attempt sent after the LISTEN took effect returned
    acquire = pg.ops.acquire

    def counting(*args: Any, **kwargs: Any) -> Any:
        # Sent once the LISTEN took effect: the waiter's wake on confirmation is spent.
        listening = pg.wake_ups.ready(key)
        answer = acquire(*args, **kwargs)
        statuses.append(answer[0])
        if listening:
            settled.set()
        return answer

    monkeypatch.setattr(pg.ops, "acquire", counting)
    inside: dict[str, Any] = {}

    def body() -> None:
        lease = current_lock()
        assert lease is not None
        inside.update(lock_id=lease.lock_id, fence=lease.fence)
        # The claim runs in the channel's thread, on its own connection.
        wait_until(lambda: lock_row(pg, key)["told"] is None, WAKE_S, "the grant is claimed")
        inside["row"] = lock_row(pg, key)

    # No timer attempts: after the first ones, only the once-a-second check-in asks.
    options = {"key": key, "using": pg, "ttl_ms": TTL, "timeout_ms": 60_000}
    options.update(retry_delay_ms=60_000, backoff="fixed", jitter="none")
    thread = threading.Thread(target=lock, args=(body,), kwargs=options)
    thread.start()
    try:
        assert settled.wait(WAKE_S)
        # The next check-in is a second away: nothing but the grant can let it in.
        sent = len(statuses)
        from_parent.put("release")
        assert reply(to_parent) == ("released", True)
        thread.join(WAKE_S)
        assert not thread.is_alive()
    finally:
        from_parent.put("release")  # a child still waiting (the test failed first)
        thread.join(WAKE_S)
    assert len(statuses) == sent  # no acquire after the release
    assert set(statuses) == {0}  # and none that took the key
    assert inside["fence"] == "000000000000002"
    row = inside["row"]
    assert (row["lock_id"], row["fence"]) == (inside["lock_id"], "000000000000002")
    assert row["granted_to"] is not None  # a grant, claimed: no told expiry left
    assert lock_row(pg, key) is None  # released by lock() at the end
    children.join()


def test_a_notification_is_a_wake_up_or_a_grant():
    assert wakeups_module._message("ch", "T") == Message("ch", "T", None)
    assert wakeups_module._message("ch", "T L 2 123") == Message("ch", "T", Grant("L", 2, 123))
    # A payload that does not parse still wakes its ticket, which then acquires.
    assert wakeups_module._message("ch", "T L x 123") == Message("ch", "T", None)


def test_a_notification_on_the_process_channel_names_the_key_s_channel():
    own = wakeups_module._own_message
    key = channel_name("k")
    assert own(f"g T L 2 123 {key}") == Message(key, "T", Grant("L", 2, 123))
    assert own(f"n T {key}") == Message(key, "T", recheck=True)
    # Nothing else on it is taken for a key's wake-up (nor for a probe's).
    for payload in ("T", "g T L 2 123", f"g T L x 123 {key}", "n T", "n T nope", "x T k", ""):
        assert own(payload) is None, payload


def test_a_failing_claim_is_logged_and_never_raised_into_the_channel_thread(caplog, monkeypatch):
    def claim(grant: Grant) -> bool:
        raise ServiceUnavailable("the server is gone")

    monkeypatch.setattr(channels_module, "CLAIM_AFTER_S", 0.0)  # due at once

    transport = wakeups_module.PostgresTransport(
        "claims",
        connect=None,
        probe=None,
        storage_key=str,  # type: ignore[arg-type]
    )
    wake_ups = wakeups_module.PostgresWakeUps(transport, reply_timeout_s=1.0, claim=claim)
    listener = wake_ups.listen("k", "T")
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert wake_ups.deliver("k", "T", Grant("L", 2, 123)) is True
            # What the channel's thread runs between reads: the claim is due.
            wake_ups._claim_due()
        assert listener.grant == Grant("L", 2, 123)
        assert "Claiming a lock granted to a waiter of" in caplog.text
        assert "the server is gone" in caplog.text
        assert wake_ups._claims == {}
    finally:
        listener.close()
        wake_ups.close()


def recorded(backend: DatabaseBackend) -> list[Message]:
    """What the wake-ups of ``backend`` hear from now on (messages only: grants,
    wake-ups, re-checks), recorded before they are handled."""
    heard: list[Message] = []
    handle = backend.wake_ups._handle

    def recording(events: Any) -> None:
        heard.extend(event for event in events if isinstance(event, Message))
        handle(events)

    backend.wake_ups._handle = recording  # type: ignore[method-assign]
    return heard


@pytest.mark.slow
@on_postgres
@pytest.mark.parametrize("watching", [True, False], ids=["releaser-checks", "next-told"])
def test_a_waiter_killed_first_in_line_delays_the_key_by_its_grant_window(
    pg, other, children, watching, monkeypatch
):
    """A process queued first is killed (SIGKILL); the release grants it the key anyway
    (its ticket is still live), on its process's channel, which nobody hears any more.
    Nobody claims the grant: it lapses after GRANT_WINDOW_MS, and the next waiter (a
    thread here, of another backend) takes the key just after. Who notices the lapse:
    the releasing process when its wake-ups are connected (it checks its grant once the
    window is over and grants the key on; the next waiter hears nothing at the
    hand-off); else the next waiter, told at the hand-off by an 'n' notification on its
    process's channel that it is next. The delay is the window, not the dead ticket's
    patience (2 s) nor a TTL."""
    key = "wake:killed-first"
    if watching:
        assert other.wake_ups.want("wake:elsewhere", wait=True)  # its wake-ups run
    held = other.acquire(key, TTL)
    entered: list[tuple[float, str]] = []
    second = threading.Event()
    heard = recorded(pg)

    def contended(sender: Any, alias: str, **kwargs: Any) -> None:
        if alias == pg.alias:
            second.set()

    def body() -> None:
        lease = current_lock()
        assert lease is not None
        entered.append((time.monotonic(), lease.fence))

    queued, to_parent = children.ctx.Event(), children.ctx.Queue()
    children.start(wakeup_workers.pg_waiter, databases(), key, queued, to_parent)
    assert queued.wait(wakeup_workers.PATIENCE_S)
    signals.lock_contended.connect(contended, weak=False)
    thread = threading.Thread(
        target=lock, args=(body,), kwargs={"key": key, "using": pg, "ttl_ms": TTL, **QUIET_WAITER}
    )
    quiet_check_ins(monkeypatch)
    try:
        thread.start()
        assert second.wait(WAKE_S)  # queued behind the child
        # Listening: a notification for this process will reach it.
        wait_until(lambda: pg.wake_ups.ready(key), WAKE_S, "the key's channel is listened")
        sigkill(children.started[0])

        assert (other._grant_hook() is not None) is watching
        released_at = time.monotonic()
        assert other.release(held.lock_id).ok
        thread.join(WAKE_S)
    finally:
        signals.lock_contended.disconnect(contended)
        children.terminate()
    assert_delayed_by_the_grant_window(entered, released_at)
    # What the next waiter's process heard: with a watching releaser, only the grant
    # its check made; else only the 'n' notification (it then took the key itself).
    assert [(m.recheck, m.grant is not None) for m in heard] == (
        [(False, True)] if watching else [(True, False)]
    )
    assert {m.channel for m in heard} == {channel_name(pg.storage_key(key))}


@on_postgres
def test_a_grant_wakes_only_the_grantee_s_process(pg, other):
    """Two processes wait for a key (two backends here: each has its own LISTEN
    connection and grant channel, as two processes do); the release grants the key to
    the first, and the second's hears nothing at that hand-off: the grant went to the
    first's process channel, and the releaser (its wake-ups connected) checks the grant
    itself, so nobody is told that it is next. The second is granted the key when the
    first releases, on its own channel."""
    key = "wake:only-grantee"
    third = build("postgres")  # the holder and releaser
    try:
        assert third.wake_ups.want("wake:elsewhere", wait=True)  # the releaser watches
        held = third.acquire(key, TTL)
        first, second = WaitTicket.new(), WaitTicket.new()
        first_heard, second_heard = recorded(pg), recorded(other)
        mine = queue_and_subscribe(pg, key, first)
        theirs = queue_and_subscribe(other, key, second)
        assert third.release(held.lock_id).ok
        assert mine.wait(WAKE_S, None) is True
        assert mine.grant is not None and mine.grant.fence == 2
        assert [(m.ticket_id, m.grant) for m in first_heard] == [(first.id, mine.grant)]
        first_heard.clear()
        # The releaser watches its grant (its check, once the window is over, finds
        # it claimed, or the key moved on).
        lock_channel = channel_name(pg.storage_key(key))
        assert lock_channel in third.wake_ups._watches
        # Notifications arrive in commit order: once a marker sent after the release
        # (a wake-up of no ticket, on the key's channel) is heard, whatever the
        # release sent has been too.
        marker = Message(lock_channel, "marker")
        other.ops.run(lambda c: c.execute("SELECT pg_notify(%s, 'marker')", [lock_channel]))
        wait_until(lambda: marker in second_heard, WAKE_S, "the marker is heard")
        assert second_heard == [marker]
        assert theirs.wait(0, None) is False and theirs.recheck_at is None
        second_heard.clear()

        got = pg.acquire(key, TTL, ticket=first)  # crosses the grant: its lock
        assert (got.fence, got.lock_id) == ("000000000000002", mine.grant.lock_id)
        mine.close()
        assert pg.release(got.lock_id).ok
        assert theirs.wait(WAKE_S, None) is True
        assert theirs.grant is not None and theirs.grant.fence == 3
        assert [(m.ticket_id, m.grant) for m in second_heard] == [(second.id, theirs.grant)]
        # This process's thread may not have read the first marker yet (its waiter
        # left, and nothing made the thread read since): once a second marker, sent
        # after that release, is heard here, whatever the release sent here has been.
        after = Message(lock_channel, "after")
        other.ops.run(lambda c: c.execute("SELECT pg_notify(%s, 'after')", [lock_channel]))
        wait_until(lambda: after in first_heard, WAKE_S, "the second marker is heard")
        assert first_heard == [marker, after]  # nothing more here
        got = other.acquire(key, TTL, ticket=second)
        assert other.release(got.lock_id).ok
        theirs.close()
    finally:
        third.close()


@on_postgres
def test_a_grant_the_releaser_watches_is_settled_by_the_key_moving_on(pg, other):
    """A process whose release granted a key (to a waiter of another backend, as of
    another process) watches the grant under the key's channel, and holds its own
    next waiting attempt on the key back for QUEUE_AFTER_GRANT_MS. Once it acquires
    the key again (so the grant ended) the watch is settled: when it falls due, no
    check is sent at all."""
    key = "wake:settled"
    assert pg.wake_ups.want("wake:elsewhere", wait=True)  # the releaser watches
    held = pg.acquire(key, TTL)
    checks: list[tuple[Any, ...]] = []
    check = pg.wake_ups._check_grant
    assert check is not None
    pg.wake_ups._check_grant = lambda *args: (checks.append(args), check(*args))[1]
    queued, leave = threading.Event(), threading.Event()

    def contended(sender: Any, alias: str, **kwargs: Any) -> None:
        if alias == other.alias:
            queued.set()

    def body() -> None:
        assert leave.wait(WAKE_S)

    signals.lock_contended.connect(contended, weak=False)
    thread = threading.Thread(
        target=lock, args=(body,), kwargs={"key": key, "using": other, "timeout_ms": 60_000}
    )
    try:
        thread.start()
        assert queued.wait(WAKE_S)
        assert pg.release(held.lock_id).ok
        channel = channel_name(pg.storage_key(key))
        ((due, ticket),) = pg.wake_ups._watches.values()
        assert ticket  # the grant to the waiter is watched
        assert pg.wake_ups._watched_keys[channel] == pg.storage_key(key)
        # Held back QUEUE_AFTER_GRANT_MS from the grant (read at given instants: the
        # millisecond after the grant can be over before the next line runs).
        granted_at = due - channels_module.WATCH_AFTER_S
        hold_back = pg.wake_ups.hold_back
        assert hold_back(key, now=granted_at) == pytest.approx(QUEUE_AFTER_GRANT_MS / 1000)
        assert hold_back(key, now=granted_at + QUEUE_AFTER_GRANT_MS / 1000) == 0
        assert pg.wake_ups.hold_back("wake:elsewhere") == 0
        leave.set()
        thread.join(WAKE_S)
        again = pg.acquire(key, TTL)
        assert again.ok and again.fence == "000000000000003"
        assert pg.wake_ups._watches[channel][1] == ""  # settled: the key moved on
        assert pg.wake_ups.hold_back(key) == 0
        wait_until(lambda: channel not in pg.wake_ups._watches, WAKE_S, "the watch due")
        assert pg.release(again.lock_id).ok
        assert checks == []
    finally:
        leave.set()
        signals.lock_contended.disconnect(contended)
        thread.join(WAKE_S)


@on_postgres
def test_a_release_that_grants_commits_durably(pg, other):
    """Decision 47: a release sets synchronous_commit off for its own transaction; a
    release that grants the key writes a fence, so it is set back on. Since 0009 the
    function sets the 'off' itself, first; the statements of older code set it in the
    select list (from left to right: before the call in 0008's, after it before).
    The setting the transaction commits with is the one seen inside it after the
    statement (the test server runs with synchronous_commit off: the session sets it
    on first, as a production server has it)."""

    def release_with(sql: str, lock_id: str, *more: Any) -> tuple[tuple[Any, ...], str]:
        def work(cursor: Any) -> tuple[tuple[Any, ...], str]:
            cursor.execute("SET synchronous_commit = on")
            cursor.execute("BEGIN")
            try:
                cursor.execute(sql, [lock_id, TIME_TOLERANCE_MS, *more])
                row = tuple(cursor.fetchone())
                cursor.execute("SELECT current_setting('synchronous_commit')")
                (setting,) = cursor.fetchone()
            finally:
                cursor.execute("COMMIT")
                cursor.execute("RESET synchronous_commit")
            return row, str(setting)

        return other.connections.run(work)

    def held_and_waited(key: str, *, record: bool = True) -> tuple[str, WaitTicket]:
        held = other.acquire(key, TTL)
        ticket = WaitTicket.new()
        waiter = pg if record else other_version
        assert waiter.acquire(key, TTL, ticket=ticket).queue_position == 0
        return held.lock_id, ticket

    other_version = build("postgres")  # a waiter that leaves no grant record
    other_version.ops.grants = False  # type: ignore[misc]
    try:
        # Nobody waits: the release alone, not durable.
        alone = other.acquire("durable:alone", TTL)
        assert release_with(RELEASE, alone.lock_id, False) == ((1, None, None), "off")

        # A waiter with a grant record: granted, durable; watched, the release says
        # which ticket it granted the key of which storage key to.
        lock_id, ticket = held_and_waited("durable:granted")
        assert release_with(RELEASE, lock_id, True) == (
            (1, ticket.id, other.storage_key("durable:granted")),
            "on",
        )
        row = lock_row(other, "durable:granted")
        assert row is not None and (row["granted_to"], row["fence"]) == (
            ticket.id,
            "000000000000002",
        )
        lock_id, ticket = held_and_waited("durable:unwatched")
        assert release_with(RELEASE, lock_id, False) == ((1, None, None), "on")
        assert lock_row(other, "durable:unwatched")["granted_to"] == ticket.id

        # 0008's statement, the 'off' first: still durable when it grants.
        of_0008 = (
            "SELECT set_config('synchronous_commit', 'off', true), syncguard_release(%s, %s, true)"
        )
        lock_id, ticket = held_and_waited("durable:0008")
        assert release_with(of_0008, lock_id) == (("off", 1), "on")
        assert lock_row(other, "durable:0008")["granted_to"] == ticket.id

        # The same call with the 'off' after it (the order of code before 0008) would
        # have committed the grant without waiting for its flush: the order matters.
        late_off = (
            "SELECT syncguard_release(%s, %s, true), set_config('synchronous_commit', 'off', true)"
        )
        lock_id, ticket = held_and_waited("durable:late-off")
        assert release_with(late_off, lock_id) == ((1, "off"), "off")
        assert lock_row(other, "durable:late-off")["granted_to"] == ticket.id

        # Which is why the two-argument release that code sends never grants.
        old = "SELECT syncguard_release(%s, %s), set_config('synchronous_commit', 'off', true)"
        lock_id, ticket = held_and_waited("durable:old")
        assert release_with(old, lock_id) == ((1, "off"), "off")
        assert lock_row(other, "durable:old") is None  # only woken

        # A waiter without a record (code before 0008) is only woken, not durably.
        lock_id, ticket = held_and_waited("durable:no-record", record=False)
        assert release_with(RELEASE, lock_id, True) == ((1, None, None), "off")
        assert lock_row(other, "durable:no-record") is None
    finally:
        other_version.close()


@on_postgres
def test_a_channel_nobody_waits_on_is_unlistened_later(pg, monkeypatch):
    monkeypatch.setattr(channels_module, "IDLE_CHANNEL_S", 0.0)
    wake_ups = pg.wake_ups
    listener = wake_ups.listen("wake:unused", generate_lock_id())
    wake_ups.queued("wake:unused")
    assert listener.wait(WAKE_S, None) is True
    assert channel_name("wake:unused") in wake_ups.listening()
    listener.close()
    # A turn of the listener thread, for a key someone waits on (kept).
    other = wake_ups.listen("wake:other", generate_lock_id())
    try:
        wake_ups.queued("wake:other")
        wait_until(
            lambda: channel_name("wake:unused") not in wake_ups.listening(),
            WAKE_S,
            "the unused channel was dropped",
        )
        wait_until(
            lambda: channel_name("wake:other") in wake_ups.listening(),
            WAKE_S,
            "the channel waited on is listened to",
        )
    finally:
        other.close()


@on_postgres
def test_a_listener_that_hears_nothing_is_reported_and_waiters_poll(
    other, alias_to, caplog: pytest.LogCaptureFixture
):
    # What a transaction pooler does to LISTEN (it succeeds; nothing is ever
    # delivered), done for real: the listening connection goes to another database of
    # the same server, and PostgreSQL delivers a NOTIFY only within its database.
    caplog.set_level(logging.WARNING, logger=LOGGER)
    backend = build("postgres", LISTEN_DATABASE=alias_to(NAME="postgres"))
    try:
        wake_ups = backend.wake_ups
        held = other.acquire("wake:deaf", TTL)
        thread, outcome = waiting_lock(backend, "wake:deaf")
        assert outcome["queued"].wait(WAKE_S)
        assert wake_ups.wait_connected(WAKE_S) is False  # the probe found it deaf
        assert wake_ups.reaches_other_processes is False
        again = wake_ups.listen("wake:deaf:2", generate_lock_id())
        wake_ups.queued("wake:deaf:2")
        assert (again.confirmed, again.healthy) == (False, False)
        again.close()
        warnings = [r for r in caplog.records if r.name == LOGGER]
        assert [r.getMessage() for r in warnings] == [DEAF_WARNING % (backend.alias, 1.0)]
        # Waiters poll instead, and still get the lock.
        other.release(held.lock_id)
        thread.join(WAKE_S * 3)
        assert outcome.get("error") is None and outcome["fence"] == "000000000000002"
        # The deploy check says it too, and how to fix it.
        [message] = backend.deploy_check()
        assert message.id == "syncguard.W012"
        assert "LISTEN_DATABASE" in message.hint
    finally:
        backend.close()


@on_postgres
def test_behind_pgbouncer_in_transaction_mode_waiters_poll_and_the_check_says_so(
    pgbouncer, other, alias_to, caplog: pytest.LogCaptureFixture
):
    # The real thing: the listening connection goes through PgBouncer in transaction
    # mode, where LISTEN succeeds on a server connection that the client no longer
    # owns once the statement is done, so no NOTIFY ever reaches it. (The lock
    # connections stay on the test database's alias, which the test may use.)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    backend = build("postgres", LISTEN_DATABASE=alias_to(PORT=str(pgbouncer.port)))
    try:
        held = other.acquire("wake:pgbouncer", TTL)
        thread, outcome = waiting_lock(backend, "wake:pgbouncer")
        assert outcome["queued"].wait(WAKE_S), outcome.get("error")
        assert backend.wake_ups.wait_connected(WAKE_S) is False  # the probe: deaf
        assert backend.wake_ups.reaches_other_processes is False
        warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
        assert warnings == [DEAF_WARNING % (backend.alias, 1.0)]
        # The waiter polls through PgBouncer, and gets the lock once it is free.
        other.release(held.lock_id)
        thread.join(WAKE_S * 3)
        assert outcome.get("error") is None and outcome["fence"] == "000000000000002"
        [message] = backend.deploy_check()
        assert message.id == "syncguard.W012"
    finally:
        backend.close()


@on_postgres
def test_the_deploy_check_is_quiet_when_notifications_arrive(pg):
    assert pg.deploy_check() == []
    assert build("postgres", WAKE_UPS=False).deploy_check() == []


@on_postgres
def test_the_deploy_check_reports_a_server_it_cannot_ask(alias_to):
    backend = build("postgres", LISTEN_DATABASE=alias_to(PORT="1"), CONNECT_TIMEOUT_MS=1_000)
    [message] = backend.deploy_check()
    assert message.id == "syncguard.W011"


@on_postgres
def test_listen_database_must_be_a_postgresql_alias(alias_to):
    with pytest.raises(InvalidArgument, match="LISTEN_DATABASE"):
        build("postgres", LISTEN_DATABASE="nope")
    with pytest.raises(InvalidArgument, match="LISTEN_DATABASE"):
        build("postgres", LISTEN_DATABASE="default")  # SQLite
    with pytest.raises(InvalidArgument, match="PostgreSQL only"):
        build("default", LISTEN_DATABASE="postgres")
    assert build("postgres", LISTEN_DATABASE=alias_to()).listen_database.startswith("alias-")


@on_postgres
def test_queued_acquire_and_withdraw_are_one_statement_each(pg, other):
    from django.test.utils import CaptureQueriesContext

    held = other.acquire("wake:rt", TTL)
    ticket = WaitTicket.new()
    conn = pg.connection()
    conn.ensure_connection()
    with CaptureQueriesContext(conn) as queued:
        pg.acquire("wake:rt", TTL, ticket=ticket)
    with CaptureQueriesContext(conn) as withdrawn:
        pg.withdraw("wake:rt", ticket.id)
    assert (len(queued), len(withdrawn)) == (1, 1)
    assert other.release(held.lock_id).ok


def test_the_reverse_migration_restores_the_previous_functions(
    postgres_server, django_db_blocker, alias_to
):
    # On a database of its own: migrating back and forth must not disturb the others
    # (no django_db marker: a test case would only allow its declared aliases).
    name = f"syncguard_migrations_{uuid.uuid4().hex[:8]}"
    maintenance = alias_to(NAME="postgres", PORT=str(postgres_server.port))
    alias = alias_to(NAME=name, PORT=str(postgres_server.port))
    with django_db_blocker.unblock():
        with connections[maintenance].cursor() as cursor:
            cursor.execute(f'CREATE DATABASE "{name}"')
        try:
            migrate_back_and_forth(alias)
        finally:
            connections[alias].close()
            with connections[maintenance].cursor() as cursor:
                cursor.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
            connections[maintenance].close()


def migrate_back_and_forth(alias: str) -> None:
    call_command("migrate", "django_syncguard", database=alias, verbosity=0)
    # 0009: the fourteen-argument acquire (process channel, watched), the four-argument
    # release and withdraw, the six-argument hand-over and the grant check; 0008's
    # acquire, release and withdraw became their wrappers, its hand-over is gone.
    assert functions(alias) == {
        ("syncguard_acquire", 7, "sql"),
        ("syncguard_acquire", 9, "sql"),
        ("syncguard_acquire", 10, "sql"),
        ("syncguard_acquire", 11, "sql"),
        ("syncguard_acquire", 12, "sql"),
        ("syncguard_acquire", 14, "plpgsql"),
        ("syncguard_channel", 1, "sql"),
        ("syncguard_check_grant", 4, "plpgsql"),
        ("syncguard_claim", 2, "plpgsql"),
        ("syncguard_extend", 3, "plpgsql"),
        ("syncguard_hand_over", 6, "plpgsql"),
        ("syncguard_release", 2, "sql"),
        ("syncguard_release", 3, "sql"),
        ("syncguard_release", 4, "plpgsql"),
        ("syncguard_withdraw", 3, "sql"),
        ("syncguard_withdraw", 4, "plpgsql"),
    }
    assert "process_channel" in columns(alias, "syncguard_waiters")
    call_command("migrate", "django_syncguard", "0008", database=alias, verbosity=0)
    # 0008: the twelve-argument acquire (grant records) and the three-argument release
    # (grants), the claim and the hand-over; the eleven-argument acquire and the
    # two-argument release became their wrappers.
    assert functions(alias) == {
        ("syncguard_acquire", 7, "sql"),
        ("syncguard_acquire", 9, "sql"),
        ("syncguard_acquire", 10, "sql"),
        ("syncguard_acquire", 11, "sql"),
        ("syncguard_acquire", 12, "plpgsql"),
        ("syncguard_channel", 1, "sql"),
        ("syncguard_claim", 2, "plpgsql"),
        ("syncguard_extend", 3, "plpgsql"),
        ("syncguard_hand_over", 5, "plpgsql"),
        ("syncguard_release", 2, "sql"),
        ("syncguard_release", 3, "plpgsql"),
        ("syncguard_withdraw", 3, "plpgsql"),
    }
    assert {"granted_to", "grant_expires_at_ms"} <= columns(alias, "syncguard_locks")
    assert "grant_window_ms" in columns(alias, "syncguard_waiters")
    assert "process_channel" not in columns(alias, "syncguard_waiters")
    call_command("migrate", "django_syncguard", "0007", database=alias, verbosity=0)
    # 0007: the eleven-argument acquire (owner label); the ten-argument one became its
    # wrapper.
    assert functions(alias) == {
        ("syncguard_acquire", 7, "sql"),
        ("syncguard_acquire", 9, "sql"),
        ("syncguard_acquire", 10, "sql"),
        ("syncguard_acquire", 11, "plpgsql"),
        ("syncguard_channel", 1, "sql"),
        ("syncguard_extend", 3, "plpgsql"),
        ("syncguard_release", 2, "plpgsql"),
        ("syncguard_withdraw", 3, "plpgsql"),
    }
    assert "owner" in columns(alias, "syncguard_locks")
    assert "queued_at_ms" in columns(alias, "syncguard_waiters")
    assert "granted_to" not in columns(alias, "syncguard_locks")
    assert "grant_window_ms" not in columns(alias, "syncguard_waiters")
    assert "grant" not in release_source(alias) and "pg_notify" in release_source(alias)
    call_command("migrate", "django_syncguard", "0006", database=alias, verbosity=0)
    # 0006: the ten-argument acquire; the nine-argument one became its wrapper.
    assert functions(alias) == {
        ("syncguard_acquire", 7, "sql"),
        ("syncguard_acquire", 9, "sql"),
        ("syncguard_acquire", 10, "plpgsql"),
        ("syncguard_channel", 1, "sql"),
        ("syncguard_extend", 3, "plpgsql"),
        ("syncguard_release", 2, "plpgsql"),
        ("syncguard_withdraw", 3, "plpgsql"),
    }
    assert "acquired_at_ms" in counter_columns(alias)
    assert "owner" not in columns(alias, "syncguard_locks")
    assert "queued_at_ms" not in columns(alias, "syncguard_waiters")
    call_command("migrate", "django_syncguard", "0005", database=alias, verbosity=0)
    assert functions(alias) == {
        ("syncguard_acquire", 7, "sql"),
        ("syncguard_acquire", 9, "plpgsql"),
        ("syncguard_channel", 1, "sql"),
        ("syncguard_extend", 3, "plpgsql"),
        ("syncguard_release", 2, "plpgsql"),
        ("syncguard_withdraw", 3, "plpgsql"),
    }
    assert "acquired_at_ms" not in counter_columns(alias)
    assert "pg_notify" in release_source(alias)
    call_command("migrate", "django_syncguard", "0003", database=alias, verbosity=0)
    assert functions(alias) == {
        ("syncguard_acquire", 7, "plpgsql"),
        ("syncguard_extend", 3, "plpgsql"),
        ("syncguard_release", 2, "plpgsql"),
    }
    assert "pg_notify" not in release_source(alias)
    call_command("migrate", "django_syncguard", database=alias, verbosity=0)
    backend = build(alias)
    try:
        # The seven-argument acquire of code deployed before 0005 still works.
        with backend.connection().cursor() as cursor:
            cursor.execute(
                "SELECT * FROM syncguard_acquire('old', 'fence:old', %s, 1000, NULL, 9, 1000)",
                [generate_lock_id()],
            )
            assert cursor.fetchone()[:2] == (1, 1)
            # So does the ten-argument one of code deployed before 0007 (no label).
            cursor.execute(
                "SELECT * FROM syncguard_acquire('older', 'fence:older', %s, 1000, NULL, 9, "
                "1000, NULL, NULL, false)",
                [generate_lock_id()],
            )
            assert cursor.fetchone()[:2] == (1, 1)
            # And the eleven-argument one of code deployed before 0008 (no grant record).
            cursor.execute(
                "SELECT * FROM syncguard_acquire('oldest', 'fence:oldest', %s, 1000, NULL, 9, "
                "1000, NULL, NULL, false, 'label')",
                [generate_lock_id()],
            )
            assert cursor.fetchone() == (1, 1, ANY, None)
            # Its two-argument release too.
            cursor.execute("SELECT lock_id FROM syncguard_locks WHERE key = 'oldest'")
            (lock_id,) = cursor.fetchone()
            cursor.execute("SELECT syncguard_release(%s, 1000)", [lock_id])
            assert cursor.fetchone() == (1,)
            # And what code deployed before 0009 sends: the twelve-argument acquire (a
            # grant record without a process channel), which queues behind a holder,
            # the three-argument release, which grants, and the three-argument
            # withdrawal, which gives the grant back.
            held, ticket = generate_lock_id(), generate_lock_id()
            old_acquire = (
                "SELECT * FROM syncguard_acquire('v8', 'fence:v8', %s, 60000, NULL, 9, "
                "1000, %s, 60000, false, NULL, 1000)"
            )
            cursor.execute(old_acquire, [held, None])
            assert cursor.fetchone() == (1, 1, ANY, None, None)
            cursor.execute(old_acquire, [generate_lock_id(), ticket])
            assert cursor.fetchone() == (0, None, None, 0, None)
            cursor.execute(
                "SELECT ticket_id, process_channel FROM syncguard_waiters WHERE key = 'v8'"
            )
            assert cursor.fetchall() == [(ticket, None)]
            cursor.execute("SELECT syncguard_release(%s, 1000, true)", [held])
            assert cursor.fetchone() == (1,)
            cursor.execute("SELECT granted_to, fence FROM syncguard_locks WHERE key = 'v8'")
            assert cursor.fetchone() == (ticket, "000000000000002")
            cursor.execute("SELECT syncguard_withdraw('v8', %s, 1000)", [ticket])
            cursor.execute("SELECT count(*) FROM syncguard_locks WHERE key = 'v8'")
            assert cursor.fetchone() == (0,)
        assert backend.lookup(key="older").owner is None
        assert backend.acquire("migrated", TTL).fence == "000000000000001"
        assert backend.lookup(key="migrated").owner is not None
    finally:
        backend.close()


def functions(alias: str) -> set[tuple[str, int, str]]:
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "SELECT p.proname, p.pronargs, l.lanname FROM pg_proc p "
            "JOIN pg_language l ON l.oid = p.prolang "
            "WHERE p.proname LIKE 'syncguard%%' AND pg_function_is_visible(p.oid)"
        )
        return set(cursor.fetchall())


def counter_columns(alias: str) -> set[str]:
    return columns(alias, "syncguard_fence_counters")


def columns(alias: str, table: str) -> set[str]:
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_name = %s AND table_schema = current_schema()",
            [table],
        )
        return {row[0] for row in cursor.fetchall()}


def release_source(alias: str) -> str:
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT prosrc FROM pg_proc WHERE proname = 'syncguard_release'")
        return str(cursor.fetchone()[0])


# ---------------------------------------------------------------------- SQLite
@pytest.mark.slow
@on_sqlite
def test_sqlite_waiters_of_three_processes_are_served_in_arrival_order(children):
    """No release reaches another process on SQLite (waiters poll), but the queue still
    decides who is next: each process queues while the key is held, and the fences
    come out in the order they queued."""
    backend = build("default")
    reports = children.ctx.Queue()
    try:
        held = backend.acquire("wake:fifo", TTL)
        for index in range(3):  # each queues before the next one starts
            children.start(wakeup_workers.sqlite_waiter, databases(), "wake:fifo", index, reports)
            assert reply(reports) == ("queued", index)
        assert backend.release(held.lock_id).ok
        acquired = [reply(reports) for _ in range(3)]
        children.join()
    finally:
        backend.close()
    assert acquired == [
        ("acquired", 0, "000000000000002"),
        ("acquired", 1, "000000000000003"),
        ("acquired", 2, "000000000000004"),
    ]


@on_sqlite
def test_sqlite_queue_lives_beside_the_database_and_never_reaches_other_processes():
    backend = build("default")
    try:
        name = str(connections["default"].settings_dict["NAME"])
        assert queue_file(name) == os.path.abspath(name) + "-syncguard-queue"
        assert queue_file("file:x?mode=memory") == "file:x-syncguard-queue?mode=memory"
        held = backend.acquire("wake:lite", TTL)
        ticket = WaitTicket.new()
        listener = backend.wake_ups.listen("wake:lite", ticket.id)
        try:
            assert backend.acquire("wake:lite", TTL, ticket=ticket).queue_position == 0
            rows = query(backend, f"SELECT ticket_id FROM {QUEUE}", [])
            assert rows == [(ticket.id,)]
            assert query(backend, "SELECT count(*) FROM syncguard_waiters", []) == [(0,)]
            # A release in this process wakes it; one in another process could not.
            assert listener.confirmed and not listener.healthy
            assert backend.release(held.lock_id).ok
            assert listener.wait(WAKE_S, None) is True
        finally:
            listener.close()
    finally:
        backend.close()


@on_sqlite
def test_a_queue_file_made_before_queueing_times_gets_the_column_on_attach():
    old = build("default")
    try:
        # A queue file as version 0006 made it: no queued_at_ms.
        query(old, f"ALTER TABLE {QUEUE} DROP COLUMN queued_at_ms", [])
        assert "queued_at_ms" not in queue_columns(old)
    finally:
        old.close()
    backend = build("default")  # its private connection attaches the file again
    try:
        assert "queued_at_ms" in queue_columns(backend)
        held = backend.acquire("wake:upgraded", TTL)
        before = backend.now_ms()
        assert backend.acquire("wake:upgraded", TTL, ticket=WaitTicket.new()).ok is False
        after = backend.now_ms()
        [(waiters, since)] = [
            (s.waiters, s.oldest_since_ms) for s in backend.queue_stats(["wake:upgraded"]).values()
        ]
        assert waiters == 1 and before <= since <= after
        assert backend.release(held.lock_id).ok
    finally:
        backend.close()


def queue_columns(backend: DatabaseBackend) -> set[str]:
    return {
        str(row[1])
        for row in query(backend, "PRAGMA syncguard_queue.table_info(syncguard_waiters)", [])
    }


# ------------------------------------------------------------- SQLite grants
NEVER = {"retry_delay_ms": 600_000, "backoff": "fixed", "jitter": "none", "timeout_ms": 600_000}


def lite_lock_row(backend: DatabaseBackend, key: str) -> tuple[Any, ...] | None:
    """(lock id, expires_at_ms, acquired_at_ms, fence) of the key's row, live or not."""
    rows = query(
        backend,
        "SELECT lock_id, expires_at_ms, acquired_at_ms, fence FROM syncguard_locks WHERE key = %s",
        [key],
    )
    return rows[0] if rows else None


@pytest.fixture
def lite() -> Iterator[SqliteHarness]:
    """The SQLite harness, on a clock that stands still: ``advance`` ages the rows, so
    a test moves time to the millisecond."""
    h = SqliteHarness()
    h.backend.ops.clock = FakeClock(h.backend.now_ms())
    yield h
    h.close()


@on_sqlite
def test_sqlite_grants_the_key_to_a_waiter_here_which_enters_without_another_acquire(
    monkeypatch,
):
    """A waiter of this process, and the release here: the release grants it the key,
    claimed as written (the lease's whole ttl at once), and the waiter enters on the
    grant its listener received, without another acquire."""
    backend = build("default")
    # Neither a poll by place in line nor a check-in can end the wait: only the grant.
    monkeypatch.setattr(session_module, "HEAD_POLL_MS", 600_000)
    monkeypatch.setattr(tickets_module, "CHECK_IN_MS", 600_000)
    calls: list[bool] = []
    acquire = backend.acquire

    def counted(*args: Any, **kwargs: Any) -> AcquireResult:
        result = acquire(*args, **kwargs)
        calls.append(result.ok)
        return result

    monkeypatch.setattr(backend, "acquire", counted)
    queued = threading.Event()

    def on_contended(sender: Any, **kwargs: Any) -> None:
        queued.set()

    entered: dict[str, Any] = {}

    def body() -> None:
        lease = current_lock()
        entered.update(lease=(lease.lock_id, lease.fence), calls=list(calls))
        entered["row"] = lite_lock_row(backend, "grant:here")

    signals.lock_contended.connect(on_contended, weak=False)
    try:
        held = acquire("grant:here", TTL)
        options = {"key": "grant:here", "using": backend, "ttl_ms": 45_000, **NEVER}
        thread = threading.Thread(target=lock, args=(body,), kwargs=options)
        thread.start()
        assert queued.wait(WAKE_S)
        # A plain try (an SQLite registry is never "ready"), then the one that queued.
        assert calls == [False, False]
        assert backend.release(held.lock_id).ok
        thread.join(WAKE_S)
        assert not thread.is_alive()
    finally:
        signals.lock_contended.disconnect(on_contended)
        backend.close()
    assert entered["calls"] == [False, False]  # no acquire since the release
    lock_id, fence = entered["lease"]
    row_id, expires, acquired, row_fence = entered["row"]
    assert (row_id, row_fence, fence) == (lock_id, "000000000000002", "000000000000002")
    assert expires == acquired + 45_000  # claimed: no grant window applies
    assert calls == [False, False]


@on_sqlite
def test_sqlite_an_unclaimed_grant_lapses_after_the_window(lite):
    """The first waiter's process is elsewhere (or gone): the release grants it the
    key, named by its ticket until its next attempt claims it. Nobody does: the lock is
    gone for every operation exactly GRANT_WINDOW_MS after the grant, and the next
    waiter takes the key with the next fence."""
    backend = lite.backend
    held = backend.acquire("grant:lapse", TTL)
    gone, second = WaitTicket.new(), WaitTicket.new()
    assert backend.acquire("grant:lapse", TTL, ticket=gone).queue_position == 0
    assert backend.acquire("grant:lapse", TTL, ticket=second).queue_position == 1
    granted_at = backend.now_ms()
    assert backend.release(held.lock_id).ok
    assert lite_lock_row(backend, "grant:lapse") == (
        gone.id,
        granted_at + GRANT_WINDOW_MS - TIME_TOLERANCE_MS,
        granted_at,
        "000000000000002",
    )
    assert query(backend, f"SELECT ticket_id FROM {QUEUE}", []) == [(second.id,)]

    lite.advance(GRANT_WINDOW_MS - 1)
    assert backend.is_locked("grant:lapse") is True
    assert backend.acquire("grant:lapse", TTL, ticket=second).queue_position == 0
    lite.advance(1)
    assert backend.is_locked("grant:lapse") is False
    assert backend.lookup(key="grant:lapse") is None
    assert backend.extend(gone.id, TTL).reason == "expired"
    assert backend.release(gone.id).reason == "expired"
    got = backend.acquire("grant:lapse", TTL, ticket=second)
    assert got.ok and got.fence == "000000000000003"
    assert backend.release(got.lock_id).ok


@on_sqlite
def test_sqlite_a_waiter_elsewhere_claims_its_grant_with_its_next_attempt(lite):
    """The waiter's next attempt (a poll) finds the key granted to its ticket: it
    returns that lock, renamed with the attempt's lock id (the ticket id named it only
    while unclaimed), with the grant's fence and the lease's expiry."""
    backend = lite.backend
    held = backend.acquire("grant:claim", TTL)
    ticket = WaitTicket.new()
    assert backend.acquire("grant:claim", 30_000, ticket=ticket).queue_position == 0
    granted_at = backend.now_ms()
    assert backend.release(held.lock_id).ok
    lite.advance(GRANT_WINDOW_MS - 1)
    got = backend.acquire("grant:claim", 30_000, ticket=ticket)
    assert got.ok and got.fence == "000000000000002" and got.lock_id != ticket.id
    # Aged by the advance: the grant was made GRANT_WINDOW_MS - 1 ago.
    assert got.expires_at_ms == granted_at + 30_000 - (GRANT_WINDOW_MS - 1)
    assert lite_lock_row(backend, "grant:claim")[0] == got.lock_id
    lite.advance(GRANT_WINDOW_MS)  # claimed: the window no longer applies
    assert backend.is_locked("grant:claim") is True
    assert backend.release(ticket.id).reason == "not-found"
    assert backend.release(got.lock_id).ok


@on_sqlite
def test_sqlite_a_withdrawal_gives_a_grant_back_to_the_next_waiter():
    """Two waiters here: the first is granted the key (claimed, its process being this
    one) but gives up before using it; its withdrawal deletes that lock and grants the
    key to the second."""
    backend = build("default")
    first, second = WaitTicket.new(), WaitTicket.new()
    listen_first = backend.wake_ups.listen("grant:back", first.id)
    listen_second = backend.wake_ups.listen("grant:back", second.id)
    try:
        held = backend.acquire("grant:back", TTL)
        assert backend.acquire("grant:back", TTL, ticket=first).queue_position == 0
        assert backend.acquire("grant:back", TTL, ticket=second).queue_position == 1
        assert backend.release(held.lock_id).ok
        assert listen_first.wait(WAKE_S, None) is True
        grant = listen_first.grant
        assert grant is not None and (grant.lock_id, grant.fence) == (first.id, 2)
        assert lite_lock_row(backend, "grant:back")[1] == grant.expires_at_ms  # claimed
        backend.withdraw("grant:back", first.id)
        assert listen_second.wait(WAKE_S, None) is True
        grant = listen_second.grant
        assert grant is not None and (grant.lock_id, grant.fence) == (second.id, 3)
        assert lite_lock_row(backend, "grant:back")[0] == second.id
        assert backend.release(second.id).ok
    finally:
        listen_first.close()
        listen_second.close()
        backend.close()


@on_sqlite
def test_sqlite_a_waiter_that_left_no_grant_request_is_only_woken():
    """A queue file made before grants gets the grant_request column on attach; a
    ticket queued by code of that version (no request) is woken, not granted, and
    takes the key itself."""
    old = build("default")
    try:
        query(old, f"ALTER TABLE {QUEUE} DROP COLUMN grant_request", [])
        assert "grant_request" not in queue_columns(old)
    finally:
        old.close()
    backend = build("default")
    ticket = WaitTicket.new()
    listener = backend.wake_ups.listen("grant:old", ticket.id)
    try:
        assert "grant_request" in queue_columns(backend)
        held = backend.acquire("grant:old", TTL)
        assert backend.acquire("grant:old", TTL, ticket=ticket).queue_position == 0
        query(backend, f"UPDATE {QUEUE} SET grant_request = NULL", [])  # as older code
        assert backend.release(held.lock_id).ok
        assert listener.wait(WAKE_S, None) is True
        assert listener.grant is None and lite_lock_row(backend, "grant:old") is None
        got = backend.acquire("grant:old", TTL, ticket=ticket)
        assert got.ok and got.fence == "000000000000002"
        assert backend.release(got.lock_id).ok
    finally:
        listener.close()
        backend.close()


@pytest.mark.slow
@on_sqlite
def test_sqlite_a_waiter_killed_first_in_line_delays_the_key_by_its_grant_window(children):
    """A process queued first is killed (SIGKILL); the release grants it the key anyway
    (its ticket is still live). Nobody claims the grant: it lapses after
    GRANT_WINDOW_MS, and the next waiter (a thread here, polling as first in line)
    takes the key at its next poll. The delay is the window, not the dead ticket's
    patience plus a check-in, nor a TTL."""
    backend = build("default")
    reports = children.ctx.Queue()
    entered: list[tuple[float, str]] = []
    queued = threading.Event()

    def on_contended(sender: Any, **kwargs: Any) -> None:
        if threading.current_thread().name == "second":
            queued.set()

    def run() -> None:
        def body() -> None:
            entered.append((time.monotonic(), current_lock().fence))

        lock(body, key="grant:killed", using=backend, ttl_ms=TTL, timeout_ms=60_000)

    signals.lock_contended.connect(on_contended, weak=False)
    try:
        held = backend.acquire("grant:killed", TTL)
        children.start(wakeup_workers.sqlite_waiter, databases(), "grant:killed", 0, reports)
        assert reply(reports) == ("queued", 0)
        thread = threading.Thread(target=run, name="second")
        thread.start()
        assert queued.wait(WAKE_S)
        sigkill(children.started[0])

        released_at = time.monotonic()
        assert backend.release(held.lock_id).ok
        thread.join(WAKE_S)
    finally:
        signals.lock_contended.disconnect(on_contended)
        backend.close()
    assert_delayed_by_the_grant_window(entered, released_at)


@on_sqlite
def test_sqlite_a_grant_that_would_pass_the_maximum_fence_only_wakes_the_waiter(lite):
    """No fence above the maximum is handed out by a grant either: the release only
    wakes the first waiter, whose own attempt then reports the overflow."""
    backend = lite.backend
    held = backend.acquire("grant:max", TTL)
    lite.set_fence("grant:max", FENCE_MAX)
    ticket = WaitTicket.new()
    listener = backend.wake_ups.listen("grant:max", ticket.id)
    try:
        assert backend.acquire("grant:max", TTL, ticket=ticket).queue_position == 0
        assert backend.release(held.lock_id).ok
        assert listener.wait(0, None) is True and listener.grant is None
        assert lite_lock_row(backend, "grant:max") is None
        with pytest.raises(Internal, match="Fence counter"):
            backend.acquire("grant:max", TTL, ticket=ticket)
    finally:
        listener.close()
