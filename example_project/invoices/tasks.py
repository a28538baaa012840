"""The task that pays an invoice, one worker at a time: a Celery task.

``pay_invoice.delay(invoice_id, worker)`` queues it; a Celery worker
(``celery -A example_project worker``, see ``example_project/celery.py``) runs it and
takes the lock ``invoice:<invoice_id>`` for that run. Celery is the example's optional
extra (``example_project/requirements-celery.txt``): without it ``pay_invoice`` is the
same locked function without ``.delay``, which the demo (``make demo``) calls
directly, as it does with Celery installed (a Celery task called directly runs in
the caller, under the lock all the same).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django_syncguard import locked

from .payments import record_payment

try:
    from celery import shared_task
except ImportError:  # the example's Celery extra is not installed: a plain function

    def shared_task(**options: Any) -> Callable[[Callable[..., Any]], Any]:
        return lambda fn: fn


#: The lease: renewed every third of it while the task runs (auto_extend), so it
#: bounds only how long a killed worker's invoice stays locked: this plus the 1 s
#: takeover tolerance (TIME_TOLERANCE_MS), 11 s.
TTL_MS = 10_000
#: A task may queue behind another payment of the same invoice for this long: longer
#: than a killed worker's lease (TTL_MS + 1 s) plus the runs queued ahead of it, so
#: the tasks queued behind a killed one still run (syncguard.W005 warns otherwise).
WAIT_MS = 30_000


# The task decorator on top: every run of the task, in whichever worker, takes the
# lock (the other order is refused when this module is imported). A worker process
# killed mid-run gets its task delivered again (CELERY_TASK_ACKS_LATE and
# CELERY_TASK_REJECT_ON_WORKER_LOST in the settings), and that run finds the
# invoice paid if the killed one had paid.
@shared_task(name="invoices.pay_invoice")
@locked("invoice:<invoice_id>", ttl_ms=TTL_MS, auto_extend=True, timeout_ms=WAIT_MS)
def pay_invoice(invoice_id: int, worker: str) -> dict[str, str | bool]:
    """Pay invoice ``invoice_id`` as ``worker``, unless it is already paid (a task
    delivered twice finds the work done).

    Returns :meth:`~invoices.payments.PaymentResult.as_dict`. Raises
    ``AcquisitionTimeout`` if the invoice stays locked for ``WAIT_MS``, and
    ``StaleFenceError`` if this worker's lease ran out before it wrote.
    """
    return record_payment(invoice_id, worker).as_dict()
