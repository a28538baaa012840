"""Property-based tests: whatever the input, a backend works or raises ``LockError``.

Every generated key, lock id, TTL and configuration value either works or raises the
``LockError`` the contract names for it (``InvalidArgument`` for bad input); never a
driver exception nor another exception type. Which outcome is expected is computed
here, independently, from the documented rules (``specs/contract.md``, "Validation,
before any I/O", and the backends' pages), not by calling the library's validators.

The I/O properties run on every backend through the ``harness`` fixture. One backend
serves all the examples of a test, so the fence counters carry over between examples:
the tests keep their own model of the counters and expect exact fences from it.
"""

from __future__ import annotations

import enum
import hashlib
import string
import unicodedata
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from django.conf import settings as django_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_syncguard import (
    AcquireResult,
    ExtendResult,
    InvalidArgument,
    LockError,
    LockInfoDebug,
    ReleaseResult,
    generate_lock_id,
    owners,
)
from django_syncguard.backends.base import BaseLockBackend
from django_syncguard.backends.database import DatabaseBackend
from django_syncguard.backends.firestore import FirestoreBackend
from django_syncguard.backends.memory import MemoryBackend
from django_syncguard.backends.redis import RedisBackend
from django_syncguard.liveness import FakeClock
from tests.support.harness import Harness

# ------------------------------------------------------------ the documented rules
MAX_KEY_BYTES = 512  # "≤ 512 bytes after NFC"
MAX_TTL = 2**31 - 1  # "1 ≤ ttl ≤ 2**31 - 1"
LOCK_ID_ALPHABET = frozenset(string.ascii_letters + string.digits + "-_")  # [A-Za-z0-9_-]
DEFAULT_TIMEOUT_MS = 5_000  # CONNECT_TIMEOUT_MS, OPERATION_TIMEOUT_MS
TTL = 30_000

# Examples per backend: the server backends pay a few round trips per example.
EXAMPLES = {
    "memory": 300,
    "sqlite": 100,
    "postgres": 60,
    "pgbouncer": 30,
    "redis": 60,
    "redis-sentinel": 20,
    "redis-cluster": 40,
    "firestore": 40,
}


def utf8_size(text: str) -> int:
    """UTF-8 length from the code points (no encoder involved)."""
    return sum(
        1 if cp < 0x80 else 2 if cp < 0x800 else 3 if cp < 0x10000 else 4 for cp in map(ord, text)
    )


