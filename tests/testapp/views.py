import functools
import json

from django.db import connections
from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt

from django_syncguard import (
    AcquisitionTimeout,
    StaleFenceError,
    afenced_update,
    current_lock,
    locked,
)
from tests.testapp.models import Account, Ledger


@locked("invoice:<pk>", max_retries=0)
def pay_invoice(request, pk):
    lease = current_lock()
    return JsonResponse({"pk": pk, "key": lease.key, "fence": lease.fence})


def conflict_when_skipped(view):
    """409 when ``on_contended="skip"`` skipped the view (it returned None)."""

    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        response = view(request, *args, **kwargs)
        return response if response is not None else JsonResponse({"error": "busy"}, status=409)

    return wrapper


def conflict_on_timeout(view):
    """409 when the lock could not be taken (``on_contended="raise"``, or a timeout)."""

    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        try:
            return view(request, *args, **kwargs)
        except AcquisitionTimeout:
            return JsonResponse({"error": "locked"}, status=409)

    return wrapper


@conflict_when_skipped
@locked("invoice:<pk>", on_contended="skip")
def refresh_invoice(request, pk):
    return JsonResponse({"fence": current_lock().fence})


@conflict_on_timeout
@locked("invoice:<pk>", on_contended="raise")
def pay_or_refuse(request, pk):
    return JsonResponse({"fence": current_lock().fence})


@locked("invoice:<pk>", timeout_ms=30_000)  # on_contended="wait", the default
def pay_when_free(request, pk):
    return JsonResponse({"fence": current_lock().fence})


@locked("invoice:<pk>", max_retries=0)
async def apay_invoice(request, pk):
    lease = current_lock()
    return JsonResponse({"pk": pk, "key": lease.key, "fence": lease.fence})


@locked("invoice:<pk>", max_retries=0)
def pay_atomic(request, pk):
    """Runs inside ATOMIC_REQUESTS on the "postgres" alias (see test_database_backend)."""
    from django.db import connections

    from django_syncguard.backends.database import DatabaseBackend
    from tests.testapp.models import Account

    lease = current_lock()
    Account.objects.using("postgres").create(name=f"paid-{pk}", fence=lease.fence)
    observer = DatabaseBackend("observer", {"OPTIONS": {"DATABASE": "postgres"}})
    visible = observer.is_locked(f"invoice:{pk}")
    observer.close()
    if request.GET.get("fail"):
        raise RuntimeError("payment provider failed")
    return JsonResponse(
        {
            "fence": lease.fence,
            "visible_elsewhere": visible,
            "in_atomic": connections["postgres"].in_atomic_block,
        }
    )


# The views of test_transactions_concurrency.py: under ATOMIC_REQUESTS on the
# ``database`` alias, Django opens the request's transaction around the decorated
# view, so the lock is taken inside it and released after its commit or rollback.
WAITING = {"max_retries": 100_000, "retry_delay_ms": 1, "backoff": "fixed", "timeout_ms": 60_000}


def with_ledger_line(view):
    """The request's transaction goes on after the locked view returns: it writes a
    ledger line. A lock released as the view returns would be free before the commit."""

    @functools.wraps(view)
    def write_after(request, database, pk):
        response = view(request, database=database, pk=pk)
        Ledger.objects.using(database).create(total=json.loads(response.content)["seen"] + 1)
        return response

    return write_after


@csrf_exempt
@with_ledger_line
@locked("account:<pk>", **WAITING)
def deposit(request, database, pk):
    """Read the balance, write it plus one (read-modify-write)."""
    accounts = Account.objects.using(database)
    seen = accounts.get(pk=pk).balance
    accounts.filter(pk=pk).update(balance=seen + 1)
    in_atomic = connections[database].in_atomic_block
    return JsonResponse({"seen": seen, "fence": current_lock().fence, "in_atomic": in_atomic})


@csrf_exempt
@locked("account:<pk>")
def deposit_then_fail(request, database, pk):
    """Write the balance plus one, then fail: the request's transaction rolls back."""
    accounts = Account.objects.using(database)
    accounts.filter(pk=pk).update(balance=accounts.get(pk=pk).balance + 1)
    raise RuntimeError("payment provider failed")


@locked("account:<pk>", max_retries=0)
def balance(request, database, pk):
    """The balance, read under the lock; refused at once if the lock is held."""
    account = Account.objects.using(database).get(pk=pk)
    return JsonResponse({"balance": account.balance, "fence": current_lock().fence})


@csrf_exempt
@locked("account:<pk>", until_commit=False)
async def adeposit(request, database, pk):
    """Add one to the balance with an async fenced write (``afenced_update``); 409
    when a newer holder has already written the row."""
    accounts = Account.objects.using(database).filter(pk=pk)
    lease = current_lock()
    try:
        account = await accounts.aget()
        await afenced_update(accounts, lease.fence, balance=account.balance + 1)
    except StaleFenceError:
        return JsonResponse({"error": "stale"}, status=409)
    return JsonResponse({"fence": lease.fence})
