"""What is particular to the database backend (the contract suite covers the rest)."""

from __future__ import annotations

import gc
import socket
import sqlite3
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction
from django.test.utils import CaptureQueriesContext

from django_syncguard import (
    Aborted,
    Internal,
    InvalidArgument,
    NetworkTimeout,
    ServiceUnavailable,
    generate_lock_id,
)
from django_syncguard import checks as syncguard_checks
from django_syncguard.backends.database import DatabaseBackend
from django_syncguard.backends.database.connections import idle_connection_is_gone
from django_syncguard.backends.database.errors import map_database_error
from django_syncguard.backends.database.postgresql import ACQUIRE, DELETE_IDLE
from django_syncguard.backends.database.sql import FLOOR_KEY
from django_syncguard.backends.database.sqlite import (
    BLOCKED_BY_CALLER,
    _WriteWatch,
    watch_transaction_writes,
)
from django_syncguard.constants import TIME_TOLERANCE_MS
from django_syncguard.errors import AuthFailed, RateLimited
from django_syncguard.fence_floors import FenceState
from django_syncguard.fencing import FENCE_MAX
from django_syncguard.keys import fence_key_of
from django_syncguard.waiting import GRANT_WINDOW_MS, Grant, WaitTicket
from tests.support import transaction_workers
from tests.support.harness import PostgresHarness, SqliteHarness
from tests.support.servers import import_extra
from tests.testapp.models import Account

DB = "django_syncguard.backends.database.DatabaseBackend"
on_postgres = pytest.mark.django_db(transaction=True, databases=["postgres"])
on_sqlite = pytest.mark.django_db(transaction=True, databases=["default"])


@pytest.fixture
def pg():
    harness = PostgresHarness()
    yield harness
    harness.close()


@pytest.fixture
def lite():
    harness = SqliteHarness()
    yield harness
    harness.close()


def observer(database: str) -> DatabaseBackend:
    """Another backend object: its own connection, as another process would have."""
    return DatabaseBackend("observer", {"OPTIONS": {"DATABASE": database}})


# ------------------------------------------------------------ round trips
@on_postgres
def test_each_operation_is_one_statement_on_postgres(pg):
    backend = pg.backend
    conn = backend.connection()
    conn.ensure_connection()
    operations = {
        "acquire": lambda: backend.acquire("rt", 10_000),
        "contended acquire": lambda: backend.acquire("rt", 10_000),
        "is_locked": lambda: backend.is_locked("rt"),
        "lookup by key": lambda: backend.lookup(key="rt"),
        "lookup by id": lambda: backend.lookup(lock_id=held.lock_id),
        "extend": lambda: backend.extend(held.lock_id, 10_000),
        "release": lambda: backend.release(held.lock_id),
        "failed release": lambda: backend.release(held.lock_id),
    }
    counts = {}
    held = None
    for name, operation in operations.items():
        with CaptureQueriesContext(conn) as queries:
            outcome = operation()
        if held is None:
            held = outcome
        counts[name] = len(queries)
    assert counts == dict.fromkeys(operations, 1)


@on_postgres
def test_a_release_alone_commits_without_waiting_for_the_wal_flush(pg):
    backend = pg.backend

    def durable(cursor):  # the test server runs with synchronous_commit=off: undo it
        cursor.execute("SET synchronous_commit = on")

    def setting(cursor):
        cursor.execute("SHOW synchronous_commit")
        return cursor.fetchone()[0]

    backend.connections.run(durable)
    held = backend.acquire("async-release", 10_000)
    conn = backend.connection()
    with CaptureQueriesContext(conn) as queries:
        assert backend.release(held.lock_id).ok is True
    # One call of the four-argument function (0009), which sets the 'off' itself,
    # first; a release that grants sets it back on inside the function
    # (tests/test_database_wakeups.py, durability of a granting release).
    assert len(queries) == 1
    assert queries[0]["sql"].startswith("SELECT * FROM syncguard_release(")
    # Local to the release's transaction: the same connection's next statements
    # (acquires, extends) commit durably.
    assert backend.connections.run(setting) == "on"
    assert backend.acquire("async-release", 10_000).ok is True


@on_postgres
def test_acquire_statement_is_the_installed_function(pg):
    conn = pg.backend.connection()
    with CaptureQueriesContext(conn) as queries:
        pg.backend.acquire("fn", 10_000)
    assert queries[0]["sql"].startswith("SELECT * FROM syncguard_acquire(")


@on_postgres
def test_migration_leaves_only_the_needed_indexes(pg):
    with pg.backend.connection().cursor() as cursor:
        cursor.execute(
            "SELECT tablename, indexname FROM pg_indexes WHERE tablename IN "
            "('syncguard_locks', 'syncguard_fence_counters', 'syncguard_waiters') ORDER BY 1, 2"
        )
        rows = cursor.fetchall()
    assert [table for table, _ in rows] == [
        "syncguard_fence_counters",
        "syncguard_locks",
        "syncguard_locks",
        "syncguard_locks",
        "syncguard_waiters",  # its primary key (key, ticket_id) only
    ]
    names = [name for _, name in rows]
    assert "syncguard_locks_expires_idx" in names
    assert not [n for n in names if n.endswith("_like")]


# ----------------------------------------------- independence from transactions
class PaymentFailed(Exception):
    pass


def take_lock_then_roll_back(harness, database, *, write_first):
    """In one transaction of ``database``: write a row, take a lock, see it from
    elsewhere, then fail. Returns the lock's result."""
    other = observer(database)
    with transaction.atomic(using=database):
        if write_first:  # PostgreSQL: the lock is independent even after a write
            Account.objects.using(database).create(name="inside")
        result = harness.backend.acquire("invoice:1", 60_000)
        if not write_first:  # SQLite: one writer at a time, so lock before writing
            Account.objects.using(database).create(name="inside")
        assert other.is_locked("invoice:1") is True  # visible at once, before any commit
        other.close()
        raise PaymentFailed(result)


