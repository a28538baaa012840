"""``until_commit``: a lock whose code ends inside ``transaction.atomic()`` is released
when the transaction ends (commit or rollback), in one process; the multi-process
proofs are in test_transactions_concurrency.py."""

from __future__ import annotations

import asyncio
import threading

import pytest
from django.db import connections, transaction
from django.test import TestCase

from django_syncguard import current_lock, lock, locked
from django_syncguard.signals import lock_extended, lock_lost, lock_released

pytestmark = pytest.mark.django_db(transaction=True)


class Rollback(Exception):
    pass


def fail_after(body, using):
    with transaction.atomic(using=using):
        body()
        raise Rollback


def rolled_back(body, using="default"):
    """Run ``body()`` in ``atomic(using=...)``, then roll that block back."""
    with pytest.raises(Rollback):
        fail_after(body, using)


@pytest.fixture
def released(mem):
    """The keys whose release was signalled, in order."""
    seen: list[str] = []

    def receiver(sender, key_hash, ok, **kwargs):
        seen.append((key_hash, ok))

    lock_released.connect(receiver, weak=False)
    yield seen
    lock_released.disconnect(receiver)


def held(mem, key="invoice:1"):
    return mem.backend.is_locked(key)


def test_outside_a_transaction_the_lock_is_released_when_the_code_ends(mem):
    with locked("invoice:1", using=mem.backend):
        assert held(mem)
    assert not held(mem)


def test_the_release_waits_for_the_commit(mem, released):
    with transaction.atomic():
        with locked("invoice:1", using=mem.backend) as lease:
            pass
        assert held(mem)
        assert current_lock() is None
        assert lease.released is False
        assert released == []
    assert not held(mem)
    assert lease.released is True
    assert [ok for _, ok in released] == [True]


def test_the_release_follows_a_rollback_at_once(mem):
    def body():
        with locked("invoice:1", using=mem.backend):
            pass
        assert held(mem)

    rolled_back(body)
    assert not held(mem)


def test_an_exception_from_the_locked_code_rolls_back_and_releases(mem):
    with pytest.raises(Rollback), transaction.atomic(), locked("invoice:1", using=mem.backend):
        raise Rollback
    assert not held(mem)


def test_a_caught_exception_inside_the_transaction_waits_for_its_commit(mem):
    with transaction.atomic():
        with pytest.raises(Rollback), locked("invoice:1", using=mem.backend):
            raise Rollback
        assert held(mem)
    assert not held(mem)


def test_a_rolled_back_savepoint_does_not_release(mem):
    def savepoint_body():
        with locked("invoice:1", using=mem.backend):
            pass

    with transaction.atomic():
        rolled_back(savepoint_body)
        assert held(mem)
    assert not held(mem)


def test_a_rolled_back_savepoint_inside_the_locked_code_does_not_release(mem):
    with transaction.atomic(), locked("invoice:1", using=mem.backend):
        with pytest.raises(Rollback), transaction.atomic():
            raise Rollback
        assert held(mem)
    assert not held(mem)


class HookFailed(Exception):
    pass


@pytest.fixture
def release_seen():
    """Set when a ``lock_released`` signal arrives (from any thread)."""
    seen = threading.Event()

    def receiver(sender, **kwargs):
        seen.set()

    lock_released.connect(receiver, weak=False)
    yield seen
    lock_released.disconnect(receiver)


def test_a_raising_commit_hook_before_ours_does_not_keep_the_lock(mem, release_seen):
    def fail():
        raise HookFailed

    def pay():
        with transaction.atomic():
            transaction.on_commit(fail)  # Django's default: robust=False
            with locked("invoice:1", using=mem.backend):
                pass

    with pytest.raises(HookFailed) as raised:
        pay()
    # The exception, and through its traceback the hooks Django never ran, stay alive
    # (as an error tracker or a task result would keep them); the data is committed.
    assert raised.value.__traceback__ is not None
    assert release_seen.wait(timeout=5)
    assert not held(mem)


