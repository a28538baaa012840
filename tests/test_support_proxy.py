"""The fault proxy's notion of a held request (``tests/support/proxy.py``): the fault tests
drop a connection while a call waits, and must know that the call's request, not
some control frame of the client's, is what the proxy holds."""

from __future__ import annotations

import struct

from tests.support.proxy import _HTTP2_PREFACE, _Requests

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
