"""The SyncGuard contract, run against every backend (see ``tests/support/harness.py``)."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import threading

import pytest
from django.utils.module_loading import import_string

from django_syncguard import (
    FENCE_THRESHOLDS,
    Aborted,
    AcquireResult,
    ExtendResult,
    Internal,
    InvalidArgument,
    LockInfo,
    ReleaseResult,
    generate_lock_id,
    hash_key,
    locked,
    owners,
)
from django_syncguard.waiting import WaitTicket

LOCK_ID = re.compile(r"[A-Za-z0-9_-]{22}")
TTL = 10_000


def acquire_ok(harness, key="resource:1", ttl_ms=TTL):
    before = harness.now_ms()
    result = harness.backend.acquire(key, ttl_ms)
    after = harness.now_ms()
    assert result.ok, result
    assert before + ttl_ms <= result.expires_at_ms <= after + ttl_ms
    return result


# ----------------------------------------------------------------- lifecycle
def test_acquire_returns_id_expiry_and_first_fence(harness):
    result = acquire_ok(harness, "lifecycle")
    assert LOCK_ID.fullmatch(result.lock_id)
    assert result.fence == "000000000000001"
    assert result.reason is None
    assert result.to_dict() == {
        "ok": True,
        "lockId": result.lock_id,
        "expiresAtMs": result.expires_at_ms,
        "fence": "000000000000001",
    }


def test_full_lifecycle(backend, harness):
    result = acquire_ok(harness, "lifecycle")
    assert backend.is_locked("lifecycle") is True
    assert backend.release(result.lock_id) == ReleaseResult(ok=True)
    assert backend.is_locked("lifecycle") is False
    assert backend.lookup(key="lifecycle") is None
    assert backend.lookup(lock_id=result.lock_id) is None
    # Release is at-most-once.
    assert backend.release(result.lock_id) == ReleaseResult(ok=False)
    assert backend.extend(result.lock_id, TTL) == ExtendResult(ok=False)


def test_release_of_unknown_lock_id_is_false(backend):
    assert backend.release(generate_lock_id()).to_dict() == {"ok": False}


def test_capabilities_are_declared(backend, harness):
    assert backend.capabilities == harness.capabilities


# ---------------------------------------------------------------- contention
def test_second_acquire_is_contended(backend, harness):
    first = acquire_ok(harness, "busy")
    second = backend.acquire("busy", TTL)
    assert second == AcquireResult(ok=False, reason="locked")
    assert second.to_dict() == {"ok": False, "reason": "locked"}
    # The holder is untouched by the failed attempt.
    assert backend.lookup(lock_id=first.lock_id).fence == first.fence


def test_contention_does_not_consume_fences(backend, harness):
    first = acquire_ok(harness, "busy")
    assert not backend.acquire("busy", TTL).ok
    backend.release(first.lock_id)
    assert acquire_ok(harness, "busy").fence == "000000000000002"


def test_keys_are_independent(harness):
    assert acquire_ok(harness, "a").fence == "000000000000001"
    assert acquire_ok(harness, "b").fence == "000000000000001"


# ---------------------------------------------------------- expiry, tolerance
# Server clocks keep moving while a test runs, so these tests leave 250 ms or more
# between the state they set up and the boundary; the exact millisecond edges are
# pinned on the fake-clock memory backend (test_memory_backend.py).


def test_lock_stays_live_until_expiry_plus_tolerance(backend, harness):
    result = acquire_ok(harness, "ttl", ttl_ms=1_000)
    # 500 ms past expiry: inside the 1000 ms tolerance, with 500 ms of real time for
    # the calls below (on the Firestore emulator, a dozen RPCs with advance()'s).
    harness.advance(1_000 + 500)
    assert backend.is_locked("ttl") is True
    assert backend.acquire("ttl", 1_000).ok is False
    assert backend.lookup(lock_id=result.lock_id) is not None
    harness.advance(750)  # 1250 ms past expiry: gone for every operation
    assert backend.is_locked("ttl") is False
    assert backend.lookup(key="ttl") is None
    assert backend.lookup(lock_id=result.lock_id) is None
    assert backend.extend(result.lock_id, TTL).ok is False
    assert backend.release(result.lock_id).ok is False


def test_expired_lock_can_be_taken_with_next_fence(backend, harness):
    old = acquire_ok(harness, "ttl", ttl_ms=1_000)
    harness.advance(2_000)
    new = acquire_ok(harness, "ttl")
    assert new.fence == "000000000000002"
    # The stale holder can neither release nor extend the new owner's lock.
    assert backend.release(old.lock_id).ok is False
    assert backend.extend(old.lock_id, TTL).ok is False
    assert backend.lookup(key="ttl").lock_id_hash == hash_key(new.lock_id)


def test_owner_may_release_inside_tolerance_window(backend, harness):
    result = acquire_ok(harness, "window", ttl_ms=1_000)
    harness.advance(1_500)
    assert backend.release(result.lock_id).ok is True
    assert backend.is_locked("window") is False


# -------------------------------------------------------------------- extend
def test_extend_replaces_remaining_ttl(backend, harness):
    result = acquire_ok(harness, "ext", ttl_ms=10_000)
    harness.advance(3_000)
    before = harness.now_ms()
    extended = backend.extend(result.lock_id, 5_000)
    after = harness.now_ms()
    assert extended.ok is True
    assert before + 5_000 <= extended.expires_at_ms <= after + 5_000
    assert extended.to_dict() == {"ok": True, "expiresAtMs": extended.expires_at_ms}
    info = backend.lookup(key="ext")
    assert info.expires_at_ms == extended.expires_at_ms
    # A shorter TTL shortens the lock: extend sets, it does not add.
    shorter = backend.extend(result.lock_id, 1_000)
    assert shorter.expires_at_ms < extended.expires_at_ms


def test_extend_never_resurrects(backend, harness):
    result = acquire_ok(harness, "dead", ttl_ms=1_000)
    harness.advance(2_000)
    assert backend.extend(result.lock_id, 60_000) == ExtendResult(ok=False)
    assert backend.is_locked("dead") is False
    assert backend.lookup(key="dead") is None


def test_extend_inside_tolerance_window_succeeds(backend, harness):
    result = acquire_ok(harness, "late", ttl_ms=1_000)
    harness.advance(1_500)
    extended = backend.extend(result.lock_id, 5_000)
    assert extended.ok is True
    harness.advance(4_000)
    assert backend.is_locked("late") is True


def test_extend_keeps_fence_and_acquired_time(backend, harness):
    result = acquire_ok(harness, "keep")
    harness.advance(1_000)
    info = backend.lookup(key="keep")
    backend.extend(result.lock_id, TTL)
    again = backend.lookup(key="keep")
    assert (again.fence, again.acquired_at_ms) == (result.fence, info.acquired_at_ms)


def test_failed_release_and_extend_say_why(backend, harness):
    expired = acquire_ok(harness, "why", ttl_ms=1_000)
    harness.advance(5_000)
    assert backend.extend(expired.lock_id, TTL).reason == "expired"
    assert backend.release(expired.lock_id).reason == "expired"
    unknown = generate_lock_id()
    assert backend.release(unknown).reason == "not-found"
    assert backend.extend(unknown, TTL).reason == "not-found"


# ------------------------------------------------------------------ ownership
def test_release_with_other_lock_id_leaves_lock_alone(backend, harness):
    result = acquire_ok(harness, "mine")
    assert backend.release(generate_lock_id()).ok is False
    assert backend.extend(generate_lock_id(), TTL).ok is False
    assert backend.lookup(lock_id=result.lock_id) is not None


# --------------------------------------------------------------------- lookup
def test_lookup_is_sanitized(backend, harness):
    result = acquire_ok(harness, "secret:42")
    by_key = backend.lookup(key="secret:42")
    by_id = backend.lookup(lock_id=result.lock_id)
    assert by_key == by_id
    assert isinstance(by_key, LockInfo)
    assert not hasattr(by_key, "key")
    assert not hasattr(by_key, "lock_id")
    assert by_key.key_hash == hash_key("secret:42")
    assert by_key.lock_id_hash == hash_key(result.lock_id)
    assert by_key.fence == result.fence
    assert by_key.expires_at_ms == result.expires_at_ms
    assert by_key.expires_at_ms - by_key.acquired_at_ms == TTL
    assert set(by_key.to_dict()) == {
        "keyHash",
        "lockIdHash",
        "expiresAtMs",
        "acquiredAtMs",
        "fence",
        "owner",
    }
    assert "secret:42" not in repr(by_key) and result.lock_id not in repr(by_key)


def test_lookup_raw_has_identifiers(backend, harness):
    result = acquire_ok(harness, "debug")
    raw = backend.lookup_raw(lock_id=result.lock_id)
    assert (raw.key, raw.lock_id, raw.fence) == ("debug", result.lock_id, result.fence)
    assert result.lock_id not in repr(raw)


def test_lookup_is_read_only(backend, harness):
    result = acquire_ok(harness, "ro")
    for _ in range(3):
        assert backend.lookup(key="ro").expires_at_ms == result.expires_at_ms
        assert backend.is_locked("ro") is True
    assert backend.lookup(lock_id=result.lock_id).expires_at_ms == result.expires_at_ms


@pytest.mark.parametrize("kwargs", [{}, {"key": "k", "lock_id": "A" * 22}])
def test_lookup_needs_exactly_one_selector(no_io, kwargs):
    with pytest.raises(InvalidArgument, match="exactly one"):
        no_io.lookup(**kwargs)


# --------------------------------------------------------------------- fences
def test_fences_increase_strictly_and_sort_as_strings(backend, harness):
    fences = []
    for _ in range(12):
        result = acquire_ok(harness, "seq")
        fences.append(result.fence)
        backend.release(result.lock_id)
    assert fences == [f"{n:015d}" for n in range(1, 13)]
    assert sorted(fences) == fences


def test_fence_at_max_is_allowed_and_above_is_refused(backend, harness):
    limit = int(FENCE_THRESHOLDS["MAX"])
    harness.set_fence("edge", limit - 1)
    at_max = acquire_ok(harness, "edge")
    assert at_max.fence == FENCE_THRESHOLDS["MAX"]
    backend.release(at_max.lock_id)
    with pytest.raises(Internal) as caught:
        backend.acquire("edge", TTL)
    assert caught.value.code == "Internal"
    # Refused before anything was committed: no lock, and the counter did not move.
    assert backend.is_locked("edge") is False
    with pytest.raises(Internal):
        backend.acquire("edge", TTL)


def test_fence_above_warn_logs_once_per_key(backend, harness, syncguard_log):
    key = f"warn-{generate_lock_id()}"
    harness.set_fence(key, int(FENCE_THRESHOLDS["WARN"]) - 1)
    at_warn = acquire_ok(harness, key)  # equal to WARN: not above it
    backend.release(at_warn.lock_id)
    assert not [r for r in syncguard_log.records if "fence" in r.getMessage()]
    for _ in range(2):
        backend.release(acquire_ok(harness, key).lock_id)
    warnings = [r for r in syncguard_log.records if "fence" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].levelname == "WARNING"
    assert warnings[0].name == "django_syncguard"
    assert "090000000000001" in warnings[0].getMessage()


# --------------------------------------------------------------------- cancel
def test_cancel_set_aborts_every_operation_before_io(no_io):
    cancel = threading.Event()
    cancel.set()
    lock_id = generate_lock_id()
    calls = [
        lambda: no_io.acquire("k", TTL, cancel=cancel),
        lambda: no_io.release(lock_id, cancel=cancel),
        lambda: no_io.extend(lock_id, TTL, cancel=cancel),
        lambda: no_io.is_locked("k", cancel=cancel),
        lambda: no_io.lookup(key="k", cancel=cancel),
        lambda: no_io.lookup(lock_id=lock_id, cancel=cancel),
    ]
    for call in calls:
        with pytest.raises(Aborted) as caught:
            call()
        assert caught.value.code == "Aborted"


def test_unset_cancel_does_not_interfere(backend, harness):
    cancel = threading.Event()
    result = backend.acquire("c", TTL, cancel=cancel)
    assert result.ok
    assert backend.release(result.lock_id, cancel=cancel).ok


@pytest.mark.parametrize("cancel", [True, "yes", object()])
def test_cancel_must_have_is_set(no_io, cancel):
    with pytest.raises(InvalidArgument, match="is_set"):
        no_io.acquire("k", TTL, cancel=cancel)


# ------------------------------------------------------------------ bad input
BAD_KEYS = [
    pytest.param("", id="empty"),
    pytest.param("x" * 513, id="513-ascii-bytes"),
    pytest.param("é" * 256 + "x", id="513-utf8-bytes"),
    pytest.param(None, id="none"),
    pytest.param(42, id="int"),
    pytest.param(b"bytes", id="bytes"),
    pytest.param("\ud800", id="lone-surrogate"),
]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_keys_are_refused_before_io(no_io, key):
    for call in (
        lambda: no_io.acquire(key, TTL),
        lambda: no_io.is_locked(key),
        lambda: no_io.lookup(key=key),
    ):
        with pytest.raises(InvalidArgument) as caught:
            call()
        assert caught.value.code == "InvalidArgument"


def test_512_byte_keys_are_accepted(backend, harness):
    for key in ("x" * 512, "é" * 256, "€" * 170 + "xy"):
        assert len(key.encode()) == 512
        assert acquire_ok(harness, key).fence == "000000000000001"
        assert backend.is_locked(key) is True


def test_nfc_equivalent_keys_are_the_same_lock(backend, harness):
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    assert composed != decomposed
    result = acquire_ok(harness, composed)
    assert backend.acquire(decomposed, TTL).ok is False
    assert backend.is_locked(decomposed) is True
    assert backend.lookup(key=decomposed).lock_id_hash == hash_key(result.lock_id)


def test_decomposed_key_over_512_bytes_that_composes_under_is_accepted(harness):
    key = "e\u0301" * 200  # 600 bytes as given, 400 bytes after NFC
    assert len(key.encode()) == 600
    assert acquire_ok(harness, key).ok


BAD_LOCK_IDS = [
    pytest.param("short", id="short"),
    pytest.param("A" * 23, id="23-chars"),
    pytest.param("A" * 21 + "+", id="non-url-alphabet"),
    pytest.param("A" * 21 + "=", id="padding"),
    pytest.param(None, id="none"),
    pytest.param(b"A" * 22, id="bytes"),
]


@pytest.mark.parametrize("lock_id", BAD_LOCK_IDS)
def test_malformed_lock_ids_are_refused_before_io(no_io, lock_id):
    for call in (
        lambda: no_io.release(lock_id),
        lambda: no_io.extend(lock_id, TTL),
        lambda: no_io.lookup(lock_id=lock_id),
    ):
        with pytest.raises(InvalidArgument) as caught:
            call()
        if isinstance(lock_id, str):
            assert lock_id not in str(caught.value)


BAD_TTLS = [0, -1, 1.5, 1000.0, "1000", True, None, 2**31]


@pytest.mark.parametrize("ttl", BAD_TTLS)
def test_bad_ttls_are_refused_before_io(no_io, ttl):
    with pytest.raises(InvalidArgument):
        no_io.acquire("k", ttl)
    with pytest.raises(InvalidArgument):
        no_io.extend(generate_lock_id(), ttl)


# ---------------------------------------------------------------------- async
async def test_async_twins_follow_the_same_contract(backend, harness):
    result = await backend.aacquire("async", TTL)
    assert result.ok and result.fence == "000000000000001"
    assert (await backend.aacquire("async", TTL)) == AcquireResult(ok=False, reason="locked")
    assert await backend.ais_locked("async") is True
    info = await backend.alookup(lock_id=result.lock_id)
    assert info == await backend.alookup(key="async")
    raw = await backend.alookup_raw(key="async")
    assert raw.lock_id == result.lock_id
    extended = await backend.aextend(result.lock_id, 20_000)
    assert extended.ok and extended.expires_at_ms >= result.expires_at_ms
    assert (await backend.arelease(result.lock_id)) == ReleaseResult(ok=True)
    assert (await backend.arelease(result.lock_id)) == ReleaseResult(ok=False)
    assert await backend.ais_locked("async") is False


async def test_async_twins_validate_before_io(no_io):
    with pytest.raises(InvalidArgument):
        await no_io.aacquire("", TTL)
    with pytest.raises(InvalidArgument):
        await no_io.arelease("nope")
    with pytest.raises(InvalidArgument):
        await no_io.aextend(generate_lock_id(), 0)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(Aborted):
        await no_io.ais_locked("k", cancel=cancel)


# --------------------------------------------------------------------- owners
def _prefix() -> str:
    """``HOST:PID`` as the owner label starts (the host clipped as the label clips it)."""
    return f"{owners.clip(socket.gethostname(), owners.PART_BYTES)}:{os.getpid()}"


def _sibling(harness, **options):
    """Another backend on the same storage as ``harness.backend``, with ``options``."""
    entry = dict(harness.settings_entry)
    cls = import_string(entry.pop("BACKEND"))
    entry["OPTIONS"] = {**entry.get("OPTIONS", {}), **options}
    return cls(f"{harness.backend.alias}-sibling", entry)


def test_owner_label_names_host_pid_and_thread(backend, harness):
    result = acquire_ok(harness, "owner:plain")
    expected = f"{_prefix()} thread:{threading.current_thread().name} -"
    info = backend.lookup(key="owner:plain")
    assert info.owner == expected
    assert info.to_dict()["owner"] == expected
    assert backend.lookup(lock_id=result.lock_id).owner == expected
    assert backend.lookup_raw(key="owner:plain").owner == expected
    (record,) = backend.list_locks(prefix="owner:plain").records
    assert record.owner == expected
    # Extending keeps the label.
    assert backend.extend(result.lock_id, TTL).ok
    assert backend.lookup(key="owner:plain").owner == expected


def test_owner_label_names_the_locked_function(backend, harness):
    seen = []

    @locked("owner:<n>", using=backend, until_commit=False)
    def charge(n):
        seen.append(backend.lookup(key=f"owner:{n}").owner)

    charge(7)
    thread = threading.current_thread().name
    qualname = "test_owner_label_names_the_locked_function.<locals>.charge"
    assert seen == [f"{_prefix()} thread:{thread} {__name__}.{qualname}"]


async def test_owner_label_of_an_async_acquire_names_the_asyncio_task(backend, harness):
    # Backends whose async I/O runs in a worker thread compute the label first, on
    # the event loop: the label names this task, not the worker thread.
    await backend.aacquire("owner:async", TTL)
    name = asyncio.current_task().get_name()
    assert (await backend.alookup(key="owner:async")).owner == f"{_prefix()} asyncio:{name} -"


def test_record_owner_false_stores_no_label(harness):
    quiet = type(harness)(RECORD_OWNER=False)
    try:
        backend = quiet.backend
        result = backend.acquire("owner:off", TTL)
        info = backend.lookup(key="owner:off")
        assert info.owner is None
        assert "owner" not in info.to_dict()
        assert backend.lookup_raw(lock_id=result.lock_id).owner is None
        (record,) = backend.list_locks(prefix="owner:off").records
        assert record.owner is None
    finally:
        quiet.close()


def test_a_lock_taken_over_without_a_label_keeps_none_of_the_last_one(backend, harness):
    acquire_ok(harness, "owner:takeover", ttl_ms=1_000)
    assert backend.lookup(key="owner:takeover").owner is not None
    harness.advance(1_000 + 1_000 + 1)  # past expiry and the tolerance
    quiet = _sibling(harness, RECORD_OWNER=False)
    try:
        taken = quiet.acquire("owner:takeover", TTL)
        assert taken.ok and taken.fence == "000000000000002"
        assert backend.lookup(key="owner:takeover").owner is None
    finally:
        quiet.close()


def test_owner_label_is_bounded_and_clean(backend, harness):
    done = []

    def hold():
        done.append(backend.acquire("owner:long", TTL))

    # 300 characters of two and three bytes and a NUL: over the bound, unstorable as is.
    worker = threading.Thread(target=hold, name="\x00" + "é" * 100 + "€" * 200)
    worker.start()
    worker.join()
    assert done[0].ok
    owner = backend.lookup(key="owner:long").owner
    assert len(owner.encode("utf-8")) <= owners.MAX_OWNER_BYTES
    # "thread:?" (8 bytes), then as many two-byte characters as the part's bytes allow.
    assert owners.PART_BYTES == 48
    assert owner == f"{_prefix()} thread:?{'é' * 20} -"


def test_the_record_owner_option_must_be_a_bool(harness):
    with pytest.raises(InvalidArgument, match="RECORD_OWNER"):
        type(harness)(RECORD_OWNER="yes")


def test_queue_stats_count_live_waiters_and_their_oldest_wait(backend, harness):
    held = acquire_ok(harness, "owner:queue")
    assert backend.queue_stats(["owner:queue"]) == {}
    before = harness.now_ms()
    first = WaitTicket.new()
    assert backend.acquire("owner:queue", TTL, ticket=first).queue_position == 0
    after = harness.now_ms()
    harness.advance(200)
    assert backend.acquire("owner:queue", TTL, ticket=WaitTicket.new()).queue_position == 1
    # Renewing the first place keeps its queueing time.
    assert backend.acquire("owner:queue", TTL, ticket=first).queue_position == 0
    stats = backend.queue_stats(["owner:queue", "owner:nobody"])
    assert set(stats) == {"owner:queue"}
    assert stats["owner:queue"].waiters == 2
    assert before <= stats["owner:queue"].oldest_since_ms <= after
    backend.release(held.lock_id)
