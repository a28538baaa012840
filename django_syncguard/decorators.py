"""``locked``: a lock as a decorator or a (async) context manager.

::

    @locked("invoice:<pk>")                  # <pk> bound from the call's arguments
    def pay(request, pk): ...

    @locked("report:<job.account.id>")       # dotted attributes (or mapping keys)
    async def build(job): ...

    with locked("invoice:42") as lease:      # or: async with
        save(fence=lease.fence)

Each call (or each ``with``) takes a fresh lease. Placeholders name parameters of
the decorated callable; an unknown one fails when the decorator is applied.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from contextvars import ContextVar
from types import TracebackType
from typing import Any, TypeVar, cast

from .backends.base import BaseLockBackend
from .constants import (
    DEFAULT_BACKOFF,
    DEFAULT_JITTER,
    DEFAULT_MAX_RETRIES,
    DEFAULT_RETRY_DELAY_MS,
    DEFAULT_TIMEOUT_MS,
    DEFAULT_TTL_MS,
)
from .errors import InvalidArgument
from .keys import normalize_and_validate_key
from .leases import Lease, LockSpec, ReleaseErrorHandler
from .registry import register_locked
from .retry import Backoff, Jitter

F = TypeVar("F", bound=Callable[..., Any])

_PLACEHOLDER = re.compile(r"<([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)>")

# Context managers entered by ``with locked(...)``, innermost last; per thread/task, so
# one ``locked`` object may be entered concurrently.
_entered: ContextVar[tuple[Any, ...]] = ContextVar("django_syncguard_entered", default=())


class locked:  # noqa: N801 - used like a function, as contextlib's helpers are
    """Hold a lock around a function call or a ``with`` block; see the module docstring."""

    def __init__(
        self,
        key_template: str,
        *,
        using: str | BaseLockBackend = "default",
        ttl_ms: int = DEFAULT_TTL_MS,
        max_retries: int = DEFAULT_MAX_RETRIES,
        retry_delay_ms: float = DEFAULT_RETRY_DELAY_MS,
        timeout_ms: float = DEFAULT_TIMEOUT_MS,
        backoff: Backoff = DEFAULT_BACKOFF,
        jitter: Jitter = DEFAULT_JITTER,
        cancel: Any = None,
        on_release_error: ReleaseErrorHandler | None = None,
        auto_extend: bool = False,
    ) -> None:
        if not isinstance(key_template, str) or not key_template:
            raise InvalidArgument("locked() needs a non-empty key template string.")
        self.key_template = key_template
        self.placeholders = tuple(_PLACEHOLDER.findall(key_template))
        if not self.placeholders:
            normalize_and_validate_key(key_template)
        self.spec = LockSpec.from_options(
            using=using,
            ttl_ms=ttl_ms,
            max_retries=max_retries,
            retry_delay_ms=retry_delay_ms,
            timeout_ms=timeout_ms,
            backoff=backoff,
            jitter=jitter,
            cancel=cancel,
            on_release_error=on_release_error,
            auto_extend=auto_extend,
        )

    def __repr__(self) -> str:
        return f"locked({self.key_template!r})"

    # ------------------------------------------------------------- decorator
    def __call__(self, fn: F) -> F:
        if not callable(fn):
            raise InvalidArgument(f"locked(...) decorates a callable, not {fn!r}.")
        signature = inspect.signature(fn)
        self._check_placeholders(fn, signature)
        register_locked(fn, self.spec)  # for the system checks (syncguard.E006, W003)
        render = functools.partial(self.render_key, signature)

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                async with self.spec.ahold(render(args, kwargs)):
                    return await fn(*args, **kwargs)

            return cast(F, async_wrapper)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self.spec.hold(render(args, kwargs)):
                return fn(*args, **kwargs)

        return cast(F, wrapper)

    def _check_placeholders(self, fn: Callable[..., Any], signature: inspect.Signature) -> None:
        params = signature.parameters
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for placeholder in self.placeholders:
            root = placeholder.split(".", 1)[0]
            if root not in params and not takes_kwargs:
                raise InvalidArgument(
                    f"locked({self.key_template!r}) on {fn.__qualname__}: placeholder "
                    f"<{placeholder}> names no parameter (parameters: "
                    f"{', '.join(params) or 'none'})."
                )

    def render_key(
        self, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> str:
        """The key for one call: each ``<name>`` / ``<a.b>`` replaced by its value."""
        if not self.placeholders:
            return self.key_template
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        extra: Mapping[str, Any] = next(
            (
                bound.arguments[p.name]
                for p in signature.parameters.values()
                if p.kind is p.VAR_KEYWORD
            ),
            {},
        )

        def value_of(match: re.Match[str]) -> str:
            root, *path = match.group(1).split(".")
            if root in bound.arguments:
                value = bound.arguments[root]
            elif root in extra:
                value = extra[root]
            else:
                raise InvalidArgument(
                    f"Key placeholder <{match.group(1)}> has no value in this call."
                )
            for name in path:
                value = _step(value, name, match.group(1))
            return str(value)

        return _PLACEHOLDER.sub(value_of, self.key_template)

    # ------------------------------------------------------- context manager
    def _literal_key(self) -> str:
        if self.placeholders:
            raise InvalidArgument(
                f"locked({self.key_template!r}) has placeholders: use it as a decorator, or "
                "pass the finished key to the with statement."
            )
        return self.key_template

    def __enter__(self) -> Lease:
        manager = self.spec.hold(self._literal_key())
        lease = manager.__enter__()
        _entered.set((*_entered.get(), manager))
        return lease

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        *rest, manager = _entered.get()
        _entered.set(tuple(rest))
        return bool(cast(AbstractContextManager[Lease], manager).__exit__(exc_type, exc, tb))

    async def __aenter__(self) -> Lease:
        manager = self.spec.ahold(self._literal_key())
        lease = await manager.__aenter__()
        _entered.set((*_entered.get(), manager))
        return lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        *rest, manager = _entered.get()
        _entered.set(tuple(rest))
        manager = cast(AbstractAsyncContextManager[Lease], manager)
        return bool(await manager.__aexit__(exc_type, exc, tb))


def _step(value: Any, name: str, placeholder: str) -> Any:
    if isinstance(value, Mapping) and name in value:
        return value[name]
    try:
        return getattr(value, name)
    except AttributeError:
        raise InvalidArgument(
            f"Key placeholder <{placeholder}>: {type(value).__name__} has no {name!r}."
        ) from None
