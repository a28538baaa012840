"""``manage.py syncguard_fences``: exact output of each action, re-runs, bad input.

The command is thin (the backends' fence hooks are tested on every backend in
tests/test_fence_floors.py); these tests run it on memory backends on a fake clock,
and on a Redis alias whose server is gone for the error path.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

from django_syncguard.fence_floors import FLOOR_MAX
from tests.support.harness import MemoryHarness
from tests.support.servers import free_port

TTL = 60_000
DAY_MS = 86_400_000


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def fences(*args: str, stdout: io.StringIO | None = None) -> str:
    out = stdout or io.StringIO()
    call_command("syncguard_fences", *args, stdout=out)
    return out.getvalue()


def take(h: MemoryHarness, key: str) -> str:
    result = h.backend.acquire(key, TTL)
    assert h.backend.release(result.lock_id).ok
    return result.fence


@pytest.fixture
def two() -> Iterator[tuple[MemoryHarness, MemoryHarness]]:
    """Aliases "old" (counter mode, fences up to 3) and "new" (clock mode)."""
    old, new = MemoryHarness(), MemoryHarness(FENCES="clock")
    for _ in range(3):
        take(old, "invoice:1")
    take(old, "invoice:2")
    entries = {"old": old.settings_entry, "new": new.settings_entry}
    with override_settings(SYNCGUARD_BACKENDS=entries):
        yield old, new
    old.close()
    new.close()


def test_show_prints_mode_floor_and_highest_of_every_alias(two):
    assert fences("show") == (
        "old (memory): counter fences, floor 0, highest counter 3\n"
        "new (memory): clock fences, floor 0, highest counter 0\n"
    )
    assert fences("show", "--backend", "new") == (
        "new (memory): clock fences, floor 0, highest counter 0\n"
    )


def test_raise_floor_raises_and_never_lowers(two):
    old, _ = two
    assert fences("raise-floor", "100", "--backend", "old") == "old: fence floor is now 100.\n"
    assert fences("raise-floor", "50", "--backend", "old") == (
        "old: fence floor stays 100 (above 50).\n"
    )
    assert take(old, "invoice:1") == "000000000000101"
    assert fences("--verbosity", "0", "raise-floor", "7", "--backend", "old") == ""


@pytest.mark.parametrize("value", ["-1", "x", "1.5", str(FLOOR_MAX + 1)])
def test_a_bad_floor_is_a_command_error(two, value):
    with pytest.raises(CommandError, match="argument fence: must be an integer from 0 to"):
        fences("raise-floor", value, "--backend", "old")


def test_migrate_starts_the_new_backend_above_the_old_ones_fences(two):
    _, new = two
    assert fences("migrate", "--from", "old", "--to", "new") == (
        "new: fence floor is now 3; every fence old handed out is at most 3.\n"
    )
    # Re-running is safe; a floor above the old highest counts too.
    assert fences("raise-floor", "10", "--backend", "old") == "old: fence floor is now 10.\n"
    assert fences("migrate", "--from", "old", "--to", "new") == (
        "new: fence floor is now 10; every fence old handed out is at most 10.\n"
    )
    new.clock.now_ms = 5  # a clock below the floor: the floor decides
    assert take(new, "invoice:1") == "000000000000011"


def test_migrate_from_a_clock_alias_covers_its_clock(two):
    # The clock alias holds no counter at all (as after a restart without
    # persistence), yet its fences reached its clock.
    old, _ = two
    assert fences("migrate", "--from", "new", "--to", "old") == (
        "old: fence floor is now 1700000000000; every fence new handed out is at most "
        "1700000000000.\n"
    )
    assert take(old, "invoice:9") == "001700000000001"


def test_migrate_needs_two_known_aliases(two):
    with pytest.raises(CommandError, match="--from and --to name the same alias"):
        fences("migrate", "--from", "old", "--to", "old")
    with pytest.raises(
        CommandError, match="Unknown lock backend alias 'nope'; configured: old, new"
    ):
        fences("migrate", "--from", "old", "--to", "nope")


def test_compact_deletes_idle_counters_and_reports_the_floor(two):
    old, _ = two
    old.advance(3 * DAY_MS)
    take(old, "invoice:3")  # recent: kept
    assert fences("compact", "--backend", "old", "--idle-days", "2", "--dry-run") == (
        "old: 2 idle fence counters would be deleted (dry run).\n"
    )
    assert fences("compact", "--backend", "old", "--idle-days", "2") == (
        "old: deleted 2 idle fence counters; floor 3.\n"
    )
    assert fences("compact", "--backend", "old", "--idle-days", "2") == (
        "old: deleted 0 idle fence counters; floor 3.\n"
    )
    assert take(old, "invoice:2") == "000000000000004"


def test_compact_at_higher_verbosity_says_what_and_counts_batches(two):
    old, _ = two
    start = old.clock()
    old.advance(DAY_MS)
    out = fences(
        "--verbosity", "3", "compact", "--backend", "old", "--idle-days", "0.5", "--batch-size", "1"
    )
    since = start + DAY_MS // 2
    assert since == 1_700_043_200_000  # 2023-11-15 10:13:20 UTC
    assert out == (
        "old: deleting the fence counters of keys with no live lock, no waiter and no "
        "acquisition since 2023-11-15 10:13:20 UTC.\n"
        "old: batch 1: 1\n"
        "old: batch 2: 1\n"
        "old: deleted 2 idle fence counters; floor 3.\n"
    )


def test_compact_shows_progress_on_a_terminal(two):
    old, _ = two
    old.advance(DAY_MS)
    out = fences(
        "compact", "--backend", "old", "--idle-days", "0", "--batch-size", "1", stdout=Tty()
    )
    assert out == (
        "\rold: 1 deleted so far\rold: 2 deleted so far\r"
        "old: deleted 2 idle fence counters; floor 3.\n"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["compact", "--idle-days", "1"], "the following arguments are required: --backend"),
        (["compact", "--backend", "old"], "the following arguments are required: --idle-days"),
        (["compact", "--backend", "old", "--idle-days", "-1"], "must be a number of days"),
        (["compact", "--backend", "old", "--idle-days", "1", "--batch-size", "0"], "between 1"),
        (["raise-floor", "5"], "the following arguments are required: --backend"),
        (["unknown"], "invalid choice: 'unknown'"),
        ([], "the following arguments are required: ACTION"),
    ],
)
def test_bad_arguments_are_command_errors(two, args, message):
    with pytest.raises(CommandError, match=message):
        fences(*args)


def test_a_server_that_is_gone_is_a_command_error():
    entry = {
        "BACKEND": "django_syncguard.backends.redis.RedisBackend",
        "LOCATION": f"redis://127.0.0.1:{free_port()}/0",
        "OPTIONS": {"CONNECT_TIMEOUT_MS": 500, "OPERATION_TIMEOUT_MS": 500},
    }
    failed = r"^raise-floor failed \(ServiceUnavailable\): "
    with (
        override_settings(SYNCGUARD_BACKENDS={"gone": entry}),
        pytest.raises(CommandError, match=failed),
    ):
        fences("raise-floor", "5", "--backend", "gone")
