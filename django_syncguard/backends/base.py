"""The contract every backend fulfils, and the checks every backend shares.

A backend subclasses :class:`BaseLockBackend` and implements only storage I/O: the
``_acquire``, ``_release``, ``_extend``, ``_is_locked``, ``_lookup_by_key`` and
``_lookup_by_id`` methods (and their ``_a*`` async twins when it has a native async
client). The public methods validate every argument before any I/O, check
``cancel``, verify what the backend returned (ownership, fence format and limits)
and sanitize lookups, so no backend repeats that logic.
"""

from __future__ import annotations

import difflib
import logging
import threading
import unicodedata
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from functools import cached_property
from typing import Any, ClassVar, TypeVar

from asgiref.sync import sync_to_async

from ..cancellation import CancelToken, check_cancel, validate_cancel
from ..constants import (
    CLEANUP_GUARD_MS,
    DEFAULT_TTL_MS,
    MAX_BATCH_SIZE,
    MAX_KEY_LENGTH_BYTES,
    MAX_PAGE_SIZE,
)
from ..contract import SanitizedLookups
from ..errors import Internal, InvalidArgument, LockError, NetworkTimeout, ServiceUnavailable
from ..fence_floors import (
    FenceMode,
    FenceState,
    IdleCounter,
    compact,
    fence_mode_option,
    validate_floor,
    validate_idle_ms,
)
from ..fencing import check_fence
from ..keys import normalize_and_validate_key, validate_lock_id
from ..lifecycle import track
from ..orphans import OrphanReleaser, SentRequest
from ..owners import QueueStats, owner_label, pinned, record_owner_option
from ..results import (
    AcquireResult,
    Capabilities,
    ExtendResult,
    LockInfoDebug,
    LockPage,
    LockRecord,
    ReleaseResult,
    TimeAuthority,
)
from ..ttl import MAX_TTL_MS, validate_ttl
from ..waiting import WaitTicket, WakeUps

logger = logging.getLogger("django_syncguard.backends")

DEFAULT_CONNECT_TIMEOUT_MS = 5_000
DEFAULT_OPERATION_TIMEOUT_MS = 5_000

T = TypeVar("T")

_NO_TTL: Any = object()  # "this operation takes no TTL" (None is a bad TTL, not absence)


