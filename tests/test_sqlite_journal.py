"""The database backend on SQLite under a rollback journal (``journal_mode`` DELETE,
SQLite's default; the README advises WAL), on a database of its own."""

from __future__ import annotations

import copy
import sqlite3
import threading
import uuid
from contextlib import suppress

import pytest
from django.core.management import call_command
from django.db import connections

from django_syncguard.backends.database import DatabaseBackend


@pytest.fixture
def rollback_journal(tmp_path, django_db_blocker):
    """A backend on an SQLite database of its own in the rollback journal (not WAL),
    and the database file's path."""
    alias = f"journal_{uuid.uuid4().hex[:8]}"
    path = tmp_path / "journal.sqlite3"
    connections.settings[alias] = {
        **copy.deepcopy(connections["default"].settings_dict),
        "NAME": str(path),
        "OPTIONS": {},
        "TEST": {},
    }
    try:
        with django_db_blocker.unblock():
            call_command("migrate", "django_syncguard", database=alias, verbosity=0)
            backend = DatabaseBackend("journal", {"OPTIONS": {"DATABASE": alias}})
            yield backend, path
            backend.close()
    finally:
        with suppress(AttributeError):
            connections[alias].close()
            del connections[alias]
        connections.settings.pop(alias, None)


def test_under_a_rollback_journal_an_acquire_s_commit_waits_for_a_reader(rollback_journal):
    # There a commit needs every reader of the file gone. The tries of an acquire run
    # with the busy timeout at 0, but its COMMIT waits as every commit does: it is not
    # refused and tried again (which readers that keep overlapping could make endless).
    backend, path = rollback_journal
    reader = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    statements: list[str] = []
    timers: list[threading.Timer] = []
    # The last statement begun as the reader left: the COMMIT, still waiting for it.
    last: list[str] = []

    def leave():
        last.append(statements[-1])
        reader.execute("ROLLBACK")

    def trace(sql):
        statements.append(sql)
        if sql == "COMMIT" and not timers:  # the reader leaves once the commit has begun
            timers.append(threading.Timer(0.05, leave))
            timers[0].start()

    private = backend.connection()
    private.ensure_connection()
    private.connection.set_trace_callback(trace)
    assert str(fetch_value_of(private, "PRAGMA journal_mode")).lower() == "delete"
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM syncguard_locks").fetchall()  # a shared lock
    try:
        result = backend.acquire("journal:1", 1_000)
    finally:
        for timer in timers:
            timer.join(10)
        reader.close()
    assert last == ["COMMIT"]
    assert result.ok is True
    assert [sql for sql in statements if sql.startswith(("BEGIN", "COMMIT", "ROLLBACK"))] == [
        "BEGIN",
        "COMMIT",
    ]
    assert backend.release(result.lock_id).ok is True


def fetch_value_of(wrapper, sql):
    with wrapper.cursor() as cursor:
        cursor.execute(sql)
        return cursor.fetchone()[0]
