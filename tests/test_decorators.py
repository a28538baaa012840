"""locked (``django_syncguard.decorators``): a decorator, or a (async) context manager."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from django_syncguard import (
    AcquisitionTimeout,
    InvalidArgument,
    ReleaseResult,
    current_lock,
    locked,
)


# ------------------------------------------------------------------ decorator
def test_decorator_fills_placeholders_from_arguments(mem):
    keys = []

    @locked("invoice:<pk>:<currency>", using=mem.backend)
    def pay(pk, currency="EUR"):
        keys.append(current_lock().key)

    pay(42)
    pay(7, currency="USD")
    pay(pk=9, currency="GBP")
    assert keys == ["invoice:42:EUR", "invoice:7:USD", "invoice:9:GBP"]


def test_decorator_follows_dotted_attributes_and_mapping_keys(mem):
    keys = []

    @locked("account:<invoice.account.id>/<meta.region>", using=mem.backend)
    def settle(invoice, meta):
        keys.append(current_lock().key)

    settle(SimpleNamespace(account=SimpleNamespace(id=5)), {"region": "eu"})
    assert keys == ["account:5/eu"]


def test_missing_attribute_fails_at_call_without_locking(mem):
    @locked("account:<invoice.account>", using=mem.backend)
    def settle(invoice):
        raise AssertionError("must not run")

    with pytest.raises(InvalidArgument, match="has no 'account'"):
        settle(SimpleNamespace())


def test_unknown_placeholder_fails_when_decorating():
    with pytest.raises(InvalidArgument, match=r"<pkk> names no parameter"):

        @locked("invoice:<pkk>")
        def pay(request, pk):
            pass


def test_placeholders_may_come_from_var_kwargs(mem):
    keys = []

    @locked("task:<job_id>", using=mem.backend)
    def run(**kwargs):
        keys.append(current_lock().key)

    run(job_id="abc")
    assert keys == ["task:abc"]
    with pytest.raises(InvalidArgument, match="has no value"):
        run(other=1)


def test_decorating_a_celery_style_bound_task(mem):
    class Task:
        name = "billing.charge"

    @locked("charge:<invoice_id>", using=mem.backend)
    def charge(self, invoice_id):
        return (self.name, current_lock().key, current_lock().fence)

    assert charge(Task(), 12) == ("billing.charge", "charge:12", "000000000000001")
    assert charge(Task(), 12) == ("billing.charge", "charge:12", "000000000000002")
    assert charge.__name__ == "charge"


WRONG_ORDER = (
    "locked('invoice:<pk>') is above a Celery task decorator; put it below, so that the "
    "worker takes the lock each time it runs the task:\n"
    "    @shared_task(...)\n"
    "    @locked('invoice:<pk>')\n"
    "    def your_task(...): ..."
)


@pytest.mark.parametrize("finalized", [False, True], ids=["proxy", "task"])
def test_locked_above_a_celery_task_fails_when_decorating(finalized):
    from celery import Celery

    app = Celery("decorator-order", set_as_current=False)
    if finalized:  # app.task then returns the Task itself, not a lazy proxy
        app.finalize()
    with pytest.raises(InvalidArgument) as raised:

        @locked("invoice:<pk>")
        @app.task(name=f"decorator-order.refused-{finalized}")
        def pay(pk):
            raise AssertionError("must not run")

    assert str(raised.value) == WRONG_ORDER


def test_locked_below_a_celery_task_keeps_delay_and_takes_the_lock(mem):
    from celery import Celery

    app = Celery("decorator-order-ok", set_as_current=False)

    @app.task(name="decorator-order.pay")
    @locked("invoice:<pk>", using=mem.backend)
    def pay(pk):
        return current_lock().key

    assert callable(pay.delay) and callable(pay.apply_async)
    assert pay.name == "decorator-order.pay"
    assert pay(42) == "invoice:42"  # run in this process, as a worker runs it


async def test_decorator_on_async_def(mem):
    @locked("job:<n>", using=mem.backend)
    async def run(n):
        await asyncio.sleep(0)
        assert await mem.backend.ais_locked(f"job:{n}")
        return current_lock().fence

    assert await run(1) == "000000000000001"
    assert await run(1) == "000000000000002"
    assert await mem.backend.ais_locked("job:1") is False


def test_decorator_times_out_when_held(mem):
    @locked("job", using=mem.backend, max_retries=0)
    def run():
        raise AssertionError("must not run")

    mem.backend.acquire("job", 10_000)
    with pytest.raises(AcquisitionTimeout):
        run()


def test_decorator_reads_no_settings_when_applied(settings):
    del settings.SYNCGUARD_BACKENDS
    settings.SYNCGUARD_BACKENDS = {"other": {"BACKEND": "nowhere.Backend"}}

    @locked("job")  # alias "default" does not exist: only a call may find out
    def run():
        pass

    with pytest.raises(Exception, match="No lock backend alias 'default'"):
        run()


# ------------------------------------------------------------ context manager
def test_context_manager_yields_a_lease(mem):
    with locked("invoice:42", using=mem.backend) as lease:
        assert (lease.key, lease.fence) == ("invoice:42", "000000000000001")
        assert len(lease.lock_id) == 22
        assert lease.expires_at_ms == mem.now_ms() + 30_000
        assert mem.backend.is_locked("invoice:42")
        assert "lock_id" not in repr(lease) and lease.lock_id not in repr(lease)
    assert not mem.backend.is_locked("invoice:42")
    assert lease.released is True


def test_each_with_takes_a_fresh_lease(mem):
    guard = locked("invoice:42", using=mem.backend)
    with guard as first:
        pass
    with guard as second:
        pass
    assert (first.fence, second.fence) == ("000000000000001", "000000000000002")
    assert first.lock_id != second.lock_id


def test_second_release_returns_false_without_io(mem, monkeypatch):
    with locked("job", using=mem.backend) as lease:
        assert lease.release() == ReleaseResult(ok=True)
        monkeypatch.setattr(mem.backend, "release", pytest.fail)
        assert lease.release() == ReleaseResult(ok=False)
    assert lease.lost is False


def test_context_manager_with_placeholders_is_refused(mem):
    with pytest.raises(InvalidArgument, match="placeholders"), locked("a:<b>", using=mem.backend):
        pass


async def test_async_context_manager(mem):
    async with locked("job", using=mem.backend) as lease:
        assert current_lock() is lease
        assert await mem.backend.ais_locked("job")
    assert not await mem.backend.ais_locked("job")


async def test_one_locked_object_entered_by_concurrent_tasks(mem):
    guard = locked("shared", using=mem.backend, retry_delay_ms=1, timeout_ms=5_000)
    inside = 0
    peak = 0

    async def worker():
        nonlocal inside, peak
        async with guard as lease:
            inside += 1
            peak = max(peak, inside)
            await asyncio.sleep(0)
            inside -= 1
            return lease.fence

    fences = await asyncio.gather(*(worker() for _ in range(5)))
    assert peak == 1
    assert sorted(fences) == [f"{n:015d}" for n in range(1, 6)]
