"""The database backend behind PgBouncer in transaction pooling mode (issue 22).

PgBouncer drops the connection's startup ``options`` (the harness's pgbouncer.ini lists
them in ``ignore_startup_parameters``, as most deployments must for Django), so the
statement and lock timeouts the backend asks for at connect time never reach the
server. The backend notices on each new connection and then sets them for each
operation's own transaction (``SET LOCAL``).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.db import connections

from django_syncguard import NetworkTimeout
from django_syncguard.backends.database import DatabaseBackend
from django_syncguard.backends.database.sql import LOCK_CLASS

pytestmark = pytest.mark.django_db(transaction=True, databases=["postgres", "pgbouncer"])

TIMEOUT_MS = 1_000


@pytest.fixture
def pooled(pgbouncer) -> str:
    """The ``DATABASES`` alias of the test database through PgBouncer."""
    return "pgbouncer"


def backend_on(alias: str, **options: Any) -> DatabaseBackend:
    return DatabaseBackend(
        f"locks-{alias}",
        {"OPTIONS": {"DATABASE": alias, "OPERATION_TIMEOUT_MS": TIMEOUT_MS, **options}},
    )


def waiting_on_our_lock() -> int:
    """Server processes waiting on a lock inside an acquire, seen on a direct connection."""
    with connections["postgres"].cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE wait_event_type = 'Lock' AND query LIKE '%%syncguard_acquire%%' "
            "AND pid <> pg_backend_pid()"
        )
        return int(cursor.fetchone()[0])


def test_the_backend_notices_the_pooler_and_only_there(pooled):
    through, direct = backend_on(pooled), backend_on("postgres")
    try:
        assert through.acquire("notice", 60_000).ok and direct.acquire("other", 60_000).ok
        assert len(through.connections._pooled) == 1
        assert len(direct.connections._pooled) == 0
    finally:
        through.close()
        direct.close()


def test_a_statement_stalled_behind_the_pooler_is_cancelled_by_the_server(pooled):
    # A direct connection holds the key's advisory lock (what a running acquire of
    # that key holds) in an open transaction: an acquire through PgBouncer waits on
    # the server. The server must end that wait at the lock timeout: a client-side
    # timeout alone would leave the statement waiting (and, once the lock comes,
    # running) on the server after the caller gave up.
    key = "stalled"
    holder = connections["postgres"]
    backend = backend_on(pooled)
    try:
        with holder.cursor() as cursor:
            cursor.execute("BEGIN")
            try:
                cursor.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", [LOCK_CLASS, key])
                started = time.monotonic()
                with pytest.raises(NetworkTimeout) as caught:
                    backend.acquire(key, 60_000)
                waited = time.monotonic() - started
                assert waiting_on_our_lock() == 0  # the server ended it, not the client
            finally:
                cursor.execute("ROLLBACK")
        assert "canceling statement due to" in str(caught.value.__cause__)  # by the server
        assert waited < TIMEOUT_MS / 1000 + 2  # the server's timeout, not the reply bound
        assert backend.acquire(key, 60_000).fence == "000000000000001"
    finally:
        backend.close()


def test_the_timeouts_do_not_leak_to_other_clients_of_the_pooler(pooled):
    backend = backend_on(pooled)
    other = connections[pooled]
    try:
        for n in range(20):  # spread over the pooler's server connections
            backend.release(backend.acquire(f"leak:{n}", 60_000).lock_id)
        with other.cursor() as cursor:
            for _ in range(20):
                cursor.execute("SELECT current_setting('lock_timeout')")
                assert cursor.fetchone()[0] == "0"
    finally:
        backend.close()
