"""``until_commit`` across OS processes, on every lock backend that other processes
share: the database backend on PostgreSQL and on SQLite, Redis and Firestore.

The data is always a row of a real database table (``Account``): on PostgreSQL, or,
with the locks on SQLite, in that same SQLite file, as the shipped default keeps them.
Process A writes the row inside ``transaction.atomic()`` under the lock, leaves the
locked block and then waits, with its transaction open, for an event that the test
sets; process B wants the same lock to read the row. Nothing is ordered by sleeping:
the test waits on queues with bounded ``get(timeout=...)``, and the times the children
report come from CLOCK_MONOTONIC, which every process of this machine shares.

The single-process behaviour is in test_transactions.py.
"""

from __future__ import annotations

import copy
import queue
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.core.signals import got_request_exception
from django.db import connections
from django.utils.module_loading import import_string

from django_syncguard import locks
from django_syncguard.backends.database.sqlite import BLOCKED_BY_CALLER
from django_syncguard.handler import DEFAULT_BACKENDS
from tests.support import transaction_workers as tw
from tests.support.harness import FirestoreHarness
from tests.support.processes import Children, run_in_processes
from tests.testapp.models import Account, Ledger

pytestmark = pytest.mark.slow

DATABASE_BACKEND = "django_syncguard.backends.database.DatabaseBackend"
POSTGRES_LOCKS = {"BACKEND": DATABASE_BACKEND, "OPTIONS": {"DATABASE": "postgres"}}
#: How long a child may take to start (spawn, import Django) and report.
REPORT_S = 60
#: How long B must stay without the lock while A's transaction is open: far longer
#: than B's acquire takes once the lock is free.
HELD_S = 1.5
#: How soon after A's transaction ends B must have the lock: far below the TTL
#: (``tw.HOLD_TTL_MS``), which is when a release that never happened would free it.
RIGHT_AFTER_S = 20
PROCESSES = 4
ITERATIONS = 25
HTTP_ITERATIONS = 10


@dataclass
class Case:
    """One lock backend, shared by the processes of a test, and where the data is."""

    name: str
    #: The ``DATABASES`` alias of the ``Account`` row.
    data: str
    #: The ``SYNCGUARD_BACKENDS`` entry each child uses as its "default".
    lock_backend: dict[str, Any]
    #: Environment the children need (the Firestore emulator's address).
    environ: dict[str, str] = field(default_factory=dict)

    @property
    def databases(self) -> dict[str, dict[str, Any]]:
        """The parent's test databases, for the children (``setup_django``)."""
        return {self.data: dict(connections[self.data].settings_dict)}

    def child_args(self, key: str, pk: int) -> tuple[Any, ...]:
        return (self.databases, self.lock_backend, self.environ, self.data, key, pk)

    def observer(self):
        """A backend of this process on the children's lock store."""
        params = dict(self.lock_backend)
        return import_string(params.pop("BACKEND"))("observer", params)


def on(*databases: str) -> pytest.MarkDecorator:
    return pytest.mark.django_db(transaction=True, databases=list(databases))


#: The databases each lock backend's case uses (its servers come from fixtures).
DATABASES_OF = {
    "postgres": "postgres",
    "sqlite": "default",
    "redis": "postgres",
    "firestore": "postgres",
}


def lock_backends(*names: str) -> pytest.MarkDecorator:
    params = [pytest.param(name, marks=on(DATABASES_OF[name])) for name in names]
    return pytest.mark.parametrize("case", params, indirect=True)


every_lock_backend = lock_backends("postgres", "sqlite", "redis", "firestore")


@pytest.fixture
def case(request: pytest.FixtureRequest) -> Case:
    suffix = uuid.uuid4().hex[:12]
    if request.param == "postgres":
        return Case("postgres", "postgres", copy.deepcopy(POSTGRES_LOCKS))
    if request.param == "sqlite":
        # B's acquire waits for SQLite's write lock, which A's open transaction holds
        # for as long as the test keeps it paused: longer than the default 5 s may be.
        options = {"DATABASE": "default", "OPERATION_TIMEOUT_MS": 30_000}
        return Case("sqlite", "default", {"BACKEND": DATABASE_BACKEND, "OPTIONS": options})
    if request.param == "redis":
        url = request.getfixturevalue("redis_server").url
        backend = "django_syncguard.backends.redis.RedisBackend"
        return Case(
            "redis", "postgres", {"BACKEND": backend, "LOCATION": url, "KEY_PREFIX": f"tx{suffix}"}
        )
    host = request.getfixturevalue("firestore_emulator").host
    options = {
        "PROJECT": FirestoreHarness.project,
        "COLLECTION": f"locks_{suffix}",
        "FENCE_COLLECTION": f"fences_{suffix}",
    }
    backend = "django_syncguard.backends.firestore.FirestoreBackend"
    return Case(
        "firestore",
        "postgres",
        {"BACKEND": backend, "OPTIONS": options},
        {"FIRESTORE_EMULATOR_HOST": host},
    )


