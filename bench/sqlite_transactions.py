"""Locks inside the caller's transactions on SQLite: before and after ``until_commit``.

    .venv/bin/python bench/sqlite_transactions.py [--samples 10] [--after-samples 100]
        [--before-timeout-ms 500] [--out bench/reports/<date>-sqlite-transactions.md]

The database backend on SQLite as shipped, with the locks in the same file as the
data (the example project's ``invoices`` app), once with Django's default journal
(``DELETE``: WAL off) and once with WAL on, each in a fresh process and file:

- **before**: ``until_commit=False`` and the caller-transaction guard off
  (``sqlite.caller_transaction_holds`` patched to say the caller's transaction holds
  nothing, so every call takes the pre-guard path with SQLite's busy timeout at the
  operation timeout): what the backend did before. A release inside a transaction
  that has written waits the whole operation timeout for the caller's own write
  lock, fails with ``NetworkTimeout``, and the lock stays until its TTL. (Patching
  ``CALLER_TRANSACTION_WAIT_MS`` to the operation timeout gives the same stall, but
  the guard then reports it as ``ServiceUnavailable``.)
- **after**: as shipped (``until_commit=True``, the 100 ms guard).

Measured, side by side in each process:

- (a) a lock whose code ends inside ``atomic()`` after a write: how long the end of
  the locked block takes, the time from the commit to the lock being free, and
  whether the lock was left until its TTL;
- (b) ``POST`` to a locked payment view through Django's test client, with
  ``ATOMIC_REQUESTS=True`` (``@locked`` on the view) and with ``atomic()`` in the
  view around ``with locked(...)`` (the view exempt from ``ATOMIC_REQUESTS``), a new
  invoice per request;
- (c) an acquire behind the caller's own write (inside ``atomic()``, after an
  ``UPDATE``): how long it takes to fail;
- (d) an acquire inside ``atomic()`` before any query (what ``@locked`` on a view
  does under ``ATOMIC_REQUESTS``), while another connection holds SQLite's write lock
  for ``--hold-ms``: the guard cannot tell this from (c).

The "before" samples stall for ``--before-timeout-ms`` (an ``OPERATION_TIMEOUT_MS``
reduced so that the run stays short); one sample of (a), (b, ATOMIC_REQUESTS) and (c)
uses the default 5000 ms. Prints a table (medians, p95, ratios) and writes it, with
the machine and the settings, to ``--out``. About a minute and a half on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine  # noqa: E402

#: The lock aliases of a child: "short" has the reduced operation timeout of the
#: "before" samples, "default" the default one (5000 ms).
SHORT, FULL = "short", "default"
TTL_MS = 30_000
JOURNALS = ("delete", "wal")

#: Filled in by the child once Django is set up (this module is its ROOT_URLCONF).
urlpatterns: list[Any] = []


# ---------------------------------------------------------------- the child process


def setup_django(journal: str, path: str, before_timeout_ms: int) -> None:
    import django
    from django.conf import settings
    from django.core.management import call_command

    sys.path.insert(0, str(ROOT / "example_project"))  # the invoices app
    database = {"ENGINE": "django.db.backends.sqlite3", "NAME": path, "ATOMIC_REQUESTS": True}
    if journal == "wal":
        database["OPTIONS"] = {"init_command": "PRAGMA journal_mode=WAL;"}
    backend = "django_syncguard.backends.database.DatabaseBackend"
    settings.configure(
        DATABASES={"default": database},
        INSTALLED_APPS=["django.contrib.contenttypes", "django_syncguard", "invoices"],
        SYNCGUARD_BACKENDS={
            FULL: {"BACKEND": backend, "OPTIONS": {"DATABASE": "default"}},
            SHORT: {
                "BACKEND": backend,
                "OPTIONS": {"DATABASE": "default", "OPERATION_TIMEOUT_MS": before_timeout_ms},
            },
        },
        USE_TZ=True,
        ROOT_URLCONF=__name__,
        MIDDLEWARE=[],
        ALLOWED_HOSTS=["testserver"],
        # The failed releases of "before" are counted, not logged.
        LOGGING={
            "version": 1,
            "disable_existing_loggers": False,
            "loggers": {"django_syncguard": {"level": "CRITICAL"}},
        },
    )
    django.setup()
    call_command("migrate", verbosity=0)
    with sqlite3.connect(path) as db:
        mode = db.execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == journal, (mode, journal)


@contextmanager
def behaviour(before: bool) -> Iterator[dict[str, Any]]:
    """The options of one side; "before" also turns the caller-transaction guard
    off for the duration: no call sees the caller's transaction."""
    from django_syncguard.backends.database import sqlite

    shipped = sqlite.caller_transaction_holds
    if before:
        sqlite.caller_transaction_holds = lambda database, *, wal: False  # type: ignore[assignment]
    try:
        yield {"until_commit": not before}
    finally:
        sqlite.caller_transaction_holds = shipped


