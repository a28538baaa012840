"""The Redis backend on its topologies: one server, Sentinel, Cluster; WAIT 0 and 1.

    .venv/bin/python bench/topologies.py [--seconds 12] [--rounds 12]
        [--modes "1 client,8 processes"] [--processes 4] [--hold-ms 5]
        [--contended-seconds 8] [--contended-rounds 4]
        [--out bench/reports/<date>-topologies.md]

Starts, on free loopback ports (``tests/support/servers.py``, every server without
persistence): a ``redis-server`` alone; a ``redis-server`` with one replica; a
``RedisSentinelTopology`` (a primary, its replica, three sentinels); a
``RedisClusterTopology`` (three primaries with one replica each). Six cells, each our
``RedisBackend`` with its defaults plus:

- ``single``: ``LOCATION`` the lone server (the baseline of every ratio);
- ``single+replica, WAIT 1``: the server with a replica, ``OPTIONS["WAIT_REPLICAS"] = 1``
  (acquire, extend and release return after a replica's ack: ``WAIT`` in the same
  round trip as the script);
- ``Sentinel`` / ``Sentinel, WAIT 1``: ``LOCATION`` ``redis://<service>/0`` and
  ``OPTIONS["SENTINELS"]``;
- ``Cluster`` / ``Cluster, WAIT 1``: ``OPTIONS["CLUSTER"] = True``.

Two parts, in one run, the cells alternating in rounds (the order rotated by one each
round) so that drift of a shared machine hits them alike:

1. **Uncontended** ``acquire`` + ``release`` cycles (``bench/common.py``): ``--modes``
   (1 client thread of this process; 8 spawned processes), each client on 64 keys of
   its own; cycles/s, p50/p99 of a whole cycle, the ratio to ``single`` over the run
   and its range over the rounds; ``--seconds`` per cell and mode.
2. **Contended hand-off** (``bench/contention.py``'s clients and analysis, wake-ups
   on): ``--processes`` spawned processes loop ``lock()`` on one hot key with a
   ``--hold-ms`` body; hand-off p50/p99 (from leaving a body while another client
   waits to the next entry, on the system-wide monotonic clock), utilization, wait
   p50/p99 and the longest wait; ``--contended-seconds`` per cell.

Prints each table as it is measured and writes them, after the machine table of
``bench/report.py``, to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import ClientPool, MethodFactory, Report, Sample, measure, parse_mode  # noqa: E402
from bench.common import percentile_us as us  # noqa: E402
from bench.contention import Cell, Pool, Target, analyse, handoff_gaps, make_backend, ms, pct  # noqa: E402

TTL_MS = 30_000
#: slug -> (title, topology, WAIT_REPLICAS); the first is the baseline of every ratio.
CELLS: dict[str, tuple[str, str, int]] = {
    "single": ("single", "single", 0),
    "single-w1": ("single+replica, WAIT 1", "replicated", 1),
    "sentinel": ("Sentinel", "sentinel", 0),
    "sentinel-w1": ("Sentinel, WAIT 1", "sentinel", 1),
    "cluster": ("Cluster", "cluster", 0),
    "cluster-w1": ("Cluster, WAIT 1", "cluster", 1),
}
BASELINE = "single"


# ------------------------------------------------------------------ servers
@dataclass
class Servers:
    """Every topology's servers, started together, destroyed (by their PIDs) together."""

    started: list[Any] = field(default_factory=list)
    locations: dict[str, tuple[str, tuple[tuple[str, Any], ...]]] = field(default_factory=dict)

    def start(self) -> None:
        from tests.support.servers import (
            TOPOLOGY_OPTIONS,
            RedisClusterTopology,
            RedisSentinelTopology,
            RedisServer,
            poll,
            replica_linked,
        )

        single = self._up(RedisServer())
        self.locations["single"] = (single.url, ())
        # The data servers' options of the topologies (a replica synced at once).
        primary = self._up(RedisServer(options=TOPOLOGY_OPTIONS))
        replica = self._up(RedisServer(replica_of=primary.port, options=TOPOLOGY_OPTIONS))
        poll(lambda: replica_linked(replica.port, primary.port), "the replica's link")
        self.locations["replicated"] = (primary.url, ())
        sentinel = self._up(RedisSentinelTopology())
        sentinels = (("SENTINELS", tuple(sentinel.sentinels)),)
        self.locations["sentinel"] = (sentinel.location, sentinels)
        cluster = self._up(RedisClusterTopology())
        self.locations["cluster"] = (cluster.startup_url, (("CLUSTER", True),))

    def _up(self, server: Any) -> Any:
        self.started.append(server)  # before start(): a half-started topology is stopped too
        return server.start()

    def targets(self) -> dict[str, Target]:
        targets = {}
        for slug, (_, topology, wait) in CELLS.items():
            location, options = self.locations[topology]
            extra = (("WAIT_REPLICAS", wait),) if wait else ()
            targets[slug] = Target("redis", location=location, options=options + extra)
        return targets

    def destroy(self) -> None:
        for server in reversed(self.started):
            server.destroy()  # stop(): each process by the PID it started; then its files

    def version(self) -> str:
        import redis

        url = self.locations["single"][0]
        with redis.Redis.from_url(url) as client:
            version = client.info("server")["redis_version"]
        return f"redis-server {version} on 127.0.0.1, no persistence; redis-py {redis.__version__}"


