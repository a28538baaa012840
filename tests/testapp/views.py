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