def _refuse_unknown_settings(alias: str, params: Mapping[str, Any]) -> None:
    """``InvalidArgument`` for a misspelled key of the alias's settings (``"OPTION"``)."""
    unknown = sorted(set(params) - SETTINGS_KEYS, key=str)
    if not unknown:
        return
    close = difflib.get_close_matches(str(unknown[0]), SETTINGS_KEYS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise InvalidArgument(
        f"Unknown setting {unknown[0]!r} in SYNCGUARD_BACKENDS[{alias!r}]; the settings are "
        f"{', '.join(sorted(SETTINGS_KEYS))}.{hint}"
    )


def _validated_prefix(prefix: object) -> str:
    if not isinstance(prefix, str):
        raise InvalidArgument(f"prefix must be a str, not {type(prefix).__name__}.")
    prefix = unicodedata.normalize("NFC", prefix)
    if len(prefix.encode("utf-8", "surrogatepass")) > MAX_KEY_LENGTH_BYTES:
        raise InvalidArgument(f"prefix must be at most {MAX_KEY_LENGTH_BYTES} bytes.")
    return prefix


def _validated_count(value: object, name: str, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= maximum:
        raise InvalidArgument(f"{name} must be an int between 1 and {maximum}, not {value!r}.")
    return value


def _lazily(make: Callable[[], Iterator[int]]) -> Iterator[int]:
    """``make()``'s items, with ``make`` called at the first ``next()``: no I/O before."""
    yield from make()


def _once(count: Callable[[], int]) -> Iterator[int]:
    """An iterator whose only item is ``count()``, called when it is consumed."""
    yield count()


def option_ms(options: Mapping[str, Any], name: str, default: int) -> int:
    """Read a positive millisecond option, e.g. ``OPERATION_TIMEOUT_MS``, of at most
    ``MAX_TTL_MS`` (beyond it, drivers' second-based timeouts overflow)."""
    value = positive_int_option(options, name, default, unit=" (ms)")
    if value > MAX_TTL_MS:
        raise InvalidArgument(f"OPTIONS[{name!r}] must be at most {MAX_TTL_MS} ms, not {value}.")
    return value


def positive_int_option(
    options: Mapping[str, Any], name: str, default: int, *, unit: str = ""
) -> int:
    """Read an option that must be a positive int, e.g. ``MAX_CONNECTIONS``."""
    value: object = options.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgument(f"OPTIONS[{name!r}] must be a positive int{unit}, not {value!r}.")
    return value


def mapping_option(options: Mapping[str, Any], name: str) -> dict[str, Any]:
    """Read an option that must be a dict (default empty), e.g. ``CLIENT_KWARGS``."""
    value = options.get(name, {})
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"OPTIONS[{name!r}] must be a dict, not {type(value).__name__}.")
    return dict(value)


#: The keys an alias's entry in ``SYNCGUARD_BACKENDS`` may have.
SETTINGS_KEYS = frozenset({"BACKEND", "LOCATION", "KEY_PREFIX", "OPTIONS"})


class BaseLockBackend(SanitizedLookups, ABC):
    """Base class of every lock backend; see the module docstring.

    ``params`` is the alias's entry in ``SYNCGUARD_BACKENDS`` (``LOCATION``,
    ``KEY_PREFIX``, ``OPTIONS``). Construction validates options but performs no I/O.
    """

    supports_fencing: ClassVar[bool] = True
    #: Options every backend accepts; subclasses extend it.
    known_options: ClassVar[frozenset[str]] = frozenset(
        {
            "CLEANUP_IN_IS_LOCKED",
            "CONNECT_TIMEOUT_MS",
            "FENCES",
            "OPERATION_TIMEOUT_MS",
            "RECORD_OWNER",
            "WAKE_UPS",
        }
    )
    #: ``OPTIONS["FENCES"]`` when not set: "counter", the specification's counter,
    #: where counters are as durable as the locks; "clock" where they can be lost.
    default_fence_mode: ClassVar[FenceMode] = "counter"
    #: Whether keys share a namespace that ``KEY_PREFIX`` divides (Redis); elsewhere
    #: tables or collections keep applications apart and ``KEY_PREFIX`` is refused.
    uses_key_prefix: ClassVar[bool] = False
    #: Whether the server may still run an acquire its caller gave up on (a server
    #: across a network or a process boundary); such acquires' lock ids are released
    #: in the background (:mod:`~django_syncguard.orphans`). Embedded stores: False.
    abandoned_requests_run: bool = False

    def __init__(self, alias: str = "default", params: Mapping[str, Any] | None = None) -> None:
        params = dict(params or {})
        _refuse_unknown_settings(alias, params)
        self.alias = alias
        self.location: str = params.get("LOCATION") or ""
        self.key_prefix: str = self._key_prefix(params)
        options = params.get("OPTIONS")
        if options is not None and not isinstance(options, Mapping):
            raise InvalidArgument(f"OPTIONS must be a dict, not {type(options).__name__}.")
        self.options: dict[str, Any] = dict(options or {})
        unknown = set(self.options) - self.known_options
        if unknown:
            raise InvalidArgument(
                f"Unknown OPTIONS for {type(self).__name__} (alias {alias!r}): "
                f"{', '.join(sorted(unknown))}. Known: {', '.join(sorted(self.known_options))}."
            )
        cleanup = self.options.get("CLEANUP_IN_IS_LOCKED", False)
        if not isinstance(cleanup, bool):
            raise InvalidArgument("OPTIONS['CLEANUP_IN_IS_LOCKED'] must be True or False.")
        self.cleanup_in_is_locked: bool = cleanup
        wake_ups = self.options.get("WAKE_UPS", True)
        if not isinstance(wake_ups, bool):
            raise InvalidArgument("OPTIONS['WAKE_UPS'] must be True or False.")
        #: False: waiters back off on the timer alone, without a queue (as before
        #: fair, notified waiting existed).
        self.wake_ups_enabled: bool = wake_ups
        self._wake_ups_mutex = threading.Lock()
        self.connect_timeout_ms = option_ms(
            self.options, "CONNECT_TIMEOUT_MS", DEFAULT_CONNECT_TIMEOUT_MS
        )
        self.operation_timeout_ms = option_ms(
            self.options, "OPERATION_TIMEOUT_MS", DEFAULT_OPERATION_TIMEOUT_MS
        )
        #: How new fences are computed (:mod:`django_syncguard.fence_floors`).
        self.fence_mode: FenceMode = fence_mode_option(self.options, self.default_fence_mode)
        #: Whether each lock stores its holder's label (:mod:`django_syncguard.owners`).
        self.record_owner: bool = record_owner_option(self.options)
        track(self)  # a forked child resets this backend (reset_after_fork)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} alias={self.alias!r}>"

    # A subclass states these facts as class attributes (``backend_name = "redis"``),
    # or as properties when they depend on its settings (the database backend's vendor).
    @property
    def backend_name(self) -> str:
        """Short name reported in ``capabilities.backend``."""
        return "base"

    @property
    def time_authority(self) -> TimeAuthority:
        """Whose clock decides expiry: the server's, or this process's."""
        return "server"

    @cached_property
    def capabilities(self) -> Capabilities:
        """What this backend offers; built on first use, once the facts are known."""
        return Capabilities(
            backend=self.backend_name,
            supports_fencing=self.supports_fencing,
            time_authority=self.time_authority,
        )

    def _key_prefix(self, params: Mapping[str, Any]) -> str:
        """``KEY_PREFIX`` (default ``"syncguard"``) where it has a meaning; elsewhere
        refused, and ``""``."""
        if not self.uses_key_prefix:
            if "KEY_PREFIX" in params:
                raise InvalidArgument(
                    f"KEY_PREFIX has no meaning for {type(self).__name__}: its locks live "
                    "in tables or collections of their own. Remove it (or name other "
                    "tables or collections in OPTIONS)."
                )
            return ""
        prefix = params.get("KEY_PREFIX", "syncguard")
        if not isinstance(prefix, str):
            raise InvalidArgument(f"KEY_PREFIX must be a str, not {type(prefix).__name__}.")
        try:
            prefix.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidArgument("KEY_PREFIX is not valid Unicode (a lone surrogate).") from exc
        return prefix

    @classmethod
    def check_settings(cls, alias: str, params: Mapping[str, Any]) -> list[Any]:
        """System-check errors about ``params`` that this class can tell without being
        built, each with its own id; the checks build the backend only when there are
        none (construction errors are ``syncguard.E003``). No I/O."""
        return []

    @classmethod
    def prepare_process(cls, alias: str, params: Mapping[str, Any]) -> None:
        """Set up, when the app is ready, what must be in place from the process's
        start for the lock alias ``alias`` (its ``SYNCGUARD_BACKENDS`` entry is
        ``params``), without building a backend and without I/O. Backends are built on
        first use, which may come too late to see what the process did before: the
        SQLite backend watches which transactions have written
        (``LockHandler.prepare_process``). Nothing by default; bad settings are the
        system checks' to report."""

    @property
    def grants(self) -> bool:
        """Whether a release hands the key to the first live waiter in the same atomic
        step (a :class:`~django_syncguard.waiting.Grant`), rather than only waking it
        to try again (``specs/decisions.md``, 48)."""
        return False

    @property
    def wake_ups(self) -> WakeUps | None:
        """This process's wake-up registry for this alias, or ``None`` when waiters
        only back off (``OPTIONS["WAKE_UPS"] = False``, or a backend without queues).
        Built on first use: a backend that is never waited on opens no channel."""
        if not self.wake_ups_enabled:
            return None
        with self._wake_ups_mutex:
            built: WakeUps | None = self.__dict__.get("_wake_ups_built")
            if built is None:
                built = self._make_wake_ups()
                self.__dict__["_wake_ups_built"] = built
            return built

    # ----------------------------------------------------------------- public API
    def acquire(
        self,
        key: str,
        ttl_ms: int = DEFAULT_TTL_MS,
        *,
        cancel: Any = None,
        ticket: WaitTicket | None = None,
    ) -> AcquireResult:
        """Try once to take ``key`` for ``ttl_ms`` milliseconds.

        Returns ``AcquireResult(ok=True, lock_id, expires_at_ms, fence)`` or
        ``AcquireResult(ok=False, reason="locked")``; raises ``LockError`` on failure.
        With a ``ticket`` (a waiter's; see :mod:`~django_syncguard.waiting`) a held key
        queues the ticket, and a free key is taken only by the first live ticket.
        """
        key, ttl_ms, cancel = self._key_args(key, cancel, ttl_ms)
        if ticket is not None:
            ticket = self._ticket_arg(ticket)
        with SentRequest() as sent:
            try:
                result = self._acquire(key, ttl_ms, cancel, ticket)
            except BaseException as exc:
                self._acquire_failed(key, sent, exc)
                raise
            if not result.ok and sent.maybe_written:
                self._acquire_failed(key, sent, None)
        return self._checked_acquire(result, key)

    async def aacquire(
        self,
        key: str,
        ttl_ms: int = DEFAULT_TTL_MS,
        *,
        cancel: Any = None,
        ticket: WaitTicket | None = None,
    ) -> AcquireResult:
        key, ttl_ms, cancel = self._key_args(key, cancel, ttl_ms)
        if ticket is not None:
            ticket = self._ticket_arg(ticket)
        with SentRequest() as sent:
            try:
                result = await self._aacquire(key, ttl_ms, cancel, ticket)
            except BaseException as exc:  # a cancelled task too: its request may be out
                self._acquire_failed(key, sent, exc)
                raise
            if not result.ok and sent.maybe_written:
                self._acquire_failed(key, sent, None)
        return self._checked_acquire(result, key)

    def withdraw(self, key: str, ticket_id: str) -> None:
        """Take ``ticket_id`` out of ``key``'s queue (a waiter gives up); when the key
        is free, the next live waiter is woken. Nothing to do without queues."""
        key, _, _ = self._key_args(key, None)
        if self.wake_ups is not None:
            self._withdraw(key, validate_lock_id(ticket_id))

    async def awithdraw(self, key: str, ticket_id: str) -> None:
        key, _, _ = self._key_args(key, None)
        if self.wake_ups is not None:
            await self._awithdraw(key, validate_lock_id(ticket_id))

    def release(self, lock_id: str, *, cancel: Any = None) -> ReleaseResult:
        """Release the lock ``lock_id`` names. ``ok=False`` when it was already gone.

        Safe to call without owning anything: it only ever removes that lock.
        """
        lock_id, _, cancel = self._id_args(lock_id, cancel)
        self._no_claim_needed(lock_id)
        return self._release(lock_id, cancel)

    async def arelease(self, lock_id: str, *, cancel: Any = None) -> ReleaseResult:
        lock_id, _, cancel = self._id_args(lock_id, cancel)
        self._no_claim_needed(lock_id)
        return await self._arelease(lock_id, cancel)

    def _no_claim_needed(self, lock_id: str) -> None:
        """A lock granted here and released before its process claimed it needs no
        claim (the release claims it); without a registry built, nothing was granted."""
        built = self._built_wake_ups()
        if built is not None:
            built.released(lock_id)

    def _built_wake_ups(self) -> WakeUps | None:
        """This backend's wake-ups if this process built them (a waiter did), without
        building them."""
        built: WakeUps | None = self.__dict__.get("_wake_ups_built")
        return built

    def extend(self, lock_id: str, ttl_ms: int, *, cancel: Any = None) -> ExtendResult:
        """Reset the expiry of a live lock to now + ``ttl_ms``; never revives a dead one."""
        lock_id, ttl_ms, cancel = self._id_args(lock_id, cancel, ttl_ms)
        return self._checked_extend(self._extend(lock_id, ttl_ms, cancel))

    async def aextend(self, lock_id: str, ttl_ms: int, *, cancel: Any = None) -> ExtendResult:
        lock_id, ttl_ms, cancel = self._id_args(lock_id, cancel, ttl_ms)
        return self._checked_extend(await self._aextend(lock_id, ttl_ms, cancel))

    def is_locked(self, key: str, *, cancel: Any = None) -> bool:
        """True while some live lock holds ``key``. Read-only unless
        ``OPTIONS["CLEANUP_IN_IS_LOCKED"]`` is set."""
        key, _, cancel = self._key_args(key, cancel)
        return bool(self._is_locked(key, cancel))

    async def ais_locked(self, key: str, *, cancel: Any = None) -> bool:
        key, _, cancel = self._key_args(key, cancel)
        return bool(await self._ais_locked(key, cancel))

    def lookup_raw(
        self, *, key: str | None = None, lock_id: str | None = None, cancel: Any = None
    ) -> LockInfoDebug | None:
        """Like :meth:`lookup` but with the raw ``key`` and ``lock_id``: for debugging."""
        by_key, value, cancel = self._lookup_args(key, lock_id, cancel)
        if by_key:
            return self._checked_record(self._lookup_by_key(value, cancel), key=value)
        return self._checked_record(self._lookup_by_id(value, cancel), lock_id=value)

    async def alookup_raw(
        self, *, key: str | None = None, lock_id: str | None = None, cancel: Any = None
    ) -> LockInfoDebug | None:
        by_key, value, cancel = self._lookup_args(key, lock_id, cancel)
        if by_key:
            return self._checked_record(await self._alookup_by_key(value, cancel), key=value)
        return self._checked_record(await self._alookup_by_id(value, cancel), lock_id=value)

    # ------------------------------------------------------------ housekeeping
    def list_locks(
        self, *, prefix: str = "", cursor: str | None = None, limit: int = 100
    ) -> LockPage:
        """One page of live locks whose key starts with ``prefix``.

        Pages follow the storage order (key order, except on Redis whose SCAN order is
        arbitrary); pass the returned ``next_cursor`` to get the next one. A page can
        hold fewer than ``limit`` records before the end (locks expired meanwhile) and,
        on Redis, somewhat more. For operators' tools: records carry raw keys and lock
        ids, which must never be shown as they are.
        """
        prefix = self._storable(_validated_prefix(prefix))
        if cursor is not None and not isinstance(cursor, str):
            raise InvalidArgument(f"cursor must be a str from a previous page, not {cursor!r}.")
        limit = _validated_count(limit, "limit", MAX_PAGE_SIZE)
        return self._list_locks(prefix, cursor, limit)

    async def alist_locks(
        self, *, prefix: str = "", cursor: str | None = None, limit: int = 100
    ) -> LockPage:
        return await self._in_thread(
            lambda: self.list_locks(prefix=prefix, cursor=cursor, limit=limit)
        )

    def delete_expired(self, *, batch_size: int = 500, dry_run: bool = False) -> Iterator[int]:
        """Delete lock records expired longer ago than the cleanup guard; return an
        iterator of the number deleted by each batch (with ``dry_run``: one number,
        how many would be deleted, and nothing written).

        The arguments are checked when this is called, before any I/O; the deletes
        happen as the iterator is consumed. Fence counters are never deleted. Safe
        beside live traffic: a record is only deleted if it is still expired by more
        than the guard at the moment of the delete, so no lock that could still be
        extended or re-acquired is touched.
        """
        batch_size = _validated_count(batch_size, "batch_size", MAX_BATCH_SIZE)
        if not isinstance(dry_run, bool):
            raise InvalidArgument("dry_run must be True or False.")
        if dry_run:
            return _once(self._count_expired)
        return self._delete_expired(batch_size)

    def force_release(self, key: str, lock_id_hash: str) -> ReleaseResult:
        """Release ``key``'s lock for its holder, if it is still the lock whose lock
        id hashes to ``lock_id_hash`` (what an operator saw in the inspector).

        An operator's tool: the holder is not told and its fenced writes keep being
        accepted until someone else takes the lock and writes with a newer fence.
        """
        key = self._storable(normalize_and_validate_key(key))
        if not isinstance(lock_id_hash, str):
            raise InvalidArgument("lock_id_hash must be the str shown by the inspector.")
        record = self._checked_record(self._lookup_by_key(key, None), key=key)
        if record is None or record.lock_id_hash != lock_id_hash:
            return ReleaseResult(ok=False, reason="not-found")
        return self.release(record.lock_id)

    async def aforce_release(self, key: str, lock_id_hash: str) -> ReleaseResult:
        return await self._in_thread(self.force_release, key, lock_id_hash)

    # ------------------------------------------------------- fence continuity
    def fence_state(self) -> FenceState:
        """The alias's fence mode, floor and highest counter (reads every counter's
        value on some backends: an operator's tool, not for a request path)."""
        return FenceState(self.alias, self.fence_mode, self._fence_floor(), self._highest_fence())

    def fence_floor(self) -> int:
        """The alias's fence floor (0: never raised): one read."""
        return self._fence_floor()

    def raise_fence_floor(self, fence: int) -> int:
        """Raise the alias's fence floor to at least ``fence`` (never lowers it);
        return the floor now in force. Every later fence of every key is above it."""
        return self._raise_fence_floor(validate_floor(fence))

    def compact_fences(
        self, *, idle_ms: int, batch_size: int = 500, dry_run: bool = False
    ) -> Iterator[int]:
        """Delete the fence counters of keys with no live lock, no waiter and no
        acquisition in the last ``idle_ms``, raising the floor first so that no key's
        fence ever goes back (:mod:`django_syncguard.fence_floors`). Returns an
        iterator of the number deleted by each batch (``dry_run``: one number, how
        many would be, nothing written). Arguments are checked before any I/O.

        A counter with no recorded acquisition time (kept by a version before this
        one) is stamped with the current time by a run that is not a dry run, and so
        compacted by a run ``idle_ms`` later.
        """
        idle_ms = validate_idle_ms(idle_ms)
        batch_size = _validated_count(batch_size, "batch_size", MAX_BATCH_SIZE)
        if not isinstance(dry_run, bool):
            raise InvalidArgument("dry_run must be True or False.")
        return _lazily(lambda: compact(self, self.now_ms() - idle_ms, batch_size, dry_run))

    def now_ms(self) -> int:
        """The time authority's clock, in Unix ms (the server's, on server backends)."""
        raise NotImplementedError

    def _fence_floor(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} keeps no fence floor.")

    def _raise_fence_floor(self, fence: int) -> int:
        """Set the floor to max(floor, ``fence``) atomically; return it."""
        raise NotImplementedError(f"{type(self).__name__} keeps no fence floor.")

    def _raise_floor_before_delete(self, counters: list[IdleCounter], fence: int) -> None:
        """Compaction, before deleting ``counters``: raise the floor every one of their
        keys reads to at least ``fence`` (the largest of theirs). One floor per alias:
        that floor. (A backend that keeps a floor per shard raises their shards'.)"""
        self._raise_fence_floor(fence)

    def _compaction_done(self, fence: int) -> None:
        """Compaction, after its last batch, ``fence`` the largest floor it raised
        (nothing with one floor per alias: it is raised already)."""

    def _highest_fence(self) -> int:
        """The largest value of any fence counter (0 when there is none)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no fence floor.")

    def _idle_counters(
        self, cutoff_ms: int, cursor: str | None, limit: int, *, stamp: bool
    ) -> tuple[list[IdleCounter], str | None]:
        """Up to ``limit`` counters after ``cursor`` (None: from the start) whose key
        has no live lock and no waiter and was last acquired before ``cutoff_ms``;
        and the cursor to go on from (None: the end). With ``stamp``, counters with
        no recorded acquisition time among those looked at get the current one."""
        raise NotImplementedError(f"{type(self).__name__} cannot compact fence counters.")

    def _delete_idle_counters(self, counters: list[IdleCounter], cutoff_ms: int) -> int:
        """Delete each of ``counters`` that is, atomically at its delete, still as
        read and still idle (no live lock, no waiter, not acquired since
        ``cutoff_ms``); return how many were deleted."""
        raise NotImplementedError(f"{type(self).__name__} cannot compact fence counters.")

    def check(self, **kwargs: Any) -> list[Any]:
        """System-check messages about this alias's built backend (no I/O); the app's
        check asks every alias (see ``checks.py``)."""
        return []

    def deploy_check(self) -> list[Any]:
        """Check messages that need the server (``manage.py check --deploy``)."""
        return []

    def close(self, **kwargs: Any) -> None:
        """Release connections; the handler calls it when settings change.
        Subclasses that override it call ``super().close()``."""
        built: WakeUps | None = self.__dict__.pop("_wake_ups_built", None)
        if built is not None:
            built.close()
        orphans: OrphanReleaser | None = self.__dict__.pop("_orphans_built", None)
        if orphans is not None:  # its release in flight ends within one operation
            orphans.stop(timeout_s=self.operation_timeout_ms / 1000 + 1)

    def reset_after_fork(self) -> None:
        """In a forked child (called by :mod:`~django_syncguard.lifecycle`, before the
        child runs code of its own): the parent's clients are forgotten, never closed,
        and the next call opens the child's own. Locks a parent thread may have held
        at the fork are replaced, not taken."""
        self._wake_ups_mutex = threading.Lock()
        # The parent's pending orphans are the parent's to release; its thread is
        # not running here.
        self.__dict__.pop("_orphans_built", None)
        self._forget_clients_after_fork()

    # -------------------------------------------------------------- orphans
    @property
    def orphans(self) -> OrphanReleaser:
        """The releaser of this backend's orphaned acquires (built on first use)."""
        with self._wake_ups_mutex:
            built: OrphanReleaser | None = self.__dict__.get("_orphans_built")
            if built is None:
                built = self.__dict__["_orphans_built"] = OrphanReleaser(self)
            return built

    def _acquire_failed(self, key: str, sent: SentRequest, error: BaseException | None) -> None:
        """An acquire of ``key`` raised ``error`` (``None``: it answered "locked"
        after a write of unknown outcome): when the server may still run or have
        applied it, its lock id is released in the background. Never raises: the
        caller gets the acquire's own outcome."""
        if sent.lock_id is None or not self.abandoned_requests_run:
            return
        if not sent.maybe_written and (
            error is None
            or (isinstance(error, LockError) and not self._acquire_may_have_run(error))
        ):
            return
        try:
            self.orphans.adopt(sent.lock_id, key, error)
        except Exception:  # a thread that cannot start, a failing log handler
            logger.exception("%s: could not hand a failed acquire to the releaser.", self.alias)

    def _acquire_may_have_run(self, error: LockError) -> bool:
        """Whether an acquire that raised ``error`` may have reached the server (a
        backend that can tell a refused connection from a lost reply narrows it)."""
        return isinstance(error, NetworkTimeout | ServiceUnavailable)

    def _forget_clients_after_fork(self) -> None:
        """Drop the clients inherited from the parent without closing them (a backend
        whose client library does not notice the fork by itself overrides this)."""

    def _make_wake_ups(self) -> WakeUps | None:
        """Build this backend's :class:`~django_syncguard.waiting.WakeUps` (``None``:
        no queues; waiters back off on the timer alone)."""
        return None

    def _withdraw(self, key: str, ticket_id: str) -> None:
        """Storage I/O of :meth:`withdraw` (backends with queues)."""

    async def _awithdraw(self, key: str, ticket_id: str) -> None:
        await self._in_thread(self._withdraw, key, ticket_id)

    # ------------------------------------------------------------ storage I/O
    @abstractmethod
    def _list_locks(self, prefix: str, cursor: str | None, limit: int) -> LockPage:
        """Storage I/O of :meth:`list_locks`."""

    @abstractmethod
    def _count_expired(self) -> int:
        """How many records ``delete_expired`` would delete now (its dry run)."""

    @abstractmethod
    def _delete_expired(self, batch_size: int) -> Iterator[int]:
        """Delete records past the cleanup guard in batches of at most ``batch_size``,
        yielding each batch's count (see :class:`BatchedCleanup`)."""

    @abstractmethod
    def _acquire(
        self, key: str, ttl_ms: int, cancel: CancelToken | None, ticket: WaitTicket | None = None
    ) -> AcquireResult:
        """Storage I/O of :meth:`acquire`; ``ticket`` is only ever passed when
        :meth:`_make_wake_ups` built a registry (the backend keeps queues)."""

    @abstractmethod
    def _release(self, lock_id: str, cancel: CancelToken | None) -> ReleaseResult:
        """Storage I/O of :meth:`release`."""

    @abstractmethod
    def _extend(self, lock_id: str, ttl_ms: int, cancel: CancelToken | None) -> ExtendResult:
        """Storage I/O of :meth:`extend`."""

    @abstractmethod
    def _is_locked(self, key: str, cancel: CancelToken | None) -> bool:
        """Storage I/O of :meth:`is_locked`."""

    @abstractmethod
    def _lookup_by_key(self, key: str, cancel: CancelToken | None) -> LockRecord | None:
        """Storage I/O of :meth:`lookup` by key: the live record of ``key``."""

    @abstractmethod
    def _lookup_by_id(self, lock_id: str, cancel: CancelToken | None) -> LockRecord | None:
        """Storage I/O of :meth:`lookup` by lock id: the live record it names."""

    # Async twins default to the sync I/O in a worker thread; backends with a native
    # async client override them.
    async def _aacquire(
        self, key: str, ttl_ms: int, cancel: CancelToken | None, ticket: WaitTicket | None = None
    ) -> AcquireResult:
        with pinned(self.record_owner):  # the label names this task, not the worker thread
            return await self._in_thread(self._acquire, key, ttl_ms, cancel, ticket)

    async def _arelease(self, lock_id: str, cancel: CancelToken | None) -> ReleaseResult:
        return await self._in_thread(self._release, lock_id, cancel)

    async def _aextend(self, lock_id: str, ttl_ms: int, cancel: CancelToken | None) -> ExtendResult:
        return await self._in_thread(self._extend, lock_id, ttl_ms, cancel)

    async def _ais_locked(self, key: str, cancel: CancelToken | None) -> bool:
        return await self._in_thread(self._is_locked, key, cancel)

    async def _alookup_by_key(self, key: str, cancel: CancelToken | None) -> LockRecord | None:
        return await self._in_thread(self._lookup_by_key, key, cancel)

    async def _alookup_by_id(self, lock_id: str, cancel: CancelToken | None) -> LockRecord | None:
        return await self._in_thread(self._lookup_by_id, lock_id, cancel)

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await sync_to_async(fn, thread_sensitive=True)(*args)

    # ------------------------------------------------------------------ owners
    def _owner(self) -> str | None:
        """The label a new lock stores: this caller's, or ``None`` when the alias
        does not record owners (``OPTIONS["RECORD_OWNER"] = False``)."""
        return owner_label() if self.record_owner else None

    def queue_stats(self, keys: list[str]) -> dict[str, QueueStats]:
        """The live waiters queued on each of ``keys`` (the user keys of the records
        ``list_locks`` returned; each backend derives its storage keys), for the
        inspector: one request for them all where the store allows. Keys nobody waits
        for are absent; a backend without queues (or with ``WAKE_UPS`` off) answers
        ``{}`` without I/O."""
        if not keys or self.wake_ups is None:
            return {}
        return self._queue_stats(list(keys))

    def _queue_stats(self, keys: list[str]) -> dict[str, QueueStats]:
        """Storage I/O of :meth:`queue_stats` (backends with queues)."""
        return {}

    # ------------------------------------------------------------ shared checks
    def _storable(self, key: str) -> str:
        """``key`` if this backend's storage can hold it; a backend with a narrower
        alphabet than the contract's raises ``InvalidArgument`` (before any I/O)."""
        return key

    @property
    def _cleanup_guard_ms(self) -> int:
        """How long past its expiry cleanup leaves a record alone."""
        return CLEANUP_GUARD_MS[self.time_authority]

    def _cleanup_cutoff(self, now_ms: int) -> int:
        """Records that expired before this instant may be deleted by cleanup."""
        return now_ms - self._cleanup_guard_ms

    def _key_args(
        self, key: Any, cancel: Any, ttl_ms: Any = _NO_TTL
    ) -> tuple[str, int, CancelToken | None]:
        key = self._storable(normalize_and_validate_key(key))
        ttl = 0 if ttl_ms is _NO_TTL else validate_ttl(ttl_ms)
        cancel = validate_cancel(cancel)
        if cancel is not None:  # (no context dict built for the usual call without one)
            check_cancel(cancel, {"key": key})
        return key, ttl, cancel

    def _id_args(
        self, lock_id: Any, cancel: Any, ttl_ms: Any = _NO_TTL
    ) -> tuple[str, int, CancelToken | None]:
        lock_id = validate_lock_id(lock_id)
        ttl = 0 if ttl_ms is _NO_TTL else validate_ttl(ttl_ms)
        cancel = validate_cancel(cancel)
        if cancel is not None:
            check_cancel(cancel, {"lock_id": lock_id})
        return lock_id, ttl, cancel

    def _lookup_args(
        self, key: Any, lock_id: Any, cancel: Any
    ) -> tuple[bool, str, CancelToken | None]:
        if (key is None) == (lock_id is None):
            raise InvalidArgument("lookup() takes exactly one of key= or lock_id=.")
        if key is not None:
            key, _, cancel = self._key_args(key, cancel)
            return True, key, cancel
        lock_id, _, cancel = self._id_args(lock_id, cancel)
        return False, lock_id, cancel

    def _ticket_arg(self, ticket: Any) -> WaitTicket | None:
        if ticket is None:
            return None
        if not isinstance(ticket, WaitTicket):
            raise InvalidArgument(f"ticket must be a WaitTicket, not {type(ticket).__name__}.")
        validate_lock_id(ticket.id)
        if self.wake_ups is None:
            return None  # no queues here: the waiter backs off on its timer
        return ticket

    def _checked_acquire(self, result: AcquireResult, key: str) -> AcquireResult:
        if not result.ok:
            return AcquireResult.locked(result.queue_position)
        if result.lock_id is None or result.expires_at_ms is None:
            raise Internal(f"{self.backend_name} returned an incomplete acquire result.")
        if self.supports_fencing:
            if result.fence is None:
                raise Internal(f"{self.backend_name} returned no fence.", context={"key": key})
            check_fence(result.fence, key)
        return result

    def _checked_extend(self, result: ExtendResult) -> ExtendResult:
        if result.ok and result.expires_at_ms is None:
            raise Internal(f"{self.backend_name} returned an extend result without expiry.")
        return result

    def _checked_record(
        self, record: LockRecord | None, *, key: str | None = None, lock_id: str | None = None
    ) -> LockInfoDebug | None:
        # Defence in depth (specs/contract.md, What the base class verifies): a record
        # found through an index or a hashed storage key must name exactly what was
        # asked for.
        if record is None:
            return None
        if (key is not None and record.key != key) or (
            lock_id is not None and record.lock_id != lock_id
        ):
            logger.warning("%s: lookup returned a record for another lock; ignored.", self)
            return None
        return record.debug_info()


class BatchedCleanup(ABC):
    """``_delete_expired`` for backends that delete by a bounded query: batches of
    ``_delete_expired_batch`` until one deletes nothing."""

    def _delete_expired(self, batch_size: int) -> Iterator[int]:
        while deleted := self._delete_expired_batch(batch_size):
            yield deleted

    @abstractmethod
    def _delete_expired_batch(self, batch_size: int) -> int:
        """Delete at most ``batch_size`` records past the guard; return how many."""
