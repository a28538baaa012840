"""Fair queues and wake-ups on the Firestore emulator, across OS processes.

The contract suite (tests/test_waiting_contract.py) covers the queue rule; here: the
queue's document layout, wake-ups sent by releases in other processes, fairness of
``lock()`` across processes, a randomized release/acquire race, a broken stream, and
async waiters. Wake-ups are awaited on events; sleeps only add jitter to races.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from django_syncguard import current_lock, generate_lock_id, lock
from django_syncguard.backends.firestore import FirestoreBackend
from django_syncguard.backends.firestore import wakeups as firestore_wakeups
from django_syncguard.constants import TIME_TOLERANCE_MS
from django_syncguard.results import AcquireResult
from django_syncguard.signals import lock_contended
from django_syncguard.waiting import GRANT_WINDOW_MS, PATIENCE_MS, Grant, WaitTicket
from tests.support import workers
from tests.support.faults import wait_until
from tests.support.harness import FirestoreHarness
from tests.support.processes import Children, assert_delayed_by_the_grant_window, sigkill
from tests.support.proxy import FaultProxy

TTL = 60_000
WAKE_S = 10.0  # generous bound for an event that must arrive; never slept
RACE_ROUNDS = 300
CLOSE_ROUNDS = 100


def ticket(patience_ms: int = PATIENCE_MS) -> WaitTicket:
    return WaitTicket(generate_lock_id(), patience_ms)


def fences(*numbers: int) -> list[str]:
    return [f"{n:015d}" for n in numbers]


@pytest.fixture
def fh(firestore_emulator) -> Iterator[FirestoreHarness]:
    harness = FirestoreHarness()
    yield harness
    harness.close()


def elsewhere(fh: FirestoreHarness) -> FirestoreBackend:
    """The same collections through another backend object (another client)."""
    return FirestoreBackend("elsewhere", fh.settings_entry)


def lock_doc(fh: FirestoreHarness, key: str) -> dict[str, Any] | None:
    return fh.firestore._refs(key)[0].get().to_dict()


@pytest.fixture
def holder(firestore_emulator, fh) -> Iterator[Any]:
    """A pipe to another OS process that takes and releases locks on command."""
    children = Children()
    ours, theirs = children.ctx.Pipe()
    options = fh.settings_entry["OPTIONS"]
    children.start(workers.firestore_holder, firestore_emulator.host, options, theirs)
    try:
        yield ours
        ours.send(("stop",))
        children.join()
    finally:
        children.terminate()


def as_older_waiters(fh: FirestoreHarness, key: str) -> None:
    """Drop the grant records of ``key``'s places, as waiters of a version before
    grants leave none: a release then only wakes them."""
    ref = fh.firestore._refs(key)[0]
    waiters = ref.get().to_dict()["waiters"]
    stripped = {t: {f: v for f, v in e.items() if f != "request"} for t, e in waiters.items()}
    ref.update({"waiters": stripped})


def held_elsewhere(holder: Any, key: str) -> str:
    holder.send(("acquire", key, TTL))
    ok, lock_id, _ = holder.recv()
    assert ok is True
    return lock_id


# ------------------------------------------------------------------ the layout
def test_a_release_keeps_the_waiters_in_a_document_without_a_lock(fh):
    backend = fh.firestore
    held = backend.acquire("layout", TTL)
    a, b = ticket(), ticket()
    assert backend.acquire("layout", TTL, ticket=a).queue_position == 0
    assert backend.acquire("layout", TTL, ticket=b).queue_position == 1
    doc = lock_doc(fh, "layout")
    assert doc["arrivals"] == 2
    assert {t: e["arrival"] for t, e in doc["waiters"].items()} == {a.id: 1, b.id: 2}
    as_older_waiters(fh, "layout")  # else the release grants the key to a (below)

    assert backend.release(held.lock_id).ok is True

    doc = lock_doc(fh, "layout")
    assert set(doc) == {"key", "waiters", "arrivals", "expiresAtMs", "purgeAt"}
    assert doc["expiresAtMs"] == max(e["liveUntilMs"] for e in doc["waiters"].values())
    # Free for every reader, though the document stays for its waiters.
    assert backend.is_locked("layout") is False
    assert backend.lookup(key="layout") is None
    assert backend.list_locks().records == ()
    assert list(backend.delete_expired()) == []  # live waiters keep it
    assert lock_doc(fh, "layout") is not None

    got_a = backend.acquire("layout", TTL, ticket=a)
    assert got_a.fence == "000000000000002"
    assert set(lock_doc(fh, "layout")["waiters"]) == {b.id}
    backend.withdraw("layout", b.id)
    assert "waiters" not in lock_doc(fh, "layout")
    assert backend.release(got_a.lock_id).ok is True
    assert lock_doc(fh, "layout") is None  # nobody waits: deleted, as before


def test_a_document_whose_waiters_all_lapsed_is_cleaned_up(fh):
    backend = fh.firestore
    held = backend.acquire("lapsed", TTL)
    assert not backend.acquire("lapsed", TTL, ticket=ticket(patience_ms=1_000)).ok
    as_older_waiters(fh, "lapsed")  # a waiter-only document, not a grant
    assert backend.release(held.lock_id).ok is True
    assert lock_doc(fh, "lapsed") is not None
    fh.advance(1_000 + 2_000 + 1)  # past the place's end and the cleanup guard
    assert list(backend.delete_expired()) == [1]
    assert lock_doc(fh, "lapsed") is None
    assert backend.acquire("lapsed", TTL).fence == "000000000000002"


def test_a_release_grants_the_key_to_the_first_waiter_in_its_own_write(fh):
    backend = fh.firestore
    held = backend.acquire("granted", TTL)
    a, b = ticket(), ticket()
    assert backend.acquire("granted", TTL, ticket=a).queue_position == 0
    assert backend.acquire("granted", TTL, ticket=b).queue_position == 1
    request = lock_doc(fh, "granted")["waiters"][a.id]["request"]
    assert (request["ttlMs"], request["clock"]) == (TTL, False)

    assert backend.release(held.lock_id).ok is True

    doc = lock_doc(fh, "granted")
    assert (doc["lockId"], doc["fence"], doc["grantTicket"]) == (
        request["lockId"],
        "000000000000002",
        a.id,
    )
    assert set(doc["waiters"]) == {b.id}  # a left the queue with its grant
    assert doc["grantExpiresAtMs"] == doc["acquiredAtMs"] + TTL
    # Until claimed, the stored expiry ends the lock at the claim deadline for readers.
    assert doc["expiresAtMs"] == doc["acquiredAtMs"] + GRANT_WINDOW_MS - TIME_TOLERANCE_MS
    assert fh.firestore._refs("granted")[1].get().get("fence") == "000000000000002"
    assert backend.lookup(key="granted").fence == "000000000000002"  # held for readers

    # a's next attempt crossed the grant: it is the granted lock, and it claims it.
    got = backend.acquire("granted", TTL, ticket=a)
    assert (got.ok, got.lock_id, got.fence, got.expires_at_ms) == (
        True,
        request["lockId"],
        "000000000000002",
        doc["grantExpiresAtMs"],
    )
    doc = lock_doc(fh, "granted")
    assert "grantExpiresAtMs" not in doc and doc["expiresAtMs"] == got.expires_at_ms

    assert backend.release(got.lock_id).ok is True  # granted on to b
    doc = lock_doc(fh, "granted")
    assert (doc["fence"], doc["grantTicket"], "waiters" in doc) == ("000000000000003", b.id, False)
    backend.withdraw("granted", b.id)  # b gives its grant back: nobody waits
    assert lock_doc(fh, "granted") is None
    assert backend.acquire("granted", TTL).fence == "000000000000004"


def test_an_attempt_that_finds_the_key_free_behind_a_waiter_grants_it_to_that_waiter(fh):
    backend = fh.firestore
    backend.acquire("noticed", TTL)
    a, b = ticket(patience_ms=600_000), ticket(patience_ms=600_000)
    assert backend.acquire("noticed", TTL, ticket=a).queue_position == 0
    fh.advance(TTL + TIME_TOLERANCE_MS)  # the lease ran out; a has not noticed yet

    # b arrives and notices: the key goes to a, and b queues behind it.
    assert backend.acquire("noticed", TTL, ticket=b) == AcquireResult.locked(0)
    doc = lock_doc(fh, "noticed")
    assert (doc["grantTicket"], doc["fence"], set(doc["waiters"])) == (
        a.id,
        "000000000000002",
        {b.id},
    )
    assert backend.acquire("noticed", TTL).ok is False  # held by the grant
    assert backend.acquire("noticed", TTL, ticket=a).fence == "000000000000002"


def test_a_grant_reaches_the_waiter_in_another_process_which_claims_it(fh, holder):
    backend = fh.firestore
    lock_id = held_elsewhere(holder, "claimed")
    t = ticket()
    listener = backend.wake_ups.listen("claimed", t.id)
    try:
        assert listener.healthy is True  # the watch is confirmed
        assert backend.acquire("claimed", TTL, ticket=t).queue_position == 0
        holder.send(("release", lock_id, 0))
        assert holder.recv() is True
        assert listener.wait(WAKE_S, None) is True
        grant = listener.grant
        assert isinstance(grant, Grant) and grant.fence == 2
        doc = lock_doc(fh, "claimed")
        assert (doc["lockId"], doc["grantExpiresAtMs"]) == (grant.lock_id, grant.expires_at_ms)
        # The wake-ups' thread claims it a quarter of the window later.
        wait_until(lambda: "grantExpiresAtMs" not in lock_doc(fh, "claimed"), WAKE_S, "the claim")
        assert lock_doc(fh, "claimed")["expiresAtMs"] == grant.expires_at_ms
        assert backend.release(grant.lock_id).ok is True
        assert lock_doc(fh, "claimed") is None
    finally:
        listener.close()


@pytest.mark.slow
def test_a_waiter_killed_first_in_line_delays_the_key_by_its_grant_window(firestore_emulator, fh):
    """A process queued first is killed (SIGKILL); the release grants it the key
    anyway (its place is still live). Nobody claims the grant: it lapses at its claim
    deadline, and the next waiter (a thread here, on another backend object), whose
    stream saw the grant go by, tries again just after and takes the key. The delay
    is the window, not the dead ticket's patience nor a TTL."""
    backend, second = fh.firestore, elsewhere(fh)
    held = backend.acquire("killed", TTL)
    children = Children()
    results, first_queued = children.ctx.Queue(), children.ctx.Event()
    entered: list[tuple[float, str]] = []

    def run() -> None:
        def body() -> None:
            entered.append((time.monotonic(), current_lock().fence))

        lock(body, key="killed", using=second, ttl_ms=TTL, timeout_ms=60_000)

    queued = Queued()
    try:
        children.start(
            workers.firestore_fair_waiter,
            firestore_emulator.host,
            fh.settings_entry["OPTIONS"],
            "killed",
            "dead",
            first_queued,
            results,
        )
        assert first_queued.wait(120)
        thread = threading.Thread(target=run)
        thread.start()
        assert queued.event.wait(WAKE_S)
        wait_until(lambda: second.wake_ups.ready("killed"), WAKE_S, "the key is watched")
        sigkill(children.started[0])

        released_at = time.monotonic()
        assert backend.release(held.lock_id).ok is True
        thread.join(WAKE_S)
    finally:
        queued.close()
        children.terminate()
        second.close()
    assert_delayed_by_the_grant_window(entered, released_at)


