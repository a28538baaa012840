"""Processes of tests/test_orphans.py: spawned children import this module before
Django is set up."""

from __future__ import annotations

from typing import Any

from tests.support.workers import setup_django

#: The lease an orphaned acquire would hold without help: far beyond the test's bound.
TTL_MS = 60_000
#: How long a child waits for its releaser once the server answers again.
RELEASE_BOUND_S = 15.0


def lose_an_acquire(
    databases: dict[str, Any],
    backend_path: str,
    params: dict[str, Any],
    key: str,
    ready: Any,
    paused: Any,
    resumed: Any,
    results: Any,
) -> None:
    """Connect (and load what the backend loads on first use), wait for the parent to
    pause the server, acquire ``key`` (it times out), then wait until the releaser
    has nothing pending. Reports ("failed", error class) and ("done", released,
    dropped, idle)."""
    try:
        setup_django(databases)
        from django.utils.module_loading import import_string

        from django_syncguard import LockError

        backend = import_string(backend_path)("orphans", params)
        warm = backend.acquire(f"{key}:warm-up", 1_000)
        backend.release(warm.lock_id)
        ready.wait(timeout=120)
        paused.wait(timeout=120)
        try:
            backend.acquire(key, TTL_MS)
            outcome = "acquired"
        except LockError as exc:
            outcome = type(exc).__name__
        results.put(("failed", outcome))
        resumed.wait(timeout=120)
        idle = backend.orphans.wait_idle(RELEASE_BOUND_S)
        results.put(("done", backend.orphans.released, backend.orphans.dropped, idle))
    except BaseException as exc:
        results.put(exc)
