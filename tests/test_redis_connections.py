"""Each thread's own connection on a plain Redis server (``client.ThreadConnections``,
decision 54): taken from the pool once, kept between the thread's script calls, given
back when the thread ends, at most half the pool held, and never shared with a forked
child (that test is in ``tests/test_fork.py``)."""

from __future__ import annotations

import os
import select
import socket
import threading
import uuid
from collections.abc import Iterator
from functools import partial

import pytest
import redis

from django_syncguard.backends import sockets
from django_syncguard.backends.redis import RedisBackend
from django_syncguard.backends.redis.client import RedisClients, _streaming
from tests.support.faults import wait_until
from tests.support.servers import RedisServer


@pytest.fixture
def backend(redis_server: RedisServer) -> Iterator[RedisBackend]:
    made = backend_on(redis_server)
    yield made
    made.close()


def backend_on(server: RedisServer, **options: object) -> RedisBackend:
    prefix = f"held{uuid.uuid4().hex[:6]}"
    return RedisBackend("held", {"LOCATION": server.url, "KEY_PREFIX": prefix, "OPTIONS": options})


def client_id(backend: RedisBackend) -> int:
    """The server's id of the connection this thread's script calls go out on."""
    return int(backend.clients.send(backend.client, "CLIENT", "ID"))


def cycle(backend: RedisBackend, key: str | None = None) -> None:
    held = backend.acquire(key or uuid.uuid4().hex, 60_000)
    assert held.ok and backend.release(held.lock_id).ok


def count_hand_outs(backend: RedisBackend, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each ``get_connection`` of the backend's pool appends to the list returned."""
    pool, calls = backend.client.connection_pool, []
    get_connection = pool.get_connection

    def counted(*args, **kwargs):
        calls.append(1)
        return get_connection(*args, **kwargs)

    monkeypatch.setattr(pool, "get_connection", counted)
    return calls


def in_threads(count: int, work, *, keep_alive: threading.Event | None = None) -> None:
    """``work()`` in ``count`` threads at once; with ``keep_alive``, each thread stays
    alive after its work until the event is set (this returns once all worked)."""
    done = threading.Barrier(count + 1)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            errors.append(exc)
        done.wait()
        if keep_alive is not None:
            keep_alive.wait()

    threads = [threading.Thread(target=run) for _ in range(count)]
    for thread in threads:
        thread.start()
    done.wait()
    if keep_alive is None:
        for thread in threads:
            thread.join()
    assert errors == []


def test_a_thread_takes_one_connection_from_the_pool_for_all_its_calls(backend, monkeypatch):
    cycle(backend)  # the scripts are loaded
    hand_outs = count_hand_outs(backend, monkeypatch)
    first = client_id(backend)
    for _ in range(20):
        cycle(backend)
    assert client_id(backend) == first
    assert hand_outs == []  # 40 scripts and 2 CLIENT IDs, no call on the pool
    assert backend.clients.threads is not None and backend.clients.threads.held == 1


def test_a_thread_that_ends_gives_its_connection_back(backend, redis_server):
    server = redis.Redis.from_url(redis_server.url)
    ids: list[int] = []

    def work() -> None:
        cycle(backend)
        ids.append(client_id(backend))

    in_threads(1, work)  # loads the scripts, perhaps on a second pooled connection
    opened = server.info("stats")["total_connections_received"]
    for _ in range(10):  # one after the other: each takes the one the last gave back
        in_threads(1, work)
        assert backend.clients.threads is not None and backend.clients.threads.held == 0
    assert server.info("stats")["total_connections_received"] == opened  # none opened
    assert set(ids) == {ids[0]}
    assert len(backend.client.connection_pool._in_use_connections) == 0
    server.close()


def test_at_most_half_the_pool_is_held_and_the_others_take_the_pooled_path(
    redis_server, monkeypatch
):
    backend = backend_on(redis_server, MAX_CONNECTIONS=4)
    try:
        cycle(backend)  # this thread holds 1 of the 2
        hand_outs = count_hand_outs(backend, monkeypatch)
        release = threading.Event()
        try:
            in_threads(2, lambda: cycle(backend), keep_alive=release)
            threads = backend.clients.threads
            assert threads is not None and threads.held == 2
            # One thread held the second place (one hand-out); the other sent its
            # acquire and its release through the pool (two more).
            assert len(hand_outs) == 3
        finally:
            release.set()
        cycle(backend)  # this thread still holds its own: no hand-out
        assert len(hand_outs) == 3
    finally:
        backend.close()


def test_the_limit_is_half_of_what_the_pool_allows_however_it_was_set(redis_server):
    # MAX_CONNECTIONS, CLIENT_KWARGS and the URL's query can all size the pool.
    for options, url, limit in [
        ({"MAX_CONNECTIONS": 6}, redis_server.url, 3),
        ({"CLIENT_KWARGS": {"max_connections": 2}}, redis_server.url, 1),
        ({}, redis_server.url + "?max_connections=4", 2),
    ]:
        made = RedisBackend("sized", {"LOCATION": url, "OPTIONS": options})
        try:
            threads = made.clients.threads
            assert threads is not None and threads.limit == limit
            assert made.client.connection_pool.max_connections == 2 * limit
        finally:
            made.close()


def test_a_process_the_object_was_not_built_in_takes_the_pooled_path(backend, monkeypatch):
    # A fork that ran no hooks (uWSGI without its fork hooks): the object is the
    # parent's, and so is the forking thread's held connection, still in its local
    # storage. That thread and any other take the pooled path.
    cycle(backend)
    hand_outs = count_hand_outs(backend, monkeypatch)
    pid = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: pid + 1)  # what the child looks like
    threads = backend.clients.threads
    assert threads is not None
    calls = []
    for work in (lambda: cycle(backend), lambda: in_threads(1, lambda: cycle(backend))):
        before = len(hand_outs)
        work()
        calls.append(len(hand_outs) - before)
    assert calls == [2, 2]  # the acquire's and the release's, from the pool, each time
    assert threads.held == 1  # still the parent's one


