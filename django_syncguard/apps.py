from __future__ import annotations

from django.apps import AppConfig


class SyncGuardConfig(AppConfig):
    name = "django_syncguard"
    label = "django_syncguard"
    verbose_name = "SyncGuard locks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks
        from .handler import locks

        checks.register()
        locks.prepare_process()
