"""Listeners and the process-wide wake-up registry of a backend.

A waiter registers a :class:`Listener` with its backend's :class:`WakeUps` before its
ticket is queued, so no wake-up meant for it can be lost. A release wakes the first
live ticket through the backend's channel; the registry hands that wake-up to the
listener holding the ticket. The base class is complete for in-process wake-ups (the
memory backend, SQLite within a process); :class:`~.channels.ChannelWorker` connects
it to a server's channel.

A listener is *healthy* while every release of its key since it was registered is
sure to reach it: the channel reaches every process, the server confirmed the
subscription, and the connection has not broken since (a broken connection bumps
:attr:`WakeUps.generation` and wakes every listener).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time

from ..cancellation import CancelToken, check_cancel
from ..lifecycle import track
from . import tickets
from .tickets import Grant

logger = logging.getLogger("django_syncguard.waiting")

#: Longest single blocking wait, so a ``cancel`` token without ``wait()`` is seen.
_CANCEL_SLICE_S = 0.025


def _recheck_at() -> float:
    """When a waiter that saw a grant go to another ticket tries again."""
    return time.monotonic() + (tickets.GRANT_WINDOW_MS + tickets.RECHECK_MARGIN_MS) / 1000


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
        #: The key, granted to this waiter by a release (set before the wake).
        self.grant: Grant | None = None
        #: ``time.monotonic()`` by which to try again: another waiter's grant will
        #: have lapsed by then if its process did not claim it (see :meth:`nudge`).
        self.recheck_at: float | None = None
        self._woken = False  # a wake, rather than a nudge, set the event

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
        self._woken = True
        self._signal()

    def nudge(self, recheck_at: float) -> None:
        """Thread-safe: end a wait by ``recheck_at`` at the latest, without waking it
        now (a wait in progress recomputes its end)."""
        self.recheck_at = recheck_at
        self._signal()

    def _end_s(self, deadline: float) -> float:
        recheck = self.recheck_at
        return (deadline if recheck is None else min(deadline, recheck)) - time.monotonic()

    def _consume(self) -> bool:
        """After the event fired: True for a wake (consumed), False for a nudge."""
        self._event.clear()
        woken, self._woken = self._woken, False
        return woken

    def _signal(self) -> None:
        self._event.set()
        self.wake_ups.signalled(self)
        if self._async is not None:
            loop, event = self._async
            # A closed loop means the waiter is gone.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(event.set)

    def wait(self, timeout_s: float, cancel: CancelToken | None) -> bool:
        """Block up to ``timeout_s``; True when woken (the wake is consumed)."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            remaining = self._end_s(deadline)
            step = remaining if cancel is None else min(remaining, _CANCEL_SLICE_S)
            if self.wake_ups.wait_for(self, max(step, 0.0)):
                if self._consume():
                    return True
                continue  # nudged: the end may have moved
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
            remaining = self._end_s(deadline)
            step = remaining if cancel is None else min(remaining, _CANCEL_SLICE_S)
            try:
                await asyncio.wait_for(event.wait(), max(step, 0.0))
            except TimeoutError:
                check_cancel(cancel)
                if remaining <= step:
                    return False
            else:
                event.clear()
                if self._consume():
                    return True

    def discard_wake(self) -> None:
        """Forget a wake-up not yet consumed."""
        self._event.clear()
        self._woken = False

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
        track(self)  # reset in a forked child (and lazily, should a fork escape the hook)

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
            confirmed = self._subscribe(key) if first else self._subscribed(key)
        except Exception as exc:  # the waiter falls back to polling
            logger.warning("Wake-ups of %s unavailable (%r); waiting by polling.", self.name, exc)
            return listener
        if confirmed:
            # Never set back to False: a confirmation may have crossed this call. One
            # that arrived while we waited may have woken the listener; no release can
            # be meant for it yet (its ticket is not queued).
            listener.confirmed = True
            listener.discard_wake()
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

    def deliver(self, key: str, ticket_id: str | None = None, grant: Grant | None = None) -> bool:
        """Wake the waiter holding ``ticket_id`` on ``key`` (every waiter on ``key``
        when ``ticket_id`` is None); False when none is in this process.

        With ``grant``, the key was granted to ``ticket_id``: :meth:`claim` runs (in the
        delivering thread, before the wake) and its waiter gets the grant; the other
        waiters of ``key`` here set their re-check past the grant's window."""
        with self._mutex:
            waiting = self._listeners.get(key, {})
            found = [waiting.get(ticket_id)] if ticket_id else list(waiting.values())
            others = [lst for tid, lst in waiting.items() if tid != ticket_id] if grant else []
        woken = [listener for listener in found if listener is not None]
        if others:
            recheck_at = _recheck_at()
            for other in others:
                other.nudge(recheck_at)
        if grant is not None and woken:
            # Before the wake: the waiter may release at once, and a release drops
            # the claim it finds pending (released()).
            self.claim(key, grant)
        for listener in woken:
            if grant is not None:
                listener.grant = grant
            listener.wake()
        if woken:
            self._yield_to_woken(woken)
        return bool(woken)

    def wait_for(self, listener: Listener, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until ``listener``'s event is set (True). A
        registry with a channel reads it in this thread meanwhile when it can (see
        :meth:`~.channels.ChannelWorker.wait_for`)."""
        return listener._event.wait(timeout_s)

    def signalled(self, listener: Listener) -> None:
        """``listener``'s event was just set (registries whose waiters may be blocked
        elsewhere than on it wake them)."""

    def _yield_to_woken(self, woken: list[Listener]) -> None:
        """Hand the GIL to the woken waiters now: otherwise they wait until this
        thread blocks (or for the interpreter's 5 ms switch interval)."""
        time.sleep(0)

    def recheck(self, key: str, ticket_id: str) -> None:
        """The key was granted to another waiter, and ``ticket_id`` is next: its
        waiter tries again once that grant's window is over, in case it lapses."""
        with self._mutex:
            listener = self._listeners.get(key, {}).get(ticket_id)
        if listener is not None:
            listener.nudge(_recheck_at())

    def hold_back(self, key: str, now: float | None = None) -> float:
        """Seconds a waiting acquisition of ``key`` starting now (or at ``now``, a
        ``time.monotonic()`` reading) waits before its first attempt (see
        :data:`~.tickets.QUEUE_AFTER_GRANT_MS`): 0 unless this process has just
        granted the key (registries that watch their grants)."""
        return 0.0

    def claim(self, key: str, grant: Grant) -> None:
        """Tell the server that the waiter a grant of ``key`` reached is alive, so the
        grant does not lapse (registries of backends that grant)."""

    def released(self, lock_id: str) -> None:
        """The holder of ``lock_id`` is releasing it: a claim not sent yet is not
        needed (a release claims too)."""

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

    def waited_on(self, key: str | None) -> bool:
        """Whether a waiter of this process is registered for ``key``."""
        with self._mutex:
            return key is not None and bool(self._listeners.get(key))

    def listeners_of(self, key: str) -> list[Listener]:
        with self._mutex:
            return list(self._listeners.get(key, {}).values())

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
        """The reset of :meth:`reset_after_fork`, if this process is a child that has
        not had it yet."""
        if self._pid != os.getpid():
            self.reset_after_fork()

    def reset_after_fork(self) -> None:
        """In a forked child the parent's threads and connections are gone. The
        child has one thread: fresh state is built without taking the parent's mutex,
        which another parent thread may have held at the fork."""
        self._pid = os.getpid()
        self._mutex = threading.RLock()
        self._listeners = {}
        self.generation += 1
        self._reset_after_fork()

    def _reset_after_fork(self) -> None:
        """Drop the parent's connection state (subclasses)."""
