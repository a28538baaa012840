"""A waiter's queue ticket and the timing rules every queue applies to it.

A ticket stays live for its ``patience_ms`` after each attempt that carries it; a
waiter makes an attempt at least every :data:`CHECK_IN_MS`, so a live waiter never
loses its place and a dead one stops holding the queue up within ``patience_ms``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..keys import generate_lock_id

#: A waiter with a healthy listener sends an attempt at least this often (it renews
#: its place in the queue and notices a holder whose lease ran out).
CHECK_IN_MS = 1_000
#: How long a ticket stays live after an attempt: a check-in, plus room for a slow
#: request or a busy process. A waiter that died holds the queue up at most this long.
PATIENCE_MS = 2 * CHECK_IN_MS


@dataclass(frozen=True, slots=True)
class WaitTicket:
    """A waiter's place in a key's queue: its id, and how long the backend keeps the
    place after this attempt without hearing from the waiter again."""

    id: str
    patience_ms: int = PATIENCE_MS

    @classmethod
    def new(cls) -> WaitTicket:
        return cls(id=generate_lock_id())