def has_lone_surrogate(text: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


def key_is_valid(key: object) -> bool:
    """A non-empty str, valid Unicode, at most 512 UTF-8 bytes after NFC."""
    if not isinstance(key, str) or key == "" or has_lone_surrogate(key):
        return False
    return utf8_size(nfc(key)) <= MAX_KEY_BYTES


def lock_id_is_valid(lock_id: object) -> bool:
    """A str of exactly 22 base64url characters."""
    return isinstance(lock_id, str) and len(lock_id) == 22 and set(lock_id) <= LOCK_ID_ALPHABET


def ttl_is_valid(ttl: object) -> bool:
    """An int (never a bool), 1 to 2**31 - 1."""
    return isinstance(ttl, int) and not isinstance(ttl, bool) and 1 <= ttl <= MAX_TTL


def sha24(text: str) -> str:
    """``hash_key``, as the contract states it: SHA-256 of the NFC UTF-8, 24 hex chars."""
    return hashlib.sha256(nfc(text).encode("utf-8")).hexdigest()[:24]


def fence(n: int) -> str:
    return str(n).rjust(15, "0")


def refused(calls: Mapping[str, Callable[[], object]]) -> list[InvalidArgument]:
    """Run every call; each must raise exactly ``InvalidArgument`` (code included)."""
    errors = []
    for name, call in calls.items():
        with pytest.raises(LockError) as caught:
            call()
        error = caught.value
        assert type(error) is InvalidArgument, (name, error)
        assert error.code == "InvalidArgument", name
        errors.append(error)
    return errors


def run_examples(harness: Harness, strategy: st.SearchStrategy[Any], check: Callable) -> None:
    """Run ``check(value)`` for generated values, as many as the backend affords.

    The property is given inside the test, so the function-scoped ``harness`` is built
    once per backend and shared by its examples (hence the fence models). No example
    database: nothing is written into the checkout.
    """

    @settings(
        max_examples=EXAMPLES[harness.name],
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        database=None,
    )
    @given(strategy)
    def prop(value: Any) -> None:
        check(value)

    prop()


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """Draw from each strategy in proportion to its weight (``st.one_of`` flattens nested
    ``one_of``s, so a strategy of eight kinds of junk would get eight shares)."""
    pool = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.sampled_from(pool).flatmap(lambda strategy: strategy)


# ---------------------------------------------------------------------- keys
ANY_CHAR = st.characters(exclude_categories=())  # every code point, lone surrogates too
# Letters that compose with combining marks, the marks, characters NFC replaces
# (Angstrom and Kelvin signs, Ohm sign), Hangul jamo that compose into syllables, and
# composition exclusions that NFC *expands* (U+0958 -> U+0915 U+093C, U+2ADC, U+0344).
COMPOSABLE = "aeouAEOUcnCNs\u0300\u0301\u0302\u0308\u0327\u0338\u212b\u212a\u2126"
COMPOSABLE += "\u1100\u1161\u11a8\u0958\u2adc\u0344"
CONTROLS = st.characters(categories=["Cc", "Cf"])  # NUL, C0/C1 controls, BOM, ZWJ...
NON_STR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.binary(max_size=8),
    st.builds(bytearray, st.binary(max_size=4)),
    st.lists(st.text(max_size=3), max_size=2),
    st.tuples(st.text(max_size=3)),
)
WIDE_CHARS = ["a", "ß", "é", "€", "\u4e2d", "\U0001f600"]  # 1, 2, 2, 3, 3, 4 bytes


def fill_to(chars: list[str], target: int) -> str:
    """Leading ``chars`` that fit in ``target`` bytes, padded with ASCII to exactly it."""
    out = ""
    for char in chars:
        if utf8_size(out + char) > target:
            break
        out += char
    return out + "k" * (target - utf8_size(out))


KEYS = weighted(
    (3, st.text(ANY_CHAR, max_size=30)),
    (3, st.text(st.sampled_from(COMPOSABLE), min_size=1, max_size=40)),
    (2, st.text(st.one_of(CONTROLS, st.sampled_from("ab:/._")), min_size=1, max_size=20)),
    (1, st.sampled_from([".", "..", "/", "a/b", "__x__", "__", " ", "*?[]", "%s", "'", "f:x"])),
    # Right at and around the 512-byte edge, with 1- to 4-byte characters.
    (
        3,
        st.builds(
            fill_to, st.lists(st.sampled_from(WIDE_CHARS), max_size=200), st.integers(505, 520)
        ),
    ),
    # 3n bytes as given, 2n after NFC: valid up to n = 256.
    (1, st.integers(250, 262).map(lambda n: "e\u0301" * n)),
    # Hangul jamo: 9n bytes as given, 3n after NFC: valid up to n = 170.
    (1, st.integers(165, 175).map(lambda n: "\u1100\u1161\u11a8" * n)),
    # A composition exclusion: 3n bytes as given, 6n after NFC: valid up to n = 85.
    (1, st.integers(80, 90).map(lambda n: "\u0958" * n)),
    (
        1,
        st.builds(
            lambda a, s, b: a + s + b,
            st.text(max_size=4),
            st.characters(categories=["Cs"]),
            st.text(max_size=4),
        ),
    ),
    (2, NON_STR),
)


def nfc_twin(key: str) -> str:
    """Another spelling of the same lock: NFD when it differs, else NFC."""
    decomposed = unicodedata.normalize("NFD", key)
    return decomposed if decomposed != key else nfc(key)


