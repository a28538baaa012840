"""Processes of the failover test (tests/test_redis_failover.py): spawned children
import this module before Django is set up, so models are imported inside."""

from __future__ import annotations

import time

from django.db.models import F

from django_syncguard import StaleFenceError, fenced_update
from django_syncguard.backends.redis import RedisBackend
from django_syncguard.errors import LockError, NetworkTimeout, ServiceUnavailable
from tests.support.workers import setup_django

#: How long each holder works under its lock (the work spans failovers now and then).
HOLD_S = 0.01
#: The pause after a transient error (four processes spinning would starve the servers).
TRANSIENT_PAUSE_S = 0.01


def fenced_cycles(databases, params, pks, stop, progress, barrier, results) -> None:
    """One process: until ``stop``, take the accounts' locks in turn and pay under each
    with a fenced write. Reports (holds, transient errors, other errors), a hold being
    (pk, fence, start, end, written) on the machine's monotonic clock (shared by the
    processes: overlapping holds of one key are double holders)."""
    try:
        setup_django(databases)
        from django_syncguard import current_lock, lock
        from tests.testapp.models import Account

        backend = RedisBackend("failover", params)
        holds: list[tuple[int, int, float, float, bool]] = []
        transient, others = 0, []

        def pay(pk: int) -> None:
            lease = current_lock()
            assert lease is not None
            start = time.monotonic()
            rows = Account.objects.using("postgres").filter(pk=pk)
            try:
                fenced_update(rows, lease.fence, balance=F("balance") + 1)
                written = True
            except StaleFenceError:
                written = False
            time.sleep(HOLD_S)  # the work the lock protects
            holds.append((pk, int(lease.fence), start, time.monotonic(), written))

        barrier.wait()
        turn = 0
        while not stop.is_set():
            pk = pks[turn % len(pks)]
            turn += 1
            try:
                lock(
                    lambda pk=pk: pay(pk),
                    key=f"account:{pk}",
                    using=backend,
                    ttl_ms=3_000,
                    timeout_ms=30_000,
                    max_retries=1_000_000,
                    retry_delay_ms=5,
                )
            except (ServiceUnavailable, NetworkTimeout):
                transient += 1
                time.sleep(TRANSIENT_PAUSE_S)  # as a caller would before trying again
            except LockError as exc:  # neither done nor a transient failure
                others.append(repr(exc))
            with progress.get_lock():
                progress.value += 1
        backend.close()
        results.put((holds, transient, others))
    except BaseException as exc:  # reported, and the test fails with it
        results.put(exc)
