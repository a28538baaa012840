"""Settings of the django-tasks-db worker processes (``tests/support/task_workers.py``).

The test settings, with the ``postgres`` alias naming the test run's PostgreSQL
database (passed as JSON in ``SYNCGUARD_WORKER_DATABASE``: its port and name are only
known at run time) and the lock backend on that database, so that the workers'
locks exclude one another.
"""

from __future__ import annotations

import json
import os

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES

DATABASES = {**DATABASES, "postgres": json.loads(os.environ["SYNCGUARD_WORKER_DATABASE"])}

SYNCGUARD_BACKENDS = {
    "default": {
        "BACKEND": "django_syncguard.backends.database.DatabaseBackend",
        "OPTIONS": {"DATABASE": "postgres"},
    }
}
