"""Driver errors as ``LockError`` subclasses, for PostgreSQL and SQLite alike.

Django wraps driver errors in its own classes; the driver's error is unwrapped and
classified by SQLSTATE (PostgreSQL), else by its message (libpq connection failures
and sqlite3 carry none). Anything unrecognised is ``Internal``. The table of codes
is in ``specs/backends/database.md``, Errors.
"""

from __future__ import annotations

from django.db import Error as DjangoDatabaseError

from ...errors import (
    AuthFailed,
    Internal,
    InvalidArgument,
    LockError,
    NetworkTimeout,
    RateLimited,
    ServiceUnavailable,
)

# SQLSTATE (exact code, else its two-character class) -> LockError subclass.
SQLSTATE_ERRORS: dict[str, type[LockError]] = {
    "08": ServiceUnavailable,  # connection exception
    "57P01": ServiceUnavailable,  # admin shutdown
    "57P02": ServiceUnavailable,  # crash shutdown
    "57P03": ServiceUnavailable,  # cannot connect now (starting up)
    "57014": NetworkTimeout,  # query cancelled: statement_timeout
    "55P03": NetworkTimeout,  # lock not available: lock_timeout
    "53300": RateLimited,  # too many connections
    "53": ServiceUnavailable,  # insufficient resources
    "28": AuthFailed,  # invalid authorization
    "42501": AuthFailed,  # insufficient privilege
    "40": ServiceUnavailable,  # serialization failure, deadlock: transient conflict
    "22": InvalidArgument,  # data exception
    "23": InvalidArgument,  # integrity constraint violation
    "42P01": Internal,  # undefined table: migrations not applied
    "42883": Internal,  # undefined function: migrations not applied
}

# Driver messages without a SQLSTATE (libpq connection failures, sqlite3).
MESSAGE_ERRORS: tuple[tuple[str, type[LockError]], ...] = (
    ("timeout expired", NetworkTimeout),
    ("timed out", NetworkTimeout),
    ("database is locked", NetworkTimeout),
    ("database table is locked", NetworkTimeout),
    ("no such table", Internal),
    ("no such function", Internal),
    ("password authentication failed", AuthFailed),
    ("connection refused", ServiceUnavailable),
    ("could not connect", ServiceUnavailable),
    ("connection failed", ServiceUnavailable),
    ("server closed the connection", ServiceUnavailable),
    ("connection is closed", ServiceUnavailable),
    ("connection already closed", ServiceUnavailable),
    ("terminating connection", ServiceUnavailable),
    ("unable to open database", ServiceUnavailable),
    ("disk i/o error", ServiceUnavailable),
    ("consuming input failed", ServiceUnavailable),
)

MIGRATE_HINT = " Run `manage.py migrate django_syncguard --database {alias}`."


def map_database_error(exc: BaseException, alias: str) -> LockError:
    """The ``LockError`` for a database driver error (Django-wrapped or raw)."""
    cause = exc.__cause__ if isinstance(exc, DjangoDatabaseError) and exc.__cause__ else exc
    sqlstate = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    error_cls: type[LockError] | None = None
    if sqlstate:
        error_cls = SQLSTATE_ERRORS.get(sqlstate) or SQLSTATE_ERRORS.get(sqlstate[:2])
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    if error_cls is None:
        lowered = str(cause).lower()
        error_cls = next((cls for needle, cls in MESSAGE_ERRORS if needle in lowered), Internal)
    message = f"Database {alias!r}: {text}"
    if sqlstate in ("42P01", "42883") or "no such table" in text.lower():
        message += MIGRATE_HINT.format(alias=alias)
    return error_cls(message, context={"cause": exc})


#: SQLSTATEs of a statement the server itself cancelled or never started: it rolled
#: back, so it took no lock.
_NOT_RUN_SQLSTATES = ("57014", "55P03", "57P03", "53300", "08001", "08004", "28", "40")
#: Driver messages of a connection that was never made: nothing was sent.
_NEVER_CONNECTED = (
    "could not connect",
    "connection refused",
    "connection failed",
    "connection timeout expired",
    "unable to open database",
)


def may_have_run(error: LockError) -> bool:
    """Whether the statement behind ``error`` (a ``NetworkTimeout`` or
    ``ServiceUnavailable``) may still commit on the server: its reply was lost or
    not waited for, rather than refused, cancelled or never sent."""
    if not isinstance(error, NetworkTimeout | ServiceUnavailable):
        return False
    exc = error.context.get("cause")
    cause = exc.__cause__ if isinstance(exc, DjangoDatabaseError) and exc.__cause__ else exc
    sqlstate = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None) or ""
    if sqlstate and sqlstate.startswith(_NOT_RUN_SQLSTATES):
        return False
    lowered = str(cause).lower()
    return not any(needle in lowered for needle in _NEVER_CONNECTED)
