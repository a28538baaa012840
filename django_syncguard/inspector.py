"""What the admin lock inspector shows and does, apart from Django's admin wiring.

Pages of live locks come from each backend's ``list_locks``; rows show keys by their
display hash (keyed with ``SECRET_KEY``, so not reversible by hashing guesses; the raw
key only with ``django_syncguard.view_lock_key``) and never a lock id.

The browser never receives a raw key or a backend cursor (both can name customers):
rows and "next page" links carry random tokens, and what a token stands for is kept
in the user's session. With Django's default database or cache sessions this stays
on the server; with the signed-cookie session engine it would travel in a signed but
readable cookie, so that engine is best avoided on sites that use the inspector.
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from .contract import LockBackend, fence_keeper
from .errors import LockError
from .keys import display_hash, hash_key
from .owners import QueueStats
from .results import LockPage, ReleaseResult
from .signals import lock_force_released, prepare, send

logger = logging.getLogger("django_syncguard.inspector")

SESSION_KEY = "django_syncguard.inspector"
PAGE_SIZE = 100
#: Tokens kept per session: several pages' rows and cursors, across browser tabs.
MAX_ROWS = 1_000
MAX_CURSORS = 100


@dataclass(frozen=True, slots=True)
class Row:
    """One lock as the inspector shows it."""

    token: str
    key_hash: str  # the display hash
    key: str | None  # None unless the user may see raw keys
    fence: str | None
    acquired_at: dt.datetime
    expires_at: dt.datetime
    remaining_ms: int  # by the backend's clock
    #: The holder's label (None: not recorded, see OPTIONS["RECORD_OWNER"]).
    owner: str | None = None
    #: Live waiters queued for the key (None: the backend keeps no queues, or they
    #: could not be read).
    waiters: int | None = None
    #: How long the longest-waiting of them has waited, by the backend's clock (None:
    #: nobody waits, or the backend does not record when a waiter queued).
    oldest_wait_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Target:
    """What a row token stands for (kept in the session, never sent to the browser)."""

    alias: str
    key: str
    lock_id_hash: str  # hash_key's, as force_release compares it
    fence: str | None


class Tokens:
    """Row and cursor tokens of one user's session, oldest dropped first."""

    def __init__(self, session: MutableMapping[str, Any]) -> None:
        self.session = session
        state = session.get(SESSION_KEY) or {}
        self.rows: dict[str, list[Any]] = dict(state.get("rows", {}))
        self.cursors: dict[str, list[str]] = dict(state.get("cursors", {}))

    def add_row(self, alias: str, key: str, lock_id_hash: str, fence: str | None) -> str:
        token = secrets.token_urlsafe(12)
        self.rows[token] = [alias, key, lock_id_hash, fence]
        return token

    def add_cursor(self, alias: str, cursor: str) -> str:
        token = secrets.token_urlsafe(12)
        self.cursors[token] = [alias, cursor]
        return token

    def target(self, token: str) -> Target | None:
        entry = self.rows.get(token)
        return None if entry is None else Target(*entry)

    def cursor(self, token: str, alias: str) -> str | None:
        entry = self.cursors.get(token)
        return entry[1] if entry is not None and entry[0] == alias else None

    def save(self) -> None:
        rows = list(self.rows.items())[-MAX_ROWS:]
        cursors = list(self.cursors.items())[-MAX_CURSORS:]
        self.session[SESSION_KEY] = {"rows": dict(rows), "cursors": dict(cursors)}


def rows_of(
    page: LockPage,
    alias: str,
    tokens: Tokens,
    *,
    show_keys: bool,
    backend: LockBackend | None = None,
) -> list[Row]:
    """The rows of ``page``, registering a token for each; with ``backend``, each with
    the waiters queued for its key (one request for the page: :func:`queues_of`)."""
    queues = queues_of(backend, page) if backend is not None else None
    rows = []
    for record in page.records:
        lock_id_hash = hash_key(record.lock_id)
        stats = queues.get(record.key) if queues is not None else None
        since = stats.oldest_since_ms if stats is not None else None
        rows.append(
            Row(
                token=tokens.add_row(alias, record.key, lock_id_hash, record.fence),
                key_hash=display_hash(record.key),
                key=record.key if show_keys else None,
                fence=record.fence,
                acquired_at=from_ms(record.acquired_at_ms),
                expires_at=from_ms(record.expires_at_ms),
                remaining_ms=record.expires_at_ms - page.now_ms,
                owner=record.owner,
                waiters=None if queues is None else (stats.waiters if stats else 0),
                oldest_wait_ms=None if since is None else max(0, page.now_ms - since),
            )
        )
    return rows


def queues_of(backend: LockBackend, page: LockPage) -> dict[str, QueueStats] | None:
    """The live waiters of the page's keys (``None``: the backend keeps no queues, or
    they could not be read: the locks are still worth seeing)."""
    stats = getattr(backend, "queue_stats", None)
    if stats is None or getattr(backend, "wake_ups", None) is None:
        return None
    try:
        found: dict[str, QueueStats] = stats([record.key for record in page.records])
    except LockError as exc:
        logger.warning("Reading the waiters of %r failed: %s", backend.alias, exc)
        return None
    return found


def force_release(backend: LockBackend, target: Target, *, user: Any, reason: str) -> ReleaseResult:
    """Release ``target`` for its holder and tell ``lock_force_released`` receivers."""
    result = backend.force_release(target.key, target.lock_id_hash)
    username = getattr(user, "get_username", lambda: None)()
    if result.ok:
        logger.warning(
            "Lock %s on %r force-released by %s: %s",
            display_hash(target.key),
            target.alias,
            username,
            reason,
        )
        # Only the lock id's hash is known here (the raw id never left the backend);
        # prepare() turns it into the display hash receivers get.
        send(
            prepare(
                lock_force_released,
                backend,
                key=target.key,
                lock_id_hash=target.lock_id_hash,
                fence=target.fence,
                user=username,
                reason=reason,
            )
        )
    return result


def fences_of(backend: LockBackend) -> str | None:
    """How the alias hands out fences, for the page: "clock fences, floor 0"; the
    floor's read failing is said, not raised (the locks are still worth seeing)."""
    keeper = fence_keeper(backend)
    if keeper is None:
        return None
    mode = getattr(keeper, "fence_mode", "counter")
    try:
        return f"{mode} fences, floor {keeper.fence_floor()}"
    except LockError as exc:
        return f"{mode} fences, floor unknown ({exc.code})"
    except NotImplementedError:  # a third-party subclass without fence floors
        return None


def from_ms(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)


def format_wait(ms: int | None) -> str:
    """An oldest wait at a glance, or an em dash when there is none to show."""
    return "\u2014" if ms is None else format_remaining(ms)


def format_remaining(ms: int) -> str:
    """``12.3 s`` / ``4 min 05 s``: a lease's remaining time at a glance."""
    if ms < 60_000:
        return f"{ms / 1000:.1f} s"
    minutes, seconds = divmod(ms // 1000, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
