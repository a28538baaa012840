"""Redis restarted without persistence under fenced writes (issue 21, the first case of
``specs/guarantees.md``, Fence continuity).

Four processes pay invoices (``Account`` rows in PostgreSQL, written with
``fenced_update`` under ``lock()``) on a Redis of the test's own with no persistence;
Redis is killed with SIGKILL and started again, empty, on the same port; four new
processes go on paying. In clock mode (the Redis default) no legitimate write after
the restart is refused, and a holder from before the restart is still refused once a
newer holder has written. In counter mode the counters start again at 1 and the rows
refuse the new holders: the test counts exactly how many, from what the processes
report.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from django.db import connections

from django_syncguard import StaleFenceError, fenced_update
from django_syncguard.backends.redis import RedisBackend
from tests.support.fence_workers import PAYMENTS, pay
from tests.support.processes import run_in_processes
from tests.support.servers import RedisServer
from tests.testapp.models import Account

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True, databases=["postgres"]),
]

PROCESSES = 4
ACCOUNTS = 3


def entry(server: RedisServer, mode: str) -> dict[str, Any]:
    return {"LOCATION": server.url, "KEY_PREFIX": "restart", "OPTIONS": {"FENCES": mode}}


def phase(params: dict[str, Any], pks: list[int]) -> list[tuple[int, str, bool]]:
    databases = {"postgres": dict(connections["postgres"].settings_dict)}
    reports = run_in_processes(pay, lambda i: (databases, params, pks), count=PROCESSES)
    return [line for report in reports for line in report]


def restart_empty(server: RedisServer) -> None:
    server.kill()  # SIGKILL: nothing saved (and no persistence configured anyway)
    server.start()  # same port, empty


@pytest.fixture
def server():
    redis = RedisServer(aof=False).start()
    yield redis
    redis.destroy()


@pytest.fixture
def accounts() -> list[int]:
    return [Account.objects.using("postgres").create(name=f"acc{n}").pk for n in range(ACCOUNTS)]


def test_in_clock_mode_no_fenced_write_is_refused_after_a_restart(server, accounts):
    params = entry(server, "clock")
    before = phase(params, accounts)
    restart_empty(server)
    after = phase(params, accounts)

    assert [written for *_, written in before + after] == [True] * (2 * PROCESSES * PAYMENTS)
    rows = Account.objects.using("postgres").order_by("pk")
    assert sum(row.balance for row in rows) == 2 * PROCESSES * PAYMENTS
    last_before = {pk: max(f for p, f, _ in before if p == pk) for pk in accounts}
    assert all(f > last_before[pk] for pk, f, _ in after)


def test_in_clock_mode_a_holder_from_before_the_restart_is_still_refused(server, accounts):
    pk = accounts[0]
    rows = Account.objects.using("postgres").filter(pk=pk)
    old_holder = RedisBackend("old", entry(server, "clock"))
    stale = old_holder.acquire("account:stale", 30_000)
    assert fenced_update(rows, stale.fence, balance=1) == 1
    restart_empty(server)  # the lock is gone with the server; its holder works on

    new_holder = RedisBackend("new", entry(server, "clock"))
    fresh = new_holder.acquire("account:stale", 30_000)
    assert fresh.ok and fresh.fence > stale.fence
    assert fenced_update(rows, fresh.fence, balance=2) == 1
    with pytest.raises(StaleFenceError):
        fenced_update(rows, stale.fence, balance=3)
    assert rows.get().balance == 2
    old_holder.close()
    new_holder.close()


def test_in_counter_mode_a_restart_gets_fenced_writes_refused(server, accounts, capsys):
    params = entry(server, "counter")
    before = phase(params, accounts)
    restart_empty(server)
    after = phase(params, accounts)

    assert all(written for *_, written in before)
    # Per account, the counter restarted at 1 while the row holds the last fence of
    # before (n): fences 1 .. n-1 are refused, n and above written.
    taken_before = Counter(pk for pk, _, _ in before)
    expected = {
        pk: sorted(int(f) < taken_before[pk] for p, f, _ in after if p == pk) for pk in accounts
    }
    refused = {pk: sorted(not w for p, _, w in after if p == pk) for pk in accounts}
    assert refused == expected
    total = sum(not written for *_, written in after)
    assert total == sum(min(taken_before[pk] - 1, len(expected[pk])) for pk in accounts)
    assert total > 0
    with capsys.disabled():
        print(f"\ncounter mode, Redis restarted empty: {total} of {len(after)} writes refused")
