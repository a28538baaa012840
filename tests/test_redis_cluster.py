"""The Redis backend on a Redis Cluster (``specs/backends/redis.md``, Redis Cluster).

On the session's cluster (three primaries, a replica each): the layout (slot-encoded
lock ids, per-slot index and floor), round trips counted on the client's connections,
housekeeping over every primary, WAIT on the slot's node, a slot migrated under
traffic from four processes, and a primary failing over. The shared contract suites
run on the cluster too (harness ``redis-cluster``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from typing import Any, ClassVar

import pytest
import redis

from django_syncguard.backends.redis import RedisBackend, slots
from django_syncguard.backends.redis.backend import W014, W014_FENCES
from django_syncguard.errors import InvalidArgument, NetworkTimeout, ServiceUnavailable
from django_syncguard.keys import validate_lock_id
from tests.support import cluster_workers
from tests.support.harness import RedisClusterHarness
from tests.support.processes import Children

TTL = 60_000
WAKE_S = 10.0


@pytest.fixture
def ch(redis_cluster_harness):
    harness = RedisClusterHarness()
    yield harness
    harness.close()


def node_of(backend: RedisBackend, name: str) -> int:
    """The port of the primary serving key ``name``."""
    cluster: Any = backend.client
    return int(cluster.get_node_from_key(name).port)


# ------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    ("options", "location", "message"),
    [
        ({"CLUSTER": "yes"}, "redis://127.0.0.1:1/0", "CLUSTER'] must be True or False"),
        ({"CLUSTER": 1}, "redis://127.0.0.1:1/0", "CLUSTER'] must be True or False"),
        (
            {"CLUSTER": True, "SENTINELS": [("127.0.0.1", 1)]},
            "redis://127.0.0.1:1/0",
            "exclude each other",
        ),
        ({"CLUSTER": True}, "redis://127.0.0.1:1/3", "database 0 only"),
        ({"CLUSTER": True}, "unix:///tmp/x.sock", "over TCP"),
    ],
)
def test_bad_cluster_settings_are_refused_before_any_connection(options, location, message):
    with pytest.raises(InvalidArgument, match=message):
        RedisBackend("bad", {"LOCATION": location, "OPTIONS": options})


def test_a_prefix_with_braces_is_refused_on_a_cluster():
    options = {"CLUSTER": True}
    params = {"LOCATION": "redis://127.0.0.1:1/0", "KEY_PREFIX": "a{b}", "OPTIONS": options}
    with pytest.raises(InvalidArgument, match="free of braces"):
        RedisBackend("bad", params)


def test_an_unreachable_cluster_is_unavailable_not_a_raw_error():
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    params = {"LOCATION": f"redis://127.0.0.1:{port}/0", "OPTIONS": {"CLUSTER": True}}
    backend = RedisBackend("down", params)  # connects on first use only
    with pytest.raises(ServiceUnavailable):
        backend.acquire("k", TTL)
    with pytest.raises(ServiceUnavailable):
        backend.release(slots.new_lock_id(5))

    async def in_a_loop() -> None:
        with pytest.raises(ServiceUnavailable):
            await backend.aacquire("k", TTL)
        await backend.clients.aclose()

    asyncio.run(in_a_loop())
    backend.close()


# --------------------------------------------------------------------- layout
def test_the_tag_table_names_every_slot_once():
    tags = slots.tags()
    assert len(tags) == slots.SLOTS
    assert all(slots.key_slot("{" + tag + "}") == slot for slot, tag in enumerate(tags))
    assert all("{" not in tag and "}" not in tag and 1 <= len(tag) <= 3 for tag in tags)
    assert slots.table_build_s is not None and slots.table_build_s < 5


def test_key_slot_agrees_with_redis_py():
    from redis.crc import key_slot

    for name in ["", "a", "P:x", "P:{tag}x", "P:{}x", "P:{x", "ünï{cödé}", "{a}{b}"]:
        assert slots.key_slot(name) == key_slot(name.encode()), name


def test_a_lock_id_says_its_slot_and_keeps_114_random_bits():
    for slot in (0, 1, 4095, 4096, 16383):
        lock_id = slots.new_lock_id(slot)
        assert validate_lock_id(lock_id) == lock_id
        assert slots.lock_id_slot(lock_id) == slot
    ids = {slots.new_lock_id(7)[3:] for _ in range(1000)}
    assert len(ids) == 1000  # 19 random characters each


def test_the_acquire_keys_share_the_lock_hash_slot(ch):
    backend = ch.redis
    for n in range(50):
        key = f"layout:{n}"
        result = backend.acquire(key, TTL)
        slot = slots.key_slot(backend.lock_key(key))
        assert slots.lock_id_slot(result.lock_id) == slot
        assert slots.key_slot(backend.index_key(result.lock_id)) == slot
        assert slots.key_slot(backend.slot_floor_key(slot)) == slot
        assert (
            backend.client.get(backend.index_key(result.lock_id)) == backend.lock_key(key).encode()
        )


def test_a_lock_id_past_the_last_slot_is_simply_not_found(ch):
    backend = ch.redis
    forged = "___" + "A" * 19  # prefix 262143
    assert slots.lock_id_slot(forged) is None
    assert backend.lookup(lock_id=forged) is None
    assert backend.release(forged).reason == "not-found"
    assert backend.extend(forged, TTL).reason == "not-found"


def test_a_lock_id_naming_another_slot_finds_nothing(ch):
    backend = ch.redis
    held = backend.acquire("elsewhere", TTL)
    slot = slots.lock_id_slot(held.lock_id)
    other = slots.new_lock_id((slot + 1) % slots.SLOTS)[:3] + held.lock_id[3:]
    assert backend.release(other).reason == "not-found"
    assert backend.lookup(lock_id=other) is None
    assert backend.release(held.lock_id).ok


def test_keys_spread_over_every_primary_and_housekeeping_sees_them_all(ch, redis_cluster):
    backend = ch.redis
    keys = [f"spread:{n}" for n in range(90)]
    ids = {key: backend.acquire(key, TTL).lock_id for key in keys}
    per_primary: dict[int, int] = defaultdict(int)
    for key in keys:
        per_primary[node_of(backend, backend.lock_key(key))] += 1
    assert set(per_primary) == set(redis_cluster.primaries())
    assert all(count >= 10 for count in per_primary.values()), per_primary

    listed, cursor = [], None
    while True:
        page = backend.list_locks(prefix="spread:", cursor=cursor, limit=7)
        listed += [record.key for record in page.records]
        cursor = page.next_cursor
        if cursor is None:
            break
    assert sorted(set(listed)) == sorted(keys)
    assert {backend.lookup(lock_id=lock_id).key_hash for lock_id in ids.values()} == {
        backend.lookup(key=key).key_hash for key in keys
    }

    ch.advance(TTL + 10_000)
    assert list(backend.delete_expired(dry_run=True)) == [90]
    assert sum(backend.delete_expired(batch_size=10)) == 90
    assert backend.list_locks().records == ()


def test_a_bad_listing_cursor_is_refused(ch):
    with pytest.raises(InvalidArgument):
        ch.redis.list_locks(cursor="12")  # a single server's cursor, not a cluster's


def test_the_deploy_check_asks_every_primary(ch, redis_cluster):
    # The trial cluster runs without AOF: the check warns, as on a single server; and
    # without WAIT_REPLICAS, a failover inside the cluster can free held locks.
    warnings = ch.redis.deploy_check()
    assert [w.id for w in warnings] == ["syncguard.W010", "syncguard.W014"]
    assert warnings[1].msg == W014.format(
        alias=ch.redis.alias, mode="counter", topology="Cluster", fences=W014_FENCES["counter"]
    )
    ports = [int(node.connection_pool.connection_kwargs["port"]) for node in ch.primaries()]
    assert sorted(ports) == redis_cluster.primaries()


# ----------------------------------------------------------------- round trips
class CountingConnection(redis.connection.Connection):
    """A connection that counts what it sends: one packed send per round trip (a
    pipeline is one send)."""

    sent: ClassVar[list[tuple[int, str]]] = []

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sent.append((self.port, _first_command(command)))
        super().send_packed_command(command, check_health)


def _first_command(packed: Any) -> str:
    data = b"".join(packed) if isinstance(packed, list) else packed
    parts = data.split(b"\r\n")
    return parts[2].decode(errors="replace").upper() if len(parts) > 2 else "?"


def test_round_trips_counted_on_the_connections(redis_cluster_harness):
    harness = RedisClusterHarness(CLIENT_KWARGS={"connection_class": CountingConnection})
    backend = harness.redis
    try:
        # Each script's first call on a node costs a NOSCRIPT and a SCRIPT LOAD (sent
        # to every primary by redis-py): the scripts are loaded first.
        warm = backend.acquire("trips:warm", TTL)
        backend.lookup(key="trips:warm")
        backend.is_locked("trips:warm")
        backend.lookup(lock_id=warm.lock_id)
        backend.extend(warm.lock_id, TTL)
        backend.release(warm.lock_id)
        trips: dict[str, list[tuple[int, str]]] = {}

        def count(name: str, call: Any) -> Any:
            CountingConnection.sent.clear()
            result = call()
            trips[name] = list(CountingConnection.sent)
            return result

        held = count("acquire", lambda: backend.acquire("trips:warm", TTL))
        count("lookup by key", lambda: backend.lookup(key="trips:warm"))
        count("is_locked", lambda: backend.is_locked("trips:warm"))
        # The backend object that acquired knows the lock hash's name ...
        count("own lookup by id", lambda: backend.lookup(lock_id=held.lock_id))
        count("own extend", lambda: backend.extend(held.lock_id, TTL))
        # ... another one (another process, say) reads it from the index first.
        params = {k: v for k, v in harness.settings_entry.items() if k != "BACKEND"}
        other = RedisBackend("other", params)
        other.lookup(lock_id=warm.lock_id)  # loads the scripts on that client
        count("lookup by id", lambda: other.lookup(lock_id=held.lock_id))
        count("extend", lambda: other.extend(held.lock_id, TTL))
        held_again = backend.acquire("trips:again", TTL)
        other.lookup(lock_id=held_again.lock_id)  # other's connection to that node
        count("own release", lambda: backend.release(held.lock_id))
        count("release again", lambda: backend.release(held.lock_id))
        count("release", lambda: other.release(held_again.lock_id))
        other.close()
    finally:
        harness.close()
    node = node_of(backend, backend.lock_key("trips:warm"))
    again = node_of(backend, backend.lock_key("trips:again"))
    assert trips["acquire"] == [(node, "EVALSHA")]
    assert trips["lookup by key"] == [(node, "EVALSHA")]
    assert trips["is_locked"] == [(node, "EVALSHA")]
    for name in ("own lookup by id", "own extend", "own release"):
        assert trips[name] == [(node, "EVALSHA")], (name, trips[name])
    for name in ("lookup by id", "extend"):
        assert trips[name] == [(node, "GET"), (node, "EVALSHA")], (name, trips[name])
    assert trips["release"] == [(again, "GET"), (again, "EVALSHA")]
    assert trips["release again"] == [(node, "GET")]  # the index is gone: not found


def test_round_trips_with_wait_replicas(redis_cluster_harness):
    # The script and WAIT go in one send on the slot's node: still one round trip
    # for acquire, release and extend (the acquiring object knows the lock hash).
    harness = RedisClusterHarness(
        CLIENT_KWARGS={"connection_class": CountingConnection}, WAIT_REPLICAS=1
    )
    backend = harness.redis
    try:
        warm = backend.acquire("trips:wait", TTL)
        backend.release(warm.lock_id)
        CountingConnection.sent.clear()
        held = backend.acquire("trips:wait", TTL)
        acquire = list(CountingConnection.sent)
        CountingConnection.sent.clear()
        assert backend.extend(held.lock_id, TTL).ok
        extend = list(CountingConnection.sent)
        CountingConnection.sent.clear()
        assert backend.release(held.lock_id).ok
        release = list(CountingConnection.sent)
    finally:
        harness.close()
    node = node_of(backend, backend.lock_key("trips:wait"))
    assert acquire == [(node, "EVALSHA")]
    assert extend == release == [(node, "EVALSHA")]  # script and WAIT in one send


# ---------------------------------------------------------------- fence floors
def test_the_floor_is_per_slot_and_reported_as_the_smallest(ch):
    backend = ch.redis
    started = time.perf_counter()
    assert backend.raise_fence_floor(50) == 50
    raise_s = time.perf_counter() - started
    started = time.perf_counter()
    assert backend.fence_floor() == 50
    read_s = time.perf_counter() - started
    print(f"raise every slot's floor: {raise_s * 1000:.0f} ms; read them: {read_s * 1000:.0f} ms")
    # One slot raised further (compaction does that): the alias's floor is the minimum.
    slot = slots.key_slot(backend.lock_key("floor:one"))
    backend.client.set(backend.slot_floor_key(slot), 80)
    assert backend.fence_floor() == 50
    assert backend.acquire("floor:one", TTL).fence == "000000000000081"
    assert backend.acquire("floor:other", TTL).fence == "000000000000051"


def test_compaction_raises_only_the_slots_of_its_counters_before_deleting(ch, monkeypatch):
    backend = ch.redis
    for key in ("compact:a", "compact:b"):
        held = backend.acquire(key, TTL)
        backend.release(held.lock_id)
    ch.set_fence("compact:b", 30)
    ch.advance(10_000)
    raised: list[tuple[list[int], int]] = []
    original = backend._raise_slot_floors

    def spy(slot_list, fence):
        slot_list = list(slot_list)
        raised.append((slot_list, fence))
        return original(slot_list, fence)

    monkeypatch.setattr(backend, "_raise_slot_floors", spy)
    assert sum(backend.compact_fences(idle_ms=5_000)) == 2
    slot_a, slot_b = (slots.key_slot(backend.lock_key(k)) for k in ("compact:a", "compact:b"))
    # Before each delete, the slots of that batch's counters (a batch is one SCAN reply
    # of one primary: here each key is alone in its batch, unless both share a node).
    before = raised[:-1]
    if len(before) == 2:
        assert sorted(before) == sorted([([slot_a], 1), ([slot_b], 30)])
    else:
        assert before == [(sorted([slot_a, slot_b]), 30)]
    assert raised[-1] == (list(range(slots.SLOTS)), 30)  # at the end: every slot
    assert backend.fence_state().floor == 30
    assert backend.acquire("compact:a", TTL).fence == "000000000000031"


# ------------------------------------------------------------------------ WAIT
def test_wait_replicas_runs_on_the_slots_node(redis_cluster_harness):
    harness = RedisClusterHarness(WAIT_REPLICAS=1, WAIT_TIMEOUT_MS=1000)
    backend = harness.redis
    try:
        for n in range(6):  # several slots, so several nodes
            key = f"wait:{n}"
            held = backend.acquire(key, TTL)
            assert held.ok
            cluster: Any = backend.client
            replica = cluster.nodes_manager.slots_cache[slots.key_slot(backend.lock_key(key))][1]
            with redis.Redis(host=replica.host, port=replica.port) as client:
                client.execute_command("READONLY")
                assert client.hget(backend.lock_key(key), "i") == held.lock_id.encode()
            assert backend.extend(held.lock_id, TTL).ok
            assert backend.release(held.lock_id).ok

        async def in_a_loop() -> None:
            taken = await backend.aacquire("wait:async", TTL)
            assert taken.ok
            assert (await backend.aextend(taken.lock_id, TTL)).ok
            assert (await backend.arelease(taken.lock_id)).ok
            await backend.clients.aclose()

        asyncio.run(in_a_loop())
    finally:
        harness.close()


def test_too_few_replicas_undo_the_acquire_on_a_cluster(redis_cluster_harness):
    harness = RedisClusterHarness(WAIT_REPLICAS=2, WAIT_TIMEOUT_MS=100)
    try:
        with pytest.raises(ServiceUnavailable, match="released again"):
            harness.redis.acquire("wait:few", TTL)
        assert harness.redis.lookup(key="wait:few") is None
    finally:
        harness.close()


# --------------------------------------------------------------------- async
def test_the_async_operations_on_a_cluster(ch):
    backend = ch.redis

    async def run() -> None:
        held = await backend.aacquire("async:k", TTL)
        assert slots.lock_id_slot(held.lock_id) == slots.key_slot(backend.lock_key("async:k"))
        record = await backend.alookup(lock_id=held.lock_id)
        assert record is not None and record.fence == held.fence
        assert (await backend.aextend(held.lock_id, TTL)).ok
        assert (await backend.arelease(held.lock_id)).ok
        assert (await backend.arelease(held.lock_id)).reason == "not-found"
        await backend.clients.aclose()

    asyncio.run(run())


# ------------------------------------------------------------------ wake-ups
def test_a_release_wakes_a_waiter_through_the_slots_shard_channel(ch):
    backend = ch.redis
    from django_syncguard.waiting import WaitTicket

    for n in range(6):  # keys on several primaries: one subscriber connection each
        key = f"wake:{n}"
        held = backend.acquire(key, TTL)
        mine = WaitTicket.new()
        listener = backend.wake_ups.listen(key, mine.id)
        try:
            assert not backend.acquire(key, TTL, ticket=mine).ok
            assert backend.release(held.lock_id).ok
            assert listener.wait(WAKE_S, None) is True
            assert backend.acquire(key, TTL, ticket=mine).ok
        finally:
            listener.close()
    assert len(backend.wake_ups._connection.nodes) >= 2


def test_a_slot_moving_away_is_a_lost_connection_then_resubscribed(ch, redis_cluster):
    from django_syncguard.waiting import WaitTicket

    backend = ch.redis
    key = "{wmove}:k"
    slot = slots.key_slot(backend.lock_key(key))
    source = redis_cluster.owner(slot)
    target = next(p for p in redis_cluster.primaries() if p != source)
    held = backend.acquire(key, TTL)
    first = WaitTicket.new()
    listener = backend.wake_ups.listen(key, first.id)
    try:
        assert listener.healthy
        generation = backend.wake_ups.generation
        redis_cluster.migrate_slot(slot, target)
        # The source dropped the shard channel (its sunsubscribe): every waiter is
        # woken to poll, as after a lost connection; no release happened.
        assert listener.wait(WAKE_S, None) is True
        assert backend.wake_ups.generation > generation
        assert not listener.healthy
        assert backend.lookup(key=key) is not None  # still held: the wake was the loss
    finally:
        listener.close()
    assert backend.wake_ups.wait_connected(WAKE_S)
    second = WaitTicket.new()
    listener = backend.wake_ups.listen(key, second.id)
    try:
        assert listener.healthy  # subscribed on the slot's new owner
        assert not backend.acquire(key, TTL, ticket=second).ok
        assert backend.release(held.lock_id).ok
        assert listener.wait(WAKE_S, None) is True
        assert backend.acquire(key, TTL, ticket=second).ok
    finally:
        listener.close()
        redis_cluster.migrate_slot(slot, source)


# --------------------------------------------------- migration and failover
def _spawn_cyclers(children, url, prefix, mode, keys, processes=4):
    ctx = children.ctx
    holders = ctx.Array("i", len(keys))
    sequence, cycles, stop = ctx.Value("q", 0), ctx.Value("q", 0), ctx.Event()
    results = ctx.Queue()
    for _ in range(processes):
        children.start(
            cluster_workers.cycle,
            url,
            prefix,
            mode,
            keys,
            holders,
            sequence,
            cycles,
            stop,
            results,
        )
    # The parent keeps every shared object until the children have unpickled them.
    children.shared = (holders, sequence)
    return cycles, stop, results


def _wait_cycles(cycles, results, more: int, timeout_s: float = 120) -> None:
    """Until the workers made ``more`` cycles; a worker that stopped fails the test."""
    target = cycles.value + more
    deadline = time.monotonic() + timeout_s
    while cycles.value < target:
        if not results.empty():  # a worker reports only when it stops: here, an error
            raise AssertionError(results.get())
        assert time.monotonic() < deadline, f"the workers made {cycles.value} of {target} cycles"
        time.sleep(0.01)  # other processes' progress: a shared counter, polled


def _collect(results, processes=4):
    held, errors = [], []
    for _ in range(processes):
        report = results.get(timeout=60)
        if isinstance(report, BaseException):
            raise report
        held += report[0]
        errors += report[1]
    return held, errors


def _fences_increase(held):
    by_key = defaultdict(list)
    for key, _order, fence in sorted(held, key=lambda row: row[1]):
        by_key[key].append(fence)
    for key, fences in by_key.items():
        assert fences == sorted(fences) and len(set(fences)) == len(fences), key


def test_a_slot_migrated_under_traffic_gives_no_double_holder(ch, redis_cluster):
    backend = ch.redis
    keys = [f"{{mig}}:{n}" for n in range(4)]  # one hash tag: one slot
    slot = slots.key_slot(backend.lock_key(keys[0]))
    assert {slots.key_slot(backend.lock_key(k)) for k in keys} == {slot}
    source = redis_cluster.owner(slot)
    target = next(p for p in redis_cluster.primaries() if p != source)
    children = Children()
    try:
        cycles, stop, results = _spawn_cyclers(children, ch.url, ch.prefix, "counter", keys)
        _wait_cycles(cycles, results, 200)
        redis_cluster.migrate_slot(slot, target)
        assert redis_cluster.owner(slot) == target
        _wait_cycles(cycles, results, 200)
        redis_cluster.migrate_slot(slot, source)  # and back, under traffic again
        _wait_cycles(cycles, results, 200)
        stop.set()
        held, errors = _collect(results)
    finally:
        children.terminate()
    assert set(errors) <= {"ServiceUnavailable", "NetworkTimeout"}, errors
    assert len(held) >= 600
    _fences_increase(held)  # counter mode: nothing was lost, nothing repeated
    print(f"migration under traffic: {len(held)} acquisitions, errors {sorted(errors)}")


def test_a_primary_failing_over_is_survived(ch, redis_cluster):
    # Last in the file: the session's cluster keeps the new primary (and, on the trial
    # cluster, loses the old node).
    backend = RedisBackend(
        "failover",
        {
            "LOCATION": ch.url,
            "KEY_PREFIX": ch.prefix,
            "OPTIONS": {"CLUSTER": True, "FENCES": "clock", "OPERATION_TIMEOUT_MS": 1000},
        },
    )
    port = redis_cluster.primaries()[-1]
    candidates = (f"fo:{n}" for n in range(200))
    keys = [k for k in candidates if node_of(backend, backend.lock_key(k)) == port][:8]
    assert keys
    last: dict[str, int] = {}
    errors: list[BaseException] = []
    successes_after = 0
    failed_over = threading.Event()

    def fail_over() -> None:
        redis_cluster.fail_over_primary(port)
        failed_over.set()

    thread = threading.Thread(target=fail_over)
    rounds = 0
    try:
        for key in keys:
            held = backend.acquire(key, 5_000)
            last[key] = int(held.fence)
            backend.release(held.lock_id)
        thread.start()
        deadline = time.monotonic() + 120
        while successes_after < 3 * len(keys):
            assert time.monotonic() < deadline, (successes_after, errors[-3:])
            key = keys[rounds % len(keys)]
            rounds += 1
            done = failed_over.is_set()
            try:
                held = backend.acquire(key, 5_000)
                if held.ok:
                    assert int(held.fence) > last[key], (key, held.fence, last[key])
                    last[key] = int(held.fence)
                    backend.release(held.lock_id)
                    successes_after += done
            except (ServiceUnavailable, NetworkTimeout) as exc:
                errors.append(exc)
    finally:
        thread.join(120)
        backend.close()
    assert errors, "the failover went unnoticed: was the primary killed?"
    print(f"failover: {len(errors)} operations failed, all ServiceUnavailable / NetworkTimeout")
