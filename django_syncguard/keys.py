"""Keys and lock ids: validation, storage keys, hashes.

Every backend calls these; none re-implements them.

Two hashes name a key (or a lock id) without showing it:

- :func:`hash_key`, the specification's: plain SHA-256, the same in every language
  and deployment. API values carry it (``LockInfo.key_hash``, ``lock_id_hash``,
  telemetry events, ``force_release``'s argument), so programs can compare them.
- :func:`display_hash`, keyed with the project's ``SECRET_KEY``: what people see
  (admin pages and messages, exception messages, log lines, signal arguments,
  thread names). Whoever reads it cannot test guesses ("is it ``invoice:1``?")
  without the secret, yet every process of one deployment shows the same value.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import secrets
import unicodedata
from collections.abc import Callable
from typing import Any, TypeVar

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.crypto import salted_hmac

from .constants import MAX_KEY_LENGTH_BYTES
from .errors import InvalidArgument

_LOCK_ID_RE = re.compile(r"[A-Za-z0-9_-]{22}")
_HASH_RE = re.compile(r"[0-9a-f]{24}")
#: base64 to base64url.
_URLSAFE = bytes.maketrans(b"+/", b"-_")

#: The ``key_salt`` of :func:`display_hash`'s ``salted_hmac``: no other use of the
#: secret shares its derived key.
DISPLAY_HASH_SALT = "django_syncguard.display-hash"
#: The secret where Django has none (settings not configured): hashes are still
#: keyed, but differ from one process to the next.
_PROCESS_SECRET = secrets.token_bytes(32)
#: (secret, HMAC over nothing yet) of the last secret seen. One entry: a deployment
#: has one SECRET_KEY; tests that switch it just recompute. Replaced whole, so
#: threads never see a half-updated pair.
_display_mac: tuple[str | bytes, hmac.HMAC] | None = None

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
    # What _b64url(secrets.token_bytes(16)) gives, in C calls only (every acquire
    # makes one): os.urandom is what token_bytes reads, and 16 bytes encode to 22
    # characters and "==".
    return binascii.b2a_base64(os.urandom(16), newline=False)[:22].translate(_URLSAFE).decode()


def hash_key(value: str) -> str:
    """Return the sanitized identifier of a key or lock id.

    SHA-256 over the UTF-8 of the NFC form, first 24 lowercase hex characters (96 bits).
    """
    data = unicodedata.normalize("NFC", value).encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()[:24]


def display_hash(value: str) -> str:
    """Return the hash of a key or lock id shown to people: :func:`display_hash_of`
    its :func:`hash_key`.

    24 lowercase hex characters, like :func:`hash_key`, but keyed with the project's
    ``SECRET_KEY``: not reversible by hashing guesses, the same in every process
    with the same ``SECRET_KEY``, and different after the secret is rotated
    (``SECRET_KEY_FALLBACKS`` play no part: one value per key at any time).
    """
    return display_hash_of(hash_key(value))


def display_hash_of(key_hash: str) -> str:
    """Return the display hash of the key or lock id whose :func:`hash_key` is
    ``key_hash`` (as ``LockInfo.key_hash`` / ``lock_id_hash`` give it), so that code
    holding only that hash shows what code holding the key shows.

    ``HMAC-SHA256(SHA-256("django_syncguard.display-hash" + SECRET_KEY), key_hash)``,
    Django's ``salted_hmac``, first 24 hex characters. Raises ``InvalidArgument``
    unless ``key_hash`` is 24 lowercase hex characters.
    """
    if not isinstance(key_hash, str) or not _HASH_RE.fullmatch(key_hash):
        raise InvalidArgument("A key hash is 24 lowercase hex characters (hash_key's value).")
    mac = _keyed_mac().copy()
    mac.update(key_hash.encode("ascii"))
    return mac.hexdigest()[:24]


def _keyed_mac() -> hmac.HMAC:
    """The HMAC keyed for the current ``SECRET_KEY``, derived once per secret.

    Read on every call, not at import, so ``override_settings`` and a settings module
    loaded after this one are honoured; after the first read Django serves the value
    from its own cache, so a call costs an attribute lookup and a comparison.
    """
    global _display_mac
    try:
        secret: str | bytes = settings.SECRET_KEY
    except ImproperlyConfigured:
        # No settings, or an empty SECRET_KEY (Django refuses to hand that out): a log
        # line or an error message must not fail for it, nor fall back to a bare hash.
        secret = _PROCESS_SECRET
    cached = _display_mac
    if cached is not None and cached[0] == secret:
        return cached[1]
    mac = salted_hmac(DISPLAY_HASH_SALT, b"", secret=secret, algorithm="sha256")
    _display_mac = (secret, mac)
    return mac


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