def test_a_rollback_releases_while_something_keeps_the_dropped_hooks(mem, release_seen):
    kept = []

    def body():
        with locked("invoice:1", using=mem.backend):
            pass
        kept.append(connections["default"].run_on_commit)  # outlives the rollback

    rolled_back(body)
    assert len(kept[0]) == 1
    assert release_seen.wait(timeout=5)
    assert not held(mem)


def test_nested_locks_are_released_together_after_the_commit(mem):
    with transaction.atomic():
        with locked("outer", using=mem.backend), locked("inner", using=mem.backend):
            pass
        assert held(mem, "outer") and held(mem, "inner")
    assert not held(mem, "outer") and not held(mem, "inner")


def test_a_durable_block_releases_after_its_commit(mem):
    with transaction.atomic(durable=True):
        lock(lambda: None, key="invoice:1", using=mem.backend)
        assert held(mem)
    assert not held(mem)


@pytest.mark.django_db(transaction=True, databases=["default", "postgres"])
def test_with_two_databases_the_release_waits_for_both(mem):
    with transaction.atomic(using="postgres"):
        with transaction.atomic(using="default"), locked("invoice:1", using=mem.backend):
            pass
        assert held(mem)  # "default" committed; "postgres" is still open
    assert not held(mem)


@pytest.mark.django_db(transaction=True, databases=["default", "postgres"])
def test_with_two_databases_a_rollback_of_the_last_one_releases(mem):
    def body():
        with transaction.atomic(using="default"), locked("invoice:1", using=mem.backend):
            pass
        assert held(mem)

    rolled_back(body, using="postgres")
    assert not held(mem)


def test_until_commit_false_releases_when_the_code_ends(mem):
    with transaction.atomic():
        with locked("invoice:1", using=mem.backend, until_commit=False):
            pass
        assert not held(mem)


def test_lock_and_decorator_take_until_commit_too(mem):
    @locked("invoice:<pk>", using=mem.backend)
    def pay(pk):
        return current_lock().fence

    with transaction.atomic():
        assert pay(1) == "000000000000001"
        lock(lambda: None, key="other", using=mem.backend, until_commit=False)
        assert held(mem, "invoice:1") and not held(mem, "other")
    assert not held(mem, "invoice:1")


def test_a_connection_closed_mid_transaction_releases(mem):
    with transaction.atomic():
        with locked("invoice:1", using=mem.backend):
            pass
        connections["default"].close()
        assert not held(mem)
        # Django refuses to leave a block whose connection is gone only on commit.
        connections["default"].needs_rollback = True


def test_auto_extend_keeps_renewing_while_the_release_waits(mem):
    renewed = threading.Event()

    def receiver(sender, **kwargs):
        renewed.set()

    lock_extended.connect(receiver, weak=False)
    try:
        with transaction.atomic():
            with locked("invoice:1", using=mem.backend, ttl_ms=300, auto_extend=True) as lease:
                pass
            renewed.clear()
            assert renewed.wait(10), "no renewal while the release waited"
            assert lease.released is False
        assert lease.released is True
        assert not held(mem)
    finally:
        lock_extended.disconnect(receiver)


def test_a_lease_lost_while_its_release_waits_is_reported(mem):
    lost = threading.Event()

    def receiver(sender, reason, **kwargs):
        lost.set()

    lock_lost.connect(receiver, weak=False)
    try:
        with transaction.atomic():
            with locked("invoice:1", using=mem.backend, ttl_ms=300, auto_extend=True) as lease:
                pass
            mem.advance(300 + 1_000 + 1)  # past its expiry and the tolerance
            assert lost.wait(10), "no lock_lost while the release waited"
            assert lease.lost is True and lease.released is False
        assert lease.released is True
    finally:
        lock_lost.disconnect(receiver)


