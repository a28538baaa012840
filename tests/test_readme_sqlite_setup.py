"""The README's "SQLite set-up": the locks in an SQLite database of their own.

The settings and the commands are read from the README itself, so what is tested is
what a user copies: a new project gets them (and nothing of this repository's test
settings), runs the commands in subprocesses, and is checked as the README says: no
system-check warning although the data's database has ATOMIC_REQUESTS and takes its
write lock up front, a lock taken inside a transaction that has written, released
after its commit, no router, tables in the right file, and the admin inspector
listing the locks of the ``locks`` database.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEADING = "#### SQLite set-up"

#: Everything else a project needs: the README's block sets DATABASES and
#: SYNCGUARD_BACKENDS on top of it.
PROJECT_SETTINGS = """
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent
SECRET_KEY = "readme-test-only"
DEBUG = True
USE_TZ = True
ALLOWED_HOSTS = ["localhost"]
ROOT_URLCONF = "urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django_syncguard",
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
"""

URLS = """
from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
"""

MANAGE = """
import os, sys

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings")
from django.core.management import execute_from_command_line

execute_from_command_line(sys.argv)
"""

# In the project: a lock inside a transaction that has written to the data's
# database, then the admin inspector on a lock another holder keeps.
USE = """
import json, os, sqlite3
from contextlib import closing

import django

os.environ["DJANGO_SETTINGS_MODULE"] = "settings"
django.setup()

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.test import Client

from django_syncguard import locked, locks

out = {"routers": settings.DATABASE_ROUTERS}

def rows_in_locks_file():
    with closing(sqlite3.connect(settings.DATABASES["locks"]["NAME"])) as db:
        return db.execute("SELECT count(*) FROM syncguard_locks").fetchone()[0]

with transaction.atomic():
    admin = User.objects.create_superuser("admin", "admin@example.com", "pw")
    with locked("invoice:1") as lease:
        out["fence"] = lease.fence
        out["rows_while_held"] = rows_in_locks_file()
    out["held_until_commit"] = locks["default"].is_locked("invoice:1")
out["held_after_commit"] = locks["default"].is_locked("invoice:1")

other = locks["default"].acquire("invoice:2", 60_000)
client = Client(HTTP_HOST="localhost")
client.force_login(admin)
page = client.get("/admin/django_syncguard/lock/")
out["inspector"] = [page.status_code, other.fence in page.content.decode()]
locks["default"].release(other.lock_id)
print(json.dumps(out))
"""


def readme_blocks() -> tuple[str, list[str]]:
    """The section's settings (its ``python`` block) and commands (its ``bash`` block)."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index(HEADING)
    # Up to the next heading (the settings' "# settings.py" is a comment, not one).
    end = re.compile(r"^#{2,4} ", re.MULTILINE).search(readme, start + len(HEADING))
    assert end is not None
    section = readme[start : end.start()]
    (python,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    (bash,) = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    return python, [line for line in bash.splitlines() if line.strip()]


def tables(path: Path) -> set[str]:
    with sqlite3.connect(path) as db:
        found = db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    return {name for (name,) in found if not name.startswith("sqlite_")}  # not SQLite's own


@pytest.mark.slow
def test_the_readme_s_sqlite_set_up_keeps_the_locks_in_their_own_file(tmp_path: Path) -> None:
    settings, commands = readme_blocks()
    (tmp_path / "settings.py").write_text(PROJECT_SETTINGS + settings)
    (tmp_path / "urls.py").write_text(URLS)
    (tmp_path / "manage.py").write_text(MANAGE)
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    assert commands == [
        "python manage.py migrate",
        "python manage.py migrate django_syncguard --database=locks",
    ]
    for command in commands:
        run(*shlex.split(command)[1:])
    checked = run("manage.py", "check")
    out = json.loads(run("-c", USE).stdout)

    # The settings the section says are fine now: no W002.
    assert "ATOMIC_REQUESTS" in settings and '"IMMEDIATE"' in settings
    assert checked.stdout.strip() == "System check identified no issues (0 silenced)."
    assert checked.stderr == ""
    # The lock was written to locks.sqlite3 while the data's transaction held
    # db.sqlite3, and released only after that transaction committed.
    assert out["fence"] == "000000000000001"
    assert out["rows_while_held"] == 1
    assert (out["held_until_commit"], out["held_after_commit"]) == (True, False)
    # No router; the admin inspector lists the locks of the locks database.
    assert out["routers"] == []
    assert out["inspector"] == [200, True]
    # The app's tables in locks.sqlite3, and nothing else there but migrate's own.
    assert tables(tmp_path / "locks.sqlite3") == {
        "django_migrations",
        "syncguard_locks",
        "syncguard_fence_counters",
        "syncguard_waiters",  # empty on SQLite: the queue has a file of its own
    }
    # Migrate also made them in db.sqlite3, where they stay empty.
    with sqlite3.connect(tmp_path / "db.sqlite3") as db:
        assert db.execute("SELECT count(*) FROM syncguard_fence_counters").fetchone() == (0,)
