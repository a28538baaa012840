"""Lock lifecycle signals sent by lock() / alock() / locked() / Lease."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.dispatch import Signal

from django_syncguard import (
    AcquisitionTimeout,
    ServiceUnavailable,
    alock,
    current_lock,
    lock,
    locked,
)
from django_syncguard import signals as sg
from django_syncguard.backends.memory import MemoryBackend
from django_syncguard.keys import display_hash, hash_key

KEY = "invoice:42"
FENCE = "000000000000001"
ALL = {
    "lock_acquired": sg.lock_acquired,
    "lock_released": sg.lock_released,
    "lock_extended": sg.lock_extended,
    "lock_lost": sg.lock_lost,
    "lock_force_released": sg.lock_force_released,
    "lock_contended": sg.lock_contended,
}
NAMES = {signal: name for name, signal in ALL.items()}

Received = tuple[str, type, dict[str, Any]]


@contextmanager
def receiving(*signals: Signal, receiver: Any = None) -> Iterator[list[Received]]:
    """Record what ``signals`` (default: all six) send while the block runs.

    Connected on entry and disconnected on exit, so nothing leaks into other tests.
    ``receiver`` replaces the recorder (it must then record for itself).
    """
    received: list[Received] = []

    def record(signal: Signal, sender: type, **kwargs: Any) -> None:
        received.append((NAMES[signal], sender, kwargs))

    chosen = signals or tuple(ALL.values())
    handler = receiver or record
    for signal in chosen:
        signal.connect(handler, weak=False)
    try:
        yield received
    finally:
        for signal in chosen:
            signal.disconnect(handler)


def common(backend: MemoryBackend, lock_id: str, fence: str = FENCE, key: str = KEY) -> dict:
    """The keyword arguments every signal about a held lock carries."""
    return {
        "alias": backend.alias,
        "key_hash": display_hash(key),
        "lock_id_hash": display_hash(lock_id),
        "fence": fence,
    }


def acquired(backend, lease_info, attempts=1, **overrides) -> Received:
    lock_id, expires_at_ms = lease_info
    kwargs = {
        **common(backend, lock_id, **overrides),
        "expires_at_ms": expires_at_ms,
        "attempts": attempts,
    }
    return ("lock_acquired", MemoryBackend, kwargs)


def released(backend, lock_id, ok=True, **overrides) -> Received:
    return ("lock_released", MemoryBackend, {**common(backend, lock_id, **overrides), "ok": ok})


def snapshot() -> tuple[str, int]:
    """The running code's lease: its lock id and expiry."""
    lease = current_lock()
    assert lease is not None
    return lease.lock_id, lease.expires_at_ms


# ------------------------------------------------------------ acquire/release
def test_lock_sends_acquired_then_released(mem):
    with receiving() as received:
        info = lock(snapshot, key=KEY, using=mem.backend)
    assert info[1] == mem.now_ms() + 30_000
    assert received == [acquired(mem.backend, info), released(mem.backend, info[0])]


async def test_alock_sends_acquired_then_released(mem):
    async def work():
        return snapshot()

    with receiving() as received:
        info = await alock(work, key=KEY, using=mem.backend)
    assert received == [acquired(mem.backend, info), released(mem.backend, info[0])]


def test_decorator_sends_acquired_then_released(mem):
    @locked("invoice:<pk>", using=mem.backend)
    def pay(pk):
        return snapshot()

    with receiving() as received:
        info = pay(42)
    assert received == [acquired(mem.backend, info), released(mem.backend, info[0])]


async def test_async_decorator_sends_acquired_then_released(mem):
    @locked("invoice:<pk>", using=mem.backend)
    async def pay(pk):
        return snapshot()

    with receiving() as received:
        info = await pay(42)
    assert received == [acquired(mem.backend, info), released(mem.backend, info[0])]


def test_context_manager_sends_one_release_even_when_released_early(mem):
    with receiving() as received, locked(KEY, using=mem.backend) as lease:
        info = (lease.lock_id, lease.expires_at_ms)
        assert received == [acquired(mem.backend, info)]
        assert lease.release().ok is True
    # The with's own release is the no-I/O second call: it sends nothing.
    assert received == [acquired(mem.backend, info), released(mem.backend, lease.lock_id)]