def test_an_interrupt_between_request_and_reply_closes_the_connection(backend):
    # redis-py closes a connection interrupted inside its read; an interrupt between
    # the send and the read leaves the reply on its way, and the next call must not
    # read it as its own. BLPOP answers (nil) only after 200 ms.
    first = client_id(backend)
    threads = backend.clients.threads
    assert threads is not None
    connection = threads._local.held.connection
    read = connection.read_response
    connection.read_response = lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        backend.clients.send(backend.client, "BLPOP", f"nothing:{uuid.uuid4().hex}", "0.2")
    connection.read_response = read
    assert client_id(backend) != first  # its own reply, on a new connection


def test_a_script_the_server_lost_is_loaded_again_on_the_thread_s_connection(backend, monkeypatch):
    cycle(backend)
    first = client_id(backend)
    backend.client.script_flush()  # as a restart does
    hand_outs = count_hand_outs(backend, monkeypatch)
    cycle(backend)  # NOSCRIPT, SCRIPT LOAD, EVALSHA: all on its own connection
    assert hand_outs == [] and client_id(backend) == first


def test_a_pool_of_one_connection_is_not_held(redis_server):
    backend = backend_on(redis_server, MAX_CONNECTIONS=1)
    try:
        assert backend.clients.threads is None
        backend.client.script_flush()
        cycle(backend)  # the EVALSHA's connection is back in the pool for SCRIPT LOAD
        cycle(backend)
    finally:
        backend.close()


def test_after_a_timeout_the_thread_s_next_call_connects_again(backend):
    # What the pool checked at each hand-out, done by the connection itself: a reply
    # that did not come closes it (tests/test_redis_backend.py shows no late reply is
    # read), and the next call through it opens a new one.
    first = client_id(backend)
    threads = backend.clients.threads
    assert threads is not None
    threads._local.held.connection.disconnect()  # as a timeout or a drop leaves it
    assert client_id(backend) != first
    cycle(backend)
    assert threads.held == 1


def test_a_connection_the_server_closed_between_calls_is_opened_again(backend, redis_server):
    # A restart, CLIENT KILL, an idle timeout: the pool found such a connection
    # readable (end of stream) before handing it out; the thread checks the same.
    first = client_id(backend)
    cycle(backend)
    server = redis.Redis.from_url(redis_server.url)
    assert server.client_kill_filter(_id=first) == 1
    server.close()
    cycle(backend)  # no ServiceUnavailable for the dead connection
    assert client_id(backend) != first


def test_without_poll_a_closed_connection_is_found_by_select(backend, redis_server, monkeypatch):
    monkeypatch.setattr(sockets, "HAS_POLL", False)  # as on Windows
    test_a_connection_the_server_closed_between_calls_is_opened_again(backend, redis_server)


def test_a_connection_closed_again_after_it_was_opened_again_is_found_again(backend, redis_server):
    # Two kills in a row: the check keeps its poll object between calls (KeptPoll)
    # and still finds the second on the connection opened after the first.
    server = redis.Redis.from_url(redis_server.url)
    try:
        for _ in range(2):
            first = client_id(backend)
            assert server.client_kill_filter(_id=first) == 1
            cycle(backend)
            assert client_id(backend) != first
    finally:
        server.close()


def test_a_kept_poll_object_follows_a_new_descriptor():
    # Built again for another descriptor: a connection opened again may get another
    # number, and polling the old one would answer for a socket it no longer is.
    kept = sockets.KeptPoll()
    first, first_peer = socket.socketpair()
    second, second_peer = socket.socketpair()
    try:
        assert kept.readable(first.fileno()) is False
        first_peer.send(b"x")
        assert kept.readable(first.fileno()) is True
        assert kept.readable(second.fileno()) is False  # not first's answer
        second_peer.send(b"x")
        assert kept.readable(second.fileno()) is True
    finally:
        for end in (first, first_peer, second, second_peer):
            end.close()


