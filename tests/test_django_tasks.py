"""Django's task framework: ``@task()`` over ``@locked(...)``.

On Django 6.x the framework is ``django.tasks``; on Django 5.2 it is the
``django_tasks`` backport, same API (``tests/testapp/task_framework.py`` picks one).
Two ways a task runs here:

- the immediate backend (``TASKS["default"]``) runs it in the test's thread as it is
  enqueued, with the in-process memory lock backend;
- django-tasks-db's workers: separate ``db_worker`` processes started by the
  ``task_workers`` fixture, taking the tasks queued on ``TASKS["database"]`` from the
  session's PostgreSQL and locking on it. Their output is shown when a test fails.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connections
from django.test import override_settings

from django_syncguard import InvalidArgument, locked, locks
from django_syncguard.backends.database import DatabaseBackend
from django_syncguard.backends.memory import MemoryBackend
from django_syncguard.keys import display_hash
from django_syncguard.signals import lock_contended
from tests.support.faults import wait_until
from tests.support.servers import start_or_skip
from tests.support.task_workers import TaskWorkers
from tests.testapp.models import Account, Ledger
from tests.testapp.task_framework import (
    AMOUNT,
    TaskResult,
    TaskResultStatus,
    charge_or_refuse,
    hold_invoice,
    pay_invoice,
    refresh_invoice,
)

MEMORY = "django_syncguard.backends.memory.MemoryBackend"
TIMEOUT = "django_syncguard.errors.AcquisitionTimeout"
FIRST_FENCE = "000000000000001"


@pytest.fixture
def memory_locks(request: pytest.FixtureRequest) -> Iterator[MemoryBackend]:
    """A memory lock backend of this test alone (fences start at 1)."""
    config = {"BACKEND": MEMORY, "LOCATION": f"django-tasks:{request.node.name}"}
    with override_settings(SYNCGUARD_BACKENDS={"default": config}):
        backend = locks["default"]
        backend.reset()
        yield backend


@pytest.fixture
def contended() -> Iterator[dict[str, threading.Event]]:
    """An event per key hash, set when a helper finds that key locked (``lock_contended``)."""
    events: dict[str, threading.Event] = {}

    def record(*, key_hash: str, **kwargs: Any) -> None:
        events.setdefault(key_hash, threading.Event()).set()

    lock_contended.connect(record, weak=False)
    try:
        yield events
    finally:
        lock_contended.disconnect(record)


def contention_on(events: dict[str, threading.Event], key: str) -> threading.Event:
    """The event of ``key`` in the ``contended`` fixture's events."""
    return events.setdefault(display_hash(key), threading.Event())


def failure_of(result: TaskResult) -> str:
    """The exception class path of a failed task (its only error)."""
    assert result.status == TaskResultStatus.FAILED, result.status
    [error] = result.errors
    return error.exception_class_path


# -- the immediate backend ----------------------------------------------------------


def test_an_enqueued_task_runs_under_its_lock(memory_locks) -> None:
    result = hold_invoice.enqueue(7)

    assert result.status == TaskResultStatus.SUCCESSFUL, result.errors
    stored = {"key": "invoice:7", "fence": FIRST_FENCE, "stored_fence": FIRST_FENCE}
    assert result.return_value == stored
    assert not memory_locks.is_locked("invoice:7")  # released when the task ended


def test_skip_while_the_key_is_held_returns_none_without_running(memory_locks, contended) -> None:
    held = memory_locks.acquire("invoice:8", 60_000)

    result = refresh_invoice.enqueue(8)

    assert result.status == TaskResultStatus.SUCCESSFUL, result.errors
    assert result.return_value is None  # the task's body returns a dict
    assert contention_on(contended, "invoice:8").is_set()
    assert memory_locks.lookup(key="invoice:8").fence == held.fence  # still the test's


def test_raise_while_the_key_is_held_fails_the_task_with_acquisition_timeout(
    memory_locks,
) -> None:
    held = memory_locks.acquire("invoice:9", 60_000)

    result = charge_or_refuse.enqueue(9)

    assert failure_of(result) == TIMEOUT
    with pytest.raises(ValueError, match="Task failed"):
        _ = result.return_value
    memory_locks.release(held.lock_id)
    assert charge_or_refuse.enqueue(9).return_value["fence"] == "000000000000002"


def test_wait_runs_the_task_once_the_holder_releases(memory_locks, contended) -> None:
    held = memory_locks.acquire("invoice:10", 60_000)
    results: list[TaskResult] = []
    runner = threading.Thread(target=lambda: results.append(hold_invoice.enqueue(10)))
    runner.start()

    assert contention_on(contended, "invoice:10").wait(30)
    assert results == []  # still waiting: the test holds the key
    memory_locks.release(held.lock_id)
    runner.join(30)

    [result] = results
    assert result.status == TaskResultStatus.SUCCESSFUL, result.errors
    assert result.return_value == {
        "key": "invoice:10",
        "fence": "000000000000002",
        "stored_fence": "000000000000002",
    }


