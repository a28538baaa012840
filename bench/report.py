"""Every backend's benchmark in one run: a Markdown report and a chart.

    .venv/bin/python bench/report.py [--seconds 6] [--rounds 3]
        [--backends redis,postgres,firestore] [--memory-locks 20000]
        [--out bench/reports/<date>-report.md]

Starts each server it needs on a free loopback port (``tests/support/servers.py``: redis-server,
PostgreSQL 15 with its durable defaults, the Firestore emulator), measures our backend
next to the peers of ``bench/redis_locks.py``, ``bench/postgres_locks.py`` and
``bench/firestore_locks.py`` for 1, 8 and 32 concurrent clients, on distinct keys and
on one shared key, then the memory a held lock costs on Redis and PostgreSQL, stops
the server, and writes ``<out>`` (Markdown: the machine and its load first, one table
per backend) and the chart next to it (same name, ``.png``).

Clients: 1 is one thread of this process; 8 are 8 spawned processes with one client
each; 32 are the same 8 processes with 4 client threads each (on a 2-core machine
more processes would only add scheduling). The processes are started once per
backend and keep each method's clients between rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import firestore_locks, postgres_locks, redis_locks  # noqa: E402
from bench.common import Sample, create_bench_database, percentile_us, run_matrix  # noqa: E402

#: Concurrent clients -> how they run (see ``bench.common.parse_mode``).
MODES = {1: "1 client", 8: "8 processes", 32: "8 processes x 4 threads"}
CLIENTS_OF = {mode: clients for clients, mode in MODES.items()}
ORDER = ("redis", "postgres", "firestore")

Row = tuple[str, str, str, Sample]


@dataclass
class Section:
    """One backend's part of the report."""

    name: str
    title: str
    baseline: str
    methods: dict[str, Callable[[Any], Any]]
    method_notes: list[str]
    server: str = ""
    rows: list[Row] = field(default_factory=list)
    memory: list[str] = field(default_factory=list)
    per_lock: str = ""  # the headline memory figure
    load: list[str] = field(default_factory=list)
    error: str = ""
    seconds_taken: float = 0.0


def new_sections() -> dict[str, Section]:
    return {
        "redis": Section(
            "redis",
            "Redis",
            "raw",
            redis_locks.METHODS,
            [
                "`syncguard`: `RedisBackend.acquire` + `release`, one EVALSHA each (fence, "
                "lock-id index, server-time expiry).",
                "`raw` (baseline): `SET key token NX PX 30000` + `DEL key`: two round trips, "
                "no ownership check on release, no fence.",
                "`redis-py Lock`: `redis.lock.Lock` (SET NX PX, Lua release), no fence.",
                "`python-redis-lock`: `redis_lock.Lock` (Lua scripts and a signal list), no fence.",
            ],
        ),
        "postgres": Section(
            "postgres",
            "PostgreSQL",
            "floor",
            postgres_locks.METHODS,
            [
                "`syncguard`: `DatabaseBackend.acquire` + `release`, one PL/pgSQL function "
                "call each.",
                "`floor` (baseline): an expiry-aware upsert and a delete, autocommit: the "
                "least a durable lock with expiry costs (no fence, no lock-id index).",
                "`seeds`: the specification's transaction (advisory lock, SELECT ... FOR "
                "UPDATE, two-step fence increment, upsert; release by SELECT ... FOR UPDATE "
                "+ DELETE), statement by statement.",
                "`advisory`: `pg_try_advisory_lock` / `pg_advisory_unlock` (django-pglocks' "
                "method), for context: it writes nothing, has no fence nor expiry, and a "
                "lock dies with its connection.",
            ],
        ),
        "firestore": Section(
            "firestore",
            "Firestore (emulator)",
            "bare transaction",
            firestore_locks.METHODS,
            [
                "`syncguard`: `FirestoreBackend.acquire` + `release` (a read and a "
                "precondition-guarded batch each).",
                "`bare transaction` (baseline): one transaction reading a lock and a counter "
                "document and writing both, then a plain delete: the least a lock with a "
                "fence counter costs, without any lock semantics. It makes one attempt "
                "(`max_attempts=1`): its failed commits are its errors.",
                "On one shared key the bare transactions wait on each other's read locks "
                "until the emulator's 2-second lock timeout aborts them, so the baseline "
                "collapses there and the ratios on that key say only that ours does not.",
            ],
        ),
    }


