"""The exceptions django-syncguard raises.

::

    SyncGuardError
    ├── LockError(code, message=None, context=None)   .code is one of ERROR_CODES
    │   ├── TransientError         worth retrying later:
    │   │   ├── ServiceUnavailable     server down, refused, conflict
    │   │   ├── RateLimited            quota or throttling
    │   │   └── NetworkTimeout         an operation or connect timeout ran out
    │   ├── AuthFailed             bad credentials or permissions
    │   ├── InvalidArgument        bad key, lock id, TTL, option (also a ValueError)
    │   ├── AcquisitionTimeout     lock()/locked() gave up retrying
    │   ├── Aborted                the caller's ``cancel`` was set
    │   └── Internal               anything unexpected, fence overflow
    └── StaleFenceError            fenced_update() met a newer fence

Each subclass fixes its code and takes the message first (``Aborted("stop")``).
``LockError("Aborted", "stop")`` is a plain ``LockError`` with that code; the package
itself always raises the subclass, so ``except Aborted`` and
``except LockError as e: e.code == "Aborted"`` catch the same errors, and
``LockError.for_code(code, ...)`` builds the subclass from a code. Driver exceptions
are never raised as they are: backends map them to a ``LockError`` and chain the
original (``raise ... from exc``; also kept as ``context["cause"]``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Final, Literal, get_args

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

ERROR_CODES: Final[tuple[str, ...]] = get_args(ErrorCode)


class SyncGuardError(Exception):
    """Root of every exception this package raises."""


class LockError(SyncGuardError):
    """A system failure of a lock operation (domain outcomes are results, not errors).

    ``code`` classifies the failure; ``context`` may hold ``key``, ``key_hash``,
    ``lock_id`` and ``cause``. The message never contains a raw lock id.
    """

    code: str
    context: dict[str, Any]

    def __init__(
        self, code: str, message: str | None = None, context: dict[str, Any] | None = None
    ) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"Unknown LockError code {code!r}; expected one of {ERROR_CODES}.")
        self.code = code
        self.message = message or code
        self.context = dict(context or {})
        super().__init__(self.message)

    @staticmethod
    def for_code(
        code: str, message: str | None = None, context: dict[str, Any] | None = None
    ) -> LockError:
        """The error of ``code`` as its subclass (``for_code("Aborted")`` is an
        :class:`Aborted`); ``LockError(code)`` itself stays a plain ``LockError``."""
        error_cls = _BY_CODE.get(code)
        if error_cls is None:
            return LockError(code, message, context)
        return error_cls(message, context)

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors cross process borders (multiprocessing, Celery); the cause may not pickle.
        context = {k: v for k, v in self.context.items() if k != "cause"}
        return (_rebuild_lock_error, (type(self), self.code, self.message, context))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"


def _rebuild_lock_error(
    cls: type[LockError], code: str, message: str, context: dict[str, Any]
) -> LockError:
    error = cls.__new__(cls)
    LockError.__init__(error, code, message, context)
    return error


class _CodedError(LockError):
    """A ``LockError`` whose class fixes the code: built as ``Aborted(message, context)``."""

    fixed_code: ClassVar[str]

    def __init__(self, message: str | None = None, context: dict[str, Any] | None = None) -> None:
        code = getattr(type(self), "fixed_code", None)
        if code is None:
            raise TypeError(
                f"{type(self).__name__} is a base to catch; raise one of its subclasses."
            )
        super().__init__(code, message, context)


class TransientError(_CodedError):
    """Base of the codes worth retrying later: the server may answer next time."""


class ServiceUnavailable(TransientError):
    """The backend could not be reached, refused the call, or hit a conflict."""

    fixed_code = "ServiceUnavailable"


class AuthFailed(_CodedError):
    """The backend rejected the credentials or the permissions."""

    fixed_code = "AuthFailed"


class InvalidArgument(_CodedError, ValueError):
    """An argument or option is malformed; raised before any I/O."""

    fixed_code = "InvalidArgument"


class RateLimited(TransientError):
    """The backend throttled the call or a quota ran out."""

    fixed_code = "RateLimited"


class NetworkTimeout(TransientError):
    """A connect or operation timeout ran out."""

    fixed_code = "NetworkTimeout"


class AcquisitionTimeout(_CodedError):
    """``lock()`` / ``locked()`` could not acquire within its retries and timeout."""

    fixed_code = "AcquisitionTimeout"


class Aborted(_CodedError):
    """The caller's ``cancel`` was set, or the task was cancelled."""

    fixed_code = "Aborted"


class Internal(_CodedError):
    """An unexpected backend condition, including fence overflow."""

    fixed_code = "Internal"


def _coded(base: type[_CodedError]) -> dict[str, type[_CodedError]]:
    """The subclasses of ``base`` that fix a code, by code."""
    found: dict[str, type[_CodedError]] = {}
    for cls in base.__subclasses__():
        if "fixed_code" in vars(cls):
            found[cls.fixed_code] = cls
        found |= _coded(cls)
    return found


_BY_CODE: Final = _coded(_CodedError)


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
