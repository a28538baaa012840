"""What is particular to MemoryBackend: threads, cleanup, its store."""

from __future__ import annotations

import threading

import pytest

from django_syncguard import Internal, InvalidArgument, current_lock, lock, signals
from django_syncguard.backends.memory import MemoryBackend
from django_syncguard.fencing import FENCE_MAX
from django_syncguard.owners import QueueStats
from django_syncguard.waiting import GRANT_WINDOW_MS, WaitTicket
from django_syncguard.waiting import tickets as waiting_tickets
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


# ------------------------------------------------------------------ grants
JOIN_S = 30.0  # bound for a thread that must finish; never slept
NEVER = {"retry_delay_ms": 600_000, "backoff": "fixed", "jitter": "none", "timeout_ms": 600_000}


def test_a_grant_lets_a_waiter_here_enter_without_another_acquire(mem, monkeypatch):
    """The release hands the key to the waiting thread: the thread enters on the grant
    its listener received, sending no acquire, and the release claimed the grant for
    it (the record carries the lease's whole ttl at once)."""
    backend = mem.backend
    monkeypatch.setattr(waiting_tickets, "CHECK_IN_MS", 600_000)  # no check-in either
    calls: list[bool] = []
    acquire = backend.acquire

    def counted(*args, **kwargs):
        result = acquire(*args, **kwargs)
        calls.append(result.ok)
        return result

    monkeypatch.setattr(backend, "acquire", counted)
    held = acquire("granted", 60_000)
    queued = threading.Event()

    def on_contended(sender, attempt, **kwargs):
        queued.set()

    entered: dict[str, object] = {}

    def body():
        lease = current_lock()
        entered.update(fence=lease.fence, lock_id=lease.lock_id, calls=list(calls))
        entered["record"] = backend.lookup_raw(key="granted")

    signals.lock_contended.connect(on_contended, weak=False)
    try:
        thread = threading.Thread(
            target=lock,
            args=(body,),
            kwargs={"key": "granted", "using": backend, "ttl_ms": 45_000, **NEVER},
        )
        thread.start()
        assert queued.wait(JOIN_S)
        assert calls == [False]  # the ticketed attempt that queued (the listener came first)
        released_at = mem.now_ms()
        assert backend.release(held.lock_id).ok
        thread.join(JOIN_S)
        assert not thread.is_alive()
    finally:
        signals.lock_contended.disconnect(on_contended)
    assert entered["calls"] == [False]  # entered on the grant: no acquire since
    assert entered["fence"] == "000000000000002"
    record = entered["record"]
    assert record.lock_id == entered["lock_id"]
    assert record.expires_at_ms == released_at + 45_000  # claimed
    assert calls == [False]
    assert backend.lookup_raw(key="granted") is None  # released on leaving


def test_an_unclaimed_grant_lapses_after_the_window(mem):
    """A waiter nobody listens for here (its thread or task is gone) is granted the key
    anyway; nobody claims it, and at GRANT_WINDOW_MS it is gone for every operation,
    without the liveness tolerance. The next waiter, told to re-check past the window,
    takes the key with the next fence."""
    backend = mem.backend
    held = backend.acquire("lapse", 60_000)
    gone, second = WaitTicket.new(), WaitTicket.new()
    listener = backend.wake_ups.listen("lapse", second.id)
    try:
        assert backend.acquire("lapse", 60_000, ticket=gone).queue_position == 0
        assert backend.acquire("lapse", 60_000, ticket=second).queue_position == 1
        granted_at = mem.now_ms()
        assert backend.release(held.lock_id).ok
        assert listener.grant is None and listener.recheck_at is not None  # nudged only
        record = backend.lookup_raw(key="lapse")
        assert record is not None and record.fence == "000000000000002"
        assert record.acquired_at_ms == granted_at

        mem.advance(GRANT_WINDOW_MS - 1)
        assert backend.is_locked("lapse") is True
        assert backend.acquire("lapse", 60_000, ticket=second).queue_position == 0
        mem.advance(1)
        assert backend.is_locked("lapse") is False
        assert backend.lookup_raw(key="lapse") is None
        assert backend.lookup_raw(lock_id=record.lock_id) is None
        assert backend.extend(record.lock_id, 60_000).reason == "expired"
        assert backend.release(record.lock_id).reason == "expired"
        got = backend.acquire("lapse", 60_000, ticket=second)
        assert got.ok and got.fence == "000000000000003"
        # The gone waiter comes back: it is behind nobody now, and queues.
        assert backend.acquire("lapse", 60_000, ticket=gone).queue_position == 0
        backend.withdraw("lapse", gone.id)
        assert backend.release(got.lock_id).ok
    finally:
        listener.close()


