from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

from tests.support.harness import (
    HARNESS_DATABASES,
    HARNESS_SERVERS,
    HARNESSES,
    Harness,
    MemoryHarness,
    RedisHarness,
)
from tests.support.servers import FirestoreEmulator, PostgresServer, RedisServer, ServerUnavailable

IN_CI = bool(os.environ.get("CI"))
_servers: dict[str, object] = {}


def _start_postgres() -> PostgresServer:
    server = PostgresServer().start()
    from django.conf import settings

    settings.DATABASES["postgres"]["PORT"] = str(server.port)
    return server


def _start_redis() -> RedisServer:
    server = RedisServer().start()
    RedisHarness.url = server.url
    return server


def _start_firestore() -> FirestoreEmulator:
    server = FirestoreEmulator().start()
    os.environ["FIRESTORE_EMULATOR_HOST"] = server.host
    # The emulator's first request takes seconds (JVM warm-up), more than the tests'
    # operation timeouts: make it here, once, with a long timeout.
    from django_syncguard.backends.firestore import FirestoreBackend

    options = {"PROJECT": "syncguard-test", "OPERATION_TIMEOUT_MS": 60_000}
    warm_up = FirestoreBackend("warm-up", {"OPTIONS": options})
    try:
        warm_up.now_ms()
    finally:
        warm_up.close()
    return server


STARTERS = {"postgres": _start_postgres, "redis": _start_redis, "firestore": _start_firestore}


def start_server(kind: str) -> PostgresServer | RedisServer | str:
    """The session's server of that kind (started on first need), or why it cannot run."""
    if kind not in _servers:
        try:
            _servers[kind] = STARTERS[kind]()
        except ServerUnavailable as exc:
            _servers[kind] = str(exc)
    return _servers[kind]  # type: ignore[return-value]


def server_needed(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    harness = callspec.params.get("harness") if callspec else None
    if harness in HARNESS_SERVERS:
        return HARNESS_SERVERS[harness]
    if "redis_server" in item.fixturenames:
        return "redis"
    if "firestore_emulator" in item.fixturenames:
        return "firestore"
    marker = item.get_closest_marker("django_db")
    if "postgres_server" in item.fixturenames or (
        marker and "postgres" in (marker.kwargs.get("databases") or ())
    ):
        return "postgres"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Start the servers the selected tests need; give harness tests their database."""
    for item in items:
        kind = server_needed(item)
        if kind is not None:
            server = start_server(kind)
            if isinstance(server, str):
                if IN_CI:
                    raise pytest.UsageError(f"CI is set and {kind} cannot start: {server}")
                item.add_marker(pytest.mark.skip(reason=f"{kind} unavailable: {server}"))
                continue
        callspec = getattr(item, "callspec", None)
        alias = HARNESS_DATABASES.get(callspec.params.get("harness")) if callspec else None
        if alias and item.get_closest_marker("django_db") is None:
            item.add_marker(pytest.mark.django_db(transaction=True, databases=[alias]))


def pytest_unconfigure(config: pytest.Config) -> None:
    for server in _servers.values():
        if isinstance(server, PostgresServer | RedisServer | FirestoreEmulator):
            server.destroy()
    _servers.clear()


def _session_server(kind: str):
    server = start_server(kind)
    if isinstance(server, str):
        pytest.fail(f"{kind} unavailable: {server}")
    return server


@pytest.fixture(scope="session")
def postgres_server() -> PostgresServer:
    return _session_server("postgres")


@pytest.fixture(scope="session")
def redis_server() -> RedisServer:
    return _session_server("redis")


@pytest.fixture(scope="session")
def firestore_emulator() -> FirestoreEmulator:
    return _session_server("firestore")


@pytest.fixture(params=sorted(HARNESSES))
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    """A fresh backend of each kind, with time and fence controls."""
    h = HARNESSES[request.param]()
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def mem() -> Iterator[MemoryHarness]:
    """A memory backend on a fake clock, for tests of what sits above backends."""
    h = MemoryHarness()
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def backend(harness: Harness):
    return harness.backend


@pytest.fixture
def no_io(backend, monkeypatch):
    """Make any storage I/O of ``backend`` fail the test: validation must come first."""

    def forbidden(*args, **kwargs):
        raise AssertionError("storage I/O happened before validation failed")

    for name in (
        "_acquire",
        "_release",
        "_extend",
        "_is_locked",
        "_lookup_by_key",
        "_lookup_by_id",
        "_aacquire",
        "_arelease",
        "_aextend",
        "_ais_locked",
        "_alookup_by_key",
        "_alookup_by_id",
        "_list_locks",
        "_count_expired",
        "_delete_expired",
    ):
        monkeypatch.setattr(backend, name, forbidden)
    return backend


@pytest.fixture
def syncguard_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="django_syncguard")
    return caplog
