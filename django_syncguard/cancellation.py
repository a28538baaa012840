"""``cancel=``: the Python counterpart of the specification's AbortSignal.

Any object with an ``is_set()`` method works (``threading.Event``,
``asyncio.Event``, ``multiprocessing.Event``, your own flag).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Protocol, cast, runtime_checkable

from .errors import Aborted, InvalidArgument


@runtime_checkable
class CancelToken(Protocol):
    def is_set(self) -> bool: ...


def validate_cancel(cancel: Any) -> CancelToken | None:
    """Return ``cancel`` if it is ``None`` or has ``is_set()``; else ``InvalidArgument``."""
    if cancel is not None and not callable(getattr(cancel, "is_set", None)):
        raise InvalidArgument(
            f"cancel must have an is_set() method (e.g. threading.Event), not "
            f"{type(cancel).__name__}."
        )
    return cast(CancelToken | None, cancel)


def check_cancel(cancel: CancelToken | None, context: dict[str, Any] | None = None) -> None:
    """Raise ``Aborted`` when ``cancel`` is set. Backends call it at their check points."""
    if cancel is not None and cancel.is_set():
        raise Aborted("Operation cancelled by the caller.", context=context)


def sleep(seconds: float, cancel: CancelToken | None) -> None:
    """Sleep, waking early when ``cancel`` (if it can be waited on) is set."""
    wait = getattr(cancel, "wait", None)
    if wait is not None and not asyncio.iscoroutinefunction(wait):
        wait(seconds)
    else:
        time.sleep(seconds)
    check_cancel(cancel)


async def asleep(seconds: float, cancel: CancelToken | None) -> None:
    """Async twin of :func:`sleep`; an ``asyncio.Event`` wakes it early."""
    if isinstance(cancel, asyncio.Event):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(cancel.wait(), seconds)
    else:
        await asyncio.sleep(seconds)
    check_cancel(cancel)
