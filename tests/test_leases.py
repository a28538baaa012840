"""Lease / current_lock() / auto-extend (``django_syncguard.leases``)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from django_syncguard import current_lock, locked, with_telemetry


# ------------------------------------------------------------- current_lock()
def test_current_lock_is_the_innermost_lease(mem):
    with locked("outer", using=mem.backend) as outer:
        assert current_lock() is outer
        with locked("inner", using=mem.backend) as inner:
            assert current_lock() is inner
        assert current_lock() is outer
    assert current_lock() is None


def test_current_lock_is_per_thread(mem):
    seen = []
    with locked("outer", using=mem.backend):
        thread = threading.Thread(target=lambda: seen.append(current_lock()))
        thread.start()
        thread.join()
    assert seen == [None]


# -------------------------------------------------------------------- leases
def test_lease_extend_updates_expiry(mem):
    with locked("job", using=mem.backend, ttl_ms=1_000) as lease:
        mem.advance(500)
        result = lease.extend(4_000)
        assert result.ok
        assert lease.expires_at_ms == mem.now_ms() + 4_000 == result.expires_at_ms
        assert lease.extend().expires_at_ms == mem.now_ms() + 1_000


def test_lease_lost_when_extend_finds_it_expired(mem, syncguard_log):
    with locked("job", using=mem.backend, ttl_ms=1_000) as lease:
        mem.advance(5_000)
        assert lease.extend().ok is False
        assert lease.lost is True
    warnings = [r for r in syncguard_log.records if "Lost the lock" in r.getMessage()]
    assert len(warnings) == 1
    assert lease.lock_id not in warnings[0].getMessage()


def test_lease_lost_when_expired_before_release(mem):
    with locked("job", using=mem.backend, ttl_ms=1_000) as lease:
        mem.advance(5_000)
    assert (lease.released, lease.lost) == (True, True)


# ---------------------------------------------------------------- auto-extend
def extend_events(backend):
    """A telemetry-wrapped backend and the extend outcomes it reports, with a signal."""
    outcomes: list[str] = []
    signal = threading.Event()

    def on_event(event):
        if event.type == "extend":
            outcomes.append(event.result)
            signal.set()

    return with_telemetry(backend, on_event), outcomes, signal


def test_auto_extend_renews_every_third_of_the_ttl(mem, monkeypatch):
    # The renewal thread waits until the test has moved the fake clock: on a busy
    # machine it could otherwise renew (after 100 real ms) before the move.
    advanced = mem.delay_extends(monkeypatch)
    wrapped, outcomes, renewed = extend_events(mem.backend)
    with locked("job", using=wrapped, ttl_ms=300, auto_extend=True) as lease:
        assert lease._renewer.interval == pytest.approx(0.1)  # a third of 300 ms
        acquired_at = mem.now_ms()
        mem.advance(100)
        advanced.set()
        assert renewed.wait(5), "no renewal within 5 s"
        assert outcomes[0] == "ok"
        assert lease.expires_at_ms == acquired_at + 100 + 300
        assert lease.lost is False
    assert mem.backend.is_locked("job") is False


def test_auto_extend_marks_the_lease_lost_when_renewal_fails(mem, syncguard_log, monkeypatch):
    # As above: a move delayed past the first renewal would give an "ok" first.
    advanced = mem.delay_extends(monkeypatch)
    wrapped, outcomes, renewed = extend_events(mem.backend)
    with locked("job", using=wrapped, ttl_ms=300, auto_extend=True) as lease:
        mem.advance(5_000)  # the lock expires before the first renewal
        advanced.set()
        assert renewed.wait(5), "no renewal within 5 s"
        lease._renewer.join(5)
        assert outcomes == ["fail"]
        assert lease.lost is True
    assert any("Lost the lock" in r.getMessage() for r in syncguard_log.records)


async def test_async_auto_extend_runs_as_a_task(mem):
    done = asyncio.Event()
    results = []

    def on_event(event):
        if event.type == "extend":
            results.append(event.result)
            done.set()

    wrapped = with_telemetry(mem.backend, on_event)
    async with locked("job", using=wrapped, ttl_ms=300, auto_extend=True) as lease:
        acquired_at = mem.now_ms()
        mem.advance(50)
        await asyncio.wait_for(done.wait(), 5)
        assert results[0] == "ok"
        assert lease.expires_at_ms == acquired_at + 50 + 300
    assert lease._arenewer.done()