@pytest.mark.parametrize(
    ("harness_cls", "database", "write_first"),
    [(SqliteHarness, "default", False), (PostgresHarness, "postgres", True)],
    ids=["sqlite", "postgres"],
)
@pytest.mark.django_db(transaction=True, databases=["default", "postgres"])
def test_lock_taken_inside_atomic_survives_rollback(harness_cls, database, write_first):
    harness = harness_cls()
    with pytest.raises(PaymentFailed) as failed:
        take_lock_then_roll_back(harness, database, write_first=write_first)
    result = failed.value.args[0]
    assert Account.objects.using(database).filter(name="inside").exists() is False
    assert observer(database).is_locked("invoice:1") is True  # not rolled back
    assert harness.backend.release(result.lock_id).ok is True
    assert harness.backend.acquire("invoice:1", 1_000).fence == "000000000000002"
    harness.close()


@on_sqlite
def test_sqlite_lock_after_a_write_in_the_same_transaction_fails_at_once():
    # SQLite has one writer at a time: a transaction that has already written holds
    # the database until it ends, so a lock taken after that write could only wait for
    # the transaction that waits for it. It fails after a short wait (not the whole
    # operation timeout) with a message that says what to do (take the lock first,
    # as @locked on a view does). See test_sqlite_transactions.py.
    backend = DatabaseBackend("long", {"OPTIONS": {"OPERATION_TIMEOUT_MS": 60_000}})
    with transaction.atomic(using="default"):
        Account.objects.create(name="first")
        with pytest.raises(ServiceUnavailable) as caught:
            backend.acquire("invoice:9", 1_000)
    backend.close()
    assert str(caught.value) == BLOCKED_BY_CALLER.format(database="default")
    assert isinstance(caught.value.__cause__, NetworkTimeout)
    assert observer("default").is_locked("invoice:9") is False


@on_sqlite
def test_sqlite_first_lock_of_a_process_after_a_write_fails_at_once_too(children):
    # The backend is built by its first use, here inside a transaction that has
    # written already. The watch of the application's transactions is in place from
    # the app's ready() (prepare_process), so that write is seen: without it, the
    # call waited out the whole busy timeout and raised NetworkTimeout.
    reports = children.ctx.Queue()
    databases = {"default": dict(connections["default"].settings_dict)}
    children.start(transaction_workers.first_lock_of_the_process_after_a_write, databases, reports)
    built_before, outcome = reports.get(timeout=60)
    children.join()
    assert built_before is False
    blocked = BLOCKED_BY_CALLER.format(database="default")
    assert outcome == ("ServiceUnavailable", blocked, "NetworkTimeout")
    assert observer("default").is_locked("invoice:9") is False


@on_sqlite
def test_the_watch_leaves_the_application_s_execute_wrapper_to_end_with_its_block():
    # A connection opened inside Django's execute_wrapper() block (a query-logging
    # middleware's, on a request's new connection): the block's end pops the last
    # wrapper, which must be the application's, not the watch added as it connected.
    watch_transaction_writes("default")
    logged: list[str] = []

    def log(execute, sql, params, many, context):
        logged.append(sql)
        return execute(sql, params, many, context)

    def request() -> list[str]:
        connection = connections["default"]  # this thread's: not connected yet
        try:
            with connection.execute_wrapper(log):
                connection.cursor().execute("SELECT 1")
            connection.cursor().execute("SELECT 2")  # after the block: not logged
            return [type(w).__name__ for w in connection.execute_wrappers]
        finally:
            connection.close()

    with ThreadPoolExecutor(1) as pool:
        wrappers = pool.submit(request).result(timeout=60)
    assert wrappers == [_WriteWatch.__name__]
    assert logged == ["SELECT 1"]


@pytest.mark.django_db(transaction=True, databases=["default", "postgres"])
def test_atomic_requests_view(client, settings, monkeypatch, pg):
    monkeypatch.setitem(connections["postgres"].settings_dict, "ATOMIC_REQUESTS", True)
    settings.SYNCGUARD_BACKENDS = {"default": {"BACKEND": DB, "OPTIONS": {"DATABASE": "postgres"}}}

    with pytest.raises(RuntimeError, match="payment provider failed"):
        client.post("/atomic/invoices/3/pay/?fail=1")
    # The view's write was rolled back with its request; its lock and fence were not.
    assert Account.objects.using("postgres").filter(name="paid-3").exists() is False
    assert pg.backend.is_locked("invoice:3") is False  # released by the decorator

    ok = client.post("/atomic/invoices/3/pay/").json()
    assert ok == {"fence": "000000000000002", "visible_elsewhere": True, "in_atomic": True}
    assert Account.objects.using("postgres").get(name="paid-3").fence == "000000000000002"


# ------------------------------------------------------------- dead servers
def test_refused_connection_is_service_unavailable(django_db_blocker):
    backend = DatabaseBackend("dead", {"OPTIONS": {"DATABASE": "dead"}})
    with django_db_blocker.unblock():
        for call in (
            lambda: backend.acquire("k", 1_000),
            lambda: backend.release(generate_lock_id()),
            lambda: backend.is_locked("k"),
        ):
            with pytest.raises(ServiceUnavailable) as caught:
                call()
            assert "'dead'" in str(caught.value)
            assert isinstance(caught.value.__cause__, Exception)
    backend.close()


def test_silent_server_times_out_at_the_connect_timeout(django_db_blocker, monkeypatch):
    # A socket that accepts TCP connections and never answers: a hung server.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    monkeypatch.setitem(connections["dead"].settings_dict, "PORT", str(silent.getsockname()[1]))
    backend = DatabaseBackend(
        "silent", {"OPTIONS": {"DATABASE": "dead", "CONNECT_TIMEOUT_MS": 2_000}}
    )
    started = time.monotonic()
    with django_db_blocker.unblock(), pytest.raises(NetworkTimeout, match="timeout expired"):
        backend.acquire("k", 1_000)
    assert time.monotonic() - started < 30  # bounded: no hang
    backend.close()
    silent.close()


