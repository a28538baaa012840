"""The exceptions django-syncguard raises.

::

    SyncGuardError
    ├── LockError(code, message=None, context=None)   .code is one of ERROR_CODES
    │   ├── ServiceUnavailable     server down, refused, conflict
    │   ├── AuthFailed             bad credentials or permissions
    │   ├── InvalidArgument        bad key, lock id, TTL, option (also a ValueError)
    │   ├── RateLimited            quota or throttling
    │   ├── NetworkTimeout         an operation or connect timeout ran out
    │   ├── AcquisitionTimeout     lock()/locked() gave up retrying
    │   ├── Aborted                the caller's ``cancel`` was set
    │   └── Internal               anything unexpected, fence overflow
    └── StaleFenceError            fenced_update() met a newer fence

``LockError("Aborted")`` builds an :class:`Aborted`, so ``except Aborted`` and
``except LockError as e: e.code == "Aborted"`` are equivalent. Driver exceptions
are never raised as they are: backends map them to a ``LockError`` and chain the
original (``raise ... from exc``; also kept as ``context["cause"]``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Final, Literal

ErrorCode = Literal[
    "ServiceUnavailable",
    "AuthFailed",
    "InvalidArgument",
    "RateLimited",
    "NetworkTimeout",
    "AcquisitionTimeout",
    "Aborted",
    "Internal",
]

ERROR_CODES: Final[tuple[str, ...]] = (
    "ServiceUnavailable",
    "AuthFailed",
    "InvalidArgument",
    "RateLimited",
    "NetworkTimeout",
    "AcquisitionTimeout",
    "Aborted",
    "Internal",
)


class SyncGuardError(Exception):
    """Root of every exception this package raises."""


class LockError(SyncGuardError):
    """A system failure of a lock operation (domain outcomes are results, not errors).

    ``code`` classifies the failure; ``context`` may hold ``key``, ``lock_id`` and
    ``cause``. The message never contains a raw lock id.
    """

    #: Set on each subclass; ``None`` on ``LockError`` itself.
    fixed_code: ClassVar[str | None] = None
    _by_code: ClassVar[dict[str, type[LockError]]] = {}

    code: str
    context: dict[str, Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> LockError:
        if cls is LockError:
            code = kwargs.get("code", args[0] if args else None)
            cls = LockError._by_code.get(code, LockError) if isinstance(code, str) else cls
        return super().__new__(cls)

    def __init__(
        self,
        code: str | None = None,
        message: str | None = None,
        context: dict[str, Any] | None = None,
    ) -> None:
        fixed = type(self).fixed_code
        if fixed is not None and code not in (None, fixed):
            # Called as ``Aborted("message"[, context])``: the first argument is the message.
            if isinstance(message, dict) and context is None:
                context = message
            message, code = code, fixed
        code = code or fixed
        if code not in ERROR_CODES:
            raise ValueError(f"Unknown LockError code {code!r}; expected one of {ERROR_CODES}.")
        self.code = code
        self.message = message or code
        self.context = dict(context or {})
        super().__init__(self.message)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.fixed_code is not None:
            LockError._by_code.setdefault(cls.fixed_code, cls)

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors cross process borders (multiprocessing, Celery); the cause may not pickle.
        context = {k: v for k, v in self.context.items() if k != "cause"}
        return (_rebuild_lock_error, (self.code, self.message, context))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"


def _rebuild_lock_error(code: str, message: str, context: dict[str, Any]) -> LockError:
    return LockError(code, message, context)


class ServiceUnavailable(LockError):
    """The backend could not be reached, refused the call, or hit a conflict."""

    fixed_code = "ServiceUnavailable"


class AuthFailed(LockError):
    """The backend rejected the credentials or the permissions."""

    fixed_code = "AuthFailed"


class InvalidArgument(LockError, ValueError):
    """An argument or option is malformed; raised before any I/O."""

    fixed_code = "InvalidArgument"


class RateLimited(LockError):
    """The backend throttled the call or a quota ran out."""

    fixed_code = "RateLimited"


class NetworkTimeout(LockError):
    """A connect or operation timeout ran out."""

    fixed_code = "NetworkTimeout"


class AcquisitionTimeout(LockError):
    """``lock()`` / ``locked()`` could not acquire within its retries and timeout."""

    fixed_code = "AcquisitionTimeout"


class Aborted(LockError):
    """The caller's ``cancel`` was set, or the task was cancelled."""

    fixed_code = "Aborted"


class Internal(LockError):
    """An unexpected backend condition, including fence overflow."""

    fixed_code = "Internal"


class StaleFenceError(SyncGuardError):
    """A fenced write met a row whose fence is newer than the writer's.

    The writer's lock expired and another holder has written since: the write was
    not applied. ``fence`` is the writer's fence.
    """

    def __init__(self, fence: str, message: str | None = None) -> None:
        self.fence = fence
        super().__init__(
            message or f"Stale fence {fence}: a newer holder has already written this row."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (StaleFenceError, (self.fence, str(self)))
