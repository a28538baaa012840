"""Fence modes, the fence floor of an alias, and compaction of idle fence counters.

Every backend computes a key's next fence inside its atomic acquire as::

    next = max(last fence of the key, floor of the alias) + 1
    next = max(next, the server's clock in ms)        # "clock" mode only

The **floor** is one value per alias, stored by the backend next to its counters
(a row, a key, a document); operators raise it, never lower it
(``manage.py syncguard_fences raise-floor`` / ``migrate``), and compaction raises it
before deleting counters. With it, a counter that is gone (compacted, or on a new
backend after a move) never lets a key's fences start again below what was handed
out. **Clock mode** (``OPTIONS["FENCES"] = "clock"``) covers what an operator cannot
see coming: a counter lost with its server (a Redis restarted without persistence,
a failover to a replica that missed the last writes). ``specs/guarantees.md``
("Fence continuity") states what each mode assumes and buys.

Compaction deletes counters of keys with no live lock, no queued waiter and no
acquisition since a cutoff, in batches: each batch first raises the floor to at
least the largest fence in it, then deletes each counter only if it is still exactly
as read (same fence, still idle), atomically per counter. An acquisition that
interleaves either changes a counter before its delete (the delete skips it) or
finds it deleted after the floor was raised (its fence starts above the floor): no
order of the two makes a fence go backwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, cast

from .errors import InvalidArgument
from .fencing import FENCE_MAX

if TYPE_CHECKING:
    from .backends.base import BaseLockBackend

FenceMode = Literal["clock", "counter"]
FENCE_MODES: Final = ("clock", "counter")

#: Largest floor an operator may set: a floor at the maximum fence would make every
#: later acquisition overflow.
FLOOR_MAX: Final = FENCE_MAX - 1


def next_fence(previous: int, floor: int, clock_ms: int | None) -> int:
    """A key's next fence after ``previous`` (0: none), under ``floor``; in clock mode
    ``clock_ms`` is the server's clock (``None`` in counter mode). The one formula
    every backend applies (PostgreSQL in SQL, Redis in Lua write it again)."""
    fence = max(previous, floor) + 1
    return fence if clock_ms is None else max(fence, clock_ms)


def fence_mode_option(options: dict[str, Any], default: FenceMode) -> FenceMode:
    """``OPTIONS["FENCES"]``, checked: ``"clock"`` or ``"counter"``."""
    mode = options.get("FENCES", default)
    if mode not in FENCE_MODES:
        raise InvalidArgument(f"OPTIONS['FENCES'] must be 'clock' or 'counter', not {mode!r}.")
    return cast(FenceMode, mode)


def validate_floor(fence: Any) -> int:
    """A floor an operator asked for: an int from 0 to ``FLOOR_MAX``."""
    if isinstance(fence, bool) or not isinstance(fence, int) or not 0 <= fence <= FLOOR_MAX:
        raise InvalidArgument(f"A fence floor must be an int from 0 to {FLOOR_MAX}, not {fence!r}.")
    return int(fence)


#: Longest idle time compaction accepts: a hundred years (every store's integers hold it).
IDLE_MAX_MS: Final = 36_500 * 86_400_000


def validate_idle_ms(idle_ms: Any) -> int:
    if isinstance(idle_ms, bool) or not isinstance(idle_ms, int) or not 0 <= idle_ms <= IDLE_MAX_MS:
        raise InvalidArgument(f"idle_ms must be an int from 0 to {IDLE_MAX_MS}, not {idle_ms!r}.")
    return int(idle_ms)


@dataclass(frozen=True)
class FenceState:
    """What ``syncguard_fences show`` prints for one alias."""

    alias: str
    mode: FenceMode
    #: The alias's floor (0: never raised).
    floor: int
    #: The largest fence any counter of the alias holds (0: none).
    highest: int


@dataclass(frozen=True)
class IdleCounter:
    """A counter compaction may delete, as one batch read it. ``name`` and ``guard``
    belong to the backend (a counter's key, and whatever its guarded delete compares:
    the stored values, an update time)."""

    name: str
    fence: int
    guard: Any = None


def compact(
    backend: BaseLockBackend, cutoff_ms: int, batch_size: int, dry_run: bool
) -> Iterator[int]:
    """The compaction loop over a backend's hooks (see the module docstring): the
    number deleted by each batch, or with ``dry_run`` one number, how many would be."""
    cursor: str | None = None
    would = raised = 0
    while True:
        batch, cursor = backend._idle_counters(cutoff_ms, cursor, batch_size, stamp=not dry_run)
        if dry_run:
            would += len(batch)
        elif batch:
            # At most FLOOR_MAX: a counter at FENCE_MAX can never be handed out again
            # anyway, and a floor there would make every other key overflow.
            fence = min(max(counter.fence for counter in batch), FLOOR_MAX)
            backend._raise_floor_before_delete(batch, fence)
            raised = max(raised, fence)
            yield backend._delete_idle_counters(batch, cutoff_ms)
        if cursor is None:
            break
    if dry_run:
        yield would
    elif raised:
        backend._compaction_done(raised)
