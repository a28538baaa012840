"""Fair, notified waiting: the one waiting engine every backend shares.

A waiter (``on_contended="wait"``, the default) on a backend with queues
(``backend.wake_ups`` is not ``None``) passes a :class:`WaitTicket` with its acquire
attempts; the backend keeps a per-key queue of live tickets beside the lock and wakes
the first one when the key is released. The modules:

* :mod:`.tickets`: the ticket, and its patience and check-in;
* :mod:`.queues`: the queue rule, for backends that decide it in Python;
* :mod:`.listeners`: a waiter's :class:`Listener` and the process-wide
  :class:`WakeUps` registry of a backend (complete for in-process wake-ups);
* :mod:`.channels`: :class:`~.channels.ChannelWorker`, the registry over a server
  channel (one thread and one connection per process and backend), which each
  transport (Redis pub/sub, PostgreSQL ``LISTEN``, Firestore Listen) plugs into;
* :mod:`.session`: one waiting acquisition (ticket, listener, pauses), which the
  acquisition loop (:func:`django_syncguard.acquisition.acquire_with_retry`) pauses on.

See ``specs/contract.md`` (Waiting) and each backend's spec for its queue and channel.
"""

from __future__ import annotations

from .listeners import Listener, WakeUps
from .queues import Queue, queue_admits, queue_head
from .session import HEAD_POLL_MS, WaitSession
from .tickets import CHECK_IN_MS, GRANT_WINDOW_MS, PATIENCE_MS, Grant, WaitTicket

__all__ = [
    "CHECK_IN_MS",
    "GRANT_WINDOW_MS",
    "HEAD_POLL_MS",
    "PATIENCE_MS",
    "Grant",
    "Listener",
    "Queue",
    "WaitSession",
    "WaitTicket",
    "WakeUps",
    "queue_admits",
    "queue_head",
]
