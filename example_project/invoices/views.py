"""``POST /invoices/<pk>/pay/``: pay an invoice, one request at a time.

The lock ``invoice:<pk>`` is taken around the view. A request that cannot get it
within ``WAIT_MS`` (another request or a task is paying the invoice) is answered
``409 Conflict`` with ``Retry-After``, rather than tying up a web worker.

The view runs in the request's transaction (``ATOMIC_REQUESTS`` in the settings).
``@locked`` sits on the view itself, so the lock is taken before the view's first
query; it is released right after that transaction commits (``until_commit``, the
default), so whoever takes the lock next reads the payment, never the invoice as it
was before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_POST

from django_syncguard import AcquisitionTimeout, StaleFenceError, locked

from .models import Invoice
from .payments import record_payment

#: How long a request waits for the invoice's lock before answering 409.
WAIT_MS = 250
#: The ``paid_by`` of payments made through the web, unless renamed.
WEB_WORKER = "web"
_web_worker = WEB_WORKER

View = Callable[..., HttpResponse]


def name_web_worker(name: str) -> None:
    """Name the payments this process makes through the web (the demo's web workers
    use their own names)."""
    global _web_worker
    _web_worker = name


def conflict_when_busy(view: View) -> View:
    """Answer ``409 Conflict`` when ``view`` could not get its lock in time, or its lease
    ran out before it wrote (``StaleFenceError``: nothing was written)."""

    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        try:
            return view(request, *args, **kwargs)
        except AcquisitionTimeout:
            body = {"error": "locked", "detail": "Another worker is paying this invoice."}
        except StaleFenceError:
            body = {"error": "stale", "detail": "The payment took too long; nothing was saved."}
        return JsonResponse(body, status=409, headers={"Retry-After": "1"})

    return wrapper


@require_POST
@conflict_when_busy
@locked("invoice:<pk>", ttl_ms=30_000, timeout_ms=WAIT_MS)
def pay(request: HttpRequest, pk: int) -> JsonResponse:
    """Pay invoice ``pk``; the JSON body is the ``PaymentResult`` (``paid`` is false when
    the invoice was already paid)."""
    try:
        result = record_payment(pk, _web_worker)
    except Invoice.DoesNotExist:
        raise Http404(f"No invoice {pk}.") from None
    return JsonResponse(result.as_dict())
