"""Four worker processes pay the same invoice at once; the invoice is paid once.

Run by ``make demo``. The workers (see ``invoices/demo_workers.py``) are separate
processes on the default lock backend, the database: the locks and their fence
counters live in the example's SQLite file, which all the processes share. The
command starts them, tells each when to act, and prints what they report.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
from http import HTTPStatus
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from django_syncguard import TIME_TOLERANCE_MS, locks

from ...demo_workers import STALL_TTL_MS, Report, Role, run_worker
from ...models import Invoice
from ...payments import LOCK_KEY

NUMBER = "INV-0042"
AMOUNT_CENTS = 12_500
#: The worker processes and what each does (see demo_workers.ROLES).
WORKERS: dict[str, Role] = {
    "worker-1": "stall",  # the payment with a 300 ms lease; stalls past it
    "worker-2": "pay",  # POST /invoices/<pk>/pay/; pays in the request's transaction
    "worker-3": "wait",  # the task; waits for worker-2, then finds the invoice paid
    "worker-4": "web",  # POST /invoices/<pk>/pay/ while worker-2 holds the lock
}
#: How long the command waits for any one report of a worker.
REPORT_TIMEOUT_S = 60.0


class Workers:
    """The spawned worker processes, the events that steer them, and their reports."""

    def __init__(self, invoice_id: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.reports = ctx.Queue()
        self.go = {name: ctx.Event() for name in WORKERS}
        self.resume = {name: ctx.Event() for name in WORKERS}
        settings_module = os.environ["DJANGO_SETTINGS_MODULE"]
        database = str(settings.DATABASES["default"]["NAME"])
        self.processes = [
            ctx.Process(
                target=run_worker,
                args=(
                    name,
                    role,
                    invoice_id,
                    settings_module,
                    database,
                    self.go[name],
                    self.resume[name],
                    self.reports,
                ),
                name=name,
                daemon=True,
            )
            for name, role in WORKERS.items()
        ]
        self._pending: list[Report] = []

    def start(self) -> None:
        """Start every process and wait until each has set Django up."""
        for process in self.processes:
            process.start()
        for name in WORKERS:
            self.expect(name, "ready")

    def expect(self, worker: str, event: str) -> dict[str, Any]:
        """The details of ``worker``'s next report, which must be ``event``.

        Reports of other workers that arrive first are kept for later, so the order
        of printing never depends on the order of arrival.
        """
        deadline = time.monotonic() + REPORT_TIMEOUT_S
        while True:
            for index, (name, got, details) in enumerate(self._pending):
                if got == "error":
                    raise CommandError(f"{name} failed:\n{details['traceback']}")
                if name == worker:
                    del self._pending[index]
                    if got != event:
                        raise CommandError(f"{worker} reported {got} {details}, not {event}.")
                    return details
            try:
                left = max(0.0, deadline - time.monotonic())
                self._pending.append(self.reports.get(timeout=left))
            except queue.Empty:
                raise CommandError(
                    f"No {event!r} from {worker} in {REPORT_TIMEOUT_S:.0f} s."
                ) from None

    def join(self) -> None:
        """Wait for every worker to exit; fail unless each exited cleanly."""
        for process in self.processes:
            process.join(timeout=REPORT_TIMEOUT_S)
        failed = [p.name for p in self.processes if p.exitcode != 0]
        if failed:
            self.terminate()
            raise CommandError(f"{', '.join(failed)} did not exit cleanly.")

    def terminate(self) -> None:
        """Stop the workers that are still running (after a failure of the demo)."""
        for process in self.processes:
            if process.is_alive():
                process.terminate()
            process.join()


class Command(BaseCommand):
    help = "Four worker processes pay the same invoice at once; it is paid exactly once."

    def handle(self, *args: Any, **options: Any) -> None:
        invoice = self.unpaid_invoice()
        key = LOCK_KEY.format(pk=invoice.pk)
        if locks["default"].is_locked(key):
            raise CommandError(f"{key} is still held by an interrupted run; try again in 30 s.")
        amount = f"{invoice.amount_cents // 100}.{invoice.amount_cents % 100:02d}"
        # The lock is named by the primary key, not the invoice's number: say which.
        count = len(WORKERS)
        self.heading(f"Paying {invoice} (pk {invoice.pk}, {amount}) with {count} worker processes")
        self.say(
            "  Each worker is its own Python process; the lock invoice:<pk> and its fences "
            "live in the shared SQLite file."
        )
        workers = Workers(invoice.pk)
        try:
            workers.start()
            self.stall_past_the_lease(workers, key)
            self.pay_at_once(workers, invoice, key)
            self.heading("3. worker-1 wakes up and writes with its old fence")
            workers.resume["worker-1"].set()
            stale = workers.expect("worker-1", "stale")
            self.say(f"  worker-1 (fence {stale['fence']}) is rejected: {stale['error']}", "NOTICE")
        except BaseException:
            workers.terminate()
            raise
        workers.join()
        self.result(invoice)

    def unpaid_invoice(self) -> Invoice:
        """The demo's invoice, unpaid and with no payments (created on the first run)."""
        invoice, _ = Invoice.objects.update_or_create(
            number=NUMBER,
            defaults={"amount_cents": AMOUNT_CENTS, "paid": False, "paid_by": "", "fence": None},
        )
        invoice.payments.all().delete()
        return invoice

    def stall_past_the_lease(self, workers: Workers, key: str) -> None:
        """worker-1 takes the lock with a short lease and stalls until it has expired."""
        self.heading("1. worker-1 takes the lock, then stalls past its lease")
        workers.go["worker-1"].set()
        held = workers.expect("worker-1", "holds")
        self.say(
            f"  worker-1 ({held['ttl_ms']} ms lease) holds {held['key']} with fence "
            f"{held['fence']}, then stalls before writing"
        )
        # Waiting for a condition, not for an order: the lease ends by itself.
        deadline = time.monotonic() + (STALL_TTL_MS + TIME_TOLERANCE_MS) / 1000 + 10
        while locks["default"].is_locked(key):
            if time.monotonic() > deadline:
                raise CommandError(f"{key} did not expire.")
            time.sleep(0.02)
        self.say(f"  worker-1's lease ran out while it stalled: {key} is free again")

    def pay_at_once(self, workers: Workers, invoice: Invoice, key: str) -> None:
        """worker-2's request holds the lock while worker-3 waits for it and worker-4's
        request is turned away; then worker-2 pays (see :meth:`commit_then_release`)."""
        self.heading("2. Three more workers pay it at the same time")
        workers.go["worker-2"].set()
        held = workers.expect("worker-2", "holds")
        path = f"/invoices/{invoice.pk}/pay/"
        self.say(
            f"  worker-2 (web) POST {path} holds {key} with fence {held['fence']} "
            "and charges the card"
        )
        workers.go["worker-3"].set()
        workers.expect("worker-3", "waiting")
        self.say(f"  worker-3 (task) finds {key} locked and waits")
        workers.go["worker-4"].set()
        answer = workers.expect("worker-4", "response")
        self.say(f"  worker-4 (web) POST {answer['path']} -> {self.answer(answer)}", "NOTICE")
        self.commit_then_release(workers, invoice, key)

    def commit_then_release(self, workers: Workers, invoice: Invoice, key: str) -> None:
        """worker-2's view pays and returns; its lock outlives the view until the
        request's transaction commits (worker-2 holds the commit until told), and
        worker-3, next in line, reads the committed payment."""
        workers.resume["worker-2"].set()
        workers.expect("worker-2", "committing")
        self.say(
            "  worker-2's view wrote the payment and returned; its request's transaction "
            "(ATOMIC_REQUESTS) has not committed yet"
        )
        invoice.refresh_from_db()
        state = "stays locked" if locks["default"].is_locked(key) else "is already free"
        self.say(f"  Until then others read {invoice} paid={invoice.paid}, and {key} {state}")
        workers.resume["worker-2"].set()
        released = workers.expect("worker-2", "released")
        answer = workers.expect("worker-2", "response")
        if released["after_commit"]:
            self.say(f"  worker-2's transaction commits, and only then is {key} released")
        else:
            self.say("  worker-2's lock was released before its transaction committed")
        self.say(f"  worker-2 (web) POST {answer['path']} -> {self.answer(answer)}")
        done = workers.expect("worker-3", "result")
        read = f"{invoice} paid by {done['paid_by']}" if done["paid_by"] else f"{invoice} unpaid"
        outcome = "pays it" if done["paid"] else "does not pay again"
        self.say(
            f"  worker-3 (task) then holds {key} with fence {done['fence']}, reads {read} "
            f"and {outcome}"
        )

    @staticmethod
    def answer(response: dict[str, Any]) -> str:
        """``200 OK: ...`` for a worker's reported response."""
        status = HTTPStatus(response["status"])
        body = response["body"]
        if "detail" in body:
            return f"{status.value} {status.phrase}: {body['detail']}"
        outcome = "paid" if body.get("paid") else "already paid"
        return f"{status.value} {status.phrase}: {outcome} (fence {body.get('fence')})"

    def result(self, invoice: Invoice) -> None:
        """Print the invoice row and its payments; fail unless it was paid exactly once."""
        invoice.refresh_from_db()
        payments = list(invoice.payments.order_by("pk"))
        self.heading("Result")
        self.say(
            f"  {invoice} paid={invoice.paid} by {invoice.paid_by} (fence {invoice.fence})",
            "SUCCESS",
        )
        recorded = "; ".join(f"{p.worker}, fence {p.fence}" for p in payments)
        self.say(f"  Payments recorded: {len(payments)} ({recorded})", "SUCCESS")
        if not invoice.paid or len(payments) != 1:
            raise CommandError(f"{invoice} was not paid exactly once.")

    def heading(self, text: str) -> None:
        self.stdout.write(self.style.MIGRATE_HEADING(text))

    def say(self, text: str, style: str | None = None) -> None:
        self.stdout.write(getattr(self.style, style)(text) if style else text)
