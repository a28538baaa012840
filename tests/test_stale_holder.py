"""A stale holder, end to end, on every backend: its lock and its writes are refused.

Holder A takes a key with a short TTL and "pauses" (a GC pause, a stalled network)
past its TTL and the 1000 ms tolerance: ``harness.advance`` ages the lock, no sleep.
Holder B then takes the key with the next fence and writes rows through
``fenced_update``. When A wakes up, its fenced writes raise ``StaleFenceError`` and
leave B's values, and its release and extend report the lock gone. The fenced rows
(``tests.testapp``: ``Account`` with the 15-digit fence string, ``Ledger`` with an
integer fence) live in the harness's own database on PostgreSQL, in SQLite otherwise.
"""

from __future__ import annotations

import pytest
from django.db.models import QuerySet

from django_syncguard import (
    AcquireResult,
    ExtendResult,
    LockInfo,
    ReleaseResult,
    StaleFenceError,
    fenced_update,
    hash_key,
    owners,
)
from tests.support.harness import HARNESSES, Harness
from tests.testapp.models import Account, Ledger

KEY = "account:alice"
TTL_A = 30_000  # A's lease: its lock-id index entry on Redis outlives the test (real ms)
TTL_B = 60_000
TOLERANCE = 1_000  # a lock is live until expires_at_ms + 1000 on every backend
MARGIN = 500
F1, F2, F3 = "000000000000001", "000000000000002", "000000000000003"

#: The database that holds the fenced rows, per harness.
ROWS_DATABASE = {
    name: "postgres" if name in ("postgres", "pgbouncer") else "default" for name in HARNESSES
}
#: The databases each harness's test touches: its rows' and its locks'.
DATABASES = {name: [ROWS_DATABASE[name]] for name in HARNESSES}
DATABASES["pgbouncer"] = ["postgres", "pgbouncer"]


def harness_params() -> list[object]:
    # Each harness needs its rows' database: conftest.py only opens the lock database
    # of the database harnesses, and none for memory, Redis and Firestore.
    return [
        pytest.param(
            name,
            id=name,
            marks=pytest.mark.django_db(transaction=True, databases=DATABASES[name]),
        )
        for name in sorted(HARNESSES)
    ]


pytestmark = pytest.mark.parametrize("harness", harness_params(), indirect=True)


def rows(harness: Harness) -> tuple[QuerySet[Account], QuerySet[Ledger]]:
    """One Account and one Ledger row, never written by a holder yet."""
    database = ROWS_DATABASE[harness.name]
    account = Account.objects.using(database).create(name="alice", balance=100, fence=None)
    ledger = Ledger.objects.using(database).create(total=0, version=None)
    return (
        Account.objects.using(database).filter(pk=account.pk),
        Ledger.objects.using(database).filter(pk=ledger.pk),
    )


def state(accounts: QuerySet[Account], ledgers: QuerySet[Ledger]) -> tuple[object, ...]:
    account, ledger = accounts.get(), ledgers.get()
    return (account.balance, account.fence, ledger.total, ledger.version)


def pause_past_ttl(harness: Harness, ttl_ms: int) -> None:
    """The holder stalls past its TTL and the tolerance: its lock is no longer live."""
    harness.advance(ttl_ms + TOLERANCE + MARGIN)


