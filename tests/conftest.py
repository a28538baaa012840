from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

from tests.harness import HARNESS_DATABASES, HARNESSES, Harness, MemoryHarness
from tests.servers import PostgresServer, ServerUnavailable

IN_CI = bool(os.environ.get("CI"))
_servers: dict[str, object] = {}


def needs_database(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    harness = callspec.params.get("harness") if callspec else None
    alias = HARNESS_DATABASES.get(harness) if harness else None
    if alias is None:
        marker = item.get_closest_marker("django_db")
        if marker and "postgres" in (marker.kwargs.get("databases") or ()):
            alias = "postgres"
    return alias


def start_postgres() -> PostgresServer | str:
    """The session's PostgreSQL server, or why it could not start."""
    if "postgres" not in _servers:
        try:
            server = PostgresServer().start()
        except ServerUnavailable as exc:
            _servers["postgres"] = str(exc)
        else:
            from django.conf import settings

            settings.DATABASES["postgres"]["PORT"] = str(server.port)
            _servers["postgres"] = server
    return _servers["postgres"]  # type: ignore[return-value]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give database-harness tests their database, starting PostgreSQL if any needs it."""
    for item in items:
        alias = needs_database(item)
        if alias is None:
            continue
        if alias == "postgres":
            server = start_postgres()
            if isinstance(server, str):
                if IN_CI:
                    raise pytest.UsageError(f"CI is set and PostgreSQL cannot start: {server}")
                item.add_marker(pytest.mark.skip(reason=f"PostgreSQL unavailable: {server}"))
                continue
        if item.get_closest_marker("django_db") is None:
            item.add_marker(pytest.mark.django_db(transaction=True, databases=[alias]))


def pytest_unconfigure(config: pytest.Config) -> None:
    server = _servers.pop("postgres", None)
    if isinstance(server, PostgresServer):
        server.destroy()


@pytest.fixture(scope="session")
def postgres_server() -> PostgresServer:
    server = start_postgres()
    if isinstance(server, str):
        pytest.fail(f"PostgreSQL unavailable: {server}")
    return server


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
    ):
        monkeypatch.setattr(backend, name, forbidden)
    return backend


@pytest.fixture
def syncguard_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="django_syncguard")
    return caplog
