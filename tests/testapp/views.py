from django.http import JsonResponse

from django_syncguard import current_lock, locked


@locked("invoice:<pk>", max_retries=0)
def pay_invoice(request, pk):
    lease = current_lock()
    return JsonResponse({"pk": pk, "key": lease.key, "fence": lease.fence})


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
