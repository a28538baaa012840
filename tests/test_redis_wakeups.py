"""Redis wake-ups across threads and OS processes (``specs/backends/redis.md``, Waiting).

A release that leaves waiters publishes the first live ticket on the lock hash's name;
``RedisWakeUps`` holds one pub/sub connection per backend and process and hands the
message to the waiter. These tests wait on events (a listener's, a process's), never
on sleeps, and assert what happened, not how fast.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import select
import socket
import threading
import time
import uuid

import pytest
import redis

from django_syncguard import current_lock, generate_lock_id, lock, signals
from django_syncguard.backends.redis import RedisBackend
from django_syncguard.backends.redis import wakeups as redis_wakeups
from django_syncguard.backends.redis.client import pooled_connection, socket_reader
from django_syncguard.backends.redis.wakeups import RedisWakeUps
from django_syncguard.waiting import GRANT_WINDOW_MS, WaitTicket, channels
from django_syncguard.waiting.channels import Message
from django_syncguard.waiting.tickets import QUEUE_AFTER_GRANT_MS, RECHECK_MARGIN_MS, Grant
from tests.support import redis_wakeup_workers as workers
from tests.support.faults import wait_until
from tests.support.harness import RedisHarness
from tests.support.leading import assert_the_worker_reads_again, record_deliveries
from tests.support.processes import (
    QUIET_WAITER,
    Children,
    assert_delayed_by_the_grant_window,
    quiet_check_ins,
    sigkill,
)
from tests.test_fork import Forked

TTL = 60_000
WAKE_S = 10.0  # generous bound for an event that must arrive; never slept
#: A spawned child imports Django and connects before it holds: on a loaded machine
#: that took more than WAKE_S once (a bench and a suite on two cores).
STARTUP_S = 60.0


@pytest.fixture
def rh(redis_server):
    harness = RedisHarness()
    yield harness
    harness.close()


def ticket() -> WaitTicket:
    return WaitTicket(generate_lock_id())


def pubsub_clients(backend: RedisBackend) -> dict[str, dict]:
    """The server's pub/sub connections (CLIENT LIST TYPE pubsub), by client id."""
    return {client["id"]: client for client in backend.client.client_list(_type="pubsub")}


@pytest.fixture
def queued_threads():
    """Events set when a thread's ``lock()`` attempt found the key held (its ticket is
    then queued): ``lock_contended`` is sent in the attempting thread."""
    events: dict[str, threading.Event] = {}

    def on_contended(sender, **kwargs) -> None:
        event = events.get(threading.current_thread().name)
        if event is not None:
            event.set()

    signals.lock_contended.connect(on_contended, weak=False)
    yield events
    signals.lock_contended.disconnect(on_contended)


def test_a_message_on_the_process_channel_names_the_lock_hash_even_with_spaces():
    own = redis_wakeups._own_message
    name = "sg:a key: with spaces"  # a lock hash names the user key
    assert own(f"g T L 2 123 {name}") == Message(name, "T", Grant("L", 2, 123))
    assert own(f"n T {name}") == Message(name, "T", recheck=True)
    for payload in ("T", "g T L 2 123", f"g T L x 123 {name}", "n T", "x T k", ""):
        assert own(payload) is None, payload


@pytest.fixture(params=["socket", "redis-py"])
def reads(request, monkeypatch):
    """The subscriber's two ways of reading its replies (``client.socket_reader``):
    straight off the socket with hiredis (the default), or through redis-py's
    connection (without hiredis, over TLS, on a blocking socket)."""
    if request.param == "redis-py":
        monkeypatch.setattr(redis_wakeups, "socket_reader", lambda connection: None)
    return request.param


def subscriber_reads(backend: RedisBackend) -> str:
    connection = backend.wake_ups._connection
    assert connection is not None
    return "redis-py" if connection._socket is None else "socket"


def test_a_grant_is_read_the_same_either_way(rh, reads):
    backend, mine = rh.redis, ticket()
    listener = backend.wake_ups.listen("x:reads", mine.id)
    try:
        assert subscriber_reads(backend) == reads
        held = backend.acquire("x:reads", TTL)
        assert backend.acquire("x:reads", TTL, ticket=mine).queue_position == 0
        assert backend.release(held.lock_id).ok
        assert listener.wait(WAKE_S, None) is True
        assert listener.grant is not None
        assert listener.grant.fence == 2
        assert backend.lookup_raw(lock_id=listener.grant.lock_id).fence == "000000000000002"
    finally:
        listener.close()


def test_a_refused_subscription_is_read_as_refused_either_way(rh, reads, caplog):
    admin = rh.redis.client
    admin.acl_setuser(
        "nosubscribe",
        enabled=True,
        passwords=["+pw"],
        keys=["*"],
        channels=["*"],
        commands=["+@all", "-subscribe"],
    )
    options = {"FENCES": "counter", "CLIENT_KWARGS": {"username": "nosubscribe", "password": "pw"}}
    params = {"LOCATION": rh.url, "KEY_PREFIX": rh.prefix, "OPTIONS": options}
    backend = RedisBackend("refused", params)
    try:
        with caplog.at_level(logging.WARNING, logger="django_syncguard.backends.redis"):
            listener = backend.wake_ups.listen("x:refused", ticket().id)
            try:
                assert listener.healthy is False  # its waiter polls
                refusal = "this user has no permissions to run the 'subscribe' command"
                wait_until(lambda: refusal in caplog.text, WAKE_S, "the refusal is logged")
            finally:
                listener.close()
        assert f"Refused({refusal!r})" in caplog.text  # not a lost connection
        assert backend.wake_ups.state.value == "down"
    finally:
        backend.close()
        admin.acl_deluser("nosubscribe")


def test_the_backend_builds_redis_wake_ups(rh):
    assert isinstance(rh.redis.wake_ups, RedisWakeUps)
    assert rh.redis.wake_ups.reaches_other_processes is True