async def test_async_context_manager_sends_acquired_then_released(mem):
    with receiving() as received:
        async with locked(KEY, using=mem.backend) as lease:
            info = (lease.lock_id, lease.expires_at_ms)
    assert received == [acquired(mem.backend, info), released(mem.backend, lease.lock_id)]


def test_sender_filter_selects_the_backend_class(mem):
    calls: list[str] = []

    def only_memory(sender, key_hash, **kwargs):
        calls.append(key_hash)

    sg.lock_acquired.connect(only_memory, sender=MemoryBackend, weak=False)
    try:
        lock(lambda: None, key=KEY, using=mem.backend)
    finally:
        sg.lock_acquired.disconnect(only_memory, sender=MemoryBackend)
    assert calls == [display_hash(KEY)]


def test_receivers_get_the_keyed_display_hashes_not_hash_key(mem):
    with receiving(sg.lock_acquired) as received, locked(KEY, using=mem.backend) as lease:
        pass
    [(_, _, kwargs)] = received
    assert kwargs["key_hash"] == display_hash(KEY) != hash_key(KEY)
    assert kwargs["lock_id_hash"] == display_hash(lease.lock_id) != hash_key(lease.lock_id)


# ------------------------------------------------------------------ contention
def test_contended_attempts_then_acquired(mem):
    holder = mem.backend.acquire(KEY, 10_000)

    def free_after_second(sender, attempt, **kwargs):
        if attempt == 2:
            mem.backend.release(holder.lock_id)

    with receiving() as received, receiving(sg.lock_contended, receiver=free_after_second):
        info = lock(snapshot, key=KEY, using=mem.backend, retry_delay_ms=0)
    shown = {"alias": mem.backend.alias, "key_hash": display_hash(KEY)}
    contended = [("lock_contended", MemoryBackend, shown)]
    assert received == [
        (*contended[0][:2], {**contended[0][2], "attempt": 1}),
        (*contended[0][:2], {**contended[0][2], "attempt": 2}),
        acquired(mem.backend, info, attempts=3, fence="000000000000002"),
        released(mem.backend, info[0], fence="000000000000002"),
    ]


def test_contended_attempts_then_timeout(mem):
    mem.backend.acquire(KEY, 10_000)
    with receiving() as received, pytest.raises(AcquisitionTimeout):
        lock(lambda: None, key=KEY, using=mem.backend, max_retries=2, retry_delay_ms=0)
    assert [(name, kwargs.get("attempt")) for name, _, kwargs in received] == [
        ("lock_contended", 1),
        ("lock_contended", 2),
        ("lock_contended", 3),
    ]
    assert all(set(kwargs) == {"alias", "key_hash", "attempt"} for _, _, kwargs in received)


async def test_async_contended_attempts_then_acquired(mem):
    holder = await mem.backend.aacquire(KEY, 10_000)

    async def free_after_first(sender, attempt, **kwargs):
        await mem.backend.arelease(holder.lock_id)

    async def work():
        return snapshot()

    with receiving() as received, receiving(sg.lock_contended, receiver=free_after_first):
        info = await alock(work, key=KEY, using=mem.backend, retry_delay_ms=0)
    assert [name for name, _, _ in received] == [
        "lock_contended",
        "lock_acquired",
        "lock_released",
    ]
    assert received[0][2] == {
        "alias": mem.backend.alias,
        "key_hash": display_hash(KEY),
        "attempt": 1,
    }
    assert received[1] == acquired(mem.backend, info, attempts=2, fence="000000000000002")


# ---------------------------------------------------------------------- extend
def test_lease_extend_sends_extended(mem):
    with receiving() as received, locked(KEY, using=mem.backend, ttl_ms=1_000) as lease:
        mem.advance(500)
        result = lease.extend(4_000)
    assert received[1] == (
        "lock_extended",
        MemoryBackend,
        {**common(mem.backend, lease.lock_id), "expires_at_ms": result.expires_at_ms},
    )
    assert result.expires_at_ms == mem.now_ms() + 4_000
    assert [name for name, _, _ in received] == [
        "lock_acquired",
        "lock_extended",
        "lock_released",
    ]


async def test_lease_aextend_sends_extended(mem):
    async with locked(KEY, using=mem.backend, ttl_ms=1_000) as lease:
        with receiving(sg.lock_extended) as received:
            result = await lease.aextend()
    assert received == [
        (
            "lock_extended",
            MemoryBackend,
            {**common(mem.backend, lease.lock_id), "expires_at_ms": result.expires_at_ms},
        )
    ]


