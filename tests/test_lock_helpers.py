"""lock() / alock() (``django_syncguard.helpers``): a callable run under a lock."""

from __future__ import annotations

import asyncio
import threading

import pytest

from django_syncguard import (
    Aborted,
    AcquisitionTimeout,
    InvalidArgument,
    ServiceUnavailable,
    alock,
    current_lock,
    lock,
    locks,
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