def test_locked_over_a_task_object_is_refused() -> None:
    """The order that cannot work (the lock would be taken at enqueue time, and the
    task framework needs its ``Task``): refused when the decorator is applied."""
    with pytest.raises(InvalidArgument) as raised:
        locked("invoice:<pk>")(hold_invoice)

    assert str(raised.value) == (
        "locked('invoice:<pk>') is above a Django task decorator; put it below, so that "
        "the worker takes the lock each time it runs the task:\n"
        "    @task(...)\n"
        "    @locked('invoice:<pk>')\n"
        "    def your_task(...): ..."
    )


# -- real worker processes ----------------------------------------------------------

WORKERS_DB = pytest.mark.django_db(transaction=True, databases=["postgres"])


def errors_of(results: list[TaskResult]) -> list[str]:
    """The exception (last lines of the traceback) of each task that did not succeed."""
    failed = [r for r in results if r.status != TaskResultStatus.SUCCESSFUL]
    return [" ".join(r.errors[0].traceback.splitlines()[-2:]) for r in failed]


@pytest.fixture
def task_workers() -> Iterator[TaskWorkers]:
    """Two ``db_worker`` processes on the test database (a failed test shows their
    logs: tests/conftest.py)."""
    settings_dict = connections["postgres"].settings_dict
    database = {name: settings_dict[name] for name in ("ENGINE", "NAME", "USER", "HOST", "PORT")}
    workers = TaskWorkers(count=2, database=database)
    start_or_skip(workers, "django-tasks-db workers")
    try:
        yield workers
    finally:
        workers.destroy()


def refreshed_until(result: TaskResult, condition: Callable[[TaskResult], bool]) -> TaskResult:
    """``result`` once ``condition`` holds for it (polling the queue's table; a failed
    test shows the workers' logs)."""

    def holds() -> bool:
        result.refresh()
        return condition(result)

    if not condition(result):
        wait_until(holds, 120, f"task {result.id} got there")
    return result


def finished(result: TaskResult) -> TaskResult:
    """``result`` once a worker has finished its task."""
    return refreshed_until(result, lambda r: r.is_finished)


@pytest.fixture
def pg_locks() -> Iterator[DatabaseBackend]:
    """The workers' lock backend (the database backend on ``postgres``), for the test;
    closed after it (its own connections would keep the test database from being dropped)."""
    backend = DatabaseBackend("holder", {"OPTIONS": {"DATABASE": "postgres"}})
    try:
        yield backend
    finally:
        backend.close()


@pytest.mark.slow
@WORKERS_DB
def test_worker_runs_never_overlap_and_pay_once_in_fence_order(task_workers, pg_locks) -> None:
    Account.objects.using("postgres").create(name="invoice:21")
    queued = [pay_invoice.enqueue(21) for _ in range(6)]

    results = [finished(result) for result in queued]

    assert errors_of(results) == [], task_workers.log_tail()
    # Hold order: the ledger rows, appended under the lock, numbered as written.
    held = list(Ledger.objects.using("postgres").order_by("pk").values_list("version", flat=True))
    assert held == list(range(held[0], held[0] + 6))  # strictly increasing, one per run
    runs = sorted((r.return_value for r in results), key=lambda run: run["fence"])
    assert [int(run["fence"]) for run in runs] == held
    assert [run["paid"] for run in runs] == [True, False, False, False, False, False]
    invoice = Account.objects.using("postgres").get(name="invoice:21")
    assert (invoice.balance, invoice.fence) == (AMOUNT, runs[0]["fence"])
    # Both workers ran tasks while the other waited for the lock; no marker was left.
    assert {w for r in results for w in r.worker_ids} == set(task_workers.names)
    assert runs[0]["rival"] is True
    assert not Account.objects.using("postgres").filter(name="running:21").exists()
    assert not pg_locks.is_locked("invoice:21")


@pytest.mark.slow
@WORKERS_DB
def test_worker_skips_refuses_or_waits_while_the_key_is_held(task_workers, pg_locks) -> None:
    held = pg_locks.acquire("invoice:22", 120_000)

    skipped = finished(refresh_invoice.using(backend="database").enqueue(22))
    refused = finished(charge_or_refuse.using(backend="database").enqueue(22))
    waiting = hold_invoice.using(backend="database").enqueue(22)
    refreshed_until(waiting, lambda r: r.status != TaskResultStatus.READY)
    pg_locks.release(held.lock_id)  # a worker runs it: it is waiting for the lock
    waited = finished(waiting)

    assert errors_of([skipped, waited]) == [], task_workers.log_tail()
    assert skipped.return_value is None  # the task's body returns a dict
    assert failure_of(refused) == TIMEOUT
    fence = f"{int(held.fence) + 1:015d}"  # the next hold of the key after the test's
    assert waited.return_value == {"key": "invoice:22", "fence": fence, "stored_fence": fence}
