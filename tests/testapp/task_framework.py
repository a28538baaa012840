"""Tasks of Django's task framework, each ``@task()`` over ``@locked(...)``.

Django 6.0+ ships the framework as ``django.tasks``; on Django 5.2 the ``django_tasks``
backport (in the ``test`` extra) provides the same API. This module is the one place
that picks between them. The right decorator order: ``@task()`` outermost, so the
task framework stores the locked function and the lock is taken when a worker (or
the immediate backend) runs the task, not when it is enqueued.

``tests/test_django_tasks.py`` runs the first three through the immediate backend
(``TASKS["default"]``) and through django-tasks-db's worker processes
(``.using(backend="database")``); ``pay_invoice`` runs on those workers only.
"""

from __future__ import annotations

import time
from typing import Any

import django

from django_syncguard import current_lock, fenced_update, get_by_key, locked
from tests.testapp.models import Account, Ledger

if django.VERSION >= (6, 0):
    from django.tasks import TaskResult, TaskResultStatus, task
else:  # the backport, same API
    from django_tasks import TaskResult, TaskResultStatus, task

__all__ = [
    "AMOUNT",
    "TaskResult",
    "TaskResultStatus",
    "charge_or_refuse",
    "hold_invoice",
    "pay_invoice",
    "refresh_invoice",
]

#: Where the worker tasks keep their rows (the task queue is there too).
DATABASE = "postgres"
#: What paying an invoice sets its balance to.
AMOUNT = 100
#: How long a run waits for another worker to take a task (a stuck worker fails it).
RIVAL_TIMEOUT_S = 60.0


def seen_under_the_lock() -> dict[str, Any]:
    """The lease the task runs under, and the fence the lock backend stores for its
    key at that moment (the same one while the lock is held)."""
    lease = current_lock()
    stored = get_by_key(lease.backend, lease.key)
    return {"key": lease.key, "fence": lease.fence, "stored_fence": stored and stored.fence}


@task()
@locked("invoice:<pk>", timeout_ms=30_000)  # on_contended="wait", the default
def hold_invoice(pk: int) -> dict[str, Any]:
    """Wait for the lock of invoice ``pk``; report what holds it."""
    return seen_under_the_lock()


@task()
@locked("invoice:<pk>", on_contended="skip")
def refresh_invoice(pk: int) -> dict[str, Any]:
    """One attempt; when the invoice is locked the task does nothing and returns None."""
    return seen_under_the_lock()


@task()
@locked("invoice:<pk>", on_contended="raise")
def charge_or_refuse(pk: int) -> dict[str, Any]:
    """One attempt; when the invoice is locked the task fails with AcquisitionTimeout."""
    return seen_under_the_lock()


@task(backend="database")
@locked("invoice:<pk>", timeout_ms=120_000, max_retries=1_000_000, backoff="fixed")
def pay_invoice(pk: int) -> dict[str, Any]:
    """Pay invoice ``pk`` (the ``Account`` named ``invoice:<pk>``) unless it is paid.

    Under the lock: sets the exclusive marker (a row with a unique name, so a second
    run inside at the same time fails on the constraint), appends its fence to the
    ``Ledger`` (rows numbered in the order the runs held the lock), lets another
    worker take a task of the queue, pays with a fenced write, clears the marker."""
    fence = current_lock().fence
    accounts = Account.objects.using(DATABASE)
    marker = accounts.create(name=f"running:{pk}")
    try:
        Ledger.objects.using(DATABASE).create(total=pk, version=int(fence))
        rival = wait_for_a_rival()
        invoice = accounts.get(name=f"invoice:{pk}")
        paid = invoice.balance == 0
        if paid:
            fenced_update(accounts.filter(pk=invoice.pk), fence, balance=AMOUNT)
    finally:
        marker.delete()
    return {"fence": fence, "paid": paid, "rival": rival}


def wait_for_a_rival() -> bool:
    """Wait, holding the lock, until another worker runs a task too (it is then
    trying to take the lock this run holds) or none is left to take.

    Without this a worker could drain the queue alone and the runs would never meet.
    Returns whether a rival ran."""
    from django_tasks_db.models import DBTaskResult

    results = DBTaskResult.objects.using(DATABASE)
    deadline = time.monotonic() + RIVAL_TIMEOUT_S
    while time.monotonic() < deadline:
        if results.filter(status=TaskResultStatus.RUNNING).count() >= 2:
            return True
        if not results.filter(status=TaskResultStatus.READY).exists():
            return False
        time.sleep(0.02)
    raise RuntimeError(f"no other worker took a task in {RIVAL_TIMEOUT_S} s")
