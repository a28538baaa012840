"""``manage.py syncguard_cleanup``: delete expired lock records, never fence counters.

Safe to run from cron while locks are taken and released: each backend deletes only
records expired longer ago than its cleanup guard (see ``delete_expired``).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from ...constants import CLEANUP_GUARD_MS
from ...contract import LockBackend
from ...errors import LockError
from ..arguments import DEFAULT_BATCH_SIZE, backend_of, batch_size, count_batches, known_aliases


class Command(BaseCommand):
    help = (
        "Delete expired lock records (never fence counters) from every lock backend, "
        "or from the ones named with --backend."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--backend",
            action="append",
            dest="aliases",
            metavar="ALIAS",
            help="A SYNCGUARD_BACKENDS alias to clean (repeatable; default: all).",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Count the records that would be deleted; delete nothing.",
        )
        parser.add_argument(
            "--batch-size",
            type=batch_size,
            default=DEFAULT_BATCH_SIZE,
            help=f"Records deleted per statement or round trip (default {DEFAULT_BATCH_SIZE}).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        for alias in known_aliases(options["aliases"]):
            self.clean(alias, options["dry_run"], options["batch_size"], options["verbosity"])

    def clean(self, alias: str, dry_run: bool, size: int, verbosity: int) -> None:
        backend = backend_of(alias)
        if verbosity >= 2:
            self.stdout.write(describe(alias, backend, dry_run))
        batches = backend.delete_expired(batch_size=size, dry_run=dry_run)
        try:
            total = count_batches(self.stdout, alias, batches, verbosity=verbosity, dry_run=dry_run)
        except LockError as exc:
            raise CommandError(f"{alias}: cleanup failed ({exc.code}): {exc}") from exc
        if verbosity >= 1:
            self.stdout.write(summary(alias, total, dry_run))


def describe(alias: str, backend: LockBackend, dry_run: bool) -> str:
    authority = backend.capabilities.time_authority
    guard = CLEANUP_GUARD_MS[authority]
    verb = "counting" if dry_run else "deleting"
    return (
        f"{alias} ({backend.capabilities.backend}, {authority} time): {verb} "
        f"lock records expired more than {guard} ms ago; fence counters are kept."
    )


def summary(alias: str, total: int, dry_run: bool) -> str:
    noun = "record" if total == 1 else "records"
    if dry_run:
        return f"{alias}: {total} expired lock {noun} would be deleted (dry run)."
    return f"{alias}: deleted {total} expired lock {noun}."
