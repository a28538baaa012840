"""The README's main command: the example project's demo, run as a user would.

The example project has its own settings (SQLite file, database lock backend), so
everything here runs in subprocesses inside ``example_project/``, each on a fresh
database file (``EXAMPLE_DB_PATH``): fences start at 1 and the output is exact.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.celery_worker import CeleryWorker, redis_url
from tests.support.servers import start_or_skip

EXAMPLE = Path(__file__).resolve().parent.parent / "example_project"

Run = Callable[..., str]


@pytest.fixture
def example(tmp_path: Path) -> tuple[Run, Path]:
    """A runner of ``python <args>`` in the example project on a fresh, migrated
    database, and the database's path."""
    database = tmp_path / "example.sqlite3"
    env = {**os.environ, "EXAMPLE_DB_PATH": str(database)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    # This checkout's django_syncguard, not whichever one the interpreter has installed
    # (from another worktree, say): the cwd is example_project/, not the checkout.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXAMPLE.parent), env.get("PYTHONPATH")]))

    def run(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, *args],
            cwd=EXAMPLE,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    run("manage.py", "migrate", "--noinput", "--verbosity", "0")
    return run, database


@pytest.mark.slow
def test_demo_pays_the_invoice_exactly_once(example: tuple[Run, Path]) -> None:
    run, database = example

    lines = run("manage.py", "syncguard_demo").splitlines()

    assert lines == [
        "Paying Invoice INV-0042 (pk 1, 125.00) with 4 worker processes",
        "  Each worker is its own Python process; the lock invoice:<pk> and its fences live "
        "in the shared SQLite file.",
        "1. worker-1 takes the lock, then stalls past its lease",
        "  worker-1 (300 ms lease) holds invoice:1 with fence 000000000000001, then stalls "
        "before writing",
        "  worker-1's lease ran out while it stalled: invoice:1 is free again",
        "2. Three more workers pay it at the same time",
        "  worker-2 (web) POST /invoices/1/pay/ holds invoice:1 with fence 000000000000002 "
        "and charges the card",
        "  worker-3 (task) finds invoice:1 locked and waits",
        "  worker-4 (web) POST /invoices/1/pay/ -> 409 Conflict: Another worker is paying "
        "this invoice.",
        "  worker-2's view wrote the payment and returned; its request's transaction "
        "(ATOMIC_REQUESTS) has not committed yet",
        # The lock outlives the view: released now, it would let worker-3 read this.
        "  Until then others read Invoice INV-0042 paid=False, and invoice:1 stays locked",
        "  worker-2's transaction commits, and only then is invoice:1 released",
        "  worker-2 (web) POST /invoices/1/pay/ -> 200 OK: paid (fence 000000000000002)",
        # The next holder reads the committed payment.
        "  worker-3 (task) then holds invoice:1 with fence 000000000000003, reads Invoice "
        "INV-0042 paid by worker-2 and does not pay again",
        "3. worker-1 wakes up and writes with its old fence",
        "  worker-1 (fence 000000000000001) is rejected: StaleFenceError: Stale fence "
        "000000000000001: a newer holder has already written this row.",
        "Result",
        "  Invoice INV-0042 paid=True by worker-2 (fence 000000000000002)",
        "  Payments recorded: 1 (worker-2, fence 000000000000002)",
    ]
    with sqlite3.connect(database) as db:
        invoices = db.execute(
            "SELECT id, number, paid, paid_by, fence FROM invoices_invoice"
        ).fetchall()
        payments = db.execute(
            "SELECT invoice_id, worker, fence, amount_cents FROM invoices_payment"
        ).fetchall()
        # Every lock was released: worker-1's expired, the others' by their holders.
        held = db.execute("SELECT count(*) FROM syncguard_locks").fetchone()[0]
    assert invoices == [(1, "INV-0042", 1, "worker-2", "000000000000002")]
    assert payments == [(1, "worker-2", "000000000000002", 12_500)]
    assert held == 0


# Runs in the example project with its settings: the view through Django's test
# client, while another holder has the lock and after it let go; then the task. Each
# release of the view's lock records whether the request's transaction was still open
# and what another connection to the file read then.
VIEW_AND_TASK = """
import json, os, sqlite3
from contextlib import closing

import django

os.environ["DJANGO_SETTINGS_MODULE"] = "example_project.settings"
django.setup()

from django.conf import settings
from django.core import checks
from django.db import connection
from django.test import Client

from django_syncguard import locks
from django_syncguard.signals import lock_released
from invoices import tasks
from invoices.models import Invoice, Payment

web = Invoice.objects.create(number="INV-0100", amount_cents=5_000)
queued = Invoice.objects.create(number="INV-0200", amount_cents=7_000)
client = Client(HTTP_HOST="localhost")
out = {"atomic_requests": settings.DATABASES["default"]["ATOMIC_REQUESTS"], "releases": []}
out["checks"] = [[m.id, m.msg] for m in checks.run_checks(tags=["syncguard"])]
out["silenced"] = settings.SILENCED_SYSTEM_CHECKS

def post(pk):
    response = client.post(f"/invoices/{pk}/pay/")
    return [response.status_code, response.get("Retry-After"), response.json()]

def released(sender, **kwargs):
    with closing(sqlite3.connect(settings.DATABASES["default"]["NAME"])) as other:
        paid = other.execute("SELECT paid FROM invoices_invoice WHERE id = ?", [web.pk])
        out["releases"].append([connection.in_atomic_block, bool(paid.fetchone()[0])])

someone_else = locks["default"].acquire(f"invoice:{web.pk}", 10_000)
out["while_locked"] = post(web.pk)
out["still_unpaid"] = Invoice.objects.get(pk=web.pk).paid
locks["default"].release(someone_else.lock_id)
lock_released.connect(released)
out["first"] = post(web.pk)
out["second"] = post(web.pk)
lock_released.disconnect(released)
out["get"] = client.get(f"/invoices/{web.pk}/pay/").status_code
out["missing"] = client.post("/invoices/999/pay/").status_code
out["task"] = [tasks.pay_invoice(queued.pk, "worker-7"), tasks.pay_invoice(queued.pk, "worker-8")]
out["invoices"] = list(
    Invoice.objects.order_by("pk").values_list("number", "paid", "paid_by", "fence")
)
out["payments"] = list(
    Payment.objects.order_by("pk").values_list("invoice__number", "worker", "fence")
)
out["held"] = [locks["default"].is_locked(f"invoice:{pk}") for pk in (web.pk, queued.pk, 999)]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_view_pays_once_and_answers_409_while_the_invoice_is_locked(
    example: tuple[Run, Path],
) -> None:
    """The view in the request's transaction (ATOMIC_REQUESTS) on SQLite, with the
    locks in the same file: its lock is taken before its first query and released
    right after the commit."""
    run, _ = example

    out = json.loads(run("-c", VIEW_AND_TASK))

    assert out["atomic_requests"] is True
    # Someone else held invoice:1 (fence 1): the view gave up after its short wait.
    assert out["while_locked"] == [
        409,
        "1",
        {"error": "locked", "detail": "Another worker is paying this invoice."},
    ]
    assert out["still_unpaid"] is False
    # Once it was free: paid by the first request, not by the second.
    assert out["first"] == [
        200,
        None,
        {
            "invoice": "INV-0100",
            "worker": "web",
            "fence": "000000000000002",
            "paid": True,
            "paid_by": "web",
        },
    ]
    assert out["second"] == [
        200,
        None,
        {
            "invoice": "INV-0100",
            "worker": "web",
            "fence": "000000000000003",
            "paid": False,
            "paid_by": "web",
        },
    ]
    # Each request's lock was released after its transaction had ended, when another
    # connection already read the invoice as paid.
    assert out["releases"] == [[False, True], [False, True]]
    assert out["get"] == 405
    # An unknown invoice: the view raised Http404 inside the transaction, which rolled
    # back; the lock was released all the same (held is False for invoice:999 below).
    assert out["missing"] == 404
    # The Celery task, called directly (it runs here, locked as in a worker), has its
    # own key: invoice:2.
    assert out["task"] == [
        {
            "invoice": "INV-0200",
            "worker": "worker-7",
            "fence": "000000000000001",
            "paid": True,
            "paid_by": "worker-7",
        },
        {
            "invoice": "INV-0200",
            "worker": "worker-8",
            "fence": "000000000000002",
            "paid": False,
            "paid_by": "worker-7",
        },
    ]
    assert out["invoices"] == [
        ["INV-0100", True, "web", "000000000000002"],
        ["INV-0200", True, "worker-7", "000000000000001"],
    ]
    assert out["payments"] == [
        ["INV-0100", "web", "000000000000002"],
        ["INV-0200", "worker-7", "000000000000001"],
    ]
    assert out["held"] == [False, False, False]
    # ATOMIC_REQUESTS on SQLite with the lock taken by the view's decorator is clean:
    # no check message, nothing silenced.
    assert out["silenced"] == []
    assert out["checks"] == []


# Both 409s of the view, each raised by the library for real: the invoice's lock held
# by someone else (AcquisitionTimeout), and a row already written with a newer fence
# than the view's (StaleFenceError). Prints each answer's status, body and raw bytes,
# and what the library's messages would have told about the key.
CONFLICTS = """
import json, os

import django

os.environ["DJANGO_SETTINGS_MODULE"] = "example_project.settings"
django.setup()

from django.test import Client

from django_syncguard import hash_key, locks
from django_syncguard.keys import display_hash
from invoices.models import Invoice

client = Client(HTTP_HOST="localhost")
busy = Invoice.objects.create(number="INV-0300", amount_cents=1_000)
stale = Invoice.objects.create(number="INV-0400", amount_cents=1_000, fence="999999999999999")
someone_else = locks["default"].acquire(f"invoice:{busy.pk}", 10_000)
out = {}
for name, invoice in (("busy", busy), ("stale", stale)):
    response = client.post(f"/invoices/{invoice.pk}/pay/")
    key = f"invoice:{invoice.pk}"
    out[name] = {
        "status": response.status_code,
        "body": response.json(),
        "raw": response.content.decode(),
        "telling": [key, hash_key(key), display_hash(key)],
    }
out["stale_paid"] = Invoice.objects.get(pk=stale.pk).paid
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_409_answers_never_echo_the_librarys_messages(example: tuple[Run, Path]) -> None:
    """A client learns that the invoice is busy, never the key, its hashes or the
    library's text (``Lock on key ... still held``, ``Stale fence ...``)."""
    run, _ = example

    out = json.loads(run("-c", CONFLICTS))

    assert out["busy"]["status"] == out["stale"]["status"] == 409
    assert out["busy"]["body"] == {
        "error": "locked",
        "detail": "Another worker is paying this invoice.",
    }
    assert out["stale"]["body"] == {
        "error": "stale",
        "detail": "The payment took too long; nothing was saved.",
    }
    assert out["stale_paid"] is False
    for answer in (out["busy"], out["stale"]):
        library_text = ["Lock on key", "still held", "Stale fence", "newer holder", "fence"]
        assert [t for t in answer["telling"] + library_text if t in answer["raw"]] == []


# -- the example's Celery task, run by a real worker --------------------------------

#: redis-server databases of the example's broker and results (the other Celery tests
#: use 1 and 2).
EXAMPLE_BROKER_DB, EXAMPLE_RESULT_DB = 3, 4


@dataclass
class ExampleWorker(CeleryWorker):
    """``celery -A example_project worker`` (prefork, two processes) started in
    ``example_project/`` as its README says, on the example's SQLite file."""

    example_db: str = ""
    app_module = "example_project"
    cwd = EXAMPLE

    @property
    def conf(self) -> dict[str, Any]:
        return {
            "broker_url": redis_url(self.redis_port, EXAMPLE_BROKER_DB),
            "result_backend": redis_url(self.redis_port, EXAMPLE_RESULT_DB),
        }

    def env(self) -> dict[str, str]:
        """The example's own settings, told where its database and broker are."""
        env = {
            **os.environ,
            "EXAMPLE_DB_PATH": self.example_db,
            "CELERY_BROKER_URL": self.conf["broker_url"],
            "CELERY_RESULT_BACKEND": self.conf["result_backend"],
        }
        env.pop("DJANGO_SETTINGS_MODULE", None)
        return env


@pytest.fixture
def example_worker(example: tuple[Run, Path], redis_server: Any) -> Iterator[ExampleWorker]:
    _, database = example
    # postgres_port and database: the test app's worker settings, unused here.
    worker = ExampleWorker(
        redis_port=redis_server.port, postgres_port=0, database="", example_db=str(database)
    )
    start_or_skip(worker, "the example's celery worker")
    try:
        yield worker
    finally:
        worker.destroy()


@pytest.mark.slow
def test_the_example_task_queued_four_times_pays_once(
    example: tuple[Run, Path], example_worker: ExampleWorker
) -> None:
    """``pay_invoice.delay`` four times at once: the worker's two processes run the
    four tasks, one at a time on invoice:<pk>, and only the first pays."""
    run, database = example
    pk = int(
        run(
            "manage.py",
            "shell",
            "--verbosity",
            "0",
            "-c",
            "from invoices.models import Invoice; "
            "print(Invoice.objects.create(number='INV-0300', amount_cents=9_900).pk)",
        )
    )
    app = example_worker.client()

    queued = [app.send_task("invoices.pay_invoice", args=[pk, f"task-{i}"]) for i in range(1, 5)]
    results = [r.get(timeout=60) for r in queued]

    by_fence = sorted(results, key=lambda r: r["fence"])
    first = by_fence[0]["worker"]
    assert [r["fence"] for r in by_fence] == [f"{n:015d}" for n in range(1, 5)]
    assert [r["paid"] for r in by_fence] == [True, False, False, False]
    assert {r["paid_by"] for r in results} == {first}
    assert sorted(r["worker"] for r in results) == ["task-1", "task-2", "task-3", "task-4"]
    with contextlib.closing(sqlite3.connect(database)) as db:
        payments = db.execute("SELECT worker, fence FROM invoices_payment").fetchall()
    assert payments == [(first, "000000000000001")]