# ------------------------------------------------------------- error mapping
@pytest.mark.parametrize(
    ("sqlstate", "expected"),
    [
        ("57014", NetworkTimeout),  # statement_timeout
        ("55P03", NetworkTimeout),  # lock_timeout
        ("57P01", ServiceUnavailable),  # admin shutdown
        ("08006", ServiceUnavailable),  # connection failure
        ("53300", RateLimited),  # too many connections
        ("53100", ServiceUnavailable),  # disk full
        ("28P01", AuthFailed),  # wrong password
        ("42501", AuthFailed),  # insufficient privilege
        ("40P01", ServiceUnavailable),  # deadlock
        ("22001", InvalidArgument),  # string data right truncation
        ("23505", InvalidArgument),  # unique violation
        ("42P01", Internal),  # undefined table
        ("XX000", Internal),  # internal error
    ],
)
def test_postgres_errors_map_by_sqlstate(sqlstate, expected):
    psycopg = import_extra("psycopg", "postgres")
    driver_error = psycopg.errors.lookup(sqlstate)("server said no")
    error = map_database_error(driver_error, "postgres")
    assert type(error) is expected
    assert error.context["cause"] is driver_error


def test_missing_tables_say_how_to_fix_them():
    psycopg = import_extra("psycopg", "postgres")
    error = map_database_error(
        sqlite3.OperationalError("no such table: syncguard_locks"), "default"
    )
    assert type(error) is Internal
    assert "migrate django_syncguard --database default" in str(error)
    pg_error = map_database_error(psycopg.errors.lookup("42883")("no function"), "postgres")
    assert "migrate django_syncguard --database postgres" in str(pg_error)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("database is locked", NetworkTimeout),
        ("unable to open database file", ServiceUnavailable),
        ("disk I/O error", ServiceUnavailable),
        ("something new", Internal),
    ],
)
def test_sqlite_errors_map_by_message(message, expected):
    assert type(map_database_error(sqlite3.OperationalError(message), "default")) is expected


# ------------------------------------------------------------------ cleanup
@pytest.mark.parametrize(
    "harness_cls", [SqliteHarness, PostgresHarness], ids=["sqlite", "postgres"]
)
@pytest.mark.django_db(transaction=True, databases=["default", "postgres"])
def test_cleanup_in_is_locked_deletes_long_expired_records_only(harness_cls):
    harness = harness_cls(CLEANUP_IN_IS_LOCKED=True)
    backend = harness.backend
    backend.acquire("old", 1_000)
    backend.acquire("recent", 1_000)
    harness.advance(1_000 + 1_500)  # both expired; 1500 ms past expiry is inside the guard
    assert backend.is_locked("recent") is False
    assert stored_keys(backend) == ["old", "recent"]
    harness.advance(1_000)  # 2500 ms past expiry: beyond the 2000 ms guard
    assert backend.is_locked("old") is False
    assert stored_keys(backend) == ["recent"]
    assert backend.acquire("old", 1_000).fence == "000000000000002"  # counter survived
    harness.close()


@on_postgres
def test_is_locked_never_writes_without_cleanup(pg):
    pg.backend.acquire("k", 1_000)
    pg.advance(60_000)
    assert pg.backend.is_locked("k") is False
    assert stored_keys(pg.backend) == ["k"]


def stored_keys(backend: DatabaseBackend) -> list[str]:
    with backend.connection().cursor() as cursor:
        cursor.execute("SELECT key FROM syncguard_locks ORDER BY key")
        return [row[0] for row in cursor.fetchall()]


# ------------------------------------------------------------- long keys
@pytest.mark.parametrize(
    "harness_cls", [SqliteHarness, PostgresHarness], ids=["sqlite", "postgres"]
)
@pytest.mark.django_db(transaction=True, databases=["default", "postgres"])
def test_keys_are_stored_as_is_and_raw_key_is_kept(harness_cls):
    harness = harness_cls()
    key = "é" * 256  # 512 bytes: within the 1700-byte budget, stored as is
    result = harness.backend.acquire(key, 10_000)
    assert stored_keys(harness.backend) == [key]
    assert harness.backend.lookup_raw(lock_id=result.lock_id).key == key
    harness.close()


# ------------------------------------------------------------------ cancel
class CancelOnSecondCheck:
    """Not set when the base class checks before I/O; set at the next check."""

    def __init__(self):
        self.checks = 0

    def is_set(self):
        self.checks += 1
        return self.checks > 1


@on_sqlite
def test_sqlite_acquire_checks_cancel_before_writing(lite):
    cancel = CancelOnSecondCheck()
    with pytest.raises(Aborted):
        lite.backend.acquire("k", 1_000, cancel=cancel)
    assert cancel.checks == 2
    assert lite.backend.is_locked("k") is False
    assert lite.backend.acquire("k", 1_000).fence == "000000000000001"  # nothing written


# ----------------------------------------------------------- configuration
def test_unsupported_vendor_is_refused():
    expected = r"is a 'unknown' database, .* does not support \(supported: postgresql, sqlite\)"
    with pytest.raises(InvalidArgument, match=expected):
        DatabaseBackend("x", {"OPTIONS": {"DATABASE": "unsupported"}})


def test_unknown_database_alias_is_refused():
    with pytest.raises(InvalidArgument, match="'nope' is not an alias of DATABASES"):
        DatabaseBackend("x", {"OPTIONS": {"DATABASE": "nope"}})


# No django_db mark: any attempt to reach a database fails these tests (no I/O).
@pytest.mark.parametrize(
    ("database", "check_id"), [("unsupported", "syncguard.E004"), ("nope", "syncguard.E005")]
)
def test_check_settings_reports_what_the_constructor_refuses(settings, database, check_id):
    params = {"BACKEND": DB, "OPTIONS": {"DATABASE": database}}
    settings.SYNCGUARD_BACKENDS = {"locks": params}
    [error] = DatabaseBackend.check_settings("locks", params)
    assert error.id == check_id
    assert error.level == checks.ERROR
    assert error.msg.startswith("Lock backend 'locks': ")
    # The same message, hint and id as the app's system check reports today (other
    # messages, about @locked functions other tests registered, are not compared).
    assert [error] == [m for m in syncguard_checks.check_backends() if m.id == check_id]
    with pytest.raises(InvalidArgument):
        DatabaseBackend("locks", params)


@pytest.mark.parametrize(
    "options",
    [None, {}, {"DATABASE": "postgres"}, {"DATABASE": 1}, {"DATABASE": ""}, ["DATABASE"]],
)
def test_check_settings_leaves_other_problems_to_construction(options):
    assert DatabaseBackend.check_settings("locks", {"BACKEND": DB, "OPTIONS": options}) == []