class Stamps:
    """Times of one sample: the commit's end (Django's connection.commit wrapped) and
    the release's (``lock_released``), and the release errors."""

    def __init__(self) -> None:
        self.committed: float | None = None
        self.released: float | None = None
        self.errors: list[str] = []

    def on_release_error(self, exc: BaseException, context: dict[str, str]) -> None:
        self.errors.append(type(exc).__name__)

    @contextmanager
    def watching(self) -> Iterator[None]:
        from django.db import connection

        from django_syncguard.signals import lock_released

        commit = connection.commit

        def stamped_commit() -> None:
            commit()
            self.committed = time.perf_counter()

        def released(**kwargs: Any) -> None:
            if kwargs.get("ok"):
                self.released = time.perf_counter()

        connection.commit = stamped_commit  # type: ignore[method-assign]
        lock_released.connect(released, weak=False)
        try:
            yield
        finally:
            lock_released.disconnect(released)
            del connection.commit


def new_invoice() -> int:
    from invoices.models import Invoice

    number = f"B{time.perf_counter_ns()}"
    return int(Invoice.objects.create(number=number, amount_cents=100).pk)


def remaining_ms(alias: str, key: str) -> float | None:
    """How long ``key``'s lock stays live from now (``None``: free)."""
    from django_syncguard import TIME_TOLERANCE_MS, locks

    info = locks[alias].lookup(key=key)
    if info is None:
        return None
    return float(info.expires_at_ms + TIME_TOLERANCE_MS - time.time() * 1000)


def release_sample(alias: str, before: bool) -> dict[str, Any]:
    """(a): write in atomic(), end the locked code, commit."""
    from django.db import transaction
    from invoices.models import Invoice

    from django_syncguard import locked

    pk = new_invoice()
    key = f"invoice:{pk}"
    stamps = Stamps()
    with behaviour(before) as options, stamps.watching(), transaction.atomic():
        with locked(
            key, using=alias, ttl_ms=TTL_MS, on_release_error=stamps.on_release_error, **options
        ):
            Invoice.objects.filter(pk=pk).update(paid=True)
            code_ended = time.perf_counter()
        block_ended = time.perf_counter()
    left = remaining_ms(alias, key)
    assert stamps.committed is not None
    return {
        "block_exit_ms": (block_ended - code_ended) * 1000,
        # Free right after the commit, or only at its TTL (then: how long from now).
        "commit_to_free_ms": (
            (stamps.released - stamps.committed) * 1000
            if stamps.released is not None and left is None
            else left
        ),
        "left_until_ttl": left is not None,
        "outcome": ",".join(stamps.errors) or "released",
    }


def pay(pk: int) -> Any:
    from invoices.payments import record_payment

    return record_payment(pk, "bench").as_dict()


#: The release errors of the views' locks, for the request being measured.
VIEW_RELEASE_ERRORS: list[str] = []


def on_release_error(exc: BaseException, context: dict[str, str]) -> None:
    VIEW_RELEASE_ERRORS.append(type(exc).__name__)