def test_a_release_in_another_process_wakes_the_waiter_here(rh):
    backend, children = rh.redis, Children()
    held, release, results = children.ctx.Event(), children.ctx.Event(), children.ctx.Queue()
    children.start(workers.hold_then_release, rh.url, rh.prefix, "x:proc", held, release, results)
    try:
        assert held.wait(STARTUP_S)
        assert results.get(timeout=WAKE_S) == ("held", "000000000000001")
        mine = ticket()
        listener = backend.wake_ups.listen("x:proc", mine.id)
        try:
            assert listener.healthy
            assert backend.acquire("x:proc", TTL, ticket=mine).queue_position == 0
            release.set()
            assert results.get(timeout=WAKE_S) == ("released", True)
            # The other process's release published our ticket: the listener's event.
            assert listener.wait(WAKE_S, None) is True
            assert backend.acquire("x:proc", TTL, ticket=mine).fence == "000000000000002"
        finally:
            listener.close()
        children.join()
    finally:
        children.terminate()


def test_only_the_first_live_waiter_is_woken(rh):
    backend = rh.redis
    first, second = ticket(), ticket()
    listen_first = backend.wake_ups.listen("x:only", first.id)
    listen_second = backend.wake_ups.listen("x:only", second.id)
    try:
        held = backend.acquire("x:only", TTL)
        assert backend.acquire("x:only", TTL, ticket=first).queue_position == 0
        assert backend.acquire("x:only", TTL, ticket=second).queue_position == 1
        assert backend.release(held.lock_id).ok
        assert listen_first.wait(WAKE_S, None) is True
        # A wake-up for the second would have been delivered before or with the first
        # (one connection, in order): its event is not set.
        assert listen_second.wait(0, None) is False
    finally:
        listen_first.close()
        listen_second.close()


def test_a_killed_pubsub_connection_makes_waiters_poll_until_it_is_back(rh, queued_threads, caplog):
    """The wake-up connection is killed and cannot come back (its ACL user is off):
    the waiter's listener turns unhealthy, the release's PUBLISH reaches nobody, and
    the waiter still gets the lock by polling. Once the user is on again the reader
    reconnects, and new listeners are healthy."""
    admin, user = rh.redis.client, f"waiter{uuid.uuid4().hex[:8]}"
    admin.execute_command("ACL", "SETUSER", user, "on", ">pw", "~*", "&*", "+@all")
    url = rh.url.replace("redis://", f"redis://{user}:pw@")
    options = {"FENCES": "counter"}  # as the harness's backend: fences count from 1
    waiter = RedisBackend("waiter", {"LOCATION": url, "KEY_PREFIX": rh.prefix, "OPTIONS": options})
    try:
        held = rh.redis.acquire("x:kill", TTL)
        probe = waiter.wake_ups.listen("x:probe", generate_lock_id())
        assert probe.healthy
        got: list[str] = []
        queued_threads["waiter"] = threading.Event()
        thread = threading.Thread(
            target=lambda: got.append(
                lock(lambda: current_lock().fence, key="x:kill", using=waiter, timeout_ms=60_000)
            ),
            name="waiter",
        )
        thread.start()
        assert queued_threads["waiter"].wait(WAKE_S)

        admin.execute_command("ACL", "SETUSER", user, "off")  # no reconnect from now on
        with caplog.at_level(logging.WARNING, logger="django_syncguard.backends.redis"):
            assert admin.execute_command("CLIENT", "KILL", "USER", user, "TYPE", "pubsub") == 1
            assert probe.wait(WAKE_S, None) is True  # connection_lost woke every listener
        assert not probe.healthy
        assert not waiter.wake_ups.connected
        assert "lost their Redis connection" in caplog.text
        channel = rh.redis.lock_key("x:kill")
        assert admin.pubsub_numsub(channel) == [(channel.encode(), 0)]  # nobody hears it
        assert rh.redis.release(held.lock_id).ok

        thread.join(WAKE_S)
        assert got == ["000000000000002"]  # acquired by polling
        assert not waiter.wake_ups.connected  # still no pub/sub connection

        admin.execute_command("ACL", "SETUSER", user, "on")
        assert waiter.wake_ups.wait_connected(WAKE_S)
        fresh = ticket()
        listener = waiter.wake_ups.listen("x:kill", fresh.id)
        try:
            assert listener.healthy
            again = rh.redis.acquire("x:kill", TTL)
            assert not waiter.acquire("x:kill", TTL, ticket=fresh).ok
            assert rh.redis.release(again.lock_id).ok
            assert listener.wait(WAKE_S, None) is True
        finally:
            listener.close()
        probe.close()
    finally:
        waiter.close()
        admin.execute_command("ACL", "DELUSER", user)


def test_a_killed_connection_comes_back_at_once_and_resubscribes(rh):
    backend = rh.redis
    others = pubsub_clients(backend)  # other tests' connections may still be closing
    old = backend.wake_ups.listen("x:back", generate_lock_id())
    assert old.healthy
    [ours] = [cid for cid in pubsub_clients(backend) if cid not in others]
    assert backend.client.client_kill_filter(_id=ours) == 1
    assert old.wait(WAKE_S, None) is True
    assert not old.healthy  # its wake-ups may have been lost: it polls for good
    assert backend.wake_ups.wait_connected(WAKE_S)
    # The key it still waits on was resubscribed on the new connection.
    [again] = [c for cid, c in pubsub_clients(backend).items() if cid not in others]
    assert again["id"] != ours
    assert again["sub"] == "2"  # and the process's own channel (grants)
    mine = ticket()
    fresh = backend.wake_ups.listen("x:back", mine.id)
    try:
        assert fresh.healthy
        held = backend.acquire("x:back", TTL)
        assert not backend.acquire("x:back", TTL, ticket=mine).ok
        assert backend.release(held.lock_id).ok
        assert fresh.wait(WAKE_S, None) is True
    finally:
        fresh.close()
        old.close()


