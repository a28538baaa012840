"""The Redis backend through Sentinel: settings, the deploy check, and a primary that
fails over under a held lock (``specs/backends/redis.md``, Topologies).

The contract suites run on Sentinel too (the ``redis-sentinel`` harness); this file
holds what only Sentinel has. The failover table (several processes, ten failovers
per cell) is ``tests/test_redis_failover.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from django_syncguard.backends.redis import W014, RedisBackend
from django_syncguard.backends.redis.backend import W014_FENCES, W014_HINT
from django_syncguard.errors import InvalidArgument, NetworkTimeout, ServiceUnavailable
from tests.support.servers import free_port

SENTINELS = [("127.0.0.1", 26379)]


def sentinel_backend(topology: Any, **options: Any) -> RedisBackend:
    params = {
        "LOCATION": topology.location,
        "KEY_PREFIX": "sentinel-test",
        "OPTIONS": {"SENTINELS": topology.sentinels, **options},
    }
    return RedisBackend("s", params)


# ------------------------------------------------------------- settings (no I/O)
@pytest.mark.parametrize(
    "sentinels",
    [
        [],
        "127.0.0.1:26379",
        [("127.0.0.1",)],
        [("127.0.0.1", "26379")],
        [("127.0.0.1", 0)],
        [("127.0.0.1", 70_000)],
        [("127.0.0.1", True)],
        [("", 26379)],
        [("127.0.0.1", 26379), None],
    ],
)
def test_bad_sentinel_lists_are_refused(sentinels):
    params = {"LOCATION": "redis://mymaster/0", "OPTIONS": {"SENTINELS": sentinels}}
    with pytest.raises(InvalidArgument) as caught:
        RedisBackend("s", params)
    assert str(caught.value) == (
        f"OPTIONS['SENTINELS'] must be a non-empty list of (host, port) pairs, not {sentinels!r}."
    )


def test_sentinel_pairs_may_be_lists_as_json_settings_give_them():
    params = {"LOCATION": "redis://mymaster/2", "OPTIONS": {"SENTINELS": [["127.0.0.1", 1]]}}
    backend = RedisBackend("s", params)  # builds clients; connects on first use only
    try:
        assert backend.clients.topology == "sentinel"
        assert backend.clients.sentinel is not None
        assert backend.clients.sentinel.service == "mymaster"
        assert backend.clients.sentinel.sentinels == [("127.0.0.1", 1)]
    finally:
        backend.close()


@pytest.mark.parametrize("location", ["unix:///tmp/redis.sock", "redis:///0"])
def test_a_sentinel_location_names_a_service(location):
    params = {"LOCATION": location, "OPTIONS": {"SENTINELS": SENTINELS}}
    with pytest.raises(InvalidArgument, match="with SENTINELS, LOCATION is 'redis://<service"):
        RedisBackend("s", params)


def test_sentinel_kwargs_need_sentinels():
    params = {"LOCATION": "redis://127.0.0.1:6379/0", "OPTIONS": {"SENTINEL_KWARGS": {}}}
    with pytest.raises(InvalidArgument, match=r"SENTINEL_KWARGS'\] needs OPTIONS\['SENTINELS'\]"):
        RedisBackend("s", params)


def test_no_sentinel_answering_is_service_unavailable():
    # A sentinel address where nothing listens: redis-py's MasterNotFoundError.
    params = {
        "LOCATION": "redis://mymaster/0",
        "OPTIONS": {"SENTINELS": [("127.0.0.1", free_port())]},
    }
    backend = RedisBackend("s", params)
    try:
        with pytest.raises(ServiceUnavailable, match="No master found for 'mymaster'"):
            backend.acquire("k", 1_000)
    finally:
        backend.close()


# ------------------------------------------------------------ on real sentinels
@pytest.mark.slow
def test_locks_go_through_the_primary_the_sentinels_name(redis_sentinel):
    backend = sentinel_backend(redis_sentinel)
    try:
        held = backend.acquire("through", 30_000)
        assert held.ok
        primary = backend.client.connection_pool.get_master_address()
        assert primary == ("127.0.0.1", redis_sentinel.primary_port())
        assert backend.lookup(key="through").fence == held.fence
        assert backend.release(held.lock_id).ok
    finally:
        backend.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["clock", "counter"])
def test_the_deploy_check_warns_about_sentinel_without_wait_replicas(redis_sentinel, mode):
    backend = sentinel_backend(redis_sentinel, FENCES=mode)
    try:
        warnings = [m for m in backend.deploy_check() if m.id == "syncguard.W014"]
        assert [(w.msg, w.hint) for w in warnings] == [
            (
                W014.format(alias="s", mode=mode, topology="Sentinel", fences=W014_FENCES[mode]),
                W014_HINT,
            )
        ]
    finally:
        backend.close()
    acknowledged = sentinel_backend(redis_sentinel, WAIT_REPLICAS=1)
    try:
        assert [m.id for m in acknowledged.deploy_check() if m.id == "syncguard.W014"] == []
    finally:
        acknowledged.close()


@pytest.mark.slow
def test_after_a_failover_the_same_backend_reaches_the_new_primary(redis_sentinel):
    # WAIT 1: the replica has the lock before acquire returns, so the promoted
    # replica still holds it: the holder can extend and release it there.
    backend = sentinel_backend(redis_sentinel, WAIT_REPLICAS=1, WAIT_TIMEOUT_MS=2_000)
    try:
        held = backend.acquire("across", 60_000)
        assert held.ok
        old_primary = redis_sentinel.primary_port()
        new_primary = redis_sentinel.failover()
        assert new_primary != old_primary
        outcomes = []
        for _ in range(3):  # the pooled connection to the killed primary fails once
            try:
                outcomes.append(backend.extend(held.lock_id, 60_000).ok)
                break
            except (ServiceUnavailable, NetworkTimeout) as exc:
                outcomes.append(type(exc).__name__)
        assert outcomes[-1] is True
        assert set(outcomes[:-1]) <= {"ServiceUnavailable", "NetworkTimeout"}
        assert backend.lookup(key="across").fence == held.fence
        assert backend.acquire("across", 1_000).ok is False
        assert backend.release(held.lock_id).ok
        assert int(backend.acquire("across", 1_000).fence) > int(held.fence)
    finally:
        backend.close()
