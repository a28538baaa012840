"""The database backend on SQLite inside the caller's transactions: SQLite has one
writer per file, and the lock backend writes through its own connection."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest
from django.db import connections, transaction

from django_syncguard import generate_lock_id, locked
from django_syncguard.backends.database import DatabaseBackend
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
        if sql == "BEGIN IMMEDIATE":
            trying.set()
        elif trying.is_set():
            # The caller's next statement (its read of the key) runs after the other
            # writer's commit: otherwise that commit could land between the read and
            # the next BEGIN IMMEDIATE, and the caller would rightly take the write
            # lock, find the key held and roll back (seen once on a loaded machine).
            assert committed.wait(10)

    def take_it_once_the_caller_waits():
        assert trying.wait(10)
        take_key(writer, "account:1")
        writer.execute("COMMIT")
        committed.set()

    private = lite.connection()
    private.ensure_connection()
    private.connection.set_trace_callback(trace)
    writer.execute("BEGIN IMMEDIATE")
    other = threading.Thread(target=take_it_once_the_caller_waits)
    other.start()
    try:
        assert lite.acquire("account:1", 1_000).ok is False
    finally:
        other.join()
    assert "BEGIN IMMEDIATE" in statements  # it did wait for the write lock ...
    assert not {"COMMIT", "ROLLBACK"} & set(statements)  # ... and never had it