def test_no_wake_up_is_lost_when_a_release_races_a_new_waiter(rh, monkeypatch):
    """Thousands of rounds: a holder releases at a random moment while a waiter
    registers and makes its attempt. The waiter is always admitted by that attempt or
    woken; a lost wake-up would leave its listener waiting. Few keys and a tiny idle
    cap keep channels being unsubscribed and subscribed again under the race."""
    monkeypatch.setattr(redis_wakeups, "MAX_IDLE_CHANNELS", 2)
    backend, rounds = rh.redis, 2_000
    jobs: queue.Queue[tuple[str, float] | None] = queue.Queue()
    released: queue.Queue[bool] = queue.Queue()

    def holder() -> None:
        while (job := jobs.get()) is not None:
            lock_id, delay_s = job
            end = time.perf_counter() + delay_s
            while time.perf_counter() < end:  # a random moment, not a synchronisation
                pass
            released.put(backend.release(lock_id).ok)

    rng = random.Random(14)
    thread = threading.Thread(target=holder)
    thread.start()
    outcomes = {"admitted": 0, "woken": 0}
    try:
        for n in range(rounds):
            key = f"race:{rng.randrange(6)}"
            held = backend.acquire(key, TTL)
            assert held.ok, n
            jobs.put((held.lock_id, rng.random() * 0.001))
            mine = ticket()
            listener = backend.wake_ups.listen(key, mine.id)
            try:
                result = backend.acquire(key, TTL, ticket=mine)
                if result.ok:
                    outcomes["admitted"] += 1
                else:
                    assert listener.wait(WAKE_S, None) is True, f"round {n}: wake-up lost"
                    outcomes["woken"] += 1
                    result = backend.acquire(key, TTL, ticket=mine)
                    assert result.ok, n
                assert released.get(timeout=WAKE_S) is True
                assert backend.release(result.lock_id).ok
            finally:
                listener.close()
    finally:
        jobs.put(None)
        thread.join(WAKE_S)
    assert sum(outcomes.values()) == rounds
    assert outcomes["admitted"] > 0 and outcomes["woken"] > 0, outcomes


def test_one_pubsub_connection_per_process_for_any_number_of_waiters(rh):
    backend, keys, per_key = rh.redis, [f"conn:{n}" for n in range(5)], 4
    before = pubsub_clients(backend)
    start = threading.Barrier(len(keys) * per_key)
    listeners = []
    mutex = threading.Lock()

    def wait_on(key: str) -> None:
        start.wait()
        listener = backend.wake_ups.listen(key, generate_lock_id())
        with mutex:
            listeners.append(listener)

    threads = [threading.Thread(target=wait_on, args=(k,)) for k in keys for _ in range(per_key)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAKE_S)
    try:
        assert len(listeners) == 20
        assert all(listener.healthy for listener in listeners)
        new = [c for cid, c in pubsub_clients(backend).items() if cid not in before]
        assert len(new) == 1
        assert new[0]["sub"] == "6"  # one channel per key, and the process's own
    finally:
        for listener in listeners:
            listener.close()


def test_a_hot_key_stays_subscribed_between_waiters(rh):
    backend = rh.redis
    first = backend.wake_ups.listen("x:hot", generate_lock_id())
    first.close()  # the last local waiter left: the channel stays for a while
    backend.client.config_resetstat()
    second = backend.wake_ups.listen("x:hot", generate_lock_id())
    try:
        assert second.healthy
        stats = backend.client.info("commandstats")
        assert "cmdstat_subscribe" not in stats and "cmdstat_unsubscribe" not in stats
    finally:
        second.close()


def test_idle_channels_beyond_the_cap_are_unsubscribed(rh, monkeypatch):
    monkeypatch.setattr(redis_wakeups, "MAX_IDLE_CHANNELS", 2)
    backend = rh.redis
    for n in range(5):
        backend.wake_ups.listen(f"idle:{n}", generate_lock_id()).close()
    # The reader trims at its next turn; a new subscription gives it one, and
    # SUBSCRIBE's confirmation comes after the UNSUBSCRIBEs sent before it.
    keep = backend.wake_ups.listen("idle:keep", generate_lock_id())
    try:
        assert keep.healthy
        channels = backend.client.pubsub_channels(f"{rh.prefix}:idle:*")
        assert sorted(c.decode() for c in channels) == [
            f"{rh.prefix}:idle:3",
            f"{rh.prefix}:idle:4",
            f"{rh.prefix}:idle:keep",
        ]
    finally:
        keep.close()


# Forking while the wake-up reader thread runs is the point of the test; Python 3.12+
# warns about any fork of a threaded process.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_gets_a_connection_of_its_own_and_the_parent_keeps_its_own(rh):
    backend = rh.redis
    parent = backend.wake_ups.listen("fork:parent", generate_lock_id())
    assert parent.healthy
    pid = os.fork()
    if pid == 0:  # the child: report by exit status only, never return into pytest
        code = 1
        try:
            mine = ticket()
            listener = backend.wake_ups.listen("fork:child", mine.id)
            held = backend.acquire("fork:child", TTL)
            queued = not backend.acquire("fork:child", TTL, ticket=mine).ok
            released = backend.release(held.lock_id).ok
            if listener.healthy and queued and released and listener.wait(WAKE_S, None):
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The child's exit closed only its copies of the parent's sockets.
    mine = ticket()
    listener = backend.wake_ups.listen("fork:parent", mine.id)
    try:
        assert parent.healthy and listener.healthy
        held = backend.acquire("fork:parent", TTL)
        assert not backend.acquire("fork:parent", TTL, ticket=mine).ok
        assert backend.release(held.lock_id).ok
        assert listener.wait(WAKE_S, None) is True
    finally:
        listener.close()
        parent.close()