def test_check_settings_leaves_an_unloadable_engine_to_construction(monkeypatch):
    monkeypatch.setitem(connections.settings, "broken", {"ENGINE": "no_such_engine_for_syncguard"})
    params = {"BACKEND": DB, "OPTIONS": {"DATABASE": "broken"}}
    assert DatabaseBackend.check_settings("locks", params) == []
    with pytest.raises(ImproperlyConfigured, match="no_such_engine_for_syncguard"):
        DatabaseBackend("locks", params)


def test_private_connection_settings():
    backend = DatabaseBackend(
        "x",
        {
            "OPTIONS": {
                "DATABASE": "postgres",
                "CONNECT_TIMEOUT_MS": 3_500,
                "OPERATION_TIMEOUT_MS": 1_200,
            }
        },
    )
    settings_dict = backend.connection().settings_dict
    assert settings_dict["AUTOCOMMIT"] is True
    assert settings_dict["ATOMIC_REQUESTS"] is False
    assert settings_dict["OPTIONS"]["connect_timeout"] == 4
    assert "-c statement_timeout=1200" in settings_dict["OPTIONS"]["options"]
    assert "-c lock_timeout=1200" in settings_dict["OPTIONS"]["options"]
    assert backend.connection() is not connections["postgres"]


def test_each_thread_gets_its_own_connection():
    backend = DatabaseBackend("x", {"OPTIONS": {"DATABASE": "default"}})
    seen = []
    thread = threading.Thread(target=lambda: seen.append(backend.connection()))
    thread.start()
    thread.join()
    assert seen[0] is not backend.connection()
    assert backend.connection() is backend.connection()
    backend.close()


# ------------------------------------------------------------------ restarts
@pytest.mark.slow
@on_postgres
def test_fences_survive_a_restart_and_the_backend_reconnects(pg, postgres_server):
    first = pg.backend.acquire("k", 60_000)
    assert pg.backend.release(first.lock_id).ok
    wrapper = pg.backend.connection()
    before = wrapper.connection
    postgres_server.restart()
    connections["postgres"].close()  # the test runner's own connection died too
    # The server ended the connection the backend held; the next call sees that
    # before sending and reconnects, so it succeeds on a new connection.
    second = pg.backend.acquire("k", 60_000)
    assert second.fence == "000000000000002"
    assert wrapper.connection is not None and wrapper.connection is not before


@pytest.mark.parametrize(
    ("peer_does", "gone"),
    [
        ("nothing", False),
        ("closes", True),
        ("resets", True),
        ("sends a FATAL error and closes", True),
        ("sends a notice", False),
        ("sends a TLS close alert", True),
        ("sends TLS application data", False),
    ],
)
def test_an_idle_connection_is_gone_only_when_its_peer_ended_it(peer_does, gone):
    # A real loopback TCP connection: ``ours`` is what a driver connection holds.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ours = socket.create_connection(listener.getsockname())
        peer, _ = listener.accept()
    with ours, peer:
        if peer_does == "closes":
            peer.close()
        elif peer_does == "resets":  # SO_LINGER on, zero seconds: close sends RST
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            peer.close()
        elif peer_does == "sends a FATAL error and closes":
            peer.sendall(b"E\x00\x00\x00\x10SFATAL\x00C57P01\x00\x00")
            peer.close()
        elif peer_does == "sends a notice":
            peer.sendall(b"N\x00\x00\x00\x04")
        elif peer_does == "sends a TLS close alert":
            peer.sendall(b"\x15\x03\x03\x00\x02\x01\x00")
        elif peer_does == "sends TLS application data":
            peer.sendall(b"\x17\x03\x03\x00\x01\x00")
        assert idle_connection_is_gone(ours) is gone
        # The peek consumed nothing: the driver still reads whatever arrived.
        if peer_does == "sends a notice":
            assert ours.recv(16) == b"N\x00\x00\x00\x04"


def _trace_batches(trace_text: str) -> list[tuple[str, list[str], str]]:
    """A libpq trace (without timestamps) as batches of consecutive messages in one
    direction: (``"F"`` for the client or ``"B"`` for the server, the message names,
    the batch's first line)."""
    batches: list[tuple[str, list[str], str]] = []
    for line in trace_text.splitlines():
        direction, _, rest = line.partition("\t")
        if direction not in ("F", "B") or rest.count("\t") < 1:
            continue  # a binary parameter's byte 0x0a split a Bind line
        name = rest.split("\t")[1]
        if batches and batches[-1][0] == direction:
            batches[-1][1].append(name)
        else:
            batches.append((direction, [name], line))
    return batches


def _traced(pgconn: Any, path: Any, work: Callable[[], None]) -> list[tuple[str, list[str], str]]:
    psycopg = import_extra("psycopg", "postgres")
    with path.open("w") as out:
        pgconn.trace(out.fileno())
        pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            work()
        finally:
            pgconn.untrace()
    return _trace_batches(path.read_text(errors="replace"))


@on_postgres
def test_each_operation_is_one_round_trip_on_the_wire(pg, tmp_path):
    # Production path (no query logging): a libpq protocol trace of what the client
    # sent (F) and the server answered (B). One round trip is one batch of client
    # messages ending in Sync, then the server's reply ending in ReadyForQuery.
    backend = pg.backend
    wrapper = backend.connection()
    wrapper.ensure_connection()
    assert backend.connections.direct(wrapper) is True

    def operations() -> None:
        held = backend.acquire("wire", 10_000)
        backend.acquire("wire", 10_000)
        backend.is_locked("wire")
        backend.lookup(key="wire")
        backend.lookup(lock_id=held.lock_id)
        backend.extend(held.lock_id, 10_000)
        backend.release(held.lock_id)
        backend.release(held.lock_id)

    batches = _traced(wrapper.connection.pgconn, tmp_path / "libpq.trace", operations)
    # Eight operations: eight client batches, each answered once, never a second
    # exchange (no separate BEGIN, COMMIT or re-query).
    assert [d for d, _, _ in batches] == ["F", "B"] * 8
    assert all(m == ["Parse", "Bind", "Describe", "Execute", "Sync"] for _, m, _ in batches[::2])
    assert all(m[-1] == "ReadyForQuery" for _, m, _ in batches[1::2])
    functions = [
        next(
            (
                f
                for f in ("syncguard_acquire", "syncguard_extend", "syncguard_release")
                if f in first
            ),
            "select",
        )
        for _, _, first in batches[::2]
    ]
    assert functions == [
        "syncguard_acquire",
        "syncguard_acquire",
        "select",
        "select",
        "select",
        "syncguard_extend",
        "syncguard_release",
        "syncguard_release",
    ]


