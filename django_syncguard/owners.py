"""Who holds a lock: the short owner label each lock records (``OPTIONS["RECORD_OWNER"]``).

A label reads ``HOST:PID WHO FUNCTION``, for example
``web-1:4242 thread:MainThread invoices.views.pay`` or
``worker-2:77 task:5c0e6a9e-... invoices.tasks.charge``:

* ``HOST:PID`` is this process, computed once and recomputed in a forked child
  (:mod:`~django_syncguard.lifecycle` resets :data:`_process`), so a Celery prefork
  child or a gunicorn worker names itself, not its parent;
* ``WHO`` is ``task:<id>`` inside a Celery task or a Django task (one that takes its
  context), else ``asyncio:<task name>`` on an event loop, else ``thread:<name>``;
* ``FUNCTION`` is the qualified name of the function or view ``@locked`` decorates,
  or ``-`` for ``lock()``, ``alock()`` and ``with locked(...)``.

How the function reaches the backend: ``@locked`` sets :data:`_function` (a
context variable) around its call, and the backend reads it when it builds the label
(:func:`owner_label`), so ``acquire()`` keeps its public arguments. A context
variable follows the call into ``sync_to_async`` threads and asyncio tasks, and ends
with it. For the same reason the async acquire of a backend that does its I/O in a
worker thread computes the label before it leaves the event loop (:func:`pinned`):
there, the thread's name would be the worker's.

The label is a diagnostic for people, never compared by the library. It is bounded:
each part is clipped (:data:`PART_BYTES`) and the whole is at most
:data:`MAX_OWNER_BYTES` bytes of UTF-8, cut on a character boundary; control
characters become ``?`` so every store (PostgreSQL ``text`` refuses NUL) takes it.
See ``specs/decisions.md`` (the owner label).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from .errors import InvalidArgument
from .lifecycle import track

__all__ = [
    "MAX_OWNER_BYTES",
    "QueueStats",
    "owner_label",
    "pinned",
    "record_owner_option",
    "running",
]

#: The most bytes (UTF-8) a stored owner label takes.
MAX_OWNER_BYTES = 128
#: The most bytes of the host name and of the ``WHO`` part (``task:`` and a 36-character
#: Celery id fit); the function gets the rest.
PART_BYTES = 48

#: The qualified name of the ``@locked`` function running in this context.
_function: ContextVar[str | None] = ContextVar("django_syncguard_owner_function", default=None)
#: The Django task id of the ``@locked`` function running in this context, if any.
_task: ContextVar[str | None] = ContextVar("django_syncguard_owner_task", default=None)
#: A label computed on the event loop for I/O that runs in a worker thread.
_pinned: ContextVar[str | None] = ContextVar("django_syncguard_owner_pinned", default=None)


def clip(text: str, limit: int) -> str:
    """``text`` with control characters as ``?``, cut to at most ``limit`` bytes of
    UTF-8 on a character boundary (a lone surrogate becomes ``?`` too)."""
    if len(text) <= limit and text.isascii() and text.isprintable():
        # The usual label (ASCII host, thread and function names): nothing to replace
        # or cut. Printable ASCII is exactly 32..126, one byte a character; every acquire
        # builds a label, and the loop below costs more than the rest of it.
        return text
    cleaned = "".join("?" if ord(ch) < 32 or ord(ch) == 127 else ch for ch in text)
    data = cleaned.encode("utf-8", "replace")[:limit]
    return data.decode("utf-8", "ignore")  # drops a character cut in half


class _Process:
    """``HOST:PID`` of this process; a forked child computes its own."""

    def __init__(self) -> None:
        self.prefix = f"{clip(socket.gethostname() or '?', PART_BYTES)}:{os.getpid()}"

    def reset_after_fork(self) -> None:
        # Called in the child before it runs code of its own: the parent's pid is stale.
        self.__init__()  # type: ignore[misc]


_process = _Process()
track(_process)


def _celery_task_id() -> str | None:
    """The running Celery task's id; Celery is only asked if something imported it."""
    state = sys.modules.get("celery._state")
    get_current_task: Callable[[], Any] | None = getattr(state, "get_current_task", None)
    if get_current_task is None:
        return None
    task = get_current_task()
    task_id = getattr(getattr(task, "request", None), "id", None) if task is not None else None
    return str(task_id) if task_id else None


def _who() -> str:
    task_id = _task.get() or _celery_task_id()
    if task_id is not None:
        return f"task:{task_id}"
    # No running loop in this thread (a synchronous caller): current_task() would
    # raise and catch RuntimeError on every acquire; ask for the loop instead.
    loop = asyncio._get_running_loop()
    current = asyncio.current_task(loop) if loop is not None else None
    if current is not None:
        return f"asyncio:{current.get_name()}"
    return f"thread:{threading.current_thread().name}"


def owner_label() -> str:
    """This caller's label (see the module docstring); cheap: no I/O, no syscall."""
    pinned_label = _pinned.get()
    if pinned_label is not None:
        return pinned_label
    function = _function.get() or "-"
    label = f"{_process.prefix} {clip(_who(), PART_BYTES)} {function}"
    return clip(label, MAX_OWNER_BYTES)


@contextmanager
def running(function: str, task_id: str | None = None) -> Iterator[None]:
    """Name ``function`` (and the Django task ``task_id``) as the owner of the locks
    taken inside the block."""
    token = _function.set(function)
    task_token = _task.set(task_id)
    try:
        yield
    finally:
        _task.reset(task_token)
        _function.reset(token)


@contextmanager
def pinned(record: bool) -> Iterator[None]:
    """Compute the label now (on the event loop) for I/O the block hands to a thread."""
    if not record:
        yield
        return
    token = _pinned.set(owner_label())
    try:
        yield
    finally:
        _pinned.reset(token)


def function_name(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of ``fn``, as the label names it."""
    module = getattr(fn, "__module__", None) or "?"
    qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{module}.{qualname}"


def task_context_id(args: tuple[Any, ...]) -> str | None:
    """The task id of a Django task that takes its context (its first argument is a
    ``TaskContext``, whose ``task_result.id`` names the run)."""
    if not args or type(args[0]).__name__ != "TaskContext":
        return None
    task_id = getattr(getattr(args[0], "task_result", None), "id", None)
    return str(task_id) if task_id else None


def record_owner_option(options: Mapping[str, Any]) -> bool:
    """``OPTIONS["RECORD_OWNER"]`` (default True); anything but a bool is refused."""
    value = options.get("RECORD_OWNER", True)
    if not isinstance(value, bool):
        raise InvalidArgument(f"OPTIONS['RECORD_OWNER'] must be True or False, not {value!r}.")
    return value


@dataclass(frozen=True, slots=True)
class QueueStats:
    """The live waiters of one key, as the inspector shows them: how many, and since
    when the longest-waiting one has been queued (Unix ms by the backend's clock;
    ``None`` where the backend does not record it)."""

    waiters: int
    oldest_since_ms: int | None = None
