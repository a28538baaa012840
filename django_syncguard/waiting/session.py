"""One waiting acquisition: its ticket, its listener, and the pause between attempts.

A release can only wake a queued ticket, and a ticket is only queued after its
listener exists, so no wake-up is lost. When the key's channel is already listened to
(a hot key: :meth:`WakeUps.ready`), the listener is registered at once and every
attempt carries the ticket. Otherwise the first attempt goes without a ticket, so an
uncontended acquire of a fresh key costs what it does without queues (no ticket, no
subscription); only if it meets contention are the ticket drawn and the listener
registered and, at once, an attempt made with the ticket to queue it.

Between attempts the waiter sleeps on its listener until the next attempt the retry
schedule calls for (the backoff delay; that attempt is always sent and counts as a
retry), and wakes earlier for an attempt that counts for nothing:

* a release (or a broken channel) woke it;
* its check-in is due: :data:`~.tickets.CHECK_IN_MS` after its last request, which
  renews its ticket and notices a holder whose lease ran out without a release;
* its listener is not healthy (no wake-up is sure to reach it) and it polls by its
  place in line: the waiter at place ``p`` (0 is first) every ``(p + 1) *``
  :data:`HEAD_POLL_MS`;
* another waiter was granted the key: once that grant's window is over, in case it
  lapsed (:data:`~.tickets.GRANT_WINDOW_MS`).

A release that grants the key to this waiter's ticket wakes it with the
:class:`~.tickets.Grant`: the next attempt is that grant, without a request.

A session that starts right after a release of this process granted its key to a
waiter makes its first attempt :data:`~.tickets.QUEUE_AFTER_GRANT_MS` late: that attempt
can only queue, and the grantee's process is waking up to enter at that moment.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from ..cancellation import CancelToken
from ..fencing import check_fence_number
from ..results import AcquireResult
from . import tickets
from .listeners import Listener, WakeUps
from .tickets import WaitTicket

#: The first waiter in line polls at least this often when no wake-up can reach it.
HEAD_POLL_MS = 10


class WaitSession:
    """See the module docstring. ``clock`` (seconds) is injectable."""

    def __init__(
        self, wake_ups: WakeUps, key: str, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.wake_ups = wake_ups
        self.key = key
        self.ticket: WaitTicket | None = None  # drawn when an attempt meets contention
        self.listener: Listener | None = None
        self.clock = clock
        self.queued = False  # an attempt with the ticket met contention
        self._last_request = clock()
        self._started = False  # the first attempt was made

    def _hold_back(self) -> float:
        """Before the first attempt: how long to wait first (0 but right after this
        process granted the key away; :data:`~.tickets.QUEUE_AFTER_GRANT_MS`)."""
        if self._started:
            return 0.0
        self._started = True
        return self.wake_ups.hold_back(self.key)

    def attempt(self, request: Callable[[WaitTicket | None], AcquireResult]) -> AcquireResult:
        """The next attempt, through ``request(ticket)`` (see the module docstring)."""
        granted = self._granted()
        if granted is not None:
            return granted
        pause = self._hold_back()
        if pause > 0:
            time.sleep(pause)  # at most QUEUE_AFTER_GRANT_MS: not worth a cancel check
        if self.listener is None and self.wake_ups.ready(self.key):
            self.listener = self._listen()
        if self.listener is None:
            self._stamp()
            result = request(None)
            if result.ok:
                return result
            self.listener = self._listen()
        self._stamp()
        return self._ticketed(request(self.ticket))

    async def aattempt(
        self, request: Callable[[WaitTicket | None], Awaitable[AcquireResult]]
    ) -> AcquireResult:
        """Async twin of :meth:`attempt`."""
        granted = self._granted()
        if granted is not None:
            return granted
        pause = self._hold_back()
        if pause > 0:
            await asyncio.sleep(pause)
        if self.listener is None and self.wake_ups.ready(self.key):
            # Ready means no I/O: no need for a worker thread.
            self.listener = self._listen()
        if self.listener is None:
            self._stamp()
            result = await request(None)
            if result.ok:
                return result
            self.listener = await self.wake_ups.alisten(self.key, self._draw().id)
        self._stamp()
        return self._ticketed(await request(self.ticket))

    def _listen(self) -> Listener:
        return self.wake_ups.listen(self.key, self._draw().id)

    def _draw(self) -> WaitTicket:
        """The session's ticket, drawn the first time it is needed."""
        if self.ticket is None:
            self.ticket = WaitTicket.new()
        return self.ticket

    def _granted(self) -> AcquireResult | None:
        """The grant a release made to this ticket, as the acquire result it stands for."""
        grant = None if self.listener is None else self.listener.grant
        if grant is None:
            return None
        fence = check_fence_number(grant.fence, self.key)
        return AcquireResult(
            ok=True, lock_id=grant.lock_id, expires_at_ms=grant.expires_at_ms, fence=fence
        )

    def _stamp(self) -> None:
        """A request is being sent: the check-in is timed from the send, as the
        ticket's patience runs from when the server sees it. A request sent once a
        re-check is due is that re-check (a later grant sets a new one)."""
        self._last_request = self.clock()
        listener = self.listener
        recheck = None if listener is None else listener.recheck_at
        if listener is not None and recheck is not None and time.monotonic() >= recheck:
            listener.recheck_at = None  # this request is the re-check

    def _ticketed(self, result: AcquireResult) -> AcquireResult:
        self.queued = self.queued or not result.ok
        return result

    @property
    def healthy(self) -> bool:
        return self.listener is not None and self.listener.healthy

    def pause_plan(self, delay_s: float, remaining_s: float, position: int | None) -> float:
        """How long to wait at most: until the retry schedule's next attempt
        (``delay_s``), the check-in, or, unhealthy, the poll by place in line. (A
        re-check after another waiter's grant ends the wait too: the listener's own
        wait honours ``recheck_at``, which another thread may set during it.)"""
        check_in_s = self._last_request + tickets.CHECK_IN_MS / 1000 - self.clock()
        budget = max(min(delay_s, remaining_s, check_in_s), 0.0)
        if position is not None and not self.healthy:
            # Polling by place: the first in line every HEAD_POLL_MS, the next ones a
            # little less often, so whoever moves up to first learns it soon.
            budget = min(budget, HEAD_POLL_MS * (position + 1) / 1000)
        return budget

    def pause(
        self, delay_s: float, remaining_s: float, cancel: CancelToken | None, position: int | None
    ) -> None:
        """Sleep until woken, or until the next attempt is due (see the module doc)."""
        self._listening().wait(self.pause_plan(delay_s, remaining_s, position), cancel)

    async def apause(
        self, delay_s: float, remaining_s: float, cancel: CancelToken | None, position: int | None
    ) -> None:
        """Async twin of :meth:`pause`."""
        budget = self.pause_plan(delay_s, remaining_s, position)
        await self._listening().await_wake(budget, cancel)

    def _listening(self) -> Listener:
        if self.listener is None:  # only a contended attempt leads to a pause
            raise RuntimeError("WaitSession.pause() before a contended attempt.")
        return self.listener

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