# ------------------------------------------------------------------------ lost
def lost(backend, lock_id, reason="expired") -> Received:
    return ("lock_lost", MemoryBackend, {**common(backend, lock_id), "reason": reason})


def test_renewal_after_expiry_sends_lost_once(mem):
    with receiving() as received, locked(KEY, using=mem.backend, ttl_ms=1_000) as lease:
        mem.advance(5_000)  # past the TTL and the 1 s tolerance
        assert lease._renew_once() is False  # one auto-extend tick
        assert lease.lost is True
        assert lease._renew_once() is False  # lost already: no second signal
    assert received[1:] == [
        lost(mem.backend, lease.lock_id),
        released(mem.backend, lease.lock_id, ok=False),
    ]


def test_auto_extend_thread_sends_lost(mem, monkeypatch):
    arrived = threading.Event()
    # The renewal waits for the clock's move, which a busy machine could otherwise
    # delay past the first renewal (100 real ms): a lock_extended before the loss.
    advanced = mem.delay_extends(monkeypatch)

    def on_lost(sender, **kwargs):
        arrived.set()

    with (
        receiving() as received,
        receiving(sg.lock_lost, receiver=on_lost),
        locked(KEY, using=mem.backend, ttl_ms=300, auto_extend=True) as lease,
    ):
        mem.advance(5_000)  # the lock expires before the first renewal
        advanced.set()
        assert arrived.wait(5), "no lock_lost within 5 s"
    assert received[1:] == [
        lost(mem.backend, lease.lock_id),
        released(mem.backend, lease.lock_id, ok=False),
    ]


async def test_async_auto_extend_awaits_async_receivers(mem):
    arrived = asyncio.Event()
    seen: list[dict[str, Any]] = []

    async def on_lost(sender, **kwargs):
        seen.append(kwargs)
        arrived.set()

    with receiving(sg.lock_lost, receiver=on_lost):
        async with locked(KEY, using=mem.backend, ttl_ms=300, auto_extend=True) as lease:
            mem.advance(5_000)
            await asyncio.wait_for(arrived.wait(), 5)
    assert seen == [{"signal": sg.lock_lost, **lost(mem.backend, lease.lock_id)[2]}]
    assert lease._arenewer is not None and lease._arenewer.done()


async def test_async_release_lets_a_signal_under_way_finish(mem):
    """A release waits for the renewal task's delivery instead of cancelling it."""
    delivering, gate = asyncio.Event(), asyncio.Event()
    finished: list[int] = []

    async def slow_receiver(sender: type, **kwargs: Any) -> None:
        delivering.set()
        await gate.wait()
        finished.append(kwargs["expires_at_ms"])

    with receiving() as received, receiving(sg.lock_extended, receiver=slow_receiver):
        async with locked(KEY, using=mem.backend, ttl_ms=300, auto_extend=True) as lease:
            await asyncio.wait_for(delivering.wait(), 5)
            releasing = asyncio.create_task(lease.arelease())
            for _ in range(5):  # let the release run as far as it can
                await asyncio.sleep(0)
            assert lease.released and not releasing.done()
            gate.set()
            assert (await releasing).ok is True
    assert finished == [lease.expires_at_ms]
    assert [name for name, _, _ in received] == [
        "lock_acquired",
        "lock_extended",
        "lock_released",
    ]


def test_renewal_errors_until_expiry_send_lost_with_reason_error(mem, monkeypatch):
    with receiving(sg.lock_lost) as received, locked(KEY, using=mem.backend) as lease:
        monkeypatch.setattr(mem.backend, "_extend", _raise_unavailable)
        lease._deadline = time.monotonic() - 1  # the lease's own expiry estimate passed
        assert lease._renew_once() is False
    assert received == [lost(mem.backend, lease.lock_id, reason="error")]


def _raise_unavailable(*args: Any, **kwargs: Any) -> None:
    raise ServiceUnavailable("server gone")


def test_expired_before_release_sends_lost_then_released(mem):
    with receiving() as received, locked(KEY, using=mem.backend, ttl_ms=1_000) as lease:
        mem.advance(5_000)
    assert received[1:] == [
        lost(mem.backend, lease.lock_id),
        released(mem.backend, lease.lock_id, ok=False),
    ]


# ------------------------------------------------------------ broken receivers
def _broken(sender, **kwargs):
    raise RuntimeError("receiver broke")


