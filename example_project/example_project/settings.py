"""Settings of the example project: SQLite, no server needed."""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = "example-only-not-secret"
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
USE_TZ = True
ROOT_URLCONF = "example_project.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django_syncguard",
    "invoices",
]

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("EXAMPLE_DB_PATH", BASE_DIR / "db.sqlite3"),
        # Each view runs in a transaction of its own: a view that fails half-way
        # leaves nothing behind. The payment view takes its lock with @locked on the
        # view itself, before the view's first query; the lock is released right after
        # the transaction commits (until_commit), so the next holder reads the payment.
        "ATOMIC_REQUESTS": True,
        # WAL lets readers and the lock backend's writes proceed side by side; the demo's
        # worker processes share this file. The transaction mode stays Django's
        # default (DEFERRED): a transaction takes SQLite's write lock at its first
        # write, so the view's lock can be written after the request's BEGIN. With
        # "IMMEDIATE" the lock would have to live in an SQLite database of its own
        # (README: SQLite set-up).
        "OPTIONS": {"init_command": "PRAGMA journal_mode=WAL;"},
    }
}

# No SYNCGUARD_BACKENDS: the "default" lock alias is the database backend over
# DATABASES["default"], so the locks live in the same SQLite file.

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_syncguard": {"handlers": ["console"], "level": "WARNING"}},
}

# Celery (only with example_project/requirements-celery.txt installed). A worker that
# is killed mid-task gets its task delivered again (acks_late + reject_on_worker_lost):
# the lock keeps the two runs apart, and the fence refuses a stale run's write. The
# visibility timeout (how long Redis waits for an acknowledgement before delivering a
# task again) is above the longest payment.
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND", CELERY_BROKER_URL)
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 3600}
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
