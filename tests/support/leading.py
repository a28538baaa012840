"""What the leading tests of every backend with a channel worker share (Redis,
PostgreSQL): a waiting thread that read its own grant has left the lead."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from django_syncguard.waiting import WaitTicket

#: (ticket, name of the delivering thread) of each wake-up delivered.
Deliveries = list[tuple[str | None, str]]

#: A generous bound for an event that must arrive; never slept.
WAKE_S = 10.0


def record_deliveries(wake_ups: Any, monkeypatch: pytest.MonkeyPatch) -> Deliveries:
    """(ticket, name of the delivering thread) for every wake-up ``wake_ups`` delivers
    from now on (until ``monkeypatch`` undoes it)."""
    seen: Deliveries = []
    original = wake_ups.deliver

    def deliver(key: str, ticket_id: str | None = None, grant: Any = None) -> bool:
        seen.append((ticket_id, threading.current_thread().name))
        return bool(original(key, ticket_id, grant))

    monkeypatch.setattr(wake_ups, "deliver", deliver)
    return seen


def assert_the_worker_reads_again(
    backend: Any, key: str, granted: Any, deliveries: Deliveries, ttl_ms: int
) -> None:
    """After a leader left with ``granted`` (its listener, holding ``key`` by a grant):
    the worker's thread reads again (it takes the connection back within LEAD_PARK_S),
    so a waiter that does not lead is woken by it. ``deliveries``: (ticket, delivering
    thread's name) of every wake-up delivered so far, the leader's first."""
    wake_ups = backend.wake_ups
    second = WaitTicket.new()
    follower = wake_ups.listen(key, second.id)
    try:
        assert backend.acquire(key, ttl_ms, ticket=second).queue_position == 0
        assert backend.release(granted.grant.lock_id).ok
        assert follower._event.wait(WAKE_S) is True  # not wait(): it would lead
        assert deliveries[1] == (second.id, wake_ups._thread.name)
        assert follower.grant is not None
    finally:
        follower.close()
