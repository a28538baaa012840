"""The retry loop: the specification's formulas, with a fake clock and no sleeping."""

from __future__ import annotations

import random

import pytest

from django_syncguard import AcquireResult, AcquisitionTimeout, InvalidArgument
from django_syncguard.acquisition import aacquire_with_retry, acquire_with_retry
from django_syncguard.keys import display_hash, hash_key
from django_syncguard.retry import RetryPolicy
from django_syncguard.waiting import WaitSession

LOCKED = AcquireResult.locked()
OK = AcquireResult(ok=True, lock_id="A" * 22, expires_at_ms=1, fence="000000000000001")


class FakeTime:
    """A monotonic clock in seconds that only the fake sleeper moves."""

    def __init__(self):
        self.now = 100.0
        self.sleeps_ms: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float, cancel) -> None:
        self.sleeps_ms.append(round(seconds * 1000, 6))
        self.now += seconds

    async def asleep(self, seconds: float, cancel) -> None:
        self.sleep(seconds, cancel)


def scripted(*outcomes):
    calls = []
    it = iter(outcomes)

    def acquire():
        calls.append(1)
        return next(it)

    return acquire, calls


# --------------------------------------------------------------------- formulas
@pytest.mark.parametrize(
    ("backoff", "jitter", "attempt", "rng", "expected"),
    [
        ("exponential", "none", 1, 0.0, 100),
        ("exponential", "none", 2, 0.0, 200),
        ("exponential", "none", 4, 0.0, 800),
        ("exponential", "equal", 3, 0.5, 300),  # 400/2 + 0.5 * 400/2
        ("exponential", "equal", 3, 0.0, 200),
        ("exponential", "full", 3, 0.25, 100),  # 0.25 * 400
        ("fixed", "none", 5, 0.9, 100),
        ("fixed", "equal", 5, 0.5, 75),  # 50 + 0.5 * 50
        ("fixed", "full", 5, 0.3, 30),
    ],
)
def test_delay_formulas(backoff, jitter, attempt, rng, expected):
    policy = RetryPolicy(retry_delay_ms=100, backoff=backoff, jitter=jitter)
    assert policy.delay_ms(attempt, lambda: rng) == pytest.approx(expected)


def test_huge_attempt_numbers_do_not_overflow():
    policy = RetryPolicy(retry_delay_ms=100, jitter="none", max_retries=5000)
    assert policy.delay_ms(5000, lambda: 0.0) > 1e300


def test_seeded_equal_jitter_matches_the_formula():
    policy = RetryPolicy(retry_delay_ms=100)
    draws = random.Random(7)
    expected = random.Random(7)
    for attempt in range(1, 6):
        base = 100 * 2 ** (attempt - 1)
        want = base / 2 + expected.random() * base / 2
        assert policy.delay_ms(attempt, draws.random) == pytest.approx(want)


# ------------------------------------------------------------------------- loop
def test_succeeds_after_retries_with_backoff_sleeps():
    t = FakeTime()
    acquire, calls = scripted(LOCKED, LOCKED, LOCKED, OK)
    policy = RetryPolicy(retry_delay_ms=100, jitter="none", timeout_ms=10_000)
    result = acquire_with_retry(acquire, policy, key="k", clock=t.clock, sleeper=t.sleep)
    assert result is OK
    assert len(calls) == 4
    assert t.sleeps_ms == [100, 200, 400]


def test_total_attempts_are_max_retries_plus_one():
    t = FakeTime()
    acquire, calls = scripted(*[LOCKED] * 10)
    policy = RetryPolicy(max_retries=3, retry_delay_ms=10, jitter="none", timeout_ms=60_000)
    with pytest.raises(AcquisitionTimeout) as caught:
        acquire_with_retry(acquire, policy, key="k", clock=t.clock, sleeper=t.sleep)
    assert len(calls) == 4
    assert t.sleeps_ms == [10, 20, 40]
    assert caught.value.code == "AcquisitionTimeout"
    # The hash people see is keyed with SECRET_KEY, never the bare hash_key.
    assert caught.value.context == {"key": "k", "key_hash": display_hash("k")}
    assert str(caught.value) == (
        f"Lock on key {display_hash('k')} still held after 4 attempts (max_retries=3)."
    )
    assert hash_key("k") not in str(caught.value)


class PollingSession:
    """A waiting session whose pauses end after ``poll_ms`` (the first in line polling
    when no wake-up can reach it), on the fake clock."""

    def __init__(self, t: FakeTime, poll_ms: float) -> None:
        self.t = t
        self.poll_ms = poll_ms
        self.pauses_ms: list[float] = []

    def pause(self, delay_s, remaining_s, cancel, position) -> None:
        self.pauses_ms.append(round(delay_s * 1000, 6))
        self.t.now += min(delay_s, self.poll_ms / 1000)


def test_attempts_within_a_backoff_step_of_a_waiting_session_do_not_count():
    # Polling every 10 ms does not use up max_retries in 30 ms: only the attempts at
    # the end of each backoff step (10, 20 ms: the schedule above) count.
    t = FakeTime()
    session = PollingSession(t, poll_ms=10)
    acquire, calls = scripted(*[LOCKED] * 10)
    policy = RetryPolicy(max_retries=3, retry_delay_ms=10, jitter="none", timeout_ms=60_000)
    with pytest.raises(AcquisitionTimeout, match="after 4 attempts"):
        acquire_with_retry(
            acquire, policy, key="k", clock=t.clock, sleeper=t.sleep, session=session
        )
    assert session.pauses_ms == [10, 20, 10, 40, 30, 20, 10]
    assert len(calls) == 8  # 4 counted, 4 within a step
    assert round(t.now - 100.0, 6) == 0.07  # the schedule's 10 + 20 + 40 ms


