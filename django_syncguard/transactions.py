"""Releases that wait for the caller's transactions (``until_commit=True``).

When locked code ends while the running thread is inside ``transaction.atomic()`` on
one or more databases, its writes are not visible to anyone yet: releasing now
would let the next holder read the old data. The release is therefore handed to
each of those transactions and runs when the last of them ends, whichever way:

- **commit**: Django runs the transaction's commit hooks right after the commit;
  ours is one of them.
- **rollback** (and a connection closed mid-transaction): Django has no hook, but
  it drops the commit hooks it will never run (``run_on_commit = []``). Our hook is
  an object that only that list holds, so dropping the list frees it, and a
  ``weakref.finalize`` on it runs the release at that moment (reference counting
  frees it at once, in the thread that rolled back). Nothing waits for the request
  or the task to end.
- **a savepoint rolled back** inside a still-open transaction: Django drops the
  hooks registered under that savepoint. Ours is registered under none (an empty
  set of savepoint ids), so it stays for the transaction's real end.

A hook runs once whichever way the transaction ends: the commit path calls the
finalizer itself, which disarms it.

Neither path may be the only one. Django runs commit hooks in order and stops at the
first that raises (``robust=False``, its default): ours, later in the list, then never
runs, and the list Django was running stays alive as long as the exception's
traceback does (an error tracker, a task result). A rollback frees our hook only when
nothing else holds the dropped list, and only at once under reference counting. So a
:class:`_Watcher` thread, alive only while releases are pending, looks every
:data:`WATCH_PERIOD_S` whether each pending hook is still in its connection's
``run_on_commit``: once it is not, that transaction has ended (committed, rolled back
or closed; a rolled-back savepoint keeps the entry) and the release runs, from the
watcher's thread, once it has been missing for :data:`WATCH_GRACE_S` (the hooks
before ours may still be running).

**Tests.** Django's ``TestCase`` (and pytest-django's ``django_db``) wraps each test
in atomic blocks of its own that never commit. Those blocks are not the caller's
transaction: a lock taken outside any ``atomic()`` of the code under test is
released at once, as outside tests. A lock that ends inside the code's own
``atomic()`` is released when that block is rolled back, or, like any
``on_commit`` callback in a ``TestCase``, when ``captureOnCommitCallbacks(execute=True)``
runs the hooks, else at the end of the test. See ``specs/contract.md`` (Transactions).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created

from .lifecycle import track

logger = logging.getLogger("django_syncguard.transactions")

#: How often the watcher looks for transactions that ended without running our hook,
#: and how long a hook must have been missing from its connection before it acts.
WATCH_PERIOD_S = 0.1
WATCH_GRACE_S = 1.0


def open_transactions(
    among: Sequence[BaseDatabaseWrapper] | None = None,
) -> list[BaseDatabaseWrapper]:
    """The running thread's connections inside an ``atomic()`` block of its own code
    (a test case's blocks do not count); with ``among``, only those of ``among``."""
    candidates = connections.all(initialized_only=True) if among is None else among
    return [c for c in candidates if c.in_atomic_block and _first_own_block(c) is not None]


@dataclass(frozen=True, slots=True)
class HoldStart:
    """The running thread's connections when a hold began, and how many connections
    it had opened by then (see :func:`hold_start`)."""

    connections: list[BaseDatabaseWrapper]
    opened: int
    thread: int

    def open_transactions(self) -> list[BaseDatabaseWrapper]:
        """The thread's open transactions now, at the end of the hold.

        A block still open now was open when the hold began, on one of
        ``connections`` (blocks and holds nest), unless it was opened inside a
        generator that the locked code left suspended: its connection may be one the
        thread opened during the hold. Only then (Django sent ``connection_created``
        in this thread since) are the thread's connections listed anew: listing them
        costs little in a loop but a few tens of microseconds on a thread that slept
        through its hold (Django's per-thread storage is read once per alias, raising
        and catching twice each), and the end of a hold is the next holder's wait.
        A hold that ends in another thread than it began in (a generator moved
        between threads) lists the ending thread's connections, as any hold did."""
        if _opened_here() != self.opened or threading.get_ident() != self.thread:
            return open_transactions()
        return open_transactions(self.connections)


def hold_start() -> HoldStart:
    """What :meth:`HoldStart.open_transactions` needs, read when a hold begins (before
    any wait)."""
    return HoldStart(
        list(connections.all(initialized_only=True)), _opened_here(), threading.get_ident()
    )


# Connections the running thread opened (Django's ``connection_created``, sent by
# every backend's ``connect()``, which ``atomic()`` calls on a connection not open yet).
# Only compared within one hold, in one thread: nothing to reset in a forked child.
class _Opened(threading.local):
    # A class attribute, not getattr() with a default: in a thread that never opened
    # a connection (a Redis-only worker) the default meant an AttributeError raised and
    # caught at every hold's end, 15 µs of the next holder's wait after a 20 ms hold.
    count = 0


_opened = _Opened()


def _opened_here() -> int:
    return _opened.count


def _count_opened(sender: object, **kwargs: object) -> None:
    _opened.count += 1


connection_created.connect(_count_opened, dispatch_uid="django_syncguard.transactions.opened")


def _first_own_block(connection: BaseDatabaseWrapper) -> int | None:
    """Index of the outermost atomic block not opened by a test case, if any."""
    blocks = connection.atomic_blocks
    return next((i for i, b in enumerate(blocks) if not getattr(b, "_from_testcase", False)), None)


def _savepoints_of_own_transaction(connection: BaseDatabaseWrapper) -> set[str]:
    """The savepoint ids to register the hook under: none for a real transaction, so
    that it waits for the commit or rollback; inside a test case's blocks, the
    savepoint of the code's outermost ``atomic()`` and those of the test case's blocks
    around it, so that rolling back either (the code's own rollback, or the end of
    the test) releases."""
    first = _first_own_block(connection) or 0
    # Every block but the outermost pushed its savepoint id (None without one): the
    # first `first` are the test case's blocks' and the code's outermost block's.
    return {sid for sid in connection.savepoint_ids[:first] if sid}


def release_after(release: Callable[[], None], transactions: Sequence[BaseDatabaseWrapper]) -> None:
    """Call ``release()`` once every one of ``transactions`` has ended (committed,
    rolled back, or its connection closed)."""
    pending = _Pending(release, len(transactions))
    for connection in transactions:
        # Django's own entry (savepoint ids, callback, robust), as on_commit() makes it
        # (django-stubs still types the two-item form of Django < 4.2): under none of
        # the code's own savepoints, so that one rolled back inside the transaction
        # keeps it (see _savepoints_of_own_transaction); robust, so that an error
        # cannot stop the hooks after it.
        hooks = cast(list[tuple[set[str], Callable[[], None], bool]], connection.run_on_commit)
        end = _TransactionEnd(pending)
        hooks.append((_savepoints_of_own_transaction(connection), end.committed, True))
        _watcher.watch(connection, end)


class _Pending:
    """A release that waits for ``count`` transactions to end."""

    def __init__(self, release: Callable[[], None], count: int) -> None:
        self._release = release
        self._count = count
        self._mutex = threading.Lock()
        self._pid = os.getpid()

    def one_ended(self) -> None:
        if os.getpid() != self._pid:
            return  # a forked child's copy (its exit runs the hooks): the parent's to end
        with self._mutex:
            self._count -= 1
            last = self._count == 0
        if last:
            self._release()


class _TransactionEnd:
    """Sits in one connection's commit hooks until its transaction ends."""

    def __init__(self, pending: _Pending) -> None:
        # The finalizer must not refer to self: it runs when self is freed.
        self._ended = weakref.finalize(self, pending.one_ended)

    def committed(self) -> None:
        """The commit hook (a bound method: Django logs hooks by ``__qualname__``)."""
        self._ended()

    def pending_in(self, connection: BaseDatabaseWrapper) -> bool:
        """Whether this hook still waits in ``connection``'s commit hooks (read from
        the watcher's thread: the attribute is rebound, never mutated, when the
        transaction ends, and a rolled-back savepoint copies our entry over)."""
        return any(
            getattr(entry[1], "__self__", None) is self for entry in connection.run_on_commit
        )


class _Watcher:
    """Releases whose transaction ended without running their hook (see the module
    docstring). One daemon thread per process, while any release is pending. It holds
    hooks and connections weakly (the finalizer still fires as soon as a hook is
    freed), and acts on a hook only once it has been missing from its connection's
    hooks for :data:`WATCH_GRACE_S`: Django empties the list before it runs the hooks
    one by one, and ours must not overtake the ones before it."""

    def __init__(self) -> None:
        self._reset()
        track(self)

    def _reset(self) -> None:
        self._mutex = threading.Lock()
        self._pending: list[_Watched] = []
        self._thread: threading.Thread | None = None

    def reset_after_fork(self) -> None:
        """A forked child has no watcher thread and none of the parent's transactions."""
        self._reset()

    def watch(self, connection: BaseDatabaseWrapper, end: _TransactionEnd) -> None:
        with self._mutex:
            self._pending.append(_Watched(weakref.ref(connection), weakref.ref(end)))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="syncguard-transaction-watcher", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(WATCH_PERIOD_S)
            with self._mutex:
                pending = list(self._pending)
            done = {id(item) for item in pending if item.done(time.monotonic())}
            with self._mutex:
                self._pending = [item for item in self._pending if id(item) not in done]
                if not self._pending:
                    self._thread = None
                    return


class _Watched:
    """One pending release, as the watcher sees it."""

    def __init__(
        self,
        connection: weakref.ref[BaseDatabaseWrapper],
        end: weakref.ref[_TransactionEnd],
    ) -> None:
        self.connection = connection
        self.end = end
        self.missing_since: float | None = None

    def done(self, now: float) -> bool:
        """Whether the watcher is done with it; runs the release of a hook that has
        been missing for the grace period."""
        end, connection = self.end(), self.connection()
        if end is None:
            return True  # freed: its finalizer has run
        if connection is not None and end.pending_in(connection):
            self.missing_since = None
            return False
        self.missing_since = self.missing_since or now
        if now - self.missing_since < WATCH_GRACE_S:
            return False
        try:
            end.committed()  # a no-op when the hook ran meanwhile
        except Exception:
            logger.exception("A release deferred to the end of a transaction failed.")
        return True


_watcher = _Watcher()