@on_postgres
def test_statements_are_prepared_when_the_alias_asks_for_it(pg, monkeypatch, tmp_path):
    # Django's own switch, OPTIONS["prepare_threshold"] on the DATABASES alias, is
    # what the backend's private connection follows: with 0, each lock statement is
    # parsed and planned once per connection and afterwards only bound and run.
    options = {**connections["postgres"].settings_dict["OPTIONS"], "prepare_threshold": 0}
    monkeypatch.setitem(connections["postgres"].settings_dict, "OPTIONS", options)
    backend = DatabaseBackend("prepared", {"OPTIONS": {"DATABASE": "postgres"}})
    try:
        wrapper = backend.connection()
        wrapper.ensure_connection()

        def cycles() -> None:
            for n in range(3):
                held = backend.acquire(f"prepared:{n}", 10_000)
                assert held.ok
                assert backend.release(held.lock_id).ok

        batches = _traced(wrapper.connection.pgconn, tmp_path / "libpq.trace", cycles)
        kinds = [names for direction, names, _ in batches if direction == "F"]
        prepare = ["Parse", "Sync"]
        prepared = ["Bind", "Describe", "Execute", "Sync"]
        # psycopg prepares a statement in a round trip of its own, once per connection:
        # acquire and release are each prepared on first use, then only bound and run.
        assert kinds == [prepare, prepared, prepare, prepared] + [prepared] * 4
    finally:
        backend.close()


@on_postgres
def test_a_finished_threads_connection_is_closed(pg):
    backend = pg.backend
    opened = []

    def work():
        backend.is_locked("k")
        opened.append(backend.connection())

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    wrapper = opened.pop()
    assert wrapper.connection is not None  # open while the thread object exists
    del thread
    gc.collect()
    assert wrapper.connection is None  # closed once the thread is gone


@on_postgres
def test_close_closes_connections_of_other_threads(pg):
    backend = pg.backend
    opened = []
    done, finish = threading.Event(), threading.Event()

    def work():
        backend.is_locked("k")
        opened.append(backend.connection())
        done.set()
        finish.wait(10)

    thread = threading.Thread(target=work)
    thread.start()
    done.wait(10)
    backend.close()
    assert opened[0].connection is None
    finish.set()
    thread.join()


# ------------------------------------------------------- fence continuity
TTL = 60_000
both_databases = pytest.mark.parametrize(
    "harness_cls", [SqliteHarness, PostgresHarness], ids=["sqlite", "postgres"]
)
on_both = pytest.mark.django_db(transaction=True, databases=["default", "postgres"])


def take(backend: DatabaseBackend, key: str) -> int:
    """Acquire and release ``key``; its fence as an int."""
    result = backend.acquire(key, TTL)
    assert result.ok, result
    assert backend.release(result.lock_id).ok is True
    return int(result.fence)


def counters(backend: DatabaseBackend) -> dict[str, tuple[int, bool]]:
    """Every row of syncguard_fence_counters: fence, and whether it has an acquisition
    time."""
    with backend.connection().cursor() as cursor:
        cursor.execute("SELECT fence_key, fence, acquired_at_ms FROM syncguard_fence_counters")
        return {key: (int(fence), at is not None) for key, fence, at in cursor.fetchall()}


def test_no_key_can_have_the_floor_rows_name():
    # A fence key is "fence:" + storage key, or, when that would be over 1700 bytes,
    # the bare 22-character base64url hash (no colon): never "syncguard:floor".
    for key in ("syncguard:floor", "floor", ":floor", "fence:syncguard:floor", "x" * 512):
        assert DatabaseBackend.storage_keys(key).fence_key == f"fence:{key}"
    for size in (1694, 1695, 1700, 1701):
        fence_key = fence_key_of("", "k" * size, 1700, 0)
        if size < 1695:
            assert fence_key == "fence:" + "k" * size
        else:
            assert len(fence_key) == 22 and ":" not in fence_key
    assert FLOOR_KEY == "syncguard:floor"


@both_databases
@on_both
def test_the_floor_row_is_never_a_counter(harness_cls):
    h = harness_cls()
    try:
        backend = h.backend
        assert backend.raise_fence_floor(50) == 50
        assert take(backend, "a") == 51
        h.advance(10_000)
        assert counters(backend) == {"syncguard:floor": (50, False), "fence:a": (51, True)}

        idle, cursor = backend._idle_counters(backend.now_ms(), None, 10, stamp=True)
        assert [(c.name, c.fence) for c in idle] == [("fence:a", 51)] and cursor is None
        assert backend.fence_state() == FenceState(backend.alias, "counter", 50, 51)
        assert sum(backend.compact_fences(idle_ms=5_000)) == 1

        # Raised by compaction to the fence it deleted; never stamped, listed or deleted.
        assert counters(backend) == {"syncguard:floor": (51, False)}
        assert backend._idle_counters(backend.now_ms(), None, 10, stamp=True) == ([], None)
        assert backend.fence_state() == FenceState(backend.alias, "counter", 51, 0)
        assert sum(backend.compact_fences(idle_ms=0)) == 0
        assert take(backend, "a") == 52
    finally:
        h.close()


@both_databases
@on_both
def test_a_counter_with_a_hashed_fence_key_is_never_compacted(harness_cls):
    # Its key's lock row cannot be found from the hash (specs/backends/database.md,
    # Fence continuity); no key of 512 bytes or less makes one.
    h = harness_cls()
    try:
        hashed = fence_key_of("", "k" * 1696, 1700, 0)
        h.execute(
            "INSERT INTO syncguard_fence_counters (fence_key, fence, acquired_at_ms) "
            "VALUES (%s, 7, %s)",
            [hashed, h.now_ms()],
        )
        h.advance(10_000)
        assert list(h.backend.compact_fences(idle_ms=5_000, dry_run=True)) == [0]
        assert sum(h.backend.compact_fences(idle_ms=5_000)) == 0
        assert counters(h.backend) == {hashed: (7, True)}
        assert h.backend.fence_state().highest == 7
    finally:
        h.close()


