"""Moving an alias between backends with ``syncguard_fences migrate`` (issue 21): rows
written with the old backend's fences accept the new backend's, both ways between the
database backend (PostgreSQL) and Redis. Without the migration the same write is
refused as stale (the control in each test)."""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.core.management import call_command
from django.test import override_settings

from django_syncguard import StaleFenceError, fenced_update, locks
from tests.testapp.models import Account

pytestmark = pytest.mark.django_db(transaction=True, databases=["postgres"])

TTL = 30_000


@contextmanager
def aliases(redis_url: str, redis_fences: str) -> Iterator[None]:
    """Aliases "db" (PostgreSQL, counter mode, the default) and "redis"."""
    entries = {
        "db": {
            "BACKEND": "django_syncguard.backends.database.DatabaseBackend",
            "OPTIONS": {"DATABASE": "postgres"},
        },
        "redis": {
            "BACKEND": "django_syncguard.backends.redis.RedisBackend",
            "LOCATION": redis_url,
            "KEY_PREFIX": f"move{uuid.uuid4().hex[:12]}",
            "OPTIONS": {"FENCES": redis_fences},
        },
    }
    with override_settings(SYNCGUARD_BACKENDS=entries):
        yield


def pay(alias: str, account: Account, amount: int) -> str:
    """Take ``invoice:<pk>`` on ``alias`` and write the row through its fence."""
    backend = locks[alias]
    lease = backend.acquire(f"invoice:{account.pk}", TTL)
    assert lease.ok
    try:
        rows = Account.objects.using("postgres").filter(pk=account.pk)
        fenced_update(rows, lease.fence, balance=amount)
    finally:
        backend.release(lease.lock_id)
    return lease.fence


def migrate(source: str, target: str) -> str:
    out = io.StringIO()
    call_command("syncguard_fences", "migrate", "--from", source, "--to", target, stdout=out)
    return out.getvalue()


def paid_rows(count: int, alias: str) -> list[Account]:
    accounts = Account.objects.using("postgres")
    rows = [accounts.create(name=f"inv-{uuid.uuid4()}") for _ in range(count)]
    for account in rows:
        for amount in range(5):  # fences 1..5 on a fresh key in counter mode
            pay(alias, account, amount)
    return rows


@pytest.mark.parametrize("redis_fences", ["counter", "clock"])
def test_from_the_database_to_redis(redis_server, redis_fences):
    # Counter mode: a fresh Redis counts from 1, the case migrate is for. Clock mode
    # starts far above a database counter anyway; migrating changes nothing there.
    with aliases(redis_server.url, redis_fences):
        from_the_database_to_redis(redis_fences)


def from_the_database_to_redis(redis_fences: str) -> None:
    paid = paid_rows(4, "db")
    if redis_fences == "clock":
        migrate("db", "redis")
        assert all(int(pay("redis", account, 100)) > 10**12 for account in paid)
        return
    with pytest.raises(StaleFenceError):  # the control: Redis counts from 1
        pay("redis", paid[0], 100)

    assert migrate("db", "redis") == (
        "redis: fence floor is now 5; every fence db handed out is at most 5.\n"
    )

    # The control took fence 1 of paid[0]'s Redis counter; the floor is above it.
    assert [pay("redis", account, 100) for account in paid] == ["000000000000006"] * 4
    balances = Account.objects.using("postgres").filter(pk__in=[a.pk for a in paid])
    assert sorted(balances.values_list("balance", flat=True)) == [100] * 4


def test_from_redis_in_clock_mode_to_the_database(redis_server):
    with aliases(redis_server.url, "clock"):
        from_redis_to_the_database()


def from_redis_to_the_database() -> None:
    paid = paid_rows(3, "redis")
    highest = locks["redis"].fence_state().highest
    with pytest.raises(StaleFenceError):  # the control: the database counts from 1
        pay("db", paid[0], 100)

    said = migrate("redis", "db")
    # Clock fences reach Redis's clock: the floor is that clock, above the highest.
    floor = locks["db"].fence_floor()
    assert floor > highest
    assert said == (
        f"db: fence floor is now {floor}; every fence redis handed out is at most {floor}.\n"
    )

    fences = [pay("db", account, 100) for account in paid]
    assert all(int(fence) > highest for fence in fences)
    balances = Account.objects.using("postgres").filter(pk__in=[a.pk for a in paid])
    assert sorted(balances.values_list("balance", flat=True)) == [100] * 3
