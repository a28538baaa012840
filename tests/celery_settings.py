"""Settings of the Celery worker that ``tests/test_celery_tasks.py`` starts.

``tests.settings``, plus what the environment of
:meth:`tests.support.celery_worker.CeleryWorker.env` says: the port of the session's
redis-server (broker, results and the ``tasks`` lock alias) and where the PostgreSQL
test database runs (the ``tasks-db`` lock alias locks in it). The Celery settings
come from the same function the test process uses
(:func:`tests.support.celery_worker.celery_conf`).
"""

from __future__ import annotations

import os

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES, SYNCGUARD_BACKENDS
from tests.support.celery_worker import (
    DB_LOCK_ALIAS,
    ENV_NAME,
    ENV_PG_NAME,
    ENV_PG_PORT,
    ENV_REDIS_PORT,
    ENV_VISIBILITY,
    LOCK_ALIAS,
    celery_conf,
    database_lock_backend,
    lock_backend,
)

_redis_port = int(os.environ[ENV_REDIS_PORT])
_visibility = os.environ.get(ENV_VISIBILITY)

# The test database pytest-django created on the session's PostgreSQL.
DATABASES["postgres"] |= {"NAME": os.environ[ENV_PG_NAME], "PORT": os.environ[ENV_PG_PORT]}

SYNCGUARD_BACKENDS = {
    **SYNCGUARD_BACKENDS,
    LOCK_ALIAS: lock_backend(_redis_port),
    DB_LOCK_ALIAS: database_lock_backend(),
}

for _name, _value in celery_conf(
    _redis_port, os.environ[ENV_NAME], float(_visibility) if _visibility else None
).items():
    globals()[f"CELERY_{_name.upper()}"] = _value
