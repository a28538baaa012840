from django.apps import AppConfig


class InvoicesConfig(AppConfig):
    name = "invoices"
    default_auto_field = "django.db.models.BigAutoField"
