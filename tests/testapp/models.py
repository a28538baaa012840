from django.db import models


class Account(models.Model):
    """A row protected by fenced writes (fence stored as the 15-digit string)."""

    name = models.CharField(max_length=50, unique=True)
    balance = models.IntegerField(default=0)
    fence = models.CharField(max_length=15, null=True, blank=True)


class Ledger(models.Model):
    """Same idea with an integer fence column."""

    total = models.IntegerField(default=0)
    version = models.BigIntegerField(null=True)
    # Columns that cannot hold a fence, for fenced_update's refusal.
    amount = models.DecimalField(max_digits=12, decimal_places=2, default=0)
    code = models.CharField(max_length=8, default="")
    flags = models.SmallIntegerField(default=0)
