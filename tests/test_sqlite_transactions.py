"""The database backend on SQLite inside the caller's transactions: SQLite has one
writer per file, and the lock backend writes through its own connection."""

from __future__ import annotations

import sqlite3
import threading
import time
from typing import Any

import pytest
from django.db import connections, transaction

from django_syncguard import generate_lock_id, locked
from django_syncguard.backends.database import DatabaseBackend
from django_syncguard.backends.database.sqlite import queue_file
from django_syncguard.constants import TIME_TOLERANCE_MS
from django_syncguard.liveness import FakeClock
from django_syncguard.waiting import WaitTicket
from tests.support.factories import AccountFactory
from tests.testapp.models import Account

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def lite():
    backend = DatabaseBackend("lite", {"OPTIONS": {"DATABASE": "default"}})
    yield backend
    backend.close()


def test_a_lock_released_in_a_writing_transaction_waits_for_its_commit(lite):
    account = AccountFactory(balance=10)
    with transaction.atomic():
        with locked("account:1", using=lite):
            Account.objects.filter(pk=account.pk).update(balance=11)
        # Released later: a release now would wait for this transaction's write lock.
        assert lite.lookup(key="account:1") is not None
    assert lite.is_locked("account:1") is False
    assert lite.acquire("account:1", 1_000).fence == "000000000000002"


def test_a_rollback_releases_too(lite):
    account = AccountFactory(balance=10)

    def pay_then_fail():
        with transaction.atomic():
            with locked("account:1", using=lite):
                Account.objects.filter(pk=account.pk).update(balance=11)
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        pay_then_fail()
    assert lite.is_locked("account:1") is False
    account.refresh_from_db()
    assert account.balance == 10


def test_until_commit_false_cannot_release_behind_the_caller_s_write(lite, syncguard_log):
    account = AccountFactory(balance=10)
    with transaction.atomic(), locked("account:1", using=lite, until_commit=False):
        Account.objects.filter(pk=account.pk).update(balance=11)
    # The release failed fast (logged) and the lock lives until its TTL.
    assert "Releasing the lock on key" in syncguard_log.text
    assert "ServiceUnavailable" in syncguard_log.text
    assert lite.is_locked("account:1") is True


def test_outside_the_caller_s_transactions_nothing_changes(lite):
    AccountFactory(balance=10)
    with transaction.atomic():
        pass
    result = lite.acquire("account:1", 1_000)
    assert result.ok is True
    assert lite.release(result.lock_id).ok is True


def test_another_thread_s_write_lock_is_ordinary_contention(lite):
    # Django opens a transaction with a plain BEGIN: until it writes, this thread holds
    # nothing, and a lock call inside it waits for another writer as usual instead of
    # failing fast. The other thread keeps its write lock for half a second, well past
    # the 100 ms a call waits once its own transaction has written.
    account = AccountFactory(balance=10)
    holding, done = threading.Event(), threading.Event()

    def other_request():
        try:
            with transaction.atomic():
                Account.objects.filter(pk=account.pk).update(balance=20)
                holding.set()
                done.wait(10)
        finally:
            connections.close_all()

    writer = threading.Thread(target=other_request)
    writer.start()
    assert holding.wait(10)
    threading.Timer(0.5, done.set).start()
    with transaction.atomic():
        result = lite.acquire("account:1", 1_000)
    writer.join(10)
    assert result.ok is True
    account.refresh_from_db()
    assert account.balance == 20


# A transaction that has read and then writes fails at once ("database is locked",
# no busy wait) when another connection has SQLite's write lock at that moment. The
# holder of a lock reads and writes in its transaction; callers waiting for the lock
# must therefore not take the write lock (test_transactions_concurrency.py shows the
# lost transactions across processes).
@pytest.fixture
def writer():
    """A connection of "another process" to the same file, used from any thread."""
    name = connections["default"].settings_dict["NAME"]
    raw = sqlite3.connect(name, isolation_level=None, check_same_thread=False)
    yield raw
    if raw.in_transaction:
        raw.execute("ROLLBACK")
    raw.close()


