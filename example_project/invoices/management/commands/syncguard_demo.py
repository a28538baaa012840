"""Two workers try to pay the same invoice at once."""

from __future__ import annotations

import threading
from typing import Any

from django.core.management.base import BaseCommand

from django_syncguard import current_lock, locks

from ...models import Invoice
from ...payments import pay_invoice


class Command(BaseCommand):
    help = "Two workers pay the same invoice at the same time; the lock lets one through."

    def handle(self, *args: Any, **options: Any) -> None:
        invoice, _ = Invoice.objects.update_or_create(
            number="INV-0042", defaults={"amount_cents": 12_500, "paid": False, "paid_by": ""}
        )
        key = f"invoice:{invoice.pk}"
        first_inside = threading.Event()
        second_waiting = threading.Event()
        outcomes: list[tuple[str, str]] = []

        def slow_provider() -> None:
            lease = current_lock()
            assert lease is not None
            name = threading.current_thread().name
            self.stdout.write(f"  {name} holds {lease.key} with fence {lease.fence}")
            first_inside.set()
            # The payment provider is slow: long enough for the other worker to arrive.
            second_waiting.wait(timeout=10)

        def worker(second: bool) -> None:
            name = threading.current_thread().name
            if second:
                first_inside.wait(timeout=10)
                if locks["default"].is_locked(key):
                    self.stdout.write(f"  {name} finds {key} locked and waits")
                second_waiting.set()
            payment = pay_invoice(invoice.pk, name, slow_provider)
            outcome = "paid the invoice" if payment.paid else "found it already paid"
            outcomes.append((payment.fence, f"  {name} (fence {payment.fence}) {outcome}"))

        self.stdout.write(self.style.MIGRATE_HEADING(f"Paying {invoice} with two workers"))
        threads = [
            threading.Thread(target=worker, args=(False,), name="worker-A"),
            threading.Thread(target=worker, args=(True,), name="worker-B"),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for _, line in sorted(outcomes):  # in the order the lock was held
            self.stdout.write(line)
        invoice.refresh_from_db()
        self.stdout.write(
            self.style.SUCCESS(
                f"{invoice} paid={invoice.paid} by {invoice.paid_by} (fence {invoice.fence})"
            )
        )
