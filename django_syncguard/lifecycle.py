"""The process lifecycle: what a forked child starts with.

Celery's prefork pool, gunicorn ``--preload``, uWSGI without lazy apps and
``multiprocessing``'s fork start method all fork a process that has already set up
Django and, often, used a lock: the child inherits every object of the parent,
sockets included, but only the thread that forked. A socket shared by two processes
is a conversation with two speakers: one process reads the reply meant for the
other. So the package has one fork hook, :func:`os.register_at_fork`
(``after_in_child``), installed once when this module is imported, and objects that
hold clients register here with :func:`track`.

The fork rule. In the child, every tracked object's ``reset_after_fork()`` runs, in
the order the objects were tracked, before the child runs any code of its own; after
it, the child opens what it needs afresh on first use: its own database connections
(the database backend's per-thread private ones), wake-up channels and their
threads, and clients (Redis pools, Firestore's gRPC channels).

What the child inherited is *forgotten*, never closed: the parent is still using it,
and a close in the child talks to the server on the parent's behalf. libpq's
``PQfinish`` sends Terminate, which ends the parent's session; closing an SQLite
connection may checkpoint the parent's write-ahead log; a TLS shutdown sends an
alert; ``shutdown(2)`` on a socket ends it for both processes. psycopg 3 itself skips
``PQfinish`` when a connection object is garbage collected in another process than
the one that opened it (``PGconn.__del__`` compares the PID), but an explicit
``close()`` does not check, and SQLite's sqlite3 module closes on collection.
Celery's Django fixup closes the file descriptor under an inherited connection first
(``_maybe_close_db_fd``) and then lets ``close()`` fail on it; we do not need to touch
the descriptor at all. A reset hands what it drops to :func:`abandon`, which keeps it
referenced for the life of the process, so nothing finalizes it either; the child's
copies of the descriptors close when it exits, which the server does not notice as
long as the parent holds its own.

A reset must not take a lock that another thread of the parent may have held at the
fork: that thread does not exist in the child, and the lock would never be released.
A reset replaces such locks instead (this module replaces its own). Each reset is
guarded: an exception is logged on ``django_syncguard.lifecycle`` (the logging
module re-creates its own locks in a forked child first, since it registered its
hook before this one) and the next object is reset all the same.

On platforms without ``fork`` (Windows) nothing is installed: there is no child to
reset. ``spawn`` and ``forkserver`` children, and ``subprocess``, start a new
interpreter and run no hook.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any, Protocol

logger = logging.getLogger("django_syncguard.lifecycle")

__all__ = ["ForkAware", "abandon", "install", "track"]


class ForkAware(Protocol):
    """An object holding clients or locks that a forked child must not share."""

    def reset_after_fork(self) -> None:
        """In a forked child: forget (never close) what belongs to the parent, and
        replace locks, so that the next use opens fresh ones."""
        ...


#: The tracked objects by ``id()``, weakly, in the order they were tracked (a dead
#: object's entry goes with it, so its ``id()`` is free for a new object).
_tracked: weakref.WeakValueDictionary[int, ForkAware] = weakref.WeakValueDictionary()
#: Guards :func:`track`'s check-and-add; replaced, never acquired, in the child.
_mutex = threading.Lock()
#: What children dropped: kept referenced, so that nothing closes or finalizes it.
_abandoned: list[Any] = []
#: Whether the hook is registered; survives ``importlib.reload`` (one hook ever).
_installed: bool = globals().get("_installed", False)


def track(obj: ForkAware) -> None:
    """Reset ``obj`` in every child forked from now on (``obj.reset_after_fork()``).

    Weakly: tracking does not keep ``obj`` alive. Tracking it again changes nothing.
    ``obj`` must support weak references."""
    with _mutex:
        _tracked.setdefault(id(obj), obj)


def abandon(obj: object) -> None:
    """Keep ``obj``, inherited from the parent, referenced until this process ends,
    and never use it: neither closed nor finalized, it sends nothing to the server
    on the parent's behalf."""
    _abandoned.append(obj)


def install() -> None:
    """Register the package's fork hook, once per process (done at import)."""
    global _installed
    with _mutex:
        if _installed or not hasattr(os, "register_at_fork"):
            return
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _installed = True


def _after_fork_in_child() -> None:
    """The hook: fresh locks, then every tracked object's reset, each guarded."""
    global _mutex
    # The parent's mutex may have been held by a thread that is not here.
    _mutex = threading.Lock()
    for obj in list(_tracked.values()):
        try:
            obj.reset_after_fork()
        except Exception:
            logger.exception("Resetting %r after a fork failed.", obj)


install()
