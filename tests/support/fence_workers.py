"""Processes of the fence tests (tests/test_redis_restart.py): spawned children import
this module before Django is set up, so models are imported inside the functions."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from django.db.models import F

from django_syncguard import StaleFenceError, fenced_update
from django_syncguard.backends.redis import RedisBackend
from tests.support.workers import setup_django

#: Payments per process and phase, spread over the accounts.
PAYMENTS = 15


def in_turn(
    backend: Any,
    items: list[Any],
    count: int,
    section: Callable[[Any], None],
    *,
    key_of: Callable[[Any], str],
) -> None:
    """``count`` times, ``section(item)`` under the lock of ``key_of(item)``, taking
    ``items`` in turn; each wait long enough that contention between the test's few
    processes never ends in a timeout."""
    from django_syncguard import lock

    for n in range(count):
        item = items[n % len(items)]
        lock(
            lambda item=item: section(item),
            key=key_of(item),
            using=backend,
            ttl_ms=60_000,
            timeout_ms=60_000,
            max_retries=1_000_000,
            retry_delay_ms=2,
        )


def pay(databases, params, pks, barrier, results) -> None:
    """One process: ``PAYMENTS`` locked, fenced payments; reports (pk, fence, written)."""
    try:
        setup_django(databases)
        from django_syncguard import current_lock
        from tests.testapp.models import Account

        backend = RedisBackend("restart", params)
        log: list[tuple[int, str, bool]] = []

        def write(pk: int) -> None:
            lease = current_lock()
            assert lease is not None
            try:
                rows = Account.objects.using("postgres").filter(pk=pk)
                fenced_update(rows, lease.fence, balance=F("balance") + 1)
                log.append((pk, lease.fence, True))
            except StaleFenceError:
                log.append((pk, lease.fence, False))

        barrier.wait()
        in_turn(backend, pks, PAYMENTS, write, key_of=lambda pk: f"account:{pk}")
        backend.close()
        results.put(log)
    except BaseException as exc:  # reported, and the test fails with it
        results.put(exc)


def cycle_keys(
    databases, entry, environ, keys, iterations, log, compacted, barrier, results
) -> None:
    """One process: take ``keys`` in turn ``iterations`` times, appending ``key fence``
    to ``log`` inside each critical section (``O_APPEND``: lines land in the order the
    holders of one key held it). Halfway, with its keys released, it waits for the
    ``compacted`` event: the second half then acquires over compacted counters."""
    try:
        os.environ.update(environ)
        setup_django(databases)
        from django.utils.module_loading import import_string

        from django_syncguard import current_lock

        params = dict(entry)
        backend = import_string(params.pop("BACKEND"))("cycler", params)

        def section(key: str) -> None:
            lease = current_lock()
            assert lease is not None
            with open(log, "a") as f:
                f.write(f"{key} {lease.fence}\n")

        barrier.wait()
        half = iterations // 2
        in_turn(backend, keys, half, section, key_of=str)
        if not compacted.wait(timeout=60):
            raise AssertionError("compaction deleted nothing in 60 s")
        in_turn(backend, keys, iterations - half, section, key_of=str)
        backend.close()
        results.put(iterations)
    except BaseException as exc:  # reported, and the test fails with it
        results.put(exc)
