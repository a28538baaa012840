"""Fair, notified waiting: the queue ticket a waiter carries and the wake-ups it waits on.

A waiter (``on_contended="wait"``, the default) passes a :class:`WaitTicket` with each
acquire attempt. A backend that supports queues (``backend.wake_ups`` is not ``None``)
keeps a per-key queue of live tickets beside the lock:

* an attempt that finds the key held puts the ticket in the queue (or keeps its place
  and renews its patience) and reports contention;
* an attempt that finds the key free takes it only when no live ticket is ahead of its
  own; a caller without a ticket (``"skip"``, ``"raise"``, a direct ``acquire``) only
  when the queue is empty. So a worker that has just released the key queues behind
  the ones that were already waiting;
* ``release`` (and ``withdraw``, when a waiter gives up) wakes the first live ticket
  through the backend's :class:`WakeUps`: Redis pub/sub, PostgreSQL ``NOTIFY``, a
  Firestore listener, or in-process events.

A ticket stays live for ``patience_ms`` after each attempt. A waiter makes an attempt
at least every :data:`CHECK_IN_MS`, so a live waiter never loses its place, and a
waiter that died stops holding up the queue within ``patience_ms``.

Between attempts a waiter sleeps on its :class:`Listener`: it wakes when notified, and
at the latest at the specification's backoff delay. While its listener is *healthy*
(the wake-up channel reaches every process and has stayed connected since the ticket
was queued) a release cannot go unannounced, so a timer wake-up sends no request
until :data:`CHECK_IN_MS` has passed (it still notices a holder that died, by the TTL,
at that check-in). An unhealthy listener (a lost connection, SQLite across processes)
polls at the backoff delay, and by its place in line: the waiter at place ``p`` (0 is
first) at least every ``(p + 1) * HEAD_POLL_MS``.

See ``specs/contract.md`` (Waiting) and each backend's spec for its queue and channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .cancellation import CancelToken, check_cancel
from .keys import generate_lock_id
from .results import AcquireResult

logger = logging.getLogger("django_syncguard.waiting")

#: A waiter with a healthy listener sends an attempt at least this often (it renews
#: its place in the queue and notices a holder whose lease ran out).
CHECK_IN_MS = 1_000
#: How long a ticket stays live after an attempt: a check-in, plus room for a slow
#: request or a busy process. A waiter that died holds the queue up at most this long.
PATIENCE_MS = 2 * CHECK_IN_MS
#: The first waiter in line polls at least this often when no wake-up can reach it.
HEAD_POLL_MS = 10
#: Longest single blocking wait, so a ``cancel`` token without ``wait()`` is seen.
_CANCEL_SLICE_S = 0.025


@dataclass(frozen=True, slots=True)
class WaitTicket:
    """A waiter's place in a key's queue: its id, and how long the backend keeps the
    place after this attempt without hearing from the waiter again."""

    id: str
    patience_ms: int = PATIENCE_MS

    @classmethod
    def new(cls) -> WaitTicket:
        return cls(id=generate_lock_id())


class Listener:
    """One waiter's registration with a :class:`WakeUps`: woken by a release meant
    for its ticket, by a lost connection, or by its own timer."""

    def __init__(self, wake_ups: WakeUps, key: str, ticket_id: str) -> None:
        self.wake_ups = wake_ups
        self.key = key
        self.ticket_id = ticket_id
        self._event = threading.Event()
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._generation = wake_ups.generation
        self.confirmed = False  # set by WakeUps.listen once the channel is subscribed

    @property
    def healthy(self) -> bool:
        """Whether every release of the key since the ticket was queued reaches us."""
        return (
            self.confirmed
            and self.wake_ups.reaches_other_processes
            and self.wake_ups.generation == self._generation
            and self.wake_ups.connected
        )

    def wake(self) -> None:
        """Thread-safe: wake this waiter (called by the delivering thread)."""
        self._event.set()
        if self._async is not None:
            loop, event = self._async
            # A closed loop means the waiter is gone.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(event.set)

    def wait(self, timeout_s: float, cancel: CancelToken | None) -> bool:
        """Block up to ``timeout_s``; True when woken (the wake is consumed)."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            remaining = deadline - time.monotonic()
            step = remaining if cancel is None else min(remaining, _CANCEL_SLICE_S)
            if self._event.wait(max(step, 0.0)):
                self._event.clear()
                return True
            check_cancel(cancel)
            if remaining <= step:
                return False

    async def await_wake(self, timeout_s: float, cancel: CancelToken | None) -> bool:
        """Async twin of :meth:`wait`."""
        if self._async is None:
            self._async = (asyncio.get_running_loop(), asyncio.Event())
            if self._event.is_set():
                self._async[1].set()
        event = self._async[1]
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            remaining = deadline - time.monotonic()
            step = remaining if cancel is None else min(remaining, _CANCEL_SLICE_S)
            try:
                await asyncio.wait_for(event.wait(), max(step, 0.0))
            except TimeoutError:
                check_cancel(cancel)
                if remaining <= step:
                    return False
            else:
                event.clear()
                self._event.clear()
                return True

    def close(self) -> None:
        self.wake_ups.forget(self)