def test_max_retries_zero_tries_once():
    t = FakeTime()
    acquire, calls = scripted(LOCKED)
    with pytest.raises(AcquisitionTimeout):
        acquire_with_retry(
            acquire, RetryPolicy(max_retries=0), key="k", clock=t.clock, sleeper=t.sleep
        )
    assert (len(calls), t.sleeps_ms) == (1, [])


def test_delay_is_clamped_to_the_remaining_time():
    t = FakeTime()
    acquire, calls = scripted(*[LOCKED] * 10)
    policy = RetryPolicy(retry_delay_ms=100, jitter="none", timeout_ms=250)
    with pytest.raises(AcquisitionTimeout, match="250 ms"):
        acquire_with_retry(acquire, policy, key="k", clock=t.clock, sleeper=t.sleep)
    # 100, then 200 clamped to the 150 left; one last attempt at the deadline.
    assert t.sleeps_ms == [100, 150]
    assert len(calls) == 3


def test_zero_retry_delay_retries_immediately_until_attempts_run_out():
    t = FakeTime()
    acquire, calls = scripted(*[LOCKED] * 5, OK)
    policy = RetryPolicy(retry_delay_ms=0, max_retries=10, timeout_ms=1_000)
    assert acquire_with_retry(acquire, policy, key="k", clock=t.clock, sleeper=t.sleep) is OK
    assert len(calls) == 6
    assert t.sleeps_ms == [0, 0, 0, 0, 0]


async def test_async_loop_uses_the_same_schedule():
    t = FakeTime()
    outcomes = iter([LOCKED, LOCKED, OK])

    async def acquire():
        return next(outcomes)

    policy = RetryPolicy(retry_delay_ms=50, backoff="fixed", jitter="none")
    result = await aacquire_with_retry(acquire, policy, key="k", clock=t.clock, sleeper=t.asleep)
    assert result is OK
    assert t.sleeps_ms == [50, 50]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_retries": -1},
        {"max_retries": 1.5},
        {"max_retries": True},
        {"retry_delay_ms": -1},
        {"retry_delay_ms": "100"},
        {"retry_delay_ms": float("nan")},
        {"timeout_ms": 0},
        {"timeout_ms": None},
        {"backoff": "linear"},
        {"jitter": "some"},
    ],
)
def test_invalid_policies_are_refused(kwargs):
    with pytest.raises(InvalidArgument):
        RetryPolicy(**kwargs)


class SilentChannel:
    """A healthy wake-up channel on which no release is ever announced: each wait
    runs to its end on the fake clock."""

    def __init__(self, t: FakeTime) -> None:
        self.t = t
        self.healthy = True
        self.grant = None  # the listener's: no release grants it the key
        self.recheck_at = None
        self.waits_ms: list[float] = []

    def ready(self, key):
        return False

    def hold_back(self, key):
        return 0.0  # this process granted nothing

    def listen(self, key, ticket_id):
        return self

    def wait(self, timeout_s, cancel):
        self.waits_ms.append(round(timeout_s * 1000, 6))
        self.t.now += timeout_s
        return False

    def close(self):
        pass


@pytest.mark.parametrize(
    ("policy", "waits_ms"),
    [
        (RetryPolicy(max_retries=3, retry_delay_ms=150, backoff="fixed", jitter="none"), [150] * 3),
        (RetryPolicy(max_retries=3, retry_delay_ms=100, jitter="none"), [100, 200, 400]),
        # Delays past the one-second check-in: an extra attempt at the check-in.
        (
            RetryPolicy(max_retries=2, retry_delay_ms=1500, backoff="fixed", jitter="none"),
            [1000, 500, 1000, 500],
        ),
    ],
)
def test_a_healthy_waiter_gives_up_on_the_formulas_schedule(policy, waits_ms):
    # Issue 20, defect 1: a timer wake-up of a healthy listener counts as a retry.
    t = FakeTime()
    channel = SilentChannel(t)
    session = WaitSession(channel, "k", clock=t.clock)
    acquire, calls = scripted(*[LOCKED] * 20)
    with pytest.raises(AcquisitionTimeout, match=f"after {policy.max_retries + 1} attempts"):
        acquire_with_retry(
            lambda: session.attempt(lambda ticket: acquire()),
            policy,
            key="k",
            clock=t.clock,
            session=session,
        )
    assert channel.waits_ms == waits_ms
    assert round(t.now - 100.0, 6) == sum(waits_ms) / 1000
    # The first attempt goes without a ticket, the queueing one at once after it; then
    # one per wait.
    assert len(calls) == 2 + len(waits_ms)


@pytest.mark.parametrize(
    ("options", "longest"),
    [
        ({}, 5_000.0),  # ten exponential delays from 100 ms add up to 102.3 s
        ({"timeout_ms": 600_000}, 102_300.0),
        ({"backoff": "fixed"}, 1_000.0),  # ten delays of 100 ms
        ({"backoff": "fixed", "retry_delay_ms": 0}, 0.0),
        ({"max_retries": 0, "timeout_ms": 60_000}, 0.0),  # one attempt only
        ({"max_retries": 10_000, "timeout_ms": 2.5}, 2.5),  # no overflow
        ({"jitter": "none", "max_retries": 3, "timeout_ms": 60_000}, 700.0),
    ],
)
def test_longest_wait_is_the_timeout_or_the_sum_of_the_delays_bases(options, longest):
    assert RetryPolicy(**options).longest_wait_ms() == longest
