"""The PL/pgSQL functions of the database backend on PostgreSQL, as released.

Layout: one directory per released version, named after the migration that installs
it (``0002/``, ``0005/``), holding one ``.sql`` file per function or small group
(``acquire.sql``, ``release.sql``, ...) and ``drop.sql``, the first part of that
migration's reverse. Each file opens with ``--`` comments that say what it does and
why; :func:`load` leaves that header out of what it sends.

**Released files are immutable.** A database that applied a migration keeps the
functions it installed; editing a released file would make fresh databases differ
from existing ones without any migration to bring them level.
``tests/test_database_sql_files.py`` pins the SHA-256 of every released file and of
every migration's expanded SQL, so an edit fails the suite. Fix or change a function
in a new version.

**Placeholders.** What several functions (or the Python side) share is written once,
in :data:`PLACEHOLDERS`, and appears in the files as ``{{ name }}``; :func:`load`
expands it inline, so the functions pay no extra call for it (acquire, release and
extend are on every lock's hot path). The values are part of the released SQL too:
never change one, add a new name for a new value.

**Adding a version** (as ``0006_fence_continuity`` did; say ``0007_...``):

1. create ``sql/0007/`` with the new or replaced functions (copy the previous
   version's file and edit the copy) and a ``drop.sql`` for what the new version adds
   (new signatures, sequences, functions);
2. add the pinned hashes of the new files to ``tests/test_database_sql_files.py``;
3. write the migration::

       from django.db import migrations

       from django_syncguard.backends.database import sql


       class Migration(migrations.Migration):
           dependencies = [("django_syncguard", "0006_fence_continuity")]

           operations = [
               sql.run_on_postgresql(
                   sql.load("0007", "acquire"),
                   # the reverse puts back what 0007 replaced, from 0006's files
                   sql.load("0007", "drop") + sql.load("0006", "acquire"),
               )
           ]

``pyproject.toml`` ships every ``sql/*/*.sql`` (package data); nothing else to do.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from importlib.resources import files
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django.db.migrations import RunPython

#: Server time in whole Unix milliseconds, read when the statement runs
#: (``clock_timestamp()``: the moment of the call, not the start of the transaction).
NOW_MS = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"

#: First key of the two-key advisory lock every acquire of a key takes
#: (``pg_advisory_xact_lock(LOCK_CLASS, hashtext(storage key))``), so that our locks
#: cannot collide with an application's one-key advisory locks. Cleanup tries the same
#: lock before deleting a row.
LOCK_CLASS = 1937337447

#: The ``fence_key`` of the row of ``syncguard_fence_counters`` that holds the alias's
#: fence floor (:mod:`django_syncguard.fence_floors`). No key's fence key can be it: the
#: backend's fence keys are ``keys.fence_key_of("", storage key, 1700, 0)``, which is
#: ``"fence:" + storage key`` or, when that is over 1700 bytes, the bare 22-character
#: base64url hash of ``make_storage_key`` (letters, digits, ``-`` and ``_``: no colon,
#: the prefix being empty). This one has a colon and does not start with ``fence:``.
FLOOR_KEY = "syncguard:floor"

#: What ``{{ name }}`` stands for in the ``.sql`` files. Released values never change.
PLACEHOLDERS: Mapping[str, str] = MappingProxyType(
    {
        "now_ms": NOW_MS,
        "lock_class": str(LOCK_CLASS),
        # The digits of a fence string (``constants.FENCE_DIGITS``).
        "fence_digits": "15",
        # FLOOR_KEY as an SQL literal (since 0006).
        "floor_key": f"'{FLOOR_KEY}'",
    }
)

_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def read(version: str, name: str) -> str:
    """The text of ``<version>/<name>.sql`` as it is stored, header included."""
    return (files(__name__) / version / f"{name}.sql").read_text(encoding="utf-8")


def expand(text: str) -> str:
    """``text`` without its header of ``--`` comments, placeholders expanded."""
    lines = text.splitlines()
    while lines and (not lines[0].strip() or lines[0].startswith("--")):
        del lines[0]
    return _PLACEHOLDER.sub(_value, "\n".join(lines).strip()) + "\n"


def _value(match: re.Match[str]) -> str:
    try:
        return PLACEHOLDERS[match[1]]
    except KeyError:
        raise ValueError(f"unknown placeholder in SQL: {match[0]}") from None


def load(version: str, *names: str) -> str:
    """The statements of ``version``'s files ``names``, in that order, expanded."""
    if not names:
        raise ValueError("name the files to load: their order matters")
    return "\n".join(expand(read(version, name)) for name in names)


def run_on_postgresql(forward: str, reverse: str) -> RunPython:
    """A migration operation that runs ``forward`` (``reverse`` when migrating back)
    on PostgreSQL and does nothing on other databases (SQLite has no functions)."""
    from django.db import migrations

    return migrations.RunPython(_postgresql_only(forward), _postgresql_only(reverse))


def _postgresql_only(statements: str) -> Callable[[Any, Any], None]:
    def run(apps: Any, schema_editor: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(statements)

    return run
