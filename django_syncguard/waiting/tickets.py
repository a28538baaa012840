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
#: A key granted to a waiter (a release hands it over in the same atomic step) lapses
#: unless the waiter's process claims it within this long: a waiter that died holds
#: the key at most this long. Its process claims it as soon as the grant arrives.
GRANT_WINDOW_MS = 1_000
#: The other waiters of a key try again this long after a grant's window ended, so a
#: lapsed grant is noticed (and the key granted on) without waiting for a check-in.
RECHECK_MARGIN_MS = 25
#: A process that has just granted a key to a waiter holds its own next waiting
#: attempt on that key back this long: that attempt can only queue (the key is the
#: grantee's), and the grantee's process needs the CPU at that moment to wake and
#: enter (decision 48: on two cores, 8 processes x 20 ms holds on Redis, the hand-off
#: p50 went from 2.1 ms to 1.4 ms). Arriving a millisecond later in a queue whose wait
#: is many holds long changes no one's turn but this caller's, by that millisecond.
QUEUE_AFTER_GRANT_MS = 1


@dataclass(frozen=True, slots=True)
class WaitTicket:
    """A waiter's place in a key's queue: its id, and how long the backend keeps the
    place after this attempt without hearing from the waiter again."""

    id: str
    patience_ms: int = PATIENCE_MS

    @classmethod
    def new(cls) -> WaitTicket:
        return cls(id=generate_lock_id())


@dataclass(frozen=True, slots=True)
class Grant:
    """A key handed to a waiter by a release: what the waiter's acquire would have
    returned. It holds the lock from the moment the release ran."""

    lock_id: str
    fence: int
    expires_at_ms: int

    @classmethod
    def parse(cls, fields: list[str]) -> Grant | None:
        """From a grant message's ``<lock id> <fence> <expires>``; None if malformed."""
        try:
            lock_id, fence, expires = fields
            return cls(lock_id, int(fence), int(expires))
        except ValueError:
            return None
