"""Closing a client that belongs to an event loop, from whatever thread closes the backend.

Async drivers (redis.asyncio, gRPC's asyncio channels) bind a client to the event
loop that built it, so the backends keep one client per loop and must close each on
its own loop; :meth:`~django_syncguard.backends.base.BaseLockBackend.close` is
synchronous and may run on any thread, inside or outside that loop.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Coroutine
from typing import Any

logger = logging.getLogger("django_syncguard.backends")

#: Closes scheduled on the caller's own running loop: kept until done, since the
#: loop holds its tasks only weakly.
_pending: set[asyncio.Task[Any]] = set()


def close_on_loop(
    loop: asyncio.AbstractEventLoop,
    closing: Callable[[], Coroutine[Any, Any, Any]],
    timeout_s: float,
) -> None:
    """Run ``closing()`` on ``loop``, the loop its client belongs to.

    - a closed loop runs nothing any more: its sockets are closed when the client is
      garbage-collected;
    - the caller's own running loop: a task, which runs at the caller's next await
      (a synchronous caller cannot wait for it without blocking its own loop);
    - a loop running on another thread: there, waiting at most ``timeout_s``;
    - a loop that is not running: run on this thread until the close is done.
    """
    if loop.is_closed():
        return
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is not loop and not loop.is_running() and running is not None:
        # This thread runs another loop: it cannot run ``loop`` too.
        logger.debug("An async client of a loop that does not run was left to the GC.")
        return
    coroutine = closing()
    try:
        if running is loop:
            task = loop.create_task(coroutine)
            _pending.add(task)
            task.add_done_callback(_pending.discard)
        elif loop.is_running():
            asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout_s)
        else:
            _run_here(loop, coroutine)
    except (TimeoutError, RuntimeError) as exc:
        # The loop is busy, or stopped meanwhile: the client goes with the garbage.
        logger.debug("Closing an async client on its event loop failed: %r", exc)
    except Exception as exc:  # a connection that broke is closed already
        logger.debug("Closing an async client raised: %r", exc)


def _run_here(loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, Any]) -> None:
    """Run a loop that is not running on this thread until ``coroutine`` is done."""
    try:
        loop.run_until_complete(coroutine)
    except RuntimeError:
        # Another thread started the loop meanwhile: the close never began, and must
        # not warn that it was never awaited.
        if inspect.getcoroutinestate(coroutine) == inspect.CORO_CREATED:
            coroutine.close()
        raise
