"""The Redis topologies of the test harness (``tests/support/servers.py``) do what the
backend tests will count on: Sentinel's failover leaves a new primary with the data
that a replica acknowledged, and a cluster covers every slot, moves one with its keys,
and survives the loss of a primary."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from tests.support.servers import RedisClusterTopology, redis_client

pytestmark = [pytest.mark.slow, pytest.mark.once]

TIMEOUTS: dict[str, Any] = {"socket_timeout": 5, "socket_connect_timeout": 2}


def write_acknowledged(port: int, key: str, value: str) -> int:
    """SET on the primary, then how many replicas had it within a second (WAIT)."""
    with redis_client(port) as client:
        client.set(key, value)
        return int(client.execute_command("WAIT", 1, 1000))


def test_sentinel_start_gives_a_primary_and_a_replica_in_sync(redis_sentinel):
    primary = redis_sentinel.primary_port()
    [replica] = [port for port in redis_sentinel.servers if port != primary]
    assert write_acknowledged(primary, "topology:start", "here") == 1
    with redis_client(replica) as client:
        assert client.get("topology:start") == "here"
        assert client.info("replication")["master_port"] == primary
    assert len(redis_sentinel.sentinels) == 3
    assert redis_sentinel.location == "redis://syncguard/0"


def test_three_failovers_in_a_row_keep_what_the_replica_acknowledged(redis_sentinel):
    written: dict[str, str] = {}
    for n in range(3):
        old = redis_sentinel.primary_port()
        key = f"topology:failover:{n}"
        assert write_acknowledged(old, key, str(n)) == 1
        written[key] = str(n)
        new = redis_sentinel.failover()
        assert new != old
        assert redis_sentinel.primary_port() == new
        # Every sentinel names it, and the crashed server is back as its replica.
        for _, port in redis_sentinel.sentinels:
            with redis_client(port) as sentinel:
                reply = sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", "syncguard")
                assert int(reply[1]) == new
        with redis_client(new) as client:
            assert client.execute_command("ROLE")[0] == "master"
            assert client.mget(list(written)) == list(written.values())
        with redis_client(old) as client:
            assert client.info("replication")["master_port"] == new


@pytest.fixture
def cluster_client(redis_cluster: RedisClusterTopology) -> Iterator[RedisCluster]:
    client = RedisCluster.from_url(redis_cluster.startup_url, decode_responses=True, **TIMEOUTS)
    try:
        yield client
    finally:
        client.close()


def keys_on_each_primary(redis_cluster: RedisClusterTopology) -> dict[int, str]:
    """A key that hashes to a slot of each primary, by the primary's port."""
    keys: dict[int, str] = {}
    n = 0
    while len(keys) < len(redis_cluster.primaries()):
        key = f"topology:spread:{n}"
        keys.setdefault(redis_cluster.owner(key_slot(key.encode())), key)
        n += 1
    return keys


def test_cluster_start_covers_every_slot_and_serves_each_primary(redis_cluster, cluster_client):
    primaries = redis_cluster.primaries()
    assert len(primaries) == 3
    assert redis_cluster.startup_url == f"redis://127.0.0.1:{primaries[0]}/0"
    with redis_client(primaries[0]) as client:
        slots = client.execute_command("CLUSTER", "SLOTS")
    assert sum(end - start + 1 for start, end, *_ in slots) == 16384
    assert {primary[1] for _, _, primary, *_ in slots} == set(primaries)
    keys = keys_on_each_primary(redis_cluster)
    for port, key in keys.items():
        assert cluster_client.set(key, str(port)) is True
    for port, key in keys.items():
        assert cluster_client.get(key) == str(port)
        with redis_client(port) as node:  # it is on that primary, not only reachable
            assert node.execute_command("GET", key) == str(port)


def test_migrate_slot_moves_fifty_keys_under_traffic(redis_cluster, cluster_client):
    tag = "{topology:migrate}"
    slot = key_slot(tag.encode())
    source = redis_cluster.owner(slot)
    target = next(p for p in redis_cluster.primaries() if p != source)
    keys = [f"{tag}:{n}" for n in range(50)]
    for n, key in enumerate(keys):
        cluster_client.set(key, str(n))
    # Traffic on the same slot while it moves: a counter that one thread increments;
    # every INCR that returned must be counted once, whichever node served it.
    increments: list[int] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def traffic() -> None:
        with RedisCluster.from_url(redis_cluster.startup_url, **TIMEOUTS) as client:
            while not done.is_set():
                try:
                    increments.append(client.incr(f"{tag}:counter"))
                except redis.RedisError as exc:
                    errors.append(exc)
                    return

    def wait_for_increments(count: int) -> None:
        deadline = time.monotonic() + 30
        while len(increments) < count and not errors:
            assert time.monotonic() < deadline, "the traffic thread is stuck"
            time.sleep(0.01)  # another thread's progress: no event to wait on

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        wait_for_increments(1)  # the traffic runs before the move starts...
        redis_cluster.migrate_slot(slot, target)
        wait_for_increments(len(increments) + 1)  # ...and goes on after it
    finally:
        done.set()
        worker.join(30)
    assert errors == []
    assert increments and increments == list(range(1, len(increments) + 1))
    assert redis_cluster.owner(slot) == target
    assert cluster_client.mget(keys) == [str(n) for n in range(50)]
    assert cluster_client.get(f"{tag}:counter") == str(len(increments))
    with redis_client(target) as node:
        assert node.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 51
    with redis_client(source) as node:
        assert node.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0


def test_fail_over_primary_keeps_the_cluster_ok(redis_cluster, cluster_client):
    keys = keys_on_each_primary(redis_cluster)
    for port, key in keys.items():
        # On its primary's own connection: WAIT counts the replicas that have it.
        assert write_acknowledged(port, key, f"before:{port}") == 1
    victim = redis_cluster.primaries()[0]
    new = redis_cluster.fail_over_primary(victim)
    assert new != victim
    assert new in redis_cluster.primaries() and victim not in redis_cluster.primaries()
    for port in redis_cluster.nodes:
        with redis_client(port) as node:
            assert "cluster_state:ok" in node.execute_command("CLUSTER", "INFO")
    with redis_client(victim) as node:
        info = node.info("replication")
    assert (info["role"], info["master_port"], info["master_link_status"]) == ("slave", new, "up")
    # A client that knew the old map finds every key again (it follows MOVED).
    for port, key in keys.items():
        assert cluster_client.get(key) == f"before:{port}"


def test_a_planned_failover_turns_the_old_primary_into_the_replica(redis_sentinel):
    old = redis_sentinel.primary_port()
    assert write_acknowledged(old, "topology:planned", "kept") == 1
    new = redis_sentinel.failover(kill=False)
    assert new != old and redis_sentinel.primary_port() == new
    with redis_client(old) as client:  # not restarted: the sentinels reconfigured it
        assert client.info("replication")["master_port"] == new
        assert client.get("topology:planned") == "kept"
