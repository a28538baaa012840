"""Acquires whose caller gave up, released in the background.

An acquire that ends in ``NetworkTimeout``, a lost connection or a cancellation may
still take its lock: Redis runs a script it has already read once it gets the CPU
back (a paused or swapped-out server), PostgreSQL runs a statement that a stalled
network path or pooler delivers late, Firestore may commit a call whose deadline
passed. The lock such an acquire takes is held by nobody, and without help it keeps
its key for its whole TTL: every caller of that key waits and fails meanwhile.

The client chose the lock id before sending, so it can release it. Each backend
records the id an acquire is about to send (:func:`note_sent`); when the acquire
fails in a way that may have reached the server, the backend hands the id to its
:class:`OrphanReleaser`, whose thread releases it once the server answers again. The
caller is never blocked: adopting is a dictionary insert.

Bounds, so that a long outage costs little:

- at most :data:`MAX_PENDING` ids wait per backend; more are logged and left to their
  TTL;
- while the server does not answer, one release per round is tried (the round stops
  at the first failure), and rounds back off to :data:`MAX_PAUSE_S` apart;
- an id whose release keeps answering "not found" for :data:`SETTLE_S` after the
  server first answered is dropped: its acquire never ran, or lost to a holder;
- an id is dropped :data:`GIVE_UP_S` after it was adopted, whatever happened.

So an orphaned lock is released at most about :data:`MAX_PAUSE_S` plus one round of
releases after its server answers again. Releasing an id that never took a lock is
harmless: a release only ever removes the lock its id names.
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import LockError, TransientError
from .keys import display_hash

if TYPE_CHECKING:
    from .backends.base import BaseLockBackend

logger = logging.getLogger("django_syncguard.orphans")

#: Lock ids waiting for release, per backend.
MAX_PENDING = 1000
#: Pauses between rounds while the server does not answer (growing), in seconds.
PAUSES_S = (0.05, 0.1, 0.2, 0.4, 0.8)
#: The longest pause between two rounds, in seconds.
MAX_PAUSE_S = 1.0
#: How long "not found" is watched after the server first answered, in seconds.
SETTLE_S = 5.0
#: Pauses before an id whose release answered "not found" is tried again (the first,
#: second, ... answer), in seconds.
NOT_FOUND_PAUSES_S = (0.25, 0.5, 1.0)
#: How long after its adoption an id is dropped in any case, in seconds.
GIVE_UP_S = 600.0


class SentRequest:
    """The lock id of the acquire running in this context, once it is chosen, and
    whether a write of it may have been applied whatever the call ends with.

    ``with SentRequest() as sent``: within the block, :func:`note_sent` records
    the lock id an acquire sends in ``sent``. A context variable holding a mutable
    record: an acquire run in a worker thread (``sync_to_async`` copies the context)
    writes to the caller's record. (A class rather than a generator context manager:
    every acquire enters one, and contextlib's costs several calls more.)"""

    __slots__ = ("_token", "lock_id", "maybe_written")

    def __init__(self) -> None:
        self.lock_id: str | None = None
        self.maybe_written = False

    def __enter__(self) -> SentRequest:
        self._token = _SENT.set(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        _SENT.reset(self._token)


_SENT: contextvars.ContextVar[SentRequest | None] = contextvars.ContextVar(
    "django_syncguard_sent_lock_id", default=None
)


def note_sent(lock_id: str) -> str:
    """Record ``lock_id`` as the id the running acquire is about to send; returns it."""
    sent = _SENT.get()
    if sent is not None:
        sent.lock_id = lock_id
    return lock_id


def note_maybe_written() -> None:
    """Record that a write of the running acquire may have been applied although the
    call will not return its lock (a commit whose outcome is unknown, a WAIT that
    failed after its script ran): the id is released whatever the call ends with."""
    sent = _SENT.get()
    if sent is not None:
        sent.maybe_written = True


def note_settled() -> None:
    """Record that the running acquire released the lock id it may have written, and
    goes on under a new one: nothing of the old id is left to release."""
    sent = _SENT.get()
    if sent is not None:
        sent.maybe_written = False


@dataclass(slots=True)
class _Orphan:
    lock_id: str
    key_hash: str
    adopted_at: float
    #: When a release of it was first answered (with "not found").
    answered_at: float | None = None
    #: Not tried again before this time (releases answered "not found" back off).
    next_at: float = 0.0
    #: How many releases answered "not found".
    misses: int = 0


#: Every releaser of this process, weakly (see :func:`stop_all`).
_releasers: weakref.WeakSet[OrphanReleaser] = weakref.WeakSet()


def stop_all(timeout_s: float = 5.0) -> int:
    """Stop every releaser of this process whose thread runs, waiting up to
    ``timeout_s`` for each; returns how many were running. For a shutdown, or a test
    suite between tests (a thread left calling a server that a test stopped must not
    run into the next test's fork)."""
    running = [r for r in list(_releasers) if r._thread is not None and r._thread.is_alive()]
    for releaser in running:
        releaser.stop(timeout_s)
    return len(running)


# At exit, a releaser thread still running (a daemon) would meet the interpreter's
# finalization mid-call or mid-log-line, which can abort the process: stop them first,
# waiting briefly (pending ids are then left to their TTL, as documented).
atexit.register(stop_all, 1.0)


class OrphanReleaser:
    """Releases the lock ids of failed acquires of one backend, in a daemon thread.

    The thread starts with the first adopted id and ends when none is left. A forked
    child starts with a new, empty releaser (the backend forgets its parent's)."""

    def __init__(
        self,
        backend: BaseLockBackend,
        *,
        clock: Callable[[], float] = time.monotonic,
        autostart: bool = True,
    ) -> None:
        self.backend = backend
        self._clock = clock
        self._autostart = autostart
        self._pending: dict[str, _Orphan] = {}
        self._mutex = threading.Lock()
        self._idle = threading.Condition(self._mutex)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        #: Counters, for logs and tests.
        self.released = 0
        self.dropped = 0
        _releasers.add(self)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def adopt(self, lock_id: str, key: str, error: BaseException | None) -> bool:
        """Release ``lock_id`` (an acquire of ``key`` that failed with ``error``) in
        the background; ``False`` when too many wait already."""
        key_hash = display_hash(key)
        with self._mutex:
            if len(self._pending) >= MAX_PENDING:
                logger.warning(
                    "%s: %d acquires already wait for release; the one on key %s (%s) "
                    "is left to its TTL.",
                    self.backend.alias,
                    MAX_PENDING,
                    key_hash,
                    _outcome(error),
                )
                return False
            self._pending[lock_id] = _Orphan(lock_id, key_hash, self._clock())
            if self._autostart and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(
                    target=self._run, name=f"syncguard-orphans-{self.backend.alias}", daemon=True
                )
                self._thread.start()
        logger.info(
            "%s: an acquire on key %s ended in %s after it may have reached the server; "
            "its lock will be released once the server answers.",
            self.backend.alias,
            key_hash,
            _outcome(error),
        )
        return True

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no id is pending; ``False`` when ``timeout_s`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout_s)

    def _forget(self, orphan: _Orphan) -> None:
        """Take ``orphan`` off the pending ids (the caller holds the mutex)."""
        self._pending.pop(orphan.lock_id, None)
        if not self._pending:
            self._idle.notify_all()

    def stop(self, timeout_s: float = 0.0) -> None:
        """Make the thread end after its current release, and wait up to
        ``timeout_s`` for it (``close()``: its clients are closed next)."""
        self._stop.set()
        thread = self._thread
        if timeout_s and thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            with self._mutex:
                if not self._pending:
                    self._thread = None
                    return
            answered = self.run_round()
            failures = 0 if answered else failures + 1
            pause = MAX_PAUSE_S if failures > len(PAUSES_S) else (0.25, *PAUSES_S)[failures]
            self._stop.wait(min(pause, MAX_PAUSE_S))

    def run_round(self) -> bool:
        """Try to release each pending id once; ``False`` when the server did not
        answer (the round then stops: one probe per round during an outage)."""
        with self._mutex:
            round_ = list(self._pending.values())
        now = self._clock()
        for orphan in round_:
            if self._stop.is_set():
                return True
            if orphan.next_at > now and now - orphan.adopted_at < GIVE_UP_S:
                continue
            if not self._try(orphan):
                with self._mutex:  # to the back: one unreachable node or slot does not
                    if self._pending.pop(orphan.lock_id, None) is not None:  # starve the rest
                        self._pending[orphan.lock_id] = orphan
                return False
        return True

    def _try(self, orphan: _Orphan) -> bool:
        now = self._clock()
        if now - orphan.adopted_at >= GIVE_UP_S:
            self._drop(orphan, "no release succeeded for %.0f s; it is left to its TTL", GIVE_UP_S)
            return True
        try:
            result = self.backend.release(orphan.lock_id)
        except TransientError:
            return False
        except LockError as exc:
            self._drop(orphan, "its release failed (%s); it is left to its TTL", exc.code)
            return True
        except Exception:
            logger.exception("%s: releasing an orphaned lock failed.", self.backend.alias)
            self._drop(orphan, "its release raised; it is left to its TTL")
            return True
        if result.ok:
            # Logged first: a process that waits for its releaser (wait_idle) and then
            # exits must not find this thread in the middle of writing a log line.
            logger.warning(
                "%s: released the lock on key %s that an acquire took after its caller "
                "had given up.",
                self.backend.alias,
                orphan.key_hash,
            )
            with self._mutex:
                self._forget(orphan)
                self.released += 1
        elif orphan.answered_at is None or now - orphan.answered_at < SETTLE_S:
            if orphan.answered_at is None:
                orphan.answered_at = now
            pause = NOT_FOUND_PAUSES_S[min(orphan.misses, len(NOT_FOUND_PAUSES_S) - 1)]
            orphan.misses += 1
            orphan.next_at = now + pause
        else:
            # The server has answered "not found" for a while: the acquire never ran,
            # found the key held, or its lock is already gone.
            logger.debug(
                "%s: the failed acquire on key %s holds nothing.",
                self.backend.alias,
                orphan.key_hash,
            )
            with self._mutex:
                self._forget(orphan)
        return True

    def _drop(self, orphan: _Orphan, why: str, *args: object) -> None:
        logger.warning(
            "%s: the failed acquire on key %s: " + why + ".",
            self.backend.alias,
            orphan.key_hash,
            *args,
        )
        with self._mutex:
            self._forget(orphan)
            self.dropped += 1


def _outcome(error: BaseException | None) -> str:
    return type(error).__name__ if error is not None else "a write of unknown outcome"