def check_key(
    backend: BaseLockBackend, key: object, fences: dict[str, int], *, nul_ok: bool = True
) -> None:
    """A valid key works end to end; any other is refused with InvalidArgument.
    ``nul_ok=False``: the backend's storage cannot hold NUL, so such keys are refused."""
    if not key_is_valid(key) or (not nul_ok and isinstance(key, str) and "\x00" in key):
        refused(
            {
                "acquire": lambda: backend.acquire(key, TTL),
                "is_locked": lambda: backend.is_locked(key),
                "lookup": lambda: backend.lookup(key=key),
                "lookup_raw": lambda: backend.lookup_raw(key=key),
            }
        )
        return
    assert isinstance(key, str)
    normal, twin = nfc(key), nfc_twin(key)
    result = backend.acquire(key, TTL)
    assert result.ok, result
    fences[normal] = fences.get(normal, 0) + 1
    released = False
    try:
        assert result.fence == fence(fences[normal])
        record = LockInfoDebug(
            key_hash=sha24(normal),
            lock_id_hash=sha24(result.lock_id),
            expires_at_ms=result.expires_at_ms,
            acquired_at_ms=result.expires_at_ms - TTL,
            fence=result.fence,
            key=normal,
            lock_id=result.lock_id,
            owner=owners.owner_label(),  # taken by this thread, outside @locked
        )
        assert backend.lookup_raw(key=key) == record
        assert backend.lookup_raw(key=twin) == record
        assert backend.lookup_raw(lock_id=result.lock_id) == record
        assert backend.lookup(key=twin) == record.sanitized()
        assert backend.is_locked(key) is True
        assert backend.is_locked(twin) is True
        assert backend.acquire(twin, TTL) == AcquireResult(ok=False, reason="locked")
        assert backend.acquire(normal, TTL) == AcquireResult(ok=False, reason="locked")
        released = True
        assert backend.release(result.lock_id) == ReleaseResult(ok=True)
    finally:
        if not released:  # leave no held lock behind for the next example
            backend.release(result.lock_id)
    assert backend.is_locked(twin) is False
    assert backend.lookup(key=key) is None


#: Hand-picked keys every backend checks before the generated ones.
KEY_EXAMPLES: list[object] = [
    "x" * 512,
    "x" * 513,
    "\u00e9" * 256,
    "\u00e9" * 256 + "x",
    "\U0001f600" * 128,
    "\U0001f600" * 128 + "x",
    "e\u0301" * 256,  # 768 bytes as given, 512 after NFC
    "e\u0301" * 257,  # 771 bytes as given, 514 after NFC
    "\u0958" * 85,  # 255 bytes as given, 510 after NFC
    "\u0958" * 86,  # 258 bytes as given, 516 after NFC: too long
    "caf\u00e9",
    "cafe\u0301",  # the same lock as the previous one
    "\u212b",  # ANGSTROM SIGN, NFC: U+00C5
    "",
    "\ud800",
    "a\udfffb",
    b"key",
    None,
    True,
    42,
]


def test_any_key_works_or_is_invalid_argument(harness: Harness) -> None:
    """Valid keys (NFC forms included) lock, look up, contend and release exactly;
    every other key is refused with InvalidArgument."""
    backend, fences = harness.backend, {}
    nul_ok = harness.name not in ("postgres", "pgbouncer")  # PostgreSQL text has no NUL
    for key in KEY_EXAMPLES:
        check_key(backend, key, fences, nul_ok=nul_ok)
    run_examples(harness, KEYS, lambda key: check_key(backend, key, fences, nul_ok=nul_ok))