def test_a_waiter_polling_fast_does_not_write_at_every_attempt(fh):
    backend = fh.firestore
    backend.acquire("calm", TTL)
    t = ticket()
    assert not backend.acquire("calm", TTL, ticket=t).ok
    written = fh.firestore._refs("calm")[0].get().update_time
    assert backend.acquire("calm", TTL, ticket=t).queue_position == 0
    assert fh.firestore._refs("calm")[0].get().update_time == written


# ------------------------------------------------------- wake-ups across processes
def test_a_release_in_another_process_wakes_a_waiter_here(fh, holder):
    backend = fh.firestore
    lock_id = held_elsewhere(holder, "wake")
    t = ticket()
    listener = backend.wake_ups.listen("wake", t.id)
    try:
        assert listener.healthy is True  # the watch is confirmed
        assert backend.acquire("wake", TTL, ticket=t).queue_position == 0
        holder.send(("release", lock_id, 0))
        assert holder.recv() is True
        assert listener.wait(WAKE_S, None) is True
        assert listener.healthy is True  # woken by the release, not by a lost stream
        assert backend.acquire("wake", TTL, ticket=t).fence == "000000000000002"
    finally:
        listener.close()


def test_lock_is_fair_across_three_processes(firestore_emulator, fh):
    # Each process queues (its first attempt finds the key held) before the next one
    # starts; one release then hands the key down the queue, process to process.
    backend = fh.firestore
    options = fh.settings_entry["OPTIONS"]
    held = backend.acquire("fair", TTL)
    children = Children()
    results = children.ctx.Queue()
    try:
        for name in "abc":
            queued = children.ctx.Event()
            children.start(
                workers.firestore_fair_waiter,
                firestore_emulator.host,
                options,
                "fair",
                name,
                queued,
                results,
            )
            assert queued.wait(120)
        assert backend.release(held.lock_id).ok is True
        got = [results.get(timeout=120) for _ in "abc"]
        children.join()
    finally:
        children.terminate()
    assert not [r for r in got if isinstance(r, BaseException)], got
    assert sorted(got, key=lambda r: r[1]) == list(zip("abc", fences(2, 3, 4), strict=True))


