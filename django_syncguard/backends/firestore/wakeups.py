"""The Firestore backend's wake-ups (``specs/backends/firestore.md``).

A key's waiters live in its lock document, beside the lock fields, so the acquire's
one read sees both (the layout: ``documents.py``). A release that leaves waiters
keeps the document without its lock fields (a *waiter-only* document). Each process
watches the lock documents of the keys its waiters wait for, and wakes the first live
waiter when a document shows the key free: :class:`FirestoreWakeUps`.

**One Listen stream per backend object and process.** The Python client's
``on_snapshot`` opens one gRPC stream and one consumer thread per watched document, and
reopens a broken stream silently and without backoff, so that a waiter could not tell
that releases may have gone unseen. This module therefore speaks Firestore's Listen
protocol itself, on the backend's own client (its gRPC channel): one bidirectional
stream carries one document target per watched key, added and removed as waiters come
and go, read by one thread that reconnects with a bounded backoff and reports every
break through :meth:`~django_syncguard.waiting.WakeUps.connection_lost`.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ...waiting import WakeUps
from .client import database_string, decode_fields, document_name, listen_stub, rpc_metadata
from .documents import first_waiter

logger = logging.getLogger("django_syncguard.backends.firestore.wakeups")

#: A watch whose key has had no local waiter this long is removed from the stream.
IDLE_UNWATCH_S = 30.0
#: Idle watches kept at most; beyond it the longest idle ones go at once.
MAX_IDLE_WATCHES = 64
#: Watched keys per process and backend; waiters on further keys poll.
MAX_WATCHES = 1_000
#: Reconnection delays after a broken stream: doubled per failed try, up to the maximum.
RECONNECT_MIN_S = 0.1
RECONNECT_MAX_S = 5.0
#: How long a stream closed on purpose may take to end before it is cancelled.
END_GRACE_S = 2.0


# ---------------------------------------------------------------------- the wake-ups
@dataclass(eq=False)
class _Watch:
    """One watched key: its target on the stream, and whether the server confirmed it."""

    target_id: int
    name: str  # the lock document's resource name
    confirmed: bool = False  # the server sent its state: no release goes unseen now
    idle_since: float | None = None  # monotonic; None while the key has local waiters


class _Resync(Exception):
    """The stream's view may have missed a change: start a new stream."""


class _Stream:
    """One Listen call: the requests sent on it, and what it learnt since its last
    consistent snapshot.

    It is never simply cancelled. The emulator fails other clients' commits to a
    watched document (``CANCELLED``, or ``UNKNOWN`` after a half-close, although the
    commit was applied) when they race with the end of a call that still has the
    document as a target. So a stream is closed politely: every target removed, the
    server's acknowledgements awaited, then the request side half-closed and the
    call left to end; only a call still open after a grace period is cancelled.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self.database: str = database_string(client)
        self.requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.call: Any = None
        self.targets: set[int] = set()  # added and not being removed
        self.removing: set[int] = set()  # removal sent, not yet acknowledged
        self.closing = False  # no further use: targets go, then the call
        self.ended = False  # closed on purpose (no reconnection follows)
        self.established = False  # a consistent snapshot arrived
        self.current: set[int] = set()  # targets the server called CURRENT
        self.pending: dict[str, dict[str, Any] | None] = {}  # name -> state (None: missing)
        self.exists: dict[str, bool] = {}  # name -> whether the document exists

    def add(self, watch: _Watch) -> None:
        from google.cloud.firestore_v1.types import ListenRequest, Target

        target = Target(
            documents=Target.DocumentsTarget(documents=[watch.name]), target_id=watch.target_id
        )
        self.targets.add(watch.target_id)
        self.requests.put(ListenRequest(database=self.database, add_target=target))

    def remove(self, watch: _Watch) -> None:
        self.pending.pop(watch.name, None)
        self.exists.pop(watch.name, None)
        self._remove(watch.target_id)

    def _remove(self, target_id: int) -> None:
        from google.cloud.firestore_v1.types import ListenRequest

        self.targets.discard(target_id)
        self.current.discard(target_id)
        self.removing.add(target_id)
        self.requests.put(ListenRequest(database=self.database, remove_target=target_id))

    def removed(self, target_ids: Iterable[int]) -> None:
        """The server acknowledged removals; a closing stream half-closes after the last."""
        self.removing.difference_update(target_ids)
        if self.closing and not self.removing:
            self.half_close()

    def outgoing(self) -> Iterator[Any]:
        """The request iterator gRPC consumes; it ends at the ``None`` of a half-close."""
        while (request := self.requests.get()) is not None:
            yield request

    def end(self, grace_s: float, *, on_purpose: bool = True) -> None:
        """Close the call politely (see the class docstring); cancel it if it is still
        open after ``grace_s``. Caller holds the wake-ups' lock."""
        self.ended = self.ended or on_purpose
        if self.closing:
            return
        self.closing = True
        for target_id in list(self.targets):
            self._remove(target_id)
        if not self.removing:
            self.half_close()
        timer = threading.Timer(grace_s, self.give_up)
        timer.daemon = True
        timer.start()

    def half_close(self) -> None:
        self.requests.put(None)  # ends the request iterator: gRPC half-closes the call

    def give_up(self) -> None:
        """Cancel the call (nothing happens to a call that has ended)."""
        self.half_close()
        if self.call is not None:
            self.call.cancel()


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


