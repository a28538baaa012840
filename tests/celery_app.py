"""The Celery app of the test suite, as a project would write it.

The worker (``celery -A tests.celery_app worker``) reads its settings from Django's,
``CELERY_*`` names (``tests/celery_settings.py``), and finds the tasks of the installed
apps (``tests/testapp/tasks.py``). The test process sends through an app of its own
with the same settings (:meth:`tests.support.celery_worker.CeleryWorker.client`).
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.celery_settings")

app = Celery("syncguard_tests")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