# ------------------------------------------------------------------ machine
def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def cpu_busy(seconds: float = 2.0) -> float:
    """Percent of the machine's CPU time that was busy over ``seconds`` (/proc/stat)."""

    def snap() -> tuple[int, int]:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        return sum(values), values[3] + values[4]  # all, idle + iowait

    try:
        total1, idle1 = snap()
        time.sleep(seconds)
        total2, idle2 = snap()
    except (OSError, ValueError, IndexError):
        return math.nan
    return 100 * (1 - (idle2 - idle1) / max(total2 - total1, 1))


def test_runs() -> int:
    """How many pytest processes (other engineers' test runs) are alive."""
    count = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if b"pytest" in cmdline.read_bytes():
                count += 1
    return count


def background() -> str:
    """The machine's load while this report does nothing: sampled between backends."""
    return (
        f"load average {loadavg()}, CPU {cpu_busy():.0f}% busy over 2 s, "
        f"{test_runs()} pytest processes running"
    )


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def hypervisor() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Hypervisor vendor:"):
                return f", {line.split(':', 1)[1].strip()} guest"
    return ""


def ram() -> str:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    return "unknown"


def os_name() -> str:
    pretty = platform.system()
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                pretty = line.split("=", 1)[1].strip('"')
    return f"{pretty}, kernel {platform.release()} {platform.machine()}"


def client_versions() -> str:
    """The client libraries the benchmarks drive, with their installed versions."""
    return ", ".join(
        f"{name} {version(dist)}"
        for name, dist in (
            ("Django", "django"),
            ("psycopg", "psycopg"),
            ("redis-py", "redis"),
            ("hiredis", "hiredis"),
            ("python-redis-lock", "python-redis-lock"),
            ("google-cloud-firestore", "google-cloud-firestore"),
        )
    )


def machine_rows(servers: list[tuple[str, str]], load: str) -> list[str]:
    """A report's machine table: CPU, RAM, OS and Python, then each ``(title, server)``,
    the client libraries, and the machine ``load``."""
    return [
        "| machine | |",
        "|---|---|",
        f"| CPU | {cpu_model()}{hypervisor()}, {os.cpu_count()} cores |",
        f"| RAM | {ram()} |",
        f"| OS | {os_name()} |",
        f"| Python | {platform.python_implementation()} {platform.python_version()} |",
        *(f"| {title} | {server} |" for title, server in servers if server),
        f"| client libraries | {client_versions()} |",
        f"| machine load | {load} |",
    ]


def version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def gcloud_versions() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["gcloud", "version"], capture_output=True, text=True, timeout=60
        ).stdout
        sdk = emulator = ""
        for line in out.splitlines():
            if line.startswith("Google Cloud SDK"):
                sdk = line.strip()
            if line.startswith("cloud-firestore-emulator"):
                emulator = line.split()[-1]
        java = subprocess.run(
            ["java", "-version"], capture_output=True, text=True, timeout=60
        ).stderr.splitlines()
        return f"cloud-firestore-emulator {emulator} ({sdk}; {java[0] if java else 'java'})"
    return "unknown"


