"""@locked on real Django views through the test client."""

from __future__ import annotations

import pytest

from django_syncguard import locks


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
