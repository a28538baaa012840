"""An invoice, and the payments recorded against it."""

from django.db import models


class Invoice(models.Model):
    """An invoice to be paid exactly once."""

    number = models.CharField(max_length=20, unique=True)
    amount_cents = models.PositiveIntegerField()
    paid = models.BooleanField(default=False)
    paid_by = models.CharField(max_length=40, blank=True)
    #: Fence of the last lock holder that wrote this row (see fenced_update).
    fence = models.CharField(max_length=15, null=True, blank=True)  # noqa: DJ001

    def __str__(self) -> str:
        return f"Invoice {self.number}"


class Payment(models.Model):
    """One payment that got through, written in the same transaction as the fenced
    update of its invoice: an invoice paid exactly once has exactly one."""

    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="payments")
    worker = models.CharField(max_length=40)
    #: The fence of the lock the worker held when it paid.
    fence = models.CharField(max_length=15)
    amount_cents = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"Payment of {self.invoice} by {self.worker} (fence {self.fence})"