def account(case: Case, balance: int) -> Account:
    return Account.objects.using(case.data).create(name=f"account-{uuid.uuid4()}", balance=balance)


def balance_of(case: Case, pk: int) -> int:
    return Account.objects.using(case.data).get(pk=pk).balance


def report(reports: Any, timeout_s: float = REPORT_S) -> tuple[Any, ...]:
    """The next report of a child; an exception it reported fails the test here."""
    got = reports.get(timeout=timeout_s)
    if isinstance(got, BaseException):
        raise got
    return got


@dataclass
class A:
    """Process A: ``go`` ends its transaction, ``leave`` its process."""

    go: Any
    leave: Any
    reports: Any
    fence: str = ""
    leaving_ns: int = 0


def start_a(case: Case, children: Children, pk: int, *, until_commit: bool, ending: str) -> A:
    a = A(children.ctx.Event(), children.ctx.Event(), children.ctx.Queue())
    args = (*case.child_args(f"account:{pk}", pk), until_commit, ending, a.go, a.leave, a.reports)
    children.start(tw.write_then_wait, *args)
    return a


def pause_a(case: Case, children: Children, pk: int, *, until_commit=True, ending="commit") -> A:
    """A, paused with its transaction open after leaving the locked block."""
    a = start_a(case, children, pk, until_commit=until_commit, ending=ending)
    left, a.fence, a.leaving_ns = report(a.reports)
    assert left == "left"
    return a


def start_b(case: Case, children: Children, pk: int) -> Any:
    """B, once it reports that it is about to call its ``@locked`` function."""
    reports = children.ctx.Queue()
    children.start(tw.read_under_lock, *case.child_args(f"account:{pk}", pk), reports)
    trying, _ = report(reports)
    assert trying == "trying"
    return reports


def let_a_end(a: A, ending: str) -> int:
    """Set A's event; the time it was set."""
    set_at = tw.now_ns()
    a.go.set()
    assert report(a.reports) == ("ended", ending)
    return set_at


def let_them_exit(a: A, children: Children) -> None:
    """Let A's process end (B's ends by itself), and check how each one ended."""
    a.leave.set()
    children.join()


# ------------------------------------------------------------------- scenarios
@every_lock_backend
def test_the_next_holder_reads_what_the_last_one_committed(case, children):
    pk = account(case, 10).pk
    a = pause_a(case, children, pk)
    b = start_b(case, children, pk)
    with pytest.raises(queue.Empty):  # A's transaction is open: B has no lock
        report(b, timeout_s=HELD_S)
    set_at = let_a_end(a, "commit")
    read, balance, fence, granted = report(b, timeout_s=RIGHT_AFTER_S)
    assert read == "read"
    assert granted > set_at
    assert balance == 11  # A's committed write, exactly
    assert fence > a.fence
    let_them_exit(a, children)


@every_lock_backend
def test_after_a_rollback_the_next_holder_gets_the_lock_and_the_old_value(case, children):
    pk = account(case, 10).pk
    a = pause_a(case, children, pk, ending="rollback")
    b = start_b(case, children, pk)
    with pytest.raises(queue.Empty):
        report(b, timeout_s=HELD_S)
    set_at = let_a_end(a, "rollback")
    read, balance, fence, granted = report(b, timeout_s=RIGHT_AFTER_S)
    assert read == "read"
    assert granted > set_at
    assert balance == 10  # A's write was rolled back
    assert fence > a.fence
    assert balance_of(case, pk) == 10
    let_them_exit(a, children)


@every_lock_backend
def test_increments_in_transactions_that_take_the_lock_inside_lose_none(case):
    pk = account(case, 0).pk
    per_process = run_in_processes(
        tw.increment_in_transactions,
        lambda i: (*case.child_args(f"account:{pk}", pk), ITERATIONS),
        PROCESSES,
    )
    total = PROCESSES * ITERATIONS
    assert balance_of(case, pk) == total  # no lost update
    records = sorted(r for process in per_process for r in process)
    assert [seen for seen, _ in records] == list(range(total))  # each saw the last commit
    fences = [fence for _, fence in records]  # in the order the sections ran
    assert fences == sorted(set(fences))


@lock_backends("postgres", "redis", "firestore")
def test_until_commit_false_lets_the_next_holder_read_the_uncommitted_row(case, children):
    pk = account(case, 10).pk
    a = pause_a(case, children, pk, until_commit=False)
    b = start_b(case, children, pk)
    # Released when the block ended: B gets the lock while A's transaction is open ...
    read, balance, fence, granted = report(b, timeout_s=RIGHT_AFTER_S)
    assert read == "read"
    assert balance == 10  # ... and reads the value A is about to overwrite
    assert fence > a.fence
    set_at = let_a_end(a, "commit")
    assert granted < set_at
    assert balance_of(case, pk) == 11  # a write of B's based on 10 would lose A's
    let_them_exit(a, children)