def make_views() -> list[Any]:
    """The payment views of (b): ``/<how>/<side>/<alias>/<pk>/``."""
    from django.db import transaction
    from django.http import HttpRequest, JsonResponse
    from django.urls import path

    from django_syncguard import locked

    def request_view(side: str, alias: str) -> Callable[..., JsonResponse]:
        # @locked on the view, inside the request's transaction (ATOMIC_REQUESTS).
        @locked(
            "invoice:<pk>",
            using=alias,
            ttl_ms=TTL_MS,
            until_commit=side == "after",
            on_release_error=on_release_error,
        )
        def view(request: HttpRequest, pk: int) -> JsonResponse:
            return JsonResponse(pay(pk))

        return view

    def atomic_view(side: str, alias: str) -> Callable[..., JsonResponse]:
        # The view's own atomic() around the locked payment.
        @transaction.non_atomic_requests
        def view(request: HttpRequest, pk: int) -> JsonResponse:
            with (
                transaction.atomic(),
                locked(
                    f"invoice:{pk}",
                    using=alias,
                    ttl_ms=TTL_MS,
                    until_commit=side == "after",
                    on_release_error=on_release_error,
                ),
            ):
                result = pay(pk)
            return JsonResponse(result)

        return view

    patterns = []
    for side in ("before", "after"):
        for alias in (SHORT, FULL):
            patterns += [
                path(f"requests/{side}/{alias}/<int:pk>/", request_view(side, alias)),
                path(f"atomic/{side}/{alias}/<int:pk>/", atomic_view(side, alias)),
            ]
    return patterns


def request_sample(how: str, alias: str, before: bool) -> dict[str, Any]:
    """(b): one POST, on a new invoice."""
    from django.test import Client

    from django_syncguard import locks

    VIEW_RELEASE_ERRORS.clear()
    pk = new_invoice()
    side = "before" if before else "after"
    client = Client()
    with behaviour(before):
        started = time.perf_counter()
        response = client.post(f"/{how}/{side}/{alias}/{pk}/")
        took = time.perf_counter() - started
    assert response.status_code == 200, response.content
    assert response.json()["paid"] is True
    return {
        "ms": took * 1000,
        "left_until_ttl": locks[alias].is_locked(f"invoice:{pk}"),
        "outcome": ",".join(VIEW_RELEASE_ERRORS) or "released",
    }


def acquire_behind_own_write(alias: str, before: bool) -> dict[str, Any]:
    """(c): inside atomic(), after an UPDATE, acquire."""
    from django.db import transaction
    from invoices.models import Invoice

    from django_syncguard import LockError, locks

    pk = new_invoice()
    with behaviour(before), transaction.atomic():
        Invoice.objects.filter(pk=pk).update(paid=True)
        started = time.perf_counter()
        try:
            locks[alias].acquire(f"invoice:{pk}", TTL_MS)
            outcome = "acquired"
        except LockError as exc:
            outcome = type(exc).__name__
        took = time.perf_counter() - started
    return {"ms": took * 1000, "outcome": outcome}


def acquire_while_another_writes(
    path: str, hold_ms: int, alias: str, before: bool
) -> dict[str, Any]:
    """(d): inside atomic(), before any query, acquire while another connection (as
    another process would) holds the write lock for ``hold_ms``."""
    from django.db import transaction

    from django_syncguard import LockError, locks

    holding = threading.Event()

    def other_writer() -> None:
        with sqlite3.connect(path, isolation_level=None, timeout=30) as other:
            other.execute("BEGIN IMMEDIATE")
            other.execute("UPDATE invoices_invoice SET paid_by = 'other' WHERE id = 1")
            holding.set()
            time.sleep(hold_ms / 1000)
            other.execute("COMMIT")
        other.close()

    key = f"other:{time.perf_counter_ns()}"
    writer = threading.Thread(target=other_writer)
    writer.start()
    holding.wait()
    with behaviour(before), transaction.atomic():
        started = time.perf_counter()
        try:
            result = locks[alias].acquire(key, TTL_MS)
            outcome = "acquired"
        except LockError as exc:
            outcome = type(exc).__name__
            result = None
        took = time.perf_counter() - started
    writer.join()
    if result is not None:
        locks[alias].release(result.lock_id)
    return {"ms": took * 1000, "outcome": outcome}


