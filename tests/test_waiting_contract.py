"""Fair queues and wake-ups, run against every backend (``specs/contract.md``, Waiting).

Each backend keeps, per key, a queue of live wait tickets: a held key queues a
ticket, a free key goes to the first live ticket (to a caller without a ticket only
when nobody waits), a release or a withdrawal wakes the first live ticket through the
backend's ``wake_ups``, and a ticket that is not renewed within its patience stops
holding the queue up. Wake-ups are awaited on events, never on sleeps.
"""

from __future__ import annotations

import time

import pytest

from django_syncguard import AcquisitionTimeout, InvalidArgument, generate_lock_id, lock
from django_syncguard.results import AcquireResult
from django_syncguard.waiting import PATIENCE_MS, WaitTicket

TTL = 10_000
WAKE_S = 10.0  # generous bound for an event that must arrive; never slept
FIXED_150_MS = {
    "max_retries": 3,
    "retry_delay_ms": 150,
    "backoff": "fixed",
    "jitter": "none",
    "timeout_ms": 10_000,
}


def ticket(patience_ms: int = PATIENCE_MS) -> WaitTicket:
    return WaitTicket(generate_lock_id(), patience_ms)


def take(backend, key, **kwargs):
    result = backend.acquire(key, TTL, **kwargs)
    assert result.ok, result
    return result


def test_every_backend_keeps_queues_and_wakes_waiters(backend):
    assert backend.wake_ups is not None


def test_a_free_key_without_waiters_is_taken_with_or_without_a_ticket(backend):
    first = take(backend, "q:free", ticket=ticket())
    backend.release(first.lock_id)
    second = take(backend, "q:free")
    assert (first.fence, second.fence) == ("000000000000001", "000000000000002")


def test_tickets_queue_in_arrival_order_and_the_first_takes_the_freed_key(backend):
    held = take(backend, "q:order")
    a, b = ticket(), ticket()
    first = backend.acquire("q:order", TTL, ticket=a)
    second = backend.acquire("q:order", TTL, ticket=b)
    assert first == second == AcquireResult(ok=False, reason="locked")
    assert (first.queue_position, second.queue_position) == (0, 1)
    # Another attempt keeps the ticket's place.
    assert backend.acquire("q:order", TTL, ticket=b).queue_position == 1
    assert backend.release(held.lock_id).ok

    # Free (or granted to a), with two waiters: neither a caller without a ticket (the
    # releaser coming back) nor the second ticket may take it. A grant took a out of
    # the queue; its next attempt returns the grant.
    assert backend.acquire("q:order", TTL) == AcquireResult(ok=False, reason="locked")
    assert backend.acquire("q:order", TTL, ticket=b).queue_position == (0 if backend.grants else 1)
    got_a = take(backend, "q:order", ticket=a)
    assert got_a.fence == "000000000000002"
    assert backend.release(got_a.lock_id).ok
    assert not backend.acquire("q:order", TTL).ok
    got_b = take(backend, "q:order", ticket=b)
    assert got_b.fence == "000000000000003"
    assert backend.release(got_b.lock_id).ok
    # The queue is empty again.
    assert take(backend, "q:order").fence == "000000000000004"


def test_a_release_wakes_the_first_waiter_and_then_the_next(backend):
    wake_ups = backend.wake_ups
    a, b = ticket(), ticket()
    listen_a = wake_ups.listen("q:wake", a.id)
    listen_b = wake_ups.listen("q:wake", b.id)
    try:
        held = take(backend, "q:wake")
        assert not backend.acquire("q:wake", TTL, ticket=a).ok
        assert not backend.acquire("q:wake", TTL, ticket=b).ok
        backend.release(held.lock_id)
        assert listen_a.wait(WAKE_S, None) is True
        got_a = take(backend, "q:wake", ticket=a)
        backend.release(got_a.lock_id)
        assert listen_b.wait(WAKE_S, None) is True
        take(backend, "q:wake", ticket=b)
    finally:
        listen_a.close()
        listen_b.close()


