"""Paying an invoice: one worker at a time, and stale workers cannot write."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from django_syncguard import current_lock, fenced_update, locked

from .models import Invoice


@dataclass(frozen=True)
class Payment:
    paid: bool  # True when this call paid the invoice
    fence: str  # the fence this call held


@locked("invoice:<invoice_id>", ttl_ms=10_000, timeout_ms=10_000)
def pay_invoice(
    invoice_id: int, worker: str, provider: Callable[[], None] = lambda: None
) -> Payment:
    """Mark the invoice paid by ``worker`` unless it already is."""
    lease = current_lock()
    assert lease is not None and lease.fence is not None
    invoice = Invoice.objects.get(pk=invoice_id)
    if invoice.paid:
        return Payment(paid=False, fence=lease.fence)
    provider()  # talk to the payment provider...
    fenced_update(Invoice.objects.filter(pk=invoice_id), lease.fence, paid=True, paid_by=worker)
    return Payment(paid=True, fence=lease.fence)