# ------------------------------------------------------------------ backends
def run_redis(section: Section, args: argparse.Namespace) -> None:
    import redis

    from tests.support.servers import RedisServer

    server = RedisServer().start()
    try:
        info = redis.Redis.from_url(server.url).info("server")
        section.server = (
            f"redis-server {info['redis_version']} on 127.0.0.1, no persistence (as the "
            "test servers run it)"
        )
        section.rows = run_matrix(
            section.methods, server.url, list(MODES.values()), args.rounds, args.seconds
        )
        if args.memory_locks:
            ours, floor = redis_locks.memory_per_lock(server.url, args.memory_locks)
            section.per_lock = f"{ours:.0f} B"
            section.memory = [
                f"**{ours:.0f} bytes per held lock** (`INFO memory` used_memory delta over "
                f"{args.memory_locks:,} held locks on distinct keys `invoice:0000000`..., "
                "divided by their number): the lock hash with its fence counter, and the "
                "lock-id index key.",
                f"One `SET NX PX` key of the same name: {floor:.0f} bytes.",
            ]
    finally:
        server.destroy()


def run_postgres(section: Section, args: argparse.Namespace) -> None:
    from tests.support.servers import PostgresServer

    server = PostgresServer(settings=()).start()  # durable defaults
    try:
        pg_version = create_bench_database(server.port)
        postgres_locks.setup_django(server.port)
        from django.core.management import call_command

        call_command("migrate", "django_syncguard", verbosity=0)
        with postgres_locks._connection(server.port) as conn:
            conn.execute(postgres_locks.PEER_TABLES, prepare=False)
        section.server = (
            f"PostgreSQL {pg_version} on 127.0.0.1, default settings (fsync on, "
            "synchronous_commit on: every commit waits for its WAL flush); "
            f"{postgres_locks.statements()}, for every method alike"
        )
        section.rows = run_matrix(
            section.methods, server.port, list(MODES.values()), args.rounds, args.seconds
        )
        if args.memory_locks:
            per_lock, delta, total = postgres_locks.memory_per_lock(server.port, args.memory_locks)
            section.per_lock = f"{total:.0f} B"
            section.memory = [
                f"**{total:.0f} bytes per held lock** by `pg_total_relation_size` of "
                "`syncguard_locks` + `syncguard_fence_counters` (tables, indexes, TOAST, "
                f"free-space and visibility maps), delta over {args.memory_locks:,} held "
                "locks on distinct keys divided by their number; from tables emptied by "
                "TRUNCATE + VACUUM FULL to the same tables after a plain VACUUM.",
                f"The main forks alone: {per_lock:.0f} bytes, by relation: "
                + ", ".join(
                    f"{name} {size / args.memory_locks:.0f} B"
                    for name, size in sorted(delta.items())
                )
                + ".",
            ]
    finally:
        server.destroy()


def run_firestore(section: Section, args: argparse.Namespace) -> None:
    from tests.support.servers import FirestoreEmulator

    emulator = FirestoreEmulator().start()
    try:
        section.server = f"Firestore emulator on 127.0.0.1: {gcloud_versions()}"
        section.rows = run_matrix(
            section.methods, emulator.host, list(MODES.values()), args.rounds, args.seconds
        )
        section.memory = [
            "Not measured: the emulator's memory says nothing about Firestore's storage "
            "(a lock document plus its counter document, billed per document)."
        ]
    finally:
        emulator.destroy()


RUNNERS = {"redis": run_redis, "postgres": run_postgres, "firestore": run_firestore}


# ------------------------------------------------------------------ output
def ms(value_us: float) -> str:
    if math.isnan(value_us):
        return "-"
    value = value_us / 1000
    if value < 1:
        return f"{value:.3f}"
    if value < 10:
        return f"{value:.2f}"
    if value < 100:
        return f"{value:.1f}"
    return f"{value:,.0f}"


