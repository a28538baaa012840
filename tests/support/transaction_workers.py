"""Child processes of test_transactions_concurrency.py (spawned, not forked).

Each child builds Django from the test settings, pointed at the parent's test
databases, with ``SYNCGUARD_BACKENDS["default"]`` set to the lock backend under test,
so ``locked(...)`` there is what a deployed project writes. The data is a row of
``tests.testapp.models.Account`` in the ``data`` database alias. A child reports on a
queue: tuples of its progress, or the exception that stopped it (a dead child would
leave the parent waiting).
"""

from __future__ import annotations

import os
import time
from typing import Any

from tests.support.workers import setup_django

#: Longer than any test: a release that never happens keeps the lock for the test.
HOLD_TTL_MS = 60_000
#: How long a child waits for the parent before giving up.
PARENT_WAIT_S = 60
#: Retry options of a waiting holder: patient, and not exponentially slower each time.
PATIENT = {
    "ttl_ms": HOLD_TTL_MS,
    "max_retries": 1_000_000,
    "retry_delay_ms": 10,
    "backoff": "fixed",
    "timeout_ms": 120_000,
}
#: The same, trying again every millisecond: a lock released early is soon taken.
EAGER = {**PATIENT, "retry_delay_ms": 1}
#: How many times a client sends one deposit that keeps answering 500.
HTTP_ATTEMPTS = 10


class Rollback(Exception):
    """Raised inside the transaction to roll it back."""


def setup(databases: dict[str, Any], lock_backend: dict[str, Any], environ: dict[str, str]) -> None:
    """Django on the parent's test databases, locks in ``lock_backend``."""
    os.environ.update(environ)
    setup_django(databases)
    from django.conf import settings

    settings.SYNCGUARD_BACKENDS = {"default": lock_backend}


def now_ns() -> int:
    """CLOCK_MONOTONIC: one clock for every process of this machine (Linux)."""
    return time.monotonic_ns()


def write_then_wait(
    databases, lock_backend, environ, data, key, pk, until_commit, ending, go, leave, reports
):
    """Process A: in ``atomic()``, take the lock, write ``balance + 1``, leave the
    locked block, report ``("left", fence, ns spent leaving it)``, then wait for
    ``go`` before the transaction ends by ``ending`` ("commit" or "rollback"), and
    report ``("ended", ending)``. A failed release is reported first, as
    ``("release failed", error class name, message)``. The process then stays until
    ``leave`` is set: its exit would release what it still holds (``weakref.finalize``
    runs at exit), and must not stand in for a release that did not happen."""
    try:
        setup(databases, lock_backend, environ)
        from django.db import transaction

        from django_syncguard import locked
        from tests.testapp.models import Account

        accounts = Account.objects.using(data)

        def release_failed(exc: BaseException, context: dict[str, str]) -> None:
            reports.put(("release failed", type(exc).__name__, str(exc)))

        try:
            with transaction.atomic(using=data):
                with locked(
                    key, until_commit=until_commit, on_release_error=release_failed, **PATIENT
                ) as lease:
                    seen = accounts.get(pk=pk).balance
                    accounts.filter(pk=pk).update(balance=seen + 1)
                    leaving = now_ns()
                reports.put(("left", lease.fence, now_ns() - leaving))
                if not go.wait(PARENT_WAIT_S):
                    raise TimeoutError("the parent never let the transaction end")
                if ending == "rollback":
                    raise Rollback
        except Rollback:
            pass
        reports.put(("ended", ending))
        if not leave.wait(PARENT_WAIT_S):
            raise TimeoutError("the parent never let the process end")
    except Exception as exc:
        reports.put(exc)