async def test_async_waiters_are_woken_and_withdraw(rh):
    backend = rh.redis
    first, second = ticket(), ticket()
    listen_first = await backend.wake_ups.alisten("x:async", first.id)
    listen_second = await backend.wake_ups.alisten("x:async", second.id)
    try:
        held = await backend.aacquire("x:async", TTL)
        assert (await backend.aacquire("x:async", TTL, ticket=first)).queue_position == 0
        assert (await backend.aacquire("x:async", TTL, ticket=second)).queue_position == 1
        assert (await backend.arelease(held.lock_id)).ok
        assert await listen_first.await_wake(WAKE_S, None) is True
        assert listen_first.grant is not None and listen_first.grant.fence == 2
        # The first gives up: its withdrawal gives the grant back, and the key is
        # granted to the second.
        await backend.awithdraw("x:async", first.id)
        assert await listen_second.await_wake(WAKE_S, None) is True
        assert listen_second.grant is not None and listen_second.grant.fence == 3
        got = await backend.aacquire("x:async", TTL, ticket=second)
        assert (got.fence, got.lock_id) == ("000000000000003", listen_second.grant.lock_id)
        assert backend.client.hgetall(backend.lock_key("x:async")).keys() == {
            b"f",
            b"i",
            b"e",
            b"a",
            b"o",  # the owner label
            b"G",  # the ticket the key was granted to (until the release)
        }  # the queue is empty again: no field of it is left (no w:, s: nor t:)
    finally:
        listen_first.close()
        listen_second.close()
        await backend._async_scripts()["_client"].aclose()


@pytest.mark.slow
def test_lock_admits_threads_and_a_process_in_the_order_they_queued(rh, queued_threads):
    """Three threads of this process and one other process wait on one key; each is
    queued before the next starts. Fences (the order the critical sections ran)
    follow the queue exactly."""
    backend, key, children = rh.redis, "x:fifo", Children()
    held = backend.acquire(key, TTL)
    fences: dict[str, str] = {}
    threads: list[threading.Thread] = []

    def start_thread(name: str) -> None:
        queued_threads[name] = threading.Event()

        def run() -> None:
            fences[name] = lock(
                lambda: current_lock().fence, key=key, using=backend, timeout_ms=60_000
            )

        thread = threading.Thread(target=run, name=name)
        thread.start()
        threads.append(thread)
        assert queued_threads[name].wait(WAKE_S)

    try:
        start_thread("first")
        start_thread("second")
        queued, results = children.ctx.Event(), children.ctx.Queue()
        children.start(workers.queued_waiter, rh.url, rh.prefix, key, queued, results)
        assert queued.wait(WAKE_S * 3)  # a spawned interpreter imports Django first
        start_thread("fourth")
        assert backend.release(held.lock_id).ok
        for thread in threads:
            thread.join(WAKE_S * 3)
        name, fence = results.get(timeout=WAKE_S)
        fences[name] = fence
        children.join()
    finally:
        children.terminate()
    assert fences == {
        "first": "000000000000002",
        "second": "000000000000003",
        "process": "000000000000004",
        "fourth": "000000000000005",
    }


@pytest.mark.slow
@pytest.mark.parametrize("watching", [True, False], ids=["releaser-checks", "next-told"])
def test_a_waiter_killed_first_in_line_delays_the_key_by_its_grant_window(
    rh, queued_threads, watching, monkeypatch
):
    """A process queued first is killed (SIGKILL); the release grants it the key
    anyway (its ticket is still live). Nobody claims the grant: it lapses after
    GRANT_WINDOW_MS, and the next waiter (a thread here, of another backend) takes the
    key just after. Who notices the lapse: the releasing process when its wake-ups are
    connected (it checks its grant once the window is over, and the next waiter hears
    nothing at the hand-off); else the next waiter, told at the hand-off by an 'n'
    message that it is next. The delay is the window, not the dead ticket's patience
    (2 s) nor a TTL."""
    config = {"LOCATION": rh.url, "KEY_PREFIX": rh.prefix, "OPTIONS": {"FENCES": "counter"}}
    holder, waiter = RedisBackend("holder", config), RedisBackend("next", config)
    key, children = "x:killed-first", Children()
    if watching:
        assert holder.wake_ups.want("x:elsewhere", wait=True)  # its wake-ups run
    held = holder.acquire(key, TTL)
    entered: list[tuple[float, str]] = []
    heard: list[Message] = []
    handle = waiter.wake_ups._handle

    def recording(events) -> None:
        heard.extend(event for event in events if isinstance(event, Message))
        handle(events)

    waiter.wake_ups._handle = recording

    def run() -> None:
        def body() -> None:
            entered.append((time.monotonic(), current_lock().fence))

        lock(body, key=key, using=waiter, ttl_ms=TTL, **QUIET_WAITER)

    quiet_check_ins(monkeypatch)
    try:
        queued, results = children.ctx.Event(), children.ctx.Queue()
        children.start(workers.queued_waiter, rh.url, rh.prefix, key, queued, results)
        assert queued.wait(STARTUP_S)
        queued_threads["second"] = threading.Event()
        thread = threading.Thread(target=run, name="second")
        thread.start()
        assert queued_threads["second"].wait(WAKE_S)
        sigkill(children.started[0])

        assert holder._watch_flag() == ("1" if watching else "")
        released_at = time.monotonic()
        assert holder.release(held.lock_id).ok
        thread.join(WAKE_S)
    finally:
        children.terminate()
        holder.close()
        waiter.close()
    assert_delayed_by_the_grant_window(entered, released_at)
    # What the next waiter's process heard: with a watching releaser, only the grant
    # its check made; else only the 'n' message (it then took the key itself).
    assert [(m.recheck, m.grant is not None) for m in heard] == (
        [(False, True)] if watching else [(True, False)]
    )