async def test_async_blocks_release_when_they_end(mem):
    # Django's transactions are synchronous: async code cannot be inside one, so an
    # async hold has nothing to wait for.
    async with locked("invoice:1", using=mem.backend):
        assert held(mem)
    assert not held(mem)


def test_sync_code_called_from_async_code_still_waits_for_its_commit(mem):
    from asgiref.sync import sync_to_async

    def pay():
        with transaction.atomic():
            with locked("invoice:1", using=mem.backend):
                pass
            return held(mem)

    assert asyncio.run(sync_to_async(pay)()) is True
    assert not held(mem)


def test_a_lock_left_by_a_test_s_own_atomic_is_released_when_the_test_ends(mem):
    """A TestCase opens a transaction for its class and a savepoint for each test;
    rolling back the test's savepoint ends what the test left, not the class's end."""

    def test_case_block():
        block = transaction.atomic()
        block._from_testcase = True
        block.__enter__()
        return block

    def roll_back(block):
        transaction.set_rollback(True)
        block.__exit__(None, None, None)

    whole_class = test_case_block()
    try:
        one_test = test_case_block()
        with transaction.atomic(), locked("invoice:1", using=mem.backend):
            pass
        assert held(mem)
        roll_back(one_test)
        assert not held(mem)
    finally:
        roll_back(whole_class)


class TestInsideDjangoTestCase(TestCase):
    """A TestCase's own atomic blocks are not the code's transaction."""

    def setUp(self):
        from tests.support.harness import MemoryHarness

        self.mem = MemoryHarness()

    def tearDown(self):
        self.mem.close()

    def test_outside_the_code_s_atomic_the_release_is_immediate(self):
        with locked("invoice:1", using=self.mem.backend):
            pass
        assert not self.mem.backend.is_locked("invoice:1")

    def test_inside_it_the_commit_hooks_release(self):
        with self.captureOnCommitCallbacks(execute=True), transaction.atomic():
            with locked("invoice:1", using=self.mem.backend):
                pass
            assert self.mem.backend.is_locked("invoice:1")
        assert not self.mem.backend.is_locked("invoice:1")

    def test_a_rollback_of_the_code_s_atomic_releases(self):
        def body():
            with locked("invoice:1", using=self.mem.backend):
                pass

        rolled_back(body)
        assert not self.mem.backend.is_locked("invoice:1")


def test_the_end_of_a_hold_lists_no_connections_anew(mem, monkeypatch):
    """The thread's connections are listed once, before the wait, when the hold opened
    none: the end of a hold is on the next holder's path (issue 24; listing them costs
    tens of microseconds on a thread that slept), and a block open at the end was open
    at the start, since blocks and holds nest."""
    calls = []
    listed = connections.all

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return listed(*args, **kwargs)

    with transaction.atomic():  # (may list them: SQLite's connection_created receiver)
        monkeypatch.setattr(connections, "all", counting)
        with locked("invoice:1", using=mem.backend):
            assert calls == [{"initialized_only": True}]
        assert calls == [{"initialized_only": True}]
        assert held(mem)
    assert not held(mem)


def test_a_transaction_left_open_in_a_generator_on_a_connection_opened_during_the_hold(mem):
    """The one way a block can outlive the hold it began in: a generator the locked
    code left inside its atomic(). In a fresh thread (a worker's, a request's), that
    block's connection is opened during the hold, so the hold's end lists the
    thread's connections anew (Django sent connection_created) and waits for it."""
    seen: dict[str, bool] = {}

    def rows():
        with transaction.atomic():
            yield
            yield

    def work() -> None:
        try:
            writes = rows()
            with locked("invoice:1", using=mem.backend):
                next(writes)  # inside rows()' transaction: written under the lock
            seen["held after the hold"] = held(mem)
            for _ in writes:  # the transaction commits
                pass
            seen["held after its commit"] = held(mem)
        finally:
            connections.close_all()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == {"held after the hold": True, "held after its commit": False}