def test_no_wake_up_is_lost_in_a_randomized_release_acquire_race(fh, holder):
    # Another process holds the key and releases it after a random delay; this one
    # queues after another random delay: before the release (it must be woken),
    # after it (the key is free), or during it (either, decided by the guards).
    backend = fh.firestore
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    outcomes: list[str] = []
    # The watch starts before any write to the key, and stays for every round: the
    # emulator may garble a stream whose watch is added during a write (see the spec).
    keeper = backend.wake_ups.listen("race", generate_lock_id())
    assert keeper.healthy is True
    for _ in range(RACE_ROUNDS):
        lock_id = held_elsewhere(holder, "race")
        holder.send(("release", lock_id, rng.uniform(0, 0.02)))
        time.sleep(rng.uniform(0, 0.02))  # jitter for the race, not synchronisation
        t = ticket()
        listener = backend.wake_ups.listen("race", t.id)
        try:
            assert listener.healthy is True  # the watch stays: confirmed at once
            result = backend.acquire("race", TTL, ticket=t)
            outcomes.append("free" if result.ok else "woken")
            if not result.ok:
                assert listener.wait(WAKE_S, None) is True, f"lost wake-up (seed {seed})"
                assert listener.healthy is True  # woken by the release, not by a lost stream
                result = backend.acquire("race", TTL, ticket=t)
                assert result.ok is True, f"woken too early (seed {seed})"
        finally:
            listener.close()
        assert holder.recv() is True
        assert backend.release(result.lock_id).ok is True
    keeper.close()
    assert set(outcomes) == {"free", "woken"}, (seed, outcomes)
    assert backend.acquire("race", TTL).fence == f"{2 * RACE_ROUNDS + 1:015d}"