def test_a_raising_receiver_never_stops_the_release(mem, caplog):
    caplog.set_level(logging.WARNING, logger="django_syncguard.signals")
    with receiving(sg.lock_acquired, sg.lock_released, receiver=_broken):
        assert lock(lambda: "done", key=KEY, using=mem.backend) == "done"
    assert mem.backend.is_locked(KEY) is False
    warnings = [r for r in caplog.records if r.name == "django_syncguard.signals"]
    assert [r.levelno for r in warnings] == [logging.WARNING, logging.WARNING]
    assert "lock_acquired" in warnings[0].getMessage()
    assert "lock_released" in warnings[1].getMessage()
    assert all(r.exc_info and isinstance(r.exc_info[1], RuntimeError) for r in warnings)


async def test_a_raising_async_receiver_never_stops_the_release(mem, caplog):
    async def broken(sender, **kwargs):
        raise RuntimeError("receiver broke")

    async def work():
        return 1

    caplog.set_level(logging.WARNING, logger="django_syncguard.signals")
    with receiving(sg.lock_acquired, receiver=broken):
        assert await alock(work, key=KEY, using=mem.backend) == 1
    assert await mem.backend.ais_locked(KEY) is False
    [warning] = [r for r in caplog.records if r.name == "django_syncguard.signals"]
    assert warning.exc_info and isinstance(warning.exc_info[1], RuntimeError)


async def test_sync_helper_in_a_running_loop_with_async_receiver(mem, caplog):
    """send_robust cannot run async receivers inside a running loop; the lock copes."""

    async def receiver(sender, **kwargs):
        pass

    caplog.set_level(logging.WARNING, logger="django_syncguard.signals")
    with receiving(sg.lock_acquired, receiver=receiver):
        assert lock(lambda: 2, key=KEY, using=mem.backend) == 2
    assert mem.backend.is_locked(KEY) is False
    assert any("Sending django_syncguard signal lock_acquired" in r.message for r in caplog.records)


# ------------------------------------------------------------------ no secrets
def test_no_signal_carries_the_raw_key_or_lock_id(mem):
    holder = mem.backend.acquire(KEY, 10_000)

    def free(sender, **kwargs):
        mem.backend.release(holder.lock_id)

    with receiving() as received, receiving(sg.lock_contended, receiver=free):
        with locked(KEY, using=mem.backend, ttl_ms=1_000, retry_delay_ms=0) as lease:
            lease.extend()
            mem.advance(5_000)
            lease.extend()  # finds it gone: lost
        raw = {KEY, lease.lock_id, holder.lock_id}
    names = [name for name, _, _ in received]
    assert names == [
        "lock_contended",
        "lock_acquired",
        "lock_extended",
        "lock_lost",
        "lock_released",
    ]
    for _, _, kwargs in received:
        for value in kwargs.values():
            assert not any(secret in str(value) for secret in raw), value


def test_nothing_is_hashed_without_receivers(mem, monkeypatch):
    def forbidden(value: str) -> str:
        raise AssertionError("hashed for a signal nobody listens to")

    monkeypatch.setattr(sg, "display_hash", forbidden)
    monkeypatch.setattr(sg, "display_hash_of", forbidden)
    assert lock(lambda: 3, key=KEY, using=mem.backend) == 3


def test_the_six_signals_exist():
    assert all(isinstance(signal, Signal) for signal in ALL.values())
    assert len({id(signal) for signal in ALL.values()}) == 6


def test_an_unobserved_hold_does_not_ask_django_for_receivers(mem, monkeypatch):
    def forbidden(self, sender=None):
        raise AssertionError("has_listeners() asked while nothing is connected")

    monkeypatch.setattr(Signal, "has_listeners", forbidden)
    assert lock(lambda: 3, key=KEY, using=mem.backend) == 3


def test_a_receiver_connected_after_unobserved_locks_hears_the_next_one(mem):
    assert lock(lambda: 1, key=KEY, using=mem.backend) == 1
    with receiving(sg.lock_acquired, sg.lock_released) as received, locked(KEY, using=mem.backend):
        lease = snapshot()
    second = "000000000000002"
    assert received == [
        acquired(mem.backend, lease, fence=second),
        released(mem.backend, lease[0], fence=second),
    ]
    # ... and disconnecting too: nothing is sent to a receiver that is gone.
    assert lock(lambda: 2, key=KEY, using=mem.backend) == 2
    assert len(received) == 2
