"""The Celery app of the test suite, as a project would write it.

The worker (``celery -A tests.celery_app worker``) reads its settings from Django's,
``CELERY_*`` names (``tests/celery_settings.py``), and finds the tasks of the installed
apps (``tests/testapp/tasks.py``). The test process sends through an app of its own
with the same settings (:meth:`tests.support.celery_worker.CeleryWorker.client`).
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from celery.signals import worker_init

from tests.support.celery_worker import DB_LOCK_ALIAS, ENV_LOCK_BEFORE_FORK, ENV_NAME

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.celery_settings")

app = Celery("syncguard_tests")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_init.connect
def _lock_before_the_pool_forks(**kwargs: Any) -> None:
    """With ``ENV_LOCK_BEFORE_FORK`` set: the main process locks on the database
    backend (Django is set up by now), so the pool's children inherit its connection,
    as a project's does when something locks at start-up (the fork rule)."""
    if os.environ.get(ENV_LOCK_BEFORE_FORK):
        from django_syncguard import lock

        key = f"before-the-fork:{os.environ[ENV_NAME]}"  # the test takes it after us
        lock(lambda: None, key=key, using=DB_LOCK_ALIAS)
