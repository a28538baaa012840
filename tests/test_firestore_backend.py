"""What is particular to the Firestore backend (the contract suite covers the rest)."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time

import pytest

from django_syncguard import (
    AuthFailed,
    Internal,
    InvalidArgument,
    NetworkTimeout,
    RateLimited,
    ReleaseResult,
    ServiceUnavailable,
)
from django_syncguard.backends.firestore import (
    FirestoreBackend,
    document_id,
    map_firestore_error,
)
from django_syncguard.backends.firestore.client import (
    PRIVATE_ATTRIBUTES,
    database_string,
    document_name,
    rpc_metadata,
)
from django_syncguard.backends.firestore.documents import FLOOR_ID, counter_id, lock_document_of
from django_syncguard.handler import InvalidBackendError, LockHandler
from django_syncguard.keys import hash_storage_key
from tests.support.harness import FirestoreHarness
from tests.support.servers import import_extra

# Without the firestore extra the module is skipped (it fails under CI).
api = import_extra("google.api_core.exceptions", "firestore")


@pytest.fixture
def fh(firestore_emulator):
    return FirestoreHarness()


def lock_docs(harness: FirestoreHarness) -> dict[str, dict]:
    coll = harness.firestore.client.collection(harness.firestore.collection)
    return {snap.id: snap.to_dict() for snap in coll.stream()}


def fence_docs(harness: FirestoreHarness) -> dict[str, dict]:
    coll = harness.firestore.client.collection(harness.firestore.fence_collection)
    return {snap.id: snap.to_dict() for snap in coll.stream()}


# --------------------------------------------------------------- documents
def test_layout_lock_document_and_fence_counter(fh):
    backend = fh.firestore
    result = backend.acquire("invoice:42", 60_000)
    doc = lock_docs(fh)["invoice:42"]
    assert {k: doc[k] for k in ("lockId", "key", "fence")} == {
        "lockId": result.lock_id,
        "key": "invoice:42",
        "fence": "000000000000001",
    }
    assert doc["expiresAtMs"] - doc["acquiredAtMs"] == 60_000
    counter = backend.client.collection(backend.fence_collection).document("fence:invoice:42").get()
    # The counter also keeps when its last fence was handed out (for compaction).
    stored = {"fence": "000000000000001", "acquiredAtMs": doc["acquiredAtMs"]}
    assert counter.to_dict() == stored
    backend.release(result.lock_id)
    assert lock_docs(fh) == {}
    assert counter.reference.get().to_dict() == stored  # kept


def test_layout_fence_floor_document(fh):
    backend = fh.firestore
    assert backend.raise_fence_floor(41) == 41
    assert fence_docs(fh) == {"syncguard:floor": {"floor": "000000000000041"}}
    assert backend.acquire("floored", 60_000).fence == "000000000000042"
    assert set(fence_docs(fh)) == {"syncguard:floor", "fence:floored"}


@pytest.mark.parametrize("key", ["invoice:42", "a/b", "x" * 512])
def test_a_counter_id_maps_back_to_its_lock_document_and_the_floor_id_to_none(key):
    lock_doc = document_id(key)
    assert counter_id(lock_doc) == f"fence:{lock_doc}"
    assert lock_document_of(counter_id(lock_doc)) == lock_doc
    # The floor's id has a colon but not the counters' "fence:" head: no counter's.
    assert lock_document_of(FLOOR_ID) is None
    # A hashed counter id (none is made while keys are at most 512 bytes) is skipped.
    assert lock_document_of(hash_storage_key("", f"fence:{lock_doc}")) is None


@pytest.mark.parametrize("key", ["invoice/42", "a/b/c", ".", "..", "__reserved__"])
def test_keys_that_are_not_document_ids_still_lock(fh, key):
    backend = fh.firestore
    assert document_id(key) != key
    result = backend.acquire(key, 60_000)
    assert result.fence == "000000000000001"
    assert backend.acquire(key, 60_000).ok is False
    assert backend.lookup_raw(lock_id=result.lock_id).key == key
    assert backend.lookup_raw(key=key).lock_id == result.lock_id
    assert backend.release(result.lock_id).ok is True
    assert backend.acquire(key, 60_000).fence == "000000000000002"


# -------------------------------------------------------------- duplicates
def duplicate(fh, source_id: str, copy_id: str, **changes) -> None:
    coll = fh.firestore.client.collection(fh.firestore.collection)
    coll.document(copy_id).set({**coll.document(source_id).get().to_dict(), **changes})


def elsewhere(fh) -> FirestoreBackend:
    """The same collections through another backend object, as another process sees
    them: it never acquired these locks, so it resolves lock ids by query."""
    return FirestoreBackend("elsewhere", fh.settings_entry)


def test_expired_duplicate_is_removed_and_the_live_lock_released(fh):
    result = fh.firestore.acquire("dup", 60_000)
    expired_at = lock_docs(fh)["dup"]["expiresAtMs"] - 120_000
    duplicate(fh, "dup", "stale-copy", expiresAtMs=expired_at)
    assert elsewhere(fh).release(result.lock_id).ok is True
    assert lock_docs(fh) == {}  # the live one released, the expired copy cleaned up


def test_two_live_duplicates_fail_safe(fh, syncguard_log):
    result = fh.firestore.acquire("dup", 60_000)
    duplicate(fh, "dup", "live-copy")
    assert fh.firestore.extend(result.lock_id, 60_000).ok is False
    assert elsewhere(fh).release(result.lock_id).ok is False
    assert fh.firestore.lookup(lock_id=result.lock_id) is None
    assert set(lock_docs(fh)) == {"dup", "live-copy"}  # nothing mutated
    assert any("carry one lock id" in r.getMessage() for r in syncguard_log.records)


# ----------------------------------------- release of a lock this object took
class RunQueries:
    """Counts the lock-id queries a backend builds (each one is streamed once)."""

    def __init__(self, backend: FirestoreBackend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = backend._by_lock_id

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(backend, "_by_lock_id", counted)


def test_release_of_own_unchanged_lock_is_one_guarded_delete(fh, monkeypatch):
    backend = fh.firestore
    result = backend.acquire("own", 60_000)
    queries = RunQueries(backend, monkeypatch)

    assert backend.release(result.lock_id).ok is True

    assert queries.count == 0
    assert lock_docs(fh) == {}
    assert backend.release(result.lock_id).reason == "not-found"  # now by query
    assert queries.count == 1
    assert backend.acquire("own", 60_000).fence == "000000000000002"


def test_release_after_the_document_changed_takes_the_query(fh, monkeypatch):
    backend = fh.firestore
    result = backend.acquire("changed", 60_000)
    assert elsewhere(fh).extend(result.lock_id, 90_000).ok is True  # not through us
    queries = RunQueries(backend, monkeypatch)

    assert backend.release(result.lock_id).ok is True

    assert queries.count == 1  # the guarded delete failed; the query decided
    assert lock_docs(fh) == {}


def test_release_of_own_lock_after_it_expired_says_expired(fh, monkeypatch):
    backend = fh.firestore
    result = backend.acquire("lapsed", 1)
    # Firestore's clock cannot be moved: wait on it until the lock is past its
    # tolerance (about a second), then release the unchanged document.
    while backend.now_ms() <= result.expires_at_ms + 1_000:
        time.sleep(0.05)
    queries = RunQueries(backend, monkeypatch)

    assert backend.release(result.lock_id).reason == "expired"

    assert queries.count == 0
    assert lock_docs(fh) == {}  # removed, as cleanup would
    assert backend.acquire("lapsed", 60_000).fence == "000000000000002"


class CancelledAnswers:
    """The emulator's answer to a commit while a Listen call watching the document
    goes away (a watcher's process killed): the write is applied, then the commit
    fails with ``Cancelled``. The next ``count`` commits, sync and async, commit for
    real (when ``applied``) and then raise it."""

    def __init__(self, monkeypatch, count: int = 1, applied: bool = True) -> None:
        from google.cloud.firestore_v1.async_batch import AsyncWriteBatch
        from google.cloud.firestore_v1.batch import WriteBatch

        self.left, self.applied = count, applied
        commit, acommit = WriteBatch.commit, AsyncWriteBatch.commit

        def answer():
            self.left -= 1
            return api.Cancelled("call already cancelled")

        def cancelled(batch, *args, **kwargs):
            if self.left <= 0:
                return commit(batch, *args, **kwargs)
            if self.applied:
                commit(batch, *args, **kwargs)
            raise answer()

        async def acancelled(batch, *args, **kwargs):
            if self.left <= 0:
                return await acommit(batch, *args, **kwargs)
            if self.applied:
                await acommit(batch, *args, **kwargs)
            raise answer()

        monkeypatch.setattr(WriteBatch, "commit", cancelled)
        monkeypatch.setattr(AsyncWriteBatch, "commit", acancelled)


def recorded_reads(backend: FirestoreBackend, monkeypatch) -> list[list[str]]:
    """The ids each ``get_all`` of ``backend``'s client reads, in order, from now on."""
    client, reads = backend.client, []
    get_all = client.get_all

    def recorded(refs, *args, **kwargs):
        refs = list(refs)
        reads.append([ref.id for ref in refs])
        return get_all(refs, *args, **kwargs)

    monkeypatch.setattr(client, "get_all", recorded)
    return reads


def test_an_acquire_applied_but_answered_cancelled_is_ours(fh, monkeypatch):
    backend = fh.firestore
    answers = CancelledAnswers(monkeypatch)

    result = backend.acquire("lost-answer", 60_000)

    assert answers.left == 0
    stored = lock_docs(fh)["lost-answer"]
    assert (result.ok, result.lock_id, result.fence) == (True, stored["lockId"], "000000000000001")
    assert result.expires_at_ms == stored["expiresAtMs"]
    assert backend.release(result.lock_id).ok is True  # by query: nothing remembered
    assert backend.acquire("lost-answer", 60_000).fence == "000000000000002"


def test_a_counter_created_by_a_commit_of_unknown_outcome_is_checked_too(fh, monkeypatch):
    # The commit that created the counter is answered "cancelled" (it applied); the
    # next read finds the lock ours, and the floor is read before it is answered.
    backend = fh.firestore
    answers = CancelledAnswers(monkeypatch)
    reads = recorded_reads(backend, monkeypatch)
    result = backend.acquire("lost-new", 60_000)

    assert answers.left == 0
    everything = ["lost-new", "fence:lost-new", "syncguard:floor"]
    assert reads == [everything, everything, ["syncguard:floor"]]
    assert (result.ok, result.fence) == (True, "000000000000001")


def test_an_acquire_answered_cancelled_but_not_applied_is_sent_again(fh, monkeypatch):
    backend = fh.firestore
    answers = CancelledAnswers(monkeypatch, applied=False)

    result = backend.acquire("not-applied", 60_000)

    assert answers.left == 0
    assert (result.ok, result.fence) == (True, "000000000000001")
    assert lock_docs(fh)["not-applied"]["lockId"] == result.lock_id


def test_a_release_applied_but_answered_cancelled_is_done(fh, monkeypatch):
    backend = fh.firestore
    remembered = backend.acquire("release-remembered", 60_000)
    queried = backend.acquire("release-queried", 60_000)
    assert elsewhere(fh).extend(queried.lock_id, 90_000).ok is True  # forces the query
    CancelledAnswers(monkeypatch, count=2)

    assert backend.release(remembered.lock_id) == ReleaseResult(ok=True)
    assert backend.release(queried.lock_id) == ReleaseResult(ok=True)

    assert lock_docs(fh) == {}


async def test_async_commits_answered_cancelled_settle_the_same(fh, monkeypatch):
    backend = fh.firestore
    answers = CancelledAnswers(monkeypatch, count=3)

    result = await backend.aacquire("async-lost", 60_000)
    extended = await backend.aextend(result.lock_id, 90_000)
    released = await backend.arelease(result.lock_id)

    assert answers.left == 0
    assert (result.ok, result.fence, extended.ok, released) == (
        True,
        "000000000000001",
        True,
        ReleaseResult(ok=True),
    )
    assert lock_docs(fh) == {}


def test_a_rival_holder_is_never_released_by_a_remembered_lock(fh):
    backend = fh.firestore
    first = backend.acquire("rival", 1)
    while backend.now_ms() <= first.expires_at_ms + 1_000:
        time.sleep(0.05)
    second = elsewhere(fh).acquire("rival", 60_000)
    assert second.fence == "000000000000002"

    assert backend.release(first.lock_id).reason == "not-found"

    assert backend.lookup(key="rival").fence == "000000000000002"


async def test_async_release_of_own_lock_skips_the_query(fh):
    backend = fh.firestore
    result = await backend.aacquire("own-async", 60_000)
    assert await backend.arelease(result.lock_id) == ReleaseResult(ok=True)
    assert lock_docs(fh) == {}


# ------------------------------------------------------------- contention
def test_eight_threads_on_one_key_get_ok_or_locked_never_an_error(fh):
    backend = fh.firestore
    outcomes: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def worker() -> None:
        start.wait()
        for _ in range(15):
            try:
                result = backend.acquire("hot", 60_000)
                outcomes.append("ok" if result.ok else result.reason)
                if result.ok:
                    assert backend.release(result.lock_id).ok
            except BaseException as exc:
                errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(outcomes) == 120
    assert set(outcomes) <= {"ok", "locked"}
    assert outcomes.count("ok") >= 1


# --------------------------------------------------------- fence continuity
def take(backend: FirestoreBackend, key: str) -> str:
    result = backend.acquire(key, 60_000)
    assert result.ok and backend.release(result.lock_id).ok
    return result.fence


async def test_the_async_acquire_reads_the_floor_too(fh):
    backend = fh.firestore
    assert backend.raise_fence_floor(30) == 30
    result = await backend.aacquire("async-floored", 60_000)
    assert result.fence == "000000000000031"
    assert fence_docs(fh)["fence:async-floored"] == {
        "fence": "000000000000031",
        "acquiredAtMs": lock_docs(fh)["async-floored"]["acquiredAtMs"],
    }
    await backend.clients.aclose()


def test_a_counter_compacted_between_an_acquires_read_and_write(fh, monkeypatch):
    # The acquire reads the counter (8), compaction (another process) raises the floor
    # to 50 and deletes it, then the acquire's guarded counter write fails: it reads
    # again, finds no counter and the raised floor, and goes on above the floor.
    backend = fh.firestore
    fh.set_fence("raced", 7)
    assert take(backend, "raced") == "000000000000008"
    fh.set_fence("other", 49)
    assert take(backend, "other") == "000000000000050"
    fh.advance(10_000)
    compactor = elsewhere(fh)
    client = backend.client
    get_all = client.get_all
    reads: list[dict[str, str | None]] = []

    def read_then_compact(refs, *args, **kwargs):
        snaps = list(get_all(refs, *args, **kwargs))
        reads.append({s.id: s.to_dict() for s in snaps if s.exists})
        if len(reads) == 1:
            assert sum(compactor.compact_fences(idle_ms=5_000)) == 2
        return snaps

    monkeypatch.setattr(client, "get_all", read_then_compact)
    try:
        result = backend.acquire("raced", 60_000)
    finally:
        compactor.close()

    acquired_at = reads[0]["fence:raced"]["acquiredAtMs"]
    assert reads == [
        {"fence:raced": {"fence": "000000000000008", "acquiredAtMs": acquired_at}},
        {"syncguard:floor": {"floor": "000000000000050"}},
        # It created the counter: the floor once more, still below its fence (53).
        {"syncguard:floor": {"floor": "000000000000050"}},
    ]
    assert result.fence == "000000000000051"
    assert fence_docs(fh)["fence:raced"]["fence"] == "000000000000051"
    assert backend.fence_state().floor == 50


def _take_and_compact(fh, key: str) -> list[str]:
    """Another process takes ``key`` (fence 1) and gives it back, then compaction
    raises the floor to 1 and deletes the counter: the key is as it was, but for the
    floor. Returns the fences that process got."""
    other = elsewhere(fh)
    try:
        fences = [take(other, key)]
        fh.advance(10_000)
        assert sum(other.compact_fences(idle_ms=5_000)) == 1
    finally:
        other.close()
    return fences


def test_a_counter_created_and_compacted_between_an_acquires_read_and_write(fh, monkeypatch):
    # The acquire reads: no lock, no counter, floor 0, and plans fence 1 with "still
    # absent" guards. Before it commits, another process takes the key (fence 1) and
    # gives it back, and compaction deletes that counter: both documents are absent
    # again, so the guards pass. The floor (now 1) tells: the lock is given back and
    # taken again above it, and fence 1 is never handed out twice.
    backend = fh.firestore
    client = backend.client
    get_all = client.get_all
    reads: list[dict[str, dict]] = []
    others: list[str] = []

    def read_then_interleave(refs, *args, **kwargs):
        snaps = list(get_all(refs, *args, **kwargs))
        reads.append({s.id: s.to_dict() for s in snaps if s.exists})
        if len(reads) == 1:
            others.extend(_take_and_compact(fh, "aba"))
        return snaps

    monkeypatch.setattr(client, "get_all", read_then_interleave)
    result = backend.acquire("aba", 60_000)
    monkeypatch.undo()

    assert others == ["000000000000001"]
    assert result.fence == "000000000000002"
    floor = {"syncguard:floor": {"floor": "000000000000001"}}
    assert reads[0] == {}  # nothing there: the plan was fence 1
    assert reads[1] == floor  # the check after the commit (the counter it wrote is 1)
    assert lock_docs(fh)["aba"]["lockId"] == result.lock_id
    assert fence_docs(fh)["fence:aba"]["fence"] == "000000000000002"
    assert backend.release(result.lock_id).ok
    assert take(backend, "aba") == "000000000000003"


def test_a_retry_after_the_check_that_meets_the_key_held_leaves_nothing_to_orphans(fh, monkeypatch):
    # As above; then, between the release of the first lock and the retry's read,
    # another process takes the key: the retry answers "locked". The first lock was
    # released, and the second lock id was never written: nothing to release later.
    backend = fh.firestore
    client = backend.client
    get_all = client.get_all
    reads: list[int] = []
    rival: list[str] = []

    def read_then_interleave(refs, *args, **kwargs):
        refs = list(refs)
        if len(refs) == 3 and reads:  # the retry's read: someone takes the key first
            other = elsewhere(fh)
            try:
                rival.append(other.acquire("aba-held", 60_000).fence)
            finally:
                other.close()
        snaps = list(get_all(refs, *args, **kwargs))
        reads.append(len(refs))
        if len(reads) == 1:
            _take_and_compact(fh, "aba-held")
        return snaps

    monkeypatch.setattr(client, "get_all", read_then_interleave)
    result = backend.acquire("aba-held", 60_000)
    monkeypatch.undo()

    assert reads == [3, 1, 3]  # the acquire, the floor check, the retry
    assert (result.ok, result.reason) == (False, "locked")
    assert rival == ["000000000000002"]  # above the first lock's 1, never handed out
    assert backend.orphans.pending == 0


async def test_the_async_acquire_checks_the_floor_after_creating_a_counter(fh, monkeypatch):
    backend = fh.firestore
    client = backend.aclient()
    get_all = client.get_all
    reads: list[dict[str, dict]] = []

    async def read_then_interleave(refs, *args, **kwargs):
        snaps = [snap async for snap in get_all(refs, *args, **kwargs)]
        reads.append({s.id: s.to_dict() for s in snaps if s.exists})
        if len(reads) == 1:
            _take_and_compact(fh, "async-aba")
        for snap in snaps:
            yield snap

    monkeypatch.setattr(client, "get_all", read_then_interleave)
    result = await backend.aacquire("async-aba", 60_000)
    monkeypatch.undo()

    assert result.fence == "000000000000002"
    assert reads[:2] == [{}, {"syncguard:floor": {"floor": "000000000000001"}}]
    assert (await backend.arelease(result.lock_id)).ok
    await backend.clients.aclose()


def test_an_acquire_that_creates_a_counter_reads_the_floor_once_more(fh, monkeypatch):
    # The price of that check: one read of the floor, only when the counter is new.
    backend = fh.firestore
    reads = recorded_reads(backend, monkeypatch)
    first = backend.acquire("new-key", 60_000)
    assert reads == [["new-key", "fence:new-key", "syncguard:floor"], ["syncguard:floor"]]
    assert backend.release(first.lock_id).ok
    reads.clear()
    second = backend.acquire("new-key", 60_000)
    assert reads == [["new-key", "fence:new-key", "syncguard:floor"]]
    assert [first.fence, second.fence] == ["000000000000001", "000000000000002"]
    assert backend.release(second.lock_id).ok


def test_an_acquire_between_compactions_read_and_delete_keeps_its_counter(fh, monkeypatch):
    # Compaction finds the counter idle and reads the lock document again; an acquire
    # (another process) writes the counter before the delete, whose guard then fails.
    backend = fh.firestore
    assert take(backend, "busy") == "000000000000001"
    fh.advance(10_000)
    compactor = elsewhere(fh)
    client = compactor.client
    get_all = client.get_all
    reads: list[list[str]] = []
    acquired = []

    def read_then_acquire(refs, *args, **kwargs):
        snaps = list(get_all(refs, *args, **kwargs))
        reads.append([s.id for s in snaps])
        if len(reads) == 2:  # the delete's second look at the lock documents
            acquired.append(backend.acquire("busy", 60_000))
        return snaps

    monkeypatch.setattr(client, "get_all", read_then_acquire)
    try:
        assert list(compactor.compact_fences(idle_ms=5_000)) == [0]
    finally:
        compactor.close()

    assert reads == [["busy"], ["busy"]]  # the page's look, then the delete's
    assert [r.fence for r in acquired] == ["000000000000002"]
    assert fence_docs(fh)["fence:busy"]["fence"] == "000000000000002"  # kept
    assert backend.fence_state().floor == 1  # raised before the delete was tried
    assert backend.release(acquired[0].lock_id).ok
    assert take(backend, "busy") == "000000000000003"


def test_one_get_all_shows_every_commit_made_before_one_it_shows(fh):
    # The acquire's argument (specs/backends/firestore.md, Fence continuity): when its
    # get_all shows compaction's delete of a counter, it shows the floor that compaction
    # raised, in a commit acknowledged before the delete was sent. Here a writer sets
    # d00 .. d19 to n, one commit each, round after round, while get_all reads them
    # (from d19 down, and a missing document): in every read, the documents written
    # earlier hold the newer value or the same, and all carry one read_time.
    coll = fh.firestore.client.collection(fh.firestore.fence_collection)
    refs = [coll.document(f"d{i:02d}") for i in range(20)]
    writer = elsewhere(fh)
    stop = threading.Event()

    def write() -> None:
        wcoll = writer.client.collection(fh.firestore.fence_collection)
        n = 0
        while not stop.is_set():
            n += 1
            for i in range(20):
                wcoll.document(f"d{i:02d}").set({"n": n})

    first = fh.firestore.client.batch()
    for ref in refs:
        first.set(ref, {"n": 0})
    first.commit()
    thread = threading.Thread(target=write)
    thread.start()
    mid_round = 0
    try:
        for _ in range(50):
            snaps = list(fh.firestore.client.get_all([*refs[::-1], coll.document("missing")]))
            assert len(snaps) == 21
            assert len({s.read_time for s in snaps}) == 1
            values = [s.get("n") for s in sorted(snaps, key=lambda s: s.id) if s.exists]
            assert values == sorted(values, reverse=True) and values[0] - values[-1] <= 1
            mid_round += values[0] != values[-1]
    finally:
        stop.set()
        thread.join()
        writer.close()
    assert mid_round > 0  # reads did land between the commits of a round


# -------------------------------------------------------------------- cleanup
def test_cleanup_in_is_locked_deletes_long_expired_lock_documents(firestore_emulator):
    harness = FirestoreHarness(CLEANUP_IN_IS_LOCKED=True)
    backend = harness.firestore
    backend.acquire("old", 1_000)
    harness.advance(1_000 + 1_500)
    assert backend.is_locked("old") is False
    assert "old" in lock_docs(harness)
    harness.advance(1_000)
    assert backend.is_locked("old") is False
    assert "old" not in lock_docs(harness)
    assert backend.acquire("old", 1_000).fence == "000000000000002"  # counter kept


# --------------------------------------------------------------------- errors
def test_unreachable_emulator_is_service_unavailable_quickly(monkeypatch):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("FIRESTORE_EMULATOR_HOST", f"127.0.0.1:{port}")
    backend = FirestoreBackend("down", {"OPTIONS": {"PROJECT": "p", "OPERATION_TIMEOUT_MS": 2_000}})
    started = time.monotonic()
    with pytest.raises((ServiceUnavailable, NetworkTimeout)):
        backend.acquire("k", 1_000)
    assert time.monotonic() - started < 30  # bounded: the library would retry for minutes
    backend.close()


def test_silent_server_times_out(monkeypatch):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    monkeypatch.setenv("FIRESTORE_EMULATOR_HOST", f"127.0.0.1:{silent.getsockname()[1]}")
    backend = FirestoreBackend(
        "silent", {"OPTIONS": {"PROJECT": "p", "OPERATION_TIMEOUT_MS": 1_000}}
    )
    started = time.monotonic()
    with pytest.raises((NetworkTimeout, ServiceUnavailable)):
        backend.is_locked("k")
    assert time.monotonic() - started < 30
    backend.close()
    silent.close()


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (api.ServiceUnavailable("down"), ServiceUnavailable),
        (api.InternalServerError("oops"), ServiceUnavailable),
        (api.Aborted("conflict"), ServiceUnavailable),
        (api.DeadlineExceeded("slow"), NetworkTimeout),
        (api.PermissionDenied("no"), AuthFailed),
        (api.Unauthenticated("who"), AuthFailed),
        (api.InvalidArgument("bad"), InvalidArgument),
        (api.FailedPrecondition("index"), InvalidArgument),
        (api.ResourceExhausted("quota"), RateLimited),
        (api.NotFound("gone"), Internal),
    ],
)
def test_firestore_errors_are_mapped(error, expected):
    mapped = map_firestore_error(error, "f")
    assert type(mapped) is expected
    assert mapped.context["cause"] is error


