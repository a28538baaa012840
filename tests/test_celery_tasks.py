"""``@shared_task`` over ``@locked(...)``, run by a real Celery worker.

The worker is ``celery worker --pool=prefork --concurrency=2``, a separate OS process
with two child processes (``tests/support/celery_worker.py``); its broker, its result
backend and its lock backend (alias ``tasks``) are the session's redis-server, and the
tasks (``tests/testapp/tasks.py``) write to the PostgreSQL test database, where these
tests read what each run did (:class:`~tests.testapp.models.TaskEvent`, in the order
it was written). A failed test shows the end of the worker's log.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from billiard.exceptions import WorkerLostError
from django.db import connections

from django_syncguard import AcquisitionTimeout, format_fence, locked, locks
from tests.support.celery_worker import (
    BROKER_DB,
    DB_LOCK_ALIAS,
    LOCK_ALIAS,
    CeleryWorker,
    database_lock_backend,
    lock_backend,
)
from tests.support.faults import wait_until
from tests.support.servers import RedisServer, start_or_skip
from tests.testapp.models import ExclusiveMarker, Invoice, Payment, TaskEvent
from tests.testapp.tasks import (
    DB,
    count_in_database_lock,
    exclusive_section,
    hold_until_gate,
    pay_after_stall,
    pay_invoice,
    pay_share,
    pay_share_old_options,
    retry_twice,
    retry_until_free,
    skip_when_held,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True, databases=[DB])]

#: Waits for something the worker does (a task run, a redelivery) give up after this.
PATIENCE_S = 60
#: ``hold_until_gate``'s ``ttl_ms``, in seconds.
HOLD_TTL_S = 1.5
#: The Redis transport's visibility timeout of the worker that redelivers.
VISIBILITY_TIMEOUT_S = 2.0


# ------------------------------------------------------------------- fixtures
def started_worker(request: pytest.FixtureRequest, **options: object) -> Iterator[CeleryWorker]:
    """A worker on the session's servers and test database, stopped afterwards."""
    redis_server = request.getfixturevalue("redis_server")
    postgres_server = request.getfixturevalue("postgres_server")
    request.getfixturevalue("django_db_setup")  # the worker needs the test database
    worker = CeleryWorker(
        redis_port=redis_server.port,
        postgres_port=postgres_server.port,
        database=connections[DB].settings_dict["NAME"],
        **options,  # type: ignore[arg-type]
    )
    start_or_skip(worker, "celery worker")
    try:
        yield worker
    finally:
        worker.destroy()


@pytest.fixture(scope="class")
def shared_worker(request: pytest.FixtureRequest) -> Iterator[CeleryWorker]:
    yield from started_worker(request)


@pytest.fixture
def worker(shared_worker: CeleryWorker) -> CeleryWorker:
    """The class's worker, the one ``.delay()`` sends to."""
    shared_worker.client()
    return shared_worker


@pytest.fixture
def own_worker(request: pytest.FixtureRequest) -> Iterator[CeleryWorker]:
    """A worker for this test alone (one of its processes gets killed)."""
    yield from started_worker(request)


@pytest.fixture
def forking_worker(request: pytest.FixtureRequest) -> Iterator[CeleryWorker]:
    """A worker whose main process locked in the database before its pool forked."""
    yield from started_worker(request, lock_before_fork=True)


@pytest.fixture
def redelivering_worker(request: pytest.FixtureRequest) -> Iterator[CeleryWorker]:
    """A worker whose broker delivers an unacknowledged message again after
    ``VISIBILITY_TIMEOUT_S``, even while its first run still runs."""
    yield from started_worker(request, visibility_timeout_s=VISIBILITY_TIMEOUT_S)


@pytest.fixture(autouse=True)
def tasks_alias(settings, redis_server: RedisServer) -> None:
    """The test process locks and looks at the tasks' keys through the same alias."""
    settings.SYNCGUARD_BACKENDS = {
        **settings.SYNCGUARD_BACKENDS,
        LOCK_ALIAS: lock_backend(redis_server.port),
    }