def stats(section: Section, seconds: float) -> list[dict[str, Any]]:
    rates = {(m, k, n): s.cycles / seconds for m, k, n, s in section.rows}
    out = []
    for mode, keys, name, sample in section.rows:
        rate = sample.cycles / seconds
        base = rates.get((mode, keys, section.baseline)) or float("nan")
        out.append(
            {
                "clients": CLIENTS_OF[mode],
                "keys": keys,
                "method": name,
                "rate": rate,
                "ratio": rate / base if base else float("nan"),
                "attempts": sample.attempts / seconds,
                "errors": sample.errors,
                "acq50": percentile_us(sample.acquire_ns, 50),
                "acq99": percentile_us(sample.acquire_ns, 99),
                "rel50": percentile_us(sample.release_ns, 50),
                "rel99": percentile_us(sample.release_ns, 99),
            }
        )
    out.sort(key=lambda r: (r["keys"] != "distinct", r["clients"]))
    return out


def table(section: Section, seconds: float) -> list[str]:
    lines = [
        f"| method | clients | keys | cycles/s | x {section.baseline} | acquire p50 ms "
        "| acquire p99 ms | release p50 ms | release p99 ms | attempts/s | errors |",
        "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in stats(section, seconds):
        name = f"**{r['method']}**" if r["method"] == "syncguard" else r["method"]
        lines.append(
            f"| {name} | {r['clients']} | {r['keys']} | {r['rate']:,.0f} | {r['ratio']:.2f} "
            f"| {ms(r['acq50'])} | {ms(r['acq99'])} | {ms(r['rel50'])} | {ms(r['rel99'])} "
            f"| {r['attempts']:,.0f} | {r['errors']:,} |"
        )
    return lines


def headline(sections: list[Section], seconds: float) -> list[str]:
    """Our cycles/s and ratio to the baseline, distinct keys, per backend and clients."""
    lines = [
        "| backend | baseline | "
        + " | ".join(f"{c} client{'s' * (c > 1)}" for c in MODES)
        + " | memory per held lock |",
        "|---|---|" + "--:|" * len(MODES) + "--:|",
    ]
    for section in sections:
        if not section.rows:
            continue
        by = {
            (r["clients"], r["method"]): r
            for r in stats(section, seconds)
            if r["keys"] == "distinct"
        }
        cells = []
        for clients in MODES:
            r = by.get((clients, "syncguard"))
            cells.append(f"{r['rate']:,.0f}/s (x{r['ratio']:.2f})" if r else "-")
        lines.append(
            f"| {section.title} | {section.baseline} | "
            + " | ".join(cells)
            + f" | {section.per_lock or '-'} |"
        )
    return lines


def write_markdown(
    path: Path,
    png: Path | None,
    sections: list[Section],
    args: argparse.Namespace,
    started: datetime.datetime,
    took: float,
    load_start: str,
    load_end: str,
) -> None:
    command = (
        f"`.venv/bin/python bench/report.py --seconds {args.seconds:g} --rounds {args.rounds} "
        f"--backends {','.join(s.name for s in sections)} --memory-locks {args.memory_locks}`"
    )
    out = [
        f"# Lock benchmark report, {started:%Y-%m-%d}",
        "",
        f"Every backend against its peers, side by side on one server per backend; {command}, "
        f"started {started:%Y-%m-%d %H:%M} UTC, took {took / 60:.1f} min.",
        "",
        *machine_rows(
            [(section.title, section.server) for section in sections],
            f"at the start: {load_start}; at the end: {load_end}; before each backend: below",
        ),
        "",
        "This is a 2-core virtual machine whose neighbours' load varies, so absolute "
        "figures are noisy from run to run. The load figures above are sampled while "
        "the report itself is idle (the 1-minute load average still carries some of "
        "its own previous minute; during a run our own 32 client threads alone make "
        "it climb past 10). "
        "Compare the ratios within one table, which were measured side by side: the "
        "methods of one scenario run in interleaved rounds, so drift hits them alike.",
        "",
        "## How it was measured",
        "",
        "- A *cycle* is a successful acquire followed by its release (TTL 30 s). "
        "*cycles/s* counts cycles of all clients together; *attempts/s* counts acquire "
        "calls, including those that found the key held.",
        "- Clients: **1** is one thread in the report's own process; **8** are 8 spawned "
        "processes with one client each; **32** are those 8 processes with 4 client "
        "threads each (the machine has 2 cores: processes beyond 8 would add only "
        "scheduling). Each client has its own connection (or the backend's pool).",
        "- Each client makes one untimed cycle first (connections, scripts, plans), then "
        "cycles without pause until its time is up.",
        "- *distinct* keys: each client cycles over 64 keys of its own, so clients never "
        "contend; *shared*: every client takes the same key, so all but one find it held.",
        f"- {args.seconds:g} s per method and scenario, in {args.rounds} interleaved rounds "
        "of all the methods.",
        "- Latencies are per call, seen by the client, in milliseconds: *acquire* counts "
        "every attempt (also those that found the key held), *release* only releases of "
        "held locks. *errors* are calls that raised.",
        "- *x baseline* is cycles/s divided by the baseline's cycles/s in the same scenario.",
        "",
        "## Headline: our cycles/s on distinct keys (x the baseline)",
        "",
        *headline(sections, args.seconds),
        "",
        "Memory budgets: 1 KB per held lock (the seeds); targets under 400 B on "
        "PostgreSQL and about 360 B on Redis (its previous measurement).",
        "",
    ]
    if png is not None:
        out += [f"![cycles/s and latency per backend]({png.name})", ""]
    for section in sections:
        out += [f"## {section.title}", ""]
        if section.server:
            out += [section.server + ".", ""]
        out += [f"- {note}" for note in section.method_notes]
        out.append("")
        if section.load:
            out += [
                f"Took {section.seconds_taken / 60:.1f} min; " + "; ".join(section.load) + ".",
                "",
            ]
        if section.error:
            out += ["**This backend failed:**", "", "```", section.error.strip(), "```", ""]
        if section.rows:
            out += table(section, args.seconds)
            out.append("")
        if section.memory:
            out += ["### Memory", ""] + [f"- {line}" for line in section.memory] + [""]
    path.write_text("\n".join(out))


def write_chart(path: Path, sections: list[Section], seconds: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [s for s in sections if s.rows]
    if not shown:
        return
    columns = (
        ("cycles/s, distinct keys", "rate", "distinct"),
        ("cycles/s, one shared key", "rate", "shared"),
        ("acquire latency, distinct keys (ms)", "acq", "distinct"),
        ("release latency, distinct keys (ms)", "rel", "distinct"),
    )
    fig, axes = plt.subplots(
        len(shown), len(columns), figsize=(24, 5.2 * len(shown)), squeeze=False
    )
    palette = ["#1f5fbf", "#7f7f7f", "#e08a1e", "#3a9b4a", "#b03a8c"]
    clients = list(MODES)
    for row, section in enumerate(shown):
        data = stats(section, seconds)
        methods = list(section.methods)
        width = 0.8 / len(methods)
        for col, (title, what, keys) in enumerate(columns):
            ax = axes[row][col]
            for m, method in enumerate(methods):
                by = {r["clients"]: r for r in data if r["method"] == method and r["keys"] == keys}
                xs = [i + (m - (len(methods) - 1) / 2) * width for i in range(len(clients))]
                color = palette[m % len(palette)]
                label = method + (" (baseline)" if method == section.baseline else "")
                if what == "rate":
                    values = [by[c]["rate"] if c in by else 0 for c in clients]
                    bars = ax.bar(xs, values, width, color=color, label=label)
                    if method == "syncguard":
                        for bar, c in zip(bars, clients, strict=True):
                            if c in by and not math.isnan(by[c]["ratio"]):
                                ax.annotate(
                                    f"x{by[c]['ratio']:.2f}",
                                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                    xytext=(0, 3),
                                    textcoords="offset points",
                                    ha="center",
                                    va="bottom",
                                    rotation=90,
                                    fontsize=10,
                                    color=color,
                                    fontweight="bold",
                                )
                else:
                    p50 = [by[c][f"{what}50"] / 1000 if c in by else math.nan for c in clients]
                    p99 = [by[c][f"{what}99"] / 1000 if c in by else math.nan for c in clients]
                    ax.bar(xs, p99, width, color=color, alpha=0.35)
                    ax.bar(xs, p50, width, color=color, label=label)
            ax.set_xticks(range(len(clients)))
            ax.set_xticklabels([f"{c} client{'s' * (c > 1)}" for c in clients], fontsize=11)
            ax.set_title(f"{section.title}: {title}", fontsize=12)
            ax.grid(axis="y", alpha=0.3)
            ax.tick_params(axis="y", labelsize=10)
            if what == "rate":
                ax.set_ylabel("cycles/s", fontsize=11)
                ax.yaxis.set_major_formatter(
                    matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}")
                )
                ax.margins(y=0.2)
            else:
                ax.set_yscale("log")
                ax.set_ylabel("ms, log scale (solid p50, pale p99)", fontsize=11)
                ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
                ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axes[row][-1].legend(
            fontsize=11,
            loc="upper left",
            bbox_to_anchor=(1.03, 1.0),
            title=section.title,
            title_fontsize=12,
            frameon=False,
        )
    fig.suptitle(
        f"Acquire + release cycles, 1 / 8 / 32 concurrent clients ({seconds:g} s per bar; "
        "the labels on syncguard's bars: its cycles/s x the baseline's)",
        fontsize=15,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)


# --------------------------------------------------------------------- main
def main() -> None:
    today = datetime.date.today()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--seconds", type=float, default=6.0, help="per method and scenario (default 6)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds per scenario (default 3)"
    )
    parser.add_argument(
        "--backends",
        default=",".join(ORDER),
        help=f"comma-separated, of {', '.join(ORDER)} (default: all)",
    )
    parser.add_argument(
        "--memory-locks",
        type=int,
        default=20_000,
        help="held locks for the memory measurement on Redis and PostgreSQL (0: skip)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "bench" / "reports" / f"{today:%Y-%m-%d}-report.md",
        help="the Markdown file; the chart goes next to it as .png "
        "(default bench/reports/<date>-report.md)",
    )
    args = parser.parse_args()
    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    unknown = set(names) - set(ORDER)
    if unknown or not names:
        parser.error(f"--backends: unknown {', '.join(sorted(unknown))}; known: {', '.join(ORDER)}")
    if args.seconds <= 0 or args.rounds < 1:
        parser.error("--seconds must be positive and --rounds at least 1")

    started = datetime.datetime.now(datetime.UTC)
    t0 = time.monotonic()
    load_start = background()
    all_sections = new_sections()
    sections = [all_sections[n] for n in ORDER if n in names]
    for section in sections:
        section.load.append(f"before it: {background()}")
        print(f"{section.title}: running ({section.load[-1]})...", flush=True)
        began = time.monotonic()
        try:
            RUNNERS[section.name](section, args)
        except Exception:
            section.error = traceback.format_exc()
            print(section.error, file=sys.stderr, flush=True)
        section.seconds_taken = time.monotonic() - began
        section.load.append(f"at its end: load average {loadavg()}")
        print(f"{section.title}: done in {section.seconds_taken:.0f} s", flush=True)
    took = time.monotonic() - t0

    args.out.parent.mkdir(parents=True, exist_ok=True)
    png = args.out.with_suffix(".png")
    try:
        write_chart(png, sections, args.seconds)
    except Exception:
        traceback.print_exc()
        png = None
    write_markdown(args.out, png, sections, args, started, took, load_start, background())
    print(f"wrote {args.out}" + (f" and {png}" if png else "") + f" in {took / 60:.1f} min")
    if any(s.error for s in sections):
        sys.exit(1)


if __name__ == "__main__":
    os.environ.pop("DJANGO_SETTINGS_MODULE", None)
    main()