class WakeUps:
    """The process-wide wake-up registry of one backend.

    Subclasses connect it to their server's channel: :meth:`_subscribe` /
    :meth:`_unsubscribe` a key, and call :meth:`deliver` when a wake-up for a ticket
    arrives and :meth:`connection_lost` when the channel breaks. The base class is
    complete for in-process wake-ups (the memory backend, SQLite within a process).
    """

    #: Whether a release in another process reaches this process's waiters.
    reaches_other_processes: bool = True

    def __init__(self, name: str) -> None:
        self.name = name
        self.generation = 0
        self._mutex = threading.RLock()
        self._listeners: dict[str, dict[str, Listener]] = {}
        self._pid = os.getpid()

    @property
    def connected(self) -> bool:
        return True

    def listen(self, key: str, ticket_id: str) -> Listener:
        """Register a waiter *before* its first attempt, so no wake-up is lost."""
        self._after_fork()
        listener = Listener(self, key, ticket_id)
        with self._mutex:
            first = key not in self._listeners
            self._listeners.setdefault(key, {})[ticket_id] = listener
        try:
            listener.confirmed = self._subscribe(key) if first else self._subscribed(key)
        except Exception as exc:  # the waiter falls back to polling
            logger.warning("Wake-ups of %s unavailable (%r); waiting by polling.", self.name, exc)
        return listener

    def ready(self, key: str) -> bool:
        """Whether a listener on ``key`` would be confirmed at once, without I/O (a
        channel already subscribed for a hot key). Registries whose subscriptions
        need the server override it; in-process ones are always ready."""
        return type(self)._subscribe is WakeUps._subscribe

    async def alisten(self, key: str, ticket_id: str) -> Listener:
        return await asyncio.to_thread(self.listen, key, ticket_id)

    def forget(self, listener: Listener) -> None:
        with self._mutex:
            waiting = self._listeners.get(listener.key)
            if waiting is None or waiting.pop(listener.ticket_id, None) is None:
                return
            if waiting:
                return
            del self._listeners[listener.key]
        try:
            self._unsubscribe(listener.key)
        except Exception as exc:
            logger.debug("Unsubscribing from %s failed: %r", self.name, exc)

    def deliver(self, key: str, ticket_id: str | None = None) -> bool:
        """Wake the waiter holding ``ticket_id`` on ``key`` (every waiter on ``key``
        when ``ticket_id`` is None); False when none is in this process."""
        with self._mutex:
            waiting = self._listeners.get(key, {})
            found = [waiting.get(ticket_id)] if ticket_id else list(waiting.values())
        woken = [listener for listener in found if listener is not None]
        for listener in woken:
            listener.wake()
        return bool(woken)

    def connection_lost(self) -> None:
        """The channel broke: every waiter polls from now on (its listener is no
        longer healthy) and tries once at once, in case it missed its wake-up."""
        with self._mutex:
            self.generation += 1
            listeners = [lst for waiting in self._listeners.values() for lst in waiting.values()]
        for listener in listeners:
            listener.wake()

    def keys(self) -> list[str]:
        with self._mutex:
            return list(self._listeners)

    def close(self) -> None:
        """Stop any thread and connection (subclasses)."""

    # ------------------------------------------------------------- channel hooks
    def _subscribe(self, key: str) -> bool:
        """Start receiving wake-ups for ``key``; True once the server confirmed."""
        return True

    def _subscribed(self, key: str) -> bool:
        """Whether wake-ups for ``key`` (already subscribed) are being received."""
        return True

    def _unsubscribe(self, key: str) -> None:
        """Stop receiving wake-ups for ``key`` (no waiter of this process left)."""

    def _after_fork(self) -> None:
        """In a forked child the parent's threads and connections are gone. The
        child has one thread: fresh state is built without taking the parent's mutex,
        which another parent thread may have held at the fork."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._mutex = threading.RLock()
            self._listeners = {}
            self.generation += 1
            self._reset_after_fork()

    def _reset_after_fork(self) -> None:
        """Drop the parent's connection state (subclasses)."""