@pytest.fixture
def gates(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    try:
        yield client
    finally:
        client.close()


# -------------------------------------------------------------------- helpers
def events(**where: object) -> list[TaskEvent]:
    """The worker's journal, filtered, in the order it was written."""
    return list(TaskEvent.objects.using(DB).filter(**where).order_by("id"))


def new_gate() -> str:
    return f"sgcelery-gate:{uuid.uuid4().hex}"


def open_gate(client: redis.Redis, gate: str) -> None:
    client.rpush(gate, "open")


def wait_for_events(count: int, what: str, **where: object) -> list[TaskEvent]:
    """Until the journal has ``count`` rows matching ``where``; returns them."""
    wait_until(lambda: len(events(**where)) >= count, PATIENCE_S, what)
    return events(**where)


def broker_idle(worker: CeleryWorker) -> bool:
    """No message of ``worker`` waits in its queue or is delivered and unacknowledged."""
    client = redis.Redis(port=worker.redis_port, db=BROKER_DB)
    try:
        prefix = f"{worker.name}:"
        return client.llen(f"{prefix}{worker.name}") == 0 and client.hlen(f"{prefix}unacked") == 0
    finally:
        client.close()


def contending_processes() -> set[int]:
    return {e.pid for e in events(task="pay_invoice", event="contended")}


def unique_key() -> str:
    return uuid.uuid4().hex[:12]


# ---------------------------------------------------------------------- tests
class TestOnOneWorker:
    """Tests that leave the worker as they found it share one."""

    def test_four_deliveries_pay_once_with_fences_in_holding_order(
        self, worker: CeleryWorker
    ) -> None:
        invoice = Invoice.objects.using(DB).create()
        # The test holds the key first, so that the runs really wait for each other:
        # both worker processes are contending before it lets go.
        with locked(f"invoice:{invoice.pk}", using=LOCK_ALIAS) as ours:
            results = [pay_invoice.delay(invoice.pk) for _ in range(4)]
            wait_until(
                lambda: len(contending_processes()) == 2,
                PATIENCE_S,
                "both worker processes wait for the lock",
            )
        outcomes = [r.get(timeout=PATIENCE_S) for r in results]

        held = events(task="pay_invoice", event="held")  # in the order the runs held the lock
        assert sorted(outcomes) == ["already paid"] * 3 + ["paid"]
        assert sorted(e.task_id for e in held) == sorted(r.id for r in results)
        fences = [e.fence for e in held]
        assert fences == sorted(fences) and len(set(fences)) == 4 and fences[0] > ours.fence
        assert {e.pid for e in held} == contending_processes()
        first = held[0]
        assert [(p.invoice_id, p.task_id) for p in Payment.objects.using(DB).all()] == [
            (invoice.pk, first.task_id)
        ]
        invoice.refresh_from_db()
        assert (invoice.paid, invoice.paid_by, invoice.fence) == (
            True,
            f"{first.task_id}/{first.pid}",
            first.fence,
        )

    def test_skip_returns_none_without_running_while_the_key_is_held(
        self, worker: CeleryWorker
    ) -> None:
        key = unique_key()
        with locked(f"skip:{key}", using=LOCK_ALIAS):
            skipped = skip_when_held.delay(key)
            assert skipped.get(timeout=PATIENCE_S) is None
        ran = skip_when_held.delay(key)
        assert ran.get(timeout=PATIENCE_S) == "ran"

        journal = [(e.task_id, e.event, e.attempt) for e in events(task="skip_when_held")]
        assert journal == [
            (skipped.id, "delivered", None),
            (skipped.id, "contended", 1),  # lock_contended, sent in the worker
            (ran.id, "delivered", None),
            (ran.id, "held", None),
        ]

    def test_raise_requeues_the_task_until_the_key_is_free(self, worker: CeleryWorker) -> None:
        key = unique_key()
        with locked(f"retry:{key}", using=LOCK_ALIAS):
            result = retry_until_free.delay(key)
            wait_for_events(3, "three attempts found the key held", event="contended")
        retries = result.get(timeout=PATIENCE_S)

        assert retries >= 3
        journal = [(e.event, e.retries, e.attempt) for e in events(task_id=result.id)]
        assert journal == [
            *(
                step
                for n in range(retries)
                for step in (("delivered", n, None), ("contended", n, 1))
            ),
            ("delivered", retries, None),
            ("held", retries, None),
        ]

    def test_raise_fails_with_acquisition_timeout_once_retries_run_out(
        self, worker: CeleryWorker
    ) -> None:
        key = unique_key()
        with locked(f"retry:{key}", using=LOCK_ALIAS):
            result = retry_twice.delay(key)
            with pytest.raises(AcquisitionTimeout, match="on_contended='raise'"):
                result.get(timeout=PATIENCE_S)

        assert result.state == "FAILURE"
        journal = [(e.event, e.retries) for e in events(task_id=result.id)]
        assert journal == [
            ("delivered", 0),
            ("contended", 0),
            ("delivered", 1),
            ("contended", 1),
            ("delivered", 2),
            ("contended", 2),
        ]


def test_sigkilled_holder_frees_its_key_within_the_ttl_and_nothing_is_stuck(
    own_worker: CeleryWorker, gates: redis.Redis
) -> None:
    key, other_key, gate = unique_key(), unique_key(), new_gate()
    doomed = hold_until_gate.delay(key, gate)
    [held] = wait_for_events(1, "the run holds the key", task_id=doomed.id, event="held")
    # Its lease outlives its TTL only through auto-extend, in the same process.
    wait_for_events(1, "auto-extend renewed the lease", pid=held.pid, event="extended")
    backend = locks[LOCK_ALIAS]
    assert backend.is_locked(f"held:{key}")

    os.kill(held.pid, signal.SIGKILL)
    wait_until(
        lambda: not backend.is_locked(f"held:{key}"),
        HOLD_TTL_S + 2,
        "the killed run's key is free again (its TTL ran out, nothing renewed it)",
    )
    with pytest.raises(WorkerLostError):
        doomed.get(timeout=PATIENCE_S)

    open_gate(gates, gate)
    after = hold_until_gate.delay(key, gate)
    elsewhere = hold_until_gate.delay(other_key, gate)
    assert (after.get(timeout=PATIENCE_S), elsewhere.get(timeout=PATIENCE_S)) == ("done", "done")
    [next_run] = events(task_id=after.id, event="held")
    assert next_run.fence > held.fence and next_run.pid != held.pid


def test_redelivered_run_waits_for_the_run_still_going(
    redelivering_worker: CeleryWorker, gates: redis.Redis
) -> None:
    key, gate = unique_key(), new_gate()
    result = exclusive_section.delay(key, gate)
    wait_for_events(1, "the first run is in its section", task_id=result.id, event="entered")
    # The broker delivers the message again while the first run still runs; the
    # second run finds the key held.
    [second] = wait_for_events(
        1, "the redelivered run contends", task_id=result.id, event="contended"
    )
    assert second.redelivered is True
    open_gate(gates, gate)
    wait_for_events(2, "both runs left the section", task_id=result.id, event="left")
    wait_until(lambda: broker_idle(redelivering_worker), PATIENCE_S, "no delivery is pending")

    runs = events(task_id=result.id, event__in=["entered", "left", "overlap"])
    first = runs[0]
    assert [(e.event, e.pid, e.fence, e.redelivered) for e in runs] == [
        ("entered", first.pid, first.fence, False),
        ("left", first.pid, first.fence, False),
        ("entered", second.pid, runs[2].fence, True),
        ("left", second.pid, runs[2].fence, True),
    ]
    assert first.pid != second.pid and first.fence < runs[2].fence
    assert [e.redelivered for e in events(task_id=result.id, event="delivered")] == [False, True]
    assert not ExclusiveMarker.objects.using(DB).exists()


def test_stale_run_fenced_write_is_refused_after_the_redelivered_run_wrote(
    redelivering_worker: CeleryWorker, gates: redis.Redis
) -> None:
    invoice = Invoice.objects.using(DB).create()
    gate = new_gate()
    result = pay_after_stall.delay(invoice.pk, gate)
    # The first run stalls at the gate, its lease runs out (no auto-extend); the
    # broker's redelivery takes the lock with a newer fence and writes.
    [wrote] = wait_for_events(1, "the redelivered run wrote", task_id=result.id, event="wrote")
    open_gate(gates, gate)
    wait_for_events(1, "the first run tried its write", task_id=result.id, event="refused")
    wait_until(lambda: broker_idle(redelivering_worker), PATIENCE_S, "no delivery is pending")

    runs = events(task_id=result.id, event__in=["held", "wrote", "refused"])
    stalled = runs[0]
    assert [(e.event, e.pid, e.fence, e.redelivered) for e in runs] == [
        ("held", stalled.pid, stalled.fence, False),
        ("held", wrote.pid, wrote.fence, True),
        ("wrote", wrote.pid, wrote.fence, True),
        ("refused", stalled.pid, stalled.fence, False),
    ]
    assert stalled.fence < wrote.fence
    invoice.refresh_from_db()
    assert (invoice.paid, invoice.paid_by, invoice.fence) == (
        True,
        f"{result.id}/{wrote.pid}",
        wrote.fence,
    )


def test_pool_children_forked_after_the_main_process_locked_lock_on_their_own_connections(
    forking_worker: CeleryWorker, gates: redis.Redis, settings
) -> None:
    """The fork rule (issue 20, defect 2): the main process locked on the database
    backend before the pool forked; both children then lock at once, each on a
    connection of its own (a shared one mixes up their replies)."""
    settings.SYNCGUARD_BACKENDS = {
        **settings.SYNCGUARD_BACKENDS,
        DB_LOCK_ALIAS: database_lock_backend(),
    }
    with locked(f"before-the-fork:{forking_worker.name}", using=DB_LOCK_ALIAS) as after:
        assert after.fence == "000000000000002"  # the main process held it first
    key, runs = unique_key(), 6
    with locked(f"forked:{key}", using=DB_LOCK_ALIAS) as ours:
        results = [count_in_database_lock.delay(key) for _ in range(runs)]
        wait_until(
            lambda: len({e.pid for e in events(event="contended")}) == 2,
            PATIENCE_S,
            "both worker processes wait for the lock",
        )
    outcomes = [r.get(timeout=PATIENCE_S) for r in results]

    journal = [(e.event, e.task_id, e.fence) for e in events(event__in=["entered", "left"])]
    expected = [format_fence(int(ours.fence) + i) for i in range(1, runs + 1)]
    assert [fence for event, _, fence in journal[::2]] == expected
    assert journal[1::2] == [("left", task_id, fence) for _, task_id, fence in journal[::2]]
    assert sorted(task_id for _, task_id, _ in journal[::2]) == sorted(r.id for r in results)
    assert sorted(outcomes) == expected
    assert int(gates.get(f"sgcelery-count:{key}")) == runs
    held_by = {e.pid for e in events(event="entered")}
    assert held_by == {e.pid for e in events(event="contended")} and len(held_by) == 2


# ------------------------------------------- a killed holder, many tasks queued
#: Tasks queued on one invoice's key behind the run that gets killed.
QUEUED = 20


@dataclass
class KilledHolderRun:
    """What :func:`kill_the_holder_of_queued_payments` saw."""

    #: The task ids queued, and each one's final state and result (or exception).
    queued: list[str]
    states: dict[str, str]
    outcomes: dict[str, Any]
    #: The run killed at the gate: its task id, process and fence.
    killed: TaskEvent
    #: Seconds from queueing to the last result, and from the kill to the next hold.
    wall_s: float
    key_free_after_s: float

    @property
    def failed(self) -> list[str]:
        return [task_id for task_id in self.queued if self.states[task_id] == "FAILURE"]


def kill_the_holder_of_queued_payments(
    task: Any, invoice: Invoice, gates: redis.Redis
) -> KilledHolderRun:
    """Queue :data:`QUEUED` payments of ``invoice``, kill (SIGKILL) the worker process
    whose run holds the key in the task's body while the other process waits for
    it, and collect every result."""
    gate = new_gate()
    started = time.monotonic()
    results = [task.delay(invoice.pk, gate) for _ in range(QUEUED)]
    stalled = f"{gate}:stalled"  # the run at the gate: "<task id>/<pid>"
    wait_until(lambda: gates.get(stalled) is not None, PATIENCE_S, "a run stalls at the gate")
    task_id, pid = gates.get(stalled).decode().split("/")
    [killed] = events(task_id=task_id, pid=int(pid), event="held")
    wait_until(
        lambda: any(e.pid != killed.pid for e in events(event="contended")),
        PATIENCE_S,
        "the other worker process waits for the key",
    )
    os.kill(killed.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(
        lambda: TaskEvent.objects.using(DB).filter(event="held", id__gt=killed.id).exists(),
        PATIENCE_S,
        "a run holds the key after the kill",
    )
    key_free_after_s = time.monotonic() - killed_at
    outcomes = {r.id: r.get(timeout=PATIENCE_S, propagate=False) for r in results}
    wall_s = time.monotonic() - started
    return KilledHolderRun(
        queued=[r.id for r in results],
        states={r.id: r.state for r in results},
        outcomes=outcomes,
        killed=killed,
        wall_s=wall_s,
        key_free_after_s=key_free_after_s,
    )


def payments_by_task() -> dict[str, int]:
    counts: dict[str, int] = {}
    for payment in Payment.objects.using(DB).all():
        counts[payment.task_id] = counts.get(payment.task_id, 0) + 1
    return counts


def test_readme_task_keeps_every_queued_payment_when_the_holder_is_killed(
    own_worker: CeleryWorker, gates: redis.Redis
) -> None:
    """The README's first task example (issue 23): its killed run is delivered again
    (``acks_late`` and ``reject_on_worker_lost``), and every run queued behind it
    waits out the dead lease (at most 10 s after its last renewal, plus the 1 s
    tolerance) instead of failing: each of the tasks pays exactly once."""
    invoice = Invoice.objects.using(DB).create()

    run = kill_the_holder_of_queued_payments(pay_share, invoice, gates)
    print(  # the figures the README quotes (pytest -s)
        f"\nREADME task, holder killed: {len(run.failed)} of {QUEUED} failed, key free "
        f"{run.key_free_after_s:.1f} s after the kill, all done in {run.wall_s:.1f} s"
    )

    assert run.failed == []
    assert run.outcomes == dict.fromkeys(run.queued, "paid")
    assert payments_by_task() == dict.fromkeys(run.queued, 1)
    # The killed run held the key, paid nothing, and ran again in another process.
    again = events(task_id=run.killed.task_id, event="held")
    assert [e.pid == run.killed.pid for e in again] == [True, False]
    # One hold per run, in fence order: QUEUED runs and the killed one.
    held = events(task="pay_share", event="held")
    assert len(held) == QUEUED + 1
    assert [e.fence for e in held] == sorted(e.fence for e in held)
    assert len({e.fence for e in held}) == QUEUED + 1
    invoice.refresh_from_db()
    assert (invoice.paid, invoice.fence) == (True, held[-1].fence)
    # The dead lease: renewed every 3.3 s, so free 7.7 to 11 s after the kill.
    assert 10 / 3 * 2 < run.key_free_after_s < 10 + 1 + 2  # a waiter checks in every 1 s


@pytest.mark.once
def test_old_readme_task_options_fail_the_runs_queued_behind_a_killed_holder(
    own_worker: CeleryWorker, gates: redis.Redis
) -> None:
    """The same with the example's options before issue 23 (``ttl_ms=30_000`` and
    the default 5 s wait, ``syncguard.W005``): the key stays locked about 31 s, and
    runs queued behind the dead lease give up for good. Every task that did not fail
    paid exactly once; the failed ones paid nothing."""
    invoice = Invoice.objects.using(DB).create()

    run = kill_the_holder_of_queued_payments(pay_share_old_options, invoice, gates)
    print(
        f"\nOld README options, holder killed: {len(run.failed)} of {QUEUED} failed, key "
        f"free {run.key_free_after_s:.1f} s after the kill, all done in {run.wall_s:.1f} s"
    )

    assert run.failed
    assert all(isinstance(run.outcomes[t], AcquisitionTimeout) for t in run.failed)
    paid = [t for t in run.queued if t not in run.failed]
    assert payments_by_task() == dict.fromkeys(paid, 1)
    assert 20 < run.key_free_after_s < 30 + 1 + 2