def test_a_held_connection_packs_its_commands_as_redis_py_does(backend, monkeypatch):
    # hiredis.pack_command directly, where redis-py packs with it anyway: the same
    # bytes as redis-py's own pack, for str (non-ASCII too) and int arguments, and the
    # held path sends them (the packer is asked for every call).
    cycle(backend)
    threads = backend.clients.threads
    assert threads is not None
    held = threads._local.held
    packer = held.connection._command_packer
    command = ("EVALSHA", "a" * 40, 1, "idx:Ω", 60_000, "façade owner", "")
    if type(packer).__name__ != "HiredisRespSerializer":
        assert held.pack is None  # redis-py's Python packer: its own path
        return
    assert held.pack(command) == b"".join(packer.pack(*command))
    packed, pack = [], held.pack
    monkeypatch.setattr(held, "pack", lambda c: packed.append(c) or pack(c))
    assert int(backend.clients.send(backend.client, "ECHO", 42)) == 42
    assert packed == [("ECHO", 42)]


def test_an_argument_hiredis_refuses_is_reported_as_redis_py_reports_it(backend):
    cycle(backend)
    with pytest.raises(redis.DataError):
        backend.clients.send(backend.client, "ECHO", object())
    assert int(backend.clients.send(backend.client, "ECHO", 7)) == 7  # still usable


def test_a_connection_class_that_sends_commands_itself_keeps_its_send(redis_server):
    sent: list[tuple] = []

    class Counting(redis.connection.Connection):
        def send_command(self, *args, **kwargs):
            sent.append(args)
            return super().send_command(*args, **kwargs)

    made = backend_on(redis_server, CLIENT_KWARGS={"connection_class": Counting})
    try:
        cycle(made)  # connects (HELLO, CLIENT SETINFO...), loads the scripts
        sent.clear()
        cycle(made)
        assert [args[0] for args in sent] == ["EVALSHA", "EVALSHA"]
    finally:
        made.close()


def test_a_connection_marked_for_reconnection_is_closed_before_its_next_call(backend):
    # redis-py 8 marks a connection when the server announces maintenance; its pool
    # closes it when it comes back. A held connection is closed before its next call.
    first = client_id(backend)
    threads = backend.clients.threads
    assert threads is not None
    held = threads._local.held
    mark = getattr(held.connection, "mark_for_reconnect", None)
    if mark is None:  # redis-py before 6 (the floor cell): no such notifications
        assert held.should_reconnect is None
        return
    mark()
    assert client_id(backend) != first


@pytest.mark.parametrize(
    ("location", "options"),
    [
        ("redis://service/0", {"SENTINELS": [("127.0.0.1", 1)]}),
        ("redis://127.0.0.1:1/0", {"CLUSTER": True}),
    ],
    ids=["sentinel", "cluster"],
)
def test_sentinel_and_cluster_clients_hold_no_connection_per_thread(location, options):
    # Sentinel's pool follows a failover connection by connection; a cluster client
    # has a pool per node. Both keep redis-py's own paths (nothing connects here).
    clients = RedisClients(
        "x", location, options, connect_timeout_ms=100, operation_timeout_ms=100, scripts={}
    )
    assert clients.threads is None


def test_a_resp3_push_waiting_on_a_held_connection_is_left_to_the_next_read(backend, redis_server):
    # redis-py 8 speaks RESP3 by default; an unasked push (a maintenance notification;
    # here a client-tracking invalidation) is no sign of a closed connection, and
    # redis-py's read skips it, as the pool leaves it.
    threads = backend.clients.threads
    assert threads is not None
    first = client_id(backend)
    connection = threads._local.held.connection
    if int(connection.protocol or 2) != 3:  # redis-py before 8 (the floor cell): RESP2
        return
    key = f"tracked:{uuid.uuid4().hex}"
    send = partial(backend.clients.send, backend.client)
    assert send("CLIENT", "TRACKING", "ON") in (b"OK", "OK")
    assert send("GET", key) is None  # the server now tracks it for this connection
    other = redis.Redis.from_url(redis_server.url)
    other.set(key, "changed")  # the server pushes an invalidation to our connection
    other.close()
    wait_until(lambda: select.select([connection._sock], [], [], 0)[0], 5, "the push")
    assert client_id(backend) == first  # kept, and the reply is the call's own
    assert send("GET", key) == b"changed"


def test_a_streaming_credential_provider_is_recognised():
    # redis-py re-authenticates such a client's connections when they go back to the
    # pool, which a held connection never does: those clients keep the pooled path.
    streaming = getattr(redis.credentials, "StreamingCredentialProvider", None)
    if streaming is None:  # redis-py before 5.3 (the floor cell): no such providers
        assert _streaming(object()) is False
        return

    class Renewing(streaming):
        def get_credentials(self):
            return ("user", "secret")

        def on_next(self, callback):
            pass

        def on_error(self, callback):
            pass

        def is_streaming(self):
            return True

    assert _streaming(Renewing()) is True
    assert _streaming(redis.credentials.UsernamePasswordCredentialProvider("u", "p")) is False


def test_a_single_connection_client_holds_no_connection_per_thread(redis_server):
    options = {"CLIENT_KWARGS": {"single_connection_client": True}}
    single = backend_on(redis_server, **options)
    try:
        assert single.clients.threads is None
        cycle(single)  # on the client's one connection (tests/test_redis_backend.py)
    finally:
        single.close()
