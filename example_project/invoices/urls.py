"""URLs of the invoices app."""

from django.urls import path

from . import views

app_name = "invoices"

urlpatterns = [path("invoices/<int:pk>/pay/", views.pay, name="pay")]
