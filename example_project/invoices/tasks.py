"""A Celery-style task that pays an invoice, one worker at a time.

With Celery installed, ``pay_invoice`` is a Celery task (``shared_task``), queued
with ``pay_invoice.delay(invoice_id, worker)``. Celery is not a dependency of this
example: without it ``pay_invoice`` stays a plain function, called directly
(``pay_invoice(invoice_id, worker)``; there is no ``.delay``). Either way the lock is
taken when the task runs, in whichever worker process runs it.
"""

from __future__ import annotations

from django_syncguard import locked

from .payments import record_payment

#: A task may queue behind another payment of the same invoice for this long.
WAIT_MS = 30_000


@locked("invoice:<invoice_id>", ttl_ms=30_000, timeout_ms=WAIT_MS)
def pay_invoice(invoice_id: int, worker: str) -> dict[str, str | bool]:
    """Pay invoice ``invoice_id`` as ``worker``, unless it is already paid.

    Returns :meth:`~invoices.payments.PaymentResult.as_dict`. Raises
    ``AcquisitionTimeout`` if the invoice stays locked for ``WAIT_MS``, and
    ``StaleFenceError`` if this worker's lease ran out before it wrote.
    """
    return record_payment(invoice_id, worker).as_dict()


try:
    from celery import shared_task
except ImportError:  # Celery is optional here
    pass
else:
    # Outside the lock: the lock is taken when a worker runs the task, not when queued.
    pay_invoice = shared_task(name="invoices.pay_invoice")(pay_invoice)