# --------------------------------------------------------------- a broken stream
class Queued:
    """Set when a ``lock()`` attempt in this process found ``key`` held."""

    def __init__(self) -> None:
        self.event = threading.Event()
        lock_contended.connect(self.receive)

    def receive(self, sender: Any, **kwargs: Any) -> None:
        self.event.set()

    def close(self) -> None:
        lock_contended.disconnect(self.receive)


def waiter_thread(backend: FirestoreBackend, key: str, fences_seen: list[str]) -> threading.Thread:
    def run() -> None:
        fence = lock(
            lambda: current_lock().fence,
            key=key,
            using=backend,
            timeout_ms=60_000,
            max_retries=1_000_000,
        )
        fences_seen.append(fence)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_stopped_watch_leaves_waiters_polling_and_they_still_acquire(fh):
    waiter, rival = fh.firestore, elsewhere(fh)
    held = rival.acquire("stopped", TTL)
    queued, seen = Queued(), []
    try:
        thread = waiter_thread(waiter, "stopped", seen)
        assert queued.event.wait(WAKE_S)
        waiter.wake_ups.close()  # no watch any more: nothing will wake the waiter
        assert waiter.wake_ups.connected is False
        assert rival.release(held.lock_id).ok is True
        thread.join(WAKE_S * 3)
        assert seen == ["000000000000002"]
    finally:
        queued.close()
        rival.close()