def take_key(raw, key):
    """Write a live lock row for ``key`` through ``raw``, as an acquire would."""
    now = int(time.time() * 1000)
    raw.execute(
        "INSERT INTO syncguard_locks (key, lock_id, expires_at_ms, acquired_at_ms, fence) "
        "VALUES (?, ?, ?, ?, ?)",
        [key, generate_lock_id(), now + 60_000, now, "000000000000001"],
    )


def trace_statements(backend, trace):
    """Call ``trace(sql)`` as each statement of ``backend``'s private connection of
    this thread begins."""
    private = backend.connection()
    private.ensure_connection()
    private.connection.set_trace_callback(trace)


def test_a_held_key_is_answered_without_the_write_lock(lite, writer):
    held = lite.acquire("account:1", 60_000)
    writer.execute("BEGIN IMMEDIATE")  # another process writes, for as long as it likes
    assert lite.acquire("account:1", 1_000).ok is False  # at once, not after the timeout
    writer.execute("ROLLBACK")
    assert lite.release(held.lock_id).ok is True


def test_a_key_taken_while_waiting_for_the_write_lock_is_answered_without_it(lite, writer):
    trying, committed = threading.Event(), threading.Event()
    statements: list[str] = []

    def trace(sql):
        statements.append(sql)
        if sql.startswith("INSERT INTO syncguard_locks"):
            trying.set()
        elif trying.is_set() and sql.startswith("SELECT"):
            # The caller's next read of the key runs after the other writer's commit:
            # otherwise that commit could land between the read and the next try, and
            # the caller would rightly try to write again, and roll back again.
            assert committed.wait(10)

    def take_it_once_the_caller_waits():
        assert trying.wait(10)
        take_key(writer, "account:1")
        writer.execute("COMMIT")
        committed.set()

    trace_statements(lite, trace)
    writer.execute("BEGIN IMMEDIATE")
    other = threading.Thread(target=take_it_once_the_caller_waits)
    other.start()
    try:
        assert lite.acquire("account:1", 1_000).ok is False
    finally:
        other.join()
    tried = [i for i, sql in enumerate(statements) if sql.startswith("INSERT INTO syncguard")]
    assert len(tried) == 1  # its one write met the other writer's lock, and failed ...
    assert statements[tried[0] + 1] == "ROLLBACK"
    assert "COMMIT" not in statements  # ... so it never wrote ...
    assert not [sql for sql in statements[tried[0] :] if sql.startswith("BEGIN")]  # nor tried again


# An attempt that read the key as free can find it taken when its transaction starts:
# another caller took it in between, and may already be in its locked code, reading.
# Deciding must then not take the database's write lock: the holder's first write
# would fail at once. Every decision to write a key's lock is made under the queue
# file's write lock, and the database's is taken only to write (seen in CI once:
# test_transactions_concurrency.py, a worker's write "database is locked").
@pytest.fixture
def other():
    backend = DatabaseBackend("other", {"OPTIONS": {"DATABASE": "default"}})
    yield backend
    backend.close()


class Holder(threading.Thread):
    """Another request: in ``atomic()``, takes ``key`` through its own backend
    (``ticket``: as that waiter), reads the account, waits for ``go_write``, then
    writes it; ``outcome`` is "wrote" or the write's error."""

    def __init__(self, backend, key, account, ticket=None):
        super().__init__()
        self.backend, self.key, self.account, self.ticket = backend, key, account, ticket
        self.reading, self.go_write, self.done = (threading.Event() for _ in range(3))
        self.outcome = None
        self.lock_id = None
        self.error = None

    def run(self):
        try:
            with transaction.atomic():
                got = self.backend.acquire(self.key, 60_000, ticket=self.ticket)
                assert got.ok, got
                self.lock_id = got.lock_id
                seen = Account.objects.get(pk=self.account.pk).balance
                self.reading.set()
                assert self.go_write.wait(10)
                try:
                    Account.objects.filter(pk=self.account.pk).update(balance=seen + 1)
                    self.outcome = "wrote"
                except Exception as exc:
                    self.outcome = repr(exc)
                    raise
        except Exception as exc:
            self.error = self.error or exc
        finally:
            self.reading.set()
            self.done.set()
            connections.close_all()


