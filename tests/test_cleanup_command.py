"""``manage.py syncguard_cleanup``: exact output at each verbosity, dry runs, batches,
failures, and fences surviving on every backend."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

from django_syncguard.constants import CLEANUP_GUARD_MS

TTL = 10_000
MARGIN = 500


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def cleanup(*args: str, stdout: io.StringIO | None = None) -> str:
    out = stdout or io.StringIO()
    call_command("syncguard_cleanup", *args, stdout=out)
    return out.getvalue()


@pytest.fixture
def expired(harness):
    """Three expired records past the guard, one live lock; configured as alias "x"."""
    for key in ("gone:1", "gone:2", "gone:3"):
        harness.backend.acquire(key, TTL)
    guard = CLEANUP_GUARD_MS[harness.capabilities.time_authority]
    harness.advance(TTL + guard + MARGIN)
    harness.backend.acquire("live", TTL)
    with override_settings(SYNCGUARD_BACKENDS={"x": harness.settings_entry}):
        yield harness


def test_cleanup_deletes_expired_records_and_keeps_fences(expired):
    assert cleanup("--backend", "x") == "x: deleted 3 expired lock records.\n"

    backend = expired.backend
    assert backend.acquire("gone:1", TTL).fence == "000000000000002"
    assert backend.acquire("live", TTL).ok is False
    assert cleanup("--backend", "x") == "x: deleted 0 expired lock records.\n"


def test_dry_run_counts_and_touches_nothing(expired):
    assert cleanup("--dry-run") == "x: 3 expired lock records would be deleted (dry run).\n"
    assert cleanup("--dry-run") == "x: 3 expired lock records would be deleted (dry run).\n"
    assert sum(expired.backend.delete_expired(dry_run=True)) == 3


def test_verbosity_zero_prints_nothing(expired):
    assert cleanup("--verbosity", "0") == ""
    assert sum(expired.backend.delete_expired(dry_run=True)) == 0


def test_verbosity_two_explains_the_guard(expired):
    backend = expired.backend
    authority = backend.time_authority
    guard = CLEANUP_GUARD_MS[authority]
    assert cleanup("--verbosity", "2") == (
        f"x ({backend.capabilities.backend}, {authority} time): deleting lock records "
        f"expired more than {guard} ms ago; fence counters are kept.\n"
        "x: deleted 3 expired lock records.\n"
    )


@override_settings(
    SYNCGUARD_BACKENDS={"m": {"BACKEND": "django_syncguard.backends.memory.MemoryBackend"}}
)
def test_verbosity_three_lists_batches(mem_alias_with_expired):
    assert cleanup("--verbosity", "3", "--batch-size", "2") == (
        "m (memory, client time): deleting lock records expired more than 2000 ms ago; "
        "fence counters are kept.\n"
        "m: batch 1: 2\n"
        "m: batch 2: 2\n"
        "m: batch 3: 1\n"
        "m: deleted 5 expired lock records.\n"
    )


def test_progress_on_a_terminal(mem_alias_with_expired):
    with override_settings(
        SYNCGUARD_BACKENDS={"m": {"BACKEND": "django_syncguard.backends.memory.MemoryBackend"}}
    ):
        text = cleanup("--batch-size", "2", stdout=Tty())
    assert text == (
        "\rm: 2 deleted so far\rm: 4 deleted so far\rm: 5 deleted so far\r"
        "m: deleted 5 expired lock records.\n"
    )


@pytest.fixture
def mem_alias_with_expired():
    from django_syncguard.backends.memory import MemoryBackend
    from django_syncguard.liveness import FakeClock

    clock = FakeClock()
    backend = MemoryBackend("m", {"OPTIONS": {"CLOCK": clock}})
    for n in range(5):
        backend.acquire(f"k:{n}", TTL)
    # The command's own backend object reads the system clock: age the records instead.
    store = backend._store
    for key, record in list(store.locks.items()):
        store.locks[key] = type(record)(
            key=record.key,
            lock_id=record.lock_id,
            expires_at_ms=0,
            acquired_at_ms=0,
            fence=record.fence,
        )
    yield backend
    backend.reset()


@override_settings(
    SYNCGUARD_BACKENDS={
        "one": {"BACKEND": "django_syncguard.backends.memory.MemoryBackend"},
        "two": {"BACKEND": "django_syncguard.backends.memory.MemoryBackend"},
    }
)
def test_every_alias_by_default_and_each_named_alias_once():
    assert (
        cleanup() == "one: deleted 0 expired lock records.\ntwo: deleted 0 expired lock records.\n"
    )
    assert (
        cleanup("--backend", "two", "--backend", "two") == "two: deleted 0 expired lock records.\n"
    )


@override_settings(
    SYNCGUARD_BACKENDS={"one": {"BACKEND": "django_syncguard.backends.memory.MemoryBackend"}}
)
def test_unknown_alias_is_a_command_error():
    with pytest.raises(CommandError) as caught:
        cleanup("--backend", "nope")
    assert str(caught.value) == "Unknown lock backend alias 'nope'; configured: one."


@pytest.mark.parametrize("size", ["0", "10001", "many"])
def test_bad_batch_size_is_a_command_error(size):
    with pytest.raises(CommandError) as caught:
        cleanup("--batch-size", size)
    assert str(caught.value) == (
        f"Error: argument --batch-size: must be an integer between 1 and 10000, not {size!r}"
    )


@override_settings(
    SYNCGUARD_BACKENDS={
        "down": {
            "BACKEND": "django_syncguard.backends.redis.RedisBackend",
            "LOCATION": "redis://127.0.0.1:1/0",
            "OPTIONS": {"CONNECT_TIMEOUT_MS": 500},
        }
    }
)
def test_unreachable_server_is_a_command_error_naming_the_code():
    with pytest.raises(CommandError) as caught:
        cleanup()
    assert str(caught.value).startswith(
        "down: cleanup failed (ServiceUnavailable): Redis ('down'):"
    )


@override_settings(
    SYNCGUARD_BACKENDS={
        "bad": {"BACKEND": "django_syncguard.backends.memory.MemoryBackend", "OPTIONS": {"X": 1}}
    }
)
def test_misconfigured_backend_is_a_command_error():
    with pytest.raises(CommandError) as caught:
        cleanup()
    assert str(caught.value) == (
        "bad: the backend cannot be used: Unknown OPTIONS for MemoryBackend (alias 'bad'): X. "
        "Known: CLEANUP_IN_IS_LOCKED, CLOCK, CONNECT_TIMEOUT_MS, FENCES, OPERATION_TIMEOUT_MS, "
        "RECORD_OWNER, WAKE_UPS."
    )
