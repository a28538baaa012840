"""@locked on real Django views through the test client."""

from __future__ import annotations

import threading

import pytest

from django_syncguard import locks, signals


@pytest.fixture(autouse=True)
def fresh_default_backend():
    locks["default"].reset()
    yield
    locks["default"].reset()


def test_sync_view_sees_its_lease(client):
    first = client.post("/invoices/42/pay/").json()
    second = client.post("/invoices/42/pay/").json()
    assert first == {"pk": 42, "key": "invoice:42", "fence": "000000000000001"}
    assert second["fence"] == "000000000000002"
    assert locks["default"].is_locked("invoice:42") is False


def test_sync_view_is_excluded_while_the_invoice_is_locked(client):
    held = locks["default"].acquire("invoice:7", 10_000)
    with pytest.raises(Exception, match="still held after"):
        client.post("/invoices/7/pay/")
    locks["default"].release(held.lock_id)
    assert client.post("/invoices/7/pay/").json()["fence"] == "000000000000002"


async def test_async_view_sees_its_lease(async_client):
    response = await async_client.post("/async/invoices/5/pay/")
    assert response.json() == {"pk": 5, "key": "invoice:5", "fence": "000000000000001"}


# ----------------------------------------------------------------- on_contended
def test_skip_view_answers_409_without_running_while_held(client):
    held = locks["default"].acquire("invoice:8", 10_000)
    response = client.post("/invoices/8/refresh/")
    assert (response.status_code, response.json()) == (409, {"error": "busy"})
    locks["default"].release(held.lock_id)
    assert client.post("/invoices/8/refresh/").json() == {"fence": "000000000000002"}


def test_raise_view_answers_409_after_one_attempt(client):
    attempts = []

    def receiver(sender, attempt, **kwargs):
        attempts.append(attempt)

    held = locks["default"].acquire("invoice:9", 10_000)
    signals.lock_contended.connect(receiver, weak=False)
    try:
        response = client.post("/invoices/9/pay-or-refuse/")
    finally:
        signals.lock_contended.disconnect(receiver)
    assert (response.status_code, response.json(), attempts) == (409, {"error": "locked"}, [1])
    locks["default"].release(held.lock_id)
    assert client.post("/invoices/9/pay-or-refuse/").json() == {"fence": "000000000000002"}


def test_wait_view_runs_once_the_holder_releases(client):
    backend = locks["default"]
    held = backend.acquire("invoice:10", 10_000)
    released = threading.Event()

    def release_when_contended(sender, **kwargs):
        if not released.is_set():
            released.set()
            threading.Thread(target=backend.release, args=(held.lock_id,)).start()

    signals.lock_contended.connect(release_when_contended, weak=False)
    try:
        response = client.post("/invoices/10/pay-when-free/")
    finally:
        signals.lock_contended.disconnect(release_when_contended)
    assert (response.status_code, response.json()) == (200, {"fence": "000000000000002"})
