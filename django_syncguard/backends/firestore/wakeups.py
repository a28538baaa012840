"""The Firestore backend's wake-ups (``specs/backends/firestore.md``).

A key's waiters live in its lock document, beside the lock fields, so the acquire's
one read sees both (the layout: ``documents.py``). A release that leaves waiters
keeps the document without its lock fields (a *waiter-only* document). Each process
watches the lock documents of the keys its waiters wait for, and wakes the first live
waiter when a document shows the key free: :class:`FirestoreWakeUps`, the package's
:class:`~django_syncguard.waiting.channels.ChannelWorker` over a
:class:`FirestoreTransport` (a key's channel is its lock document's name).

**One Listen stream per backend object and process.** The Python client's
``on_snapshot`` opens one gRPC stream and one consumer thread per watched document, and
reopens a broken stream silently and without backoff, so that a waiter could not tell
that releases may have gone unseen. This module therefore speaks Firestore's Listen
protocol itself, on the backend's own client (its gRPC channel): one bidirectional
stream carries one document target per watched key, added and removed as the worker
subscribes and unsubscribes. gRPC's stream is read by blocking iteration, so each
stream has a pump thread that turns responses into the worker's events and pokes it;
a response that leaves our view in doubt ends the stream, and the worker reconnects.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from ...waiting import Grant
from ...waiting.channels import ChannelWorker, Confirmed, Event, Message
from .client import database_string, decode_fields, document_name, listen_stub, rpc_metadata
from .documents import first_waiter, unclaimed_grant

logger = logging.getLogger("django_syncguard.backends.firestore.wakeups")

#: Idle watches kept at most; beyond it the longest idle ones go at once.
MAX_IDLE_WATCHES = 64
#: Watched keys per process and backend; waiters on further keys poll.
MAX_WATCHES = 1_000
#: How long a stream closed on purpose may take to end before it is cancelled.
END_GRACE_S = 2.0


class _Resync(Exception):
    """The stream's view may have missed a change: start a new stream."""


#: Wake-ups that opened a stream: closed politely when the interpreter exits, rather
#: than cancelled by the channel's teardown.
_open: weakref.WeakSet[FirestoreWakeUps] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for wake_ups in list(_open):
        wake_ups.close()


def _ms(timestamp: Any) -> int:
    """A protobuf Timestamp as whole Unix milliseconds (as ``server_ms`` does)."""
    return int(timestamp.seconds) * 1000 + int(timestamp.nanos) // 1_000_000


class FirestoreTransport:
    """Firestore Listen as a channel transport. ``client`` returns the backend's (sync)
    Firestore client, ``document`` the lock document reference of a key."""

    confirms_on_listen = True
    let_waiters_read = False  # a Listen stream, no socket to wait on
    max_channels: int | None = MAX_WATCHES
    connection_name = "Firestore stream"
    logger = logger

    def __init__(
        self, client: Callable[[], Any], document: Callable[[str], Any], grace_s: float
    ) -> None:
        self._client = client
        self._document = document
        self._grace_s = grace_s

    @property
    def idle_cap(self) -> int:
        return MAX_IDLE_WATCHES

    def channel(self, key: str) -> str:
        # Not cached on the key: that would keep this transport (and its client) alive.
        return document_name(self._document(key))

    def connect(self, poke: Callable[[], None]) -> _Watching:
        return _Watching(self._client(), poke, self._grace_s)