def test_an_attempt_that_crosses_its_grant_returns_and_claims_it(mem):
    """A grant that did not reach its waiter (no listener here) is found by the
    waiter's next attempt: that attempt returns the granted lock, claimed."""
    backend = mem.backend
    held = backend.acquire("crossed", 60_000)
    ticket = WaitTicket.new()
    assert backend.acquire("crossed", 30_000, ticket=ticket).queue_position == 0
    granted_at = mem.now_ms()
    assert backend.release(held.lock_id).ok
    record = backend.lookup_raw(key="crossed")
    assert record is not None
    mem.advance(GRANT_WINDOW_MS - 1)
    got = backend.acquire("crossed", 30_000, ticket=ticket)
    assert (got.ok, got.lock_id, got.fence) == (True, record.lock_id, "000000000000002")
    assert got.expires_at_ms == granted_at + 30_000
    mem.advance(GRANT_WINDOW_MS)  # claimed: the window no longer applies
    assert backend.lookup_raw(key="crossed").expires_at_ms == granted_at + 30_000
    assert backend.release(got.lock_id).ok


def test_a_withdrawal_gives_a_claimed_grant_back_to_the_next_waiter(mem):
    """A waiter whose grant was claimed for it, but which gave up before using it (its
    timeout came first), withdraws: the lock goes, and the key is granted on."""
    backend = mem.backend
    held = backend.acquire("given-back", 60_000)
    first, second = WaitTicket.new(), WaitTicket.new()
    listen_first = backend.wake_ups.listen("given-back", first.id)
    listen_second = backend.wake_ups.listen("given-back", second.id)
    try:
        assert not backend.acquire("given-back", 60_000, ticket=first).ok
        assert not backend.acquire("given-back", 60_000, ticket=second).ok
        assert backend.release(held.lock_id).ok
        assert listen_first.grant is not None and listen_first.grant.fence == 2
        backend.withdraw("given-back", first.id)
        assert backend.lookup_raw(lock_id=listen_first.grant.lock_id) is None
        assert listen_second.grant is not None and listen_second.grant.fence == 3
        record = backend.lookup_raw(key="given-back")
        assert record.lock_id == listen_second.grant.lock_id
        assert record.expires_at_ms == listen_second.grant.expires_at_ms  # claimed
    finally:
        listen_first.close()
        listen_second.close()


def test_a_grant_that_would_pass_the_maximum_fence_only_wakes_the_waiter(mem):
    """No fence above the maximum is handed out by a grant either: the release only
    wakes the first waiter, whose own attempt then reports the overflow."""
    backend = mem.backend
    held = backend.acquire("at-max", 60_000)
    mem.set_fence("at-max", FENCE_MAX)
    ticket = WaitTicket.new()
    listener = backend.wake_ups.listen("at-max", ticket.id)
    try:
        assert backend.acquire("at-max", 60_000, ticket=ticket).queue_position == 0
        assert backend.release(held.lock_id).ok
        assert listener.wait(0, None) is True and listener.grant is None
        assert backend.is_locked("at-max") is False
        with pytest.raises(Internal, match="Fence counter"):
            backend.acquire("at-max", 60_000, ticket=ticket)
    finally:
        listener.close()