TOPOLOGIES = (
    "single: one redis-server. single+replica: a redis-server and its replica. Sentinel: "
    "a primary, its replica and 3 sentinels (quorum 2). Cluster: 3 primaries with a "
    "replica each (`redis-cli --cluster create`). All running at once, on 127.0.0.1"
)


# ------------------------------------------------------------- uncontended
_backends: dict[Target, Any] = {}


def cell_method(slug: str, target: Target) -> MethodFactory:
    """``bench.common``'s method for a cell: ``backend.acquire`` + ``release`` on the
    cell's keys (``<slug>:<key>``: the cells of one server keep apart). The backend is
    built once per process and kept between rounds, as a long-lived worker's."""
    backend = _backends.get(target)
    if backend is None:
        backend = _backends[target] = make_backend(target, wake_ups=True, alias="topologies")

    def factory(client: int) -> tuple[Callable[[str], Any], Callable[[Any], None]]:
        def acquire(key: str) -> Any:
            result = backend.acquire(f"{slug}:{key}", TTL_MS)
            return result.lock_id if result.ok else None

        return acquire, backend.release

    return factory


@dataclass
class Uncontended:
    sample: Sample = field(default_factory=Sample)
    rates: list[float] = field(default_factory=list)  # cycles/s of each round


def run_uncontended(
    targets: dict[str, Target], mode: str, rounds: int, seconds: float
) -> dict[str, Uncontended]:
    """Every cell in ``mode`` on distinct keys, ``seconds / rounds`` per cell and round."""
    processes, _ = parse_mode(mode)
    pool = ClientPool(processes) if processes else None
    results = {slug: Uncontended() for slug in targets}
    names = list(targets)
    try:
        for number in range(rounds):
            shift = number % len(names)
            for slug in names[shift:] + names[:shift]:
                setup = functools.partial(cell_method, slug, targets[slug])
                sample = measure(setup, mode, False, seconds / rounds, pool)
                results[slug].sample.merge(sample)
                results[slug].rates.append(sample.cycles / (seconds / rounds))
            print(f"  {mode}: round {number + 1}/{rounds} done", flush=True)
    finally:
        if pool is not None:
            pool.close()
    return results