class _Watching:
    """One Listen call (a :class:`~django_syncguard.waiting.channels.Connection`): the
    worker adds and removes targets, a pump thread reads the responses, and what the
    call learnt since its last consistent snapshot.

    It is never simply cancelled. The emulator fails other clients' commits to a
    watched document (``CANCELLED``, or ``UNKNOWN`` after a half-close, although the
    commit was applied) when they race with the end of a call that still has the
    document as a target. So a call is closed politely: every target removed, the
    server's acknowledgements awaited, then the request side half-closed and the
    call left to end; only a call still open after a grace period is cancelled.
    """

    def __init__(self, client: Any, poke: Callable[[], None], grace_s: float) -> None:
        self.client = client
        self.database: str = database_string(client)
        self.poke = poke
        self.grace_s = grace_s
        self.lock = threading.Lock()  # everything below, shared with the pump
        self.requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.call: Any = None
        self.targets: dict[str, int] = {}  # document name -> target id, while added
        self.names: dict[int, str] = {}  # target id -> document name
        self.next_target = 1
        self.removing: set[int] = set()  # removal sent, not yet acknowledged
        self.closing = False  # no further use: targets go, then the call
        self.current: set[int] = set()  # targets the server called CURRENT
        self.pending: dict[str, dict[str, Any] | None] = {}  # name -> state (None: missing)
        self.exists: dict[str, bool] = {}  # name -> whether the document exists
        self.confirmed: set[str] = set()
        self.granted: dict[str, str] = {}  # name -> the lock id of the grant last told
        self.events: list[Event] = []
        self.finished = False
        self.error: BaseException | None = None
        self.pump = threading.Thread(target=self._pump, name="syncguard-listen", daemon=True)
        self.pump.start()

    def fileno(self) -> None:
        return None  # the pump pokes the worker

    def subscribe(self, channels: Sequence[str]) -> Iterable[str]:
        from google.cloud.firestore_v1.types import ListenRequest, Target

        with self.lock:
            for name in channels:
                target_id, self.next_target = self.next_target, self.next_target + 1
                self.targets[name], self.names[target_id] = target_id, name
                documents = Target.DocumentsTarget(documents=[name])
                target = Target(documents=documents, target_id=target_id)
                self.requests.put(ListenRequest(database=self.database, add_target=target))
        return ()  # confirmed by a consistent snapshot

    def unsubscribe(self, channels: Sequence[str]) -> None:
        with self.lock:
            for name in channels:
                if name in self.targets:
                    self._remove(name)

    def _remove(self, name: str) -> None:
        """Send the removal of ``name``'s target (caller holds ``lock``)."""
        from google.cloud.firestore_v1.types import ListenRequest

        target_id = self.targets.pop(name)
        self.names.pop(target_id, None)
        self.confirmed.discard(name)
        self.granted.pop(name, None)
        self.pending.pop(name, None)
        self.exists.pop(name, None)
        self.current.discard(target_id)
        self.removing.add(target_id)
        self.requests.put(ListenRequest(database=self.database, remove_target=target_id))

    def receive(self) -> list[Event]:
        with self.lock:
            events, self.events = self.events, []
            # What arrived before the end is delivered first; the end, next time.
            if self.finished and not events:
                raise self.error or ConnectionError("the Listen stream ended")
        return events

    def check(self) -> float:
        return float("inf")  # a broken stream ends the call: the pump reports it

    def close(self) -> None:
        """End the call politely and wait for it to end: a channel closed under a call
        that still watches a document fails other clients' commits on the emulator."""
        with self.lock:
            self._end()
        if self.pump is not threading.current_thread():
            self.pump.join(self.grace_s + 1)

    def _end(self) -> None:
        """Close the call politely (see the class docstring); cancel it if it is still
        open after the grace period. Caller holds ``lock``."""
        if self.closing:
            return
        self.closing = True
        for name in list(self.targets):
            self._remove(name)
        if not self.removing:
            self._half_close()
        timer = threading.Timer(self.grace_s, self._give_up)
        timer.daemon = True
        timer.start()

    def _half_close(self) -> None:
        self.requests.put(None)  # ends the request iterator: gRPC half-closes the call

    def _give_up(self) -> None:
        """Cancel the call (nothing happens to a call that has ended)."""
        self._half_close()
        if self.call is not None:
            self.call.cancel()

    def _removed(self, target_ids: Iterable[int]) -> None:
        """The server acknowledged removals; a closing call half-closes after the last
        (caller holds ``lock``)."""
        self.removing.difference_update(target_ids)
        if self.closing and not self.removing:
            self._half_close()

    def _outgoing(self) -> Iterator[Any]:
        """The request iterator gRPC consumes; it ends at the ``None`` of a half-close."""
        while (request := self.requests.get()) is not None:
            yield request

    def _pump(self) -> None:
        """Run the Listen call until it ends, then report how."""
        client = self.client
        try:
            # The transport's bare stub: the client's wrapped method would put the
            # operation timeout on a stream that must stay open.
            call = listen_stub(client)(self._outgoing(), metadata=rpc_metadata(client))
        except Exception as exc:
            self._half_close()
            self._finish(exc)
            return
        with self.lock:
            self.call = call  # ended meanwhile: it half-closes after its requests
        error: BaseException | None = None
        try:
            for response in call:
                try:
                    self._on_response(response)
                except Exception as exc:  # _Resync, a document we cannot read
                    # Our view may be stale: end this stream (politely); the worker
                    # starts another.
                    error = error or exc
                    with self.lock:
                        self._end()
        except Exception as exc:  # grpc.RpcError: the call failed, or was given up on
            error = error or exc
        self._half_close()  # lets gRPC's request thread return
        self._finish(error)

    def _finish(self, error: BaseException | None) -> None:
        with self.lock:
            self.finished, self.error = True, error
        self.poke()

    def _on_response(self, response: Any) -> None:
        from google.cloud.firestore_v1.types import TargetChange

        kinds = TargetChange.TargetChangeType
        pb = type(response).pb(response)
        which = pb.WhichOneof("response_type")
        if which == "target_change":
            change = pb.target_change
            # No target ids and a read time: everything sent so far is one consistent
            # snapshot, as of that time.
            if change.target_change_type == kinds.NO_CHANGE:
                if not change.target_ids and change.HasField("read_time"):
                    self._settle(_ms(change.read_time))
                return
            if change.target_change_type == kinds.REMOVE and change.cause.code:
                raise _Resync(f"target removed by the server: {change.cause.message}")
            with self.lock:
                if change.target_change_type == kinds.REMOVE:  # one we asked for
                    self._removed(change.target_ids)
                elif change.target_change_type == kinds.CURRENT:
                    self.current.update(change.target_ids)
                elif change.target_change_type == kinds.RESET:  # its state comes again
                    for target_id in change.target_ids:
                        self.pending.pop(self.names.get(target_id, ""), None)
            return
        state: dict[str, Any] | None = None
        if which == "document_change":
            document = response.document_change.document
            name = document.name
            if pb.document_change.target_ids:  # else it left our targets: missing for us
                data = decode_fields(document.fields, self.client)
                state = data if isinstance(data, dict) else {}
        elif which in ("document_delete", "document_remove"):
            name = getattr(pb, which).document
        elif which == "filter":
            # How many documents the server holds for a target: ours hold 0 or 1.
            with self.lock:
                watched = self.names.get(pb.filter.target_id)
                if watched and pb.filter.count != int(self.exists.get(watched, False)):
                    raise _Resync("existence filter mismatch")
            return
        else:
            return
        with self.lock:
            self.pending[name] = state
            self.exists[name] = state is not None

    def _settle(self, now_ms: int) -> None:
        """A consistent snapshot at ``now_ms``: wake the first live waiter of every
        changed document that shows its key free, tell each grant not yet claimed to
        its ticket (once per grant: the document changes again while it waits to be
        claimed, and a second delivery would postpone the claim), and confirm new
        watches."""
        with self.lock:
            pending, self.pending = self.pending, {}
            for name, data in pending.items():
                if name not in self.targets:
                    continue
                head = first_waiter(data, now_ms)
                if head is not None:
                    self.events.append(Message(name, head))
                    continue
                granted = unclaimed_grant(data, now_ms)
                if granted is not None and self.granted.get(name) != granted[1].lock_id:
                    self.granted[name] = granted[1].lock_id
                    self.events.append(Message(name, *granted))
            if not self.closing:
                for name, target_id in self.targets.items():
                    if target_id in self.current and name not in self.confirmed:
                        self.confirmed.add(name)
                        self.events.append(Confirmed(name))
        self.poke()


