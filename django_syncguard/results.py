"""Immutable results of lock operations.

Each compares by value and has ``to_dict()`` returning the wire shape the SyncGuard
specification uses (camelCase keys), so it can cross process and language borders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .keys import hash_key

TimeAuthority = Literal["server", "client"]
FailureReason = Literal["expired", "not-found"]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend offers: its name, whether it fences, whose clock it trusts."""

    backend: str
    supports_fencing: bool = True
    time_authority: TimeAuthority = "server"

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "supportsFencing": self.supports_fencing,
            "timeAuthority": self.time_authority,
        }


@dataclass(frozen=True, slots=True)
class AcquireResult:
    """``ok=True`` with ``lock_id``, ``expires_at_ms`` and ``fence``; or
    ``ok=False, reason="locked"`` when someone else holds the key."""

    ok: bool
    lock_id: str | None = None
    expires_at_ms: int | None = None
    fence: str | None = None
    reason: Literal["locked"] | None = None
    #: On contention with a wait ticket: the ticket's 0-based place among the live
    #: waiters, when the backend knows it (a diagnostic; not part of equality).
    queue_position: int | None = field(default=None, compare=False)

    @classmethod
    def locked(cls, queue_position: int | None = None) -> AcquireResult:
        return cls(ok=False, reason="locked", queue_position=queue_position)

    def to_dict(self) -> dict[str, Any]:
        if not self.ok:
            return {"ok": False, "reason": self.reason or "locked"}
        data: dict[str, Any] = {
            "ok": True,
            "lockId": self.lock_id,
            "expiresAtMs": self.expires_at_ms,
        }
        if self.fence is not None:
            data["fence"] = self.fence
        return data

    def __repr__(self) -> str:
        # The lock id is a bearer credential: keep it out of logs and tracebacks.
        if not self.ok:
            return f"AcquireResult(ok=False, reason={self.reason!r})"
        return (
            f"AcquireResult(ok=True, lock_id=<hidden>, expires_at_ms={self.expires_at_ms}, "
            f"fence={self.fence!r})"
        )


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    """``ok`` is True when this call removed the lock.

    ``reason`` is a best-effort diagnostic for telemetry (``"expired"`` /
    ``"not-found"``); it does not take part in equality nor in ``to_dict()``.
    """

    ok: bool
    reason: FailureReason | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok}


@dataclass(frozen=True, slots=True)
class ExtendResult:
    """``ok`` is True when the expiry was reset; then ``expires_at_ms`` is the new one."""

    ok: bool
    expires_at_ms: int | None = None
    reason: FailureReason | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        if not self.ok:
            return {"ok": False}
        return {"ok": True, "expiresAtMs": self.expires_at_ms}


@dataclass(frozen=True, slots=True)
class LockInfo:
    """Sanitized facts about a live lock: hashes only, never the key or lock id.

    ``owner`` is the holder's label (:mod:`~django_syncguard.owners`), ``None`` where
    the alias does not record it (``OPTIONS["RECORD_OWNER"] = False``)."""

    key_hash: str
    lock_id_hash: str
    expires_at_ms: int
    acquired_at_ms: int
    fence: str | None
    owner: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "keyHash": self.key_hash,
            "lockIdHash": self.lock_id_hash,
            "expiresAtMs": self.expires_at_ms,
            "acquiredAtMs": self.acquired_at_ms,
        }
        if self.fence is not None:
            data["fence"] = self.fence
        if self.owner is not None:
            data["owner"] = self.owner
        return data


@dataclass(frozen=True, slots=True)
class LockInfoDebug:
    """``LockInfo`` plus the raw ``key`` and ``lock_id``; for debugging only."""

    key_hash: str
    lock_id_hash: str
    expires_at_ms: int
    acquired_at_ms: int
    fence: str | None
    key: str
    lock_id: str
    owner: str | None = None

    def sanitized(self) -> LockInfo:
        return LockInfo(
            key_hash=self.key_hash,
            lock_id_hash=self.lock_id_hash,
            expires_at_ms=self.expires_at_ms,
            acquired_at_ms=self.acquired_at_ms,
            fence=self.fence,
            owner=self.owner,
        )

    def to_dict(self) -> dict[str, Any]:
        return {**self.sanitized().to_dict(), "key": self.key, "lockId": self.lock_id}

    def __repr__(self) -> str:
        return (
            f"LockInfoDebug(key={self.key!r}, lock_id=<hidden>, fence={self.fence!r}, "
            f"expires_at_ms={self.expires_at_ms})"
        )


def has_fence(result: AcquireResult) -> bool:
    """True when ``result`` is a successful acquisition that carries a fence."""
    return bool(result.ok and result.fence)


@dataclass(frozen=True, slots=True)
class LockRecord:
    """A stored lock as a backend reads it (raw key and lock id); never public."""

    key: str
    lock_id: str
    expires_at_ms: int
    acquired_at_ms: int
    fence: str | None
    owner: str | None = None

    def debug_info(self) -> LockInfoDebug:
        return LockInfoDebug(
            key_hash=hash_key(self.key),
            lock_id_hash=hash_key(self.lock_id),
            expires_at_ms=self.expires_at_ms,
            acquired_at_ms=self.acquired_at_ms,
            fence=self.fence,
            key=self.key,
            lock_id=self.lock_id,
            owner=self.owner,
        )


@dataclass(frozen=True, slots=True)
class LockPage:
    """One page of live locks, as the admin inspector shows them.

    ``next_cursor`` is an opaque string for the following page (``None`` on the last
    one); ``now_ms`` is the backend's clock when the page was read, so remaining TTLs
    are computed against the time authority, not the web server's clock.
    """

    records: tuple[LockRecord, ...]
    next_cursor: str | None
    now_ms: int
