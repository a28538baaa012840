"""``OPTIONS["WAIT_REPLICAS"]`` / ``["WAIT_TIMEOUT_MS"]`` on a real primary with one
replica (issue 22): a write returns only once enough replicas have it; too few in
time gives ``ServiceUnavailable``, and an acquire is undone."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from django_syncguard import InvalidArgument, ServiceUnavailable
from django_syncguard.backends.redis import RedisBackend
from tests.support.servers import RedisServer

pytestmark = pytest.mark.slow

TTL = 60_000


@pytest.fixture(scope="module")
def primary() -> Iterator[tuple[RedisServer, RedisServer]]:
    """A primary and one replica, linked."""
    main = RedisServer().start()
    replica = RedisServer(replica_of=main.port).start()
    try:
        link = RedisBackend("link", {"LOCATION": f"redis://127.0.0.1:{replica.port}/0"})
        deadline = time.monotonic() + 30
        while link.client.info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "the replica did not link to the primary"
            time.sleep(0.05)  # the replication handshake: no event to wait on
        link.close()
        yield main, replica
    finally:
        replica.destroy()
        main.destroy()


def backend(server: RedisServer, **options: Any) -> RedisBackend:
    return RedisBackend(
        "acked", {"LOCATION": server.url, "KEY_PREFIX": "acked", "OPTIONS": options}
    )


def on_replica(replica: RedisServer, name: str) -> dict[bytes, bytes]:
    reader = RedisBackend("reader", {"LOCATION": replica.url})
    try:
        return reader.client.hgetall(name)
    finally:
        reader.close()


def test_a_write_returns_once_the_replica_has_it(primary):
    main, replica = primary
    locks = backend(main, WAIT_REPLICAS=1, FENCES="counter")
    try:
        result = locks.acquire("acked:1", TTL)
        # WAIT returned: the replica has the lock, without polling it.
        stored = on_replica(replica, locks.lock_key("acked:1"))
        assert (stored[b"i"].decode(), stored[b"f"]) == (result.lock_id, b"1")
        assert locks.extend(result.lock_id, TTL).ok
        assert locks.release(result.lock_id).ok
        assert b"i" not in on_replica(replica, locks.lock_key("acked:1"))
    finally:
        locks.close()


def test_too_few_replicas_in_time_undo_the_acquire_and_raise(primary):
    main, _ = primary
    locks = backend(main, WAIT_REPLICAS=2, WAIT_TIMEOUT_MS=200)
    plain = backend(main)
    try:
        with pytest.raises(ServiceUnavailable, match=r"1 of the 2 replicas .* released again"):
            locks.acquire("short:1", TTL)
        assert plain.is_locked("short:1") is False  # undone

        held = plain.acquire("short:2", TTL)
        with pytest.raises(ServiceUnavailable, match="extended here"):
            locks.extend(held.lock_id, TTL)
        with pytest.raises(ServiceUnavailable, match="released here"):
            locks.release(held.lock_id)
        assert plain.is_locked("short:2") is False  # the release itself happened
    finally:
        locks.close()
        plain.close()


async def test_the_async_twins_wait_too(primary):
    main, _ = primary
    locks = backend(main, WAIT_REPLICAS=2, WAIT_TIMEOUT_MS=100)
    try:
        with pytest.raises(ServiceUnavailable, match="released again"):
            await locks.aacquire("async:1", TTL)
        assert await locks.ais_locked("async:1") is False
    finally:
        locks.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"WAIT_REPLICAS": -1}, "WAIT_REPLICAS'\\] must be an int from 0 to 64"),
        ({"WAIT_REPLICAS": True}, "WAIT_REPLICAS'\\] must be an int from 0 to 64"),
        ({"WAIT_REPLICAS": 1, "WAIT_TIMEOUT_MS": 5_000}, "must be shorter than"),
    ],
)
def test_bad_wait_options_are_refused(options, message):
    with pytest.raises(InvalidArgument, match=message):
        RedisBackend("bad", {"LOCATION": "redis://127.0.0.1:1/0", "OPTIONS": options})
