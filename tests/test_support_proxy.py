"""The fault proxy (``tests/support/proxy.py``).

Its notion of a held request: the fault tests drop a connection while a call waits,
and must know that the call's request, not some control frame of the client's, is
what the proxy holds. And its latency: a stream of chunks is delayed as a link delays
it, once, so that a gRPC call made of several frames stays below a timeout the test
means it to stay below."""

from __future__ import annotations

import socket
import socketserver
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from tests.support.proxy import _HTTP2_PREFACE, FaultProxy, _Requests

PING, SETTINGS, HEADERS, DATA, WINDOW_UPDATE, RST_STREAM = 0x6, 0x4, 0x1, 0x0, 0x8, 0x3


def frame(kind: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, 0]) + struct.pack(">I", stream) + payload


def opened(chunks: list[bytes]) -> list[bool]:
    requests = _Requests()
    return [requests.feed(chunk) for chunk in chunks]


def test_any_byte_of_a_non_http2_client_is_a_request():
    postgres_startup = struct.pack(">II", 8, 80877103)  # an SSLRequest
    assert opened([postgres_startup, b"Q"]) == [True, True]
    assert opened([b"*1\r\n$4\r\nPING\r\n"]) == [True]  # Redis


def test_http2_control_frames_are_not_requests():
    chunks = [
        _HTTP2_PREFACE + frame(SETTINGS, 0, bytes(6)),
        frame(PING, 0, bytes(8)),
        frame(WINDOW_UPDATE, 0, bytes(4)),
        frame(RST_STREAM, 1, struct.pack(">I", 8)),
    ]
    assert opened(chunks) == [False, False, False, False]


def test_a_headers_frame_opens_a_request_wherever_the_chunks_split_it():
    before = (
        _HTTP2_PREFACE
        + frame(SETTINGS, 0, bytes(6))
        + frame(PING, 0, b"HEADERS!")  # payload bytes that look like a frame header
    )
    stream = before + frame(HEADERS, 3, b"\x83\x86" * 40) + frame(DATA, 3, b"\x01" * 100)
    headers_at = len(before)
    for cut in range(1, len(stream)):
        first, second = stream[:cut], stream[cut:]
        # The request starts in the chunk that completes the HEADERS frame's header.
        expected = [cut >= headers_at + 9, cut < headers_at + 9]
        assert opened([first, second]) == expected, cut


def test_the_preface_arriving_in_pieces_is_not_a_request():
    assert opened([_HTTP2_PREFACE[:5], _HTTP2_PREFACE[5:], frame(HEADERS, 1, b"\x82")]) == [
        False,
        False,
        True,
    ]


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def echo_port() -> Iterator[int]:
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo) as server:
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield server.server_address[1]
        finally:
            server.shutdown()


def test_latency_delays_a_stream_of_chunks_once_not_once_per_chunk(echo_port):
    latency_s, chunks = 1.0, 4
    with (
        FaultProxy(echo_port) as proxy,
        socket.create_connection(("127.0.0.1", proxy.port)) as sock,
    ):
        proxy.set_latency(int(latency_s * 1000))
        started = time.monotonic()
        for n in range(chunks):
            sock.sendall(bytes([n]))
            # Apart, so that the proxy reads them as separate chunks (a pause that only
            # shapes the traffic: chunks read together would pass with either delay).
            time.sleep(0.05)
        echoed, first_back = b"", None
        while len(echoed) < chunks:
            echoed += sock.recv(16)
            first_back = first_back or time.monotonic()
        all_back = time.monotonic()
    assert echoed == bytes(range(chunks))
    # There and back: twice the latency for the first byte. A delay counted from the
    # previous chunk's departure would bring the last one back after about 5 s (the
    # chunks queue on the way out, 1 s each, and the last echo pays 1 s more).
    assert first_back - started >= 2 * latency_s * 0.99  # asyncio may wake a hair early
    assert all_back - started < 2 * latency_s + 1.5