# -------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"COLLECTION": "same", "FENCE_COLLECTION": "same"}, "must differ"),
        ({"COLLECTION": "a/b"}, "not a valid Firestore collection id"),
        ({"COLLECTION": ""}, "not a valid Firestore collection id"),
        ({"FENCE_COLLECTION": "__x__"}, "not a valid Firestore collection id"),
        ({"COLLECTION": ".."}, "not a valid Firestore collection id"),
        ({"CLIENT_KWARGS": "x"}, "CLIENT_KWARGS"),
    ],
)
def test_bad_configuration_is_refused(options, message):
    with pytest.raises(InvalidArgument, match=message):
        FirestoreBackend("f", {"OPTIONS": options})


def test_deploy_check_gives_the_index_and_ttl_hint():
    [info] = FirestoreBackend("f", {"OPTIONS": {"COLLECTION": "locks"}}).deploy_check()
    assert info.id == "syncguard.I020"
    assert "lockId" in info.msg and "purgeAt" in info.msg


def test_missing_extra_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "google.cloud.firestore", None)
    handler = LockHandler(
        {"f": {"BACKEND": "django_syncguard.backends.firestore.FirestoreBackend"}}
    )
    with pytest.raises(InvalidBackendError, match=r'pip install "django-syncguard\[firestore\]"'):
        handler["f"]


