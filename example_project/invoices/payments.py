"""Paying an invoice: the code that runs while the invoice's lock is held.

The view (``views.pay``) and the task (``tasks.pay_invoice``) take the lock
``invoice:<pk>`` with ``@locked`` and call :func:`record_payment`, which uses the
lease's fence so that a worker whose lease ran out cannot write any more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from django.db import transaction

from django_syncguard import current_lock, fenced_update

from .models import Invoice, Payment

#: The lock key of invoice ``pk``; the view and the task render the same key.
LOCK_KEY = "invoice:{pk}"

#: Talks to the payment provider: ``charge(invoice, worker)``.
ChargeCard = Callable[[Invoice, str], None]


def instant_charge(invoice: Invoice, worker: str) -> None:
    """The payment provider's API call; instant in this example. (A real one would pass
    the invoice number as its idempotency key.)"""


_charge: ChargeCard = instant_charge


def set_payment_provider(charge: ChargeCard) -> None:
    """Replace the provider call in this process (the demo makes it slow)."""
    global _charge
    _charge = charge


@dataclass(frozen=True)
class PaymentResult:
    """What one payment attempt did; JSON-friendly through :meth:`as_dict`."""

    invoice: str  # the invoice number
    worker: str  # who attempted the payment
    fence: str  # the fence of the lock it held
    paid: bool  # True when this attempt paid; False when the invoice was already paid
    paid_by: str  # who paid the invoice, as read under the lock: ``worker`` or an earlier one

    def as_dict(self) -> dict[str, str | bool]:
        """The result as a dict (a view's JSON body, a Celery task's return value)."""
        return asdict(self)


def record_payment(invoice_id: int, worker: str) -> PaymentResult:
    """Pay invoice ``invoice_id`` on behalf of ``worker`` unless it is already paid.

    Must run under the lock ``invoice:<invoice_id>`` (``@locked`` puts it in
    ``current_lock()``). Raises ``Invoice.DoesNotExist`` for an unknown invoice and
    :class:`~django_syncguard.StaleFenceError` when the lease expired and a newer
    holder has written the invoice since: then nothing is written.
    """
    lease = current_lock()
    if lease is None or lease.fence is None or lease.key != LOCK_KEY.format(pk=invoice_id):
        raise RuntimeError(f"record_payment needs the lock {LOCK_KEY.format(pk=invoice_id)}.")
    invoice = Invoice.objects.get(pk=invoice_id)
    if invoice.paid:
        return PaymentResult(invoice.number, worker, lease.fence, False, invoice.paid_by)
    _charge(invoice, worker)  # slow: the lease may run out meanwhile
    row = Invoice.objects.filter(pk=invoice_id)
    with transaction.atomic():
        # Stamp the row with our fence first: if a newer holder has already written it,
        # our lease has expired and this raises StaleFenceError (rolling back).
        fenced_update(row, lease.fence)
        # Our fence is the newest: pay, unless a holder before us already did.
        if not row.filter(paid=False).update(paid=True, paid_by=worker):
            paid_by = row.values_list("paid_by", flat=True).get()
            return PaymentResult(invoice.number, worker, lease.fence, False, paid_by)
        Payment.objects.create(
            invoice=invoice, worker=worker, fence=lease.fence, amount_cents=invoice.amount_cents
        )
    return PaymentResult(invoice.number, worker, lease.fence, True, worker)
