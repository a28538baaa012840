from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tests.harness import HARNESSES, Harness, MemoryHarness


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