async def test_async_twins_use_the_async_client_and_map_its_errors(fh, monkeypatch):
    result = await fh.firestore.aacquire("async", 60_000)
    assert result.fence == "000000000000001"
    loop_client = fh.firestore.aclient()
    assert type(loop_client).__name__ == "AsyncClient"
    assert (await fh.firestore.arelease(result.lock_id)).ok is True
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("FIRESTORE_EMULATOR_HOST", f"127.0.0.1:{port}")
    down = FirestoreBackend("down", {"OPTIONS": {"PROJECT": "p", "OPERATION_TIMEOUT_MS": 2_000}})
    with pytest.raises((ServiceUnavailable, NetworkTimeout)):
        await down.aacquire("k", 1_000)


def test_close_closes_the_async_client_of_every_loop(fh):
    """``close()`` closes the gRPC channel of each loop's ``AsyncClient``, on that loop
    (here running on another thread): the client cannot be used afterwards."""
    from grpc.aio import UsageError

    backend = fh.firestore
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def loop_client() -> object:
        await backend.ais_locked("close")
        return backend.aclient()

    try:
        client = asyncio.run_coroutine_threadsafe(loop_client(), loop).result(10)
        backend.close()
        read = client.collection(backend.collection).document("close").get()
        with pytest.raises(UsageError, match=r"^Channel is closed\.$"):
            asyncio.run_coroutine_threadsafe(read, loop).result(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def test_the_client_library_still_has_every_private_attribute_we_use(fh):
    """``client.py`` reaches into google-cloud-firestore in the places listed in
    ``PRIVATE_ATTRIBUTES``; each is named here, on a synchronous and an async client,
    so a library upgrade that removes one fails this test rather than a lock."""
    from google.cloud.firestore_v1 import _helpers

    database = "projects/syncguard-test/databases/(default)"
    for client in (fh.firestore.client, fh.firestore.aclient()):
        reached = {
            "Client._firestore_api": client._firestore_api,
            "transport._wrapped_methods": client._firestore_api.transport._wrapped_methods,
            "transport.listen": client._firestore_api.transport.listen,
            "Client._rpc_metadata": client._rpc_metadata,
            "Client._database_string": client._database_string,
            "DocumentReference._document_path": client.document("c/d")._document_path,
            "firestore_v1._helpers.decode_dict": _helpers.decode_dict,
        }
        assert sorted(reached) == sorted(name for name, _ in PRIVATE_ATTRIBUTES)
        assert type(reached["transport._wrapped_methods"]) is dict
        assert len(reached["transport._wrapped_methods"]) > 0
        assert callable(reached["transport.listen"])
        assert ("google-cloud-resource-prefix", database) in reached["Client._rpc_metadata"]
        assert reached["Client._database_string"] == database
        assert reached["DocumentReference._document_path"] == f"{database}/documents/c/d"
        # The client layer's accessors give exactly these.
        assert database_string(client) == database
        assert document_name(client.document("c/d")) == f"{database}/documents/c/d"
        assert rpc_metadata(client) == reached["Client._rpc_metadata"]
    await fh.firestore.clients.aclose()
