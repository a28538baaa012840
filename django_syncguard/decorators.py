"""``locked``: a lock as a decorator or a (async) context manager.

::

    @locked("invoice:<pk>")                  # <pk> bound from the call's arguments
    def pay(request, pk): ...

    @locked("report:<job.account.id>")       # dotted attributes (or mapping keys)
    async def build(job): ...

    with locked("invoice:42") as lease:      # or: async with
        save(fence=lease.fence)

Each call (or each ``with``) takes a fresh lease. Placeholders name parameters of
the decorated callable (see :mod:`~django_syncguard.key_templates`); an unknown one
fails when the decorator is applied. The options are
:class:`~django_syncguard.acquisition.LockOptions`.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from contextvars import ContextVar
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

from .acquisition import LockOptions, LockSpec, Skipped
from .errors import InvalidArgument
from .key_templates import KeyTemplate
from .leases import Lease
from .owners import function_name, running, task_context_id
from .registry import register_locked

if TYPE_CHECKING:
    from typing_extensions import Unpack

F = TypeVar("F", bound=Callable[..., Any])

# Context managers entered by ``with locked(...)``, innermost last; per thread/task, so
# one ``locked`` object may be entered concurrently.
_entered: ContextVar[tuple[Any, ...]] = ContextVar("django_syncguard_entered", default=())


class locked:  # noqa: N801 - used like a function, as contextlib's helpers are
    """Hold a lock around a function call or a ``with`` block; see the module docstring."""

    def __init__(self, key_template: str, **options: Unpack[LockOptions]) -> None:
        self.template = KeyTemplate(key_template)
        self.spec = LockSpec.from_options("locked", options)

    def __repr__(self) -> str:
        return f"locked({self.template.template!r})"

    # ------------------------------------------------------------- decorator
    def __call__(self, fn: F) -> F:
        _refuse_task_object(fn, self)  # first: a Django Task is not even callable
        if not callable(fn):
            raise InvalidArgument(f"locked(...) decorates a callable, not {fn!r}.")
        signature = inspect.signature(fn)
        self.template.check_against(fn, signature)
        # For the system checks (syncguard.E006, W003, W004, W005).
        literal = self.template.literal_parameters(signature)
        register_locked(fn, self.spec, self.template.template, literal)
        render = functools.partial(self.template.render, signature)
        # The owner label names this function (see owners.py): set around the call.
        owner = function_name(fn)

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                try:
                    with running(owner, task_context_id(args)):
                        async with self.spec.ahold(render(args, kwargs)):
                            return await fn(*args, **kwargs)
                except Skipped:  # on_contended="skip": the key was held
                    return None

            return cast(F, async_wrapper)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                with running(owner, task_context_id(args)), self.spec.hold(render(args, kwargs)):
                    return fn(*args, **kwargs)
            except Skipped:  # on_contended="skip": the key was held
                return None

        return cast(F, wrapper)

    # ------------------------------------------------------- context manager
    def _refuse_skip(self) -> None:
        if self.spec.on_contended == "skip":
            raise InvalidArgument(
                "on_contended='skip' cannot skip a with block (the block would run "
                "unlocked); decorate a function instead, or use 'raise'."
            )

    def __enter__(self) -> Lease:
        self._refuse_skip()
        manager = self.spec.hold(self.template.literal_key())
        lease = manager.__enter__()
        _entered.set((*_entered.get(), manager))
        return lease

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Never suppresses the block's exception: the hold releases and re-raises.
        *rest, manager = _entered.get()
        _entered.set(tuple(rest))
        cast(AbstractContextManager[Lease], manager).__exit__(exc_type, exc, tb)

    async def __aenter__(self) -> Lease:
        self._refuse_skip()
        manager = self.spec.ahold(self.template.literal_key())
        lease = await manager.__aenter__()
        _entered.set((*_entered.get(), manager))
        return lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        *rest, manager = _entered.get()
        _entered.set(tuple(rest))
        await cast(AbstractAsyncContextManager[Lease], manager).__aexit__(exc_type, exc, tb)


#: Task classes, as (module, class name, framework, its task decorator): what a task
#: decorator returns. Looked up in ``sys.modules`` only: a framework nobody imported
#: cannot have made ``fn``.
_TASK_CLASSES = (
    ("celery.local", "Proxy", "Celery", "shared_task"),  # before the app is finalized
    ("celery.app.task", "Task", "Celery", "shared_task"),
    ("django.tasks.base", "Task", "Django", "task"),  # Django 6's task framework
    ("django_tasks.base", "Task", "Django", "task"),  # its backport, django-tasks
)


def task_framework(obj: object) -> tuple[str, str] | None:
    """``(framework, its task decorator)`` when ``obj`` is a task object, else ``None``.

    Judged on ``type(obj)``: a Celery proxy would evaluate itself when asked its
    ``__class__``. Also used by the system checks (``syncguard.W005``), which look up
    what a ``@locked`` function's module name is bound to once the task decorator ran.
    """
    for module_name, class_name, framework, task_decorator in _TASK_CLASSES:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(cls, type) and issubclass(type(obj), cls):
            return framework, task_decorator
    return None


def _refuse_task_object(fn: object, decorator: locked) -> None:
    """``@locked`` above ``@shared_task`` / ``@task`` would wrap the task object in a
    plain function: ``.delay()`` / ``.enqueue()`` would be gone, and the worker would
    run the task without the lock. Say so, with the right order, when decorating."""
    found = task_framework(fn)
    if found is not None:
        framework, task_decorator = found
        raise InvalidArgument(
            f"{decorator!r} is above a {framework} task decorator; put it below, so "
            "that the worker takes the lock each time it runs the task:\n"
            f"    @{task_decorator}(...)\n"
            f"    @{decorator!r}\n"
            "    def your_task(...): ..."
        )