def test_a_grant_the_releaser_watches_is_settled_by_the_key_moving_on(rh, queued_threads):
    """A process whose release granted a key (to a waiter of another backend, as of
    another process) watches the grant, and holds its own next waiting attempt on the
    key back for QUEUE_AFTER_GRANT_MS. Once it acquires the key again (so the grant
    ended) the watch is settled: when it falls due, no check is sent at all."""
    config = {"LOCATION": rh.url, "KEY_PREFIX": rh.prefix, "OPTIONS": {"FENCES": "counter"}}
    backend, other, key = rh.redis, RedisBackend("other", config), "x:settled"
    assert backend.wake_ups.want("x:elsewhere", wait=True)
    held = backend.acquire(key, TTL)
    checks: list[tuple[str, str]] = []
    check = backend.check_grant
    backend.check_grant = lambda *args: (checks.append(args), check(*args))[1]
    leave = threading.Event()
    queued_threads["waiter"] = threading.Event()

    def body() -> None:
        assert leave.wait(WAKE_S)

    thread = threading.Thread(
        target=lock,
        kwargs={"fn": body, "key": key, "using": other, "timeout_ms": 60_000},
        name="waiter",
    )
    try:
        thread.start()
        assert queued_threads["waiter"].wait(WAKE_S)
        assert backend.release(held.lock_id).ok
        lock_key = backend.lock_key(key)
        ((due, ticket),) = backend.wake_ups._watches.values()
        assert ticket  # the grant to the waiter is watched
        # Held back QUEUE_AFTER_GRANT_MS from the grant (read at given instants: the
        # millisecond after the grant can be over before the next line runs).
        granted_at = due - channels.WATCH_AFTER_S
        hold_back = backend.wake_ups.hold_back
        assert hold_back(key, now=granted_at) == pytest.approx(QUEUE_AFTER_GRANT_MS / 1000)
        assert hold_back(key, now=granted_at + QUEUE_AFTER_GRANT_MS / 1000) == 0
        assert backend.wake_ups.hold_back("x:elsewhere") == 0
        leave.set()
        thread.join(WAKE_S)
        again = backend.acquire(key, TTL)
        assert again.ok and again.fence == "000000000000003"
        assert backend.wake_ups._watches[lock_key][1] == ""  # settled: the key moved on
        assert backend.wake_ups.hold_back(key) == 0
        wait_until(lambda: lock_key not in backend.wake_ups._watches, WAKE_S, "the watch due")
        assert backend.release(again.lock_id).ok
        assert checks == []
    finally:
        other.close()


def test_a_grant_is_claimed_by_its_process_and_then_cannot_lapse(rh, queued_threads):
    """A waiter enters on a grant, sending nothing more; its process claims the grant
    CLAIM_AFTER_S later while the holder is still inside: the claim deadline is gone
    from the hash, so the grant can no longer lapse."""
    backend, key = rh.redis, "x:claimed"
    claimed, inside, leave = threading.Event(), threading.Event(), threading.Event()
    claim, acquire = backend.claim, backend.acquire
    acquires: list[object] = []

    def counted_claim(grant):
        ok = claim(grant)
        claimed.set()
        return ok

    def counted_acquire(*args, **kwargs):
        result = acquire(*args, **kwargs)
        acquires.append(result)
        return result

    backend.claim, backend.acquire = counted_claim, counted_acquire
    held = backend.acquire(key, TTL)

    def body() -> str:
        inside.set()
        assert leave.wait(WAKE_S)
        return current_lock().lock_id

    results: list[str] = []
    queued_threads["holder"] = threading.Event()
    thread = threading.Thread(
        target=lambda: results.append(lock(body, key=key, using=backend, timeout_ms=60_000)),
        name="holder",
    )
    thread.start()
    try:
        assert queued_threads["holder"].wait(WAKE_S)
        assert backend.release(held.lock_id).ok
        assert inside.wait(WAKE_S)
        # Entered on the grant: every acquire the waiter sent found the key held.
        assert [result.ok for result in acquires[1:]] == [False] * (len(acquires) - 1)
        assert claimed.wait(WAKE_S)
        fields = backend.client.hgetall(backend.lock_key(key))
        assert b"g" not in fields and b"G" in fields
    finally:
        leave.set()
        thread.join(WAKE_S)
    assert results == [fields[b"i"].decode()]


def test_a_grant_released_before_its_claim_is_never_claimed(rh, queued_threads):
    backend, key = rh.redis, "x:short"
    claimed: list[object] = []
    claim = backend.claim

    def counted_claim(grant):
        claimed.append(grant)
        return claim(grant)

    backend.claim = counted_claim
    held = backend.acquire(key, TTL)
    results: list[str] = []
    queued_threads["short"] = threading.Event()
    thread = threading.Thread(
        target=lambda: results.append(
            lock(lambda: current_lock().lock_id, key=key, using=backend, timeout_ms=60_000)
        ),
        name="short",
    )
    thread.start()
    assert queued_threads["short"].wait(WAKE_S)
    assert backend.release(held.lock_id).ok
    thread.join(WAKE_S)
    # The hold ended before CLAIM_AFTER_S: its claim was dropped, never sent.
    (lock_id,) = results
    assert lock_id not in backend.wake_ups._claims
    assert claimed == []
    assert b"i" not in backend.client.hgetall(backend.lock_key(key))


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_gets_a_grant_channel_of_its_own(rh):
    """Grants are published on the waiter's process channel; a child forked from a
    process that had one (Celery prefork) makes its own, and its waiter is granted
    the key through it."""
    backend, key = rh.redis, "x:fork-grant"
    parents = backend.wake_ups.process_channel
    assert parents is not None and parents.startswith(f"{rh.prefix}#w:")
    held = backend.acquire(key, TTL)

    def child() -> dict[str, str]:
        channel = backend.wake_ups.process_channel
        fence = lock(lambda: current_lock().fence, key=key, using=backend, timeout_ms=30_000)
        return {"channel": channel, "fence": fence}

    forked = Forked(child)
    forked.go()
    wait_until(
        lambda: backend.client.hget(backend.lock_key(key), "q") == b"1", WAKE_S * 3, "queued"
    )
    assert backend.release(held.lock_id).ok
    result = forked.result()
    assert result["channel"] not in (None, parents)
    assert int(result["fence"]) > int(held.fence)
    assert backend.wake_ups.process_channel == parents  # the parent's is unchanged


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_inherits_no_watched_grant(rh):
    """The grants a process watches are its own: a forked child starts with none (its
    thread, which would check them, is the parent's), and watches nothing until its
    own wake-ups connect. The parent's watch stays."""
    backend = rh.redis
    assert backend.wake_ups.want("x:fork-watch", wait=True)
    backend.wake_ups.watch(backend.lock_key("x:fork-watch"), "some-ticket", after_s=60)

    def child() -> dict[str, object]:
        return {"watches": dict(backend.wake_ups._watches), "flag": backend._watch_flag()}

    forked = Forked(child)
    forked.go()
    assert forked.result() == {"watches": {}, "flag": ""}
    assert list(backend.wake_ups._watches) == [backend.lock_key("x:fork-watch")]
    assert backend._watch_flag() == "1"