def test_a_dropped_stream_is_reported_and_reestablished(firestore_emulator, monkeypatch, caplog):
    caplog.set_level("WARNING", logger="django_syncguard.backends.firestore.wakeups")
    suffix = uuid.uuid4().hex[:12]
    options = {
        "PROJECT": FirestoreHarness.project,
        "COLLECTION": f"locks_{suffix}",
        "FENCE_COLLECTION": f"fences_{suffix}",
    }
    rival = FirestoreBackend("rival", {"OPTIONS": options})
    with FaultProxy(firestore_emulator.port) as proxy:
        monkeypatch.setenv("FIRESTORE_EMULATOR_HOST", proxy.host)
        waiter = FirestoreBackend("proxied", {"OPTIONS": options})
        held = rival.acquire("dropped", TTL)
        t = ticket()
        listener = waiter.wake_ups.listen("dropped", t.id)
        try:
            assert listener.healthy is True
            assert waiter.acquire("dropped", TTL, ticket=t).queue_position == 0

            proxy.drop()  # resets every connection, the Listen stream's included

            assert listener.wait(WAKE_S, None) is True  # told: it may have missed a release
            assert listener.healthy is False  # from now on it polls
            assert any("lost their Firestore stream" in r.getMessage() for r in caplog.records)
            assert waiter.wake_ups.wait_connected(WAKE_S) is True  # reconnected
            # The watch is back: a new listener is healthy, and releases wake both.
            t2 = ticket()
            fresh = waiter.wake_ups.listen("dropped", t2.id)
            try:
                assert fresh.healthy is True
                assert waiter.acquire("dropped", TTL, ticket=t2).queue_position == 1
                assert rival.release(held.lock_id).ok is True
                assert listener.wait(WAKE_S, None) is True  # t is first in line
                got = waiter.acquire("dropped", TTL, ticket=t)
                assert got.fence == "000000000000002"
                assert waiter.release(got.lock_id).ok is True
                assert fresh.wait(WAKE_S, None) is True
                assert waiter.acquire("dropped", TTL, ticket=t2).fence == "000000000000003"
            finally:
                fresh.close()
        finally:
            listener.close()
            waiter.close()
            rival.close()


def test_closing_wake_ups_never_fails_other_clients_writes(fh):
    # On the emulator, a Listen call cancelled (or half-closed) while it still watches
    # a document makes concurrent commits to that document fail, though applied.
    # Closing removes the targets first; here, watchers come and go while another
    # client keeps taking and releasing the key they watch. (A watch added during a
    # write is sometimes refused a healthy start: the emulator then sends a corrupt
    # message, the stream is lost and the waiter would poll; see the spec.)
    rival = elsewhere(fh)
    errors: list[BaseException] = []
    done = threading.Event()

    def churn() -> None:
        while not done.is_set():
            try:
                result = rival.acquire("churn", TTL)
                if result.ok:
                    rival.release(result.lock_id)
            except Exception as exc:
                errors.append(exc)

    writer = threading.Thread(target=churn)
    writer.start()
    try:
        for _ in range(CLOSE_ROUNDS):
            watcher = elsewhere(fh)
            watcher.wake_ups.listen("churn", generate_lock_id()).close()
            watcher.close()
    finally:
        done.set()
        writer.join()
        rival.close()
    assert errors == []


