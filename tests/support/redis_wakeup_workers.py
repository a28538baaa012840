"""Child processes of tests/test_redis_wakeups.py (spawned, not forked).

Each child builds its own ``RedisBackend`` on the parent's server and prefix, as
another worker process of a deployed project would, and reports through ``results``
(an exception instead of dying, so the parent never waits in vain).
"""

from __future__ import annotations

from typing import Any

WAIT_S = 60.0


def _backend(url: str, prefix: str) -> Any:
    from django_syncguard.backends.redis import RedisBackend

    # Counter fences: the parent's tests assert fences counted from 1 (its harness's).
    options = {"FENCES": "counter"}
    return RedisBackend("child", {"LOCATION": url, "KEY_PREFIX": prefix, "OPTIONS": options})


def hold_then_release(url, prefix, key, held, release, results) -> None:
    """Take ``key``, set ``held``, release it when ``release`` is set."""
    try:
        backend = _backend(url, prefix)
        taken = backend.acquire(key, 60_000)
        results.put(("held", taken.fence))
        held.set()
        if not release.wait(WAIT_S):
            raise TimeoutError("the parent never asked for the release")
        results.put(("released", backend.release(taken.lock_id).ok))
        backend.close()
    except Exception as exc:
        results.put(exc)


def queued_waiter(url, prefix, key, queued, results) -> None:
    """``lock()`` on ``key``; set ``queued`` after the first contended attempt (the
    ticket is then in the queue); report the fence the critical section saw."""
    try:
        from django_syncguard import current_lock, lock, signals

        backend = _backend(url, prefix)

        def on_contended(sender, **kwargs) -> None:
            queued.set()

        signals.lock_contended.connect(on_contended, weak=False)
        fence = lock(
            lambda: current_lock().fence, key=key, using=backend, ttl_ms=60_000, timeout_ms=60_000
        )
        results.put(("process", fence))
        backend.close()
    except Exception as exc:
        results.put(exc)