@both_databases
@on_both
def test_a_counter_whose_key_has_a_waiter_is_kept(harness_cls):
    h = harness_cls()
    try:
        backend = h.backend
        held = backend.acquire("queued", TTL)
        ticket = WaitTicket(generate_lock_id(), 60_000)
        if backend.grants:
            # The release grants the key (fence 2) to a first waiter, which never
            # claims it (its process is gone): the grant lapses, and ``ticket`` is the
            # waiter still queued.
            gone = WaitTicket(generate_lock_id(), 60_000)
            assert backend.acquire("queued", TTL, ticket=gone).queue_position == 0
        position = backend.acquire("queued", TTL, ticket=ticket).queue_position
        assert position == (1 if backend.grants else 0)
        assert backend.release(held.lock_id).ok
        h.advance(10_000)  # the counter is old, the ticket still live

        assert sum(backend.compact_fences(idle_ms=5_000)) == 0

        taken = backend.acquire("queued", TTL, ticket=ticket)  # the waiter's turn
        assert taken.fence == ("000000000000003" if backend.grants else "000000000000002")
        assert backend.release(taken.lock_id).ok
        h.advance(10_000)
        assert sum(backend.compact_fences(idle_ms=5_000)) == 1
        assert take(backend, "queued") == (4 if backend.grants else 3)
    finally:
        h.close()


def state(backend: DatabaseBackend) -> tuple[str, int, int]:
    fence_state = backend.fence_state()
    return fence_state.mode, fence_state.floor, fence_state.highest


def fence_script(h: SqliteHarness | PostgresHarness) -> list[Any]:
    """One sequence of acquisitions, floor raises and compactions; what each step
    answered (acquisition times only as present or not: the clocks differ)."""
    backend = h.backend
    seen: list[Any] = [take(backend, "s:a"), take(backend, "s:a"), take(backend, "s:b")]
    h.set_fence("s:legacy", 30)  # no acquisition time, as before 0006
    seen += [backend.raise_fence_floor(5), backend.raise_fence_floor(2), take(backend, "s:c")]
    held = backend.acquire("s:held", TTL)
    seen.append(int(held.fence))
    h.advance(10_000)
    seen.append(take(backend, "s:recent"))
    seen.append(list(backend.compact_fences(idle_ms=5_000, dry_run=True)))
    seen.append(list(backend.compact_fences(idle_ms=5_000, batch_size=2)))
    seen += [state(backend), counters(backend)]
    h.advance(10_000)
    seen.append(list(backend.compact_fences(idle_ms=5_000, batch_size=2)))
    seen += [take(backend, "s:a"), take(backend, "s:legacy"), take(backend, "s:recent")]
    assert backend.release(held.lock_id).ok
    seen += [take(backend, "s:held"), state(backend), counters(backend)]
    return seen


@on_both
def test_postgres_and_sqlite_answer_a_fence_script_alike():
    expected = [
        1,
        2,
        1,
        5,
        5,
        6,  # above the floor
        6,
        6,
        [3],  # s:a, s:b, s:c (legacy: no time; held: live; recent: new)
        [2, 1],  # pages [a, b] and [c, held]; [legacy (stamped), recent] has none
        ("counter", 6, 30),
        {
            "fence:s:held": (6, True),
            "fence:s:legacy": (30, True),  # stamped
            "fence:s:recent": (6, True),
            "syncguard:floor": (6, False),
        },
        [1, 1],  # legacy (floor to 30), then recent; held is still live
        31,
        31,
        31,
        31,  # s:held's counter is 6, the floor 30
        ("counter", 30, 31),
        {
            "fence:s:a": (31, True),
            "fence:s:held": (31, True),
            "fence:s:legacy": (31, True),
            "fence:s:recent": (31, True),
            "syncguard:floor": (30, False),
        },
    ]
    answers = {}
    for harness_cls in (SqliteHarness, PostgresHarness):
        h = harness_cls()
        try:
            answers[h.name] = fence_script(h)
        finally:
            h.close()
    assert answers == {"sqlite": expected, "postgres": expected}


def blocked_by(backend: DatabaseBackend, pid: int) -> list[str]:
    """Wait until a statement waits for a lock that the PostgreSQL session ``pid``
    holds; the statements waiting. (The server shows it; nothing else can.)"""
    deadline = time.monotonic() + 10
    with backend.connection().cursor() as cursor:
        while True:
            cursor.execute(
                "SELECT query FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
                [pid],
            )
            waiting = [row[0] for row in cursor.fetchall()]
            if waiting or time.monotonic() > deadline:
                return waiting
            time.sleep(0.005)


@on_postgres
def test_a_counter_deleted_under_an_acquire_never_repeats_a_fence(pg):
    # Compaction's delete runs without the key's advisory lock, so it can remove the
    # counter that syncguard_acquire has read and not yet written. Here the delete
    # (compaction's own statement) holds the row in an open transaction while an
    # acquire reaches its counter write, and commits only then. The acquire's upsert
    # inserts the counter again; an UPDATE would have written nothing and the next
    # acquire, starting from the floor (1), would hand out 2 again.
    backend = pg.backend
    assert take(backend, "raced") == 1
    pg.advance(10_000)
    cutoff = backend.now_ms() - 5_000
    assert backend.raise_fence_floor(1) == 1  # compaction's first step
    with ThreadPoolExecutor(1) as pool:
        with transaction.atomic(using="postgres"), connections["postgres"].cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            (pid,) = cursor.fetchone()
            cursor.execute(DELETE_IDLE, [["fence:raced"], [1], cutoff, TIME_TOLERANCE_MS])
            assert cursor.rowcount == 1
            acquiring = pool.submit(backend.acquire, "raced", TTL)
            waiting = blocked_by(backend, pid)
            assert len(waiting) == 1 and "syncguard_acquire" in waiting[0]
        acquired = acquiring.result(timeout=10)
    assert acquired.fence == "000000000000002"
    assert backend.release(acquired.lock_id).ok
    assert take(backend, "raced") == 3
    assert counters(backend) == {"syncguard:floor": (1, False), "fence:raced": (3, True)}