# ------------------------------------------------------------------------- async
async def test_an_async_waiter_is_woken_by_a_release_in_another_process(fh, holder):
    backend = fh.firestore
    lock_id = await asyncio.to_thread(held_elsewhere, holder, "async")
    t = ticket()
    listener = await backend.wake_ups.alisten("async", t.id)
    try:
        assert (await backend.aacquire("async", TTL, ticket=t)).queue_position == 0
        gone = ticket()
        assert (await backend.aacquire("async", TTL, ticket=gone)).queue_position == 1
        await backend.awithdraw("async", gone.id)
        assert set(lock_doc(fh, "async")["waiters"]) == {t.id}
        holder.send(("release", lock_id, 0))
        assert await listener.await_wake(WAKE_S, None) is True
        assert listener.healthy is True
        assert (await backend.aacquire("async", TTL, ticket=t)).fence == "000000000000002"
    finally:
        listener.close()
    assert await asyncio.to_thread(holder.recv) is True


async def test_an_async_release_grants_and_an_async_withdrawal_gives_it_back(fh):
    backend = fh.firestore
    held = await backend.aacquire("async:grant", TTL)
    a, b = ticket(), ticket()
    assert (await backend.aacquire("async:grant", TTL, ticket=a)).queue_position == 0
    assert (await backend.aacquire("async:grant", TTL, ticket=b)).queue_position == 1
    assert (await backend.arelease(held.lock_id)).ok is True
    assert lock_doc(fh, "async:grant")["grantTicket"] == a.id
    await backend.awithdraw("async:grant", a.id)  # a gives it back: granted on to b
    doc = lock_doc(fh, "async:grant")
    assert (doc["grantTicket"], doc["fence"]) == (b.id, "000000000000003")
    got = await backend.aacquire("async:grant", TTL, ticket=b)  # crossed its grant
    assert (got.ok, got.fence) == (True, "000000000000003")
    assert (await backend.arelease(got.lock_id)).ok is True
    assert lock_doc(fh, "async:grant") is None


# -------------------------------------------------------------- watch lifecycle
def test_a_key_stays_watched_a_while_after_its_last_waiter(fh, monkeypatch):
    monkeypatch.setattr(firestore_wakeups, "MAX_IDLE_WATCHES", 1)
    wake_ups = fh.firestore.wake_ups
    wake_ups.listen("idle:1", generate_lock_id()).close()
    assert wake_ups.watched() == ["idle:1"]  # kept: a waiter may come back soon
    again = wake_ups.listen("idle:1", generate_lock_id())
    assert again.healthy is True
    again.close()
    wake_ups.listen("idle:2", generate_lock_id()).close()
    assert wake_ups.watched() == ["idle:2"]  # beyond the cap the longest idle goes


def test_a_forked_child_starts_its_own_stream(fh, holder):
    # A real fork would copy the gRPC state too; this pretends the process changed,
    # which is what the registry checks, and shows the state rebuilt from nothing.
    wake_ups = fh.firestore.wake_ups
    wake_ups.listen("fork", generate_lock_id()).close()
    parent_thread = wake_ups._thread
    wake_ups._pid = -1  # as a forked child sees its parent's registry
    lock_id = held_elsewhere(holder, "fork")
    t = ticket()
    listener = wake_ups.listen("fork", t.id)
    try:
        assert wake_ups._thread is not parent_thread  # a stream of its own
        assert listener.healthy is True
        assert fh.firestore.acquire("fork", TTL, ticket=t).queue_position == 0
        holder.send(("release", lock_id, 0))
        assert holder.recv() is True
        assert listener.wait(WAKE_S, None) is True
    finally:
        listener.close()
