"""One harness per backend, so the contract suite runs unchanged on each.

A harness builds a fresh backend and can do what a test cannot do through the
public API: move the backend's notion of time forward (a fake clock, or ageing the
stored records on a server whose clock we do not control), and seed a fence counter.
"""

from __future__ import annotations

import uuid
from typing import ClassVar

from django_syncguard.backends.base import BaseLockBackend
from django_syncguard.backends.memory import MemoryBackend
from django_syncguard.keys import normalize_and_validate_key
from django_syncguard.liveness import FakeClock


class Harness:
    name: ClassVar[str]
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


HARNESSES: dict[str, type[Harness]] = {"memory": MemoryHarness}