@pytest.mark.parametrize("key", ["\x00", "a\x00b", "\x00" * 512, "nul:\x00:\u00e9"])
def test_keys_with_nul(harness: Harness, key: str) -> None:
    """NUL is a valid key character (a non-empty str of valid Unicode), except on
    PostgreSQL, whose text type cannot hold it: refused before any I/O there."""
    if harness.name in ("postgres", "pgbouncer"):
        refused({"acquire": lambda: harness.backend.acquire(key, TTL)})
        refused({"is_locked": lambda: harness.backend.is_locked(key)})
        refused({"list_locks": lambda: harness.backend.list_locks(prefix=key)})
        return
    check_key(harness.backend, key, {})


# ------------------------------------------------------------------ lock ids
B64URL = "".join(sorted(LOCK_ID_ALPHABET))
VALID_IDS = st.text(st.sampled_from(B64URL), min_size=22, max_size=22)
LOCK_IDS = weighted(
    (5, VALID_IDS),
    (2, st.text(st.sampled_from(B64URL), max_size=30).filter(lambda s: len(s) != 22)),
    # 22 characters, one of them outside the alphabet (padding, '+', '/', Unicode
    # digits and letters, whitespace, NUL, surrogates...).
    (
        3,
        st.builds(
            lambda s, i, c: s[:i] + c + s[i + 1 :],
            VALID_IDS,
            st.integers(0, 21),
            st.characters(exclude_categories=(), exclude_characters=B64URL),
        ),
    ),
    (1, st.text(ANY_CHAR, min_size=20, max_size=24)),
    (1, VALID_IDS.map(lambda s: s + "\n")),
    (1, VALID_IDS.map(lambda s: s.encode())),
    (1, NON_STR),
)


def check_lock_id(backend: BaseLockBackend, lock_id: object) -> None:
    if lock_id_is_valid(lock_id):
        # A fresh random id names no lock on any backend.
        released = backend.release(lock_id)
        assert (released, released.reason) == (ReleaseResult(ok=False), "not-found")
        extended = backend.extend(lock_id, TTL)
        assert (extended, extended.reason) == (ExtendResult(ok=False), "not-found")
        assert backend.lookup(lock_id=lock_id) is None
        assert backend.lookup_raw(lock_id=lock_id) is None
        return
    calls = {
        "release": lambda: backend.release(lock_id),
        "extend": lambda: backend.extend(lock_id, TTL),
        "lookup": lambda: backend.lookup(lock_id=lock_id),
        "lookup_raw": lambda: backend.lookup_raw(lock_id=lock_id),
    }
    for error in refused(calls):
        if isinstance(lock_id, str) and len(lock_id) >= 8:
            # The message gives the length, never the value (a bearer credential).
            assert lock_id not in str(error)
            assert f"({len(lock_id)} characters)" in str(error)


def test_any_lock_id_works_or_is_invalid_argument(harness: Harness) -> None:
    """22 base64url characters reach the backend (and name no lock); anything else is
    refused with InvalidArgument whose message never repeats it."""
    backend = harness.backend
    for lock_id in ["A" * 22, "-" * 22, "_" * 22, "A" * 21, "A" * 23, "A" * 21 + "=", "\x00" * 22]:
        check_lock_id(backend, lock_id)
    run_examples(harness, LOCK_IDS, lambda lock_id: check_lock_id(backend, lock_id))


# ----------------------------------------------------------------------- TTLs
class Milliseconds(enum.IntEnum):
    """An int subclass: an ``int`` by the contract's rule, so a valid TTL."""

    ONE = 1
    MINUTE = 60_000
    MAX = MAX_TTL


TTLS = weighted(
    (2, st.integers(-3, 3)),
    (2, st.integers(MAX_TTL - 3, MAX_TTL + 3)),
    (1, st.integers(-(2**70), 2**70)),
    (4, st.integers(1, MAX_TTL)),
    (1, st.sampled_from([2**63, -(2**63), 10**400, -(10**400), *Milliseconds])),
    (1, st.booleans()),
    (1, st.floats(allow_nan=True, allow_infinity=True)),
    (1, st.integers(1, 10**6).map(float)),
    (1, st.decimals(allow_nan=False, allow_infinity=False, places=0)),
    (1, st.fractions()),
    (1, st.sampled_from([None, "1000", b"1", [1000], "", "1e3"])),
)


