"""Celery tasks of the test app, run by a real worker (``tests/test_celery_tasks.py``).

Each is ``@shared_task(...)`` over ``@locked(...)``: Celery's task wraps the locked
function, so every run of the task (a retry, a redelivery) takes a fresh lease. They
lock on the Redis backend (alias ``tasks``) and write to the PostgreSQL test database,
where the test reads what happened: :class:`~tests.testapp.models.TaskEvent` rows,
written by the tasks and, in the worker's processes, by receivers of Celery's
``task_prerun`` and of the locks' ``lock_contended`` and ``lock_extended`` signals.

A task that must stay in its locked section until the test says so waits at a
*gate*: a Redis list the test pushes one item to. The item stays (``BLMOVE`` from
the list to itself), so the gate, once open, is open for every run.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import redis
from celery import current_task, shared_task
from celery.signals import task_prerun, worker_process_init
from django.conf import settings
from django.db import IntegrityError, connections

from django_syncguard import (
    AcquisitionTimeout,
    StaleFenceError,
    current_lock,
    fenced_update,
    locked,
    signals,
)
from tests.support.celery_worker import DB_LOCK_ALIAS, LOCK_ALIAS
from tests.testapp.models import ExclusiveMarker, Invoice, Payment, TaskEvent

DB = "postgres"
#: How long a run waits at a gate before it fails (the test opens it long before).
GATE_TIMEOUT_S = 60
#: Lock waits of the tasks that wait: long enough for any test's contention.
WAIT = {"timeout_ms": 60_000, "max_retries": 10_000}
#: ``hold_until_gate``'s TTL: short, a test waits for it to run out.
HOLD_TTL_MS = 1500


# ----------------------------------------------------------------- the journal
def record(
    event: str, fence: str | None = None, *, task: Any = None, attempt: int | None = None
) -> None:
    """Append a :class:`TaskEvent` for ``task`` (the running one by default)."""
    task = task or current_task
    request = task.request if task else None
    TaskEvent.objects.using(DB).create(
        task=task.name.rsplit(".", 1)[-1] if task else "",
        task_id=request.id if request else "",
        event=event,
        pid=os.getpid(),
        fence=fence,
        retries=request.retries if request else None,
        redelivered=bool((request.delivery_info or {}).get("redelivered")) if request else None,
        attempt=attempt,
    )


def held_fence() -> str:
    """The fence of the lease the running task holds."""
    lease = current_lock()
    assert lease is not None and lease.fence is not None
    return lease.fence


def mark_paid(pk: int, fence: str) -> None:
    """The fenced write: invoice ``pk`` paid by this run, unless a newer fence wrote."""
    invoice = Invoice.objects.using(DB).filter(pk=pk)
    fenced_update(invoice, fence, paid=True, paid_by=run_label())


def run_label() -> str:
    """Which run this is: a redelivered message runs again under the same task id."""
    return f"{current_task.request.id}/{os.getpid()}"


@task_prerun.connect
def _on_prerun(task: Any, **kwargs: Any) -> None:
    """Each delivery of a message the worker starts to run (before any lock)."""
    record("delivered", task=task)


def _on_contended(alias: str, attempt: int, **kwargs: Any) -> None:
    if alias in (LOCK_ALIAS, DB_LOCK_ALIAS):
        record("contended", attempt=attempt)


def _on_extended(alias: str, fence: str | None, **kwargs: Any) -> None:
    # Sent by the auto-extend thread, which runs no task: the pid says whose lease.
    if alias == LOCK_ALIAS:
        record("extended", fence)
        connections[DB].close()  # the thread ends with the lease; so does its connection


@worker_process_init.connect
def _journal_lock_signals(**kwargs: Any) -> None:
    """Only in the worker's child processes: the test process's locks stay unjournaled."""
    signals.lock_contended.connect(_on_contended, dispatch_uid="tasks-journal-contended")
    signals.lock_extended.connect(_on_extended, dispatch_uid="tasks-journal-extended")


# ---------------------------------------------------------------------- gates
@functools.cache
def gate_client() -> redis.Redis:
    return redis.Redis.from_url(settings.SYNCGUARD_BACKENDS[LOCK_ALIAS]["LOCATION"])


def wait_at_gate(gate: str) -> None:
    """Until the test opens ``gate``; fails the run if it never does."""
    if gate_client().blmove(gate, gate, GATE_TIMEOUT_S, "LEFT", "RIGHT") is None:
        raise TimeoutError(f"gate {gate} was not opened within {GATE_TIMEOUT_S} s")


# ---------------------------------------------------------------------- tasks
@shared_task
@locked("invoice:<pk>", using=LOCK_ALIAS, **WAIT)
def pay_invoice(pk: int) -> str:
    """Pay invoice ``pk`` unless it is paid: one ``Payment`` and a fenced write."""
    fence = held_fence()
    record("held", fence)
    invoice = Invoice.objects.using(DB).get(pk=pk)
    if invoice.paid:
        return "already paid"
    Payment.objects.using(DB).create(invoice=invoice, task_id=current_task.request.id)
    mark_paid(pk, fence)
    return "paid"


@shared_task
@locked("held:<key>", using=LOCK_ALIAS, ttl_ms=HOLD_TTL_MS, auto_extend=True, **WAIT)
def hold_until_gate(key: str, gate: str) -> str:
    """Hold ``key`` (its lease renewed while the run lives) until ``gate`` opens."""
    record("held", held_fence())
    wait_at_gate(gate)
    return "done"


@shared_task(acks_late=True)
@locked("exclusive:<key>", using=LOCK_ALIAS, ttl_ms=1500, auto_extend=True, **WAIT)
def exclusive_section(key: str, gate: str) -> str:
    """Acknowledged late, so the broker may deliver it again while it runs: enter the
    section (a marker only one run can set), wait at ``gate``, leave it."""
    fence = held_fence()
    try:
        ExclusiveMarker.objects.using(DB).create(key=key, holder=run_label())
    except IntegrityError:
        record("overlap", fence)
        raise
    record("entered", fence)
    wait_at_gate(gate)
    record("left", fence)
    ExclusiveMarker.objects.using(DB).filter(key=key, holder=run_label()).delete()
    return "left"


@shared_task(acks_late=True)
@locked("stale:<pk>", using=LOCK_ALIAS, ttl_ms=1000, **WAIT)
def pay_after_stall(pk: int, gate: str) -> str:
    """Acknowledged late, no auto-extend: the first run stalls at ``gate`` (its lease
    runs out meanwhile); a run after it does not stall. Then a fenced write."""
    fence = held_fence()
    record("held", fence)
    if gate_client().set(f"{gate}:stalled", run_label(), nx=True):
        wait_at_gate(gate)
    try:
        mark_paid(pk, fence)
    except StaleFenceError:
        record("refused", fence)
        raise
    record("wrote", fence)
    return "paid"


#: The lock options of the README's first task example (section 4, Tasks): a lease
#: renewed while the run lives, short enough that a killed run's key is free again
#: within 11 s (ttl_ms plus the 1 s takeover tolerance), and a wait well past that.
README_TASK_LOCK: dict[str, Any] = {"ttl_ms": 10_000, "auto_extend": True, "timeout_ms": 30_000}
#: The example's options before issue 23: a 30 s lease and the default 5 s wait
#: (``syncguard.W005`` warns about them), for the comparison test.
OLD_README_TASK_LOCK: dict[str, Any] = {"ttl_ms": 30_000, "auto_extend": True}


def pay_share_once(pk: int, gate: str) -> str:
    """The body of the README's first task example, with one payment per task (so
    that every task's own work shows): pay this task's share of invoice ``pk`` unless
    a run of it already did (a redelivered run finds it done), then the fenced write.
    The first run to hold the key stalls at ``gate`` before paying: the test kills it
    there."""
    fence = held_fence()
    record("held", fence)
    task_id = current_task.request.id
    if Payment.objects.using(DB).filter(task_id=task_id).exists():
        return "already paid"
    if gate_client().set(f"{gate}:stalled", run_label(), nx=True):
        wait_at_gate(gate)
    Payment.objects.using(DB).create(invoice_id=pk, task_id=task_id)
    mark_paid(pk, fence)
    return "paid"


@shared_task(acks_late=True, reject_on_worker_lost=True)
@locked("invoice:<pk>", using=LOCK_ALIAS, **README_TASK_LOCK)
def pay_share(pk: int, gate: str) -> str:
    """The README's first task example: see :func:`pay_share_once`."""
    return pay_share_once(pk, gate)


