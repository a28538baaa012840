"""The Firestore backend: compare-and-swap locks, with Firestore's own clock.

``OPTIONS``: ``PROJECT`` (default: the client library's usual discovery, e.g.
``GOOGLE_CLOUD_PROJECT``), ``DATABASE`` (default ``"(default)"``), ``COLLECTION``
(default ``"locks"``), ``FENCE_COLLECTION`` (default ``"fence_counters"``) and
``CLIENT_KWARGS`` (passed to ``google.cloud.firestore.Client``). Credentials are
found as the client library normally finds them; ``FIRESTORE_EMULATOR_HOST`` points
it at the emulator. Needs ``pip install "django-syncguard[firestore]"``.

Time authority is the **server**: every liveness decision and every returned expiry
uses the ``read_time`` Firestore stamps on the snapshots of that very operation, so
client clocks do not matter.

Waiters queue in the key's lock document (``waiters``, ``arrivals``), read and written
by the same guarded batches as the lock; a release that leaves waiters keeps the
document without its lock, and each process's :class:`FirestoreWakeUps` watches the
documents its waiters wait for (``wakeups.py``). The documents' fields are described
in ``documents.py``; ``client.py`` builds the clients and is the only module that
touches the client library's private attributes. See ``specs/backends/firestore.md``.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, TypeVar

from django.core import checks

from ...cancellation import CancelToken, check_cancel
from ...constants import TIME_TOLERANCE_MS
from ...errors import InvalidArgument, LockError, ServiceUnavailable
from ...fence_floors import IdleCounter, next_fence
from ...fencing import FENCE_MAX, fence_overflow_error, format_fence
from ...keys import generate_lock_id
from ...liveness import is_live
from ...orphans import note_maybe_written, note_sent, note_settled
from ...owners import QueueStats
from ...results import AcquireResult, ExtendResult, LockPage, LockRecord, ReleaseResult
from ...waiting import CHECK_IN_MS, Grant, Queue, WaitTicket, WakeUps, queue_admits, queue_head
from ...waiting.queues import unclaimed_expiry
from ..base import BaseLockBackend, BatchedCleanup, mapping_option
from .client import (
    FirestoreClients,
    _firestore,
    commit_may_have_applied,
    guard_failed,
    mapped_error,
    outcome_unknown,
)
from .documents import (
    ACQUIRED_AT_MS,
    ARRIVALS,
    COUNTER_ACQUIRED_AT_MS,
    COUNTER_FENCE,
    EXPIRES_AT_MS,
    FENCE,
    FLOOR,
    FLOOR_ID,
    GRANT_EXPIRES_AT_MS,
    GRANT_TICKET,
    KEY,
    LOCK_ID,
    OWNER,
    PURGE_AT,
    counter_id,
    document_id,
    fields_of,
    has_waiters,
    holds_lock,
    last_until,
    lock_document_of,
    lock_fields,
    purge_at,
    queue_fields,
    queue_of,
    queue_update,
    queued_since,
    request_of,
    server_ms,
    vacated,
)
from .wakeups import FirestoreWakeUps

logger = logging.getLogger("django_syncguard.backends.firestore")

T = TypeVar("T")

#: Attempts of a release or extend whose guarded write found the lock changed since
#: its read (e.g. renewed by auto-extend at that instant). Each starts over.
CONFLICT_ATTEMPTS = 5
#: Firestore's limit of writes in one batched write.
MAX_WRITES_PER_BATCH = 500
#: Locks this backend object acquired and still remembers (see ``_Held``).
HELD_MEMORY = 10_000

#: Above every character in Firestore's (UTF-8 byte) string order: the end of a prefix range.
_LAST_CHAR = "\U0010ffff"
#: Queries one inspector page may make while skipping expired documents.
_READS_PER_PAGE = 5
#: The field path of a document's id, for ordering and cursors.
_DOCUMENT_ID = "__name__"
_DESCENDING = "DESCENDING"

_COLLECTION_ID = re.compile(r"[^/]+")
_RESERVED_ID = re.compile(r"__.*__", re.DOTALL)


def validate_collection(name: Any, option: str) -> str:
    if (
        not isinstance(name, str)
        or not _COLLECTION_ID.fullmatch(name)
        or name in (".", "..")
        or _RESERVED_ID.fullmatch(name)
        or any("\ud800" <= char <= "\udfff" for char in name)  # not valid Unicode
        or len(name.encode()) > 1500
    ):
        raise InvalidArgument(
            f"OPTIONS[{option!r}] = {name!r} is not a valid Firestore collection id "
            "(non-empty, no '/', not '.' or '..', not __reserved__)."
        )
    return name


# System-check message of this backend (see checks.py for the table of ids).
I020 = (
    "Lock backend {alias!r} (Firestore): release, extend and lookup by lock id query "
    "collection {collection!r} on the field lockId; keep its single-field index (Firestore "
    "creates it unless an exemption removes it). A TTL policy on the field purgeAt may "
    "delete long-expired lock documents; it only saves storage, liveness is always "
    "checked on every operation, and fence counters live in another collection."
)


class FirestoreBackend(BatchedCleanup, BaseLockBackend):
    """Locks in Firestore; see the module docstring."""

    backend_name = "firestore"
    time_authority = "server"
    known_options: ClassVar[frozenset[str]] = BaseLockBackend.known_options | {
        "PROJECT",
        "DATABASE",
        "COLLECTION",
        "FENCE_COLLECTION",
        "CLIENT_KWARGS",
    }
    #: A commit whose deadline passed (or whose connection broke) may still apply.
    abandoned_requests_run = True

    def __init__(self, alias: str = "default", params: Mapping[str, Any] | None = None) -> None:
        super().__init__(alias, params)
        self.collection = validate_collection(self.options.get("COLLECTION", "locks"), "COLLECTION")
        self.fence_collection = validate_collection(
            self.options.get("FENCE_COLLECTION", "fence_counters"), "FENCE_COLLECTION"
        )
        if self.collection == self.fence_collection:
            raise InvalidArgument(
                "OPTIONS['COLLECTION'] and OPTIONS['FENCE_COLLECTION'] must differ: cleanup "
                "of lock documents must never reach fence counters."
            )
        self.project = self.options.get("PROJECT")
        self.database = self.options.get("DATABASE")
        self._client_kwargs = mapping_option(self.options, "CLIENT_KWARGS")
        self.clients = FirestoreClients(alias, self._client_options(), self.operation_timeout_ms)
        self._held = _Held()

    @property
    def grants(self) -> bool:
        # A release (or a withdrawal) writes the lock for the first live waiter in its
        # guarded batch; the waiter's Listen stream sees the document change and
        # delivers the grant (decision 48). Only where waiters queue.
        return self.wake_ups_enabled

    # --------------------------------------------------------------- clients
    def _client_options(self) -> dict[str, Any]:
        kwargs = dict(self._client_kwargs)
        if self.project:
            kwargs.setdefault("project", self.project)
        if self.database:
            kwargs.setdefault("database", self.database)
        return kwargs

    @property
    def client(self) -> Any:
        """The Firestore client (see :class:`~.client.FirestoreClients`)."""
        return self.clients.sync()

    def aclient(self) -> Any:
        """The ``AsyncClient`` of the running event loop (gRPC channels are per loop)."""
        return self.clients.for_loop()

    def close(self, **kwargs: Any) -> None:
        super().close()  # the wake-ups' stream first: it runs on the synchronous client
        self.clients.close()

    def _locks(self, client: Any = None) -> Any:
        return (client or self.client).collection(self.collection)

    def _refs(self, key: str, client: Any = None) -> tuple[Any, Any]:
        client = client or self.client
        lock_doc = document_id(key)
        return (
            client.collection(self.collection).document(lock_doc),
            self._fences(client).document(counter_id(lock_doc)),
        )

    def _fences(self, client: Any = None) -> Any:
        return (client or self.client).collection(self.fence_collection)

    def _floor_ref(self, client: Any = None) -> Any:
        return self._fences(client).document(FLOOR_ID)

    def _acquire_refs(self, key: str, client: Any = None) -> _AcquireRefs:
        """What an acquire reads in its one ``get_all``: the key's lock document, its
        fence counter, and the alias's fence floor."""
        return (*self._refs(key, client), self._floor_ref(client))

    def _refs_at(self, path: str, client: Any = None) -> _AcquireRefs:
        """The acquire's three documents for the lock document at ``path`` (what a
        release that may grant reads)."""
        client = client or self.client
        lock_ref = client.document(path)
        counter_ref = self._fences(client).document(counter_id(lock_ref.id))
        return lock_ref, counter_ref, self._floor_ref(client)

    def _by_lock_id(self, lock_id: str, client: Any = None) -> Any:
        # No limit: duplicates must be seen to be handled (specs/backends/firestore.md,
        # Operations: duplicates of one lock id).
        return self._locks(client).where(filter=_field(LOCK_ID, "==", lock_id))

    # ---------------------------------------------------------------- errors
    def _mapped(self, exc: Exception) -> Exception:
        """The exception to raise for ``exc``: a ``LockError`` for library errors."""
        return mapped_error(exc, self.alias)

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn``, mapping library errors to ``LockError``."""
        try:
            return fn()
        except Exception as exc:
            mapped = self._mapped(exc)
            if mapped is exc:
                raise
            raise mapped from exc

    async def _acall(self, awaitable: Awaitable[T]) -> T:
        try:
            return await awaitable
        except Exception as exc:
            mapped = self._mapped(exc)
            if mapped is exc:
                raise
            raise mapped from exc

    # ------------------------------------------------------ guarded batches
    @staticmethod
    def _unchanged(snap: Any) -> dict[str, Any]:
        """Write option: the document is still as ``snap`` saw it."""
        return _unchanged_since(snap.update_time)

    def _put(self, batch: Any, ref: Any, snap: Any, data: dict[str, Any]) -> None:
        """Write ``data`` as the whole document, only if it is still as ``snap`` saw it
        (still absent, or not updated since)."""
        if snap.exists:
            batch.update(ref, data, **self._unchanged(snap))  # every field is rewritten
        else:
            batch.create(ref, data)  # fails if someone created it meanwhile

    def _commit(self, batch: Any) -> bool | None:
        """Commit a guarded batch. False when a guard failed: a document changed (or
        appeared) since our read, and nothing was written. None when the outcome is
        unknown (``outcome_unknown``): the caller reads again, and every operation is
        written so that a second pass over a write that did apply answers as the
        first would have."""
        try:
            self._call(batch.commit)
        except LockError as exc:
            return self._failed_commit(exc)
        return True

    async def _acommit(self, batch: Any) -> bool | None:
        try:
            await self._acall(batch.commit())
        except LockError as exc:
            return self._failed_commit(exc)
        return True

    @staticmethod
    def _failed_commit(exc: LockError) -> bool | None:
        if guard_failed(exc):
            return False
        if outcome_unknown(exc):
            logger.info("A commit's outcome is unknown (%s); reading again.", exc.code)
            # Should the acquire end without learning it (its attempts used up, a
            # failed read), its lock id is released in the background.
            note_maybe_written()
            return None
        raise exc

    # --------------------------------------------------------------- acquire
    def _plan_acquire(
        self,
        batch: Any,
        key: str,
        ttl_ms: int,
        snaps: list[Any],
        refs: _AcquireRefs,
        cancel: CancelToken | None,
        ticket: WaitTicket | None,
        lock_id: str,
    ) -> _Plan:
        """Decide from the read: ``locked`` (perhaps with the guarded write of the
        caller's place in the queue), overflow, or fill ``batch`` with the guarded
        writes of a new lock under ``lock_id``. The plan's result is what the writes
        will make true; a read that shows the lock already ours (an earlier pass's
        commit applied, its answer lost) answers as that commit would have.

        The new fence is ``next_fence(counter, floor, now in clock mode)``. The three
        documents come from one ``get_all``, which shows every commit acknowledged
        before one it shows (specs/backends/firestore.md, Fence continuity): a counter
        read as absent because compaction deleted it comes with the floor compaction
        raised before deleting it; a counter read before its deletion fails its guard
        below, and the acquire reads again."""
        by_path = {snap.reference.path: snap for snap in snaps}
        lock_ref, fence_ref, floor_ref = refs
        current, counter = by_path[lock_ref.path], by_path[fence_ref.path]
        now = server_ms(current.read_time)  # Firestore's clock
        data = fields_of(current)
        free = not holds_lock(data, now)
        if not free and data.get(LOCK_ID) == lock_id:
            ours = AcquireResult(
                ok=True, lock_id=lock_id, expires_at_ms=int(data[EXPIRES_AT_MS]), fence=data[FENCE]
            )
            return _Plan(ours)
        if not free and ticket is not None and data.get(GRANT_TICKET) == ticket.id:
            return self._plan_crossed(batch, current, data)
        queue = queue_of(data)
        arrivals = int(data.get(ARRIVALS, 0))
        grant_first = False
        if free and queue:
            # Free, and another waiter is first: a lease ran out, or a grant lapsed,
            # and this attempt is the first to notice. It grants the key to that
            # waiter (in its own batch), and then meets the key held.
            first = self._grantable_head(data, dict(queue), now, counter, by_path[floor_ref.path])
            grant_first = first is not None and (ticket is None or first[0] != ticket.id)
            free = not grant_first
        if queue or (ticket is not None and not free):
            # Someone waits, or the caller will: the queue rule decides (waiting.py).
            before = queue.get(ticket.id) if ticket is not None else None
            take, position = queue_admits(
                queue, now, free=free, ticket=ticket, arrival=arrivals + 1
            )
            requests = None
            if ticket is not None and queue.get(ticket.id, (0, 0))[0] == arrivals + 1:
                arrivals += 1  # a new place was handed out
                if self.grants:  # with what a release would grant the key with
                    requests = {ticket.id: self._request(lock_id, ttl_ms)}
            if not take and grant_first:
                check_cancel(cancel, {"key": key})  # after reads, before writes
                self._plan_grant(batch, data, queue, snaps, refs, arrivals, requests)
                behind = None if position is None else position - 1  # the head has it
                return _Plan(AcquireResult.locked(behind), write=True, crossed=True)
            if not take:
                if ticket is None or not _renewal_due(before, queue[ticket.id], ticket, now):
                    return _Plan(AcquireResult.locked(position))
                check_cancel(cancel, {"key": key})  # after reads, before writes
                fields = queue_update(data, queue, arrivals, now_ms=now, requests=requests)
                batch.update(lock_ref, fields, **self._unchanged(current))
                return _Plan(AcquireResult.locked(position), write=True)
        elif not free:
            return _Plan(AcquireResult.locked())  # nobody waits: no write, as always
        previous = int(counter.get(COUNTER_FENCE)) if counter.exists else 0
        clock = now if self.fence_mode == "clock" else None
        fence = next_fence(previous, _floor_of(by_path[floor_ref.path]), clock)
        if fence > FENCE_MAX:
            raise fence_overflow_error(key)
        check_cancel(cancel, {"key": key})  # after reads, before writes
        expires = now + ttl_ms
        waiting_until = last_until(queue)
        lock = {
            **lock_fields(lock_id, key, format_fence(fence), now, expires, self._owner(), data),
            PURGE_AT: purge_at(max(expires, waiting_until or 0)),
            **queue_fields(data, queue, arrivals, now),
        }
        # The floor is read, not guarded: it only rises, and a raise that lands after
        # our read is followed by the deletes it protects, each of which either fails
        # its own guard (our counter write came first) or fails ours.
        self._put(
            batch,
            fence_ref,
            counter,
            {COUNTER_FENCE: format_fence(fence), COUNTER_ACQUIRED_AT_MS: now},
        )
        self._put(batch, lock_ref, current, lock)
        result = AcquireResult(
            ok=True, lock_id=lock_id, expires_at_ms=expires, fence=format_fence(fence)
        )
        return _Plan(
            result, write=True, waiting_until=waiting_until, new_counter=not counter.exists
        )

    def _request(self, lock_id: str, ttl_ms: int) -> dict[str, Any]:
        """A new place's grant record: what this acquire would write (documents.py)."""
        request: dict[str, Any] = {
            "lockId": lock_id,
            "ttlMs": ttl_ms,
            "clock": self.fence_mode == "clock",
        }
        owner = self._owner()
        if owner is not None:
            request["owner"] = owner
        return request

    def _plan_crossed(self, batch: Any, current: Any, data: Mapping[str, Any]) -> _Plan:
        """The caller's ticket was granted the key while its attempt was on the way
        (``data`` holds that live grant): the answer is the granted lock, claimed by
        this attempt's guarded write if nobody claimed it yet."""
        expires = int(data.get(GRANT_EXPIRES_AT_MS, data[EXPIRES_AT_MS]))
        result = AcquireResult(
            ok=True, lock_id=data[LOCK_ID], expires_at_ms=expires, fence=data[FENCE]
        )
        if GRANT_EXPIRES_AT_MS not in data:
            return _Plan(result, crossed=True)
        batch.update(current.reference, _claim_fields(data), **self._unchanged(current))
        return _Plan(result, write=True, crossed=True)

    def _plan_grant(
        self,
        batch: Any,
        data: Mapping[str, Any],
        queue: Queue,
        snaps: list[Any],
        refs: _AcquireRefs,
        arrivals: int | None = None,
        requests: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> bool:
        """The key of the lock document in ``snaps`` is free (or being freed by this
        batch): fill ``batch`` with the lock for the first live place of ``queue`` (its
        place leaves ``queue``), exactly as that waiter's acquire would write it, with
        a claim deadline; False (nothing written) when that place has no grant record,
        or its fence would pass the maximum (the waiter is only woken, and its own
        acquire reports that). ``queue`` has no lapsed places; ``now`` is the read's.
        ``arrivals`` and ``requests``: an acquire's new place written with the grant.

        The fence is chosen and guarded as the acquire's: the counter's guard (and the
        lock document's) fail the batch if either changed since the read."""
        by_path = {snap.reference.path: snap for snap in snaps}
        lock_ref, fence_ref, floor_ref = refs
        current, counter = by_path[lock_ref.path], by_path[fence_ref.path]
        now = server_ms(current.read_time)
        grantable = self._grantable_head(data, queue, now, counter, by_path[floor_ref.path])
        if grantable is None:
            return False
        head, request, fence = grantable
        del queue[head]
        ttl_ms, owner = int(request["ttlMs"]), request.get("owner")
        lease = now + ttl_ms
        lock = {
            **lock_fields(
                str(request["lockId"]),
                str(data[KEY]),
                format_fence(fence),
                now,
                unclaimed_expiry(now, ttl_ms),  # gone at the claim deadline unless claimed
                None if owner is None else str(owner),
                data,
            ),
            GRANT_TICKET: head,
            GRANT_EXPIRES_AT_MS: lease,
            PURGE_AT: purge_at(max(lease, last_until(queue) or 0)),
            **queue_fields(
                data,
                queue,
                int(data.get(ARRIVALS, 0)) if arrivals is None else arrivals,
                now,
                requests,
            ),
        }
        self._put(
            batch,
            fence_ref,
            counter,
            {COUNTER_FENCE: format_fence(fence), COUNTER_ACQUIRED_AT_MS: now},
        )
        batch.update(lock_ref, lock, **self._unchanged(current))
        return True

    def _grantable_head(
        self, data: Mapping[str, Any], queue: Queue, now: int, counter: Any, floor: Any
    ) -> tuple[str, Mapping[str, Any], int] | None:
        """The first live place of ``queue`` that a grant can go to: its ticket, its
        grant record and the fence it would get; None without grants, without a
        waiter, for a place without a record, or past the maximum fence."""
        head = queue_head(queue, now) if self.grants else None
        request = request_of(data, head) if head is not None else None
        if head is None or request is None:
            return None
        previous = int(counter.get(COUNTER_FENCE)) if counter.exists else 0
        fence = next_fence(previous, _floor_of(floor), now if request.get("clock") else None)
        return None if fence > FENCE_MAX else (head, request, fence)

    # If a guard fails, the lock or its counter changed between our read and our
    # write, and nothing was written. Usually another client took the lock: the next
    # read sees it live and answers "locked". But cleanup deleting the expired document
    # also fails the guard, and then the key is free: so read again rather than guess.
    # A waiter's write of its place fails the same way when another waiter or the
    # holder wrote first, and is decided again on a fresh read.
    #
    # An acquire that created the key's counter checks the floor once more before it
    # answers (decision 53): "still absent" cannot tell a counter that never existed
    # from one created and compacted away between our read and our commit, whose fence
    # the floor then carries. A floor at or above our fence means that may have
    # happened: the lock is given back and taken again above the floor.
    def _acquire(
        self, key: str, ttl_ms: int, cancel: CancelToken | None, ticket: WaitTicket | None = None
    ) -> AcquireResult:
        refs, lock_id, created = self._acquire_refs(key), generate_lock_id(), False
        for _ in range(CONFLICT_ATTEMPTS):
            snaps = self._call(lambda: list(self.client.get_all(list(refs))))
            batch = self.client.batch()
            plan = self._plan_acquire(batch, key, ttl_ms, snaps, refs, cancel, ticket, lock_id)
            if not plan.write:
                result = self._decided(plan, refs)
            else:
                if not plan.crossed:
                    note_sent(lock_id)  # only a commit can take the lock, not the reads before
                committed = self._commit(batch)
                created = _created(created, plan, committed)
                if not committed:
                    continue
                result = self._committed(plan, refs, batch)
            if not (created and _ours(result, lock_id)):
                return result
            note_maybe_written()  # should the check fail, the lock is released for us
            if _fence_of(result) > self._fence_floor():
                return result
            self._release(lock_id, None)
            note_settled()  # a later "locked" must not send the next lock id to orphans
            lock_id, created = generate_lock_id(), False
        return AcquireResult.locked()  # the lock kept changing under us: contention

    async def _aacquire(
        self, key: str, ttl_ms: int, cancel: CancelToken | None, ticket: WaitTicket | None = None
    ) -> AcquireResult:
        client = self.aclient()
        refs, lock_id, created = self._acquire_refs(key, client), generate_lock_id(), False
        for _ in range(CONFLICT_ATTEMPTS):
            snaps = await self._acall(_collect(client.get_all(list(refs))))
            batch = client.batch()
            plan = self._plan_acquire(batch, key, ttl_ms, snaps, refs, cancel, ticket, lock_id)
            if not plan.write:
                result = self._decided(plan, refs)
            else:
                if not plan.crossed:
                    note_sent(lock_id)
                committed = await self._acommit(batch)
                created = _created(created, plan, committed)
                if not committed:
                    continue
                result = self._committed(plan, refs, batch)
            if not (created and _ours(result, lock_id)):
                return result
            note_maybe_written()
            floor = await self._acall(_collect(client.get_all([refs[2]])))
            if _fence_of(result) > _floor_of(floor[0]):
                return result
            await self._arelease(lock_id, None)
            note_settled()
            lock_id, created = generate_lock_id(), False
        return AcquireResult.locked()

    def _committed(self, plan: _Plan, refs: _AcquireRefs, batch: Any) -> AcquireResult:
        if plan.crossed:
            return self._decided(plan, refs)
        if plan.result.ok:
            self._held.remember(plan.result, refs[0].path, batch, plan.waiting_until)
        return plan.result

    def _decided(self, plan: _Plan, refs: _AcquireRefs) -> AcquireResult:
        if plan.crossed and plan.result.ok:  # granted: its release reads the document
            assert plan.result.lock_id is not None
            self._held.remember_path(plan.result.lock_id, refs[0].path)
        return plan.result

    @staticmethod
    def _live(snap: Any, now: int) -> bool:
        return snap.exists and holds_lock(snap.to_dict() or {}, now)

    # ------------------------------------------------------------------ queue
    def _make_wake_ups(self) -> WakeUps:
        # One Listen stream per backend object and process, on this backend's client.
        return FirestoreWakeUps(
            f"firestore:{self.alias}",
            client=lambda: self.client,
            document=lambda key: self._refs(key)[0],
            timeout_s=self.operation_timeout_ms / 1000,
            claim=self._claim,
            granted=lambda key, grant: self._held.remember_path(
                grant.lock_id, self._refs(key)[0].path
            ),
        )

    def _plan_withdraw(
        self, batch: Any, snaps: list[Any], refs: _AcquireRefs, ticket_id: str
    ) -> bool:
        """Fill ``batch`` with the guarded removal of ``ticket_id`` from the queue, or,
        when the key was granted to it (claimed or not), the release of that lock;
        either way a key then free is granted to the next live waiter. False when the
        ticket is neither queued nor granted (nothing to write). Without a grant, the
        listeners of the key wake its next waiter when the document shows it free."""
        snap = next(s for s in snaps if s.reference.path == refs[0].path)
        data = fields_of(snap)
        now = server_ms(snap.read_time)
        queue = queue_of(data)
        queued = queue.pop(ticket_id, None) is not None
        granted = data.get(GRANT_TICKET) == ticket_id and holds_lock(data, now)
        if not queued and not granted:
            return False
        queue_head(queue, now)  # drops lapsed places
        if (granted or not holds_lock(data, now)) and self._plan_grant(
            batch, data, queue, snaps, refs
        ):
            return True
        if not queue and (granted or not data.get(LOCK_ID)):
            batch.delete(snap.reference, **self._unchanged(snap))  # nothing left in it
        else:
            fields = queue_update(data, queue, int(data.get(ARRIVALS, 0)), vacate=granted)
            batch.update(snap.reference, fields, **self._unchanged(snap))
        return True

    def _withdraw(self, key: str, ticket_id: str) -> None:
        refs = self._acquire_refs(key)
        for _ in range(CONFLICT_ATTEMPTS):
            snaps = self._call(lambda: list(self.client.get_all(list(refs))))
            batch = self.client.batch()
            if not self._plan_withdraw(batch, snaps, refs, ticket_id) or self._commit(batch):
                return
        logger.debug("Withdrawing a ticket kept conflicting; its place lapses by itself.")

    async def _awithdraw(self, key: str, ticket_id: str) -> None:
        client = self.aclient()
        refs = self._acquire_refs(key, client)
        for _ in range(CONFLICT_ATTEMPTS):
            snaps = await self._acall(_collect(client.get_all(list(refs))))
            batch = client.batch()
            if not self._plan_withdraw(batch, snaps, refs, ticket_id) or await self._acommit(batch):
                return
        logger.debug("Withdrawing a ticket kept conflicting; its place lapses by itself.")

    def _claim(self, key: str, grant: Grant) -> None:
        """Claim a grant delivered to a waiter of this process (from the wake-ups'
        thread): the lock gets its lease's expiry, if ``grant`` still holds the key and
        is not claimed yet. A grant found gone lapsed, or was released already."""
        ref = self._refs(key)[0]
        for _ in range(CONFLICT_ATTEMPTS):
            snap = self._call(ref.get)
            data = fields_of(snap)
            if (
                data.get(LOCK_ID) != grant.lock_id
                or GRANT_EXPIRES_AT_MS not in data
                or not holds_lock(data, server_ms(snap.read_time))
            ):
                logger.debug("A granted lock was claimed, gone or lapsed when claimed.")
                return
            batch = self.client.batch()
            batch.update(ref, _claim_fields(data), **self._unchanged(snap))
            if self._commit(batch):
                return
        logger.warning("Claiming a granted lock kept conflicting; it lapses unless released.")

    # ------------------------------------------------------- release, extend
    def _plan_mutation(
        self,
        batch: Any,
        found: list[Any],
        lock_id: str,
        cancel: CancelToken | None,
        apply: Callable[[Any, Any, int], Any],
    ) -> tuple[tuple[str, Any], bool]:
        """Decide from the lock-id query: ((outcome, value), whether to commit ``batch``).

        Keeps the documents that still carry ``lock_id`` (the stored lock id is
        re-checked, specs/contract.md); with duplicates (specs/backends/firestore.md)
        removes the expired ones and fails safe when several are live.
        """
        snaps = [s for s in found if s.get(LOCK_ID) == lock_id]
        if not snaps:
            return ("not-found", None), False
        now = server_ms(snaps[0].read_time)
        live = [s for s in snaps if self._live(s, now)]
        check_cancel(cancel, {"lock_id": lock_id})  # after reads, before writes
        if len(snaps) > 1:
            logger.warning(
                "%d lock documents carry one lock id (%d live); expired ones are removed.",
                len(snaps),
                len(live),
            )
            for snap in snaps:
                if snap not in live:
                    self._delete(batch, snap)
            if len(live) != 1:  # none to act on, or ambiguous: only clean up
                return (("expired" if not live else "not-found"), None), True
        elif not live:
            return ("expired", None), False
        return ("ok", apply(batch, live[0], now)), True

    def _mutate(
        self,
        lock_id: str,
        cancel: CancelToken | None,
        apply: Callable[[Any, Any, int], Any],
        *,
        release: bool = False,
        unknown: bool = False,
        found: list[Any] | None = None,
    ) -> tuple[str, Any]:
        """Query, verify, guarded batch; start over when a guard fails (the lock was
        renewed, released or replaced since the query), up to ``CONFLICT_ATTEMPTS``.
        After a commit of unknown outcome (``unknown``: perhaps an earlier one), a
        ``release`` that finds the lock id gone reports the release done: that commit
        applied. An extend simply applies again. ``found``: the first query's answer,
        when the caller made it."""
        for _ in range(CONFLICT_ATTEMPTS):
            if found is None:
                found = self._call(lambda: list(self._by_lock_id(lock_id).stream()))
            batch = self.client.batch()
            outcome, commit = self._plan_mutation(batch, found, lock_id, cancel, apply)
            if not commit:
                return _settled(outcome, release and unknown)
            committed = self._commit(batch)
            if committed:
                return outcome
            unknown, found = unknown or committed is None, None
        raise self._kept_changing()

    async def _amutate(
        self,
        lock_id: str,
        cancel: CancelToken | None,
        apply: Callable[[Any, Any, int], Any],
        *,
        release: bool = False,
        unknown: bool = False,
        found: list[Any] | None = None,
    ) -> tuple[str, Any]:
        client = self.aclient()
        for _ in range(CONFLICT_ATTEMPTS):
            if found is None:
                found = await self._acall(_collect(self._by_lock_id(lock_id, client).stream()))
            batch = client.batch()
            outcome, commit = self._plan_mutation(batch, found, lock_id, cancel, apply)
            if not commit:
                return _settled(outcome, release and unknown)
            committed = await self._acommit(batch)
            if committed:
                return outcome
            unknown, found = unknown or committed is None, None
        raise self._kept_changing()

    def _acquire_may_have_run(self, error: LockError) -> bool:
        return commit_may_have_applied(error)

    def _kept_changing(self, what: str = "the lock") -> ServiceUnavailable:
        return ServiceUnavailable(
            f"Firestore ({self.alias!r}): {what} kept changing during {CONFLICT_ATTEMPTS} attempts."
        )

    def _delete(self, batch: Any, snap: Any, now: int = 0) -> None:
        """Delete the document ``snap`` read, only if unchanged since (``now``: unused,
        the signature of a mutation for ``_mutate``)."""
        batch.delete(snap.reference, **self._unchanged(snap))

    def _vacate(self, batch: Any, snap: Any, now: int) -> None:
        """Release the lock of the document ``snap`` read, only if unchanged since:
        delete the document, or, while live waiters remain, only its lock fields (the
        listeners of the key then wake the first of them)."""
        data = fields_of(snap)
        queue = queue_of(data)
        queue_head(queue, now)  # drops lapsed places
        if not queue:
            batch.delete(snap.reference, **self._unchanged(snap))
            return
        fields = queue_update(data, queue, int(data.get(ARRIVALS, 0)), vacate=True)
        batch.update(snap.reference, fields, **self._unchanged(snap))

    def _renewal(self, ttl_ms: int) -> Callable[[Any, Any, int], int]:
        def renew(batch: Any, snap: Any, now: int) -> int:
            expires = now + ttl_ms
            data = fields_of(snap)
            waiting_until = last_until(queue_of(data)) or 0
            fields = {EXPIRES_AT_MS: expires, PURGE_AT: purge_at(max(expires, waiting_until))}
            if GRANT_EXPIRES_AT_MS in data:  # the holder's extend claims its grant
                fields[GRANT_EXPIRES_AT_MS] = _firestore().DELETE_FIELD
            batch.update(snap.reference, fields, **self._unchanged(snap))
            return expires

        return renew

    @staticmethod
    def _released(outcome: tuple[str, Any]) -> ReleaseResult:
        if outcome[0] == "ok":
            return ReleaseResult(ok=True)
        return ReleaseResult(ok=False, reason=outcome[0])  # type: ignore[arg-type]

    @staticmethod
    def _extended(outcome: tuple[str, Any]) -> ExtendResult:
        if outcome[0] == "ok":
            return ExtendResult(ok=True, expires_at_ms=outcome[1])
        return ExtendResult(ok=False, reason=outcome[0])  # type: ignore[arg-type]

    # Release of a lock this object acquired and never saw change: one guarded delete,
    # no query. The guard is the lock document's update time from our own acquire, so
    # the delete applies only if the document is still exactly our lock; if anything
    # changed it (an extend, a new holder, a waiter taking its place), the guard fails,
    # nothing is written, and the general path below decides. Liveness is judged at
    # the commit's server time; a lock found expired is reported so, its document
    # removed as cleanup would. When our acquire left waiters in the document, the
    # same guarded write removes only the lock fields.
    def _remembered_release(self, lock_id: str, client: Any) -> tuple[Any, Any] | None:
        held = self._held.forget(lock_id)
        if held is None:
            return None
        path, update_time, expires, waiting_until = held
        batch = client.batch()
        guard = _unchanged_since(update_time)
        if waiting_until is None:
            batch.delete(client.document(path), **guard)
        else:
            batch.update(client.document(path), vacated(waiting_until), **guard)
        return batch, expires

    @staticmethod
    def _released_at(batch: Any, expires: int) -> ReleaseResult:
        if is_live(expires, server_ms(batch.commit_time), TIME_TOLERANCE_MS):
            return ReleaseResult(ok=True)
        return ReleaseResult(ok=False, reason="expired")

    # With grants, a release that may find live waiters reads the lock document, its
    # counter and the floor in one get_all (the acquire's read) and, in one guarded
    # batch, either frees the key or writes the lock for the first live waiter that
    # left a grant record: the release and the grant are one atomic step. It reads
    # the document directly when its path is known (acquired, or granted, here);
    # otherwise the lock-id query finds it first. A release that leaves no waiter
    # keeps the one-RPC guarded delete above.
    def _plan_release(
        self,
        batch: Any,
        snaps: list[Any],
        refs: _AcquireRefs,
        lock_id: str,
        cancel: CancelToken | None,
    ) -> tuple[str, Any] | None:
        """Decide a release from the acquire's three documents: ("ok", None) with
        ``batch`` filled, ("expired", None) with nothing to write, or None when the
        document does not carry ``lock_id`` (the lock-id query decides)."""
        current = next(snap for snap in snaps if snap.reference.path == refs[0].path)
        data = fields_of(current)
        if data.get(LOCK_ID) != lock_id:
            return None
        now = server_ms(current.read_time)
        if not holds_lock(data, now):
            return ("expired", None)
        check_cancel(cancel, {"lock_id": lock_id})  # after reads, before writes
        queue = queue_of(data)
        queue_head(queue, now)  # drops lapsed places
        if self._plan_grant(batch, data, queue, snaps, refs):
            return ("ok", None)
        if not queue:
            batch.delete(current.reference, **self._unchanged(current))
        else:
            fields = queue_update(data, queue, int(data.get(ARRIVALS, 0)), vacate=True)
            batch.update(current.reference, fields, **self._unchanged(current))
        return ("ok", None)

    def _release_at(
        self, lock_id: str, refs: _AcquireRefs, cancel: CancelToken | None, unknown: bool
    ) -> tuple[tuple[str, Any] | None, bool]:
        """Release ``lock_id`` from the documents ``refs``: (the outcome, or None when
        the document does not carry it; whether a commit's outcome is unknown)."""
        for _ in range(CONFLICT_ATTEMPTS):
            snaps = self._call(lambda: list(self.client.get_all(list(refs))))
            batch = self.client.batch()
            outcome = self._plan_release(batch, snaps, refs, lock_id, cancel)
            if outcome is None or outcome[0] != "ok":
                return outcome, unknown
            committed = self._commit(batch)
            if committed:
                return outcome, unknown
            unknown = unknown or committed is None
        raise self._kept_changing()

    async def _arelease_at(
        self, lock_id: str, refs: _AcquireRefs, cancel: CancelToken | None, unknown: bool
    ) -> tuple[tuple[str, Any] | None, bool]:
        client = self.aclient()
        for _ in range(CONFLICT_ATTEMPTS):
            snaps = await self._acall(_collect(client.get_all(list(refs))))
            batch = client.batch()
            outcome = self._plan_release(batch, snaps, refs, lock_id, cancel)
            if outcome is None or outcome[0] != "ok":
                return outcome, unknown
            committed = await self._acommit(batch)
            if committed:
                return outcome, unknown
            unknown = unknown or committed is None
        raise self._kept_changing()

    def _grantable(self, found: list[Any], lock_id: str) -> Any:
        """The one document of the lock-id query that carries ``lock_id`` and has a live
        waiter a release could grant the key to, or None."""
        snaps = [snap for snap in found if snap.get(LOCK_ID) == lock_id]
        if not self.grants or len(snaps) != 1:
            return None
        data = fields_of(snaps[0])
        head = queue_head(queue_of(data), server_ms(snaps[0].read_time))
        return snaps[0] if head is not None and request_of(data, head) is not None else None

    def _release(self, lock_id: str, cancel: CancelToken | None) -> ReleaseResult:
        path, remembered = self._release_plan(lock_id, self.client)
        committed: bool | None = False
        if remembered is not None:
            committed = self._commit(remembered[0])
            if committed:
                return self._released_at(*remembered)
        unknown = committed is None
        if path is not None:
            outcome, unknown = self._release_at(lock_id, self._refs_at(path), cancel, unknown)
            if outcome is not None:
                return self._released(_settled(outcome, unknown))
        found = None
        if self.grants:
            found = self._call(lambda: list(self._by_lock_id(lock_id).stream()))
            snap = self._grantable(found, lock_id)
            if snap is not None:
                refs = self._refs_at(snap.reference.path)
                outcome, unknown = self._release_at(lock_id, refs, cancel, unknown)
                if outcome is not None:
                    return self._released(_settled(outcome, unknown))
                found = None  # changed meanwhile: the query decides afresh
        return self._released(
            self._mutate(lock_id, cancel, self._vacate, release=True, unknown=unknown, found=found)
        )

    async def _arelease(self, lock_id: str, cancel: CancelToken | None) -> ReleaseResult:
        client = self.aclient()
        path, remembered = self._release_plan(lock_id, client)
        committed: bool | None = False
        if remembered is not None:
            committed = await self._acommit(remembered[0])
            if committed:
                return self._released_at(*remembered)
        unknown = committed is None
        if path is not None:
            refs = self._refs_at(path, client)
            outcome, unknown = await self._arelease_at(lock_id, refs, cancel, unknown)
            if outcome is not None:
                return self._released(_settled(outcome, unknown))
        found = None
        if self.grants:
            found = await self._acall(_collect(self._by_lock_id(lock_id, client).stream()))
            snap = self._grantable(found, lock_id)
            if snap is not None:
                refs = self._refs_at(snap.reference.path, client)
                outcome, unknown = await self._arelease_at(lock_id, refs, cancel, unknown)
                if outcome is not None:
                    return self._released(_settled(outcome, unknown))
                found = None
        return self._released(
            await self._amutate(
                lock_id, cancel, self._vacate, release=True, unknown=unknown, found=found
            )
        )

    def _release_plan(self, lock_id: str, client: Any) -> tuple[str | None, tuple[Any, Any] | None]:
        """How to release ``lock_id``: the path of its document, when a release there
        may grant (a lock granted to a waiter here, or acquired here with waiters
        queued), to read before deciding; or the one-RPC guarded write of a lock this
        object acquired, to try first (its acquire left no waiter, or no grants)."""
        granted_path = self._held.forget_path(lock_id)
        held = self._held.peek(lock_id)
        if held is None:
            return (granted_path if self.grants else None), None
        if self.grants and held[3] is not None:  # waiters were there: read, then grant
            self._held.forget(lock_id)
            return held[0], None
        # The blind write fails only when the document changed since our acquire: the
        # lock-id query then decides (and hands over to the read of the document when
        # a waiter it could grant the key to has queued meanwhile).
        return None, self._remembered_release(lock_id, client)

    def _extend(self, lock_id: str, ttl_ms: int, cancel: CancelToken | None) -> ExtendResult:
        self._held.forget(lock_id)  # the document changes: later releases take the query
        return self._extended(self._mutate(lock_id, cancel, self._renewal(ttl_ms)))

    async def _aextend(self, lock_id: str, ttl_ms: int, cancel: CancelToken | None) -> ExtendResult:
        self._held.forget(lock_id)
        return self._extended(await self._amutate(lock_id, cancel, self._renewal(ttl_ms)))

    # ---------------------------------------------------------------- reads
    def _is_locked(self, key: str, cancel: CancelToken | None) -> bool:
        snap = self._call(self._refs(key)[0].get)
        live = self._live(snap, server_ms(snap.read_time))
        option = self._sweep_option(snap, live)
        if option is not None:
            try:  # best effort: the answer is already decided
                self._call(lambda: snap.reference.delete(**option))
            except LockError as exc:
                logger.info("Cleanup in is_locked skipped: %s", exc.code)
        return live

    async def _ais_locked(self, key: str, cancel: CancelToken | None) -> bool:
        snap = await self._acall(self._refs(key, self.aclient())[0].get())
        live = self._live(snap, server_ms(snap.read_time))
        option = self._sweep_option(snap, live)
        if option is not None:
            try:
                await self._acall(snap.reference.delete(**option))
            except LockError as exc:
                logger.info("Cleanup in is_locked skipped: %s", exc.code)
        return live

    def _sweep_option(self, snap: Any, live: bool) -> dict[str, Any] | None:
        """With CLEANUP_IN_IS_LOCKED: the guarded delete of a lock document expired more
        than the guard ago (None when there is nothing to sweep)."""
        if live or not snap.exists or not self.cleanup_in_is_locked:
            return None
        now = server_ms(snap.read_time)
        data = fields_of(snap)
        expires = int(data.get(EXPIRES_AT_MS, now))
        if expires >= self._cleanup_cutoff(now) or queue_head(queue_of(data), now):
            return None  # recent, or live waiters still hold their places in it
        return self._unchanged(snap)

    def _record(self, snap: Any) -> LockRecord:
        data = snap.to_dict()
        return LockRecord(
            key=data[KEY],
            lock_id=data[LOCK_ID],
            expires_at_ms=int(data[EXPIRES_AT_MS]),
            acquired_at_ms=int(data[ACQUIRED_AT_MS]),
            fence=data[FENCE],
            owner=data.get(OWNER),
        )

    def _live_record(self, snap: Any) -> LockRecord | None:
        return self._record(snap) if self._live(snap, server_ms(snap.read_time)) else None

    def _one_live(self, snaps: list[Any], lock_id: str) -> LockRecord | None:
        live = [s for s in snaps if s.get(LOCK_ID) == lock_id and self._live_record(s)]
        if len(live) > 1:
            logger.warning("%d live lock documents carry one lock id.", len(live))
        return self._record(live[0]) if len(live) == 1 else None

    def _lookup_by_key(self, key: str, cancel: CancelToken | None) -> LockRecord | None:
        return self._live_record(self._call(self._refs(key)[0].get))

    async def _alookup_by_key(self, key: str, cancel: CancelToken | None) -> LockRecord | None:
        return self._live_record(await self._acall(self._refs(key, self.aclient())[0].get()))

    def _lookup_by_id(self, lock_id: str, cancel: CancelToken | None) -> LockRecord | None:
        return self._one_live(self._call(lambda: list(self._by_lock_id(lock_id).stream())), lock_id)

    async def _alookup_by_id(self, lock_id: str, cancel: CancelToken | None) -> LockRecord | None:
        query = self._by_lock_id(lock_id, self.aclient())
        return self._one_live(await self._acall(_collect(query.stream())), lock_id)

    def _queue_stats(self, keys: list[str]) -> dict[str, QueueStats]:
        # The page's lock documents in one get_all.
        by_path = {self._refs(key)[0].path: key for key in keys}
        refs = [self._refs(key)[0] for key in keys]
        snaps = self._call(lambda: list(self.client.get_all(refs)))
        stats: dict[str, QueueStats] = {}
        for snap in snaps:
            if not snap.exists:
                continue
            live, since = queued_since(fields_of(snap), server_ms(snap.read_time))
            key = by_path.get(snap.reference.path)
            if live and key is not None:
                stats[key] = QueueStats(live, since)
        return stats

    # ---------------------------------------------------------- housekeeping
    def _list_locks(self, prefix: str, cursor: str | None, limit: int) -> LockPage:
        # Key order (the automatic single-field index on ``key``); expired documents
        # are skipped by Firestore's own clock, which may take a few reads to fill a page.
        query = self._locks().order_by(KEY)
        if prefix:
            query = query.where(filter=_field(KEY, ">=", prefix)).where(
                filter=_field(KEY, "<", prefix + _LAST_CHAR)
            )
        records: list[LockRecord] = []
        now: int | None = None
        for _ in range(_READS_PER_PAGE):
            page = query.start_after({KEY: cursor}) if cursor is not None else query
            wanted = limit + 1 - len(records)  # one more: is there a next page?
            snaps: list[Any] = self._call(partial(_streamed, page.limit(wanted)))
            for snap in snaps:
                now = server_ms(snap.read_time)
                if len(records) == limit:  # a further document: the page is full
                    return LockPage(tuple(records), cursor, now)
                cursor = snap.get(KEY)
                if self._live(snap, now):
                    records.append(self._record(snap))
            if len(snaps) < wanted:
                cursor = None  # the end of the collection
                break
        return LockPage(tuple(records), cursor, now if now is not None else self.now_ms())

    def _expired_query(self, cutoff: int) -> Any:
        return self._locks().where(filter=_field(EXPIRES_AT_MS, "<", cutoff))

    def _count_expired(self) -> int:
        query = self._expired_query(self._cleanup_cutoff(self.now_ms()))
        result = self._call(lambda: query.count().get())
        return int(result[0][0].value)

    def _delete_expired_batch(self, batch_size: int) -> int:
        # Firestore takes at most 500 writes per batched write.
        size = min(batch_size, MAX_WRITES_PER_BATCH)
        query = self._expired_query(self._cleanup_cutoff(self.now_ms())).limit(size)
        # A document whose lock expired long ago may still hold live waiters' places
        # (until the first of them takes the key): it stays.
        snaps = [s for s in self._call(lambda: list(query.stream())) if not has_waiters(s)]
        # A document that changed since the query (re-acquired) fails its guard.
        return self._write_each([partial(self._delete, snap=snap) for snap in snaps])

    def _write_each(self, writes: list[Callable[[Any], None]]) -> int:
        """Apply guarded ``writes`` (each adds one write to a batch) in batches of
        Firestore's maximum; how many applied. A batch is all or nothing: when one
        guard failed (its document changed since it was read), or the outcome is
        unknown, each write of that batch is committed again alone, and only those
        that then apply are counted (a write of unknown outcome counts as not applied;
        if it did apply, its guard now fails)."""
        applied = 0
        for start in range(0, len(writes), MAX_WRITES_PER_BATCH):
            chunk = writes[start : start + MAX_WRITES_PER_BATCH]
            batch = self.client.batch()
            for write in chunk:
                write(batch)
            if self._commit(batch):
                applied += len(chunk)
                continue
            for write in chunk:
                single = self.client.batch()
                write(single)
                applied += bool(self._commit(single))
        return applied

    def now_ms(self) -> int:
        """Firestore's clock: the read time of a (missing) document."""
        snap = self._call(lambda: self._locks().document("syncguard-clock").get())
        return server_ms(snap.read_time)

    # ------------------------------------------------------ fence continuity
    # The floor is the document FLOOR_ID of the fence collection; every counter holds
    # its last fence and when it was handed out (documents.py). Why no interleaving of
    # compaction and acquire makes a fence go back: specs/backends/firestore.md,
    # Fence continuity.
    def _fence_floor(self) -> int:
        # Through get_all, as the acquire's own reads go (the acquire's check after
        # creating a counter reads the floor here too).
        return _floor_of(self._call(lambda: list(self.client.get_all([self._floor_ref()])))[0])

    def _raise_fence_floor(self, fence: int) -> int:
        # Read, then a write guarded on that read (create if absent, else unchanged
        # since): a concurrent raise fails our guard, and we read its result again.
        ref = self._floor_ref()
        for _ in range(CONFLICT_ATTEMPTS):
            snap = self._call(ref.get)
            floor = _floor_of(snap)
            if floor >= fence:
                return floor
            batch = self.client.batch()
            self._put(batch, ref, snap, {FLOOR: format_fence(fence)})
            if self._commit(batch):
                return fence
            # A guard failed, or the outcome is unknown: the next read tells.
        raise self._kept_changing("the fence floor")

    def _highest_fence(self) -> int:
        # Fences are 15-digit strings: string order is numeric order, and the automatic
        # single-field index on ``fence`` serves the query. The floor document has no
        # ``fence`` field, so the query never returns it.
        query = self._fences().order_by(COUNTER_FENCE, direction=_DESCENDING).limit(1)
        snaps = self._call(partial(_streamed, query))
        return int(snaps[0].get(COUNTER_FENCE)) if snaps else 0

    def _idle_counters(
        self, cutoff_ms: int, cursor: str | None, limit: int, *, stamp: bool
    ) -> tuple[list[IdleCounter], str | None]:
        # Counters in document id order (cursor: the last id looked at). A page holds
        # at most one batched write's worth, so its deletes (or stamps) fit one batch.
        size = min(limit, MAX_WRITES_PER_BATCH)
        fences = self._fences()
        query = fences.order_by(_DOCUMENT_ID)
        if cursor is not None:
            query = query.start_after({_DOCUMENT_ID: fences.document(cursor)})
        snaps: list[Any] = self._call(partial(_streamed, query.limit(size)))
        next_cursor = snaps[-1].id if len(snaps) == size else None
        # The floor document, and a counter whose id is a hash (never made with the
        # current key limits, documents.lock_document_of), are skipped: without the
        # lock document there is no telling whether the key is idle.
        counters = {doc: snap for snap in snaps if (doc := lock_document_of(snap.id)) is not None}
        if not counters:
            return [], next_cursor
        unstamped = [s for s in counters.values() if COUNTER_ACQUIRED_AT_MS not in fields_of(s)]
        if stamp and unstamped:
            now = server_ms(unstamped[0].read_time)
            self._write_each([partial(_stamp, snap=snap, now=now) for snap in unstamped])
        locks = self._lock_documents(counters)
        idle = [
            IdleCounter(counter.id, int(counter.get(COUNTER_FENCE)), guard=counter.update_time)
            for doc, counter in counters.items()
            if int(fields_of(counter).get(COUNTER_ACQUIRED_AT_MS, cutoff_ms)) < cutoff_ms
            and _quiet(locks[doc])
        ]
        return idle, next_cursor

    def _delete_idle_counters(self, counters: list[IdleCounter], cutoff_ms: int) -> int:
        # Each delete is guarded by the update time the page read: any acquire since
        # rewrote the counter (acquiredAtMs included), so a counter still as read is
        # still not acquired since ``cutoff_ms``. The lock documents are read again for
        # what does not touch the counter: a waiter that queued since the page.
        by_doc = {doc: c for c in counters if (doc := lock_document_of(c.name)) is not None}
        if not by_doc:
            return 0
        locks = self._lock_documents(by_doc)
        fences = self._fences()
        return self._write_each(
            [
                partial(_delete_since, ref=fences.document(counter.name), update_time=counter.guard)
                for doc, counter in by_doc.items()
                if _quiet(locks[doc])
            ]
        )

    def _lock_documents(self, ids: Mapping[str, Any]) -> dict[str, Any]:
        """Snapshots of the lock documents ``ids``, read in one ``get_all``, by id."""
        locks = self._locks()
        refs = [locks.document(doc) for doc in ids]
        return {snap.id: snap for snap in self._call(lambda: list(self.client.get_all(refs)))}

    def deploy_check(self) -> list[Any]:
        return [
            checks.Info(
                I020.format(alias=self.alias, collection=self.collection), id="syncguard.I020"
            )
        ]


_Remembered = tuple[str, Any, int, int | None]
#: An acquire's reads: the lock document, its fence counter, the fence floor.
_AcquireRefs = tuple[Any, Any, Any]


class _Held:
    """Locks this backend object acquired: lock id -> (document path, the update time
    our acquire gave the document, expiry, when the last waiter our acquire left in
    the document lapses, or None). Bounded (oldest forgotten first) and only a
    shortcut: a lock not found here is released through the lock-id query."""

    def __init__(self) -> None:
        self._locks: OrderedDict[str, _Remembered] = OrderedDict()
        # Granted locks whose waiter is here: lock id -> document path (same bound).
        self._paths: OrderedDict[str, str] = OrderedDict()
        self._mutex = threading.Lock()

    def remember_path(self, lock_id: str, path: str) -> None:
        with self._mutex:
            self._paths[lock_id] = path
            if len(self._paths) > HELD_MEMORY:
                self._paths.popitem(last=False)

    def forget_path(self, lock_id: str) -> str | None:
        with self._mutex:
            return self._paths.pop(lock_id, None)

    def peek(self, lock_id: str) -> _Remembered | None:
        with self._mutex:
            return self._locks.get(lock_id)

    def remember(
        self, result: AcquireResult, path: str, batch: Any, waiting_until: int | None
    ) -> None:
        lock_write = batch.write_results[-1]  # the lock document is written last
        assert result.lock_id is not None and result.expires_at_ms is not None
        entry = (path, lock_write.update_time, result.expires_at_ms, waiting_until)
        with self._mutex:
            self._locks[result.lock_id] = entry
            if len(self._locks) > HELD_MEMORY:
                self._locks.popitem(last=False)

    def forget(self, lock_id: str) -> _Remembered | None:
        with self._mutex:
            return self._locks.pop(lock_id, None)


@dataclass(frozen=True, slots=True)
class _Plan:
    """What an acquire decided from its read: the result, whether the batch holds
    writes to commit first, and when the last waiter left in the document lapses."""

    result: AcquireResult
    write: bool = False
    waiting_until: int | None = None
    # A grant decided it: the result is the lock granted to the caller's ticket, or
    # ``locked`` after this attempt granted the key to the first waiter. Either way
    # the batch takes no lock id of this call.
    crossed: bool = False
    # The batch creates the key's fence counter (it was absent at the read).
    new_counter: bool = False


def _renewal_due(
    before: tuple[int, int] | None, after: tuple[int, int], ticket: WaitTicket, now: int
) -> bool:
    """Whether a waiter's attempt must write its place: a new place, or one written at
    least half a check-in (or half its patience) ago. A healthy waiter so renews at
    every check-in, and one polling fast (the first in line without wake-ups) writes
    the document twice a second, not at every attempt."""
    if before is None or before[0] != after[0]:
        return True
    written_ago = ticket.patience_ms - (before[1] - now)
    return written_ago >= min(CHECK_IN_MS // 2, ticket.patience_ms // 2)


def _settled(outcome: tuple[str, Any], released_unseen: bool) -> tuple[str, Any]:
    """``outcome``, or "ok" for a release whose lock id is gone after a commit of
    unknown outcome (``released_unseen``): that commit removed it."""
    if released_unseen and outcome[0] == "not-found":
        return ("ok", None)
    return outcome


def _claim_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    """The claim of the unclaimed grant ``data`` holds: the lease's expiry."""
    lease = int(data[GRANT_EXPIRES_AT_MS])
    return {
        EXPIRES_AT_MS: lease,
        GRANT_EXPIRES_AT_MS: _firestore().DELETE_FIELD,
        PURGE_AT: purge_at(max(lease, last_until(queue_of(data)) or 0)),
    }


def _quiet(lock: Any) -> bool:
    """Whether a lock document shows, at its read time, no live lock and no live
    waiter's place (a missing document: yes)."""
    return not holds_lock(fields_of(lock), server_ms(lock.read_time)) and not has_waiters(lock)


def _stamp(batch: Any, snap: Any, now: int) -> None:
    """Give a counter read without an acquisition time ``now``, only if unchanged since."""
    guard = _unchanged_since(snap.update_time)
    batch.update(snap.reference, {COUNTER_ACQUIRED_AT_MS: now}, **guard)


def _delete_since(batch: Any, ref: Any, update_time: Any) -> None:
    """Delete ``ref`` only if it was last written at ``update_time``."""
    batch.delete(ref, **_unchanged_since(update_time))


def _created(before: bool, plan: _Plan, committed: bool | None) -> bool:
    """Whether this acquire's lock id may have created the key's counter, after a
    commit of ``plan``: it did when the commit applied (True) or may have (None);
    a failed guard (False) wrote nothing, and an earlier unknown commit still counts."""
    return before if committed is False else before or plan.new_counter


def _ours(result: AcquireResult, lock_id: str) -> bool:
    """Whether ``result`` is the lock this attempt took under ``lock_id``."""
    return result.ok and result.lock_id == lock_id


def _fence_of(result: AcquireResult) -> int:
    assert result.fence is not None
    return int(result.fence)


def _floor_of(snap: Any) -> int:
    """The fence floor a read of the floor document shows (0: never raised)."""
    return int(snap.get(FLOOR)) if snap.exists else 0


def _unchanged_since(update_time: Any) -> dict[str, Any]:
    """Write option: the document was last written at ``update_time``."""
    return {"option": _firestore().Client.write_option(last_update_time=update_time)}


def _streamed(query: Any) -> list[Any]:
    return list(query.stream())


def _field(name: str, op: str, value: Any) -> Any:
    from google.cloud.firestore_v1.base_query import FieldFilter

    return FieldFilter(name, op, value)


async def _collect(items: Any) -> list[Any]:
    """A list from the async iterators of the async client."""
    if hasattr(items, "__aiter__"):
        return [item async for item in items]
    return list(await items)
