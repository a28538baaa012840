"""``lock()`` and ``alock()``: run a function while holding a lock."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .backends.base import BaseLockBackend
from .constants import (
    DEFAULT_BACKOFF,
    DEFAULT_JITTER,
    DEFAULT_MAX_RETRIES,
    DEFAULT_RETRY_DELAY_MS,
    DEFAULT_TIMEOUT_MS,
    DEFAULT_TTL_MS,
)
from .leases import LockSpec, ReleaseErrorHandler
from .retry import Backoff, Jitter

T = TypeVar("T")


def lock(
    fn: Callable[[], T],
    *,
    key: str,
    using: str | BaseLockBackend = "default",
    ttl_ms: int = DEFAULT_TTL_MS,
    max_retries: int = DEFAULT_MAX_RETRIES,
    retry_delay_ms: float = DEFAULT_RETRY_DELAY_MS,
    timeout_ms: float = DEFAULT_TIMEOUT_MS,
    backoff: Backoff = DEFAULT_BACKOFF,
    jitter: Jitter = DEFAULT_JITTER,
    cancel: Any = None,
    on_release_error: ReleaseErrorHandler | None = None,
    auto_extend: bool = False,
) -> T:
    """Acquire ``key`` (retrying on contention), call ``fn()``, release, return its result.

    Raises ``AcquisitionTimeout`` when the lock stays held past ``timeout_ms`` or
    ``max_retries + 1`` attempts. The release always runs; its errors go to
    ``on_release_error(error, {"key", "lock_id"})`` (or the log) and never replace
    ``fn``'s result or exception. ``current_lock()`` is the lease inside ``fn``.
    """
    spec = LockSpec.from_options(
        using=using,
        ttl_ms=ttl_ms,
        max_retries=max_retries,
        retry_delay_ms=retry_delay_ms,
        timeout_ms=timeout_ms,
        backoff=backoff,
        jitter=jitter,
        cancel=cancel,
        on_release_error=on_release_error,
        auto_extend=auto_extend,
    )
    with spec.hold(key):
        return fn()


async def alock(
    fn: Callable[[], Awaitable[T]],
    *,
    key: str,
    using: str | BaseLockBackend = "default",
    ttl_ms: int = DEFAULT_TTL_MS,
    max_retries: int = DEFAULT_MAX_RETRIES,
    retry_delay_ms: float = DEFAULT_RETRY_DELAY_MS,
    timeout_ms: float = DEFAULT_TIMEOUT_MS,
    backoff: Backoff = DEFAULT_BACKOFF,
    jitter: Jitter = DEFAULT_JITTER,
    cancel: Any = None,
    on_release_error: ReleaseErrorHandler | None = None,
    auto_extend: bool = False,
) -> T:
    """Async twin of :func:`lock`: ``fn`` is a coroutine function (or returns an awaitable)."""
    spec = LockSpec.from_options(
        using=using,
        ttl_ms=ttl_ms,
        max_retries=max_retries,
        retry_delay_ms=retry_delay_ms,
        timeout_ms=timeout_ms,
        backoff=backoff,
        jitter=jitter,
        cancel=cancel,
        on_release_error=on_release_error,
        auto_extend=auto_extend,
    )
    async with spec.ahold(key):
        outcome = fn()
        if inspect.isawaitable(outcome):
            return await outcome
        return outcome
