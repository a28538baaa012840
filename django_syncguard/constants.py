"""Numbers that are part of the SyncGuard contract.

Every mapping here is read-only (``MappingProxyType``): these values are shared by
all backends and must not drift at run time.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

#: Longest user key accepted, in UTF-8 bytes after NFC normalisation.
MAX_KEY_LENGTH_BYTES: Final = 512

#: A lock stays live until ``expires_at_ms + TIME_TOLERANCE_MS`` on every backend.
TIME_TOLERANCE_MS: Final = 1000

DEFAULT_TTL_MS: Final = 30_000

#: Defaults every backend operation applies.
BACKEND_DEFAULTS: Final = MappingProxyType({"ttl_ms": DEFAULT_TTL_MS})


DEFAULT_MAX_RETRIES: Final = 10
DEFAULT_RETRY_DELAY_MS: Final = 100
DEFAULT_TIMEOUT_MS: Final = 5_000
DEFAULT_BACKOFF: Final = "exponential"
DEFAULT_JITTER: Final = "equal"

#: Defaults of the ``lock()`` / ``locked()`` retry loop.
LOCK_DEFAULTS: Final = MappingProxyType(
    {
        "max_retries": DEFAULT_MAX_RETRIES,
        "retry_delay_ms": DEFAULT_RETRY_DELAY_MS,
        "timeout_ms": DEFAULT_TIMEOUT_MS,
        "backoff": DEFAULT_BACKOFF,
        "jitter": DEFAULT_JITTER,
    }
)

#: Fences above ``MAX`` are refused; fences above ``WARN`` log a warning.
FENCE_THRESHOLDS: Final = MappingProxyType({"MAX": "900000000000000", "WARN": "090000000000000"})

#: Width of every fence string.
FENCE_DIGITS: Final = 15

#: Storage-key budget of each server backend, in bytes.
BACKEND_LIMITS: Final = MappingProxyType({"REDIS": 1000, "POSTGRES": 1700, "FIRESTORE": 1500})

#: Bytes each backend keeps free for the suffixes of its derived keys.
RESERVE_BYTES: Final = MappingProxyType({"REDIS": 26, "POSTGRES": 0, "FIRESTORE": 0})

#: How long past its expiry a lock record must be before any cleanup may delete it:
#: 2000 ms on server-time backends; tolerance + 1000 ms on client-time ones. Both
#: leave at least 1000 ms after the record stops being live, so no extend that saw
#: it live can be racing the delete.
CLEANUP_GUARD_MS: Final = MappingProxyType({"server": 2000, "client": TIME_TOLERANCE_MS + 1000})

#: Largest page ``list_locks`` returns and largest ``delete_expired`` batch.
MAX_PAGE_SIZE: Final = 1_000
MAX_BATCH_SIZE: Final = 10_000
