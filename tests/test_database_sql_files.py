"""The PostgreSQL functions as versioned ``.sql`` files (``backends/database/sql/``).

Released files never change (their SHA-256 is pinned here, and so is the expanded SQL
each migration runs); placeholders expand to the values the Python side uses; and the
rules that exist both in SQL and in Python (the wake-up channel name, the queue rule)
agree on a real PostgreSQL.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from importlib import import_module
from importlib.resources import files

import pytest
from django.db import connections

from django_syncguard import generate_lock_id
from django_syncguard.backends.database import DatabaseBackend, sql
from django_syncguard.backends.database.postgresql import (
    DELETE_EXPIRED,
    NOW,
    PostgresOperations,
)
from django_syncguard.backends.database.wakeups import channel_name
from django_syncguard.constants import FENCE_DIGITS
from django_syncguard.waiting import Queue, WaitTicket, queue_admits

#: Every released file, as ``<version>/<name>.sql``, and the SHA-256 of its text. A
#: new version adds its files here; a released one is never edited (see the docstring
#: of ``django_syncguard.backends.database.sql``).
RELEASED = {
    "0002/acquire.sql": "73bcecb32a3e5cf0309d3549f86d0ad721801ab211131adbdd18e436eddb507f",
    "0002/drop.sql": "97db575bb00d57a6b87c12f2ba8de3fe62e370bad22172608cdee712596594ef",
    "0002/extend.sql": "51b2eb7824ff28a58f0a03d9bc8af7fa9d644d12a1212db7e52443901dc28c94",
    "0002/release.sql": "33a54979a39338609279cd4cd00591e500959be45470b89ed30b61b7db5fd1fe",
    "0005/acquire.sql": "6771956a0fef6b8542eed7086f06f76c5ae6c3ed7b7e2febcb13f6669b97fff4",
    "0005/acquire_legacy.sql": "18cf07090833feffbc916c0295a0c5893474f070fe3fb409e56454216ed48081",
    "0005/channel.sql": "5977ac1b626a321e75ce85a2bc4621b748a721024fbe527b79f0df66246f78a8",
    "0005/drop.sql": "b23d5c8b92c185e016387147978996adc3555020592d3c7dd91d3be3c7f2d913",
    "0005/release.sql": "b34f47384e2eef5a6885a3455ed8c06db7ae4fe0f8f6fce693d310c328a387ae",
    "0005/sequence.sql": "cbaf4fe7eec7049a496b32820e05bd61630d7c1e3c48ccfe05158fd2eab8ce0b",
    "0005/withdraw.sql": "0cc2b340d788cd7f4b6dd5f4f7d8b8e01bfacbb1a40b03a7d7c0e75dd7f3759b",
    "0006/acquire.sql": "f57449f9adcf48856aa2c8e518103c123a87bd8942d86124ed4e41b39ff8205d",
    "0006/acquire_legacy.sql": "3ccff6962080a8dc715dc694d7208841cfb2f4d22ad7e24b453fad697698dc9e",
    "0006/drop.sql": "6ce3116e95244b84d5b6f4c1bebf4e9a70a80a7ca63eb70263191806c6151892",
    "0007/acquire.sql": "dee8a2f2869a8900c28357149236262ea4901f7f4f117f5eb732a95fc48b72a0",
    "0007/acquire_legacy.sql": "695c98204b6ef0712fedd534607c9c25284b86b2fa8f7c335b634f99263adca1",
    "0007/drop.sql": "8ce561018bf190c58b7c6a398131fdfe958723cb43f0973952d37a6ac94ef3b6",
    "0008/acquire.sql": "c8452a3531e539596a604ea97cedbb2617eefaab12d6cb88c0aad42f65e9823a",
    "0008/acquire_legacy.sql": "5ef66b5c88ae4ccfd90fba2393b10920e8b943fd209ad87a69ff8a4676384b2c",
    "0008/claim.sql": "0430fa82d55cf6c879207f79da73b3341d144b2676b80747829b57a6ada3bff7",
    "0008/drop.sql": "5cfbecd431f21b6d00e60580568ed52f68d55cd86b67bbfa4aba5d4aa382fa75",
    "0008/extend.sql": "d919f0bfb72beaf7f8bf0973e6bdfd197d56a04e1f3517c5be95ba598da64994",
    "0008/hand_over.sql": "a7003ced40898ca2aa6f4c9dd7d5f01cc986a7dfa82407dfe61506fe3be4945a",
    "0008/release.sql": "b3f1b868ef6fc79d3e10def2bc75df3a2e6ed84d52e32087f589934aaac7190b",
    "0008/release_legacy.sql": "2e9cfc7b61c6d4dd35039b9e25f49c60dded5174c8c1a32d9eec9ef67f796436",
    "0008/withdraw.sql": "04d5ee2e4e210c10b4d4cb03deddaff1228bca77c87352b8d0c8981eccb7ec60",
    "0009/acquire.sql": "2ff6624ea3b4d9f5cbc75afc76a93cac09ddc9a28c37145dd9a7516e1fdf43eb",
    "0009/acquire_legacy.sql": "f8d1b18c0748dd862ab9ec49850596e7faab4259cb45e182a269736d5a3d11e8",
    "0009/check_grant.sql": "39afd7137c738cc8d7c4377038c5ae9296cfa7354bcd1b9cae9474576bcdb48e",
    "0009/drop.sql": "ef8d417792e49fd8c850f2497e5d4cbd62ff45ea3b3693ca03809a96ed902edf",
    "0009/hand_over.sql": "c5d408dfe0f9b4ad2e31fa1b55cf05e71d215a3aac7bec7e55518ee07fafcf44",
    "0009/release.sql": "918f6d57994c78492d37a861a36cbda7001e16b31ad18589b72aef0bac6dfd49",
    "0009/release_legacy.sql": "5e88aae336b2ed93c233280b73371e0c076da0bf9fd956f9890790c54c66e92f",
    "0009/withdraw.sql": "5f2fd7115282fbf2a3701da1bdf84626b3c9afa45f54ed9f22565353849d4a2f",
    "0009/withdraw_legacy.sql": "b35956236e45664fffbd0d5b19b1578dd1dd7b0f0d810b273d6365ca4f7af506",
}

#: The SHA-256 of what each migration runs, forward and reverse, placeholders expanded:
#: catches a changed placeholder value as well as an edited file.
MIGRATIONS = {
    ("0002_postgres_functions", "FORWARD"): (
        "44331e66d7b25c6945bd40ed6fe79f4ce37a970b9c4deff1a359c6f975bf961e"
    ),
    ("0002_postgres_functions", "REVERSE"): (
        "54acdf302ba4e1e3a15f56b10fed12845d1d629f5d00740fd04b431dde9c3622"
    ),
    ("0005_postgres_queue_functions", "FORWARD"): (
        "4ee4f8922d6014fbbcfd124da64375cf11318944f8aab239762f8aab424f6c07"
    ),
    ("0005_postgres_queue_functions", "REVERSE"): (
        "9aca55543d6fc6fef4935e3c63ea8b0471c1a83c51231fa4a1974868f747e534"
    ),
    ("0006_fence_continuity", "FORWARD"): (
        "226a31a4e78fa46baf72fde1af63327ee06cb64ea4f41c7938609510e3b0b3b6"
    ),
    ("0006_fence_continuity", "REVERSE"): (
        "411866700be414918c4543852edeb2935a6eff5fe8494732373c5847c7303f85"
    ),
    ("0007_owners", "FORWARD"): (
        "96302ff34989fb592571647efc42f8cc54701882db60063319736bb0f5a6c4ac"
    ),
    ("0007_owners", "REVERSE"): (
        "49c1d3d3a57f90666dc8e8040369a17c962e213e90dab2b2e429cd4fd7839d45"
    ),
    ("0008_grants", "FORWARD"): (
        "66fa2d749e14ab00035270f39062f32e1c25fbdda9d90168afacfe37dd114678"
    ),
    ("0008_grants", "REVERSE"): (
        "51a2caa5b3748221654fac9c2e87a8cf65a67ef8350ef1dde6225cebb52540ca"
    ),
    ("0009_process_channels", "FORWARD"): (
        "7e8ab015e4b03c015a119b55fd32ea429d300bf917b058779244425d010d535f"
    ),
    ("0009_process_channels", "REVERSE"): (
        "c3328cd04512129cb0c8471c9fd8a048d7b36e8bba8f992d88f2fd73776b1eda"
    ),
}

TTL = 60_000
PATIENCE_MS = 60_000  # no ticket of the queue script goes stale while it runs


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def stored_files() -> set[str]:
    root = files(sql.__name__)
    return {
        f"{version.name}/{item.name}"
        for version in root.iterdir()
        if version.is_dir() and version.name != "__pycache__"
        for item in version.iterdir()
        if item.name.endswith(".sql")
    }


# ------------------------------------------------------------------ released files
def test_every_sql_file_is_released_and_pinned() -> None:
    assert stored_files() == set(RELEASED)


@pytest.mark.parametrize("path", sorted(RELEASED))
def test_a_released_sql_file_is_never_edited(path: str) -> None:
    version, name = path.removesuffix(".sql").split("/")
    assert sha256(sql.read(version, name)) == RELEASED[path], (
        f"{path} was released: put the change in a new version (see the docstring of "
        "django_syncguard.backends.database.sql)"
    )


@pytest.mark.parametrize(("migration", "name"), sorted(MIGRATIONS))
def test_each_migration_runs_the_sql_it_was_released_with(migration: str, name: str) -> None:
    text = getattr(import_module(f"django_syncguard.migrations.{migration}"), name)
    assert "{{" not in text and "}}" not in text
    assert sha256(text) == MIGRATIONS[(migration, name)]


# ------------------------------------------------------------------ the loader
def test_load_drops_the_header_and_expands_placeholders_inline() -> None:
    assert sql.load("0005", "sequence") == (
        "CREATE SEQUENCE IF NOT EXISTS syncguard_waiters_arrival AS bigint;\n"
    )
    assert sql.expand("-- about\n--\n\nSELECT {{ now_ms }}, {{lock_class}};\n") == (
        "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint, 1937337447;\n"
    )
    # Inline, not a helper function: one PL/pgSQL call per operation, as before.
    acquire = sql.load("0005", "acquire")
    assert acquire.count("clock_timestamp()") == 1
    assert "PERFORM pg_advisory_xact_lock(1937337447, hashtext(p_key));" in acquire
    assert acquire.count("lpad(o_fence::text, 15, '0')") == 2


def test_the_0006_acquire_reads_the_floor_first_and_upserts_every_counter_write() -> None:
    acquire = sql.load("0006", "acquire")
    assert acquire.count("clock_timestamp()") == 1
    # The floor comes with the counter, in the function's first statement.
    assert "LEFT JOIN syncguard_fence_counters f ON f.fence_key = 'syncguard:floor';" in acquire
    assert "o_fence := greatest(coalesce(v_last, 0), coalesce(v_floor, 0)) + 1;" in acquire
    assert "o_fence := greatest(o_fence, v_now);" in acquire  # clock mode
    # Compaction may delete the counter between the read and the write: never an UPDATE.
    assert "UPDATE syncguard_fence_counters" not in acquire
    assert acquire.count("INSERT INTO syncguard_fence_counters") == 2
    assert acquire.count("ON CONFLICT (fence_key) DO UPDATE SET") == 2


def test_load_concatenates_files_in_the_order_given() -> None:
    both = sql.load("0002", "release", "extend")
    assert both == sql.load("0002", "release") + "\n" + sql.load("0002", "extend")
    assert both.index("syncguard_release(") < both.index("syncguard_extend(")


def test_an_unknown_placeholder_or_no_file_name_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"unknown placeholder in SQL: \{\{ later \}\}"):
        sql.expand("SELECT {{ later }};")
    with pytest.raises(ValueError, match="name the files"):
        sql.load("0002")
    with pytest.raises(FileNotFoundError):
        sql.load("0002", "withdraw")


def test_placeholders_are_the_values_the_python_side_uses() -> None:
    assert dict(sql.PLACEHOLDERS) == {
        "now_ms": "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint",
        "lock_class": "1937337447",
        "fence_digits": "15",
        "floor_key": "'syncguard:floor'",
    }
    assert sql.PLACEHOLDERS["fence_digits"] == str(FENCE_DIGITS)
    assert sql.PLACEHOLDERS["floor_key"] == f"'{sql.FLOOR_KEY}'"
    assert f"SELECT {sql.NOW_MS}" == NOW
    # Cleanup tries the advisory lock that acquire takes: the same class.
    assert "pg_try_advisory_xact_lock(1937337447, hashtext(c.key))" in DELETE_EXPIRED


# ------------------------------------------------------------------ SQL and Python agree
@pytest.mark.django_db(databases=["postgres"])
@pytest.mark.parametrize(
    "storage_key",
    ["", "a", "invoice:42", "clé:ünïcødé", "锁:键", "emoji:🔒", "quote:'\"", "k" * 512],
)
def test_the_sql_channel_name_is_the_one_wakeups_listen_on(storage_key: str) -> None:
    with connections["postgres"].cursor() as cursor:
        cursor.execute("SELECT syncguard_channel(%s)", [storage_key])
        (name,) = cursor.fetchone()
    assert name == channel_name(storage_key)
    assert len(name.encode()) == 50


# One key's life: each step is (action, actor); an actor is a ticket's name or None
# (an acquire without a ticket); "release" frees the key held. Expected per acquire:
# (took the key, queue position).
QUEUE_SCRIPT: list[tuple[str, str | None, tuple[bool, int | None] | None]] = [
    ("acquire", None, (True, None)),  # free, nobody waits
    ("acquire", "a", (False, 0)),
    ("acquire", "b", (False, 1)),
    ("acquire", "a", (False, 0)),  # another attempt keeps its place
    ("acquire", None, (False, None)),  # held: no ticket, no place
    ("release", None, None),
    ("acquire", None, (False, None)),  # free, but two wait: not for a caller without one
    ("acquire", "c", (False, 2)),  # ... nor for a ticket behind them
    ("acquire", "b", (False, 1)),
    ("withdraw", "a", None),
    ("acquire", "c", (False, 1)),  # b is first now
    ("acquire", "b", (True, None)),
    ("acquire", "c", (False, 0)),
    ("release", None, None),
    ("acquire", None, (False, None)),
    ("acquire", "c", (True, None)),
    ("release", None, None),
    ("acquire", None, (True, None)),  # nobody waits any more
    ("acquire", "d", (False, 0)),
    ("withdraw", "d", None),
    ("release", None, None),
    ("acquire", "a", (True, None)),  # withdrawn long ago: a fresh ticket, nobody ahead
]


@pytest.fixture
def pg() -> Iterator[DatabaseBackend]:
    backend = DatabaseBackend(
        f"sql-files-{uuid.uuid4().hex[:8]}", {"OPTIONS": {"DATABASE": "postgres"}}
    )
    yield backend
    backend.close()


def run_on_postgresql(backend: DatabaseBackend, key: str) -> list[tuple[bool, int | None]]:
    """The script through ``syncguard_acquire``, ``syncguard_release`` and
    ``syncguard_withdraw``."""
    tickets: dict[str, WaitTicket] = {}
    held: str | None = None
    answers = []
    for action, actor, _ in QUEUE_SCRIPT:
        if actor is not None and actor not in tickets:
            tickets[actor] = WaitTicket(generate_lock_id(), PATIENCE_MS)
        ticket = None if actor is None else tickets[actor]
        if action == "release":
            assert held is not None and backend.release(held).ok
            held = None
        elif action == "withdraw":
            assert ticket is not None
            backend.withdraw(key, ticket.id)
        else:
            result = backend.acquire(key, TTL, ticket=ticket)
            if result.ok:
                held = result.lock_id
            answers.append((result.ok, result.queue_position))
    return answers


def run_in_python() -> list[tuple[bool, int | None]]:
    """The script through ``queue_admits`` (the rule of the memory and SQLite
    backends), at a clock that never lets a ticket go stale."""
    queue: Queue = {}
    held = False
    arrivals = 0
    answers = []
    for action, actor, _ in QUEUE_SCRIPT:
        if action == "release":
            held = False
        elif action == "withdraw":
            assert actor is not None
            queue.pop(actor, None)
        else:
            arrivals += 1
            ticket = None if actor is None else WaitTicket(actor, PATIENCE_MS)
            take, position = queue_admits(queue, 0, free=not held, ticket=ticket, arrival=arrivals)
            held = held or take
            answers.append((take, position))
    return answers


@pytest.mark.django_db(transaction=True, databases=["postgres"])
def test_the_sql_queue_rule_answers_as_the_python_one(
    pg: DatabaseBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Waiters that leave no grant record (as those of code before 0008): a release
    # only wakes the first, which takes the key with its next attempt, as in Python.
    monkeypatch.setattr(PostgresOperations, "grants", False)
    expected = [answer for action, _, answer in QUEUE_SCRIPT if action == "acquire"]
    assert run_in_python() == expected
    assert run_on_postgresql(pg, f"sql-queue:{uuid.uuid4().hex[:8]}") == expected


# The same script where waiters take grants (0008): a release (or a withdrawal that
# gives a grant back) hands the key to the first waiter at once, which leaves the queue;
# its next attempt crosses the grant and returns its lock.
GRANTED_ANSWERS = [
    (True, None),
    (False, 0),
    (False, 1),
    (False, 0),
    (False, None),
    (False, None),  # the release granted the key to a
    (False, 1),  # c: only b is ahead now
    (False, 0),
    (False, 0),  # a withdrew: its grant went on to b; c is first
    (True, None),  # b's attempt returns its grant
    (False, 0),
    (False, None),  # the release granted the key to c
    (True, None),
    (True, None),
    (False, 0),
    (True, None),
]


@pytest.mark.django_db(transaction=True, databases=["postgres"])
def test_the_sql_queue_rule_with_grants(pg: DatabaseBackend) -> None:
    assert pg.grants
    assert run_on_postgresql(pg, f"sql-grants:{uuid.uuid4().hex[:8]}") == GRANTED_ANSWERS