def uncontended_table(mode: str, results: dict[str, Uncontended], seconds: float) -> list[str]:
    lines = [
        f"### Uncontended acquire + release, {mode}, distinct keys",
        "",
        "| cell | cycles/s | x single | per-round x single | cycle p50 µs | cycle p99 µs "
        "| errors |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    base = results[BASELINE]
    for slug, r in results.items():
        rate = r.sample.cycles / seconds
        ratio = r.sample.cycles / base.sample.cycles if base.sample.cycles else math.nan
        per_round = [a / b for a, b in zip(r.rates, base.rates, strict=True) if b]
        spread = f"{min(per_round):.2f}-{max(per_round):.2f}" if per_round else "n/a"
        lines.append(
            f"| {CELLS[slug][0]} | {rate:,.0f} | **{ratio:.2f}** | {spread} "
            f"| {us(r.sample.cycle_ns, 50):,.0f} | {us(r.sample.cycle_ns, 99):,.0f} "
            f"| {r.sample.errors} |"
        )
    return lines


# --------------------------------------------------------------- contended
@dataclass
class Contended:
    rounds: list[Cell] = field(default_factory=list)  # contention.analyse of each window
    gaps: list[int] = field(default_factory=list)  # hand-off gaps of every round, ns
    waits: list[int] = field(default_factory=list)  # waits of the calls that acquired, ns
    drain_s: float = 0.0


def run_contended(
    targets: dict[str, Target], processes: int, hold_ms: int, rounds: int, seconds: float
) -> dict[str, Contended]:
    """``bench/contention.py``'s cell (wake-ups on) for every target on one pool of
    ``processes`` client processes; ``seconds / rounds`` per cell and round, each
    window on a hot key of its own."""
    results = {slug: Contended() for slug in targets}
    names = list(targets)
    pool = Pool(targets[names[0]], processes)
    try:
        for number in range(rounds):
            shift = number % len(names)
            for slug in names[shift:] + names[:shift]:
                key = f"hot:{slug}:{number}"
                data, start, deadline, drain = pool.run_cell(
                    "on", processes, hold_ms, seconds / rounds, key, targets[slug]
                )
                cell = Cell("redis", "on", processes, hold_ms)
                analyse(cell, data, start, deadline)
                calls = [c for d in data for c in d["calls"]]
                holds = sorted((h for d in data for h in d["holds"]), key=lambda h: h[1])
                result = results[slug]
                result.rounds.append(cell)
                result.gaps += handoff_gaps(calls, holds, start, deadline)[0]
                result.waits += [c[2] for c in calls if c[3] == "acquired"]
                result.drain_s = max(result.drain_s, drain)
            print(f"  contended: round {number + 1}/{rounds} done", flush=True)
    finally:
        pool.close()
    return results


def contended_table(results: dict[str, Contended], processes: int, hold_ms: int) -> list[str]:
    lines = [
        f"### Contended hand-off: {processes} processes, one hot key, {hold_ms} ms holds",
        "",
        "| cell | acquisitions/s | hand-offs | hand-off p50 / p99 ms | per-round p50 ms "
        "| utilization | wait p50 / p99 ms | longest wait ms | least client x fair "
        "| timeouts | errors | overlaps |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for slug, r in results.items():
        window = sum(c.window_s for c in r.rounds)
        held = sum(c.utilization * c.window_s for c in r.rounds)
        p50s = [c.handoff_p50 for c in r.rounds if not math.isnan(c.handoff_p50)]
        spread = f"{ms(min(p50s))}-{ms(max(p50s))}" if p50s else "-"
        lines.append(
            f"| {CELLS[slug][0]} | {sum(c.acquisitions for c in r.rounds) / window:,.1f} "
            f"| {len(r.gaps):,} | **{ms(pct(r.gaps, 50))}** / {ms(pct(r.gaps, 99))} | {spread} "
            f"| {held / window:.1%} | {ms(pct(r.waits, 50))} / {ms(pct(r.waits, 99))} "
            f"| {ms(max(c.longest for c in r.rounds))} "
            f"| x{min(c.min_ratio for c in r.rounds):.2f} "
            f"| {sum(c.timeouts for c in r.rounds)} | {sum(c.errors for c in r.rounds)} "
            f"| {sum(c.overlaps for c in r.rounds)} |"
        )
    return lines


HOW = """\
- **Cells.** Our `RedisBackend` with its defaults (clock fences, wake-ups on), each
  cell's keys apart by name on the servers two cells share (Sentinel, Cluster).
  `WAIT 1`: `OPTIONS["WAIT_REPLICAS"] = 1`, so each acquire, extend and release
  sends `EVALSHA` and `WAIT 1 500` in one pipeline and returns once the replica has
  acknowledged. The single server of the WAIT 0 cell has no replica; the WAIT 1
  cell's primary has one (WAIT needs it), as do Sentinel's and each Cluster shard's.
  Round trips per acquire + release: 2 everywhere but on the Cluster, 3: a release
  by lock id first GETs the lock-id index to learn the lock hash's name, since a
  cluster script must declare every key it touches (`RedisBackend._id_keys`).
- **Uncontended.** A cycle is `backend.acquire(key, ttl_ms=30000)` then
  `release(lock_id)`. *1 client*: a thread of this process; *8 processes*: 8
  spawned processes, one client each, started together (`bench/common.py`); each
  client cycles over 64 keys of its own. cycles/s is over the cell's wall time; the
  ratio is the cell's cycles over `single`'s in the same run, *per-round* the lowest
  and highest ratio of one round (each round measures every cell back to back).
  Where that range straddles 1.00 the run cannot tell the two apart.
- **Contended.** `bench/contention.py`'s clients: each process loops
  `lock(body, key=<hot key>, ttl_ms=10_000, timeout_ms=5_000)`, the body sleeping
  for the hold; all start at one instant of `CLOCK_MONOTONIC`. *Hand-off*: from
  leaving a body while another client's call was waiting to the next body's entry
  (whoever enters), over every round's windows; it holds the release's round trip,
  the wake-up and the acquire's round trip (with WAIT 1, two WAITs). *Per-round
  p50*: the lowest and highest p50 of one round's window. *Utilization*: time in
  bodies / the windows; at best hold / (hold + hand-off). *Wait*: from calling
  `lock()` to entering the body; *longest* includes timeouts. *Least client x
  fair*: the fewest acquisitions one client got in a window over the window's fair
  share, the worst round.
"""


# -------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=12.0, help="uncontended: per cell, mode")
    parser.add_argument("--rounds", type=int, default=12, help="uncontended rounds")
    parser.add_argument("--modes", default="1 client,8 processes", help="uncontended clients")
    parser.add_argument("--processes", type=int, default=4, help="contended clients")
    parser.add_argument("--hold-ms", type=int, default=5, help="contended hold")
    parser.add_argument("--contended-seconds", type=float, default=8.0, help="per cell")
    parser.add_argument("--contended-rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, help="default: bench/reports/<date>-topologies.md")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.seconds <= 0 or args.contended_seconds <= 0 or min(args.rounds, args.processes) < 1:
        parser.error("--seconds, --contended-seconds, --rounds and --processes must be positive")
    if args.contended_rounds < 1 or args.hold_ms < 0:
        parser.error("--contended-rounds must be positive, --hold-ms not negative")

    from bench.report import background, machine_rows

    started = datetime.datetime.now(datetime.UTC)
    out = args.out or ROOT / "bench" / "reports" / f"{started:%Y-%m-%d}-topologies.md"
    command = " ".join(["python bench/topologies.py", *sys.argv[1:]])
    t0 = time.monotonic()
    load_start = background()
    report = Report()
    servers = Servers()
    try:
        servers.start()
        version = servers.version()
        targets = servers.targets()
        print(f"servers up in {time.monotonic() - t0:.0f} s", flush=True)
        for mode in modes:
            results = run_uncontended(targets, mode, args.rounds, args.seconds)
            report(*uncontended_table(mode, results, args.seconds), "")
        contended = run_contended(
            targets, args.processes, args.hold_ms, args.contended_rounds, args.contended_seconds
        )
        report(*contended_table(contended, args.processes, args.hold_ms), "")
    finally:
        for backend in _backends.values():
            backend.close()
        servers.destroy()
    took = time.monotonic() - t0
    head = [
        "# The Redis backend on its topologies (bench/topologies.py)",
        "",
        f"`{command}`, started {started:%Y-%m-%d %H:%M} UTC, took {took / 60:.1f} min. "
        f"Uncontended: {args.seconds:g} s per cell and mode in {args.rounds} rounds; "
        f"contended: {args.contended_seconds:g} s per cell in {args.contended_rounds} rounds.",
        "",
        *machine_rows(
            [("Redis", version), ("topologies", TOPOLOGIES)],
            f"at the start: {load_start}; at the end: {background()}",
        ),
        "",
    ]
    tail = ["## How it was measured", "", HOW]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(head + report.lines + tail))
    print(f"wrote {out} in {took / 60:.1f} min")


if __name__ == "__main__":
    os.environ.pop("DJANGO_SETTINGS_MODULE", None)
    main()
