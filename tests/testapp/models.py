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


class Invoice(models.Model):
    """What the Celery tasks of ``tests/testapp/tasks.py`` pay, with fenced writes."""

    paid = models.BooleanField(default=False)
    #: The run that wrote last: ``<task id>/<pid of the worker process>``.
    paid_by = models.CharField(max_length=100, default="")
    fence = models.CharField(max_length=15, null=True, blank=True)


class Payment(models.Model):
    """One row per payment a task made: paying twice shows as two rows."""

    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE)
    task_id = models.CharField(max_length=50)


class TaskEvent(models.Model):
    """Append-only journal the Celery worker's processes write (the test reads it).

    Rows written while holding a lock are numbered (``id``) in the order the runs
    held it; ``fence`` is the fence of the lease held then, if any.
    """

    #: The task's name and id; empty for an event of a thread that runs no task
    #: (the auto-extend renewal's).
    task = models.CharField(max_length=50)
    task_id = models.CharField(max_length=50)
    event = models.CharField(max_length=30)
    pid = models.IntegerField()
    fence = models.CharField(max_length=15, null=True)
    #: The task's ``request.retries`` (Celery's retries of this task so far).
    retries = models.IntegerField(null=True)
    #: Whether the broker delivered this message before (``delivery_info``).
    redelivered = models.BooleanField(null=True)
    #: ``lock_contended``'s ``attempt``.
    attempt = models.IntegerField(null=True)


class ExclusiveMarker(models.Model):
    """Set by a run when it enters its locked section, cleared when it leaves: a
    second run entering meanwhile fails on the unique key."""

    key = models.CharField(max_length=100, unique=True)
    holder = models.CharField(max_length=100)
