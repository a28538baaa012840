"""The ``@locked`` functions of this process, for the system checks.

``locked(...)`` records each function it decorates here, when it decorates it
(at import time for module-level functions). Each entry is a plain tuple of the
function's dotted name and the options the checks need; no reference to the function
or to a backend object is kept, and an identical entry is stored once, so decorating
closures in a loop does not grow the registry. Reads no settings.

``syncguard.E006``, ``syncguard.W003``, ``syncguard.W004`` and ``syncguard.W005`` (see
:mod:`django_syncguard.checks`) walk :func:`locked_functions`. Tests isolate it with
:func:`snapshot` and :func:`restore`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from .retry import RetryPolicy

if TYPE_CHECKING:
    from .acquisition import LockSpec


class LockedFunction(NamedTuple):
    """One ``@locked(...)`` decoration."""

    #: ``module.qualname`` of the decorated callable.
    name: str
    #: The alias of ``SYNCGUARD_BACKENDS`` given as ``using=``; ``None`` when a backend
    #: object was passed instead (the checks cannot judge those).
    using: str | None
    ttl_ms: int
    auto_extend: bool
    #: The key template, and the parameters it names as literal text (W004).
    template: str = ""
    literal_params: tuple[str, ...] = ()
    #: How a held key is met, and the waiting loop's options (W005).
    on_contended: str = "wait"
    policy: RetryPolicy = RetryPolicy()


_entries: dict[LockedFunction, None] = {}  # an ordered set
_mutex = threading.Lock()


def qualified_name(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of ``fn`` (its ``repr`` for callables without them)."""
    qualname = getattr(fn, "__qualname__", None)
    if not isinstance(qualname, str):
        return repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}.{qualname}" if isinstance(module, str) else qualname


def register_locked(
    fn: Callable[..., Any],
    spec: LockSpec,
    template: str = "",
    literal_params: tuple[str, ...] = (),
) -> None:
    """Record that ``fn`` is decorated with ``locked(template, ...)`` of options ``spec``,
    whose template names ``literal_params`` of ``fn`` as literal text."""
    entry = LockedFunction(
        name=qualified_name(fn),
        using=spec.using if isinstance(spec.using, str) else None,
        ttl_ms=spec.ttl_ms,
        auto_extend=spec.auto_extend,
        template=template,
        literal_params=literal_params,
        on_contended=spec.on_contended,
        policy=spec.policy,
    )
    with _mutex:
        _entries[entry] = None


def locked_functions() -> tuple[LockedFunction, ...]:
    """Every decoration recorded so far, in the order they happened."""
    with _mutex:
        return tuple(_entries)


def snapshot() -> tuple[LockedFunction, ...]:
    """The registry's contents, for :func:`restore` (tests)."""
    return locked_functions()


def restore(entries: Iterable[LockedFunction]) -> None:
    """Replace the registry's contents with ``entries`` (tests)."""
    with _mutex:
        _entries.clear()
        _entries.update(dict.fromkeys(entries))


def clear() -> None:
    """Forget every recorded decoration (tests)."""
    restore(())