def check_ttl(harness: Harness, ttl: object, model: dict[str, int]) -> None:
    backend, key = harness.backend, "ttl-property"
    if not ttl_is_valid(ttl):
        refused(
            {
                "acquire": lambda: backend.acquire(key, ttl),
                "extend": lambda: backend.extend(generate_lock_id(), ttl),
            }
        )
        return
    assert isinstance(ttl, int)
    result = backend.acquire(key, ttl)
    assert result.ok, result
    model["fence"] += 1
    released = False
    try:
        assert result.fence == fence(model["fence"])
        info = backend.lookup(key=key)
        assert info is not None
        assert (info.fence, info.expires_at_ms) == (result.fence, result.expires_at_ms)
        assert info.expires_at_ms - info.acquired_at_ms == ttl
        extended = backend.extend(result.lock_id, ttl)
        assert extended.ok is True
        assert extended.expires_at_ms >= result.expires_at_ms
        assert backend.lookup(key=key).expires_at_ms == extended.expires_at_ms
        # Even a 1 ms lock is still live here: liveness has a 1000 ms tolerance.
        released = True
        assert backend.release(result.lock_id) == ReleaseResult(ok=True)
    finally:
        if not released:
            backend.release(result.lock_id)


def test_any_ttl_works_or_is_invalid_argument(harness: Harness) -> None:
    """int TTLs of 1 to 2**31 - 1 (int subclasses included) set expiry = acquisition + ttl;
    bools, floats, None, strings and out-of-range ints are refused."""
    model = {"fence": 0}
    for ttl in [1, MAX_TTL, MAX_TTL + 1, 0, -1, True, False, None, 1.0, 10**400, *Milliseconds]:
        check_ttl(harness, ttl, model)
    run_examples(harness, TTLS, lambda ttl: check_ttl(harness, ttl, model))


# ------------------------------------------------------------ configuration
ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=4),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
POSITIVE_INT_VALUES = weighted(
    (6, st.integers(1, 2**64)),
    (1, st.integers(2**64, 2**1000)),
    (1, st.sampled_from(list(Milliseconds))),
    (1, st.integers(-3, 0)),
    (1, st.integers(1, 10**6).map(float)),
    (1, ANY_VALUE),
)
FLAG_VALUES = weighted(
    (5, st.booleans()), (1, st.sampled_from([0, 1, "true", None])), (1, ANY_VALUE)
)
PREFIXES = weighted(
    (4, st.text(ANY_CHAR, max_size=20)),
    (1, st.text(st.sampled_from(":"), max_size=3)),
    (1, st.builds(lambda a, b: a + b, st.text(max_size=5), st.text(":", min_size=1, max_size=3))),
    (1, st.sampled_from(["syncguard", "app:", "a#b", "*", "\u00e9", "\ud800", "p\udc00:"])),
    (1, ANY_VALUE),
)
COLLECTIONS = weighted(
    (3, st.text(ANY_CHAR, max_size=12)),
    (1, ANY_VALUE),
    (
        2,
        st.sampled_from(
            [
                "locks",
                "fence_counters",
                "",
                ".",
                "..",
                "...",
                "a/b",
                "/",
                "__x__",
                "____",
                "___",
                "__",
                "_x_",
                "__\n__",
                "a\x00b",
                "\ud800",
                "x" * 1500,
                "x" * 1501,
                "\u00e9" * 750,
                "\u00e9" * 751,
            ]
        ),
    ),
)
CLOCKS = weighted(
    (1, ANY_VALUE.filter(lambda v: not isinstance(v, str))),
    (
        4,
        st.sampled_from(
            [
                FakeClock(),
                lambda: 0,
                "django_syncguard.liveness.system_clock_ms",
                "django_syncguard.liveness.FakeClock",
                "django_syncguard.constants.MAX_KEY_LENGTH_BYTES",  # not callable
                "django_syncguard.liveness.no_such_clock",
                "no_such_module_for_syncguard.clock",
                "nodots",
                "",
                ".",
                "..relative",
            ]
        ),
    ),
)
CLOCK_DEFAULT = "django_syncguard.liveness.system_clock_ms"
#: The dotted paths above that name a callable.
IMPORTABLE_CLOCKS = {CLOCK_DEFAULT, "django_syncguard.liveness.FakeClock"}
DATABASES = weighted((4, st.sampled_from(sorted(django_settings.DATABASES))), (1, ANY_VALUE))
CLIENT_KWARGS = weighted(
    (1, ANY_VALUE.filter(lambda v: not isinstance(v, dict))),
    (4, st.sampled_from([{}, {"username": "u", "password": "p"}, {"health_check_interval": 10}])),
)