def read_under_lock(databases, lock_backend, environ, data, key, pk, reports):
    """Process B: a ``@locked`` function on the same key reads the row; report
    ``("trying", t)`` just before the call, then ``("read", balance, fence, t)`` with
    the time the lock was granted."""
    try:
        setup(databases, lock_backend, environ)
        from django_syncguard import current_lock, locked
        from tests.testapp.models import Account

        @locked(key, **PATIENT)
        def read_balance() -> tuple[int, str, int]:
            granted = now_ns()
            return Account.objects.using(data).get(pk=pk).balance, current_lock().fence, granted

        reports.put(("trying", now_ns()))
        balance, fence, granted = read_balance()
        reports.put(("read", balance, fence, granted))
    except Exception as exc:
        reports.put(exc)


def increment_in_transactions(
    databases, lock_backend, environ, data, key, pk, iterations, barrier, results
):
    """``iterations`` times: ``with atomic(): with locked(key): read; write`` the
    balance plus one; the lock is taken before the transaction's first query. The
    transaction goes on after the locked block (it writes a ledger line), so a lock
    released when the block ends would let the next holder read the balance before
    this commit. Reports ``[(balance seen, fence), ...]``."""
    try:
        setup(databases, lock_backend, environ)
        from django.db import transaction

        from django_syncguard import current_lock, locked
        from tests.testapp.models import Account, Ledger

        accounts = Account.objects.using(data)
        records: list[tuple[int, str]] = []
        barrier.wait()
        for _ in range(iterations):
            with transaction.atomic(using=data):
                with locked(key, **EAGER):
                    seen = accounts.get(pk=pk).balance
                    accounts.filter(pk=pk).update(balance=seen + 1)
                    fence = current_lock().fence
                Ledger.objects.using(data).create(total=seen + 1, version=int(fence))
            records.append((seen, fence))
    except Exception as exc:
        results.put(exc)
        return
    results.put(records)


def deposit_over_http(url, iterations, barrier, results):
    """``iterations`` deposits, each a POST to ``url`` (the deposit view on a live
    server). A deposit answered 500 (its request failed, and its transaction was
    rolled back) is sent again, up to ``HTTP_ATTEMPTS`` times; the test checks what
    failed. Reports ``(replies, failed)``: each reply's ``(seen, fence, in_atomic)``,
    and how many requests answered 500."""
    import json
    import urllib.error
    import urllib.request

    replies: list[tuple[int, str, bool]] = []
    failed = 0
    barrier.wait()
    try:
        for _ in range(iterations):
            for _attempt in range(HTTP_ATTEMPTS):
                request = urllib.request.Request(url, method="POST", data=b"")
                try:
                    with urllib.request.urlopen(request, timeout=PARENT_WAIT_S) as response:
                        body = json.loads(response.read())
                    break
                except urllib.error.HTTPError as exc:
                    if exc.code != 500:
                        body = exc.read()[:2000]
                        raise AssertionError(f"{url}: HTTP {exc.code}: {body!r}") from None
                    failed += 1
            else:
                raise AssertionError(f"{url}: HTTP 500 {HTTP_ATTEMPTS} times in a row")
            replies.append((body["seen"], body["fence"], body["in_atomic"]))
    except Exception as exc:
        results.put(exc)
        return
    results.put((replies, failed))


def first_lock_of_the_process_after_a_write(databases, reports):
    """A process whose settings keep its locks in its SQLite database, as a project's
    would, and whose first lock call (the one that builds the backend) comes inside a
    transaction that has written. Reports whether the backend was built before that
    call, and what the call raised: (type name, message, type name of its cause)."""
    database_backend = "django_syncguard.backends.database.DatabaseBackend"
    options = {"OPERATION_TIMEOUT_MS": 5_000}
    setup_django(databases, {"default": {"BACKEND": database_backend, "OPTIONS": options}})
    from django.db import transaction

    from django_syncguard import locks
    from tests.testapp.models import Account

    built_before, outcome = None, None
    try:
        with transaction.atomic():
            Account.objects.create(name="first")
            built_before = hasattr(locks._connections, "default")
            locks["default"].acquire("invoice:9", 1_000)
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc), type(exc.__cause__).__name__)
    reports.put((built_before, outcome))
