"""Fixtures of the whole suite.

The test servers start in session fixtures, when the first test that needs one runs,
and stop (by their PID) at the end of the session: ``postgres_server``,
``redis_server``, ``redis_sentinel``, ``redis_cluster`` and ``firestore_emulator``. A
test gets its server by asking for the fixture, through the ``harness`` fixture, or,
for the ``postgres`` database alias, through its ``django_db`` marker. When ``CI`` is
set, a server that cannot start fails the tests that need it; elsewhere they are
skipped with the reason.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest
from django.conf import settings
from django.db import connections

from django_syncguard.backends.base import BaseLockBackend
from tests.support.harness import (
    HARNESS_DATABASES,
    HARNESS_SERVERS,
    HARNESSES,
    Harness,
    MemoryHarness,
    RedisClusterHarness,
    RedisHarness,
    RedisSentinelHarness,
)
from tests.support.processes import Children
from tests.support.servers import (
    FirestoreEmulator,
    InTempRoot,
    PgBouncerServer,
    PostgresServer,
    RedisClusterTopology,
    RedisSentinelTopology,
    RedisServer,
    start_or_skip,
)

Server = TypeVar(
    "Server",
    PostgresServer,
    RedisServer,
    FirestoreEmulator,
    PgBouncerServer,
    RedisSentinelTopology,
    RedisClusterTopology,
)


@contextmanager
def running(kind: str, server: Server) -> Iterator[Server]:
    """``server``, started, until the block ends; a failure to start skips the test
    that asked (fails it in CI)."""
    start_or_skip(server, kind)
    try:
        yield server
    finally:
        server.destroy()


def uses_postgres(item: pytest.Item) -> bool:
    """Whether the test's ``django_db`` marker names the ``postgres`` alias."""
    marker = item.get_closest_marker("django_db")
    databases = marker.kwargs.get("databases") if marker else None
    return databases == "__all__" or "postgres" in (databases or ())


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """The session's PostgreSQL; the ``postgres`` alias points at it while it runs."""
    with running("postgres", PostgresServer()) as server, pytest.MonkeyPatch.context() as patch:
        connection = connections["postgres"]
        for settings_dict in (settings.DATABASES["postgres"], connection.settings_dict):
            patch.setitem(settings_dict, "PORT", str(server.port))
        connection.close()  # one opened before had no server to go to
        yield server


@pytest.fixture(scope="session")
def pgbouncer(
    postgres_server: PostgresServer, django_db_setup: None, django_db_blocker: Any
) -> Iterator[PgBouncerServer]:
    """PgBouncer in transaction mode in front of the session's PostgreSQL, for the
    session. It starts after the test database exists (a test asks for it), so it
    stops before the database is dropped: its pooled server connections never keep
    the drop waiting."""
    with (
        running("pgbouncer", PgBouncerServer(postgres_server.port)) as server,
        pytest.MonkeyPatch.context() as patch,
    ):
        connection = connections["pgbouncer"]
        for settings_dict in (settings.DATABASES["pgbouncer"], connection.settings_dict):
            patch.setitem(settings_dict, "PORT", str(server.port))
            # The mirror's NAME is the test database's once the tests set up.
            patch.setitem(settings_dict, "NAME", connections["postgres"].settings_dict["NAME"])
        yield server
        connection.close()
    # Its server connections end as PgBouncer exits, asynchronously: wait until the
    # test database has no other session, or dropping it would fail.
    with django_db_blocker.unblock(), connections["postgres"].cursor() as cursor:
        for _ in range(200):
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            if cursor.fetchone()[0] == 0:
                break
            time.sleep(0.05)  # polling the server's own view: no event to wait on
    connections["postgres"].close()  # or this session would keep the drop waiting


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """The session's redis-server; ``RedisHarness`` builds its backends on it."""
    with running("redis", RedisServer()) as server, pytest.MonkeyPatch.context() as patch:
        patch.setattr(RedisHarness, "url", server.url)
        yield server


@pytest.fixture(scope="session")
def redis_sentinel() -> Iterator[RedisSentinelTopology]:
    """The session's Redis Sentinel topology: a primary, its replica, three sentinels.
    A test that fails it over leaves the other primary for the next."""
    with (
        running("redis sentinel", RedisSentinelTopology()) as topology,
        pytest.MonkeyPatch.context() as patch,
    ):
        patch.setattr(RedisSentinelHarness, "location", topology.location)
        patch.setattr(RedisSentinelHarness, "sentinels", topology.sentinels)
        yield topology


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterTopology]:
    """The session's Redis Cluster: three primaries with a replica each."""
    with running("redis cluster", RedisClusterTopology()) as topology:
        yield topology