@shared_task(acks_late=True, reject_on_worker_lost=True)
@locked("invoice:<pk>", using=LOCK_ALIAS, **OLD_README_TASK_LOCK)
def pay_share_old_options(pk: int, gate: str) -> str:
    """:func:`pay_share` with the example's lock options before issue 23."""
    return pay_share_once(pk, gate)


@shared_task
@locked("skip:<key>", using=LOCK_ALIAS, on_contended="skip")
def skip_when_held(key: str) -> str:
    """Returns ``None`` without running when ``key`` is held."""
    record("held", held_fence())
    return "ran"


@shared_task
@locked("forked:<key>", using=DB_LOCK_ALIAS, **WAIT)
def count_in_database_lock(key: str) -> str:
    """Locks in the PostgreSQL test database, from a pool child forked after the main
    process locked there: journal the section, and add one to a counter by reading it
    then writing it (an overlap would lose an update). Returns the fence."""
    fence = held_fence()
    record("entered", fence)
    counter = f"sgcelery-count:{key}"
    gate_client().set(counter, int(gate_client().get(counter) or 0) + 1)
    record("left", fence)
    return fence


RAISE_AND_RETRY = {
    "bind": True,
    "autoretry_for": (AcquisitionTimeout,),
    "retry_backoff": False,
    "default_retry_delay": 0.1,  # seconds
}


@shared_task(**RAISE_AND_RETRY, max_retries=50)
@locked("retry:<key>", using=LOCK_ALIAS, on_contended="raise")
def retry_until_free(self: Any, key: str) -> int:
    """Re-queued by Celery while ``key`` is held; returns the retries it took."""
    record("held", held_fence())
    return int(self.request.retries)


@shared_task(**RAISE_AND_RETRY, max_retries=2)
@locked("retry:<key>", using=LOCK_ALIAS, on_contended="raise")
def retry_twice(self: Any, key: str) -> int:
    """As ``retry_until_free``, but gives up after two retries."""
    record("held", held_fence())
    return int(self.request.retries)
