"""Where a Redis hand-off's time goes, step by step, next to the FIFO floor (issue 24).

    .venv/bin/python bench/handoff_steps.py [--hold-ms 20] [--seconds 6] [--processes 8]
        [--backend redis|postgres] [--statements]

Starts a throw-away ``redis-server`` on a free loopback port, then, one after the
other, two runs of ``--processes`` spawned processes looping on one hot key with a
``--hold-ms`` body, as ``bench/contention.py``'s target cell does:

- ``syncguard``: ``lock(body, key=...)`` on the Redis backend with its defaults;
- ``FIFO floor``: ``bench/contention.py``'s ``FifoFloor`` (a queue list and a
  ``BLPOP`` per waiter; no fence, no expiry check, no index, no cancellation).

Each process stamps ``time.monotonic_ns()`` (one clock for every process on a host)
at points of the path, by wrapping the functions named below in its own copy of the
package. For every hand-off (a body left while another process's call waits, to the
next body entered, in another process) the report gives the p50, p90 and p99 of each
step:

| step | from | to |
|---|---|---|
| exit → release | the releaser's body returns | ``RedisBackend.release`` is called |
| release → send | | the release script's request is written to the socket |
| send → read | | the grantee's process starts reading its wake-up socket |
| read → parsed | | the socket's replies are parsed into events |
| parsed → delivered | | ``WakeUps.deliver`` has woken the waiter |
| delivered → returned | | the waiter's ``wait_for`` returns |
| returned → granted | | the wait session returns the grant as the acquire's result |
| granted → body | | the grantee's body starts |

For the floor: exit → release, release → send, send → ``BLPOP`` returned, → body.
Then, for ours, the time from the waiting thread's own last read of its socket to its
body, and that thread's CPU time (``time.thread_time_ns()``) over the same span: equal,
the grantee's path is work on a core; wall time above CPU time would be waiting for a
core or for the GIL.
The wrappers add a few microseconds to each step; both runs pay them alike. Each
release script's own time on the server (``SLOWLOG``, every call logged) is given
too, ours and the floor's. The stamps say where the time goes; ``bench/contention.py``
says how long a hand-off takes.

``--backend postgres``: the same for the database backend on a throw-away PostgreSQL
with its durable defaults (one run, ours only; the wake-up is a ``NOTIFY`` that the
waiting thread reads itself, as on Redis):

| step | from | to |
|---|---|---|
| exit → release | the releaser's body returns | ``DatabaseBackend.release`` is called |
| release → send | | the release statement is executed |
| send → read | | the grantee's listening connection is read |
| read → parsed | | the notifications are parsed into events |
| parsed → delivered | | ``WakeUps.deliver`` has woken the waiter |
| delivered → returned | | the waiter's ``Listener.wait`` returns |
| returned → granted | | the wait session returns the grant |
| granted → body | | the grantee's body starts |

and the release statement's round trip as its caller sees it (send to reply). Only the
hand-offs that went the whole way are counted (the number is printed): on PostgreSQL a
release that finds an acquire holding the key's advisory lock only wakes the waiter,
and that acquire grants instead. ``--statements`` loads ``pg_stat_statements`` with
``track = all`` and prints the server's time per statement, those inside the PL/pgSQL
functions too (the tracking itself adds to every time measured in that run).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import percentile_us  # noqa: E402
from bench.grant_scaling import log_every_call, release_durations  # noqa: E402
from tests.support.servers import RedisServer  # noqa: E402

OURS = ("exit", "release", "send", "read", "parsed", "delivered", "returned", "granted", "body")
FLOOR = ("exit", "release", "send", "popped", "body")
POSTGRES = ("exit", "release", "send", "read", "parsed", "delivered", "returned", "granted", "body")
Stamps = list[tuple[str, int]]
#: (stamp, monotonic ns, thread ident, that thread's CPU time in ns) at each "read" and
#: "body": whether the grantee's path is work or waiting (:func:`grantee_cpu`).
Marks = list[tuple[str, int, int, int]]


def around(owner: Any, name: str, record: Callable[[str], None], after: str) -> None:
    """Wrap ``owner.name`` so that it stamps ``after`` when it returns."""
    wrapped = getattr(owner, name)

    def stamped(*args: Any, **kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        record(after)
        return result

    setattr(owner, name, stamped)


def stamp_releasing(
    owner: Any, name: str, record: Callable[[str], None], local: threading.local
) -> None:
    """Stamp "release" when ``owner.name`` is called, and mark the thread as releasing
    (``local.releasing``) until it returns."""
    release = getattr(owner, name)

    def releasing(*args: Any, **kwargs: Any) -> Any:
        record("release")
        local.releasing = True
        try:
            return release(*args, **kwargs)
        finally:
            local.releasing = False

    setattr(owner, name, releasing)


def stamp_release(
    owner: Any, name: str, record: Callable[[str], None], local: threading.local
) -> None:
    """Stamp "release" when ``owner.name`` is called, and "send" when that call writes
    its request to a redis-py connection."""
    import redis.connection

    stamp_releasing(owner, name, record, local)
    connection = getattr(redis.connection, "AbstractConnection", redis.connection.Connection)
    send = connection.send_packed_command

    def sending(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(local, "releasing", False):
            record("send")
        return send(self, *args, **kwargs)

    connection.send_packed_command = sending


def stamp_ours(record: Callable[[str], None], local: threading.local) -> None:
    """Wrap the package's functions on the path so that they stamp."""
    from django_syncguard.backends.redis import client, wakeups
    from django_syncguard.backends.redis.backend import RedisBackend
    from django_syncguard.waiting import channels, listeners, session

    stamp_release(RedisBackend, "release", record, local)
    replies = client.SocketReader.replies

    def reading(self: Any) -> Any:
        record("read")
        yield from replies(self)

    client.SocketReader.replies = reading  # type: ignore[method-assign]
    around(wakeups._Subscriber, "receive", record, "parsed")
    around(listeners.WakeUps, "deliver", record, "delivered")
    around(channels.ChannelWorker, "wait_for", record, "returned")
    around(session.WaitSession, "attempt", record, "granted")