def test_a_withdrawn_first_waiter_hands_its_turn_to_the_next(backend):
    wake_ups = backend.wake_ups
    a, b = ticket(), ticket()
    listen_b = wake_ups.listen("q:withdraw", b.id)
    try:
        held = take(backend, "q:withdraw")
        assert not backend.acquire("q:withdraw", TTL, ticket=a).ok
        assert not backend.acquire("q:withdraw", TTL, ticket=b).ok
        backend.release(held.lock_id)
        assert not backend.acquire("q:withdraw", TTL, ticket=b).ok  # a is first
        backend.withdraw("q:withdraw", a.id)
        assert listen_b.wait(WAKE_S, None) is True
        # A grant to a took fence 2 before a gave it back.
        expected = "000000000000003" if backend.grants else "000000000000002"
        assert take(backend, "q:withdraw", ticket=b).fence == expected
    finally:
        listen_b.close()


def test_withdrawing_an_unknown_ticket_changes_nothing(backend):
    held = take(backend, "q:unknown")
    backend.withdraw("q:unknown", generate_lock_id())
    backend.withdraw("q:never-used", generate_lock_id())
    assert backend.lookup(key="q:unknown").fence == held.fence


def test_a_waiter_that_stops_checking_in_loses_its_place(backend, harness):
    held = take(backend, "q:patience")
    gone, alive = ticket(patience_ms=1_000), ticket(patience_ms=600_000)
    assert not backend.acquire("q:patience", TTL, ticket=gone).ok
    assert not backend.acquire("q:patience", TTL, ticket=alive).ok
    backend.release(held.lock_id)
    assert not backend.acquire("q:patience", TTL, ticket=alive).ok
    harness.advance(5_000)  # ages locks and tickets alike
    # With grants, the release granted the key to the gone waiter (fence 2), and that
    # grant lapsed unclaimed.
    expected = "000000000000003" if backend.grants else "000000000000002"
    assert take(backend, "q:patience", ticket=alive).fence == expected


def test_a_ticket_is_checked_before_any_io(backend, no_io):
    with pytest.raises(InvalidArgument, match="ticket must be a WaitTicket"):
        backend.acquire("q:bad", TTL, ticket="not-a-ticket")
    with pytest.raises(InvalidArgument):
        backend.acquire("q:bad", TTL, ticket=WaitTicket("short", 1_000))
    with pytest.raises(InvalidArgument):
        backend.withdraw("q:bad", "short")


def test_wake_ups_off_means_plain_backoff_without_a_queue(harness):
    quiet = type(harness)(WAKE_UPS=False)
    try:
        backend = quiet.backend
        assert backend.wake_ups is None
        held = take(backend, "q:off")
        # The ticket is ignored: nothing is queued, so a free key goes to anyone.
        assert backend.acquire("q:off", TTL, ticket=ticket()).queue_position is None
        backend.release(held.lock_id)
        assert take(backend, "q:off").fence == "000000000000002"
    finally:
        quiet.close()


def test_the_wake_ups_option_must_be_a_bool(harness):
    with pytest.raises(InvalidArgument, match="WAKE_UPS"):
        type(harness)(WAKE_UPS="no")


@pytest.mark.parametrize("wake_ups", [True, False], ids=["wake-ups", "no-wake-ups"])
def test_a_waiter_gives_up_when_the_retry_formulas_say(harness, wake_ups):
    """Issue 20, defect 1: with wake-ups on, a timer wake-up did not count as a retry
    and ``max_retries=3`` waited three one-second check-ins (3 s) instead of 3 x 150 ms."""
    h = type(harness)(WAKE_UPS=wake_ups)
    try:
        held = take(h.backend, "q:budget")
        started = time.monotonic()
        # Counted: the first attempt and three retries (polls in between count for nothing).
        with pytest.raises(AcquisitionTimeout, match=r"after 4 attempts \(max_retries=3\)"):
            lock(lambda: None, key="q:budget", using=h.backend, **FIXED_150_MS)
        waited_s = time.monotonic() - started
        h.backend.release(held.lock_id)
    finally:
        h.close()
    assert (h.backend.wake_ups is not None) is wake_ups
    # The formulas: 3 x 150 ms. The bound above leaves room for a slow machine, and
    # stays far below the 3 s of the defect.
    assert 0.45 <= waited_s < 2.0
