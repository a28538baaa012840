"""A TCP proxy on loopback that injects network faults between a client and a server.

``FaultProxy(upstream_port).start()`` listens on a free port of 127.0.0.1 and
forwards every connection to ``127.0.0.1:upstream_port``, in both directions, from
an asyncio loop in a background thread. Controls, callable from any thread (each
takes effect before it returns):

- ``set_latency(ms)``: every chunk is forwarded ``ms`` after it arrived, like a link
  with that one-way delay: a request and its reply each pay it once, however many
  chunks (HTTP/2 frames, say) they arrive in;
- ``stall()``: keep accepting and holding connections (new ones too), forward no
  byte: a server that went silent, or a middlebox that hangs. Nothing is closed, so
  TCP keepalives and ``tcp_user_timeout`` see a healthy peer;
- ``drop()``: reset every open connection (``SO_LINGER`` 0, so the peers get an RST,
  not a FIN); new connections are still accepted;
- ``resume()``: forward again, without latency; held bytes flow on.

``wait_for_held_request()`` returns once, while stalled, the proxy holds the start of
a request: a call is then in flight and cannot have reached the server. On PostgreSQL
and Redis connections any client byte is a request. On HTTP/2 (gRPC, the Firestore
emulator) only a HEADERS frame opens one: the client also sends pings, window updates
and stream resets of its own, and a drop while only those are held would reset a
connection the call has not used yet (gRPC then sends it on a new one).

``stop()`` resets everything and closes the listening socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Coroutine
from typing import Any

_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends an RST
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HTTP2_FRAME_HEADER = 9  # length (3 bytes), type, flags, stream id (4 bytes)
_HTTP2_HEADERS = 0x1


class _Requests:
    """Reads a client's byte stream from its first byte and tells, chunk by chunk,
    whether a chunk carries the start of a request (see the module docstring)."""

    def __init__(self) -> None:
        self._start = b""  # the first bytes, until the protocol is known
        self._http2: bool | None = None
        self._frame_header = b""  # an HTTP/2 frame header split across chunks
        self._payload_left = 0  # bytes of the current frame's payload still to come

    def feed(self, data: bytes) -> bool:
        if self._http2 is None:
            self._start += data
            if len(self._start) < len(_HTTP2_PREFACE) and _HTTP2_PREFACE.startswith(self._start):
                return False  # the preface so far: no request yet, protocol not known
            self._http2 = self._start.startswith(_HTTP2_PREFACE)
            data, self._start = self._start, b""
            if self._http2:
                data = data[len(_HTTP2_PREFACE) :]
        if not self._http2:
            return bool(data)
        return self._opens_stream(data)

    def _opens_stream(self, data: bytes) -> bool:
        opens = False
        at = 0
        while at < len(data):
            if self._payload_left:
                taken = min(self._payload_left, len(data) - at)
                self._payload_left -= taken
                at += taken
                continue
            needed = _HTTP2_FRAME_HEADER - len(self._frame_header)
            self._frame_header += data[at : at + needed]
            at += needed
            if len(self._frame_header) == _HTTP2_FRAME_HEADER:
                header, self._frame_header = self._frame_header, b""
                self._payload_left = int.from_bytes(header[:3], "big")
                opens |= header[3] == _HTTP2_HEADERS
        return opens


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
    writer.transport.abort()


class FaultProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self.latency_s = 0.0
        #: Connections accepted so far (for tests that want to see reconnections).
        self.accepted = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._flowing: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._held = threading.Event()  # client bytes held since the last stall()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    # ----------------------------------------------------------------- controls
    def start(self) -> FaultProxy:
        self._thread.start()
        self._run(self._start())
        return self

    def set_latency(self, ms: int) -> None:
        self._run(self._set(latency_s=ms / 1000))

    def stall(self) -> None:
        self._held.clear()
        self._run(self._set(flowing=False))

    def wait_for_held_request(self, timeout_s: float = 30) -> None:
        if not self._held.wait(timeout_s):
            raise AssertionError(f"no client bytes reached the stalled proxy in {timeout_s} s")

    def resume(self) -> None:
        self._run(self._set(latency_s=0.0, flowing=True))

    def drop(self) -> None:
        self._run(self._drop())

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        self._run(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------- in the loop
    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _set(self, *, latency_s: float | None = None, flowing: bool | None = None) -> None:
        assert self._flowing is not None
        if latency_s is not None:
            self.latency_s = latency_s
        if flowing is True:
            self._flowing.set()
        elif flowing is False:
            self._flowing.clear()

    async def _drop(self) -> None:
        pairs, self._pairs = self._pairs, set()
        for client, server in pairs:
            _reset(client)
            _reset(server)
        # abort() closes the sockets in callbacks of the next loop iteration: let it
        # run, so that every reset has been sent when drop() returns.
        await asyncio.sleep(0)

    async def _stop(self) -> None:
        assert self._server is not None and self._flowing is not None
        self._server.close()
        self._flowing.set()  # stalled pumps wake up, see their pair gone and return
        await self._drop()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._tasks.add(task := asyncio.current_task())  # type: ignore[arg-type]
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                _reset(writer)  # upstream down: the client sees a reset, like a refusal
                return
            pair = (writer, up_writer)
            self._pairs.add(pair)
            await asyncio.gather(
                self._pump(reader, up_writer, pair, from_client=True),
                self._pump(up_reader, writer, pair, from_client=False),
                return_exceptions=True,
            )
            if pair in self._pairs:  # both directions ended by themselves
                self._pairs.discard(pair)
                for w in pair:
                    w.close()
        finally:
            self._tasks.discard(task)  # type: ignore[arg-type]

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
        *,
        from_client: bool,
    ) -> None:
        flowing = self._flowing
        assert flowing is not None
        # Reading goes on while stalled (only forwarding stops), so that a request
        # behind a client's control frame is seen as held.
        # Each chunk with the loop time it arrived at: its latency counts from then, so
        # chunks that arrive together leave together (a delay per chunk counted from
        # the previous one's departure would add up along a stream of frames).
        chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        requests = _Requests() if from_client else None
        loop = asyncio.get_running_loop()

        async def receive() -> None:
            try:
                while data := await reader.read(65536):
                    if requests is not None and requests.feed(data) and not flowing.is_set():
                        self._held.set()
                    chunks.put_nowait((loop.time(), data))
            except OSError:
                pass  # a reset (ours or the peer's): the stream ends here either way
            finally:
                chunks.put_nowait((loop.time(), b""))  # end of stream, or the connection failed

        receiving = asyncio.ensure_future(receive())
        try:
            while True:
                arrived, data = await chunks.get()
                await flowing.wait()  # stalled: hold the bytes
                if (due := arrived + self.latency_s - loop.time()) > 0:
                    await asyncio.sleep(due)
                if pair not in self._pairs:  # dropped meanwhile
                    return
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
        finally:
            receiving.cancel()
