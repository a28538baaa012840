"""The Firestore backend's document layout: lock documents, their queues, fence counters.

A key's **lock document** (id: :func:`document_id`, in ``OPTIONS["COLLECTION"]``):

``lockId``, ``key``, ``fence``, ``acquiredAtMs``, ``expiresAtMs``
    the lock (Firestore's clock, whole Unix ms); a *waiter-only* document has no
    ``lockId``, ``fence`` or ``acquiredAtMs``, and ``expiresAtMs`` = when its last
    waiter lapses;
``owner``
    the holder's label (:mod:`django_syncguard.owners`), absent when not recorded;
``purgeAt``
    when a TTL policy may delete the document (past its lock and its waiters);
``waiters``
    map ``ticket id -> {"arrival": n, "liveUntilMs": ms, "queuedAtMs": ms}``
    (``queuedAtMs``: when the place was handed out, for the inspector's oldest wait;
    absent in places written by a version before it);
``arrivals``
    the last arrival number handed out; both queue fields are absent when nobody waits;
``request`` (in a place)
    what the waiter's acquire would write (``lockId``, ``ttlMs``, ``clock``, ``owner``),
    stored when the place is handed out: a release grants the key with it;
``grantTicket``, ``grantExpiresAtMs``
    a lock a release granted to a waiter: its ticket (kept until the lock goes, so a
    withdrawal of the ticket gives the key back), and, until the waiter's process
    claims it, the lease's expiry (``expiresAtMs`` is then
    :func:`~django_syncguard.waiting.queues.unclaimed_expiry`, so an unclaimed grant
    is gone for every reader at its claim deadline).

A key's **fence counter** (in ``OPTIONS["FENCE_COLLECTION"]``, id :func:`counter_id`):

``fence``
    the last fence handed out (15 digits, so string order is numeric order);
``acquiredAtMs``
    when that fence was handed out (Firestore's clock); absent in counters written
    before fence compaction existed. A counter is only deleted by compaction.

The alias's **fence floor** is the document :data:`FLOOR_ID` of the same collection,
with one field, ``floor`` (15 digits); no counter can have that id.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from functools import partial
from typing import Any

from ...constants import BACKEND_LIMITS, CLEANUP_GUARD_MS, RESERVE_BYTES, TIME_TOLERANCE_MS
from ...keys import derived, hash_storage_key, make_storage_key
from ...liveness import is_live
from ...waiting import Grant, Queue, queue_head
from .client import _firestore

#: Fields of a lock document.
LOCK_ID = "lockId"
KEY = "key"
FENCE = "fence"
ACQUIRED_AT_MS = "acquiredAtMs"
OWNER = "owner"
EXPIRES_AT_MS = "expiresAtMs"
PURGE_AT = "purgeAt"
#: Document fields of a key's queue.
WAITERS = "waiters"
ARRIVALS = "arrivals"
#: A place's grant record (what its acquire would write), and the fields of a grant.
REQUEST = "request"
GRANT_TICKET = "grantTicket"
GRANT_EXPIRES_AT_MS = "grantExpiresAtMs"
#: Fields of a fence counter document.
COUNTER_FENCE = "fence"
COUNTER_ACQUIRED_AT_MS = "acquiredAtMs"
#: The fence floor's document id in the fence collection, and its field. A counter id
#: is ``make_storage_key("", "fence:" + lock document id, ...)`` with an empty prefix:
#: either ``fence:<lock document id>``, or, when that is too long, the bare 22-character
#: base64url hash, which has no colon. ``syncguard:floor`` is neither.
FLOOR_ID = "syncguard:floor"
FLOOR = "floor"
#: What every counter id that is not hashed starts with.
_COUNTER_HEAD = "fence:"

LIMIT_BYTES = BACKEND_LIMITS["FIRESTORE"]
RESERVE = RESERVE_BYTES["FIRESTORE"]
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_MS = dt.timedelta(milliseconds=1)
_RESERVED_ID = re.compile(r"__.*__", re.DOTALL)


def server_ms(read_time: dt.datetime) -> int:
    """A Firestore timestamp as whole Unix milliseconds."""
    return (read_time - _EPOCH) // _MS


def document_id(key: str) -> str:
    """The lock document id of ``key``: its storage key, or the hashed form when that is
    not a valid Firestore id (``a/b`` would be a path, ``.``, ``..`` and ``__x__`` are
    refused by Firestore): every valid key gets a document."""
    return derived(key, document_id, "document id", partial(_document_id, key))


def _document_id(key: str) -> str:
    storage_key = make_storage_key("", key, LIMIT_BYTES, RESERVE)
    if "/" in storage_key or storage_key in (".", "..") or _RESERVED_ID.fullmatch(storage_key):
        return hash_storage_key("", key)
    return storage_key


def counter_id(lock_document_id: str) -> str:
    """The fence counter document id of a lock document."""
    return make_storage_key("", f"{_COUNTER_HEAD}{lock_document_id}", LIMIT_BYTES, RESERVE)


def lock_document_of(counter_document_id: str) -> str | None:
    """The lock document id whose counter is ``counter_document_id``; None for the
    floor, and for a hashed counter id, which cannot be mapped back. (Keys are at most
    512 bytes, so ``fence:`` + a lock document id always fits the 1500-byte id limit
    and no counter is hashed today; a hashed one is never compacted.)"""
    if not counter_document_id.startswith(_COUNTER_HEAD):
        return None
    lock_document = counter_document_id[len(_COUNTER_HEAD) :]
    return lock_document if counter_id(lock_document) == counter_document_id else None


def purge_at(expires_at_ms: int) -> dt.datetime:
    """When a TTL policy may delete a lock document: past expiry, tolerance and guard."""
    return _EPOCH + (expires_at_ms + CLEANUP_GUARD_MS["server"]) * _MS


def fields_of(snap: Any) -> dict[str, Any]:
    """A snapshot's fields; empty for a missing document."""
    return (snap.to_dict() or {}) if snap.exists else {}