def test_checking_a_grant_before_its_window_ends_watches_it_again_and_a_claimed_one_is_left(rh):
    """A check of a grant whose window is not over yet (the server's clock decides)
    frees nothing and watches it again for the rest of the window; on a grant its
    waiter claimed, it does nothing and watches nothing."""
    backend, key = rh.redis, "x:check-early"
    lock_key = backend.lock_key(key)
    mine = ticket()
    listener = backend.wake_ups.listen(key, mine.id)  # connected: releases are watched
    try:
        held = backend.acquire(key, TTL)
        assert backend.acquire(key, TTL, ticket=mine).queue_position == 0
        assert backend.release(held.lock_id).ok
        assert listener.wait(WAKE_S, None) is True
        grant = listener.grant
        assert grant is not None and grant.fence == 2
        backend.wake_ups.settled(lock_key)  # this process is the grantee: drop the watch
        backend.wake_ups.released(grant.lock_id)  # and send no claim: the test checks

        backend.wake_ups._run_grant_check(lock_key, mine.id)
        ((due, watched),) = backend.wake_ups._watches.values()
        assert watched == mine.id
        assert 0 < due - time.monotonic() <= (GRANT_WINDOW_MS + RECHECK_MARGIN_MS) / 1000
        fields = backend.client.hmget(lock_key, "i", "G")
        assert fields == [grant.lock_id.encode(), mine.id.encode()]  # still granted

        backend.wake_ups.settled(lock_key)
        assert backend.claim(grant)
        backend.wake_ups._run_grant_check(lock_key, mine.id)
        assert [t for _, t in backend.wake_ups._watches.values() if t] == []  # none watched
        assert backend.client.hget(lock_key, "i") == grant.lock_id.encode()
        assert backend.release(grant.lock_id).ok
    finally:
        listener.close()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_does_not_inherit_the_redis_backends_held_locks(rh):
    """Threads of the parent held the backend's own locks at the fork (the names of
    held locks, the cluster client's build, the slot tag table's build): the child's
    are new, so its first use of each does not wait forever for a thread that does
    not exist there."""
    from django_syncguard.backends.redis import slots

    backend = rh.redis
    held = [backend._held_names._lock, backend.clients._building, slots._table_lock]
    for lock_ in held:
        lock_.acquire()
    try:

        def child() -> list[bool]:
            news = [backend._held_names._lock, backend.clients._building, slots._table_lock]
            backend._held_names.remember("some-id", "some-hash")
            pairs = zip(news, held, strict=True)
            fresh = [new is not old and not new.locked() for new, old in pairs]
            return [*fresh, backend._held_names.get("some-id") == "some-hash"]

        forked = Forked(child)
        forked.go()
        assert forked.result() == [True, True, True, True]
    finally:
        for lock_ in held:
            lock_.release()


@pytest.fixture
def deliveries(rh, monkeypatch):
    """(ticket, name of the delivering thread) for every wake-up delivered here."""
    return record_deliveries(rh.redis.wake_ups, monkeypatch)


def waiting_thread(listener, name: str) -> tuple[threading.Thread, dict]:
    """A thread named ``name`` blocked in ``listener.wait``; its outcome in the dict."""
    outcome: dict = {}
    thread = threading.Thread(
        target=lambda: outcome.setdefault("woken", listener.wait(WAKE_S, None)), name=name
    )
    thread.start()
    return thread, outcome


def queued_leader(backend: RedisBackend, key: str, name: str) -> tuple:
    """``key`` held here, a ticket queued first behind it, and a thread named ``name``
    waiting for that ticket's wake-up, leading: (listener, held lock, thread, outcome)."""
    wake_ups = backend.wake_ups
    mine = ticket()
    listener = wake_ups.listen(key, mine.id)
    held = backend.acquire(key, TTL)
    assert backend.acquire(key, TTL, ticket=mine).queue_position == 0
    thread, outcome = waiting_thread(listener, name)
    wait_until(lambda: wake_ups._leader is listener, WAKE_S, "the waiting thread leads")
    return listener, held, thread, outcome


def test_a_waiting_thread_reads_its_own_grant_then_the_worker_reads_again(rh, deliveries):
    backend = rh.redis
    wake_ups = backend.wake_ups
    leader, held, thread, outcome = queued_leader(backend, "x:lead", "first-waiter")
    try:
        assert backend.release(held.lock_id).ok
        thread.join(WAKE_S)
        # Read and delivered by the waiting thread itself: no second thread woken.
        assert outcome == {"woken": True}
        assert deliveries == [(leader.ticket_id, "first-waiter")]
        assert wake_ups._leader is None
        assert_the_worker_reads_again(backend, "x:lead", leader, deliveries, TTL)
    finally:
        leader.close()


def test_a_connection_lost_under_a_leader_wakes_it_and_comes_back(rh):
    backend = rh.redis
    wake_ups = backend.wake_ups
    listener, held, thread, outcome = queued_leader(backend, "x:lead-lost", "leading-waiter")
    try:
        failures = wake_ups._failures
        assert backend.client.client_kill_filter(_type="pubsub") == 1
        thread.join(WAKE_S)
        # The leader met the closed connection; the worker reconnected; the waiter was
        # woken by the loss (it tries once at once, then polls until healthy again).
        assert outcome == {"woken": True}
        assert wake_ups.wait_connected(WAKE_S) is True
        assert wake_ups._failures == failures + 1
        assert wake_ups._leader is None
        assert listener.healthy is False  # registered before the loss
        assert backend.release(held.lock_id).ok
    finally:
        listener.close()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_child_forked_while_a_thread_leads_starts_with_no_leader(rh):
    backend = rh.redis
    wake_ups = backend.wake_ups
    listener, held, thread, outcome = queued_leader(backend, "fork:lead", "parent-waiter")
    try:
        # The leader builds its poll once it leads (just after it became the leader).
        wait_until(lambda: wake_ups._lead_poll is not None, WAKE_S, "the leader's poll")
        parents = wake_ups._lead_poll

        def child() -> list:
            # The reset ran at the fork: no leader, and no poll (the child's socket
            # pair is new); its own lead builds one for its own connection.
            before = [wake_ups._leader, wake_ups._lead_poll]
            own, holder, waiter, result = queued_leader(backend, "fork:lead-child", "child")
            backend.release(holder.lock_id)
            waiter.join(WAKE_S)
            built = wake_ups._lead_poll
            polls_its_own = built is not None and built.fd == wake_ups._connection.fileno()
            return [before == [None, None], result, own.grant is not None, polls_its_own]

        forked = Forked(child)
        forked.go()
        assert forked.result() == [True, {"woken": True}, True, True]
        # The parent's leader is untouched by the child.
        assert wake_ups._leader is listener
        assert wake_ups._lead_poll is parents
        assert backend.release(held.lock_id).ok
        thread.join(WAKE_S)
        assert outcome == {"woken": True}
    finally:
        listener.close()


