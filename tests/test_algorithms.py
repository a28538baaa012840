"""The shared algorithms, pinned to reference values."""

from __future__ import annotations

import base64
import pickle
import re

import pytest

from django_syncguard import (
    BACKEND_DEFAULTS,
    BACKEND_LIMITS,
    FENCE_THRESHOLDS,
    LOCK_DEFAULTS,
    MAX_KEY_LENGTH_BYTES,
    RESERVE_BYTES,
    TIME_TOLERANCE_MS,
    Aborted,
    AcquireResult,
    AcquisitionTimeout,
    Capabilities,
    ExtendResult,
    InvalidArgument,
    LockError,
    ReleaseResult,
    ServiceUnavailable,
    StaleFenceError,
    SyncGuardError,
    TransientError,
    format_fence,
    generate_lock_id,
    has_fence,
    hash_key,
    is_live,
    make_storage_key,
    normalize_and_validate_key,
    validate_lock_id,
)
from django_syncguard.errors import ERROR_CODES, NetworkTimeout
from django_syncguard.keys import hash_storage_key, make_fence_key


# ------------------------------------------------------------------ constants
def test_constants_have_the_decided_values():
    assert MAX_KEY_LENGTH_BYTES == 512
    assert TIME_TOLERANCE_MS == 1000
    assert dict(BACKEND_DEFAULTS) == {"ttl_ms": 30000}
    assert dict(LOCK_DEFAULTS) == {
        "max_retries": 10,
        "retry_delay_ms": 100,
        "timeout_ms": 5000,
        "backoff": "exponential",
        "jitter": "equal",
    }
    assert dict(FENCE_THRESHOLDS) == {"MAX": "900000000000000", "WARN": "090000000000000"}
    assert dict(BACKEND_LIMITS) == {"REDIS": 1000, "POSTGRES": 1700, "FIRESTORE": 1500}
    assert dict(RESERVE_BYTES) == {"REDIS": 26, "POSTGRES": 0, "FIRESTORE": 0}


@pytest.mark.parametrize("mapping", [BACKEND_DEFAULTS, LOCK_DEFAULTS, FENCE_THRESHOLDS])
def test_constant_mappings_are_read_only(mapping):
    with pytest.raises(TypeError):
        mapping["x"] = 1


# --------------------------------------------------------------- storage keys
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("syncguard", "resource:123", 1000, 26), "syncguard:resource:123"),
        (("test", "x" * 500, 100, 0), "test:almAngpz1zHVEeEfkwDrhg"),
        (("", "x" * 2000, 1500, 0), "XA4OpCFXHDALXfauwKEYtQ"),
        (("prefix:", "resource", 1000, 0), "prefix:resource"),
        (("", "resource", 1000, 0), "resource"),
        (("p::", "k", 1000, 0), "p:k"),
    ],
)
def test_make_storage_key_reference_values(args, expected):
    assert make_storage_key(*args) == expected


def test_make_storage_key_boundary_counts_utf8_bytes_and_reserve():
    # "p:" + 97 bytes + reserve 1 == 100 fits; one more byte hashes.
    assert make_storage_key("p", "x" * 97, 100, 1) == "p:" + "x" * 97
    hashed = make_storage_key("p", "x" * 98, 100, 1)
    assert re.fullmatch(r"p:[A-Za-z0-9_-]{22}", hashed)
    # "é" is two bytes: 49 of them are 98 bytes, too many for the same budget.
    assert make_storage_key("p", "é" * 48, 100, 1) == "p:" + "é" * 48
    assert make_storage_key("p", "é" * 49, 100, 1).startswith("p:") is True
    assert len(make_storage_key("p", "é" * 49, 100, 1)) == 24


def test_make_storage_key_is_deterministic_and_hashes_the_prefixed_string():
    first = make_storage_key("a", "k" * 600, 100, 0)
    assert first == make_storage_key("a", "k" * 600, 100, 0)
    assert first != make_storage_key("b", "k" * 600, 100, 0).replace("b:", "a:")


@pytest.mark.parametrize(
    ("limit", "expected"),
    [
        (1000, "pr\u00e9:caf\u00e9:" + "x" * 40),  # fits: kept as it is
        (30, hash_storage_key("pr\u00e9", "caf\u00e9:" + "x" * 40)),  # too long: hashed
    ],
)
def test_make_storage_key_treats_decomposed_and_composed_keys_alike(limit, expected):
    assert make_storage_key("pr\u00e9", "caf\u00e9:" + "x" * 40, limit, 0) == expected
    assert make_storage_key("pre\u0301", "cafe\u0301:" + "x" * 40, limit, 0) == expected


def test_make_storage_key_refuses_empty_key_and_oversized_prefix():
    with pytest.raises(InvalidArgument):
        make_storage_key("p", "", 100, 0)
    with pytest.raises(InvalidArgument, match="prefix"):
        make_storage_key("p" * 90, "x" * 100, 100, 0)


def test_fence_key_is_derived_from_the_base_storage_key():
    assert make_fence_key("", "resource", 1700, 0) == "fence:resource"
    long_key = "x" * 2000
    base = make_storage_key("", long_key, 1500, 0)
    assert make_fence_key("", long_key, 1500, 0) == f"fence:{base}"


# ----------------------------------------------------------------- validation
def test_normalize_returns_nfc():
    assert normalize_and_validate_key("cafe\u0301") == "caf\u00e9"


def test_validate_lock_id_accepts_generated_ids():
    for _ in range(100):
        lock_id = generate_lock_id()
        assert validate_lock_id(lock_id) == lock_id


