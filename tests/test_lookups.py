"""get_by_key / get_by_id / *_raw / owns, sync and async, on every backend."""

from __future__ import annotations

from django_syncguard import (
    aget_by_id,
    aget_by_id_raw,
    aget_by_key,
    aget_by_key_raw,
    aowns,
    generate_lock_id,
    get_by_id,
    get_by_id_raw,
    get_by_key,
    get_by_key_raw,
    hash_key,
    owns,
)


def test_lookup_helpers(backend):
    result = backend.acquire("doc:1", 10_000)
    info = get_by_key(backend, "doc:1")
    assert info == get_by_id(backend, result.lock_id)
    assert (info.key_hash, info.fence) == (hash_key("doc:1"), "000000000000001")
    raw = get_by_id_raw(backend, result.lock_id)
    assert (raw.key, raw.lock_id) == ("doc:1", result.lock_id)
    assert get_by_key_raw(backend, "doc:1") == raw
    assert owns(backend, result.lock_id) is True
    assert owns(backend, generate_lock_id()) is False
    backend.release(result.lock_id)
    assert owns(backend, result.lock_id) is False
    assert get_by_key(backend, "doc:1") is None


async def test_async_lookup_helpers(backend):
    result = await backend.aacquire("doc:2", 10_000)
    info = await aget_by_key(backend, "doc:2")
    assert info == await aget_by_id(backend, result.lock_id)
    assert (await aget_by_key_raw(backend, "doc:2")).lock_id == result.lock_id
    assert (await aget_by_id_raw(backend, result.lock_id)).key == "doc:2"
    assert await aowns(backend, result.lock_id) is True
    await backend.arelease(result.lock_id)
    assert await aowns(backend, result.lock_id) is False