def child(args: argparse.Namespace) -> None:
    """Measure one journal mode; print the samples as JSON."""
    journal = args.child
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, f"bench-{journal}.sqlite3")
        setup_django(journal, path, args.before_timeout_ms)
        global urlpatterns
        urlpatterns = make_views()
        new_invoice()  # invoice 1, which (d)'s other writer updates
        n, m = args.samples, args.after_samples
        out: dict[str, dict[str, list[dict[str, Any]]]] = {}

        def measure(
            name: str, sample: Callable[..., dict[str, Any]], after: int, full: bool = True
        ) -> None:
            out[name] = {
                "before": [sample(SHORT, True) for _ in range(n)],
                "after": [sample(SHORT, False) for _ in range(after)],
            }
            if full:
                out[name]["before (5000 ms)"] = [sample(FULL, True)]

        def requests(how: str) -> Callable[..., dict[str, Any]]:
            return lambda alias, before: request_sample(how, alias, before)

        def while_another_writes(alias: str, before: bool) -> dict[str, Any]:
            return acquire_while_another_writes(path, args.hold_ms, alias, before)

        for warm_up in (release_sample, requests("requests"), requests("atomic")):
            warm_up(SHORT, False)  # connections, URL resolver, views
        measure("a", release_sample, m)
        measure("b_atomic_requests", requests("requests"), m)
        measure("b_atomic_view", requests("atomic"), m, full=False)
        measure("c", acquire_behind_own_write, n)
        measure("d", while_another_writes, n, full=False)
        out["versions"] = {"sqlite": [sqlite3.sqlite_version], "django": [django_version()]}
    print(json.dumps(out))


def django_version() -> str:
    import django

    return str(django.get_version())


# ---------------------------------------------------------------- the parent process


