"""Key templates of ``@locked``: ``"invoice:<pk>"``, ``"report:<job.account.id>"``.

A placeholder ``<name>`` names a parameter of the decorated callable, ``<a.b>`` an
attribute (or mapping key) of one. A template is checked when ``locked(...)`` is
built: a ``{name}`` placeholder (the ``str.format`` habit), an unbalanced ``<`` or
``>`` and an empty ``<>`` would otherwise be literal text, so every call would share
one lock; they are ``InvalidArgument`` instead.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

from .errors import InvalidArgument
from .keys import normalize_and_validate_key

_PLACEHOLDER = re.compile(r"<([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)>")
_FORMAT_FIELD = re.compile(r"\{[A-Za-z_][\w.]*\}")
_HINT = "placeholders are written <name> or <name.attribute>"
_WORD = re.compile(r"[A-Za-z_]\w*")
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


class KeyTemplate:
    """A checked key template; :meth:`render` fills it for one call."""

    def __init__(self, template: str) -> None:
        if not isinstance(template, str) or not template:
            raise InvalidArgument("locked() needs a non-empty key template string.")
        _refuse_malformed(template)
        self.template = template
        self.placeholders = tuple(_PLACEHOLDER.findall(template))
        if not self.placeholders:
            normalize_and_validate_key(template)

    def check_against(self, fn: Callable[..., Any], signature: inspect.Signature) -> None:
        """``InvalidArgument`` when a placeholder names no parameter of ``fn``."""
        params = signature.parameters
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for placeholder in self.placeholders:
            root = placeholder.split(".", 1)[0]
            if root not in params and not takes_kwargs:
                raise InvalidArgument(
                    f"locked({self.template!r}) on {fn.__qualname__}: placeholder "
                    f"<{placeholder}> names no parameter (parameters: "
                    f"{', '.join(params) or 'none'})."
                )

    def literal_parameters(self, signature: inspect.Signature) -> tuple[str, ...]:
        """Parameters of the callable that the template names as literal text, not as a
        placeholder: ``"invoice:pk"`` on ``def pay(pk)`` locks one key for every
        invoice (the system check ``syncguard.W004`` says so). ``self`` and ``cls`` are
        left out, and so is a name also used as a placeholder (``"pk:<pk>"``)."""
        used = {placeholder.split(".", 1)[0] for placeholder in self.placeholders}
        words = _WORD.findall(_PLACEHOLDER.sub(" ", self.template))
        names = [p.name for p in signature.parameters.values() if p.kind not in _VARIADIC]
        return tuple(
            name
            for name in dict.fromkeys(words)
            if name in names and name not in used and name not in ("self", "cls")
        )

    def with_placeholder(self, name: str) -> str:
        """The template with the literal word ``name`` written as ``<name>`` (the fix
        W004 suggests); placeholders are left as they are."""
        parts = _PLACEHOLDER.split(self.template)
        # split() with one group alternates literal text and placeholder names.
        return "".join(
            re.sub(rf"(?<![\w.]){re.escape(name)}(?!\w)", f"<{name}>", part)
            if n % 2 == 0
            else f"<{part}>"
            for n, part in enumerate(parts)
        )

    def literal_key(self) -> str:
        """The key of a template without placeholders (``with locked(...)``)."""
        if self.placeholders:
            raise InvalidArgument(
                f"locked({self.template!r}) has placeholders: use it as a decorator, or "
                "pass the finished key to the with statement."
            )
        return self.template

    def render(
        self, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> str:
        """The key for one call: each ``<name>`` / ``<a.b>`` replaced by its value."""
        if not self.placeholders:
            return self.template
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

        return _PLACEHOLDER.sub(value_of, self.template)


def _refuse_malformed(template: str) -> None:
    """Refuse what looks like a placeholder but is not one."""
    field = _FORMAT_FIELD.search(template)
    if field:
        name = field.group(0)[1:-1]
        raise InvalidArgument(
            f"locked({template!r}): {field.group(0)} is not a placeholder; {_HINT} (here <{name}>)."
        )
    rest = _PLACEHOLDER.sub("", template)
    if "<>" in rest:
        raise InvalidArgument(f"locked({template!r}) has an empty <>; {_HINT}.")
    stray = next((c for c in rest if c in "<>"), None)
    if stray is not None:
        raise InvalidArgument(
            f"locked({template!r}) has an unbalanced or malformed {stray!r}; {_HINT}."
        )


def _step(value: Any, name: str, placeholder: str) -> Any:
    if isinstance(value, Mapping) and name in value:
        return value[name]
    try:
        return getattr(value, name)
    except AttributeError:
        raise InvalidArgument(
            f"Key placeholder <{placeholder}>: {type(value).__name__} has no {name!r}."
        ) from None
