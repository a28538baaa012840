from django.db import models


class Invoice(models.Model):
    number = models.CharField(max_length=20, unique=True)
    amount_cents = models.PositiveIntegerField()
    paid = models.BooleanField(default=False)
    paid_by = models.CharField(max_length=40, blank=True)
    #: Fence of the last lock holder that wrote this row (see fenced_update).
    fence = models.CharField(max_length=15, null=True, blank=True)  # noqa: DJ001

    def __str__(self) -> str:
        return f"Invoice {self.number}"
