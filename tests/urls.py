from django.contrib import admin
from django.urls import path

from tests.testapp import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("invoices/<int:pk>/pay/", views.pay_invoice),
    path("async/invoices/<int:pk>/pay/", views.apay_invoice),
    path("invoices/<int:pk>/refresh/", views.refresh_invoice),
    path("invoices/<int:pk>/pay-or-refuse/", views.pay_or_refuse),
    path("invoices/<int:pk>/pay-when-free/", views.pay_when_free),
    path("atomic/invoices/<int:pk>/pay/", views.pay_atomic),
    path("accounts/<str:database>/<int:pk>/deposit/", views.deposit),
    path("accounts/<str:database>/<int:pk>/deposit-then-fail/", views.deposit_then_fail),
    path("accounts/<str:database>/<int:pk>/balance/", views.balance),
    path("async/accounts/<str:database>/<int:pk>/deposit/", views.adeposit),
]
