"""The Firestore backend: compare-and-swap locks, with Firestore's own clock.

``OPTIONS``: ``PROJECT`` (default: the client library's usual discovery, e.g.
``GOOGLE_CLOUD_PROJECT``), ``DATABASE`` (default ``"(default)"``), ``COLLECTION``
(default ``"locks"``), ``FENCE_COLLECTION`` (default ``"fence_counters"``) and
``CLIENT_KWARGS`` (passed to ``google.cloud.firestore.Client``). Credentials are
found as the client library normally finds them; ``FIRESTORE_EMULATOR_HOST`` points
it at the emulator. Needs ``pip install "django-syncguard[firestore]"``.

Time authority is the **server**: every liveness decision and every returned expiry
uses the ``read_time`` Firestore stamps on the snapshots of that very operation, so
client clocks do not matter. See ``specs/backends/firestore.md``.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from django.core.exceptions import ImproperlyConfigured

from ..cancellation import CancelToken, check_cancel
from ..constants import BACKEND_LIMITS, CLEANUP_GUARD_MS, RESERVE_BYTES, TIME_TOLERANCE_MS
from ..errors import (
    AuthFailed,
    Internal,
    InvalidArgument,
    LockError,
    NetworkTimeout,
    RateLimited,
    ServiceUnavailable,
)
from ..fencing import FENCE_MAX, fence_overflow_error, format_fence
from ..keys import generate_lock_id, hash_storage_key, make_storage_key
from ..liveness import is_live
from ..results import AcquireResult, ExtendResult, ReleaseResult
from .base import BaseLockBackend, LockRecord

logger = logging.getLogger("django_syncguard.backends.firestore")

T = TypeVar("T")

LIMIT_BYTES = BACKEND_LIMITS["FIRESTORE"]
RESERVE = RESERVE_BYTES["FIRESTORE"]
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_MS = dt.timedelta(milliseconds=1)

#: Attempts of a release or extend whose guarded write found the lock changed since
#: its read (e.g. renewed by auto-extend at that instant). Each starts over.
CONFLICT_ATTEMPTS = 5

_COLLECTION_ID = re.compile(r"[^/]+")
_RESERVED_ID = re.compile(r"__.*__", re.DOTALL)


def _firestore() -> Any:
    try:
        import google.cloud.firestore as firestore
    except ImportError as exc:
        raise ImproperlyConfigured(
            "The Firestore lock backend needs google-cloud-firestore: "
            'pip install "django-syncguard[firestore]".'
        ) from exc
    return firestore


def server_ms(read_time: dt.datetime) -> int:
    """A Firestore timestamp as whole Unix milliseconds."""
    return (read_time - _EPOCH) // _MS


def document_id(key: str) -> str:
    """The lock document id of ``key``: its storage key, or the hashed form when that is
    not a valid Firestore id (``a/b`` would be a path, ``.``, ``..`` and ``__x__`` are
    refused by Firestore): every valid key gets a document."""
    storage_key = make_storage_key("", key, LIMIT_BYTES, RESERVE)
    if "/" in storage_key or storage_key in (".", "..") or _RESERVED_ID.fullmatch(storage_key):
        return hash_storage_key("", key)
    return storage_key


def purge_at(expires_at_ms: int) -> dt.datetime:
    """When a TTL policy may delete a lock document: past expiry, tolerance and guard."""
    return _EPOCH + (expires_at_ms + CLEANUP_GUARD_MS["server"]) * _MS


def validate_collection(name: Any, option: str) -> str:
    if (
        not isinstance(name, str)
        or not _COLLECTION_ID.fullmatch(name)
        or name in (".", "..")
        or _RESERVED_ID.fullmatch(name)
        or len(name.encode()) > 1500
    ):
        raise InvalidArgument(
            f"OPTIONS[{option!r}] = {name!r} is not a valid Firestore collection id "
            "(non-empty, no '/', not '.' or '..', not __reserved__)."
        )
    return name


def map_firestore_error(exc: BaseException, alias: str) -> LockError:
    """The ``LockError`` for a google-api-core / google-auth exception."""
    from google.api_core import exceptions as api

    message = f"Firestore ({alias!r}): {exc}"
    table: tuple[tuple[Any, type[LockError]], ...] = (
        ((api.DeadlineExceeded, api.RetryError), NetworkTimeout),
        ((api.ServiceUnavailable, api.InternalServerError, api.Aborted), ServiceUnavailable),
        ((api.PermissionDenied, api.Unauthenticated), AuthFailed),
        ((api.InvalidArgument, api.FailedPrecondition), InvalidArgument),
        ((api.ResourceExhausted, api.TooManyRequests), RateLimited),
    )
    error_cls = next((cls for types, cls in table if isinstance(exc, types)), Internal)
    try:
        from google.auth.exceptions import DefaultCredentialsError

        if isinstance(exc, DefaultCredentialsError):
            error_cls = AuthFailed
    except ImportError:  # pragma: no cover - google-auth comes with the client
        pass
    return error_cls(message, context={"cause": exc})


class FirestoreBackend(BaseLockBackend):
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
        client_kwargs = self.options.get("CLIENT_KWARGS", {})
        if not isinstance(client_kwargs, Mapping):
            raise InvalidArgument("OPTIONS['CLIENT_KWARGS'] must be a dict.")
        self._client_kwargs = dict(client_kwargs)
        _firestore()  # fail at start-up, not at the first lock, when the extra is missing
        self._client: Any = None

    # ---------------------------------------------------------------- client
    @property
    def client(self) -> Any:
        """The Firestore client, built on first use with bounded calls."""
        if self._client is None:
            firestore = _firestore()
            kwargs = dict(self._client_kwargs)
            if self.project:
                kwargs.setdefault("project", self.project)
            if self.database:
                kwargs.setdefault("database", self.database)
            try:
                client = firestore.Client(**kwargs)
                _bound_every_call(client, self.operation_timeout_ms / 1000)
            except Exception as exc:
                raise map_firestore_error(exc, self.alias) from exc
            self._client = client
        return self._client

    def close(self, **kwargs: Any) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _locks(self) -> Any:
        return self.client.collection(self.collection)

    def _refs(self, key: str) -> tuple[Any, Any]:
        lock_doc = document_id(key)
        fence_doc = make_storage_key("", f"fence:{lock_doc}", LIMIT_BYTES, RESERVE)
        return (
            self._locks().document(lock_doc),
            self.client.collection(self.fence_collection).document(fence_doc),
        )

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn``, mapping library errors to ``LockError``."""
        from google.api_core.exceptions import GoogleAPIError

        try:
            return fn()
        except LockError:
            raise
        except (GoogleAPIError, ValueError) as exc:
            cause = exc.__cause__ if isinstance(exc, ValueError) else exc
            if cause is None:  # a ValueError of our own making, not the library's
                raise
            raise map_firestore_error(cause, self.alias) from exc
        except Exception as exc:
            if type(exc).__module__.startswith(("google.", "grpc")):
                raise map_firestore_error(exc, self.alias) from exc
            raise

    def _commit(self, batch: Any) -> bool:
        """Commit a batched write whose preconditions guard what we read.

        False when a precondition failed: a document changed (or appeared) since our
        read, so nothing was written. Any other failure is a ``LockError``.
        """
        from google.api_core.exceptions import AlreadyExists, Conflict, FailedPrecondition

        def commit() -> bool:
            try:
                batch.commit()
            except (FailedPrecondition, AlreadyExists, Conflict):
                return False
            return True

        return self._call(commit)

    def _unchanged(self, snap: Any) -> dict[str, Any]:
        """Write option: the document is still as ``snap`` saw it."""
        return {"option": self.client.write_option(last_update_time=snap.update_time)}

    def _put(self, batch: Any, ref: Any, snap: Any, data: dict[str, Any]) -> None:
        """Write ``data`` as the whole document, only if it is still as ``snap`` saw it
        (still absent, or not updated since)."""
        if snap.exists:
            batch.update(ref, data, **self._unchanged(snap))  # every field is rewritten
        else:
            batch.create(ref, data)  # fails if someone created it meanwhile

    # --------------------------------------------------------------- acquire
    def _acquire(self, key: str, ttl_ms: int, cancel: CancelToken | None) -> AcquireResult:
        lock_ref, fence_ref = self._refs(key)
        # One read of both documents; its read_time is "now".
        snaps = self._call(lambda: list(self.client.get_all([lock_ref, fence_ref])))
        by_path = {snap.reference.path: snap for snap in snaps}
        current, counter = by_path[lock_ref.path], by_path[fence_ref.path]
        now = server_ms(current.read_time)
        if self._live(current, now):
            return AcquireResult.locked()
        fence = (int(counter.get("fence")) if counter.exists else 0) + 1
        if fence > FENCE_MAX:
            raise fence_overflow_error(key)
        check_cancel(cancel, {"key": key})  # after reads, before writes
        lock_id = generate_lock_id()
        expires = now + ttl_ms
        lock = {
            "lockId": lock_id,
            "expiresAtMs": expires,
            "acquiredAtMs": now,
            "key": key,
            "fence": format_fence(fence),
            "purgeAt": purge_at(expires),
        }
        # One atomic batch, each write guarded by "unchanged since our read": if another
        # client took or changed this lock (or its counter) meanwhile, nothing is
        # written, and that is contention.
        batch = self.client.batch()
        self._put(batch, fence_ref, counter, {"fence": format_fence(fence)})
        self._put(batch, lock_ref, current, lock)
        if not self._commit(batch):
            return AcquireResult.locked()
        return AcquireResult(
            ok=True, lock_id=lock_id, expires_at_ms=expires, fence=format_fence(fence)
        )

    @staticmethod
    def _live(snap: Any, now: int) -> bool:
        if not snap.exists:
            return False
        data = snap.to_dict() or {}
        return bool(data.get("lockId")) and is_live(
            int(data["expiresAtMs"]), now, TIME_TOLERANCE_MS
        )

    # ------------------------------------------------------- release, extend
    def _mutate(
        self, lock_id: str, cancel: CancelToken | None, apply: Callable[[Any, Any, int], Any]
    ) -> tuple[str, Any]:
        """Resolve ``lock_id`` by query, verify what came back, and apply the change in
        one batch guarded by "unchanged since the query read it".

        Returns ("ok", value), ("expired", None) or ("not-found", None). When a guard
        fails (the lock was extended, released or replaced meanwhile) it starts over,
        up to ``CONFLICT_ATTEMPTS`` times.
        """
        for _ in range(CONFLICT_ATTEMPTS):
            outcome = self._mutate_once(lock_id, cancel, apply)
            if outcome is not None:
                return outcome
        raise ServiceUnavailable(
            f"Firestore ({self.alias!r}): the lock kept changing during "
            f"{CONFLICT_ATTEMPTS} attempts."
        )

    def _mutate_once(
        self, lock_id: str, cancel: CancelToken | None, apply: Callable[[Any, Any, int], Any]
    ) -> tuple[str, Any] | None:
        found = self._call(lambda: list(self._by_lock_id(lock_id).stream()))
        snaps = [s for s in found if s.get("lockId") == lock_id]  # ADR-003
        if not snaps:
            return "not-found", None
        now = server_ms(snaps[0].read_time)
        live = [s for s in snaps if self._live(s, now)]
        check_cancel(cancel, {"lock_id": lock_id})  # after reads, before writes
        batch = self.client.batch()
        if len(snaps) > 1:  # ADR-014: duplicates of one lock id
            logger.warning(
                "%d lock documents carry one lock id (%d live); expired ones are removed.",
                len(snaps),
                len(live),
            )
            for snap in snaps:
                if snap not in live:
                    batch.delete(snap.reference, **self._unchanged(snap))
            if len(live) != 1:  # none to act on, or ambiguous: fail safe, only clean up
                if not self._commit(batch):
                    return None
                return ("expired", None) if not live else ("not-found", None)
        elif not live:
            return "expired", None
        value = apply(batch, live[0], now)
        return ("ok", value) if self._commit(batch) else None

    def _by_lock_id(self, lock_id: str) -> Any:
        from google.cloud.firestore_v1.base_query import FieldFilter

        # No limit: duplicates must be seen to be handled (ADR-014).
        return self._locks().where(filter=FieldFilter("lockId", "==", lock_id))

    def _release(self, lock_id: str, cancel: CancelToken | None) -> ReleaseResult:
        def delete(batch: Any, snap: Any, now: int) -> None:
            batch.delete(snap.reference, **self._unchanged(snap))

        outcome, _ = self._mutate(lock_id, cancel, delete)
        if outcome == "ok":
            return ReleaseResult(ok=True)
        return ReleaseResult(ok=False, reason=outcome)  # type: ignore[arg-type]

    def _extend(self, lock_id: str, ttl_ms: int, cancel: CancelToken | None) -> ExtendResult:
        def renew(batch: Any, snap: Any, now: int) -> int:
            expires = now + ttl_ms
            batch.update(
                snap.reference,
                {"expiresAtMs": expires, "purgeAt": purge_at(expires)},
                **self._unchanged(snap),
            )
            return expires

        outcome, expires = self._mutate(lock_id, cancel, renew)
        if outcome == "ok":
            return ExtendResult(ok=True, expires_at_ms=expires)
        return ExtendResult(ok=False, reason=outcome)  # type: ignore[arg-type]

    # ---------------------------------------------------------------- reads
    def _is_locked(self, key: str, cancel: CancelToken | None) -> bool:
        lock_ref, _ = self._refs(key)
        snap = self._call(lambda: lock_ref.get())
        now = server_ms(snap.read_time)
        live = self._live(snap, now)
        if not live and snap.exists and self.cleanup_in_is_locked:
            self._sweep(snap, now)
        return live

    def _sweep(self, snap: Any, now: int) -> None:
        """Delete a long-expired lock document unless it changed since we read it."""
        expires = int((snap.to_dict() or {}).get("expiresAtMs", now))
        if now - expires <= CLEANUP_GUARD_MS["server"]:
            return
        option = self.client.write_option(last_update_time=snap.update_time)
        try:
            self._call(lambda: snap.reference.delete(option=option))
        except LockError as exc:  # best effort: the answer is already decided
            logger.info("Cleanup in is_locked skipped: %s", exc.code)

    def _record(self, snap: Any) -> LockRecord:
        data = snap.to_dict()
        return LockRecord(
            key=data["key"],
            lock_id=data["lockId"],
            expires_at_ms=int(data["expiresAtMs"]),
            acquired_at_ms=int(data["acquiredAtMs"]),
            fence=data["fence"],
        )

    def _lookup_by_key(self, key: str, cancel: CancelToken | None) -> LockRecord | None:
        lock_ref, _ = self._refs(key)
        snap = self._call(lambda: lock_ref.get())
        return self._record(snap) if self._live(snap, server_ms(snap.read_time)) else None

    def _lookup_by_id(self, lock_id: str, cancel: CancelToken | None) -> LockRecord | None:
        snaps = self._call(lambda: list(self._by_lock_id(lock_id).stream()))
        live = [
            s for s in snaps if s.get("lockId") == lock_id and self._live(s, server_ms(s.read_time))
        ]
        if len(live) != 1:
            if len(live) > 1:
                logger.warning("%d live lock documents carry one lock id.", len(live))
            return None
        return self._record(live[0])

    def now_ms(self) -> int:
        """Firestore's clock: the read time of a (missing) document."""
        snap = self._call(lambda: self._locks().document("syncguard-clock").get())
        return server_ms(snap.read_time)

    # The client is thread-safe: async twins may run in any worker thread.
    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        from asgiref.sync import sync_to_async

        return await sync_to_async(fn, thread_sensitive=False)(*args)

    def deploy_check(self) -> list[Any]:
        from django.core import checks

        from ..checks import I020

        return [
            checks.Info(
                I020.format(alias=self.alias, collection=self.collection), id="syncguard.I020"
            )
        ]


def _bound_every_call(client: Any, timeout_s: float) -> None:
    """Give every RPC of ``client`` no retries and ``timeout_s``.

    The generated client retries most calls for up to 60 s by default, and the
    transaction calls (begin, commit, rollback) take no per-call settings, so the
    defaults are replaced once, on the client's transport.
    """
    from google.api_core import gapic_v1

    transport = client._firestore_api._transport
    for method in list(transport._wrapped_methods):
        transport._wrapped_methods[method] = gapic_v1.method.wrap_method(  # type: ignore[no-untyped-call]
            method, default_retry=None, default_timeout=timeout_s
        )
