"""What the management commands share: argument types, resolving aliases, and
reporting batches as they are deleted."""

from __future__ import annotations

from argparse import ArgumentTypeError
from collections.abc import Iterable

from django.core.management.base import CommandError, OutputWrapper

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


def count_batches(
    stdout: OutputWrapper, alias: str, batches: Iterable[int], *, verbosity: int, dry_run: bool
) -> int:
    """Sum the per-batch counts of a deleting iterator, printing a line per batch at
    verbosity 3, or a running count on a terminal (not for a dry run); the running
    count's line is ended before an error goes on up."""
    progress = stdout.isatty() and verbosity >= 1 and not dry_run
    total = 0
    try:
        for number, count in enumerate(batches, 1):
            total += count
            if verbosity >= 3:
                stdout.write(f"{alias}: batch {number}: {count}")
            elif progress:
                stdout.write(f"\r{alias}: {total} deleted so far", ending="")
                stdout.flush()
    except BaseException:
        if progress:
            stdout.write("")
        raise
    if progress:
        stdout.write("\r", ending="")
    return total