COMMON_OPTIONS = {
    "CONNECT_TIMEOUT_MS": POSITIVE_INT_VALUES,
    "OPERATION_TIMEOUT_MS": POSITIVE_INT_VALUES,
    "CLEANUP_IN_IS_LOCKED": FLAG_VALUES,
}
COMMON = frozenset(COMMON_OPTIONS)

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
REDIS_LOCATIONS = weighted(
    (6, st.sampled_from(["redis://127.0.0.1:1/0", "rediss://127.0.0.1:1", "unix:///tmp/no.sock"])),
    (1, st.sampled_from(["", "http://127.0.0.1:1", "127.0.0.1:6379", b"redis://127.0.0.1:1"])),
    (1, ANY_VALUE.filter(lambda v: not isinstance(v, str))),
)

#: backend -> (class, its params, its extra OPTIONS), as strategies. No I/O: a Redis
#: URL names port 1 and is never dialled, the Firestore client is built on first use.
CONFIG: dict[str, tuple[type[BaseLockBackend], dict[str, Any], dict[str, Any]]] = {
    "memory": (MemoryBackend, {"LOCATION": st.just("properties-config")}, {"CLOCK": CLOCKS}),
    "sqlite": (DatabaseBackend, {}, {"DATABASE": DATABASES}),
    "postgres": (DatabaseBackend, {}, {"DATABASE": DATABASES}),
    "redis": (
        RedisBackend,
        {"LOCATION": REDIS_LOCATIONS},
        {"MAX_CONNECTIONS": POSITIVE_INT_VALUES, "CLIENT_KWARGS": CLIENT_KWARGS},
    ),
    "firestore": (
        FirestoreBackend,
        {},
        {
            "PROJECT": st.sampled_from(["syncguard-test", "other"]),
            "COLLECTION": COLLECTIONS,
            "FENCE_COLLECTION": COLLECTIONS,
        },
    ),
}
UNKNOWN_OPTIONS = ["NOT_AN_OPTION", "connect_timeout_ms", "Clock", "", "LOCATION"]
#: Options a backend needs to stand for its harness (added unless generated).
REQUIRED_OPTIONS = {"postgres": {"DATABASE": "postgres"}, "firestore": {"PROJECT": "p"}}


def config_strategy(name: str) -> st.SearchStrategy[dict[str, Any]]:
    _, fixed, extra = CONFIG[name]
    known = st.fixed_dictionaries({}, optional={**COMMON_OPTIONS, **extra})
    # Now and then one unknown name (option names are case-sensitive).
    unknown = weighted(
        (5, st.just({})),
        (1, st.dictionaries(st.sampled_from(UNKNOWN_OPTIONS), ANY_VALUE, min_size=1, max_size=1)),
    )
    options = st.builds(
        lambda known, unknown: {**REQUIRED_OPTIONS.get(name, {}), **known, **unknown},
        known,
        unknown,
    )
    container = weighted(
        (8, options), (1, st.none()), (1, st.sampled_from([[], "", 0, [("CLOCK", 1)], "x"]))
    )
    return st.fixed_dictionaries(fixed, optional={"KEY_PREFIX": PREFIXES, "OPTIONS": container})


def positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def collection_id_ok(value: object) -> bool:
    """Firestore: non-empty valid Unicode of at most 1500 bytes, no '/', not '.' or '..',
    not ``__...__``."""
    if not isinstance(value, str) or value in ("", ".", "..") or "/" in value:
        return False
    if has_lone_surrogate(value) or utf8_size(value) > 1500:
        return False
    return not (len(value) >= 4 and value.startswith("__") and value.endswith("__"))


def database_ok(value: object) -> bool:
    """An alias of DATABASES whose engine is PostgreSQL or SQLite."""
    if not isinstance(value, str) or value not in django_settings.DATABASES:
        return False
    engine = django_settings.DATABASES[value]["ENGINE"]
    return engine.endswith((".postgresql", ".sqlite3"))


def clock_ok(value: object) -> bool:
    """A callable, or the dotted path of one."""
    if isinstance(value, str):
        return value in IMPORTABLE_CLOCKS
    return callable(value)


def expected_config(name: str, params: dict[str, Any]) -> dict[str, Any] | None:
    """The attributes the backend must end up with, or None when it must refuse."""
    cls, _, extra = CONFIG[name]
    if "KEY_PREFIX" in params and cls is not RedisBackend:
        return None  # only Redis keys share a namespace a prefix divides
    prefix = params.get("KEY_PREFIX", "syncguard")
    if not isinstance(prefix, str) or has_lone_surrogate(prefix):
        return None
    if cls is RedisBackend:
        location = params["LOCATION"]
        if not isinstance(location, str) or not location.startswith(REDIS_SCHEMES):
            return None
        if prefix.rstrip(":") == "" or "#" in prefix:
            return None
    options = params.get("OPTIONS")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        return None
    if set(options) - COMMON - set(extra):
        return None
    expected: dict[str, Any] = {"key_prefix": prefix if cls is RedisBackend else ""}
    for option, attribute in (
        ("CONNECT_TIMEOUT_MS", "connect_timeout_ms"),
        ("OPERATION_TIMEOUT_MS", "operation_timeout_ms"),
    ):
        value = options.get(option, DEFAULT_TIMEOUT_MS)
        if not positive_int(value) or value > 2**31 - 1:  # the longest TTL
            return None
        expected[attribute] = value
    cleanup = options.get("CLEANUP_IN_IS_LOCKED", False)
    if cleanup is not True and cleanup is not False:
        return None
    expected["cleanup_in_is_locked"] = cleanup
    if name == "memory" and not clock_ok(options.get("CLOCK", CLOCK_DEFAULT)):
        return None
    if cls is DatabaseBackend:
        database = options.get("DATABASE", "default")
        if not database_ok(database):
            return None
        expected["database"] = database
    if cls is RedisBackend:
        if not positive_int(options.get("MAX_CONNECTIONS", 50)):
            return None
        if not isinstance(options.get("CLIENT_KWARGS", {}), dict):
            return None
        expected["prefix"] = prefix.rstrip(":")
    if cls is FirestoreBackend:
        collection = options.get("COLLECTION", "locks")
        fences = options.get("FENCE_COLLECTION", "fence_counters")
        if not (collection_id_ok(collection) and collection_id_ok(fences)):
            return None
        if collection == fences:
            return None
        expected |= {"collection": collection, "fence_collection": fences}
    return expected


def check_config(name: str, params: dict[str, Any]) -> None:
    cls = CONFIG[name][0]
    expected = expected_config(name, params)
    if expected is None:
        with pytest.raises(LockError) as caught:
            cls("properties", params)
        assert type(caught.value) is InvalidArgument, caught.value
        assert caught.value.code == "InvalidArgument"
        return
    backend = cls("properties", params)
    try:
        assert {attr: getattr(backend, attr) for attr in expected} == expected
        assert all(type(getattr(backend, attr)) is type(v) for attr, v in expected.items())
    finally:
        backend.close()


