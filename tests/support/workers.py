"""Code that runs in child processes of the concurrency tests (spawned, not forked).

Each child talks to the servers through its own connections, exactly as separate
worker processes of a deployed project would. Every worker ends by putting its records
(or the exception that stopped it) on ``results``; see ``tests/support/processes.py``.
"""

from __future__ import annotations

import os
import random
from typing import Any


def setup_django(
    databases: dict[str, dict[str, Any]], lock_backends: dict[str, Any] | None = None
) -> None:
    """Django from the test settings, pointed at the parent's test databases; with
    ``lock_backends``, that ``SYNCGUARD_BACKENDS``, set before the app is ready (as a
    project's settings file would set it)."""
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    import django
    from django.conf import settings

    for alias, settings_dict in databases.items():
        settings.DATABASES[alias] = settings_dict
    if lock_backends is not None:
        settings.SYNCGUARD_BACKENDS = lock_backends
    django.setup()


def _hammer(
    backend, key, iterations, critical_section, records, barrier, results, retry_delay_ms=1
) -> None:
    """Take ``key`` ``iterations`` times around ``critical_section``, then report."""
    from django_syncguard import lock

    barrier.wait()
    try:
        for _ in range(iterations):
            lock(
                critical_section,
                key=key,
                using=backend,
                ttl_ms=60_000,
                retry_delay_ms=retry_delay_ms,
                max_retries=1_000_000,
                timeout_ms=300_000,
            )
    except Exception as exc:  # a dead child would leave the parent waiting
        results.put(exc)
        return
    results.put(records)


def hammer(databases, database, key, iterations, account_pk, barrier, results) -> None:
    """On the database backend; inside, increment a row by read-modify-write."""
    setup_django(databases)
    from django_syncguard import current_lock
    from django_syncguard.backends.database import DatabaseBackend
    from tests.testapp.models import Account

    backend = DatabaseBackend("worker", {"OPTIONS": {"DATABASE": database}})
    accounts = Account.objects.using(database)
    records: list[tuple[int, str]] = []

    def critical_section() -> None:
        seen = accounts.get(pk=account_pk).balance  # read ...
        accounts.filter(pk=account_pk).update(balance=seen + 1)  # ... modify, write
        records.append((seen, current_lock().fence))

    _hammer(backend, key, iterations, critical_section, records, barrier, results)


def first_acquisitions(databases, database, keys, seed, barrier, results) -> None:
    """Race the other processes to acquire (then release) every fresh key once."""
    setup_django(databases)
    from django_syncguard.backends.database import DatabaseBackend

    backend = DatabaseBackend("worker", {"OPTIONS": {"DATABASE": database}})
    order = list(keys)
    random.Random(seed).shuffle(order[len(order) // 2 :])  # same start, then diverge
    got: list[tuple[str, str]] = []
    try:
        for key in order:
            barrier.wait()
            result = backend.acquire(key, 60_000)
            if result.ok:
                got.append((key, result.fence))
                backend.release(result.lock_id)
    except Exception as exc:
        results.put(exc)
        return
    results.put(got)


def redis_hammer(url, prefix, key, iterations, barrier, results) -> None:
    """On Redis; inside, GET + SET a shared counter (no atomic INCR)."""
    from django_syncguard import current_lock
    from django_syncguard.backends.redis import RedisBackend

    # Counter fences: the test asserts they count 1, 2, ... in the order sections ran.
    params = {"LOCATION": url, "KEY_PREFIX": prefix, "OPTIONS": {"FENCES": "counter"}}
    backend = RedisBackend("worker", params)
    shared = f"{prefix}-shared-counter"
    records: list[tuple[int, str]] = []

    def critical_section() -> None:
        seen = int(backend.client.get(shared) or 0)
        backend.client.set(shared, seen + 1)
        records.append((seen, current_lock().fence))

    _hammer(backend, key, iterations, critical_section, records, barrier, results)


def firestore_hammer(emulator_host, options, key, iterations, barrier, results) -> None:
    """On Firestore; inside, get + set a shared counter document (no transaction)."""
    os.environ["FIRESTORE_EMULATOR_HOST"] = emulator_host
    from django_syncguard import current_lock
    from django_syncguard.backends.firestore import FirestoreBackend

    backend = FirestoreBackend("worker", {"OPTIONS": options})
    counter = backend.client.collection(f"{options['COLLECTION']}_shared").document("counter")
    records: list[tuple[int, str]] = []

    def critical_section() -> None:
        seen = (counter.get().to_dict() or {}).get("value", 0)
        counter.set({"value": seen + 1})
        records.append((seen, current_lock().fence))

    _hammer(backend, key, iterations, critical_section, records, barrier, results, retry_delay_ms=5)


# ---------------------------------------------------------- Firestore wake-ups
def firestore_holder(emulator_host, options, conn) -> None:
    """Another process of the application: takes and releases locks on command.

    Commands on the pipe ``conn``: ``("acquire", key, ttl_ms)`` answers ``(ok,
    lock_id, fence)``; ``("release", lock_id, delay_s)`` releases after ``delay_s``
    (jitter for races) and answers ``ok``; ``("stop",)`` ends. An error is answered
    with the exception.
    """
    import time

    os.environ["FIRESTORE_EMULATOR_HOST"] = emulator_host
    from django_syncguard.backends.firestore import FirestoreBackend

    backend = FirestoreBackend("holder", {"OPTIONS": options})
    try:
        while (command := conn.recv())[0] != "stop":
            try:
                if command[0] == "acquire":
                    result = backend.acquire(command[1], command[2])
                    conn.send((result.ok, result.lock_id, result.fence))
                else:
                    time.sleep(command[2])
                    conn.send(backend.release(command[1]).ok)
            except Exception as exc:
                conn.send(exc)
    finally:
        backend.close()


def firestore_fair_waiter(emulator_host, options, key, name, queued, results) -> None:
    """``lock()`` on ``key``; sets ``queued`` once an attempt found the key held (its
    ticket is in the queue), then reports ``(name, fence)``."""
    os.environ["FIRESTORE_EMULATOR_HOST"] = emulator_host
    from django_syncguard import current_lock, lock
    from django_syncguard.backends.firestore import FirestoreBackend
    from django_syncguard.signals import lock_contended

    backend = FirestoreBackend("waiter", {"OPTIONS": options})

    def contended(sender, **kwargs) -> None:
        queued.set()

    lock_contended.connect(contended, weak=False)
    try:
        fence = lock(
            lambda: current_lock().fence,
            key=key,
            using=backend,
            timeout_ms=120_000,
            max_retries=1_000_000,
        )
        results.put((name, fence))
    except Exception as exc:
        results.put(exc)
    finally:
        backend.close()