# ---------------------------------------------------------------- the queue in a document
def holds_lock(data: Mapping[str, Any], now_ms: int) -> bool:
    """Whether the lock document ``data`` holds a live lock at ``now_ms``."""
    return bool(data.get(LOCK_ID)) and is_live(int(data[EXPIRES_AT_MS]), now_ms, TIME_TOLERANCE_MS)


def queue_of(data: Mapping[str, Any]) -> Queue:
    """The waiters of a lock document as a :data:`~django_syncguard.waiting.Queue`."""
    raw = data.get(WAITERS) or {}
    return {
        ticket_id: (int(entry["arrival"]), int(entry["liveUntilMs"]))
        for ticket_id, entry in raw.items()
        if isinstance(entry, Mapping)
    }


def queue_value(
    queue: Queue,
    data: Mapping[str, Any] | None = None,
    now_ms: int | None = None,
    requests: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """``queue`` as the value of the ``waiters`` field: a place that ``data`` already
    had (same arrival number) keeps its ``queuedAtMs`` and its grant record; a new one
    is queued at ``now_ms`` (when given), with its record from ``requests``."""
    old = (data or {}).get(WAITERS) or {}
    value: dict[str, dict[str, Any]] = {}
    for ticket_id, (arrival, until) in queue.items():
        entry: dict[str, Any] = {"arrival": arrival, "liveUntilMs": until}
        kept = old.get(ticket_id)
        if isinstance(kept, Mapping) and kept.get("arrival") == arrival:
            if "queuedAtMs" in kept:
                entry["queuedAtMs"] = int(kept["queuedAtMs"])
            if isinstance(kept.get(REQUEST), Mapping):
                entry[REQUEST] = dict(kept[REQUEST])
        else:
            if now_ms is not None:
                entry["queuedAtMs"] = now_ms
            if requests and ticket_id in requests:
                entry[REQUEST] = dict(requests[ticket_id])
        value[ticket_id] = entry
    return value


def queued_since(data: Mapping[str, Any], now_ms: int) -> tuple[int, int | None]:
    """The live places of a lock document at ``now_ms``, and the earliest
    ``queuedAtMs`` among them (None: none recorded)."""
    raw = data.get(WAITERS) or {}
    live = [e for e in raw.values() if isinstance(e, Mapping) and int(e["liveUntilMs"]) > now_ms]
    times = [int(e["queuedAtMs"]) for e in live if "queuedAtMs" in e]
    return len(live), min(times, default=None)


def last_until(queue: Queue) -> int | None:
    """When the last place in ``queue`` lapses (None: nobody waits)."""
    return max((until for _, until in queue.values()), default=None)


def first_waiter(data: Mapping[str, Any] | None, now_ms: int) -> str | None:
    """The ticket a document state calls next: the first live waiter of a free key."""
    if not data or holds_lock(data, now_ms):
        return None
    return queue_head(queue_of(data), now_ms)


def request_of(data: Mapping[str, Any], ticket_id: str) -> Mapping[str, Any] | None:
    """The grant record of ``ticket_id``'s place (None: a place without one, written
    by a version before grants or by a backend that does not grant)."""
    entry = (data.get(WAITERS) or {}).get(ticket_id)
    request = entry.get(REQUEST) if isinstance(entry, Mapping) else None
    return request if isinstance(request, Mapping) else None


def unclaimed_grant(data: Mapping[str, Any] | None, now_ms: int) -> tuple[str, Grant] | None:
    """The ticket and grant of a live lock a release granted and nobody claimed yet."""
    if not data or GRANT_EXPIRES_AT_MS not in data or not holds_lock(data, now_ms):
        return None
    grant = Grant(str(data[LOCK_ID]), int(data[FENCE]), int(data[GRANT_EXPIRES_AT_MS]))
    return str(data[GRANT_TICKET]), grant


def has_waiters(snap: Any) -> bool:
    """Whether a lock document still holds a live waiter's place, at its read time."""
    return queue_head(queue_of(fields_of(snap)), server_ms(snap.read_time)) is not None


# ------------------------------------------------------------------ writes
def lock_fields(
    lock_id: str,
    key: str,
    fence: str,
    acquired_at_ms: int,
    expires_at_ms: int,
    owner: str | None = None,
    data: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The lock fields of a lock document (without its queue and ``purgeAt``); with
    no ``owner``, the deletion of the label a previous holder left in ``data`` (the
    write is an update: a field it does not name stays)."""
    fields: dict[str, Any] = {
        LOCK_ID: lock_id,
        EXPIRES_AT_MS: expires_at_ms,
        ACQUIRED_AT_MS: acquired_at_ms,
        KEY: key,
        FENCE: fence,
    }
    if owner is not None:
        fields[OWNER] = owner
    elif data and OWNER in data:
        fields[OWNER] = _firestore().DELETE_FIELD
    for name in (GRANT_TICKET, GRANT_EXPIRES_AT_MS):  # a previous holder's grant
        if data and name in data:
            fields[name] = _firestore().DELETE_FIELD
    return fields


def queue_fields(
    data: Mapping[str, Any],
    queue: Queue,
    arrivals: int,
    now_ms: int | None = None,
    requests: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The queue fields of a write: ``queue`` (new places queued at ``now_ms``, with
    their grant records from ``requests``) and the arrival counter, or, once nobody
    waits, the deletion of the fields ``data`` has."""
    if queue:
        return {WAITERS: queue_value(queue, data, now_ms, requests), ARRIVALS: arrivals}
    return {name: _firestore().DELETE_FIELD for name in (WAITERS, ARRIVALS) if name in data}


def vacated(waiting_until: int) -> dict[str, Any]:
    """The fields of a release that keeps the document for its waiters: no lock, and
    the document's own expiry, the last waiter's (for cleanup and the TTL policy)."""
    delete = _firestore().DELETE_FIELD
    return {
        LOCK_ID: delete,
        FENCE: delete,
        ACQUIRED_AT_MS: delete,
        OWNER: delete,
        GRANT_TICKET: delete,
        GRANT_EXPIRES_AT_MS: delete,
        EXPIRES_AT_MS: waiting_until,
        PURGE_AT: purge_at(waiting_until),
    }


def queue_update(
    data: Mapping[str, Any],
    queue: Queue,
    arrivals: int,
    *,
    vacate: bool = False,
    now_ms: int | None = None,
    requests: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The update of a document that keeps waiters (``queue`` is not empty): the queue
    fields, and when the document may be purged. A document without a lock (or whose
    lock this write releases: ``vacate``) expires with its last waiter."""
    fields = queue_fields(data, queue, arrivals, now_ms, requests)
    waiting_until = last_until(queue) or 0
    if vacate:
        return {**fields, **vacated(waiting_until)}
    if not data.get(LOCK_ID):  # a waiter-only document
        return {**fields, EXPIRES_AT_MS: waiting_until, PURGE_AT: purge_at(waiting_until)}
    return {**fields, PURGE_AT: purge_at(max(int(data[EXPIRES_AT_MS]), waiting_until))}