def stamp_postgres(record: Callable[[str], None], local: threading.local) -> None:
    """The database backend's path on PostgreSQL, stamped as :func:`stamp_ours` does
    Redis's; "released" when the release returns (its round trip, from "send")."""
    from django_syncguard.backends.database import postgresql, wakeups
    from django_syncguard.backends.database.backend import DatabaseBackend
    from django_syncguard.waiting import listeners, session

    around(DatabaseBackend, "release", record, "released")
    stamp_releasing(DatabaseBackend, "release", record, local)
    fetch_one = postgresql.fetch_one

    def fetching(cursor: Any, sql: str, params: list[Any]) -> Any:
        if sql == postgresql.RELEASE and getattr(local, "releasing", False):
            record("send")
        return fetch_one(cursor, sql, params)

    postgresql.fetch_one = fetching
    receive = wakeups._Listening.receive

    def receiving(self: Any) -> Any:
        record("read")
        return receive(self)

    wakeups._Listening.receive = receiving  # type: ignore[method-assign]
    around(wakeups._Listening, "receive", record, "parsed")
    around(listeners.WakeUps, "deliver", record, "delivered")
    around(listeners.Listener, "wait", record, "returned")
    around(session.WaitSession, "attempt", record, "granted")


def floor_method(url: str, record: Callable[[str], None], local: threading.local) -> Any:
    import redis.commands.core

    import bench.contention as contention

    class Unmetered:
        def attempt(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        def op(self, what: str) -> None:
            pass

    contention.METER = Unmetered()  # type: ignore[assignment]
    method = contention.FifoFloor(contention.Target("redis", url))
    around(redis.commands.core.ListCommands, "blpop", record, "popped")
    stamp_release(method, "release", record, local)
    return method


def child(kind: str, url: str, hold_s: float, start_ns: int, seconds: float, out: Any) -> None:
    from bench.common import configure_django, postgres_database

    if kind == "postgres":  # url: the server's port
        database = {"BACKEND": "django_syncguard.backends.database.DatabaseBackend"}
        configure_django(
            {"default": postgres_database(int(url), name="bench")}, {"default": database}
        )
    else:
        location = {"BACKEND": "django_syncguard.backends.redis.RedisBackend", "LOCATION": url}
        configure_django({}, {"default": location})
    stamps: Stamps = []
    marks: Marks = []
    local = threading.local()

    def record(name: str) -> None:
        now = time.monotonic_ns()
        stamps.append((name, now))
        if name in ("read", "body"):
            marks.append((name, now, threading.get_ident(), time.thread_time_ns()))

    def body() -> None:
        record("body")
        time.sleep(hold_s)
        record("exit")

    if kind in ("ours", "postgres"):
        from django_syncguard import lock

        (stamp_ours if kind == "ours" else stamp_postgres)(record, local)

        def hold(key: str) -> None:
            lock(body, key=key, ttl_ms=10_000, timeout_ms=5_000)

    else:
        method = floor_method(url, record, local)

        def hold(key: str) -> None:
            method.hold(key, body, filler=False)

    hold(f"warm-{os.getpid()}")  # connections, scripts, the wake-up thread
    stamps.clear()
    marks.clear()
    time.sleep(max(start_ns - time.monotonic_ns(), 0) / 1e9)
    end = start_ns + int(seconds * 1e9)
    while time.monotonic_ns() < end:
        hold("hot")
    out.put((os.getpid(), stamps, marks))


def steps(runs: dict[int, Stamps], chain: tuple[str, ...]) -> dict[str, list[int]]:
    """Per hand-off, the time of each step of ``chain`` (ns): from the releaser's exit
    to the first of the next step in its process, then the last of each step in the
    grantee's process before its body."""
    bodies = sorted(
        (t, pid) for pid, stamps in runs.items() for name, t in stamps if name == "body"
    )
    entered = [t for t, _ in bodies]
    by_pid = {pid: sorted((t, name) for name, t in stamps) for pid, stamps in runs.items()}
    found: dict[str, list[int]] = {f"{a} → {b}": [] for a, b in itertools.pairwise(chain)}
    found["hand-off"] = []
    for pid, stamps in by_pid.items():
        for exit_ns, name in stamps:
            if name != "exit":
                continue
            i = bisect.bisect_right(entered, exit_ns)
            if i == len(bodies) or bodies[i][1] == pid or bodies[i][0] - exit_ns > 50_000_000:
                continue  # the releaser barged in again, or nobody was waiting
            body_ns, grantee = bodies[i]
            times = [exit_ns]
            for step in chain[1:-1]:
                own = stamps if step in ("release", "send") else by_pid[grantee]
                inside = [t for t, n in own if n == step and times[-1] <= t <= body_ns]
                if not inside:
                    break
                times.append(inside[0] if own is stamps else inside[-1])
            else:
                times.append(body_ns)
                for (a, b), (t0, t1) in zip(
                    itertools.pairwise(chain), itertools.pairwise(times), strict=True
                ):
                    found[f"{a} → {b}"].append(t1 - t0)
                found["hand-off"].append(body_ns - exit_ns)
    return found


def grantee_cpu(marks: dict[int, Marks]) -> tuple[list[int], list[int]]:
    """For each body entered after a wait whose wake-up its own thread read: the time
    from that thread's last read to the body, and the thread's CPU time over it (ns).
    Equal, the path is work on the CPU; wall time above CPU time is waiting (for the
    GIL, or for a core)."""
    walls: list[int] = []
    cpus: list[int] = []
    for process_marks in marks.values():
        reads: dict[int, tuple[int, int]] = {}
        for name, t, thread, cpu in process_marks:
            if name == "read":
                reads[thread] = (t, cpu)
                continue
            read = reads.get(thread)
            if read is not None:
                walls.append(t - read[0])
                cpus.append(cpu - read[1])
            reads.clear()
    return walls, cpus


def run(
    kind: str, url: str, args: argparse.Namespace
) -> tuple[dict[int, Stamps], dict[int, Marks]]:
    """Each process's stamps and marks, by process id."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    start_ns = time.monotonic_ns() + int(5e9)
    hold_s = args.hold_ms / 1000
    processes = [
        context.Process(target=child, args=(kind, url, hold_s, start_ns, args.seconds, out))
        for _ in range(args.processes)
    ]
    for process in processes:
        process.start()
    runs, marks = {}, {}
    for _ in processes:
        pid, runs[pid], marks[pid] = out.get(timeout=120)
    for process in processes:
        process.join(30)
    return runs, marks


def spread_us(values: list[int]) -> str:
    """``p50 / p90 / p99`` of ``values`` (ns) in µs."""
    if not values:
        return "-"
    return " / ".join(f"{percentile_us(values, q):,.0f}" for q in (50, 90, 99))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold-ms", type=float, default=20)
    parser.add_argument("--seconds", type=float, default=6)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--backend", choices=("redis", "postgres"), default="redis")
    parser.add_argument(
        "--statements",
        action="store_true",
        help="postgres: also the server's time per statement (pg_stat_statements)",
    )
    args = parser.parse_args()
    if args.backend == "postgres":
        postgres_main(args)
        return
    import redis

    server = RedisServer().start()
    try:
        url = f"redis://127.0.0.1:{server.port}/0"
        client = redis.Redis.from_url(url)
        log_every_call(client)
        runs, marks = run("ours", url, args)
        ours = steps(runs, OURS)
        script = [duration * 1000 for _, duration in release_durations(client)]  # ns
        client.slowlog_reset()
        floor = steps(run("fifo", url, args)[0], FLOOR)
        floor_script = [d * 1000 for _, d in release_durations(client, _floor_release())]
        client.close()
    finally:
        server.stop()
    print(
        f"# Hand-off steps: {args.processes} processes x {args.hold_ms:g} ms holds, "
        f"{args.seconds:g} s each, p50 / p90 / p99 in µs\n"
    )
    print(f"syncguard: {len(ours['hand-off'])} hand-offs; FIFO floor: {len(floor['hand-off'])}\n")
    print("| step | syncguard | FIFO floor |\n|---|--:|--:|")
    for name, values in ours.items():
        print(f"| {name} | {spread_us(values)} | {spread_us(floor.get(name, []))} |")
    print(f"| send → popped (floor) | | {spread_us(floor['send → popped'])} |")
    print(f"| popped → body (floor) | | {spread_us(floor['popped → body'])} |")
    scripts = f"{spread_us(script)} | {spread_us(floor_script)}"
    print(f"| the release script on the server (SLOWLOG) | {scripts} |")
    print_grantee_cpu(marks)


def print_grantee_cpu(marks: dict[int, Marks]) -> None:
    walls, cpus = grantee_cpu(marks)
    print(
        f"\nThe waiting thread's own read to its body ({len(walls)} bodies): "
        f"{spread_us(walls)} µs, of which its CPU time {spread_us(cpus)} µs"
    )


def _floor_release() -> str:
    from bench.contention import FifoFloor

    return FifoFloor.RELEASE


def postgres_main(args: argparse.Namespace) -> None:
    from bench.common import configure_django, create_bench_database, postgres_database
    from tests.support.servers import PostgresServer

    # Durable defaults, as bench/contention.py; --statements adds pg_stat_statements.
    settings = STATEMENTS_SETTINGS if args.statements else ()
    server = PostgresServer(settings=settings).start()
    statements: list[tuple[Any, ...]] = []
    try:
        version = create_bench_database(server.port)
        configure_django({"default": postgres_database(server.port, name="bench")})
        from django.core.management import call_command

        call_command("migrate", "django_syncguard", verbosity=0)
        if args.statements:
            _statements(server.port, "CREATE EXTENSION pg_stat_statements")
            _statements(server.port, "SELECT pg_stat_statements_reset()")
        runs, marks = run("postgres", str(server.port), args)
        if args.statements:
            statements = _statements(server.port, STATEMENTS_QUERY)
    finally:
        server.destroy()
    ours = steps(runs, POSTGRES)
    trips = []
    for stamps in runs.values():
        sent = None
        for name, t in stamps:
            if name == "send":
                sent = t
            elif name == "released" and sent is not None:
                trips.append(t - sent)
                sent = None
    print(
        f"# Hand-off steps on PostgreSQL {version} (fsync on): {args.processes} processes x "
        f"{args.hold_ms:g} ms holds, {args.seconds:g} s, p50 / p90 / p99 in µs\n"
    )
    print(f"{len(ours['hand-off'])} hand-offs\n\n| step | syncguard |\n|---|--:|")
    for name, values in ours.items():
        print(f"| {name} | {spread_us(values)} |")
    print(f"| the release statement's round trip, every release | {spread_us(trips)} |")
    print_grantee_cpu(marks)
    if statements:
        print(
            "\nStatements by total time (pg_stat_statements, track = all: the statements"
            " inside the functions too; tracking them adds to the times above)\n\n"
            "| calls | mean µs | total ms | top level | statement |\n|--:|--:|--:|---|---|"
        )
        for calls, mean_us, total_ms, top, text in statements:
            print(f"| {calls} | {mean_us:,.0f} | {total_ms:,.0f} | {top} | `{text}` |")


#: pg_stat_statements, counting the statements that PL/pgSQL runs as well.
STATEMENTS_SETTINGS = (
    "shared_preload_libraries=pg_stat_statements",
    "pg_stat_statements.track=all",
)
STATEMENTS_QUERY = """
SELECT calls, mean_exec_time * 1000, total_exec_time, toplevel,
       left(regexp_replace(query, '\\s+', ' ', 'g'), 100)
FROM pg_stat_statements WHERE calls >= 50 ORDER BY total_exec_time DESC LIMIT 20
"""


def _statements(port: int, sql: str) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(
        host="127.0.0.1", port=port, user="postgres", dbname="bench", autocommit=True
    ) as admin:
        cursor = admin.execute(sql)
        return cursor.fetchall() if cursor.description else []


if __name__ == "__main__":
    main()