@pytest.mark.parametrize("name", sorted(CONFIG))
def test_any_configuration_builds_or_is_invalid_argument(name: str) -> None:
    """Construction (no I/O) either keeps exactly the given values (defaults otherwise)
    or raises InvalidArgument, which ``manage.py check`` reports as E003."""

    @settings(max_examples=300, deadline=None, database=None)
    @given(config_strategy(name))
    def prop(params: dict[str, Any]) -> None:
        check_config(name, params)

    prop()


@pytest.mark.parametrize("option", ["CONNECT_TIMEOUT_MS", "OPERATION_TIMEOUT_MS"])
@pytest.mark.parametrize("value", [2**31, 10**400])
def test_timeouts_beyond_the_longest_ttl_are_invalid_argument(option: str, value: int) -> None:
    params = {"LOCATION": "redis://127.0.0.1:1/0", "OPTIONS": {option: value}}
    with pytest.raises(InvalidArgument):
        RedisBackend("properties", params)


# --------------------------------------------------- Redis prefixes, with I/O
REDIS_LIMIT, REDIS_RESERVE, HASHED_KEY = 1000, 26, 22
COUNTER = {"FENCES": "counter"}


def redis_prefix_expected(prefix: str, key: str) -> str:
    """How ``P:key`` fits the 1000-byte Redis budget: "plain", "hashed" or "too-long"."""
    head = utf8_size(prefix.rstrip(":")) + 1 + REDIS_RESERVE
    if head + utf8_size(key) <= REDIS_LIMIT:
        return "plain"
    if head + HASHED_KEY <= REDIS_LIMIT:
        return "hashed"
    return "too-long"


REDIS_PREFIXES = st.one_of(
    st.text(ANY_CHAR, min_size=1, max_size=12),
    st.builds(lambda n, tail: "p" * n + tail, st.integers(925, 960), st.text(":", max_size=2)),
    st.builds(lambda n: "\u00e9" * n, st.integers(462, 480)),
)


def test_any_accepted_redis_prefix_gives_working_locks(redis_server: Any) -> None:
    """A KEY_PREFIX Redis accepts gives working locks (plain or hashed storage keys,
    the user key always returned as given) or, when too long for even the hashed key,
    InvalidArgument on use; an unusable one is refused at construction."""

    @settings(max_examples=60, deadline=None, database=None)
    @given(REDIS_PREFIXES)
    def prop(prefix: str) -> None:
        # Counter fences: a key never seen before gets fence 1.
        params = {"LOCATION": redis_server.url, "KEY_PREFIX": prefix, "OPTIONS": COUNTER}
        if has_lone_surrogate(prefix) or prefix.rstrip(":") == "" or "#" in prefix:
            with pytest.raises(LockError) as caught:
                RedisBackend("properties", params)
            assert type(caught.value) is InvalidArgument
            return
        backend = RedisBackend("properties", params)
        key = f"prop-{uuid.uuid4().hex}"  # 37 bytes: never seen before, fence 1
        try:
            outcome = redis_prefix_expected(prefix, key)
            if outcome == "too-long":
                refused({"acquire": lambda: backend.acquire(key, TTL)})
                return
            result = backend.acquire(key, TTL)
            assert (result.ok, result.fence) == (True, fence(1))
            name = backend.lock_key(key)
            plain = f"{prefix.rstrip(':')}:{key}"
            assert (name == plain) is (outcome == "plain")
            assert backend.lookup_raw(key=key).key == key
            assert backend.lookup_raw(lock_id=result.lock_id).key == key
            assert backend.acquire(key, TTL) == AcquireResult(ok=False, reason="locked")
            assert backend.release(result.lock_id) == ReleaseResult(ok=True)
            assert backend.is_locked(key) is False
            backend.client.delete(name)
        finally:
            backend.close()

    prop()
