"""TTLs: the longest one accepted, and the check every TTL goes through."""

from __future__ import annotations

from .errors import InvalidArgument

#: Longest TTL accepted (about 24.8 days): keeps every expiry exact in a double and
#: in a signed 64-bit column, whatever the backend. A lease this long is a bug.
MAX_TTL_MS = 2**31 - 1


def validate_ttl(ttl_ms: object) -> int:
    """Return ``ttl_ms`` if it is a positive int of at most ``MAX_TTL_MS``."""
    if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int):
        raise InvalidArgument(f"ttl_ms must be an int number of milliseconds, not {ttl_ms!r}.")
    if not 0 < ttl_ms <= MAX_TTL_MS:
        raise InvalidArgument(f"ttl_ms must be between 1 and {MAX_TTL_MS}, not {ttl_ms}.")
    return int(ttl_ms)  # a plain int: drivers refuse int subclasses such as IntEnum
