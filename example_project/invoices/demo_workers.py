"""The worker processes of ``manage.py syncguard_demo``.

Each worker is a separate OS process (multiprocessing's ``spawn``: a fresh Python,
as a Celery worker or a gunicorn worker would be) that calls ``django.setup()`` with
the example settings. The workers share nothing but the SQLite file, where the
default lock backend keeps the locks. The command steers them with two events each
(``go``: start; ``resume``: carry on after each pause) and they tell it what happened
on a queue; the command prints it. Events, not sleeps, fix the order.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, Protocol

Role = Literal["stall", "pay", "wait", "web"]

#: The lease of the worker that stalls: it runs out while the worker is paused.
STALL_TTL_MS = 300
#: How long a worker waits for the command's next signal before giving up.
SIGNAL_TIMEOUT_S = 60.0

#: What a worker reports: (worker name, event, details).
Report = tuple[str, str, dict[str, Any]]
Reporter = Callable[..., None]


class Event(Protocol):
    """A ``multiprocessing`` event, as the workers use it."""

    def wait(self, timeout: float | None = None) -> bool: ...

    def clear(self) -> None: ...


class Queue(Protocol):
    """A ``multiprocessing`` queue, as the workers use it."""

    def put(self, obj: Any) -> None: ...


def wait_for(event: Event, what: str) -> None:
    """Wait for the command's signal, and clear it for the next pause; fail rather than
    hang if it never comes. (Cleared before the worker reports anything more, so the
    command's next signal is never the one already used.)"""
    if not event.wait(SIGNAL_TIMEOUT_S):
        raise TimeoutError(f"No signal to {what} within {SIGNAL_TIMEOUT_S:.0f} s.")
    event.clear()


def run_worker(
    name: str,
    role: Role,
    invoice_id: int,
    settings_module: str,
    database: str,
    go: Event,
    resume: Event,
    reports: Queue,
) -> None:
    """Entry point of a worker process: set up Django, report ``ready``, wait for
    ``go``, play ``role`` on invoice ``invoice_id``. Any failure is reported as an
    ``error`` (with its traceback) instead of dying silently."""

    def report(event: str, **details: Any) -> None:
        reports.put((name, event, details))

    try:
        os.environ["DJANGO_SETTINGS_MODULE"] = settings_module
        import django
        from django.conf import settings

        settings.DATABASES["default"]["NAME"] = database  # the command's database file
        django.setup()
        report("ready")
        wait_for(go, "start")
        ROLES[role](name, invoice_id, resume, report)
    except BaseException:
        report("error", traceback=traceback.format_exc())


def _hold_then_pause(report: Reporter, resume: Event) -> Callable[[Any, str], None]:
    """A payment provider that reports the lease it runs under, then waits for
    ``resume``: the worker is paused inside the lock."""
    from django_syncguard import current_lock

    def provider(invoice: Any, worker: str) -> None:
        lease = current_lock()
        assert lease is not None
        report("holds", key=lease.key, fence=lease.fence, ttl_ms=lease.ttl_ms)
        wait_for(resume, "resume")

    return provider


def stall_past_lease(name: str, invoice_id: int, resume: Event, report: Reporter) -> None:
    """Pay with a short lease and stall inside it (think: a long GC pause) until told
    to resume; by then a newer holder has paid, so the fenced write is rejected."""
    from django_syncguard import StaleFenceError, locked

    from .payments import record_payment, set_payment_provider

    # The lease is lost when this worker releases it; the demo prints that itself.
    logging.getLogger("django_syncguard.leases").setLevel(logging.ERROR)
    set_payment_provider(_hold_then_pause(report, resume))
    # The same payment as the task, with a lease that runs out during the pause.
    pay_briefly = locked("invoice:<invoice_id>", ttl_ms=STALL_TTL_MS)(record_payment)
    try:
        result = pay_briefly(invoice_id, name)
    except StaleFenceError as exc:
        report("stale", fence=exc.fence, error=f"{type(exc).__name__}: {exc}")
    else:
        report("result", **result.as_dict())


def pay_through_view(name: str, invoice_id: int, resume: Event, report: Reporter) -> None:
    """POST to the payment view, which runs in the request's transaction
    (``ATOMIC_REQUESTS``): pause inside the lock (charging the card), then, once the
    view has returned, before its transaction commits; report the answer."""
    from django.db import connection
    from django.test import Client
    from django.urls import reverse

    from django_syncguard.signals import lock_released

    from .payments import set_payment_provider
    from .views import name_web_worker

    name_web_worker(name)
    set_payment_provider(_hold_then_pause(report, resume))
    committed = []

    def released(**kwargs: Any) -> None:
        report("released", after_commit=bool(committed) and not connection.in_atomic_block)

    lock_released.connect(released, weak=False)
    path = reverse("invoices:pay", args=[invoice_id])
    with commit_held(resume, report, committed):
        response = Client(HTTP_HOST="localhost").post(path)
    report("response", path=path, status=response.status_code, body=response.json())


@contextmanager
def commit_held(resume: Event, report: Reporter, committed: list[bool]) -> Iterator[None]:
    """Hold this thread's commits on the default database until ``resume``, so that the
    command can look at the moment between the view's return and its transaction's
    commit. (A demo device: ``atomic()`` commits through ``connection.commit()``, and
    only this wraps it; the lock backend commits on connections of its own.)"""
    from django.db import connection

    commit = connection.commit

    def commit_when_told() -> None:
        report("committing")
        wait_for(resume, "commit")
        commit()
        committed.append(True)

    connection.commit = commit_when_told  # type: ignore[method-assign]
    try:
        yield
    finally:
        del connection.commit


def wait_for_turn(name: str, invoice_id: int, resume: Event, report: Reporter) -> None:
    """Run the task while another worker holds the lock: it waits its turn."""
    from django_syncguard import locks

    from .payments import LOCK_KEY
    from .tasks import pay_invoice

    key = LOCK_KEY.format(pk=invoice_id)
    report("waiting" if locks["default"].is_locked(key) else "free", key=key)
    report("result", **pay_invoice(invoice_id, name))


def post_to_view(name: str, invoice_id: int, resume: Event, report: Reporter) -> None:
    """POST to the payment view through Django's full request stack (URL routing,
    middleware, the view) with Django's test client."""
    from django.test import Client
    from django.urls import reverse

    from .views import name_web_worker

    # Django logs every 4xx answer as a warning; the demo prints the answer itself.
    logging.getLogger("django.request").setLevel(logging.ERROR)
    name_web_worker(name)
    path = reverse("invoices:pay", args=[invoice_id])
    response = Client(HTTP_HOST="localhost").post(path)
    report("response", path=path, status=response.status_code, body=response.json())


ROLES: dict[Role, Callable[[str, int, Event, Reporter], None]] = {
    "stall": stall_past_lease,
    "pay": pay_through_view,
    "wait": wait_for_turn,
    "web": post_to_view,
}