@pytest.fixture(scope="session")
def redis_cluster_harness(redis_cluster: RedisClusterTopology) -> Iterator[RedisClusterTopology]:
    """The session's cluster, named by ``RedisClusterHarness`` while it runs."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RedisClusterHarness, "url", redis_cluster.startup_url)
        yield redis_cluster


@pytest.fixture(scope="session")
def firestore_emulator() -> Iterator[FirestoreEmulator]:
    """The session's Firestore emulator, named by ``FIRESTORE_EMULATOR_HOST``."""
    with running("firestore", FirestoreEmulator()) as server, pytest.MonkeyPatch.context() as patch:
        patch.setenv("FIRESTORE_EMULATOR_HOST", server.host)
        # The emulator's first request takes seconds (JVM warm-up), more than the
        # tests' operation timeouts: make it here, once, with a long timeout.
        from django_syncguard.backends.firestore import FirestoreBackend

        options = {"PROJECT": "syncguard-test", "OPERATION_TIMEOUT_MS": 60_000}
        warm_up = FirestoreBackend("warm-up", {"OPTIONS": options})
        try:
            warm_up.now_ms()
        finally:
            warm_up.close()
        yield server


@pytest.fixture(scope="session")
def django_db_modify_db_settings(
    django_db_modify_db_settings: None, request: pytest.FixtureRequest
) -> None:
    """pytest-django's hook before it creates the test databases: when a selected test
    uses the ``postgres`` alias, its server must run and the alias name its port."""
    if not any(uses_postgres(item) for item in request.session.items):
        return
    try:
        request.getfixturevalue("postgres_server")
    except pytest.skip.Exception:
        # Outside CI, without PostgreSQL: no test database is created for a mirror,
        # and the alias's tests skip with the reason when they ask for the server.
        settings.DATABASES["postgres"]["TEST"]["MIRROR"] = "default"


@pytest.fixture(autouse=True)
def _postgres_for_the_alias(request: pytest.FixtureRequest) -> None:
    """A test on the ``postgres`` alias needs the session's PostgreSQL."""
    if uses_postgres(request.node):
        request.getfixturevalue("postgres_server")


@pytest.fixture(autouse=True)
def _no_orphan_releaser_outlives_its_test() -> Iterator[None]:
    """A releaser still retrying against a server its test stopped would call it
    during the next tests, and a gRPC call in flight when a later test forks can crash
    the child (gRPC's fork limits, not ours): each test ends its releasers."""
    yield
    from django_syncguard import orphans

    orphans.stop_all()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Remove the SQLite test database's wait-queue file (the database backend keeps
    its queue beside the database; the test database itself is removed by Django)."""
    from django_syncguard.backends.database.sqlite import queue_file

    name = settings.DATABASES["default"].get("TEST", {}).get("NAME")
    if name:
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(OSError):
                os.remove(queue_file(str(name)) + suffix)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give harness tests their database (servers start later, in fixtures). A test
    picks its harness through the ``harness`` fixture, or through ``kind`` when it
    builds harnesses itself (tests/test_fence_floors.py)."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = callspec.params if callspec else {}
        kind = params.get("harness", params.get("kind"))
        aliases = HARNESS_DATABASES.get(kind) if isinstance(kind, str) else None
        if aliases and item.get_closest_marker("django_db") is None:
            item.add_marker(pytest.mark.django_db(transaction=True, databases=aliases))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test shows the end of the output of each process it used that the
    harness started (Celery and django-tasks workers, servers): their stdout and
    stderr go to a log file, read here before the fixtures remove it."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed:
        values = getattr(item, "funcargs", {}).values()
        # A fixture may hand on another's process: each log once.
        started = {id(v): v for v in values if isinstance(v, InTempRoot)}
        for process in started.values():
            name = getattr(process, "node", type(process).__name__)
            report.sections.append((f"{name}: log (tail)", process.log_tail()))


def start_server_of(request: pytest.FixtureRequest, kind: str) -> None:
    """Start the server the harness ``kind`` needs, if any (a session fixture)."""
    server = HARNESS_SERVERS.get(kind)
    if server is not None:
        request.getfixturevalue(server)


@pytest.fixture(params=sorted(HARNESSES))
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    """A fresh backend of each kind, with time and fence controls, on its server."""
    start_server_of(request, request.param)
    h = HARNESSES[request.param]()
    try:
        yield h
    finally:
        h.close()


@pytest.fixture(params=sorted(HARNESSES))
def kind(request: pytest.FixtureRequest) -> str:
    """Each harness's name, its server running: for tests that build harnesses of
    their own, with options (tests/test_fence_floors.py)."""
    start_server_of(request, request.param)
    return str(request.param)


@pytest.fixture
def mem() -> Iterator[MemoryHarness]:
    """A memory backend on a fake clock, for tests of what sits above backends."""
    h = MemoryHarness()
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def children() -> Iterator[Children]:
    """Child processes started by the test; any still running are terminated after it."""
    spawned = Children()
    try:
        yield spawned
    finally:
        spawned.terminate()


@pytest.fixture
def backend(harness: Harness):
    return harness.backend


@pytest.fixture
def no_io(backend, monkeypatch):
    """Make any storage I/O of ``backend`` fail the test: validation must come first."""

    def forbidden(*args, **kwargs):
        raise AssertionError("storage I/O happened before validation failed")

    # The storage hooks, and the async twins of those that have one.
    hooks = set(BaseLockBackend.__abstractmethods__)
    for name in sorted(hooks | {f"_a{h[1:]}" for h in hooks if hasattr(backend, f"_a{h[1:]}")}):
        monkeypatch.setattr(backend, name, forbidden)
    return backend


@pytest.fixture
def syncguard_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="django_syncguard")
    return caplog
