"""One harness per backend, so the contract suite runs unchanged on each.

A harness builds a fresh backend and can do what a test cannot do through the
public API: move the backend's notion of time forward (a fake clock, or ageing the
stored records on a server whose clock we do not control), and seed a fence counter.
"""

from __future__ import annotations

import uuid
from typing import ClassVar

from django_syncguard.backends.base import BaseLockBackend
from django_syncguard.backends.database import DatabaseBackend
from django_syncguard.backends.memory import MemoryBackend
from django_syncguard.keys import normalize_and_validate_key
from django_syncguard.liveness import FakeClock
from django_syncguard.results import Capabilities


class Harness:
    name: ClassVar[str]
    #: What the backend must declare.
    capabilities: ClassVar[Capabilities]
    backend: BaseLockBackend

    def now_ms(self) -> int:
        """The backend's time authority, now."""
        raise NotImplementedError

    def advance(self, ms: int) -> None:
        """Make every stored lock ``ms`` older, as if the authority's clock jumped."""
        raise NotImplementedError

    def set_fence(self, key: str, value: int) -> None:
        """Set the fence counter of ``key`` (the next acquire returns ``value + 1``)."""
        raise NotImplementedError

    def close(self) -> None:
        self.backend.close()


class MemoryHarness(Harness):
    name = "memory"
    capabilities = Capabilities("memory", supports_fencing=True, time_authority="client")

    def __init__(self, **options: object) -> None:
        self.clock = FakeClock()
        self.backend = MemoryBackend(
            f"contract-{uuid.uuid4().hex}", {"OPTIONS": {"CLOCK": self.clock, **options}}
        )

    def now_ms(self) -> int:
        return self.clock()

    def advance(self, ms: int) -> None:
        self.clock.advance(ms)

    def set_fence(self, key: str, value: int) -> None:
        assert isinstance(self.backend, MemoryBackend)
        self.backend._store.fences[normalize_and_validate_key(key)] = value

    def close(self) -> None:
        assert isinstance(self.backend, MemoryBackend)
        self.backend.reset()


class DatabaseHarness(Harness):
    """The database backend on a real database; time moves by ageing the rows."""

    database: ClassVar[str]

    def __init__(self, **options: object) -> None:
        self.backend = DatabaseBackend(
            f"contract-{self.name}", {"OPTIONS": {"DATABASE": self.database, **options}}
        )

    def now_ms(self) -> int:
        assert isinstance(self.backend, DatabaseBackend)
        return self.backend.now_ms()

    def execute(self, sql: str, params: list[object]) -> None:
        assert isinstance(self.backend, DatabaseBackend)
        with self.backend.connection().cursor() as cursor:
            cursor.execute(sql, params)

    def advance(self, ms: int) -> None:
        self.execute(
            "UPDATE syncguard_locks SET expires_at_ms = expires_at_ms - %s, "
            "acquired_at_ms = acquired_at_ms - %s",
            [ms, ms],
        )

    def set_fence(self, key: str, value: int) -> None:
        assert isinstance(self.backend, DatabaseBackend)
        fence_key = self.backend.storage_keys(normalize_and_validate_key(key))[1]
        self.execute(
            "INSERT INTO syncguard_fence_counters (fence_key, fence) VALUES (%s, %s) "
            "ON CONFLICT (fence_key) DO UPDATE SET fence = excluded.fence",
            [fence_key, value],
        )


class SqliteHarness(DatabaseHarness):
    name = "sqlite"
    capabilities = Capabilities("sqlite", supports_fencing=True, time_authority="client")
    database = "default"


class PostgresHarness(DatabaseHarness):
    name = "postgres"
    capabilities = Capabilities("postgres", supports_fencing=True, time_authority="server")
    database = "postgres"


HARNESSES: dict[str, type[Harness]] = {
    "memory": MemoryHarness,
    "sqlite": SqliteHarness,
    "postgres": PostgresHarness,
}

#: Which DATABASES alias each database-backed harness needs.
HARNESS_DATABASES = {"sqlite": "default", "postgres": "postgres"}