@on_postgres
def test_compaction_waits_for_an_acquire_under_way_and_keeps_its_counter(pg):
    # The other order: an acquire has written the counter and not committed. The
    # page read the counter as it was (idle), the delete waits for the acquire's row
    # lock, then finds the fence moved and leaves the row.
    backend = pg.backend
    assert take(backend, "busy") == 1
    pg.advance(10_000)
    keys = DatabaseBackend.storage_keys("busy")
    lock_id = generate_lock_id()
    params = [keys.storage_key, keys.fence_key, lock_id, TTL, None, FENCE_MAX]
    # (0007: the owner label; 0008: the grant window, none without a ticket; 0009: the
    # process channel, none either, and whether a grant it makes is watched)
    params += [TIME_TOLERANCE_MS, None, None, False, None, None, None, False]
    with ThreadPoolExecutor(1) as pool:
        with transaction.atomic(using="postgres"), connections["postgres"].cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            (pid,) = cursor.fetchone()
            cursor.execute(ACQUIRE, params)
            assert cursor.fetchone()[:2] == (1, 2)
            compacting = pool.submit(lambda: sum(backend.compact_fences(idle_ms=5_000)))
            waiting = blocked_by(backend, pid)
            assert len(waiting) == 1 and "DELETE FROM syncguard_fence_counters" in waiting[0]
        assert compacting.result(timeout=10) == 0
    assert backend.fence_state() == FenceState(backend.alias, "counter", 1, 2)
    assert backend.release(lock_id).ok
    assert take(backend, "busy") == 3


@on_postgres
def test_the_acquire_of_code_before_0006_applies_the_floor(pg):
    # A rolling deploy: processes still on 0005's code call the nine- (and 0002's
    # seven-) argument function, which 0006 made a wrapper of the new one in counter
    # mode: above the floor, counter upserted, acquisition time recorded.
    backend = pg.backend
    assert backend.raise_fence_floor(40) == 40
    with backend.connection().cursor() as cursor:
        cursor.execute(
            "SELECT * FROM syncguard_acquire('old9', 'fence:old9', %s, 1000, NULL, %s, 1000, "
            "NULL, NULL)",
            [generate_lock_id(), FENCE_MAX],
        )
        assert cursor.fetchone()[:2] == (1, 41)
        cursor.execute(
            "SELECT * FROM syncguard_acquire('old7', 'fence:old7', %s, 1000, NULL, %s, 1000)",
            [generate_lock_id(), FENCE_MAX],
        )
        assert cursor.fetchone()[:2] == (1, 41)
    assert counters(backend) == {
        "syncguard:floor": (40, False),
        "fence:old9": (41, True),
        "fence:old7": (41, True),
    }


@pytest.mark.slow
@both_databases
@on_both
def test_fences_keep_increasing_while_compaction_runs_flat_out(harness_cls):
    # Compaction with no idle time deletes every released counter it meets, in
    # batches, while three threads take and release their own key: on PostgreSQL its
    # statements fall anywhere inside the acquires (no advisory lock).
    # Halfway, each thread waits (keys released) until compaction has deleted
    # something: the second half then acquires over deleted counters, on any scheduling.
    h = harness_cls()
    stop = threading.Event()
    compacted = threading.Event()

    def compact() -> int:
        deleted = 0
        while not stop.is_set():
            deleted += sum(h.backend.compact_fences(idle_ms=0, batch_size=2))
            if deleted:
                compacted.set()
        return deleted

    def hammer(key: str) -> list[int]:
        fences = []
        for turn in range(150):
            if turn == 75:
                assert compacted.wait(timeout=60), "compaction deleted nothing in 60 s"
            result = h.backend.acquire(key, TTL)
            assert result.ok, result
            fences.append(int(result.fence))
            assert h.backend.release(result.lock_id).ok
        return fences

    try:
        with ThreadPoolExecutor(4) as pool:
            compacting = pool.submit(compact)
            taking = {key: pool.submit(hammer, key) for key in ("flat:1", "flat:2", "flat:3")}
            try:
                seen = {key: future.result(timeout=120) for key, future in taking.items()}
            finally:
                stop.set()
            deleted = compacting.result(timeout=60)
        for key, fences in seen.items():
            assert fences == sorted(set(fences)), f"{key} went back or repeated: {fences}"
        assert deleted > 0
    finally:
        h.close()


# ------------------------------------------------------------ database routers
class EverythingToSqlite:
    """A router that sends every read and write, of every model, to "default" (the
    SQLite test database): as a site that routes reads to a replica would, taken to
    the limit."""

    def db_for_read(self, model: Any, **hints: Any) -> str:
        return "default"

    def db_for_write(self, model: Any, **hints: Any) -> str:
        return "default"


@pytest.mark.django_db(transaction=True, databases=["postgres", "default"])
def test_routers_never_move_the_locks_off_their_configured_database(settings):
    # The backend talks to OPTIONS["DATABASE"] through connections of its own, never
    # through the ORM: DATABASE_ROUTERS cannot send a lock, or its read, elsewhere.
    settings.DATABASE_ROUTERS = [f"{__name__}.EverythingToSqlite"]
    backend = observer("postgres")
    try:
        result = backend.acquire("routed", 60_000)
        assert result.fence == "000000000000001"
        assert backend.lookup(lock_id=result.lock_id).fence == result.fence  # type: ignore[union-attr]
        with connections["postgres"].cursor() as cursor:
            cursor.execute("SELECT fence FROM syncguard_locks WHERE key = %s", ["routed"])
            assert cursor.fetchall() == [(result.fence,)]
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT count(*) FROM syncguard_locks")
            assert cursor.fetchall() == [(0,)]
        assert backend.release(result.lock_id).ok is True
    finally:
        backend.close()


