"""Whether the peer of an idle connection has ended it, asked of its socket.

Drivers and redis-py read every reply to its end, so an idle connection has nothing
to read unless the other side spoke since. The database backend asks this before it
hands out a thread's private connection; the Redis backend before each call on a
thread's held connection (what redis-py's pool asks before it hands one out).
"""

from __future__ import annotations

import os
import select
import socket
from collections.abc import Collection
from typing import Any

#: Whether this platform has ``select.poll`` (Windows has not: ``select`` then).
HAS_POLL = hasattr(select, "poll")


class KeptPoll:
    """A poll object for the descriptor of one connection, kept between checks (a
    connection checked before every call): built again only for another descriptor
    (the connection was opened again). On a thread that slept through a lock's hold,
    building one per check cost about 13 µs more than polling a kept one."""

    __slots__ = ("fd", "poller")

    def __init__(self) -> None:
        self.fd: int | None = None
        self.poller: Any = None

    def readable(self, fd: int) -> bool:
        if not HAS_POLL:  # Windows
            return bool(select.select([fd], [], [], 0)[0])
        if fd != self.fd:
            self.poller = select.poll()
            self.poller.register(fd, select.POLLIN)
            self.fd = fd
        return bool(self.poller.poll(0))


def peer_ended(raw: Any, gone: Collection[bytes], kept: KeptPoll | None = None) -> bool:
    """True when the peer ended the idle connection whose socket (or driver object
    with a ``fileno()``) is ``raw``: it was reset, or the first byte waiting on it is
    one of ``gone`` (``b""``: the end of the stream; a protocol's last words).

    A poll without waiting (about a microsecond) decides the common case, nothing to
    read; only then is the first byte peeked at, on a copy of the file descriptor
    (the owner keeps its own, and its reader sees the byte afterwards). ``kept``:
    the connection's :class:`KeptPoll`, for a connection checked often."""
    try:
        fd = raw.fileno()
    except Exception:  # closed, or broken beyond telling
        return True
    if not (kept or KeptPoll()).readable(fd):
        return False
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            head = sock.recv(1, socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0))
    except BlockingIOError:
        return False
    except OSError:  # reset by the peer
        return True
    return head in gone