def test_stale_holder_cannot_write_after_a_newer_holder(harness: Harness) -> None:
    backend = harness.backend
    accounts, ledgers = rows(harness)

    a = backend.acquire(KEY, TTL_A)
    assert (a.ok, a.fence) == (True, F1)
    # A writes once inside its lease: the rows carry fence 1.
    assert fenced_update(accounts, a.fence, balance=110) == 1
    assert fenced_update(ledgers, a.fence, field="version", total=10) == 1
    assert state(accounts, ledgers) == (110, F1, 10, 1)

    pause_past_ttl(harness, TTL_A)
    assert backend.is_locked(KEY) is False
    assert backend.lookup(key=KEY) is None
    assert backend.lookup(lock_id=a.lock_id) is None

    b = backend.acquire(KEY, TTL_B)
    assert (b.ok, b.fence) == (True, F2)
    assert b.fence > a.fence
    assert fenced_update(accounts, b.fence, balance=150) == 1
    assert fenced_update(ledgers, b.fence, field="version", total=50) == 1
    assert state(accounts, ledgers) == (150, F2, 50, 2)

    # A wakes up and carries on with its old fence: every write is refused.
    with pytest.raises(StaleFenceError) as caught:
        fenced_update(accounts, a.fence, balance=0)
    assert caught.value.fence == F1
    assert str(caught.value) == f"Stale fence {F1}: a newer holder has already written this row."
    with pytest.raises(StaleFenceError) as caught_ledger:
        fenced_update(ledgers, a.fence, field="version", total=0)
    assert caught_ledger.value.fence == F1
    assert state(accounts, ledgers) == (150, F2, 50, 2)

    # Nor can A release or extend: the key's lock is B's now, under another lock id.
    released = backend.release(a.lock_id)
    assert (released, released.reason, released.to_dict()) == (
        ReleaseResult(ok=False),
        "not-found",
        {"ok": False},
    )
    extended = backend.extend(a.lock_id, TTL_A)
    assert (extended, extended.reason, extended.to_dict()) == (
        ExtendResult(ok=False),
        "not-found",
        {"ok": False},
    )

    # B's lock is untouched by all that.
    info = backend.lookup(key=KEY)
    assert info == LockInfo(
        key_hash=hash_key(KEY),
        lock_id_hash=hash_key(b.lock_id),
        expires_at_ms=b.expires_at_ms,
        acquired_at_ms=b.expires_at_ms - TTL_B,
        fence=F2,
        owner=owners.owner_label(),  # this thread took it, outside any @locked function
    )
    assert backend.lookup(lock_id=b.lock_id) == info
    assert backend.acquire(KEY, TTL_A) == AcquireResult(ok=False, reason="locked")
    assert fenced_update(accounts, b.fence, balance=175) == 1  # B writes again: same fence
    assert state(accounts, ledgers) == (175, F2, 50, 2)
    assert backend.release(b.lock_id) == ReleaseResult(ok=True)
    assert backend.is_locked(KEY) is False

    # A third holder overrides B's fence in turn; A is still refused.
    c = backend.acquire(KEY, TTL_A)
    assert (c.ok, c.fence) == (True, F3)
    assert fenced_update(accounts, c.fence, balance=200) == 1
    with pytest.raises(StaleFenceError):
        fenced_update(accounts, a.fence, balance=0)
    with pytest.raises(StaleFenceError):
        fenced_update(accounts, b.fence, balance=0)
    assert state(accounts, ledgers) == (200, F3, 50, 2)
    assert backend.release(c.lock_id) == ReleaseResult(ok=True)


def test_stale_holder_without_successor_learns_its_lock_expired(harness: Harness) -> None:
    """Nobody took the key meanwhile: release and extend say "expired", the lock is not
    revived, and A's fenced write still applies (no newer fence exists to refuse it)."""
    backend = harness.backend
    accounts, ledgers = rows(harness)

    a = backend.acquire(KEY, TTL_A)
    assert (a.ok, a.fence) == (True, F1)
    pause_past_ttl(harness, TTL_A)

    extended = backend.extend(a.lock_id, TTL_A)
    assert (extended, extended.reason) == (ExtendResult(ok=False), "expired")
    assert backend.is_locked(KEY) is False
    released = backend.release(a.lock_id)
    assert (released, released.reason) == (ReleaseResult(ok=False), "expired")

    assert fenced_update(accounts, a.fence, balance=120) == 1
    assert fenced_update(ledgers, a.fence, field="version", total=20) == 1
    assert state(accounts, ledgers) == (120, F1, 20, 1)

    # The next holder gets fence 2 and from then on A's writes are refused.
    b = backend.acquire(KEY, TTL_B)
    assert (b.ok, b.fence) == (True, F2)
    assert fenced_update(accounts, b.fence, balance=130) == 1
    with pytest.raises(StaleFenceError):
        fenced_update(accounts, a.fence, balance=0)
    assert state(accounts, ledgers) == (130, F2, 20, 1)
    assert backend.release(b.lock_id) == ReleaseResult(ok=True)
