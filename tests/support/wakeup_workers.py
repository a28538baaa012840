"""Children of the database backend's wake-up tests (spawned, not forked).

Each child talks to the test databases through its own connections, as a separate
worker process of a deployed project would, and reports on ``to_parent``; a child
that fails reports the exception instead of dying (the parent fails the test).
"""

from __future__ import annotations

from typing import Any

from tests.support.workers import setup_django

#: How long a child waits for the parent's word or for a lock.
PATIENCE_S = 60


def pg_holder(databases: dict[str, dict[str, Any]], key: str, to_parent, from_parent) -> None:
    """Take ``key`` on PostgreSQL, say so, release it when told, say so."""
    setup_django(databases)
    from django_syncguard.backends.database import DatabaseBackend

    backend = DatabaseBackend("holder", {"OPTIONS": {"DATABASE": "postgres"}})
    try:
        held = backend.acquire(key, 60_000)
        to_parent.put(("held", held.fence))
        assert from_parent.get(timeout=PATIENCE_S) == "release"
        to_parent.put(("released", backend.release(held.lock_id).ok))
    except Exception as exc:
        to_parent.put(exc)
    finally:
        backend.close()


def sqlite_waiter(databases: dict[str, dict[str, Any]], key: str, index: int, to_parent) -> None:
    """Wait for ``key`` on SQLite with ``lock()``: report ``("queued", index)`` after
    the first attempt that found it held (its ticket is in the queue by then), then
    ``("acquired", index, fence)`` from inside the critical section."""
    setup_django(databases)
    from django_syncguard import current_lock, lock, signals
    from django_syncguard.backends.database import DatabaseBackend

    backend = DatabaseBackend("waiter", {"OPTIONS": {"DATABASE": "default"}})

    def queued(sender: Any, attempt: int, **kwargs: Any) -> None:
        if attempt == 1:
            to_parent.put(("queued", index))

    signals.lock_contended.connect(queued, weak=False)

    def section() -> None:
        lease = current_lock()
        assert lease is not None
        to_parent.put(("acquired", index, lease.fence))

    try:
        lock(
            section,
            key=key,
            using=backend,
            ttl_ms=60_000,
            timeout_ms=PATIENCE_S * 1000,
            max_retries=1_000_000,  # the first in line polls every 10 ms
        )
    except Exception as exc:
        to_parent.put(exc)
    finally:
        backend.close()


def pg_waiter(databases: dict[str, dict[str, Any]], key: str, queued, to_parent) -> None:
    """Wait for ``key`` on PostgreSQL with ``lock()``; set ``queued`` after the first
    contended attempt (the ticket is in the queue by then), then report
    ``("acquired", fence)`` from inside the critical section."""
    setup_django(databases)
    from django_syncguard import current_lock, lock, signals
    from django_syncguard.backends.database import DatabaseBackend

    backend = DatabaseBackend("waiter", {"OPTIONS": {"DATABASE": "postgres"}})

    def contended(sender: Any, **kwargs: Any) -> None:
        queued.set()

    signals.lock_contended.connect(contended, weak=False)

    def section() -> None:
        lease = current_lock()
        assert lease is not None
        to_parent.put(("acquired", lease.fence))

    try:
        lock(section, key=key, using=backend, ttl_ms=60_000, timeout_ms=PATIENCE_S * 1000)
    except Exception as exc:
        to_parent.put(exc)
    finally:
        backend.close()
