"""The release script's server time against the length of the queue it grants from.

    .venv/bin/python bench/grant_scaling.py [--waiters 1,8,32,128] [--cycles 1500]

Starts a throw-away ``redis-server`` on a free loopback port. For each queue length
N, one key is held and N tickets queue behind it; then, ``--cycles`` times: the holder
releases (its process watching the grant, as a process whose wake-up connection is
up does), the grantee takes its grant (its ticketed acquire), and a new ticket queues
at the end, so the queue stays N long. Two ways side by side in one run, cycle by
cycle in turn on two keys:

- ``hinted``: as the scripts run (a release reads the head hint 'h' and three fields
  of the waiter it names, see ``specs/backends/redis.md``, The head hint);
- ``full read``: the same, with 'h' deleted before each release, so that the
  release reads the whole queue (HGETALL), as every release did before the hint.

Each release script's duration comes from the server's ``SLOWLOG`` (every call is
logged: ``slowlog-log-slower-than 0``): the time Redis spent in it, which is the
hand-off's critical path on the server. Printed: p50 and p90 per N and way.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support.servers import RedisServer  # noqa: E402

TTL_MS = 60_000


class Queue:
    """One key held, with ``waiters`` tickets queued behind its holder."""

    def __init__(self, backend: Any, key: str, waiters: int) -> None:
        from django_syncguard.waiting import WaitTicket

        self.backend, self.key, self.new_ticket = backend, key, WaitTicket.new
        self.holder = backend.acquire(key, TTL_MS).lock_id
        self.tickets = [self.queued() for _ in range(waiters)]

    def queued(self) -> Any:
        ticket = self.new_ticket()
        assert not self.backend.acquire(self.key, TTL_MS, ticket=ticket).ok
        return ticket

    def cycle(self, full_read: bool) -> None:
        backend = self.backend
        if full_read:
            backend.client.hdel(backend.lock_key(self.key), "h")
        # The release as a process that watches its grants sends it ("1"): the reply
        # names the ticket the key went to.
        reply = backend._call("release", backend._id_keys(self.holder), [self.holder, 1000, "1"])
        assert int(reply[0]) == 1 and reply[1].decode() == self.tickets[0].id, reply
        granted = backend.acquire(self.key, TTL_MS, ticket=self.tickets.pop(0))
        assert granted.ok, granted
        self.holder = granted.lock_id
        self.tickets.append(self.queued())


def log_every_call(client: Any, max_len: int = 10_000_000) -> None:
    """Have the server log every command in its ``SLOWLOG`` (emptied first), with its
    own time spent in it: read back by :func:`release_durations`."""
    client.config_set("slowlog-max-len", max_len)
    client.config_set("slowlog-log-slower-than", 0)
    client.slowlog_reset()


def release_durations(client: Any, script: str | None = None) -> list[tuple[str, int]]:
    """The calls of ``script`` (default: the release script) in the server's slow
    log: (its first key, µs)."""
    from django_syncguard.backends.redis.scripts import RELEASE

    digest = hashlib.sha1((script or RELEASE).encode()).hexdigest().encode()
    return [
        (words[3].decode(), entry["duration"])
        for entry in client.slowlog_get(10_000_000)
        if (words := entry["command"].split())[:2] == [b"EVALSHA", digest]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiters", default="1,8,32,128")
    parser.add_argument("--cycles", type=int, default=1500)
    args = parser.parse_args()
    from bench.common import configure_django

    configure_django({})
    from django_syncguard.backends.redis import RedisBackend

    server = RedisServer().start()
    rows = []
    try:
        url = f"redis://127.0.0.1:{server.port}/0"
        for n in (int(part) for part in args.waiters.split(",")):
            # A backend per way: its index keys carry its prefix, and so do the
            # release calls in the slow log.
            ways = {"hinted": f"h{n}", "full read": f"f{n}"}
            backends = {
                way: RedisBackend(f"b-{prefix}", {"LOCATION": url, "KEY_PREFIX": prefix})
                for way, prefix in ways.items()
            }
            queues = {way: Queue(backend, "hot", n) for way, backend in backends.items()}
            for way, queue in queues.items():  # untimed: the scripts get loaded
                queue.cycle(full_read=way == "full read")
            client = backends["hinted"].client
            log_every_call(client)
            for _ in range(args.cycles):
                for way, queue in queues.items():
                    queue.cycle(full_read=way == "full read")
            client.config_set("slowlog-log-slower-than", 10_000)
            index_heads = {backend.index_key(""): way for way, backend in backends.items()}
            found: dict[str, list[int]] = {way: [] for way in ways}
            for index, duration in release_durations(client):
                for head, way in index_heads.items():
                    if index.startswith(head):
                        found[way].append(duration)
            for way, values in found.items():
                values.sort()
                p90 = values[int(len(values) * 0.9)]
                rows.append((n, way, len(values), statistics.median(values), p90))
            for backend in backends.values():
                backend.close()
    finally:
        server.stop()
    print(f"# Release script time on the server, by queue length ({args.cycles} cycles each)\n")
    print("| waiters | release | calls | p50 µs | p90 µs |\n|--:|---|--:|--:|--:|")
    for n, way, calls, p50, p90 in rows:
        print(f"| {n} | {way} | {calls} | {p50:g} | {p90:g} |")


if __name__ == "__main__":
    main()
