"""Diagnostic lookups: "is this key locked, and by which fence?", "do I still own it?".

Read-only, for diagnostics and UIs; never use a lookup to decide whether to
release or extend (those operations verify ownership atomically themselves).
The ``*_raw`` variants add the raw ``key`` and ``lock_id``: keep them out of logs.
"""

from __future__ import annotations

from typing import Any

from .contract import LockBackend
from .results import LockInfo, LockInfoDebug


def get_by_key(backend: LockBackend, key: str, *, cancel: Any = None) -> LockInfo | None:
    """Sanitized info about the live lock on ``key``, or ``None``."""
    return backend.lookup(key=key, cancel=cancel)


def get_by_id(backend: LockBackend, lock_id: str, *, cancel: Any = None) -> LockInfo | None:
    """Sanitized info about the live lock ``lock_id`` names, or ``None``."""
    return backend.lookup(lock_id=lock_id, cancel=cancel)


def get_by_key_raw(backend: LockBackend, key: str, *, cancel: Any = None) -> LockInfoDebug | None:
    """Like :func:`get_by_key`, with the raw key and lock id."""
    return backend.lookup_raw(key=key, cancel=cancel)


def get_by_id_raw(
    backend: LockBackend, lock_id: str, *, cancel: Any = None
) -> LockInfoDebug | None:
    """Like :func:`get_by_id`, with the raw key and lock id."""
    return backend.lookup_raw(lock_id=lock_id, cancel=cancel)


def owns(backend: LockBackend, lock_id: str, *, cancel: Any = None) -> bool:
    """True while ``lock_id`` names a live lock."""
    return backend.lookup(lock_id=lock_id, cancel=cancel) is not None


async def aget_by_key(backend: LockBackend, key: str, *, cancel: Any = None) -> LockInfo | None:
    return await backend.alookup(key=key, cancel=cancel)


async def aget_by_id(backend: LockBackend, lock_id: str, *, cancel: Any = None) -> LockInfo | None:
    return await backend.alookup(lock_id=lock_id, cancel=cancel)


async def aget_by_key_raw(
    backend: LockBackend, key: str, *, cancel: Any = None
) -> LockInfoDebug | None:
    return await backend.alookup_raw(key=key, cancel=cancel)


async def aget_by_id_raw(
    backend: LockBackend, lock_id: str, *, cancel: Any = None
) -> LockInfoDebug | None:
    return await backend.alookup_raw(lock_id=lock_id, cancel=cancel)


async def aowns(backend: LockBackend, lock_id: str, *, cancel: Any = None) -> bool:
    return await backend.alookup(lock_id=lock_id, cancel=cancel) is not None
