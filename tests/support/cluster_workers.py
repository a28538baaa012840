"""Child processes of tests/test_redis_cluster.py (spawned, not forked).

Each child builds its own ``RedisBackend`` on the parent's cluster and prefix and
cycles acquire / release on a few keys until told to stop. Holding is checked by a
shared array (how many hold each key, never more than one) kept outside Redis, so a
double holder is seen even if Redis lost track of it.
"""

from __future__ import annotations

import os
import random
from typing import Any

TTL_MS = 10_000


def cycle(url, prefix, mode, keys, holders, sequence, cycles, stop, results) -> None:
    """Acquire and release ``keys`` in random order until ``stop`` is set. Report
    ``(held, errors)``: ``held`` = (key, order, fence) for each acquisition, ``order``
    taken from ``sequence`` while holding; ``errors`` = the class names of the errors
    raised (only ServiceUnavailable / NetworkTimeout are allowed by the parent)."""
    from django_syncguard.backends.redis import RedisBackend
    from django_syncguard.errors import LockError

    options = {"CLUSTER": True, "FENCES": mode, "OPERATION_TIMEOUT_MS": 2000}
    params = {"LOCATION": url, "KEY_PREFIX": prefix, "OPTIONS": options}
    backend: Any = RedisBackend("child", params)
    rng = random.Random(os.getpid())
    held: list[tuple[str, int, int]] = []
    errors: list[str] = []
    try:
        while not stop.is_set():
            n = rng.randrange(len(keys))
            try:
                result = backend.acquire(keys[n], TTL_MS)
            except LockError as exc:
                errors.append(type(exc).__name__)
                continue
            if not result.ok:
                continue
            with holders.get_lock():
                holders[n] += 1
                double = holders[n] > 1
                with sequence.get_lock():
                    order = sequence.value
                    sequence.value += 1
            held.append((keys[n], order, int(result.fence)))
            with holders.get_lock():
                holders[n] -= 1
            if double:
                raise AssertionError(f"two holders of {keys[n]!r} at once")
            try:
                backend.release(result.lock_id)
            except LockError as exc:  # the lock stays until its TTL: nobody else takes it
                errors.append(type(exc).__name__)
            with cycles.get_lock():
                cycles.value += 1
        backend.close()
    except Exception as exc:
        results.put(exc)
        return
    results.put((held, errors))