def test_generated_lock_ids_are_16_random_bytes():
    ids = {generate_lock_id() for _ in range(1000)}
    assert len(ids) == 1000
    for lock_id in list(ids)[:20]:
        assert len(lock_id) == 22
        assert len(base64.urlsafe_b64decode(lock_id + "==")) == 16


# --------------------------------------------------------------------- hashes
def test_hash_key_reference_values():
    assert hash_key("resource:123") == "f52f328d6111ae89dbcfcb99"  # printf resource:123 | sha256sum
    assert hash_key("") == "e3b0c44298fc1c149afbf4c8"
    assert hash_key("cafe\u0301") == hash_key("caf\u00e9")
    assert re.fullmatch(r"[0-9a-f]{24}", hash_key(generate_lock_id()))


# --------------------------------------------------------------------- fences
@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "000000000000000"),
        (1, "000000000000001"),
        (900000000000000, "900000000000000"),
        (999999999999999, "999999999999999"),
    ],
)
def test_format_fence(n, expected):
    assert format_fence(n) == expected


def test_format_fence_refuses_what_does_not_fit():
    with pytest.raises(InvalidArgument, match="at most 15 digits"):
        format_fence(10**15)
    for bad in (-1, 1.0, "1", True):
        with pytest.raises(InvalidArgument):
            format_fence(bad)


# ------------------------------------------------------------------- liveness
@pytest.mark.parametrize(
    ("expires", "now", "live"),
    [
        (1000, 0, True),
        (1000, 1000, True),
        (1000, 1999, True),
        (1000, 2000, False),
        (1000, 5000, False),
    ],
)
def test_is_live_uses_the_tolerance(expires, now, live):
    assert is_live(expires, now, TIME_TOLERANCE_MS) is live
    assert is_live(expires, now) is live


def test_is_live_with_zero_tolerance():
    assert is_live(1000, 999, 0) is True
    assert is_live(1000, 1000, 0) is False


# --------------------------------------------------------------------- errors
def test_lock_error_keeps_its_class_and_takes_the_code_first():
    error = LockError("Aborted", "stop", {"key": "k"})
    assert type(error) is LockError
    assert isinstance(error, SyncGuardError)
    assert (error.code, error.message, error.context) == ("Aborted", "stop", {"key": "k"})
    assert str(error) == "stop"


def test_for_code_builds_the_code_subclass():
    error = LockError.for_code("Aborted", "stop", {"key": "k"})
    assert type(error) is Aborted
    assert (error.code, error.message, error.context) == ("Aborted", "stop", {"key": "k"})


def test_transient_codes_share_a_base():
    transient = [c for c in ERROR_CODES if isinstance(LockError.for_code(c), TransientError)]
    assert transient == ["ServiceUnavailable", "RateLimited", "NetworkTimeout"]
    with pytest.raises(TypeError, match="TransientError is a base to catch"):
        TransientError("down")


def test_every_code_has_its_subclass():
    assert [type(LockError.for_code(code)).__name__ for code in ERROR_CODES] == list(ERROR_CODES)


def test_subclasses_take_message_first():
    error = ServiceUnavailable("down", {"cause": "x"})
    assert error.code == "ServiceUnavailable"
    assert error.message == "down"
    assert error.context == {"cause": "x"}
    assert str(AcquisitionTimeout()) == "AcquisitionTimeout"


def test_subclass_context_by_keyword_or_position():
    assert ServiceUnavailable("down", context={"key": "k"}).context == {"key": "k"}
    positional = ServiceUnavailable("down", {"key": "k"})
    assert (positional.message, positional.context) == ("down", {"key": "k"})


def test_invalid_argument_is_also_a_value_error():
    assert isinstance(InvalidArgument("bad"), ValueError)


def test_unknown_code_is_refused():
    with pytest.raises(ValueError, match="Unknown LockError code"):
        LockError("Nope")


@pytest.mark.parametrize(
    "error",
    [
        LockError("NetworkTimeout", "slow", {"key": "k", "cause": lambda: None}),
        NetworkTimeout("slow", {"key": "k", "cause": lambda: None}),
    ],
)
def test_lock_error_pickles_without_its_cause(error):
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is type(error)
    assert (clone.code, clone.message, clone.context) == ("NetworkTimeout", "slow", {"key": "k"})


def test_stale_fence_error_pickles():
    clone = pickle.loads(pickle.dumps(StaleFenceError("000000000000003")))
    assert clone.fence == "000000000000003"
    assert "000000000000003" in str(clone)


# -------------------------------------------------------------------- results
def test_results_are_frozen_and_compare_by_value():
    a = AcquireResult(ok=True, lock_id="A" * 22, expires_at_ms=5, fence="000000000000001")
    assert a == AcquireResult(ok=True, lock_id="A" * 22, expires_at_ms=5, fence="000000000000001")
    with pytest.raises(AttributeError):
        a.ok = False  # type: ignore[misc]
    assert ReleaseResult(ok=False, reason="expired") == ReleaseResult(ok=False)
    assert ExtendResult(ok=False).to_dict() == {"ok": False}
    assert "A" * 22 not in repr(a)


def test_has_fence():
    assert has_fence(
        AcquireResult(ok=True, lock_id="A" * 22, expires_at_ms=1, fence="000000000000001")
    )
    assert not has_fence(AcquireResult(ok=True, lock_id="A" * 22, expires_at_ms=1))
    assert not has_fence(AcquireResult.locked())


def test_capabilities_to_dict():
    caps = Capabilities(backend="redis", supports_fencing=True, time_authority="server")
    assert caps.to_dict() == {
        "backend": "redis",
        "supportsFencing": True,
        "timeAuthority": "server",
    }
