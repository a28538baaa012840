"""What is particular to MemoryBackend: threads, cleanup, its store."""

from __future__ import annotations

import threading

import pytest

from django_syncguard import InvalidArgument
from django_syncguard.backends.memory import MemoryBackend
from django_syncguard.owners import QueueStats
from django_syncguard.waiting import WaitTicket
from tests.support.harness import MemoryHarness


def test_threads_exclude_each_other_and_fences_strictly_increase():
    backend = MemoryBackend("threads", {})
    backend.reset()
    counter = {"value": 0, "inside": 0, "peak": 0}
    fences: list[str] = []
    start = threading.Barrier(8)

    def worker():
        start.wait()
        done = 0
        while done < 50:
            result = backend.acquire("hot", 60_000)
            if not result.ok:
                continue
            counter["inside"] += 1
            counter["peak"] = max(counter["peak"], counter["inside"])
            value = counter["value"]  # read-modify-write, unsafe without the lock
            counter["value"] = value + 1
            fences.append(result.fence)
            counter["inside"] -= 1
            assert backend.release(result.lock_id).ok
            done += 1

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter["value"] == 400
    assert counter["peak"] == 1
    assert fences == [f"{n:015d}" for n in range(1, 401)]
    backend.reset()


def test_liveness_edges_to_the_millisecond():
    harness = MemoryHarness()
    backend = harness.backend
    result = backend.acquire("ttl", 1_000)
    harness.advance(1_000 + 999)  # 999 ms past expiry: live
    assert backend.is_locked("ttl") is True
    assert backend.acquire("ttl", 1_000).ok is False
    assert backend.lookup(lock_id=result.lock_id) is not None
    harness.advance(1)  # expiry + 1000: gone for every operation
    assert backend.is_locked("ttl") is False
    assert backend.lookup(lock_id=result.lock_id) is None
    assert backend.extend(result.lock_id, 1_000).ok is False
    assert backend.acquire("ttl", 1_000).fence == "000000000000002"
    harness.close()


def test_cleanup_in_is_locked_removes_only_long_expired_records():
    harness = MemoryHarness(CLEANUP_IN_IS_LOCKED=True)
    backend = harness.backend
    result = backend.acquire("k", 1_000)
    harness.advance(1_000 + 2_000)  # exactly the 2000 ms guard past expiry: kept
    assert backend.is_locked("k") is False
    assert "k" in backend._store.locks
    harness.advance(1)
    assert backend.is_locked("k") is False
    assert "k" not in backend._store.locks
    assert result.lock_id not in backend._store.index
    # The fence counter survives the cleanup.
    assert backend.acquire("k", 1_000).fence == "000000000000002"
    harness.close()


def test_without_cleanup_is_locked_never_writes():
    harness = MemoryHarness()
    harness.backend.acquire("k", 1_000)
    harness.advance(60_000)
    assert harness.backend.is_locked("k") is False
    assert "k" in harness.backend._store.locks
    harness.close()


@pytest.mark.parametrize(
    "options",
    [{"CLOCK": 5}, {"CLEANUP_IN_IS_LOCKED": "yes"}, {"CONNECT_TIMEOUT_MS": 0}],
)
def test_bad_options_are_refused(options):
    with pytest.raises(InvalidArgument):
        MemoryBackend("bad", {"OPTIONS": options})


def test_key_prefix_must_be_a_string():
    with pytest.raises(InvalidArgument, match="KEY_PREFIX"):
        MemoryBackend("bad", {"KEY_PREFIX": 5})


def test_a_waiter_that_lapsed_and_came_back_waits_from_its_return(mem):
    """The inspector's oldest wait (``queue_stats``): a renewal keeps a place's
    queueing time; a ticket whose place lapsed queues again at the end, from then."""
    backend = mem.backend
    held = backend.acquire("since", 60_000)
    ticket = WaitTicket.new()
    start = mem.now_ms()
    assert backend.acquire("since", 60_000, ticket=ticket).queue_position == 0
    mem.advance(1_000)
    assert backend.acquire("since", 60_000, ticket=ticket).queue_position == 0  # renewal
    assert backend.queue_stats(["since"]) == {"since": QueueStats(1, start)}
    mem.advance(ticket.patience_ms + 1)  # the place lapses
    back = mem.now_ms()
    assert backend.acquire("since", 60_000, ticket=ticket).queue_position == 0
    assert backend.queue_stats(["since"]) == {"since": QueueStats(1, back)}
    backend.withdraw("since", ticket.id)
    assert backend.queue_stats(["since"]) == {}
    assert backend.release(held.lock_id).ok