def pause_after_the_first_read(backend, holder):
    """A trace on ``backend``'s private connection in this thread: at its first
    ``BEGIN`` (the key read as free), let ``holder`` take the key and read; at the
    end of that transaction (its ``COMMIT`` or ``ROLLBACK``, when it holds every lock
    it takes), let ``holder`` write, and wait for the write's outcome."""
    state = {"began": False, "ended": False, "waited": True, "in between": []}

    def trace(sql):
        if sql.startswith("BEGIN") and not state["began"]:
            state["began"] = True
            holder.start()
            state["waited"] &= holder.reading.wait(10)
        elif sql in ("COMMIT", "ROLLBACK") and state["began"] and not state["ended"]:
            state["ended"] = True
            holder.go_write.set()
            state["waited"] &= holder.done.wait(10)
        elif state["began"] and not state["ended"]:
            state["in between"].append(sql)

    trace_statements(backend, trace)
    return state


@pytest.mark.parametrize("behind", [False, True], ids=["acquire", "grant-to-the-first"])
def test_an_attempt_that_read_the_key_free_leaves_its_new_holder_s_write_alone(lite, other, behind):
    account = AccountFactory(balance=10)
    ticket = None
    if behind:
        # The key is free with a waiter first in line (a lease ran out): the attempt
        # grants it to that waiter, who meanwhile took it itself.
        clock = FakeClock(lite.now_ms())
        lite.ops.clock = other.ops.clock = clock
        ran_out = lite.acquire("account:1", 1_000)
        ticket = WaitTicket(WaitTicket.new().id, patience_ms=60_000)  # still queued
        assert other.acquire("account:1", 60_000, ticket=ticket).queue_position == 0
        clock.advance(1_000 + TIME_TOLERANCE_MS)
        assert lite.is_locked("account:1") is False
    holder = Holder(other, "account:1", account, ticket)
    state = pause_after_the_first_read(lite, holder)
    try:
        attempt = lite.acquire("account:1", 1_000)
    finally:
        holder.go_write.set()
        if holder.ident is not None:  # started: the attempt read the key as free
            holder.join(10)
    assert (state["began"], state["ended"], state["waited"]) == (True, True, True)
    assert holder.error is None
    assert holder.outcome == "wrote"
    # Inside its transaction the attempt took the queue file's lock, read the key again
    # (a grant reads only whether it is free), found it held, and wrote nothing.
    taken = ["DELETE FROM syncguard_queue.syncguard_waiters WHERE 0"]
    if behind:
        taken.append("SELECT expires_at_ms FROM syncguard_locks WHERE key = 'account:1'")
    else:
        taken.append("SELECT expires_at_ms, lock_id FROM syncguard_locks WHERE key = 'account:1'")
        taken.append(
            "SELECT ticket_id, arrival, live_until_ms FROM syncguard_queue.syncguard_waiters "
            "WHERE key = 'account:1'"
        )
    assert state["in between"] == taken
    assert attempt.ok is False
    account.refresh_from_db()
    assert account.balance == 11
    assert other.release(holder.lock_id).ok is True
    if behind:
        assert lite.release(ran_out.lock_id).reason == "not-found"  # taken over


