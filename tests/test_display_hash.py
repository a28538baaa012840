"""The display hash: what people see of a key or lock id, keyed with ``SECRET_KEY``
(``django.utils.crypto.salted_hmac``), unlike the specification's ``hash_key``."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from django.conf import settings
from django.test import override_settings

from django_syncguard import InvalidArgument, generate_lock_id, hash_key, locked
from django_syncguard.errors import Internal
from django_syncguard.fencing import FENCE_MAX, check_fence, check_fence_number
from django_syncguard.keys import DISPLAY_HASH_SALT, display_hash, display_hash_of

ROOT = Path(__file__).resolve().parent.parent
KEYS = ["invoice:1", "invoice:2", "customer:alice@example.com", "caf\u00e9"]

# Another process with the same SECRET_KEY (its own settings, nothing shared with
# this one) prints the display hashes of the keys given as JSON.
OTHER_PROCESS = """
import json, sys
from django.conf import settings
if sys.argv[1] != "-":
    settings.configure(SECRET_KEY=sys.argv[1])
from django_syncguard.keys import display_hash
print(json.dumps([display_hash(key) for key in json.loads(sys.argv[2])]))
"""


def in_another_process(secret: str | None, keys: list[str]) -> list[str]:
    """``display_hash`` of ``keys`` in a fresh interpreter with ``SECRET_KEY=secret``
    (``None``: Django settings not configured at all)."""
    done = subprocess.run(
        [sys.executable, "-c", OTHER_PROCESS, secret or "-", json.dumps(keys)],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return list(json.loads(done.stdout))


def reference(secret: str, key: str) -> str:
    """The construction written out with hashlib/hmac alone (salted_hmac's, SHA-256)."""
    derived = hashlib.sha256((DISPLAY_HASH_SALT + secret).encode()).digest()
    return hmac.new(derived, hash_key(key).encode(), hashlib.sha256).hexdigest()[:24]


def test_the_display_hash_is_an_hmac_of_the_spec_hash_keyed_with_the_secret():
    assert settings.SECRET_KEY == "tests-only-not-secret"
    assert display_hash("invoice:1") == reference("tests-only-not-secret", "invoice:1")
    # K=$(printf django_syncguard.display-hashtests-only-not-secret | sha256sum | cut -c1-64)
    # printf 3c16c567c592b7496421530a | openssl dgst -sha256 -mac HMAC -macopt hexkey:$K
    assert display_hash("invoice:1") == "62fc0f3498dc28f874e5d68d"
    assert hash_key("invoice:1") == "3c16c567c592b7496421530a"  # the spec's, unchanged


def test_same_shape_as_hash_key_but_a_different_value():
    for key in KEYS:
        shown = display_hash(key)
        assert re.fullmatch(r"[0-9a-f]{24}", shown)
        assert shown != hash_key(key)
        assert display_hash(key) == shown  # stable across calls
    assert len({display_hash(key) for key in KEYS}) == len(KEYS)
    # The key's NFC form, as hash_key takes it: one key, one display hash.
    assert display_hash("cafe\u0301") == display_hash("caf\u00e9")


def test_code_that_only_has_hash_key_derives_the_same_display_hash(mem):
    held = mem.backend.acquire("invoice:1", 10_000)
    info = mem.backend.lookup(key="invoice:1")

    assert info.key_hash == hash_key("invoice:1")  # the API value stays the spec's
    assert display_hash_of(info.key_hash) == display_hash("invoice:1")
    assert display_hash_of(info.lock_id_hash) == display_hash(held.lock_id)


@pytest.mark.parametrize("bad", ["invoice:1", "3C16C567C592B7496421530A", "3c16c567", 42, None])
def test_display_hash_of_takes_only_a_spec_hash(bad):
    with pytest.raises(InvalidArgument, match="24 lowercase hex characters"):
        display_hash_of(bad)


def test_another_process_with_the_same_secret_shows_the_same_hashes():
    assert in_another_process(settings.SECRET_KEY, KEYS) == [display_hash(key) for key in KEYS]


def test_rotating_the_secret_changes_every_display_hash_but_not_hash_key():
    before = [display_hash(key) for key in KEYS]
    with override_settings(SECRET_KEY="rotated", SECRET_KEY_FALLBACKS=["tests-only-not-secret"]):
        after = [display_hash(key) for key in KEYS]
        # Fallbacks play no part: one display hash per key at any time.
        assert after == [reference("rotated", key) for key in KEYS]
        assert hash_key("invoice:1") == "3c16c567c592b7496421530a"
    assert set(before).isdisjoint(after)
    assert [display_hash(key) for key in KEYS] == before  # back to the old secret


def test_without_django_settings_the_hash_is_still_keyed_per_process():
    first = in_another_process(None, ["invoice:1"])[0]
    second = in_another_process(None, ["invoice:1"])[0]

    assert re.fullmatch(r"[0-9a-f]{24}", first)
    assert first != second  # a random secret per process
    assert hash_key("invoice:1") not in (first, second)


def test_log_lines_and_thread_names_show_the_display_hash(mem, caplog):
    caplog.set_level(logging.WARNING, logger="django_syncguard")
    shown = display_hash("invoice:1")
    with locked("invoice:1", using=mem.backend, ttl_ms=30_000, auto_extend=True) as lease:
        renewers = [t.name for t in threading.enumerate() if t.name.startswith("syncguard-")]
        mem.advance(40_000)  # expired: the next extend finds it gone
        assert lease.extend().ok is False

    assert renewers == [f"syncguard-renew-{shown[:8]}"]
    [line] = [r.getMessage() for r in caplog.records if "Lost the lock" in r.getMessage()]
    assert line.startswith(f"Lost the lock on key {shown} (fence 000000000000001):")
    assert hash_key("invoice:1") not in caplog.text


def test_the_fence_warning_names_the_key_by_its_display_hash(caplog):
    caplog.set_level(logging.WARNING, logger="django_syncguard")
    key = f"warn-{generate_lock_id()}"  # warned once per key and process: a fresh one

    check_fence("090000000000001", key)

    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"Lock fence 090000000000001 of key {display_hash(key)} is above")
    assert hash_key(key) not in line


def test_a_granted_fence_number_is_checked_as_its_string_is(caplog):
    caplog.set_level(logging.WARNING, logger="django_syncguard")
    key = f"warn-{generate_lock_id()}"

    assert check_fence_number(7, key) == "000000000000007"
    assert check_fence_number(90000000000001, key) == "090000000000001"
    assert check_fence_number(90000000000002, key) == "090000000000002"  # warned once

    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"Lock fence 090000000000001 of key {display_hash(key)} is above")
    with pytest.raises(Internal, match="would pass"):
        check_fence_number(FENCE_MAX + 1, key)
    with pytest.raises(Internal, match="would pass"):
        check_fence(f"{FENCE_MAX + 1:015d}", key)