def run_child(journal: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", journal]
    for option in ("samples", "after_samples", "before_timeout_ms", "hold_ms"):
        command += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{journal}: the measuring process failed:\n{done.stderr}")
    print(f"  {journal}: measured in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return dict(json.loads(done.stdout.splitlines()[-1]))


def stats(values: list[float]) -> tuple[float, float]:
    """Median and p95 (the largest value when there are few samples)."""
    if len(values) == 1:
        return values[0], values[0]
    p95 = statistics.quantiles(values, n=20, method="inclusive")[18]
    return statistics.median(values), p95


def fmt(values: list[float]) -> str:
    median, p95 = stats(values)
    return f"{median:,.1f} / {p95:,.1f}"


def outcomes(samples: list[dict[str, Any]]) -> str:
    counts = Counter(s["outcome"] for s in samples)
    return ", ".join(f"{name} x{count}" for name, count in sorted(counts.items()))


def ratio(before: list[float], after: list[float]) -> str:
    b, a = statistics.median(before), statistics.median(after)
    return f"{b / a:,.0f}x" if a > 0 else "-"


def compared(data: dict[str, Any], field: str) -> str:
    """The ratio of the medians, unless the two sides did not end alike (then a
    shorter time is no gain)."""
    acquired = {side: {s["outcome"] == "acquired" for s in data[side]} for side in data}
    if acquired["before"] != acquired["after"]:
        return "- (" + ("after fails" if True in acquired["before"] else "before fails") + ")"
    return ratio([s[field] for s in data["before"]], [s[field] for s in data["after"]])


def table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    """One Markdown table: each measurement, before and after, per journal mode."""
    lines = [
        "| journal | measurement | before: median / p95 ms | after: median / p95 ms "
        "| before / after (medians) | before: outcome | after: outcome "
        "| before, OPERATION_TIMEOUT_MS 5000: ms (/ after), outcome |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def row(journal: str, what: str, data: dict[str, Any], field: str) -> None:
        before = [s[field] for s in data["before"]]
        after = [s[field] for s in data["after"]]
        full = data.get("before (5000 ms)")
        full_text = "-"
        if full is not None:
            value = full[0][field]
            full_text = f"{value:,.0f} ({ratio([value], after)}), {full[0]['outcome']}"
        lines.append(
            f"| {journal} | {what} | {fmt(before)} | {fmt(after)} | {compared(data, field)} "
            f"| {outcomes(data['before'])} | {outcomes(data['after'])} | {full_text} |"
        )

    for journal, out in results.items():
        a = out["a"]
        row(journal, "(a) end of the locked block, after a write in atomic()", a, "block_exit_ms")
        left_b = sum(s["left_until_ttl"] for s in a["before"])
        left_a = sum(s["left_until_ttl"] for s in a["after"])
        free_b = [s["commit_to_free_ms"] for s in a["before"]]
        free_a = [s["commit_to_free_ms"] for s in a["after"]]
        full = a["before (5000 ms)"][0]
        lines.append(
            f"| {journal} | (a) commit -> lock free | {fmt(free_b)} (its TTL) | {fmt(free_a)} "
            f"| {ratio(free_b, free_a)} | left until TTL: {left_b}/{len(a['before'])} "
            f"| left until TTL: {left_a}/{len(a['after'])} "
            f"| {full['commit_to_free_ms']:,.0f} (its TTL) |"
        )
        row(journal, "(b) POST, ATOMIC_REQUESTS, @locked view", out["b_atomic_requests"], "ms")
        row(journal, "(b) POST, atomic() in the view", out["b_atomic_view"], "ms")
        row(journal, "(c) acquire behind the caller's own write: time to fail", out["c"], "ms")
        row(
            journal,
            f"(d) acquire in atomic() before any query, another connection writing for "
            f"{args.hold_ms} ms",
            out["d"],
            "ms",
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=10, help="'before' samples (each stalls)")
    parser.add_argument("--after-samples", type=int, default=100)
    parser.add_argument(
        "--before-timeout-ms",
        type=int,
        default=500,
        help="OPERATION_TIMEOUT_MS of the 'before' samples (one more sample uses 5000)",
    )
    parser.add_argument("--hold-ms", type=int, default=300, help="(d): the other writer's hold")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", choices=JOURNALS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    started = time.perf_counter()
    results = {journal: run_child(journal, args) for journal in JOURNALS}
    elapsed = time.perf_counter() - started
    text = table(results, args)
    print(text)
    versions = results[JOURNALS[0]]["versions"]
    out = args.out or ROOT / "bench" / "reports" / f"{dt.date.today()}-sqlite-transactions.md"
    out.write_text(report(text, args, versions, elapsed))
    print(f"\nReport: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


def report(text: str, args: argparse.Namespace, versions: dict[str, Any], elapsed: float) -> str:
    command = (
        f".venv/bin/python bench/sqlite_transactions.py --samples {args.samples} "
        f"--after-samples {args.after_samples} --before-timeout-ms {args.before_timeout_ms} "
        f"--hold-ms {args.hold_ms}"
    )
    return f"""# SQLite: locks inside the caller's transactions, before and after `until_commit`

{dt.datetime.now().strftime("%Y-%m-%d %H:%M")}, {machine()}; SQLite {versions["sqlite"][0]},
Django {versions["django"][0]}; load average {", ".join(f"{x:.2f}" for x in os.getloadavg())}.
`{command}` ({elapsed:.0f} s).

The database backend with the locks in the same SQLite file as the data, `DELETE`
journal (Django's default: WAL off) and WAL, each in a fresh process and file.
**Before**: `until_commit=False` and the caller-transaction guard off
(`sqlite.caller_transaction_holds` patched to `False`: the pre-guard path,
SQLite's busy timeout at the operation timeout), with `OPERATION_TIMEOUT_MS` =
{args.before_timeout_ms} ms ({args.samples} samples) and one sample at the default
5000 ms. **After**: as shipped ({args.after_samples} samples;
(c) and (d): {args.samples}). TTL {TTL_MS:,} ms. Times in ms.

{text}

(a) The end of the locked block is where the release runs (before) or is handed to
the transaction (after); "commit -> lock free" is from the end of Django's commit to
the end of the release (after), or the time the lock still had to live at that point
(before: it was left until its TTL, plus the 1000 ms time tolerance). (b) A new
invoice per request, through Django's test client (URL routing, the view, the
request's transaction); the view reads the invoice, then writes it and a payment.
(c) An acquire after an `UPDATE` in the caller's transaction. (d) An acquire inside
`atomic()` before any query, as `@locked` on a view under `ATOMIC_REQUESTS` does,
while another connection holds SQLite's write lock for {args.hold_ms} ms: the guard
cannot tell this from (c), and fails after 100 ms a lock it would have got.
"""


if __name__ == "__main__":
    main()
