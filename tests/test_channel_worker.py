"""The channel worker's own rules (``waiting/channels.py``), on a channel in this process.

The transports' behaviour against their real servers is in the wake-up tests of each
backend; here an in-process channel lets a test hold the worker's thread still, hold
back a confirmation or refuse connections, to pin down the worker's bookkeeping at the
moments where waiter threads and its thread cross.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

import pytest

from django_syncguard import generate_lock_id
from django_syncguard.waiting import channels
from django_syncguard.waiting.channels import ChannelWorker, Confirmed, Event, State
from tests.support.faults import wait_until

WAKE_S = 10.0  # bound for something that must happen; never slept


class LocalConnection:
    """One connection to :class:`LocalChannel`: confirms what it is asked for at once,
    unless the channel holds that confirmation back."""

    def __init__(self, channel: LocalChannel, poke: Callable[[], None]) -> None:
        self.channel = channel
        self.poke = poke
        self.events: list[Event] = []
        self.lock = threading.Lock()
        self.broken = False

    def fileno(self) -> None:
        return None

    def subscribe(self, names: Sequence[str]) -> Iterable[str]:
        self.channel.wire.append(("SUBSCRIBE", *names))
        with self.lock:
            self.events += [Confirmed(n) for n in names if n not in self.channel.held]
        self.poke()
        return ()

    def unsubscribe(self, names: Sequence[str]) -> None:
        self.channel.wire.append(("UNSUBSCRIBE", *names))

    def receive(self) -> list[Event]:
        self.channel.in_receive.set()
        self.channel.gate.wait()  # a test holds the worker's thread here
        self.channel.in_receive.clear()
        if self.broken:
            raise ConnectionError("the test broke the connection")
        with self.lock:
            events, self.events = self.events, []
        return events

    def check(self) -> float:
        return 0.05

    def close(self) -> None:
        pass


class LocalChannel:
    """A transport whose server is this process."""

    confirms_on_listen = True
    idle_cap = 1
    max_channels = None
    connection_name = "local connection"
    let_waiters_read = False
    logger = logging.getLogger("tests.channel_worker")

    def __init__(self) -> None:
        self.wire: list[tuple[str, ...]] = []
        self.held: set[str] = set()  # confirmations held back
        self.refuse = False  # new connections fail
        self.connections: list[LocalConnection] = []
        self.gate = threading.Event()
        self.gate.set()
        self.in_receive = threading.Event()

    def channel(self, key: str) -> str:
        return f"ch:{key}"

    def connect(self, poke: Callable[[], None]) -> LocalConnection:
        if self.refuse:
            raise ConnectionError("the test refuses connections")
        connection = LocalConnection(self, poke)
        self.connections.append(connection)
        return connection

    def hold_the_worker(self) -> None:
        """Return once the worker's thread waits at the gate."""
        self.gate.clear()
        self.connections[-1].poke()
        assert self.in_receive.wait(WAKE_S)

    def let_go(self) -> None:
        self.gate.set()


@pytest.fixture
def local() -> Iterator[tuple[LocalChannel, ChannelWorker]]:
    transport = LocalChannel()
    worker = ChannelWorker("local", transport, timeout_s=WAKE_S)
    try:
        yield transport, worker
    finally:
        transport.let_go()
        worker.close()


def test_a_channel_forgotten_and_wanted_again_before_the_thread_turns_is_subscribed_anew(local):
    transport, worker = local
    first = worker.listen("a", generate_lock_id())
    second = worker.listen("b", generate_lock_id())
    assert (first.healthy, second.healthy) == (True, True)
    transport.hold_the_worker()
    first.close()  # "a" idle
    second.close()  # "b" idle too: beyond the cap of 1, "a" is forgotten at once
    assert worker.listening() == frozenset({"ch:b"})
    assert worker.want("a", wait=False) is False  # wanted again, on this thread
    transport.let_go()
    wait_until(lambda: "ch:a" in worker.listening(), WAKE_S, '"a" confirmed again')
    assert transport.wire[-2:] == [("UNSUBSCRIBE", "ch:a"), ("SUBSCRIBE", "ch:a")]


def test_a_reconnect_whose_unconfirmed_channel_goes_meanwhile_still_connects(local):
    transport, worker = local
    transport.idle_cap = 0  # a channel goes as soon as its last waiter does
    stays = worker.listen("a", generate_lock_id())
    leaves = worker.listen("b", generate_lock_id())
    transport.held.add("ch:b")  # the next connection never confirms "b"
    transport.connections[-1].broken = True
    transport.connections[-1].poke()
    wait_until(lambda: worker.listening() == {"ch:a"}, WAKE_S, '"a" confirmed again')
    assert worker.state is State.CONNECTING  # waiting for "b"
    leaves.close()  # "b" goes: nobody waits for its confirmation any more
    assert worker.wait_connected(WAKE_S) is True
    fresh = worker.listen("a", generate_lock_id())
    assert fresh.healthy is True
    stays.close()
    fresh.close()


def test_idle_channels_expire_while_no_connection_can_be_made(local, monkeypatch):
    monkeypatch.setattr(channels, "IDLE_CHANNEL_S", 0.2)
    transport, worker = local
    listener = worker.listen("a", generate_lock_id())
    transport.refuse = True
    transport.connections[-1].broken = True
    transport.connections[-1].poke()
    listener.close()  # "a" idle; the worker reconnects in vain
    wait_until(lambda: worker.state is State.IDLE, WAKE_S, "the thread ended")
    assert worker._thread is None