class Releasing(threading.Thread):
    """Releases ``lock_id`` through ``backend`` on a thread of its own. ``reached`` is
    set as the first statement that ``at(sql)`` picks begins (or when the release
    ends); ``outcome`` gets the release's ``ok``, or its error."""

    def __init__(self, backend, lock_id, at):
        super().__init__()
        self.backend, self.lock_id, self.at = backend, lock_id, at
        self.reached = threading.Event()
        self.outcome: list[Any] = []

    def run(self):
        try:
            trace_statements(self.backend, lambda sql: self.at(sql) and self.reached.set())
            self.outcome.append(self.backend.release(self.lock_id).ok)
        except Exception as exc:
            self.outcome.append(exc)
        finally:
            self.reached.set()

    def wait_if_started(self):
        if self.ident is not None:
            self.join(10)


def claims_its_grant(backend, ticket):
    """The waiter of ``ticket`` claims the key a release granted it, with the next
    fence, and releases it."""
    claimed = backend.acquire("account:1", 60_000, ticket=ticket)
    assert (claimed.ok, claimed.fence) == (True, "000000000000002")
    assert backend.release(claimed.lock_id).ok is True


def test_a_release_that_grants_waits_for_the_queue_file_holding_nothing_writers_need(lite, writer):
    # The release and the grant take the queue file's write lock, then the database's,
    # neither waiting while it holds the other: while the queue file's is taken
    # elsewhere, the release waits holding nothing, and a holder of another key
    # writes meanwhile.
    held = lite.acquire("account:1", 60_000)
    ticket = WaitTicket(WaitTicket.new().id, patience_ms=60_000)
    assert lite.acquire("account:1", 60_000, ticket=ticket).queue_position == 0
    name = connections["default"].settings_dict["NAME"]
    queue = sqlite3.connect(queue_file(name), isolation_level=None, check_same_thread=False)
    # At the release's transaction's start (BEGIN IMMEDIATE: how it began before).
    starts = ("BEGIN IMMEDIATE", "DELETE FROM syncguard_queue.syncguard_waiters WHERE 0")
    releasing = Releasing(lite, held.lock_id, lambda sql: sql in starts)
    released = releasing.outcome
    try:
        queue.execute("BEGIN")
        queue.execute("DELETE FROM syncguard_waiters WHERE 0")  # another process's queue write
        releasing.start()
        assert releasing.reached.wait(10)
        writer.execute("BEGIN")
        writer.execute("SELECT count(*) FROM syncguard_locks").fetchall()
        take_key(writer, "account:2")  # a write after a read: it would fail at once
        writer.execute("COMMIT")
        assert (releasing.is_alive(), released) == (True, [])  # still waiting meanwhile
    finally:
        if queue.in_transaction:
            queue.execute("ROLLBACK")
        queue.close()
        releasing.wait_if_started()
    assert released == [True]
    claims_its_grant(lite, ticket)


def test_a_release_that_grants_waits_for_the_database_holding_nothing_waiters_need(lite, writer):
    # The mirror case: while another connection holds the database's write lock, the
    # release that grants keeps trying without holding the queue file's lock, and a
    # waiter queues meanwhile (queueing needs only the queue file's lock).
    held = lite.acquire("account:1", 60_000)
    first = WaitTicket(WaitTicket.new().id, patience_ms=60_000)
    second = WaitTicket(WaitTicket.new().id, patience_ms=60_000)
    assert lite.acquire("account:1", 60_000, ticket=first).queue_position == 0
    # At the release's write to the database, which meets the other writer's lock.
    releasing = Releasing(
        lite, held.lock_id, lambda sql: sql.startswith("DELETE FROM syncguard_locks WHERE lock_id")
    )
    outcome = releasing.outcome
    try:
        writer.execute("BEGIN IMMEDIATE")  # another process writes, for as long as it likes
        releasing.start()
        assert releasing.reached.wait(10)
        queued = lite.acquire("account:1", 60_000, ticket=second)
        assert queued.queue_position == 1  # behind the first waiter, at once
        assert (releasing.is_alive(), outcome) == (True, [])  # the release still tries
    finally:
        if writer.in_transaction:
            writer.execute("ROLLBACK")
        releasing.wait_if_started()
    assert outcome == [True]
    claims_its_grant(lite, first)
