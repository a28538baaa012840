"""Fence tokens: their format, their limits, and fenced writes in the ORM.

A fence is a 15-digit zero-padded decimal string. Fences of one key strictly
increase with each acquisition, so plain string comparison orders them.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

from .constants import FENCE_DIGITS, FENCE_THRESHOLDS
from .errors import Internal, InvalidArgument, StaleFenceError
from .keys import display_hash, hash_key

logger = logging.getLogger("django_syncguard")

FENCE_MAX: int = int(FENCE_THRESHOLDS["MAX"])
FENCE_WARN: int = int(FENCE_THRESHOLDS["WARN"])
_FENCE_RE = re.compile(rf"\d{{{FENCE_DIGITS}}}")

_warned_keys: set[str] = set()
_warned_lock = threading.Lock()


def format_fence(n: int) -> str:
    """Return ``n`` as a fence string: 15 digits, zero-padded."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise InvalidArgument(f"A fence is a non-negative int, not {n!r}.")
    if n >= 10**FENCE_DIGITS:
        raise InvalidArgument(f"A fence has at most {FENCE_DIGITS} digits; {n} does not fit.")
    return str(n).zfill(FENCE_DIGITS)


def validate_fence(fence: Any) -> str:
    """Return ``fence`` if it is a 15-digit string, else raise ``InvalidArgument``."""
    if not isinstance(fence, str) or not _FENCE_RE.fullmatch(fence):
        raise InvalidArgument(f"A fence is a string of {FENCE_DIGITS} digits, not {fence!r}.")
    return fence


def fence_overflow_error(key: str) -> Internal:
    """The error a backend raises instead of handing out a fence above ``FENCE_MAX``.

    The backend must raise it before committing anything: no lock is taken and the
    counter does not move.
    """
    return Internal(
        f"Fence counter of this key would pass {FENCE_THRESHOLDS['MAX']}; the lock was "
        "not taken. Rotate to a new key namespace (never reset a fence counter).",
        context={"key": key},
    )


def check_fence(fence: str, key: str) -> str:
    """Validate a fence a backend handed out; warn once per key above ``FENCE_WARN``.

    A backend that let a fence above ``FENCE_MAX`` through would be a bug: it is
    reported as ``Internal``.
    """
    return _checked(int(validate_fence(fence)), fence, key)


def check_fence_number(value: int, key: str) -> str:
    """:func:`check_fence` of a fence a backend handed out as a number (a grant's):
    the same checks on the number, then its string, without parsing one back."""
    return _checked(value, format_fence(value), key)


def _checked(value: int, fence: str, key: str) -> str:
    if value > FENCE_MAX:
        raise fence_overflow_error(key)
    if value > FENCE_WARN:
        # The set remembers keys by hash_key (never shown, and stable if SECRET_KEY
        # changes); the log line names the key by its display hash.
        digest = hash_key(key)
        with _warned_lock:
            first = digest not in _warned_keys
            _warned_keys.add(digest)
        if first:
            logger.warning(
                "Lock fence %s of key %s is above the warning threshold %s; plan a key "
                "namespace rotation before it reaches %s.",
                fence,
                display_hash(key),
                FENCE_THRESHOLDS["WARN"],
                FENCE_THRESHOLDS["MAX"],
            )
    return fence


def _fence_field(model: Any, name: str) -> Any:
    """The model field ``name`` if it can hold a fence: a text field of at least 15
    characters (the fence string) or an integer field of at least 32 bits (its value;
    a 64-bit one holds every fence). Anything else would compare fences wrongly."""
    from django.core.exceptions import FieldDoesNotExist
    from django.db import models

    try:
        field = model._meta.get_field(name)
    except FieldDoesNotExist as exc:
        raise InvalidArgument(f"{model.__name__} has no field {name!r} to hold the fence.") from exc
    too_small = (models.SmallIntegerField, models.PositiveSmallIntegerField)
    text = isinstance(field, models.CharField | models.TextField) and (
        field.max_length is None or field.max_length >= FENCE_DIGITS
    )
    integer = isinstance(field, models.IntegerField) and not isinstance(field, too_small)
    if not (text or integer):
        raise InvalidArgument(
            f"{model.__name__}.{name} ({type(field).__name__}) cannot hold a fence: use a "
            f"CharField(max_length={FENCE_DIGITS}) or a BigIntegerField, and name it with "
            "field=."
        )
    return field


def fenced_update(queryset: Any, fence: str, *, field: str = "fence", **updates: Any) -> int:
    """Apply ``updates`` plus ``field=fence`` to the rows of ``queryset`` whose stored
    fence is NULL or not newer than ``fence``, in one UPDATE statement.

    Returns the number of rows written. When nothing was written but a row of the
    queryset holds a newer fence, raises :class:`StaleFenceError`: the caller's lock
    expired and a later holder has already written. An equal fence is the same holder
    writing again and is applied. Works with a ``CharField`` fence (the 15-digit
    string) or an integer field (its value).
    """
    stored, applies = _fenced(queryset, fence, field)
    written = int(queryset.filter(applies).update(**{**updates, field: stored}))
    if written == 0 and queryset.filter(**{f"{field}__gt": stored}).exists():
        raise StaleFenceError(fence)
    return written


async def afenced_update(queryset: Any, fence: str, *, field: str = "fence", **updates: Any) -> int:
    """The async twin of :func:`fenced_update`, for async views and tasks: the same
    rules, checks and errors (``InvalidArgument`` before any query, ``StaleFenceError``
    when a newer holder has written), through Django's async queryset methods
    (``aupdate``, ``aexists``), so no ``SynchronousOnlyOperation``."""
    stored, applies = _fenced(queryset, fence, field)
    written = int(await queryset.filter(applies).aupdate(**{**updates, field: stored}))
    if written == 0 and await queryset.filter(**{f"{field}__gt": stored}).aexists():
        raise StaleFenceError(fence)
    return written


def _fenced(queryset: Any, fence: str, field: str) -> tuple[Any, Any]:
    """(the fence as ``field`` stores it, the condition of the rows it may write),
    after checking the fence and the field (no query)."""
    from django.db import models

    validate_fence(fence)
    model_field = _fence_field(queryset.model, field)
    stored: Any = int(fence) if isinstance(model_field, models.IntegerField) else fence
    applies = models.Q(**{f"{field}__isnull": True}) | models.Q(**{f"{field}__lte": stored})
    return stored, applies
