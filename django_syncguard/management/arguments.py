"""What the management commands share: argument types and resolving aliases."""

from __future__ import annotations

from argparse import ArgumentTypeError

from django.core.management.base import CommandError

from ..constants import MAX_BATCH_SIZE
from ..contract import FenceKeeper, LockBackend, fence_keeper
from ..errors import LockError
from ..handler import InvalidBackendError, locks

DEFAULT_BATCH_SIZE = 500


def batch_size(value: str) -> int:
    """argparse type: an int between 1 and MAX_BATCH_SIZE."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if not 0 < number <= MAX_BATCH_SIZE:
        raise ArgumentTypeError(f"must be an integer between 1 and {MAX_BATCH_SIZE}, not {value!r}")
    return number


def known_aliases(aliases: list[str] | None) -> list[str]:
    """``aliases`` (default: every configured one), each once, in the order given;
    ``CommandError`` naming any alias that is not configured."""
    configured = list(locks)
    chosen = aliases or configured
    unknown = [alias for alias in chosen if alias not in configured]
    if unknown:
        raise CommandError(
            f"Unknown lock backend alias {', '.join(map(repr, unknown))}; "
            f"configured: {', '.join(configured)}."
        )
    return list(dict.fromkeys(chosen))


def backend_of(alias: str) -> LockBackend:
    """The backend of a configured ``alias``, or ``CommandError`` saying why not."""
    try:
        return locks[alias]
    except (InvalidBackendError, LockError) as exc:
        raise CommandError(f"{alias}: the backend cannot be used: {exc}") from exc


def keeper_of(alias: str) -> FenceKeeper:
    """The backend of ``alias`` as a fence keeper, or ``CommandError``."""
    backend = backend_of(alias)
    keeper = fence_keeper(backend)
    if keeper is None:
        raise CommandError(f"{alias}: {type(backend).__name__} keeps no fence floor.")
    return keeper
