"""The queue rule, for the backends that decide it in Python (memory, SQLite, and the
Firestore transaction); PostgreSQL and Redis apply the same rule server-side
(``specs/contract.md``, Waiting).
"""

from __future__ import annotations

from ..constants import TIME_TOLERANCE_MS
from . import tickets
from .tickets import WaitTicket

#: A queue as a mapping ``ticket id -> (arrival number, live until ms)``: how the
#: backends that decide in Python (memory, SQLite) hold one key's waiters.
Queue = dict[str, tuple[int, int]]


def queue_head(queue: Queue, now_ms: int) -> str | None:
    """Drop the tickets whose patience ran out; the first live one's id, if any."""
    for ticket_id in [tid for tid, (_, until) in queue.items() if until <= now_ms]:
        del queue[ticket_id]
    return min(queue, key=lambda tid: queue[tid][0], default=None)


def queue_admits(
    queue: Queue, now_ms: int, *, free: bool, ticket: WaitTicket | None, arrival: int
) -> tuple[bool, int | None]:
    """The queue rule of an acquire attempt, applied to ``queue`` in place.

    Returns ``(take, position)``: ``take`` when the attempt may take the key (its
    ticket, if any, leaves the queue); otherwise the ticket is queued (``arrival``
    numbers a new entry; a queued ticket keeps its place) and ``position`` is its
    0-based place among the live waiters.
    """
    head = queue_head(queue, now_ms)
    if free and (head is None or (ticket is not None and head == ticket.id)):
        if ticket is not None:
            queue.pop(ticket.id, None)
        return True, None
    if ticket is None:
        return False, None
    first = queue.get(ticket.id, (arrival, 0))[0]
    queue[ticket.id] = (first, now_ms + ticket.patience_ms)
    return False, sum(1 for number, _ in queue.values() if number < first)


def unclaimed_expiry(now_ms: int, ttl_ms: int, window_ms: int | None = None) -> int:
    """The expiry to store for a lock granted at ``now_ms`` whose waiter has not yet
    claimed it (the backends that decide in Python).

    Liveness everywhere is ``expiry + TIME_TOLERANCE_MS > now``; this expiry makes
    that end exactly at the claim deadline (``now_ms`` + ``window_ms``, by default
    :data:`~.tickets.GRANT_WINDOW_MS`), or at the
    lease's own end when the ttl is shorter. So a grant nobody claims is gone for every
    operation at its deadline, with no tolerance and no other field to consult; a
    claim (or the holder's extend) writes the lease's expiry.
    """
    window = tickets.GRANT_WINDOW_MS if window_ms is None else window_ms
    deadline = now_ms + window - TIME_TOLERANCE_MS
    return min(now_ms + ttl_ms, deadline)
