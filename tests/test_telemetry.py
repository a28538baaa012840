"""with_telemetry(): one event per completed operation, never in the way."""

from __future__ import annotations

import asyncio

import pytest

from django_syncguard import InvalidArgument, LockEvent, generate_lock_id, hash_key, with_telemetry


def test_events_for_each_operation(mem):
    events: list[LockEvent] = []
    backend = with_telemetry(mem.backend, events.append)
    first = backend.acquire("k", 1_000)
    backend.acquire("k", 1_000)
    backend.is_locked("k")
    backend.lookup(key="k")
    backend.extend(first.lock_id, 1_000)
    backend.release(first.lock_id)
    backend.release(first.lock_id)
    mem.advance(0)
    kh, ih = hash_key("k"), hash_key(first.lock_id)
    assert events == [
        LockEvent("acquire", "ok", key_hash=kh, lock_id_hash=ih),
        LockEvent("acquire", "fail", key_hash=kh, reason="locked"),
        LockEvent("is_locked", "ok", key_hash=kh),
        LockEvent("lookup", "ok", key_hash=kh),
        LockEvent("extend", "ok", lock_id_hash=ih),
        LockEvent("release", "ok", lock_id_hash=ih),
        LockEvent("release", "fail", lock_id_hash=ih, reason="not-found"),
    ]


def test_expired_release_reports_expired(mem):
    events: list[LockEvent] = []
    backend = with_telemetry(mem.backend, events.append)
    result = backend.acquire("k", 1_000)
    mem.advance(5_000)
    backend.release(result.lock_id)
    assert events[-1].reason == "expired"


def test_raw_values_only_on_request(mem):
    events: list[LockEvent] = []
    plain = with_telemetry(mem.backend, events.append)
    result = plain.acquire("k", 1_000)
    assert (events[0].key, events[0].lock_id) == (None, None)
    raw = with_telemetry(mem.backend, events.append, include_raw=lambda e: e.type == "release")
    raw.release(result.lock_id)
    assert (events[1].key, events[1].lock_id) == (None, result.lock_id)


def test_callback_errors_never_reach_the_caller(mem, syncguard_log):
    def broken(event):
        raise RuntimeError("telemetry down")

    backend = with_telemetry(mem.backend, broken)
    assert backend.acquire("k", 1_000).ok is True
    assert any("Telemetry callback failed" in r.getMessage() for r in syncguard_log.records)


def test_failed_operations_emit_nothing(mem):
    events: list[LockEvent] = []
    backend = with_telemetry(mem.backend, events.append)
    with pytest.raises(InvalidArgument, match="empty"):
        backend.acquire("", 1_000)
    assert events == []


def test_wrapper_keeps_capabilities_and_lookup_raw(mem):
    backend = with_telemetry(mem.backend, lambda e: None)
    assert backend.capabilities == mem.backend.capabilities
    result = backend.acquire("k", 1_000)
    assert backend.lookup_raw(lock_id=result.lock_id).key == "k"
    assert backend.release(generate_lock_id()).ok is False


async def test_async_twins_emit_and_async_callbacks_are_not_awaited(mem):
    seen = asyncio.Event()
    events: list[LockEvent] = []

    async def on_event(event):
        events.append(event)
        seen.set()

    backend = with_telemetry(mem.backend, on_event)
    result = await backend.aacquire("k", 1_000)
    assert events == []  # scheduled, not awaited by the operation
    await asyncio.wait_for(seen.wait(), 5)
    assert events[0].type == "acquire"
    assert (await backend.arelease(result.lock_id)).ok is True


def test_the_wrapper_is_a_plain_proxy_of_every_attribute_and_housekeeping(mem):
    events: list[LockEvent] = []
    backend = with_telemetry(mem.backend, events.append)
    assert backend.capabilities == mem.backend.capabilities
    assert (backend.capabilities.backend, backend.capabilities.time_authority) == (
        "memory",
        "client",
    )
    assert (backend.backend_name, backend.time_authority) == ("memory", "client")
    assert backend.alias == mem.backend.alias
    held = backend.acquire("live", 1_000)
    backend.acquire("old", 1_000)
    mem.advance(1_000 + 2_000 + 1)
    backend.acquire("live", 60_000)  # the expired "live" record is taken over
    [record] = backend.list_locks().records
    assert record.key == "live"
    assert list(backend.delete_expired(batch_size=10)) == [1]
    assert backend.force_release("live", hash_key(record.lock_id)).ok is True
    assert backend.is_locked("live") is False
    assert held.ok is True
    assert [e.type for e in events] == ["acquire", "acquire", "acquire", "is_locked"]