def test_an_interrupt_in_a_leading_thread_is_a_lost_connection_for_the_others(rh, monkeypatch):
    backend = rh.redis
    wake_ups, mine = backend.wake_ups, ticket()
    listener = wake_ups.listen("x:lead-interrupted", mine.id)
    try:
        held = backend.acquire("x:lead-interrupted", TTL)
        assert backend.acquire("x:lead-interrupted", TTL, ticket=mine).queue_position == 0
        subscriber, outcome = wake_ups._connection, {}
        original = subscriber.receive

        def receive():
            if threading.current_thread().name == "interrupted-waiter":
                raise KeyboardInterrupt  # as a signal handler raises in the main thread
            return original()

        monkeypatch.setattr(subscriber, "receive", receive)

        def run() -> None:
            try:
                listener.wait(WAKE_S, None)
            except KeyboardInterrupt:
                outcome["raised"] = True

        thread = threading.Thread(target=run, name="interrupted-waiter")
        thread.start()
        wait_until(lambda: wake_ups._leader is listener, WAKE_S, "the waiting thread leads")
        failures = wake_ups._failures
        assert backend.release(held.lock_id).ok  # its grant arrives; the read is interrupted
        thread.join(WAKE_S)
        # The interrupt reaches its own thread; what that read may have dropped is
        # recovered as after a lost connection: the worker's thread reconnects.
        assert outcome == {"raised": True}
        wait_until(lambda: wake_ups._failures == failures + 1, WAKE_S, "a reconnect")
        assert wake_ups.wait_connected(WAKE_S) is True
        assert wake_ups._connection is not subscriber
        assert wake_ups._leader is None
    finally:
        listener.close()


def test_the_socket_reader_refuses_a_closed_connection(rh):
    pool = rh.redis.clients.pubsub_connection_pool()
    try:
        connection = pooled_connection(pool, "SUBSCRIBE")
        reader = socket_reader(connection)
        assert reader is not None
        assert list(reader.replies()) == []  # nothing arrived: no blocking, no reply
        connection.send_command("PING")
        # (Not connection.can_read(): before redis-py 5.3 it reads into its own parser.)
        sock = connection._sock
        wait_until(lambda: select.select([sock], [], [], 0.01)[0], WAKE_S, "the PONG")
        assert list(reader.replies()) == [b"PONG"]
        connection.disconnect()  # its descriptor number may now be another socket's
        with pytest.raises(redis.exceptions.ConnectionError, match="closed"):
            list(reader.replies())
    finally:
        pool.disconnect()


# ------------------------------------------------------------------ head hint
# A release (withdrawal, grant check) the releaser's process watches grants the key to
# the waiter the hash's head hint 'h' names, reading three of its fields instead of the
# whole queue, as long as the hint still names the first live waiter
# (specs/backends/redis.md, Grants).


def queued(backend: RedisBackend, key: str, *tickets: WaitTicket) -> None:
    for waiting in tickets:
        assert backend.acquire(key, TTL, ticket=waiting).ok is False


def fields(backend: RedisBackend, key: str) -> dict[bytes, bytes]:
    return backend.client.hgetall(backend.lock_key(key))


@pytest.fixture
def watched(rh, monkeypatch) -> RedisBackend:
    """The harness's backend, its scripts told that this process checks the grants
    they make (as when its wake-up connection is up)."""
    backend = rh.redis
    monkeypatch.setattr(backend, "_watch_flag", lambda: "1")
    return backend


def commands_on(backend: RedisBackend, name: str, action) -> list[list[str]]:
    """Run ``action()``; the commands scripts ran on hash ``name`` meanwhile, as read
    from MONITOR up to a marker sent after the action."""
    marker = f"end-{uuid.uuid4().hex}"
    with redis.Redis(connection_pool=backend.client.connection_pool).monitor() as monitor:
        action()
        backend.client.echo(marker)
        seen = []
        while marker not in (entry := monitor.next_command())["command"]:
            words = entry["command"].split(" ")
            if entry["client_type"] == "lua" and words[1:2] == [name]:
                seen.append(words)
        return seen


def test_a_release_grants_the_waiter_the_head_hint_names_without_reading_the_queue(watched):
    backend, key = watched, "x:hinted"
    held = backend.acquire(key, TTL)
    first, second, third = ticket(), ticket(), ticket()
    queued(backend, key, first, second, third)
    assert fields(backend, key)[b"h"] == f"{first.id} 1".encode()
    name = backend.lock_key(key)
    seen = commands_on(backend, name, lambda: backend.release(held.lock_id))
    reads = [words for words in seen if words[0] in ("HGETALL", "HMGET", "HSCAN")]
    assert reads == [
        ["HMGET", name, "i", "e", "q", "g", "h"],  # the lock, and the hint
        ["HMGET", name, f"w:{first.id}", f"t:{first.id}", "f"],  # its waiter
    ]
    after = fields(backend, key)
    assert after[b"G"] == first.id.encode() and after[b"f"] == b"2"
    assert after[b"q"] == b"2"  # second and third
    assert b"h" not in after  # its waiter was granted the key
    assert f"w:{first.id}".encode() not in after
    # The next waiter to queue reads the queue and writes the hint again.
    fourth = ticket()
    queued(backend, key, fourth)
    assert fields(backend, key)[b"h"] == f"{second.id} 2".encode()


