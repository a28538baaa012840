"""django-syncguard: distributed locks with fencing tokens for Django.

Importing this package reads no settings and opens no connection.
"""

from __future__ import annotations

from .constants import (
    BACKEND_DEFAULTS,
    BACKEND_LIMITS,
    FENCE_THRESHOLDS,
    LOCK_DEFAULTS,
    MAX_KEY_LENGTH_BYTES,
    RESERVE_BYTES,
    TIME_TOLERANCE_MS,
)
from .decorators import locked
from .errors import (
    Aborted,
    AcquisitionTimeout,
    AuthFailed,
    Internal,
    InvalidArgument,
    LockError,
    NetworkTimeout,
    RateLimited,
    ServiceUnavailable,
    StaleFenceError,
    SyncGuardError,
    TransientError,
)
from .fencing import afenced_update, fenced_update, format_fence
from .handler import locks
from .helpers import alock, lock
from .keys import (
    generate_lock_id,
    hash_key,
    make_storage_key,
    normalize_and_validate_key,
    validate_lock_id,
)
from .leases import Lease, current_lock
from .liveness import is_live
from .lookups import (
    aget_by_id,
    aget_by_id_raw,
    aget_by_key,
    aget_by_key_raw,
    aowns,
    get_by_id,
    get_by_id_raw,
    get_by_key,
    get_by_key_raw,
    owns,
)
from .results import (
    AcquireResult,
    Capabilities,
    ExtendResult,
    LockInfo,
    LockInfoDebug,
    ReleaseResult,
    has_fence,
)
from .telemetry import LockEvent, with_telemetry

__version__ = "0.1.0"

__all__ = [
    "BACKEND_DEFAULTS",
    "BACKEND_LIMITS",
    "FENCE_THRESHOLDS",
    "LOCK_DEFAULTS",
    "MAX_KEY_LENGTH_BYTES",
    "RESERVE_BYTES",
    "TIME_TOLERANCE_MS",
    "Aborted",
    "AcquireResult",
    "AcquisitionTimeout",
    "AuthFailed",
    "Capabilities",
    "ExtendResult",
    "Internal",
    "InvalidArgument",
    "Lease",
    "LockError",
    "LockEvent",
    "LockInfo",
    "LockInfoDebug",
    "NetworkTimeout",
    "RateLimited",
    "ReleaseResult",
    "ServiceUnavailable",
    "StaleFenceError",
    "SyncGuardError",
    "TransientError",
    "afenced_update",
    "aget_by_id",
    "aget_by_id_raw",
    "aget_by_key",
    "aget_by_key_raw",
    "alock",
    "aowns",
    "current_lock",
    "fenced_update",
    "format_fence",
    "generate_lock_id",
    "get_by_id",
    "get_by_id_raw",
    "get_by_key",
    "get_by_key_raw",
    "has_fence",
    "hash_key",
    "is_live",
    "lock",
    "locked",
    "locks",
    "make_storage_key",
    "normalize_and_validate_key",
    "owns",
    "validate_lock_id",
    "with_telemetry",
]
