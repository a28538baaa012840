"""``lock()`` and ``alock()``: run a function while holding a lock.

They hold the lock as ``locked`` does, through the same acquisition code, on a
finished key; they take the same options
(:class:`~django_syncguard.acquisition.LockOptions`).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar, cast

from .acquisition import LockOptions, LockSpec, Skipped

if TYPE_CHECKING:
    from typing_extensions import Unpack

T = TypeVar("T")


def lock(fn: Callable[[], T], *, key: str, **options: Unpack[LockOptions]) -> T:
    """Acquire ``key`` (retrying on contention), call ``fn()``, release, return its result.

    Raises ``AcquisitionTimeout`` when the lock stays held past ``timeout_ms`` or
    ``max_retries + 1`` attempts. The release always runs; its errors go to
    ``on_release_error(error, {"key", "lock_id"})`` (or the log) and never replace
    ``fn``'s result or exception. ``current_lock()`` is the lease inside ``fn``.
    ``key`` is used as it is: ``<...>`` in it is not a placeholder.
    With ``on_contended="skip"`` a held key returns ``None`` without calling ``fn``;
    with ``"raise"`` it raises ``AcquisitionTimeout`` after one attempt.
    """
    try:
        with LockSpec.from_options("lock", options).hold(key):
            return fn()
    except Skipped:  # on_contended="skip": fn was not called
        return cast(T, None)


async def alock(fn: Callable[[], Awaitable[T]], *, key: str, **options: Unpack[LockOptions]) -> T:
    """Async twin of :func:`lock`: ``fn`` is a coroutine function (or returns an awaitable)."""
    try:
        async with LockSpec.from_options("alock", options).ahold(key):
            outcome = fn()
            if inspect.isawaitable(outcome):
                return await outcome
            return outcome
    except Skipped:  # on_contended="skip": fn was not called
        return cast(T, None)
