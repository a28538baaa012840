"""Hash slots of the Redis backend on a Redis Cluster: slot-encoded lock ids and the
per-slot hash tags that name the per-slot keys (``specs/backends/redis.md``, Cluster).

A cluster script may only touch keys of one hash slot, all declared in ``KEYS``. The
lock hash ``P:<key>`` lies in the slot of its name; the acquire also writes the index
of the new lock id and reads the fence floor, so those two must be in that same slot:
they carry a hash tag ``{T}`` whose slot is the lock hash's (``P#id:{T}<lock id>``,
``P#floor:{T}``). A release, an extend or a lookup knows only the lock id, so the lock
id itself says the slot: its first three base64url characters are the slot number
(18 bits, of which 14 are used), the other nineteen are from the OS CSPRNG (114 bits).
"""

from __future__ import annotations

import binascii
import itertools
import secrets
import threading
import time
from typing import Final

from ...lifecycle import track

#: Redis Cluster's number of hash slots.
SLOTS: Final = 16384
_B64: Final = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
_B64_VALUE: Final = {c: n for n, c in enumerate(_B64)}
# Tag candidates: characters that need no escaping anywhere and are never braces.
_TAG_ALPHABET: Final = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"

_table: list[str] | None = None
_table_lock = threading.Lock()


class _TableLockReset:
    """Replaces :data:`_table_lock` in a forked child: a parent thread may have been
    building the table (holding the lock) at the fork."""

    def reset_after_fork(self) -> None:
        global _table_lock
        _table_lock = threading.Lock()


_table_lock_reset = _TableLockReset()
track(_table_lock_reset)
#: Seconds the last build of the tag table took (reported by the tests and the spec).
table_build_s: float | None = None


def crc_slot(data: bytes) -> int:
    """The slot of a whole byte string (CRC16-XMODEM mod 16384, as Redis computes it
    for a key without a hash tag)."""
    return binascii.crc_hqx(data, 0) % SLOTS


def key_slot(name: str) -> int:
    """The slot of key ``name``: of its hash tag (the text between the first ``{`` and
    the next ``}``, when not empty), else of the whole name."""
    data = name.encode("utf-8", "surrogatepass")
    start = data.find(b"{")
    if start != -1:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return crc_slot(data)


def _build() -> list[str]:
    table: list[str | None] = [None] * SLOTS
    left = SLOTS
    # Shortest first: every slot is reached by a string of at most three characters
    # (62**3 candidates), most by two or three; 238,328 CRCs at most, about 30 ms.
    for length in itertools.count(1):
        for chars in itertools.product(_TAG_ALPHABET, repeat=length):
            tag = "".join(chars)
            slot = crc_slot(tag.encode())
            if table[slot] is None:
                table[slot] = tag
                left -= 1
                if not left:
                    return [t for t in table if t is not None]
    raise AssertionError("unreachable")  # pragma: no cover


def tags() -> list[str]:
    """slot -> a short string without braces whose slot is that slot (built once per
    process, on first use)."""
    global _table, table_build_s
    table = _table
    if table is None:
        with _table_lock:
            table = _table
            if table is None:
                started = time.perf_counter()
                table = _build()
                table_build_s = time.perf_counter() - started
                _table = table
    return table


def slot_tag(slot: int) -> str:
    """The hash tag ``{T}`` that puts a key in ``slot``."""
    return "{" + tags()[slot] + "}"


def new_lock_id(slot: int) -> str:
    """A fresh lock id saying ``slot``: three characters of slot, nineteen random."""
    prefix = _B64[slot >> 12] + _B64[(slot >> 6) & 63] + _B64[slot & 63]
    # token_urlsafe(15) is 20 base64url characters of 120 random bits: 19 keep 114.
    return prefix + secrets.token_urlsafe(15)[:19]


def lock_id_slot(lock_id: str) -> int | None:
    """The slot a (validated) lock id says, or ``None`` when its prefix is past the
    last slot (no lock of this layout has such an id: it is simply not found)."""
    slot = (_B64_VALUE[lock_id[0]] << 12) | (_B64_VALUE[lock_id[1]] << 6) | _B64_VALUE[lock_id[2]]
    return slot if slot < SLOTS else None
