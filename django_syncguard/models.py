"""Tables of the database backend: lock records and fence counters.

A fence counter is deleted only by compaction (``syncguard_fences compact``), which
first raises the alias's fence floor (a row of the counters' table) to at least its
value, so that the key's fences never start again below it
(``specs/backends/database.md``, Fence continuity).
"""

from __future__ import annotations

from django.db import models


class Lock(models.Model):
    """One held (or expired, not yet swept) lock."""

    #: Storage key: the normalised user key, hashed only if longer than 1700 bytes.
    key = models.TextField(primary_key=True)
    lock_id = models.CharField(max_length=22, unique=True)
    expires_at_ms = models.BigIntegerField()
    acquired_at_ms = models.BigIntegerField()
    #: The 15-digit fence handed out with this lock.
    fence = models.CharField(max_length=15)
    #: The user key when it differs from ``key`` (hashed storage key); else NULL.
    user_key = models.TextField(null=True, blank=True)  # noqa: DJ001 - NULL means "same as key"
    #: A waiter may be queued for this key (PostgreSQL): only then does a release look
    #: for one to wake. Never False while one is (it may stay True after they left).
    waiters = models.BooleanField(db_default=False)
    #: The holder's label (host, pid, thread or task, function; django_syncguard.owners),
    #: at most 128 bytes. NULL when the alias does not record owners (RECORD_OWNER).
    owner = models.TextField(null=True, blank=True)  # noqa: DJ001 - NULL means "not recorded"
    #: A lock a release granted to a waiter (PostgreSQL, 0008): the waiter's ticket. NULL
    #: for a lock its acquire took.
    granted_to = models.CharField(max_length=22, null=True, blank=True)  # noqa: DJ001
    #: While a grant is unclaimed: the expiry its holder was told (``expires_at_ms`` then
    #: holds the claim deadline minus the tolerance, so the grant lapses there). NULL
    #: once claimed, and for a lock its acquire took.
    grant_expires_at_ms = models.BigIntegerField(null=True)

    class Meta:
        db_table = "syncguard_locks"
        indexes = (models.Index(fields=["expires_at_ms"], name="syncguard_locks_expires_idx"),)
        verbose_name = "lock"
        verbose_name_plural = "locks"
        # The admin lock inspector covers every backend alias, not only this table:
        # "view" opens it; these two add raw keys and the force-release action.
        default_permissions = ("view",)
        permissions = (
            ("view_lock_key", "Can see raw lock keys in the lock inspector"),
            ("force_release_lock", "Can force-release a lock from the lock inspector"),
        )

    def __str__(self) -> str:
        return f"lock with fence {self.fence}"

    @property
    def raw_key(self) -> str:
        return self.user_key if self.user_key is not None else self.key


class FenceCounter(models.Model):
    """The last fence handed out for one key; or, in the one row whose ``fence_key`` is
    ``syncguard:floor``, the alias's fence floor. Deleted only by compaction."""

    fence_key = models.TextField(primary_key=True)
    fence = models.BigIntegerField(default=0)
    #: When the key was last acquired (the time authority's ms), for compaction's
    #: cut-off. NULL: last acquired before version 0006 recorded it (compaction stamps
    #: the current time first), and always on the floor row.
    acquired_at_ms = models.BigIntegerField(null=True)
    #: The key's wait queue may have tickets (PostgreSQL): only then does an acquire
    #: of the free key read the queue. Never False while it has (it may stay True
    #: after they left, until the key is next taken).
    waiters = models.BooleanField(db_default=False)

    class Meta:
        db_table = "syncguard_fence_counters"
        verbose_name = "fence counter"
        verbose_name_plural = "fence counters"

    def __str__(self) -> str:
        return f"fence counter at {self.fence}"


class Waiter(models.Model):
    """One waiter's place in a key's queue (fair, notified waiting; see
    ``django_syncguard.waiting``). A row lives while its waiter keeps checking in:
    the acquire that takes the key, a withdrawal, or a later acquire that finds it
    past ``live_until_ms`` removes it."""

    pk = models.CompositePrimaryKey("key", "ticket_id")
    #: The storage key of the lock the ticket waits for (``Lock.key``).
    key = models.TextField()
    ticket_id = models.CharField(max_length=22)
    #: Arrival order within the key (a sequence on PostgreSQL, max + 1 on SQLite).
    arrival = models.BigIntegerField()
    #: The ticket stops holding the queue up after this instant (the time authority's
    #: ms), unless its waiter checks in again.
    live_until_ms = models.BigIntegerField()
    #: When the ticket was queued (the time authority's ms; again after its place
    #: lapsed): the inspector's oldest wait. NULL for rows queued before 0007.
    queued_at_ms = models.BigIntegerField(null=True)
    # The ticket's grant record (PostgreSQL, 0008): what its latest attempt would have
    # written as the lock, for a release to write it for the waiter (a grant). All NULL
    # for a waiter that takes no grant (grant_window_ms says which).
    #: The lock id of the waiter's latest attempt.
    lock_id = models.CharField(max_length=22, null=True)  # noqa: DJ001
    ttl_ms = models.BigIntegerField(null=True)
    #: ``FenceCounter.fence_key`` of the key.
    fence_key = models.TextField(null=True)  # noqa: DJ001
    #: As ``Lock.user_key``.
    user_key = models.TextField(null=True)  # noqa: DJ001
    #: As ``Lock.owner``.
    owner = models.TextField(null=True)  # noqa: DJ001
    #: Clock fence mode (the fence is at least the server's now).
    clock = models.BooleanField(null=True)
    max_fence = models.BigIntegerField(null=True)
    #: How long the grant waits for the waiter's process to claim it, in ms.
    grant_window_ms = models.BigIntegerField(null=True)
    #: The channel the waiter's process LISTENs on for its grants (PostgreSQL, 0009);
    #: NULL: none (code before 0009), its grants go on the key's channel.
    process_channel = models.TextField(null=True)  # noqa: DJ001

    class Meta:
        db_table = "syncguard_waiters"
        verbose_name = "waiter"
        verbose_name_plural = "waiters"
        # Not in the admin: queue rows are short-lived and only the backend reads them.
        default_permissions = ()

    def __str__(self) -> str:
        return f"waiter {self.arrival} for a lock"
