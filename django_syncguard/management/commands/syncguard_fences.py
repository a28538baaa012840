"""``manage.py syncguard_fences``: see and keep fence continuity across backends.

- ``show``: each alias's fence mode, floor and highest counter;
- ``raise-floor N --backend ALIAS``: every later fence of the alias is above ``N``;
- ``migrate --from OLD --to NEW``: NEW's fences start above every fence OLD handed
  out, so moving an alias to another backend never makes a fenced write look stale;
- ``compact --backend ALIAS --idle-days D``: delete the counters of keys idle for
  ``D`` days, after raising the floor above them.

Thin: the work is the backend's (``fence_state``, ``raise_fence_floor``,
``compact_fences``; :mod:`django_syncguard.fence_floors`). Every action is safe to
re-run and safe beside live traffic.
"""

from __future__ import annotations

import datetime as dt
from argparse import ArgumentTypeError
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from ...errors import LockError
from ...fence_floors import FLOOR_MAX, IDLE_MAX_MS
from ..arguments import DEFAULT_BATCH_SIZE, batch_size, count_batches, keeper_of, known_aliases

DAY_MS = 86_400_000
#: Longest --idle-days: what compact_fences accepts (a hundred years).
MAX_IDLE_DAYS = IDLE_MAX_MS // DAY_MS


def floor_value(value: str) -> int:
    """argparse type: a fence floor, 0 to FLOOR_MAX."""
    try:
        number = int(value)
    except ValueError:
        number = -1
    if not 0 <= number <= FLOOR_MAX:
        raise ArgumentTypeError(f"must be an integer from 0 to {FLOOR_MAX}, not {value!r}")
    return number


def idle_days(value: str) -> float:
    """argparse type: a number of days, 0 or more (decimals allowed)."""
    try:
        days = float(value)
    except ValueError:
        days = -1.0
    if not 0 <= days <= MAX_IDLE_DAYS:
        raise ArgumentTypeError(
            f"must be a number of days from 0 to {MAX_IDLE_DAYS}, not {value!r}"
        )
    return days


class Command(BaseCommand):
    help = "Show and keep the fence floors of the lock backends (see each action's --help)."

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        show = actions.add_parser("show", help="Fence mode, floor and highest counter per alias.")
        show.add_argument(
            "--backend",
            action="append",
            dest="aliases",
            metavar="ALIAS",
            help="A SYNCGUARD_BACKENDS alias (repeatable; default: all).",
        )
        floor = actions.add_parser("raise-floor", help="Raise an alias's fence floor.")
        floor.add_argument("fence", type=floor_value, help="Every later fence is above this.")
        floor.add_argument("--backend", required=True, dest="alias", metavar="ALIAS")
        migrate = actions.add_parser(
            "migrate", help="Make NEW's fences start above every fence OLD handed out."
        )
        migrate.add_argument("--from", required=True, dest="source", metavar="OLD")
        migrate.add_argument("--to", required=True, dest="target", metavar="NEW")
        compact = actions.add_parser(
            "compact", help="Delete the fence counters of idle keys (raising the floor first)."
        )
        compact.add_argument("--backend", required=True, dest="alias", metavar="ALIAS")
        compact.add_argument(
            "--idle-days",
            required=True,
            type=idle_days,
            metavar="D",
            help="Only keys with no acquisition for D days (and no live lock, no waiter).",
        )
        compact.add_argument(
            "--dry-run", action="store_true", help="Count the counters; delete nothing."
        )
        compact.add_argument(
            "--batch-size",
            type=batch_size,
            default=DEFAULT_BATCH_SIZE,
            help=f"Counters read and deleted per batch (default {DEFAULT_BATCH_SIZE}).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        action = options["action"]
        try:
            if action == "show":
                self.show(known_aliases(options["aliases"]))
            elif action == "raise-floor":
                self.raise_floor(options["alias"], options["fence"], options["verbosity"])
            elif action == "migrate":
                self.migrate(options["source"], options["target"], options["verbosity"])
            else:
                self.compact(options)
        except LockError as exc:
            raise CommandError(f"{action} failed ({exc.code}): {exc}") from exc
        except NotImplementedError as exc:  # a third-party subclass without them
            raise CommandError(f"{action}: {exc}") from exc

    def show(self, aliases: list[str]) -> None:
        for alias in aliases:
            backend = keeper_of(alias)
            state = backend.fence_state()
            self.stdout.write(
                f"{alias} ({backend.capabilities.backend}): {state.mode} fences, "
                f"floor {state.floor}, highest counter {state.highest}"
            )

    def raise_floor(self, alias: str, fence: int, verbosity: int) -> None:
        [alias] = known_aliases([alias])
        backend = keeper_of(alias)
        floor = backend.raise_fence_floor(fence)
        if verbosity >= 1:
            if floor == fence:
                self.stdout.write(f"{alias}: fence floor is now {floor}.")
            else:
                self.stdout.write(f"{alias}: fence floor stays {floor} (above {fence}).")

    def migrate(self, source: str, target: str, verbosity: int) -> None:
        if source == target:
            raise CommandError("--from and --to name the same alias.")
        known_aliases([source, target])
        source_backend = keeper_of(source)
        old = source_backend.fence_state()
        handed_out = max(old.highest, old.floor)
        if old.mode == "clock":
            # Clock fences reach the source's clock: a source that lost counters (a
            # Redis restarted empty, the usual reason to move) may hold less.
            handed_out = max(handed_out, source_backend.now_ms())
        floor = keeper_of(target).raise_fence_floor(handed_out)
        if verbosity >= 1:
            self.stdout.write(
                f"{target}: fence floor is now {floor}; every fence {source} handed out "
                f"is at most {handed_out}."
            )

    def compact(self, options: dict[str, Any]) -> None:
        [alias] = known_aliases([options["alias"]])
        backend = keeper_of(alias)
        days, dry_run, verbosity = options["idle_days"], options["dry_run"], options["verbosity"]
        idle_ms = int(days * DAY_MS)
        if verbosity >= 2:
            since = dt.datetime.fromtimestamp((backend.now_ms() - idle_ms) / 1000, dt.UTC)
            verb = "counting" if dry_run else "deleting"
            self.stdout.write(
                f"{alias}: {verb} the fence counters of keys with no live lock, no waiter "
                f"and no acquisition since {since:%Y-%m-%d %H:%M:%S} UTC."
            )
        batches = backend.compact_fences(
            idle_ms=idle_ms, batch_size=options["batch_size"], dry_run=dry_run
        )
        total = count_batches(self.stdout, alias, batches, verbosity=verbosity, dry_run=dry_run)
        if verbosity >= 1:
            noun = "counter" if total == 1 else "counters"
            if dry_run:
                self.stdout.write(f"{alias}: {total} idle fence {noun} would be deleted (dry run).")
            else:
                floor = backend.fence_floor()
                self.stdout.write(f"{alias}: deleted {total} idle fence {noun}; floor {floor}.")
