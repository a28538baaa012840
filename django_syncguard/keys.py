"""Keys and lock ids: validation, storage keys, hashes.

Every backend calls these; none re-implements them.
"""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
import unicodedata
from collections.abc import Callable
from typing import Any, TypeVar

from .constants import MAX_KEY_LENGTH_BYTES
from .errors import InvalidArgument

_LOCK_ID_RE = re.compile(r"[A-Za-z0-9_-]{22}")

T = TypeVar("T")


class Key(str):
    """A key :func:`normalize_and_validate_key` accepted, carrying what backends derive
    from it (storage key, fence key, wake-up channel), so that one operation derives
    each once: the acquisition code validates the key once and hands this object
    down, and backends derive through :func:`derived`. It is a ``str`` everywhere
    else, and pickles and copies as a plain one."""

    def __reduce__(self) -> tuple[type[str], tuple[str]]:
        return (str, (str(self),))


def derived(key: str, owner: object, name: str, compute: Callable[[], T]) -> T:
    """``compute()``, remembered on ``key`` for ``owner`` (whose settings it depends
    on) when ``key`` is a :class:`Key`; a plain ``str`` remembers nothing."""
    if type(key) is not Key:
        return compute()
    slot = (owner, name)
    memo: dict[Any, Any] = key.__dict__
    try:
        return memo[slot]  # type: ignore[no-any-return]
    except KeyError:
        value = memo[slot] = compute()
        return value


def normalize_and_validate_key(key: Any) -> Key:
    """Return ``key`` in NFC form, or raise ``InvalidArgument``.

    A key must be a non-empty ``str`` of at most ``MAX_KEY_LENGTH_BYTES`` UTF-8
    bytes after normalisation, and encodable as UTF-8 (no lone surrogates). A
    :class:`Key` is returned as it is: it was checked when it was made.
    """
    if type(key) is Key:
        return key
    if not isinstance(key, str):
        raise InvalidArgument(f"Key must be a str, not {type(key).__name__}.")
    if not key:
        raise InvalidArgument("Key must not be empty.")
    normalized = unicodedata.normalize("NFC", key)
    try:
        size = len(normalized.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidArgument("Key is not valid Unicode (it holds a lone surrogate).") from exc
    if size > MAX_KEY_LENGTH_BYTES:
        raise InvalidArgument(
            f"Key is {size} bytes after NFC normalisation; the limit is "
            f"{MAX_KEY_LENGTH_BYTES} bytes."
        )
    return Key(normalized)


def validate_lock_id(lock_id: Any) -> str:
    """Return ``lock_id`` if it is 22 base64url characters, else raise ``InvalidArgument``.

    The message never repeats the value: a lock id is a bearer credential.
    """
    if not isinstance(lock_id, str):
        raise InvalidArgument(f"Lock id must be a str, not {type(lock_id).__name__}.")
    if not _LOCK_ID_RE.fullmatch(lock_id):
        raise InvalidArgument(
            f"Malformed lock id ({len(lock_id)} characters); expected 22 base64url characters."
        )
    return lock_id


def generate_lock_id() -> str:
    """Return a fresh lock id: 16 bytes from the OS CSPRNG, base64url without padding."""
    return _b64url(secrets.token_bytes(16))


def hash_key(value: str) -> str:
    """Return the sanitized identifier of a key or lock id.

    SHA-256 over the UTF-8 of the NFC form, first 24 lowercase hex characters (96 bits).
    """
    data = unicodedata.normalize("NFC", value).encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()[:24]


def make_storage_key(prefix: str, key: str, limit_bytes: int, reserve_bytes: int) -> str:
    """Return the name under which a backend stores ``key``.

    ``prefix`` and ``key`` are taken in NFC form; ``prefix`` loses its trailing
    colons. When ``prefix:key`` (or just ``key`` with an empty prefix) plus
    ``reserve_bytes`` fits in ``limit_bytes`` it is used as is; otherwise the key
    part becomes the base64url of the first 16 bytes of SHA-256 over the whole
    prefixed string. Raises ``InvalidArgument`` for an empty key or when
    even the hashed form does not fit.
    """
    if not key:
        raise InvalidArgument("Key must not be empty.")
    # Canonical form first, as every backend stores it: a decomposed "é" and a
    # composed one are the same key and must get the same storage key.
    key = unicodedata.normalize("NFC", key)
    prefix = unicodedata.normalize("NFC", prefix).rstrip(":")
    head = f"{prefix}:" if prefix else ""
    full = head + key
    if len(full.encode("utf-8")) + reserve_bytes <= limit_bytes:
        return full
    hashed = hash_storage_key(prefix, key)
    if len(hashed.encode("utf-8")) + reserve_bytes > limit_bytes:
        raise InvalidArgument(
            f"Key prefix is too long: even the hashed storage key exceeds {limit_bytes} bytes."
        )
    return hashed


def hash_storage_key(prefix: str, key: str) -> str:
    """The hashed form of a storage key: ``prefix:`` (if any) + base64url of the first
    16 bytes of SHA-256 over the whole prefixed key (22 characters)."""
    prefix = prefix.rstrip(":")
    head = f"{prefix}:" if prefix else ""
    return head + _b64url(hashlib.sha256((head + key).encode("utf-8")).digest()[:16])


def make_fence_key(prefix: str, key: str, limit_bytes: int, reserve_bytes: int) -> str:
    """Return the fence-counter name of ``key``: ``fence:`` + its base storage key.

    Two steps, so that a truncated lock key and its fence key hash identically and
    every distinct user key owns exactly one counter.
    """
    base = make_storage_key(prefix, key, limit_bytes, reserve_bytes)
    return fence_key_of(prefix, base, limit_bytes, reserve_bytes)


def fence_key_of(prefix: str, storage_key: str, limit_bytes: int, reserve_bytes: int) -> str:
    """:func:`make_fence_key` from the key's storage key, when the caller has it."""
    return make_storage_key(prefix, f"fence:{storage_key}", limit_bytes, reserve_bytes)


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")