@lock_backends("sqlite")
def test_until_commit_false_cannot_release_inside_an_sqlite_write(case, children):
    # SQLite has one writer per file: the release, through the lock backend's own
    # connection, would wait for A's transaction, which waits for the release. It fails
    # fast instead (CALLER_TRANSACTION_WAIT_MS, not OPERATION_TIMEOUT_MS) and the lock
    # lives until its TTL.
    pk = account(case, 10).pk
    a = start_a(case, children, pk, until_commit=False, ending="commit")
    failed = report(a.reports)
    assert failed == (
        "release failed",
        "ServiceUnavailable",
        BLOCKED_BY_CALLER.format(database="default"),
    )
    left, _, leaving_ns = report(a.reports)
    assert left == "left"
    assert leaving_ns < 5_000_000_000  # far from the 30 s operation timeout
    let_a_end(a, "commit")
    observer = case.observer()
    try:
        assert observer.is_locked(f"account:{pk}") is True  # until its TTL
    finally:
        observer.close()
    assert balance_of(case, pk) == 11
    let_them_exit(a, children)


# ------------------------------------------------------ through Django's HTTP stack
# The views (tests/testapp/views.py) are decorated with @locked("account:<pk>"); with
# ATOMIC_REQUESTS, Django opens the request's transaction around the decorated view,
# so each lock is released after its request's commit or rollback. Concurrent
# requests come from several processes to the live server, which serves each in a
# thread of its own.
per_site = pytest.mark.parametrize(
    "database",
    [
        pytest.param("default", id="sqlite-as-shipped", marks=on("default")),
        pytest.param("postgres", id="postgres", marks=on("postgres")),
    ],
)


@pytest.fixture
def atomic_requests(database, settings, monkeypatch) -> str:
    """ATOMIC_REQUESTS on ``database``, which holds the views' locks too: on SQLite,
    the shipped default (no SYNCGUARD_BACKENDS: the database backend on "default")."""
    monkeypatch.setitem(connections[database].settings_dict, "ATOMIC_REQUESTS", True)
    if database == "default":
        settings.SYNCGUARD_BACKENDS = copy.deepcopy(DEFAULT_BACKENDS)
    else:
        settings.SYNCGUARD_BACKENDS = {"default": copy.deepcopy(POSTGRES_LOCKS)}
    return database


@pytest.fixture
def failed_requests() -> Iterator[list[BaseException]]:
    """The exception of each request that failed (500), as the handler saw it."""
    failed: list[BaseException] = []

    def receiver(sender, **kwargs):
        failed.append(sys.exc_info()[1])

    got_request_exception.connect(receiver, weak=False)
    yield failed
    got_request_exception.disconnect(receiver)


@per_site
def test_concurrent_requests_under_atomic_requests_each_apply_their_increment(
    atomic_requests, live_server, failed_requests
):
    database = atomic_requests
    pk = Account.objects.using(database).create(name="hot", balance=0).pk
    url = f"{live_server.url}/accounts/{database}/{pk}/deposit/"
    per_process = run_in_processes(
        tw.deposit_over_http, lambda i: (url, HTTP_ITERATIONS), PROCESSES
    )
    total = PROCESSES * HTTP_ITERATIONS
    replies = sorted(reply for process, _ in per_process for reply in process)
    # Each view ran inside its request's transaction ...
    assert all(in_atomic for _, _, in_atomic in replies)
    # ... and saw the commit of the request before it.
    assert [seen for seen, _, _ in replies] == list(range(total))
    fences = [fence for _, fence, _ in replies]  # in the order the views ran
    assert fences == sorted(set(fences))
    assert Account.objects.using(database).get(pk=pk).balance == total
    assert Ledger.objects.using(database).count() == total  # written after each view
    # No request failed. On SQLite one could: SQLite refuses at once a transaction
    # that has read and then writes while another connection holds the write lock,
    # and until decision 58 a request that read the key as free just before another
    # took it held that lock for a moment (0 to 2 of these 40 requests failed).
    assert [repr(exc) for exc in failed_requests] == []
    assert [failed for _, failed in per_process] == [0] * PROCESSES


@per_site
def test_a_rolled_back_request_leaves_the_lock_free_at_once(atomic_requests, client):
    database = atomic_requests
    pk = Account.objects.using(database).create(name="hot", balance=10).pk
    with pytest.raises(RuntimeError, match="payment provider failed"):
        client.post(f"/accounts/{database}/{pk}/deposit-then-fail/")
    assert locks["default"].is_locked(f"account:{pk}") is False
    # The balance view does not retry: it gets the lock at once or fails.
    reply = client.get(f"/accounts/{database}/{pk}/balance/").json()
    assert reply == {"balance": 10, "fence": "000000000000002"}
