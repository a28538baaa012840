"""Settings for the test suite (pytest-django)."""

from __future__ import annotations

import os
import tempfile
from importlib.util import find_spec
from pathlib import Path

import django

BASE_DIR = Path(__file__).resolve().parent
SECRET_KEY = "tests-only-not-secret"
DEBUG = False
USE_TZ = True
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "tests.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_syncguard",
    "tests.testapp",
]

# Django's task framework (tests/test_django_tasks.py): built in since Django 6.0
# (django.tasks); on 5.2 the django_tasks backport, an app of its own, has the same API.
tasks_package = "django.tasks" if django.VERSION >= (6, 0) else "django_tasks"
TASKS = {
    # Runs each task as it is enqueued, in the caller's thread.
    "default": {"BACKEND": f"{tasks_package}.backends.immediate.ImmediateBackend"},
}
# The backport and django-tasks-db come with the "test" extra; the type check (the
# "lint" extra) loads these settings without them.
if find_spec(tasks_package) and find_spec("django_tasks_db"):
    if tasks_package == "django_tasks":
        INSTALLED_APPS.append("django_tasks")
    INSTALLED_APPS.append("django_tasks_db")
    # Queues tasks in a table that `manage.py db_worker` processes (django-tasks-db).
    TASKS["database"] = {"BACKEND": "django_tasks_db.DatabaseBackend"}

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

_TMP = Path(tempfile.gettempdir())

DATABASES = {
    # A file, not :memory:, so that the database backend's own connections (one per
    # thread, outside the test's transaction) see the same database.
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(_TMP / "syncguard-tests.sqlite3"),
        "TEST": {"NAME": str(_TMP / f"syncguard-tests-{os.getpid()}.sqlite3")},
        # WAL: readers never block the lock backend's writes (and the reverse). The
        # busy timeout (Python's default is 5 s) is for the multi-process tests, whose
        # writers queue for SQLite's one write lock: on a loaded CI machine a writer
        # once waited longer than 5 s ("database is locked").
        "OPTIONS": {"init_command": "PRAGMA journal_mode=WAL;", "timeout": 30},
    },
    # Started on a free port by the postgres_server fixture, which fills in PORT.
    "postgres": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "syncguard",
        "USER": "postgres",
        "HOST": "127.0.0.1",
        "PORT": "",
        "TEST": {"NAME": "test_syncguard", "DEPENDENCIES": []},
    },
    # The test database through PgBouncer (transaction pooling): the pgbouncer fixture
    # starts it and fills in PORT. A mirror: no test database of its own.
    "pgbouncer": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "syncguard",
        "USER": "postgres",
        "HOST": "127.0.0.1",
        "PORT": "",
        "TEST": {"MIRROR": "postgres"},
    },
    # Nothing listens on port 1: for tests of a dead server (never set up as a test DB).
    "dead": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "nothing",
        "USER": "postgres",
        "HOST": "127.0.0.1",
        "PORT": "1",
    },
    # A vendor the database backend does not support.
    "unsupported": {"ENGINE": "django.db.backends.dummy"},
}

# The task queue's table lives on the "postgres" alias, where the workers of
# tests/test_django_tasks.py take tasks with SELECT ... FOR UPDATE SKIP LOCKED.
DATABASE_ROUTERS = ["tests.testapp.routers.TaskQueueOnPostgres"]

SYNCGUARD_BACKENDS = {
    "default": {"BACKEND": "django_syncguard.backends.memory.MemoryBackend"},
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "loggers": {"django_syncguard": {"level": "DEBUG"}},
}

# Fast hashing: tests create users, and PBKDF2 would cost a second each.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# The browser test's live server serves the admin's CSS through staticfiles.
STATIC_URL = "/static/"