@pytest.mark.parametrize("change", ["withdrawn", "stale", "requeued"])
def test_a_head_hint_that_no_longer_names_the_first_waiter_is_not_followed(watched, rh, change):
    """The hinted waiter left (withdrew), ran out of patience, or is back in line with
    a new arrival (a version without hints pruned and re-queued it): the release reads
    the queue and grants the key to the first live waiter, the second here."""
    backend, key = watched, "x:hint-gone"
    held = backend.acquire(key, TTL)
    first = WaitTicket(generate_lock_id(), patience_ms=1_000)
    second = WaitTicket(generate_lock_id(), patience_ms=TTL)
    queued(backend, key, first, second)
    name = backend.lock_key(key)
    if change == "withdrawn":
        backend.withdraw(key, first.id)
    elif change == "stale":
        rh.advance(2_000)  # past the first's patience, within the second's and the TTL
    else:
        live_until = fields(backend, key)[f"w:{first.id}".encode()].split()[1]
        backend.client.hset(name, f"w:{first.id}", b"3 " + live_until)
    assert fields(backend, key)[b"h"] == f"{first.id} 1".encode()
    seen = commands_on(backend, name, lambda: backend.release(held.lock_id))
    assert ["HGETALL", name] in seen
    after = fields(backend, key)
    assert after[b"G"] == second.id.encode() and after[b"f"] == b"2"
    assert b"h" not in after
    assert f"w:{second.id}".encode() not in after
    assert (f"w:{first.id}".encode() in after) is (change == "requeued")


def test_the_head_hint_goes_with_the_queue(watched):
    backend, key = watched, "x:hint-empty"
    held = backend.acquire(key, TTL)
    first, second = ticket(), ticket()
    queued(backend, key, first, second)
    backend.withdraw(key, second.id)
    backend.withdraw(key, first.id)  # the last waiter leaves without a grant
    assert fields(backend, key).keys() == {b"f", b"i", b"e", b"a", b"o"}
    queued(backend, key, second)  # alone in line: the hint names it
    assert fields(backend, key)[b"h"] == f"{second.id} 1".encode()
    assert backend.release(held.lock_id).ok
    assert b"h" not in fields(backend, key) and fields(backend, key)[b"G"] == second.id.encode()


def test_a_withdrawal_that_grants_from_the_hint_counts_both_waiters_gone(watched, rh):
    """The lease ran out with two waiters queued; the second withdraws, and its
    withdrawal grants the key to the first from the hint: both left the queue, so no
    field of it is left (no 'q' or 'n' counting a waiter that is not there)."""
    backend, key = watched, "x:hint-withdraw"
    assert backend.acquire(key, TTL).ok
    first, second = (WaitTicket(generate_lock_id(), patience_ms=10 * TTL) for _ in range(2))
    queued(backend, key, first, second)
    rh.advance(2 * TTL)  # past the lease (and its tolerance), within the patience
    name = backend.lock_key(key)
    seen = commands_on(backend, name, lambda: backend.withdraw(key, second.id))
    assert ["HGETALL", name] not in seen  # granted from the hint
    assert fields(backend, key).keys() == {b"f", b"i", b"e", b"a", b"g", b"G", b"o"}
    assert fields(backend, key)[b"G"] == first.id.encode()


def test_a_first_waiter_that_takes_the_key_itself_takes_the_hint_along(watched, rh):
    backend, key = watched, "x:hint-self"
    assert backend.acquire(key, TTL).ok
    first, second = (WaitTicket(generate_lock_id(), patience_ms=10 * TTL) for _ in range(2))
    queued(backend, key, first, second)
    rh.advance(2 * TTL)
    assert backend.acquire(key, TTL, ticket=first).ok  # no grant was made: it takes it
    assert b"h" not in fields(backend, key)


def test_a_reply_on_the_process_channel_is_the_same_message_as_bytes_or_str(rh):
    # Bytes (hiredis, redis-py's reads) take the grant's short path; str (redis-py's
    # reads with decode_responses) the general one. Other channels: the general path.
    wake_ups, mine = rh.redis.wake_ups, ticket()
    listener = wake_ups.listen("x:bytes", mine.id)
    try:
        subscriber = wake_ups._connection
        own = subscriber.own_channel
        name = "sg:a key: with spaces é"
        grant = Message(name, "T", Grant("L", 2, 123))
        payload = f"g T L 2 123 {name}"
        assert subscriber._event([b"message", own.encode(), payload.encode()]) == grant
        assert subscriber._event(["message", own, payload]) == grant
        assert subscriber._event([b"message", name.encode(), b"T"]) == Message(name, "T")
        assert subscriber._event([b"message", own.encode(), b"x T"]) is None
    finally:
        listener.close()


def test_leaders_wait_on_a_poll_kept_between_leads_and_rebuilt_for_another_descriptor(rh):
    backend = rh.redis
    wake_ups = backend.wake_ups

    def lead_once(key: str) -> None:
        listener, held, thread, outcome = queued_leader(backend, key, "leading-waiter")
        try:
            assert backend.release(held.lock_id).ok
            thread.join(WAKE_S)
            assert outcome == {"woken": True}
        finally:
            listener.close()

    lead_once("x:poll-1")
    kept = wake_ups._lead_poll
    assert kept is not None
    assert kept.fd == wake_ups._connection.fileno()
    lead_once("x:poll-2")
    assert wake_ups._lead_poll is kept
    spare, other = socket.socketpair()
    try:
        wake_ups._lead_poll = channels._LeadPoll(spare.fileno(), wake_ups._lead_r.fileno())
        lead_once("x:poll-3")
        assert wake_ups._lead_poll.fd == wake_ups._connection.fileno() != spare.fileno()
    finally:
        spare.close()
        other.close()