# ------------------------------------------------------------------ grants (0008)
def granted(h: PostgresHarness, key: str) -> Any:
    """Hold ``key``, queue a waiter, release: the key is granted to the waiter (whose
    process never claims it). The granted lock, as a debug lookup sees it."""
    backend = h.backend
    held = backend.acquire(key, TTL)
    ticket = WaitTicket(generate_lock_id(), 60_000)
    assert backend.acquire(key, TTL, ticket=ticket).queue_position == 0
    assert backend.release(held.lock_id).ok
    info = backend.lookup_raw(key=key)
    assert info is not None and info.lock_id != held.lock_id
    return info


@on_postgres
def test_an_unclaimed_grant_is_gone_everywhere_at_its_claim_deadline(pg):
    backend = pg.backend
    info = granted(pg, "granted")
    assert info.fence == "000000000000002"
    # Lookups and lists show the expiry its holder was told, not the claim deadline.
    assert info.expires_at_ms - info.acquired_at_ms == TTL
    listed = backend.list_locks(prefix="granted").records
    assert [(r.lock_id, r.expires_at_ms) for r in listed] == [(info.lock_id, info.expires_at_ms)]
    assert backend.is_locked("granted")

    pg.advance(GRANT_WINDOW_MS)  # the window is over: no tolerance
    assert not backend.is_locked("granted")
    assert backend.lookup_raw(key="granted") is None
    assert backend.lookup_raw(lock_id=info.lock_id) is None
    assert backend.list_locks(prefix="granted").records == ()
    grant = Grant(info.lock_id, 2, info.expires_at_ms)
    assert backend.claim(grant) is False
    assert backend.extend(info.lock_id, TTL).reason == "expired"
    assert backend.release(info.lock_id).reason == "expired"
    assert take(backend, "granted") == 3  # fence 2 was burnt


@on_postgres
def test_a_claimed_grant_holds_to_its_ttl(pg):
    backend = pg.backend
    info = granted(pg, "claimed")
    grant = Grant(info.lock_id, 2, info.expires_at_ms)
    assert backend.claim(grant) is True
    assert backend.claim(grant) is True  # claimed already: still its holder's
    pg.advance(GRANT_WINDOW_MS + 10_000)
    assert backend.is_locked("claimed")
    after = backend.lookup_raw(key="claimed")
    assert after is not None
    assert after.expires_at_ms - after.acquired_at_ms == TTL  # aged alike
    assert backend.release(info.lock_id).ok
    assert backend.claim(grant) is False  # released: nothing to claim


@on_postgres
def test_an_extend_claims_a_grant(pg):
    backend = pg.backend
    info = granted(pg, "extended")
    assert backend.extend(info.lock_id, 5_000).ok
    pg.advance(GRANT_WINDOW_MS + 1_000)
    assert backend.is_locked("extended")
    # The late claim of the waiter's channel does not move the expiry back.
    assert backend.claim(Grant(info.lock_id, 2, info.expires_at_ms)) is True
    after = backend.lookup_raw(key="extended")
    assert after is not None  # still the extend's 5 s, not the grant's 60 s
    assert after.expires_at_ms - after.acquired_at_ms < 10_000


@on_postgres
def test_a_withdrawal_gives_a_grant_back_and_grants_the_next_waiter(pg):
    backend = pg.backend
    held = backend.acquire("handed", TTL)
    first = WaitTicket(generate_lock_id(), 60_000)
    second = WaitTicket(generate_lock_id(), 60_000)
    assert backend.acquire("handed", TTL, ticket=first).queue_position == 0
    assert backend.acquire("handed", TTL, ticket=second).queue_position == 1
    assert backend.release(held.lock_id).ok  # granted to first (fence 2)
    backend.withdraw("handed", first.id)  # first gives up: granted to second (fence 3)
    got = backend.acquire("handed", TTL, ticket=second)  # crosses the grant
    assert (got.ok, got.fence) == (True, "000000000000003")
    assert backend.lookup_raw(key="handed").lock_id == got.lock_id
    assert backend.release(got.lock_id).ok
    assert take(backend, "handed") == 4


@on_postgres
def test_a_grant_check_waits_for_the_window_then_grants_a_lapsed_grant_on(pg):
    """``syncguard_check_grant`` (0009), which the releasing process runs once its
    grant's window is over: not over yet by the server's clock, it says how long is
    left; a grant claimed, or a key that moved on, needs nothing; a grant that lapsed
    unclaimed is handed on to the next live waiter, whose ticket is reported when the
    caller watches that grant in turn."""
    backend = pg.backend
    held = backend.acquire("checked", TTL)
    first, second, third = (WaitTicket(generate_lock_id(), 60_000) for _ in range(3))
    for position, ticket in enumerate((first, second, third)):
        assert backend.acquire("checked", TTL, ticket=ticket).queue_position == position
    # Closed wake-ups watch nothing: no check of this process's runs behind the test's.
    backend.wake_ups.close()
    assert backend._grant_hook() is None
    assert backend.release(held.lock_id).ok  # granted to first (fence 2)
    storage_key = backend.storage_key("checked")

    status, left_ms, handed = backend.check_grant(storage_key, first.id, True)
    assert (status, handed) == (2, None)
    assert 0 < left_ms <= GRANT_WINDOW_MS
    assert backend.check_grant(storage_key, second.id, True) == (0, None, None)

    pg.advance(GRANT_WINDOW_MS)  # first's window is over, unclaimed
    assert backend.check_grant(storage_key, first.id, True) == (1, None, second.id)
    info = backend.lookup_raw(key="checked")
    assert info is not None and info.fence == "000000000000003"
    assert backend.check_grant(storage_key, first.id, True) == (0, None, None)  # moved on

    pg.advance(GRANT_WINDOW_MS)  # second's lapses too; unwatched, no ticket reported
    assert backend.check_grant(storage_key, second.id, False) == (1, None, None)
    got = backend.acquire("checked", TTL, ticket=third)  # crosses its grant: claimed
    assert (got.ok, got.fence) == (True, "000000000000004")
    pg.advance(GRANT_WINDOW_MS)
    assert backend.check_grant(storage_key, third.id, True) == (0, None, None)  # claimed
    assert backend.release(got.lock_id).ok
    assert take(backend, "checked") == 5