class FirestoreWakeUps(ChannelWorker):
    """Wake-ups through a Listen stream on the lock documents of waited-for keys.

    ``client`` returns the backend's (sync) Firestore client, ``document`` the lock
    document reference of a key; ``timeout_s`` bounds how long :meth:`listen` waits for
    the server to confirm a new watch.
    """

    def __init__(
        self,
        name: str,
        *,
        client: Callable[[], Any],
        document: Callable[[str], Any],
        timeout_s: float,
        claim: Callable[[str, Grant], None] | None = None,
        granted: Callable[[str, Grant], None] | None = None,
    ) -> None:
        transport = FirestoreTransport(client, document, min(timeout_s, END_GRACE_S))
        super().__init__(name, transport, timeout_s=timeout_s)
        self._claimer = claim
        self._granted = granted
        _open.add(self)

    def claim(self, key: str, grant: Grant) -> None:
        """A grant reached a waiter here: claim it later (the worker's timer), and let
        the backend know where the granted lock lives, so that its release reads the
        document directly."""
        if self._granted is not None:
            self._granted(key, grant)
        super().claim(key, grant)

    def _claim_on_server(self, key: str, grant: Grant) -> None:
        if self._claimer is not None:
            self._claimer(key, grant)

    def watched(self) -> list[str]:
        """The keys on the stream now (waited for, or idle and not yet unwatched)."""
        with self._cond:
            return list(self._channels.values())
