"""Waiting above the backends: ``on_contended``, wake-ups, fairness, give-ups.

On the memory backend (every release happens in this process). Threads meet on
events and signals; a waiter that could only finish through a wake-up runs with a
check-in and a backoff far longer than the test, so a lost wake-up hangs it (and
``join`` reports it) instead of being papered over by a timer.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from types import SimpleNamespace

import pytest

from django_syncguard import (
    Aborted,
    AcquisitionTimeout,
    InvalidArgument,
    alock,
    current_lock,
    lock,
    locked,
    signals,
)
from django_syncguard.keys import display_hash
from django_syncguard.results import AcquireResult
from django_syncguard.waiting import (
    CHECK_IN_MS,
    HEAD_POLL_MS,
    WaitSession,
    WaitTicket,
    WakeUps,
)
from django_syncguard.waiting import tickets as waiting_module

JOIN_S = 30.0  # bound for a thread that must finish; never slept
NEVER = {"retry_delay_ms": 600_000, "backoff": "fixed", "jitter": "none", "timeout_ms": 600_000}


@pytest.fixture
def no_check_in(monkeypatch):
    """Healthy waiters make no request until woken (the check-in is far away)."""
    monkeypatch.setattr(waiting_module, "CHECK_IN_MS", 600_000)


@pytest.fixture
def contended():
    """Events set on each ``lock_contended`` (by key), to order threads without sleeps."""
    seen: dict[str, threading.Event] = {}

    def receiver(sender, key_hash, attempt, **kwargs):
        seen.setdefault(key_hash, threading.Event()).set()

    signals.lock_contended.connect(receiver, weak=False)
    try:
        yield lambda key: seen.setdefault(display_hash(key), threading.Event())
    finally:
        signals.lock_contended.disconnect(receiver)


def in_thread(fn):
    box: dict[str, object] = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def finished(thread, box):
    thread.join(JOIN_S)
    assert not thread.is_alive(), "the waiter was never woken"
    if "error" in box:
        raise box["error"]
    return box["value"]


# ------------------------------------------------------------------ wake-ups
def test_a_release_wakes_a_waiter_that_would_otherwise_sleep_for_minutes(
    mem, no_check_in, contended
):
    backend = mem.backend
    held = backend.acquire("w:wake", 10_000)
    waiter = in_thread(lambda: lock(lambda: "ran", key="w:wake", using=backend, **NEVER))
    assert contended("w:wake").wait(JOIN_S)
    backend.release(held.lock_id)
    assert finished(*waiter) == "ran"


def test_the_releaser_coming_back_queues_behind_the_waiter(mem, no_check_in, contended):
    backend = mem.backend
    fences: list[tuple[str, str]] = []
    holding, release_first = threading.Event(), threading.Event()

    def body(name):
        return lambda: fences.append((name, current_lock().fence))

    def first_holder():
        lock(lambda: holding.set() or release_first.wait(JOIN_S), key="w:fair", using=backend)
        # Straight back for the key: the waiter queued meanwhile must go first.
        lock(body("releaser"), key="w:fair", using=backend, **NEVER)

    holder = in_thread(first_holder)
    assert holding.wait(JOIN_S)
    waiter = in_thread(lambda: lock(body("waiter"), key="w:fair", using=backend, **NEVER))
    assert contended("w:fair").wait(JOIN_S)
    release_first.set()
    finished(*waiter)
    finished(*holder)
    assert fences == [("waiter", "000000000000002"), ("releaser", "000000000000003")]


def test_waiters_take_the_key_in_the_order_they_queued(mem, no_check_in):
    backend = mem.backend
    held = backend.acquire("w:fifo", 10_000)
    order: list[int] = []
    threads = []
    for number in range(5):
        queued = threading.Event()

        def receiver(sender, attempt, _queued=queued, **kwargs):
            _queued.set()

        signals.lock_contended.connect(receiver, weak=False)
        threads.append(
            in_thread(
                lambda n=number: lock(lambda: order.append(n), key="w:fifo", using=backend, **NEVER)
            )
        )
        assert queued.wait(JOIN_S)
        signals.lock_contended.disconnect(receiver)
    backend.release(held.lock_id)
    for thread in threads:
        finished(*thread)
    assert order == [0, 1, 2, 3, 4]


def test_a_lost_wake_up_costs_one_check_in_on_a_healthy_channel(mem, monkeypatch, contended):
    backend = mem.backend
    monkeypatch.setattr(waiting_module, "CHECK_IN_MS", 20)
    monkeypatch.setattr(backend.wake_ups, "deliver", lambda key, ticket_id=None, grant=None: False)
    held = backend.acquire("w:lost", 10_000)
    waiter = in_thread(lambda: lock(lambda: "ran", key="w:lost", using=backend, **NEVER))
    assert contended("w:lost").wait(JOIN_S)
    backend.release(held.lock_id)
    assert finished(*waiter) == "ran"


def test_an_unhealthy_channel_falls_back_to_the_backoff_delay(mem, no_check_in, contended):
    backend = mem.backend
    backend.wake_ups.deliver = lambda key, ticket_id=None, grant=None: False  # wake-ups lost
    backend.wake_ups.reaches_other_processes = False  # and known unreliable
    held = backend.acquire("w:poll", 10_000)
    options = {"retry_delay_ms": 5, "backoff": "fixed", "timeout_ms": 600_000}
    waiter = in_thread(lambda: lock(lambda: "ran", key="w:poll", using=backend, **options))
    assert contended("w:poll").wait(JOIN_S)
    backend.release(held.lock_id)
    assert finished(*waiter) == "ran"


def test_a_lost_connection_wakes_every_waiter_to_poll(mem, no_check_in):
    wake_ups = mem.backend.wake_ups
    first = wake_ups.listen("w:lost-conn", WaitTicket.new().id)
    second = wake_ups.listen("w:other", WaitTicket.new().id)
    try:
        assert first.healthy and second.healthy
        wake_ups.connection_lost()
        assert first.wait(0, None) and second.wait(0, None)
        assert not first.healthy and not second.healthy
        # A listener registered after the loss is healthy again.
        third = wake_ups.listen("w:lost-conn", WaitTicket.new().id)
        assert third.healthy
        third.close()
    finally:
        first.close()
        second.close()


def test_no_wake_up_is_lost_in_a_randomized_release_race(mem, no_check_in):
    """A holder releases at a random moment while a waiter registers and tries; the
    waiter must always get the key, through its attempt or through a wake-up."""
    backend = mem.backend
    rng = random.Random(1414)
    for round_number in range(3000):
        key = f"w:race:{round_number % 7}"
        held = backend.acquire(key, 10_000)
        assert held.ok
        spins = rng.randrange(0, 200)
        waiter = in_thread(lambda k=key: lock(lambda: True, key=k, using=backend, **NEVER))
        for _ in range(spins):
            pass
        backend.release(held.lock_id)
        assert finished(*waiter) is True


# ------------------------------------------------------------------ give-ups
def test_a_timed_out_waiter_leaves_the_queue(mem):
    backend = mem.backend
    held = backend.acquire("w:timeout", 10_000)
    with pytest.raises(AcquisitionTimeout):
        lock(lambda: None, key="w:timeout", using=backend, timeout_ms=30, retry_delay_ms=5)
    assert "w:timeout" not in backend._store.queues
    backend.release(held.lock_id)
    assert backend.acquire("w:timeout", 10_000).fence == "000000000000002"


def test_a_cancelled_waiter_leaves_the_queue(mem, no_check_in, contended):
    backend = mem.backend
    held = backend.acquire("w:cancel", 10_000)
    cancel = threading.Event()
    waiter = in_thread(
        lambda: lock(lambda: None, key="w:cancel", using=backend, cancel=cancel, **NEVER)
    )
    assert contended("w:cancel").wait(JOIN_S)
    cancel.set()
    with pytest.raises(Aborted):
        finished(*waiter)
    assert "w:cancel" not in backend._store.queues
    backend.release(held.lock_id)


def test_an_async_waiter_is_woken_and_a_cancelled_one_leaves_the_queue(mem, no_check_in):
    backend = mem.backend

    async def scenario():
        held = await backend.aacquire("w:async", 10_000)
        woken = asyncio.create_task(alock(lambda: "ran", key="w:async", using=backend, **NEVER))
        doomed = asyncio.create_task(alock(lambda: "never", key="w:async", using=backend, **NEVER))
        while len(backend._store.queues.get("w:async", {})) < 2:
            await asyncio.sleep(0)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert len(backend._store.queues["w:async"]) == 1
        await backend.arelease(held.lock_id)
        return await asyncio.wait_for(woken, JOIN_S)

    assert asyncio.run(scenario()) == "ran"
    assert "w:async" not in backend._store.queues


# --------------------------------------------------------------- on_contended
def test_skip_returns_none_without_calling_and_sends_lock_contended(mem, contended):
    backend = mem.backend
    held = backend.acquire("w:skip", 10_000)
    calls: list[int] = []

    @locked("w:skip", using=backend, on_contended="skip")
    def task():
        calls.append(1)
        return "ran"

    assert task() is None
    assert lock(lambda: calls.append(2), key="w:skip", using=backend, on_contended="skip") is None
    assert calls == []
    assert contended("w:skip").is_set()
    assert "w:skip" not in backend._store.queues  # one attempt, no ticket
    backend.release(held.lock_id)
    assert task() == "ran"


def test_skip_on_a_coroutine_function(mem):
    backend = mem.backend
    held = backend.acquire("w:askip", 10_000)

    @locked("w:askip", using=backend, on_contended="skip")
    async def task():
        return "ran"

    assert asyncio.run(task()) is None
    backend.release(held.lock_id)
    assert asyncio.run(task()) == "ran"


def test_raise_fails_after_one_attempt(mem):
    backend = mem.backend
    held = backend.acquire("w:raise", 10_000)
    attempts: list[int] = []

    def receiver(sender, attempt, **kwargs):
        attempts.append(attempt)

    signals.lock_contended.connect(receiver, weak=False)
    try:
        with pytest.raises(AcquisitionTimeout, match="on_contended='raise'") as info:
            lock(lambda: None, key="w:raise", using=backend, on_contended="raise")
    finally:
        signals.lock_contended.disconnect(receiver)
    assert attempts == [1]
    assert info.value.context["key"] == "w:raise"
    backend.release(held.lock_id)


def test_skip_cannot_guard_a_with_block(mem):
    block = locked("w:block", using=mem.backend, on_contended="skip")
    with pytest.raises(InvalidArgument, match="cannot skip a with block"), block:
        pass

    async def scenario():
        async with locked("w:block", using=mem.backend, on_contended="skip"):
            pass

    with pytest.raises(InvalidArgument, match="cannot skip a with block"):
        asyncio.run(scenario())
    assert not mem.backend.is_locked("w:block")


def test_on_contended_is_checked_when_the_decorator_is_built():
    with pytest.raises(InvalidArgument, match="on_contended must be 'wait', 'skip' or 'raise'"):
        locked("w:bad", on_contended="queue")


class _Subscribing(WakeUps):
    """A registry whose subscriptions would need the server: counts them."""

    def __init__(self):
        super().__init__("subscribing")
        self.subscribed: list[str] = []

    def _subscribe(self, key):  # subscriptions linger, as Redis's do
        if key not in self.subscribed:
            self.subscribed.append(key)
        return True

    def ready(self, key):
        return key in self.subscribed


def test_a_fresh_key_is_tried_without_a_ticket_and_subscribed_only_when_held(mem, monkeypatch):
    backend = mem.backend
    wake_ups = _Subscribing()
    monkeypatch.setattr(backend, "_make_wake_ups", lambda: wake_ups)
    tickets: list[object] = []
    acquire = backend.acquire

    def spy(key, ttl_ms, *, cancel=None, ticket=None):
        tickets.append(ticket is not None)
        return acquire(key, ttl_ms, cancel=cancel, ticket=ticket)

    monkeypatch.setattr(backend, "acquire", spy)
    assert lock(lambda: "ran", key="w:fresh", using=backend) == "ran"
    assert (wake_ups.subscribed, tickets) == ([], [False])

    held = backend._acquire("w:busy", 10_000, None)
    tickets.clear()
    with pytest.raises(AcquisitionTimeout):
        lock(lambda: None, key="w:busy", using=backend, timeout_ms=20, retry_delay_ms=5)
    # Contended: subscribed, then queued at once, then every attempt with the ticket.
    assert wake_ups.subscribed == ["w:busy"]
    assert tickets[:2] == [False, True] and all(tickets[1:])
    # A hot key (its channel still subscribed): the first attempt carries the ticket.
    tickets.clear()
    with pytest.raises(AcquisitionTimeout):
        lock(lambda: None, key="w:busy", using=backend, timeout_ms=20, retry_delay_ms=5)
    assert tickets[0] is True and wake_ups.subscribed == ["w:busy"]
    backend.release(held.lock_id)


# ------------------------------------------------------------------ the pause
class _Listener:
    def __init__(self, healthy):
        self.healthy = healthy
        self.grant = None
        self.recheck_at = None

    def close(self):
        pass


@pytest.mark.parametrize(
    ("healthy", "delay_s", "remaining_s", "position", "expected_s"),
    [
        # Healthy: until the schedule's next attempt (issue 20: it slept to the check-in).
        (True, 0.05, 5.0, 3, 0.05),
        (True, 4.0, 5.0, 3, CHECK_IN_MS / 1000),  # ...or the check-in, if sooner
        (True, 0.5, 0.3, 0, 0.3),  # ...but never past the timeout
        (False, 0.4, 5.0, None, 0.4),  # unhealthy, place unknown: the backoff delay
        (False, 4.0, 5.0, None, CHECK_IN_MS / 1000),  # ...capped at the check-in
        (False, 0.4, 5.0, 0, HEAD_POLL_MS / 1000),  # first in line polls quickly
        (False, 0.4, 5.0, 3, 4 * HEAD_POLL_MS / 1000),  # fourth: four times less often
        (False, 0.02, 5.0, 3, 0.02),  # ...never later than the backoff delay
    ],
)
def test_pause_plan(healthy, delay_s, remaining_s, position, expected_s):
    session = WaitSession(WakeUps("test"), "k", clock=lambda: 100.0)  # the last request: now
    session.listener = _Listener(healthy)
    assert session.pause_plan(delay_s, remaining_s, position) == expected_s


def test_wake_ups_deliver_only_to_the_named_ticket():
    wake_ups = WakeUps("test")
    first, second = WaitTicket.new(), WaitTicket.new()
    listen_first = wake_ups.listen("k", first.id)
    listen_second = wake_ups.listen("k", second.id)
    assert wake_ups.deliver("k", second.id) is True
    assert listen_second.wait(0, None) is True
    assert listen_first.wait(0, None) is False
    assert wake_ups.deliver("k", WaitTicket.new().id) is False
    listen_first.close()
    listen_second.close()
    assert wake_ups.keys() == []


def test_early_polls_of_the_first_waiter_do_not_use_up_max_retries(mem, no_check_in):
    backend = mem.backend
    backend.wake_ups.deliver = lambda key, ticket_id=None, grant=None: False  # nothing is delivered
    backend.wake_ups.reaches_other_processes = False  # as on SQLite across processes
    held = backend.acquire("w:polls", 10_000)
    polls = threading.Semaphore(0)

    def receiver(sender, **kwargs):
        polls.release()

    signals.lock_contended.connect(receiver, weak=False)
    try:
        options = {"max_retries": 1, "retry_delay_ms": 600_000, "backoff": "fixed"}
        waiter = in_thread(lambda: lock(lambda: "ran", key="w:polls", using=backend, **options))
        for _ in range(5):  # five polls (10 ms apart) before the holder lets go
            assert polls.acquire(timeout=JOIN_S)
    finally:
        signals.lock_contended.disconnect(receiver)
    backend.release(held.lock_id)
    assert finished(*waiter) == "ran"


class _HoldingBack(WakeUps):
    """A registry whose process has just granted key "k" away (see hold_back)."""

    def hold_back(self, key: str) -> float:
        return 0.0007 if key == "k" else 0.0


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_session_right_after_a_grant_of_its_key_holds_its_first_attempt_back(
    monkeypatch, asynchronous
):
    """The registry says this process granted the key away a moment ago: the
    session's first attempt waits what it says (the grantee's process is waking up,
    and this attempt can only queue); the attempts after it do not wait again."""
    from django_syncguard.waiting import session as session_module

    pauses: list[float] = []

    async def asleep(seconds: float) -> None:
        pauses.append(seconds)

    # The session module's own names only: other threads keep the real sleep.
    clock = SimpleNamespace(sleep=pauses.append, monotonic=time.monotonic)
    monkeypatch.setattr(session_module, "time", clock)
    monkeypatch.setattr(session_module, "asyncio", SimpleNamespace(sleep=asleep))
    session = WaitSession(_HoldingBack("test"), "k")
    held = AcquireResult.locked(0)

    def request(ticket):
        return held

    async def arequest(ticket):
        return held

    for _ in range(3):
        if asynchronous:
            assert asyncio.run(session.aattempt(arequest)) is held
        else:
            assert session.attempt(request) is held
    assert pauses == [0.0007]
    other = WaitSession(_HoldingBack("test"), "elsewhere")
    assert other.attempt(request) is held
    assert pauses == [0.0007]  # another key: no wait
