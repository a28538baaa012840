"""lock() / alock() / locked() / Lease / current_lock()."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from django_syncguard import (
    Aborted,
    AcquisitionTimeout,
    InvalidArgument,
    ReleaseResult,
    ServiceUnavailable,
    alock,
    current_lock,
    lock,
    locked,
    locks,
    with_telemetry,
)
from django_syncguard.backends.memory import MemoryBackend


class FailingRelease(MemoryBackend):
    """Releases fail as if the server had gone away."""

    def _release(self, lock_id, cancel):
        raise ServiceUnavailable("server gone")


# ---------------------------------------------------------------------- lock()
def test_lock_runs_fn_under_the_lock_and_releases(mem):
    seen = {}

    def work():
        seen["locked"] = mem.backend.is_locked("job")
        seen["fence"] = current_lock().fence
        return 42

    assert lock(work, key="job", using=mem.backend) == 42
    assert seen == {"locked": True, "fence": "000000000000001"}
    assert mem.backend.is_locked("job") is False
    assert current_lock() is None


def test_lock_releases_when_fn_raises(mem):
    def boom():
        raise KeyError("inner")

    with pytest.raises(KeyError, match="inner"):
        lock(boom, key="job", using=mem.backend)
    assert mem.backend.is_locked("job") is False


def test_lock_times_out_on_contention(mem):
    mem.backend.acquire("job", 10_000)
    with pytest.raises(AcquisitionTimeout) as caught:
        lock(lambda: None, key="job", using=mem.backend, max_retries=0)
    assert caught.value.context["key"] == "job"


def test_lock_uses_the_settings_alias_by_default():
    default = locks["default"]
    assert isinstance(default, MemoryBackend)
    default.reset()
    assert lock(lambda: current_lock().fence, key="alias-default") == "000000000000001"


def test_release_error_goes_to_callback_and_keeps_result():
    backend = FailingRelease("failing-release", {})
    calls = []
    result = lock(
        lambda: "done",
        key="job",
        using=backend,
        on_release_error=lambda error, context: calls.append((error, context)),
    )
    assert result == "done"
    [(error, context)] = calls
    assert isinstance(error, ServiceUnavailable)
    assert context["key"] == "job"
    assert set(context) == {"key", "lock_id"}
    backend.reset()


def test_release_error_never_masks_the_fn_exception(syncguard_log):
    backend = FailingRelease("failing-release-2", {})

    def boom():
        raise ValueError("from fn")

    with pytest.raises(ValueError, match="from fn"):
        lock(boom, key="job", using=backend)
    messages = [r.getMessage() for r in syncguard_log.records]
    assert any("Releasing the lock on key" in m and "server gone" in m for m in messages)
    backend.reset()


def test_a_failing_release_callback_is_contained(syncguard_log):
    backend = FailingRelease("failing-release-3", {})

    def callback(error, context):
        raise RuntimeError("callback broke")

    assert lock(lambda: 1, key="job", using=backend, on_release_error=callback) == 1
    assert any("on_release_error raised" in r.getMessage() for r in syncguard_log.records)
    backend.reset()


def test_cancel_before_acquire_aborts(mem):
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(Aborted):
        lock(lambda: None, key="job", using=mem.backend, cancel=cancel)


def test_cancel_set_inside_fn_does_not_stop_the_release(mem):
    cancel = threading.Event()
    lock(cancel.set, key="job", using=mem.backend, cancel=cancel)
    assert mem.backend.is_locked("job") is False


def test_bad_options_fail_before_any_io(mem):
    for kwargs in (
        {"ttl_ms": 0},
        {"max_retries": -1},
        {"backoff": "x"},
        {"cancel": 3},
        {"on_release_error": "x"},
        {"using": 3},
        {"auto_extend": "yes"},
    ):
        with pytest.raises(InvalidArgument):
            lock(lambda: None, key="job", **{"using": mem.backend, **kwargs})
    with pytest.raises(InvalidArgument):
        lock(lambda: None, key="", using=mem.backend)
    assert mem.backend.is_locked("job") is False


async def test_alock_awaits_the_coroutine(mem):
    async def work():
        await asyncio.sleep(0)
        return current_lock().fence

    assert await alock(work, key="job", using=mem.backend) == "000000000000001"
    assert await mem.backend.ais_locked("job") is False


async def test_alock_releases_on_task_cancellation(mem):
    entered = asyncio.Event()

    async def work():
        entered.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(alock(work, key="job", using=mem.backend))
    await entered.wait()
    assert mem.backend.is_locked("job") is True
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert mem.backend.is_locked("job") is False


# ------------------------------------------------------------- current_lock()
def test_current_lock_is_the_innermost_lease(mem):
    with locked("outer", using=mem.backend) as outer:
        assert current_lock() is outer
        with locked("inner", using=mem.backend) as inner:
            assert current_lock() is inner
        assert current_lock() is outer
    assert current_lock() is None


def test_current_lock_is_per_thread(mem):
    seen = []
    with locked("outer", using=mem.backend):
        thread = threading.Thread(target=lambda: seen.append(current_lock()))
        thread.start()
        thread.join()
    assert seen == [None]


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


# -------------------------------------------------------------------- leases
def test_lease_extend_updates_expiry(mem):
    with locked("job", using=mem.backend, ttl_ms=1_000) as lease:
        mem.advance(500)
        result = lease.extend(4_000)
        assert result.ok
        assert lease.expires_at_ms == mem.now_ms() + 4_000 == result.expires_at_ms
        assert lease.extend().expires_at_ms == mem.now_ms() + 1_000


def test_lease_lost_when_extend_finds_it_expired(mem, syncguard_log):
    with locked("job", using=mem.backend, ttl_ms=1_000) as lease:
        mem.advance(5_000)
        assert lease.extend().ok is False
        assert lease.lost is True
    warnings = [r for r in syncguard_log.records if "Lost the lock" in r.getMessage()]
    assert len(warnings) == 1
    assert lease.lock_id not in warnings[0].getMessage()


def test_lease_lost_when_expired_before_release(mem):
    with locked("job", using=mem.backend, ttl_ms=1_000) as lease:
        mem.advance(5_000)
    assert (lease.released, lease.lost) == (True, True)


# ---------------------------------------------------------------- auto-extend
def extend_events(backend):
    """A telemetry-wrapped backend and the extend outcomes it reports, with a signal."""
    outcomes: list[str] = []
    signal = threading.Event()

    def on_event(event):
        if event.type == "extend":
            outcomes.append(event.result)
            signal.set()

    return with_telemetry(backend, on_event), outcomes, signal


def test_auto_extend_renews_every_third_of_the_ttl(mem):
    wrapped, outcomes, renewed = extend_events(mem.backend)
    with locked("job", using=wrapped, ttl_ms=300, auto_extend=True) as lease:
        assert lease._renewer.interval == pytest.approx(0.1)  # a third of 300 ms
        acquired_at = mem.now_ms()
        mem.advance(100)
        assert renewed.wait(5), "no renewal within 5 s"
        assert outcomes[0] == "ok"
        assert lease.expires_at_ms == acquired_at + 100 + 300
        assert lease.lost is False
    assert mem.backend.is_locked("job") is False


def test_auto_extend_marks_the_lease_lost_when_renewal_fails(mem, syncguard_log):
    wrapped, outcomes, renewed = extend_events(mem.backend)
    with locked("job", using=wrapped, ttl_ms=300, auto_extend=True) as lease:
        mem.advance(5_000)  # the lock expires before the first renewal
        assert renewed.wait(5), "no renewal within 5 s"
        lease._renewer.join(5)
        assert outcomes == ["fail"]
        assert lease.lost is True
    assert any("Lost the lock" in r.getMessage() for r in syncguard_log.records)


async def test_async_auto_extend_runs_as_a_task(mem):
    done = asyncio.Event()
    results = []

    def on_event(event):
        if event.type == "extend":
            results.append(event.result)
            done.set()

    wrapped = with_telemetry(mem.backend, on_event)
    async with locked("job", using=wrapped, ttl_ms=300, auto_extend=True) as lease:
        acquired_at = mem.now_ms()
        mem.advance(50)
        await asyncio.wait_for(done.wait(), 5)
        assert results[0] == "ok"
        assert lease.expires_at_ms == acquired_at + 50 + 300
    assert lease._arenewer.done()