class WaitSession:
    """One waiting acquisition: its ticket, its listener, and the pause between attempts.

    A release can only wake a queued ticket, and a ticket is only queued after its
    listener exists, so no wake-up is lost. When the key's channel is already
    listened to (a hot key: :meth:`WakeUps.ready`), the listener is registered at once
    and every attempt carries the ticket. Otherwise the first attempt goes without a
    ticket, so an uncontended acquire of a fresh key costs what it did without queues
    (no subscription); only if it meets contention is the listener registered and,
    at once, an attempt with the ticket made to queue it. ``clock`` (seconds) is
    injectable.
    """

    def __init__(
        self, wake_ups: WakeUps, key: str, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.wake_ups = wake_ups
        self.key = key
        self.ticket = WaitTicket.new()
        self.listener: Listener | None = None
        self.clock = clock
        self.queued = False  # an attempt with the ticket met contention

    def attempt(self, request: Callable[[WaitTicket | None], AcquireResult]) -> AcquireResult:
        """The next attempt, through ``request(ticket)`` (see the class docstring)."""
        if self.listener is None and self.wake_ups.ready(self.key):
            self.listener = self.wake_ups.listen(self.key, self.ticket.id)
        if self.listener is None:
            result = request(None)
            if result.ok:
                return result
            self.listener = self.wake_ups.listen(self.key, self.ticket.id)
        result = request(self.ticket)
        self.queued = self.queued or not result.ok
        return result

    async def aattempt(
        self, request: Callable[[WaitTicket | None], Awaitable[AcquireResult]]
    ) -> AcquireResult:
        """Async twin of :meth:`attempt`."""
        if self.listener is None and self.wake_ups.ready(self.key):
            # Ready means no I/O: no need for a worker thread.
            self.listener = self.wake_ups.listen(self.key, self.ticket.id)
        if self.listener is None:
            result = await request(None)
            if result.ok:
                return result
            self.listener = await self.wake_ups.alisten(self.key, self.ticket.id)
        result = await request(self.ticket)
        self.queued = self.queued or not result.ok
        return result

    @property
    def healthy(self) -> bool:
        return self.listener is not None and self.listener.healthy

    def pause_plan(self, delay_s: float, remaining_s: float, position: int | None) -> float:
        """How long to wait at most before the next attempt."""
        if self.healthy:
            return min(CHECK_IN_MS / 1000, remaining_s)
        budget = min(delay_s, CHECK_IN_MS / 1000, remaining_s)
        if position is not None:
            # Polling by place: the first in line every HEAD_POLL_MS, the next ones a
            # little less often, so whoever moves up to first learns it soon.
            budget = min(budget, HEAD_POLL_MS * (position + 1) / 1000)
        return budget

    def pause(
        self, delay_s: float, remaining_s: float, cancel: CancelToken | None, position: int | None
    ) -> None:
        """Sleep until woken, or until the next attempt is due (see the module doc).

        The timer fires at the backoff delay; a healthy listener then goes back to
        sleep without a request until the check-in is due.
        """
        listener = self._listening()
        end = self.clock() + self.pause_plan(delay_s, remaining_s, position)
        step = max(delay_s, HEAD_POLL_MS / 1000)  # retry_delay_ms=0 must not spin
        while (left := end - self.clock()) > 0:
            if listener.wait(min(step, left), cancel) or not listener.healthy:
                return

    async def apause(
        self, delay_s: float, remaining_s: float, cancel: CancelToken | None, position: int | None
    ) -> None:
        """Async twin of :meth:`pause`."""
        listener = self._listening()
        end = self.clock() + self.pause_plan(delay_s, remaining_s, position)
        step = max(delay_s, HEAD_POLL_MS / 1000)
        while (left := end - self.clock()) > 0:
            if await listener.await_wake(min(step, left), cancel) or not listener.healthy:
                return

    def _listening(self) -> Listener:
        if self.listener is None:  # only a contended attempt leads to a pause
            raise RuntimeError("WaitSession.pause() before a contended attempt.")
        return self.listener

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()


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
