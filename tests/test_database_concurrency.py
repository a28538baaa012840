"""Mutual exclusion and fences across OS processes, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections import defaultdict

import pytest
from django.db import connections

from tests.support import workers
from tests.support.factories import AccountFactory
from tests.support.processes import run_in_processes

PROCESSES = 4
databases = pytest.mark.django_db(transaction=True, databases=["default", "postgres"])
per_database = pytest.mark.parametrize(
    "database", ["default", "postgres"], ids=["sqlite", "postgres"]
)


def run_processes(target, args_for) -> list:
    dbs = {alias: dict(connections[alias].settings_dict) for alias in ("default", "postgres")}
    return run_in_processes(target, lambda i: (dbs, *args_for(i)), PROCESSES)


@pytest.mark.slow
@databases
@per_database
def test_processes_hammering_one_key_never_overlap(database):
    iterations = 100
    account = (
        AccountFactory.create(balance=0)
        if database == "default"
        else (AccountFactory._meta.model.objects.using("postgres").create(name="hot", balance=0))
    )
    per_process = run_processes(workers.hammer, lambda i: (database, "hot", iterations, account.pk))
    records = sorted(r for process in per_process for r in process)
    total = PROCESSES * iterations
    account.refresh_from_db(using=database)
    assert account.balance == total  # no lost update
    assert [seen for seen, _ in records] == list(range(total))  # one section at a time
    fences = [fence for _, fence in records]  # in the order the sections ran
    assert fences == sorted(set(fences))  # distinct and strictly increasing
    assert len(fences) == total


@pytest.mark.slow
@databases
@per_database
def test_concurrent_first_acquisitions_never_share_a_fence(database):
    keys = [f"fresh:{n}" for n in range(150)]
    per_process = run_processes(workers.first_acquisitions, lambda i: (database, keys, i))
    fences = defaultdict(list)
    for process in per_process:
        for key, fence in process:
            fences[key].append(fence)
    assert set(fences) == set(keys)  # every key was taken at least once
    for key, got in fences.items():
        assert len(got) == len(set(got)), f"{key} handed out a fence twice: {got}"
        assert "000000000000001" in got