class FirestoreWakeUps(WakeUps):
    """Wake-ups through a Listen stream on the lock documents of waited-for keys.

    ``client`` returns the backend's (sync) Firestore client, ``document`` the lock
    document reference of a key; ``timeout_s`` bounds how long :meth:`listen` waits for
    the server to confirm a new watch.
    """

    reaches_other_processes = True

    def __init__(
        self,
        name: str,
        *,
        client: Callable[[], Any],
        document: Callable[[str], Any],
        timeout_s: float,
    ) -> None:
        super().__init__(name)
        self._client = client
        self._document = document
        self._timeout_s = timeout_s
        self._grace_s = min(timeout_s, END_GRACE_S)
        self._closed = False
        self._init_state()

    def _init_state(self) -> None:
        self._wlock = threading.Lock()  # watches and stream; taken before WakeUps._mutex
        self._changed = threading.Condition(self._wlock)  # a watch confirmed, a stream lost
        self._watches: dict[str, _Watch] = {}
        self._keys: dict[str, str] = {}  # document name -> key
        self._next_target = 1
        self._stream: _Stream | None = None
        self._thread: threading.Thread | None = None
        self._connected = False
        self._broken = False  # the last stream failed: reconnecting
        self._stop = threading.Event()
        self._sweeper: threading.Timer | None = None

    @property
    def connected(self) -> bool:
        return self._connected and not self._closed

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until the stream is established (True), at most ``timeout_s``."""
        with self._wlock:
            return self._changed.wait_for(lambda: self.connected, timeout_s)

    def watched(self) -> list[str]:
        """The keys on the stream now (waited for, or idle and not yet unwatched)."""
        with self._wlock:
            return list(self._watches)

    # ------------------------------------------------------------- channel hooks
    def _subscribe(self, key: str) -> bool:
        return self._watch(key)

    def _subscribed(self, key: str) -> bool:
        # The first waiter's watch may still await its confirmation: wait for it too.
        return self._watch(key)

    def _watch(self, key: str) -> bool:
        """Watch ``key``'s lock document; True once the server confirmed the watch."""
        with self._wlock:
            if self._closed:
                return False
            watch = self._watches.get(key)
            if watch is None:
                if len(self._watches) >= MAX_WATCHES:
                    self._evict_idle(keep=0)
                if len(self._watches) >= MAX_WATCHES:
                    logger.info("%s watches %d keys: this waiter polls.", self.name, MAX_WATCHES)
                    return False
                watch = _Watch(self._next_target, document_name(self._document(key)))
                self._next_target += 1
                self._watches[key] = watch
                self._keys[watch.name] = key
                if self._stream is not None:
                    self._stream.add(watch)
            if self._thread is None:  # the first watch, or after a failure to start
                _open.add(self)
                self._thread = threading.Thread(
                    target=self._run, name=f"syncguard-{self.name}", daemon=True
                )
                self._thread.start()
            watch.idle_since = None
            if self._broken:
                return False  # reconnecting: poll; the watch joins the next stream
            self._changed.wait_for(
                lambda: watch.confirmed or self._broken or self._closed, self._timeout_s
            )
            return watch.confirmed and not self._closed

    def _unsubscribe(self, key: str) -> None:
        # Lazily: a key waited for again soon keeps its confirmed watch.
        with self._wlock:
            watch = self._watches.get(key)
            if watch is None or self._closed:
                return
            watch.idle_since = time.monotonic()
            self._evict_idle(keep=MAX_IDLE_WATCHES)
            if self._sweeper is None:
                self._schedule_sweep(IDLE_UNWATCH_S)

    def _evict_idle(self, keep: int) -> None:
        """Unwatch the longest idle keys beyond ``keep``. Caller holds ``_wlock``."""
        idle = sorted(
            (w.idle_since, key) for key, w in self._watches.items() if w.idle_since is not None
        )
        for _, key in idle[: max(len(idle) - keep, 0)]:
            self._drop(key)

    def _schedule_sweep(self, delay_s: float) -> None:
        self._sweeper = threading.Timer(delay_s, self._sweep)
        self._sweeper.daemon = True
        self._sweeper.start()

    def _sweep(self) -> None:
        with self._wlock:
            self._sweeper = None
            if self._closed:
                return
            now = time.monotonic()
            for key, watch in list(self._watches.items()):
                if watch.idle_since is not None and now - watch.idle_since >= IDLE_UNWATCH_S:
                    self._drop(key)
            idle = [w.idle_since for w in self._watches.values() if w.idle_since is not None]
            if idle:
                self._schedule_sweep(max(min(idle) + IDLE_UNWATCH_S - now, 0.1))

    def _drop(self, key: str) -> None:
        """Remove ``key``'s watch unless a waiter came back. Caller holds ``_wlock``."""
        with self._mutex:
            waited = bool(self._listeners.get(key))
        watch = self._watches[key]
        if waited:  # a listener registered after the last one left
            watch.idle_since = None
            return
        del self._watches[key]
        self._keys.pop(watch.name, None)
        if self._stream is not None:
            self._stream.remove(watch)
            if not self._watches:  # nothing left to watch: the thread ends with its stream
                self._stream.end(self._grace_s)
                self._stream = None

    # ------------------------------------------------------------------- stream
    def _run(self) -> None:
        """The reader thread: one stream after another while keys are watched."""
        delay = RECONNECT_MIN_S
        me = threading.current_thread()
        while True:
            with self._wlock:
                if self._closed or not self._watches or self._thread is not me:
                    if self._thread is me:
                        self._thread = None
                    return
                try:
                    stream = _Stream(self._client())
                except Exception as exc:  # no client (bad settings): waiters poll
                    logger.warning("%s: no Firestore client for wake-ups (%r).", self.name, exc)
                    self._thread = None
                    self._broken = True
                    self._changed.notify_all()
                    return
                for watch in self._watches.values():
                    stream.add(watch)
                self._stream = stream
            error = self._consume(stream)
            with self._wlock:
                if self._stream is stream:
                    self._stream = None
                for watch in self._watches.values():
                    watch.confirmed = False
                self._connected = False
                lost = not stream.ended and not self._closed
                self._broken = lost
                self._changed.notify_all()
            if not lost:
                continue
            logger.warning(
                "Wake-ups of %s lost their Firestore stream (%r); waiters poll until it is back.",
                self.name,
                error,
            )
            self.connection_lost()
            if stream.established:
                delay = RECONNECT_MIN_S
            if self._stop.wait(delay):
                continue  # closed: the loop ends
            delay = min(delay * 2, RECONNECT_MAX_S)

    def _consume(self, stream: _Stream) -> BaseException | None:
        """Run one Listen call until it ends; the error that ended it, if any."""
        try:
            # The transport's bare stub: the client's wrapped method would put the
            # operation timeout on a stream that must stay open.
            listen = listen_stub(stream.client)
            call = listen(stream.outgoing(), metadata=rpc_metadata(stream.client))
        except Exception as exc:
            stream.half_close()
            return exc
        with self._wlock:
            stream.call = call  # ended meanwhile: the call half-closes after its requests
        error: BaseException | None = None
        try:
            for response in call:
                try:
                    self._on_response(stream, response)
                except Exception as exc:  # _Resync, a document we cannot read
                    # Our view may be stale: end this stream (politely) and start another.
                    error = error or exc
                    with self._wlock:
                        stream.end(self._grace_s, on_purpose=False)
        except Exception as exc:  # grpc.RpcError: the call failed, or was given up on
            error = error or exc
        stream.half_close()  # lets gRPC's request thread return
        return error

    def _on_response(self, stream: _Stream, response: Any) -> None:
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
                    self._settle(stream, _ms(change.read_time))
                return
            if change.target_change_type == kinds.REMOVE and change.cause.code:
                raise _Resync(f"target removed by the server: {change.cause.message}")
            with self._wlock:
                if change.target_change_type == kinds.REMOVE:  # one we asked for
                    stream.removed(change.target_ids)
                elif change.target_change_type == kinds.CURRENT:
                    stream.current.update(change.target_ids)
                elif change.target_change_type == kinds.RESET:  # its state comes again
                    for watch in self._watches.values():
                        if watch.target_id in change.target_ids:
                            stream.pending.pop(watch.name, None)
            return
        state: dict[str, Any] | None = None
        if which == "document_change":
            document = response.document_change.document
            name = document.name
            if pb.document_change.target_ids:  # else it left our targets: missing for us
                data = decode_fields(document.fields, stream.client)
                state = data if isinstance(data, dict) else {}
        elif which in ("document_delete", "document_remove"):
            name = getattr(pb, which).document
        elif which == "filter":
            # How many documents the server holds for a target: ours hold 0 or 1.
            with self._wlock:
                target = pb.filter.target_id
                names = [w.name for w in self._watches.values() if w.target_id == target]
                if names and pb.filter.count != int(stream.exists.get(names[0], False)):
                    raise _Resync("existence filter mismatch")
            return
        else:
            return
        with self._wlock:
            stream.pending[name] = state
            stream.exists[name] = state is not None

    def _settle(self, stream: _Stream, now_ms: int) -> None:
        """A consistent snapshot at ``now_ms``: wake the first live waiter of every
        changed document that shows its key free, and confirm new watches."""
        deliveries: list[tuple[str, str]] = []
        with self._wlock:
            pending, stream.pending = stream.pending, {}
            for name, data in pending.items():
                key = self._keys.get(name)
                head = first_waiter(data, now_ms) if key is not None else None
                if key is not None and head is not None:
                    deliveries.append((key, head))
            if stream is self._stream and not stream.closing:
                stream.established = True
                self._connected = True
                self._broken = False
                for watch in self._watches.values():
                    watch.confirmed = watch.confirmed or watch.target_id in stream.current
                self._changed.notify_all()
        for key, head in deliveries:
            self.deliver(key, head)

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """End the stream and its thread; waiters still registered poll from now on."""
        with self._wlock:
            if self._closed:
                return
            self._closed = True
            self._connected = False
            stream, thread, sweeper = self._stream, self._thread, self._sweeper
            self._stream = self._sweeper = None
            self._watches.clear()
            self._keys.clear()
            if stream is not None:
                stream.end(self._grace_s)
            self._changed.notify_all()
        self._stop.set()
        if sweeper is not None:
            sweeper.cancel()
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._grace_s + 1)
        _open.discard(self)
        self.connection_lost()

    def _reset_after_fork(self) -> None:
        # The parent's stream and threads do not exist here (and its locks may have
        # been held at the fork): start from nothing, without touching its call.
        self._init_state()
