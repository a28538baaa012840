"""fenced_update(): a stale holder's ORM write is rejected in one statement."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_syncguard import InvalidArgument, StaleFenceError, afenced_update, fenced_update
from tests.support.factories import AccountFactory, LedgerFactory
from tests.testapp.models import Account, Ledger

pytestmark = pytest.mark.django_db

F3, F4, F5 = "000000000000003", "000000000000004", "000000000000005"


def test_first_fenced_write_applies_and_stores_the_fence():
    account = AccountFactory(fence=None)
    with CaptureQueriesContext(connection) as queries:
        written = fenced_update(Account.objects.filter(pk=account.pk), F4, balance=70)
    assert written == 1
    assert len(queries) == 1
    assert queries[0]["sql"].startswith("UPDATE")
    account.refresh_from_db()
    assert (account.balance, account.fence) == (70, F4)


def test_newer_fence_wins_and_stale_write_raises():
    account = AccountFactory(fence=F4, balance=100)
    with pytest.raises(StaleFenceError) as caught:
        fenced_update(Account.objects.filter(pk=account.pk), F3, balance=0)
    assert caught.value.fence == F3
    account.refresh_from_db()
    assert (account.balance, account.fence) == (100, F4)


def test_same_holder_may_write_again():
    account = AccountFactory(fence=F4)
    assert fenced_update(Account.objects.filter(pk=account.pk), F4, balance=1) == 1
    assert fenced_update(Account.objects.filter(pk=account.pk), F5, balance=2) == 1
    account.refresh_from_db()
    assert (account.balance, account.fence) == (2, F5)


def test_no_matching_row_returns_zero():
    assert fenced_update(Account.objects.filter(name="nobody"), F3, balance=1) == 0


def test_integer_fence_field():
    ledger = LedgerFactory(version=4)
    qs = Ledger.objects.filter(pk=ledger.pk)
    with pytest.raises(StaleFenceError):
        fenced_update(qs, F3, field="version", total=9)
    assert fenced_update(qs, F5, field="version", total=9) == 1
    ledger.refresh_from_db()
    assert (ledger.total, ledger.version) == (9, 5)


def test_multi_row_update_skips_newer_rows():
    old, new = AccountFactory(fence=F3), AccountFactory(fence=F5)
    assert fenced_update(Account.objects.filter(pk__in=[old.pk, new.pk]), F4, balance=7) == 1
    old.refresh_from_db()
    new.refresh_from_db()
    assert (old.balance, old.fence, new.balance, new.fence) == (7, F4, 100, F5)


@pytest.mark.parametrize("fence", ["1", "00000000000000x", 3, None, "0000000000000001"])
def test_malformed_fence_is_refused_before_io(fence, django_assert_num_queries):
    with django_assert_num_queries(0), pytest.raises(InvalidArgument):
        fenced_update(Account.objects.all(), fence, balance=1)


def test_unknown_fence_field_is_refused():
    with pytest.raises(InvalidArgument, match="no field 'nope'"):
        fenced_update(Account.objects.all(), F3, field="nope")


@pytest.mark.parametrize(
    ("field", "kind"),
    [("amount", "DecimalField"), ("code", "CharField"), ("flags", "SmallIntegerField")],
)
def test_a_field_that_cannot_hold_a_fence_is_refused_before_any_query(field, kind):
    ledger = LedgerFactory(version=4)
    qs = Ledger.objects.filter(pk=ledger.pk)
    with (
        CaptureQueriesContext(connection) as queries,
        pytest.raises(InvalidArgument, match=rf"Ledger\.{field} \({kind}\) cannot hold a fence"),
    ):
        fenced_update(qs, F5, field=field, total=9)
    assert len(queries) == 0
    ledger.refresh_from_db()
    assert ledger.total == 0


# ------------------------------------------------------------- afenced_update
@pytest.mark.django_db(transaction=True)
async def test_afenced_update_writes_refuses_stale_and_lets_the_holder_write_again():
    account = await Account.objects.acreate(name="async", fence=F4, balance=100)
    rows = Account.objects.filter(pk=account.pk)
    with pytest.raises(StaleFenceError) as caught:
        await afenced_update(rows, F3, balance=0)
    assert caught.value.fence == F3
    assert await afenced_update(rows, F4, balance=1) == 1
    assert await afenced_update(rows, F5, balance=2) == 1
    assert await afenced_update(Account.objects.filter(name="nobody"), F5, balance=3) == 0
    stored = await rows.aget()
    assert (stored.balance, stored.fence) == (2, F5)


@pytest.mark.django_db(transaction=True)
async def test_afenced_update_with_an_integer_fence_field():
    ledger = await Ledger.objects.acreate(version=4)
    rows = Ledger.objects.filter(pk=ledger.pk)
    with pytest.raises(StaleFenceError):
        await afenced_update(rows, F3, field="version", total=9)
    assert await afenced_update(rows, F5, field="version", total=9) == 1
    stored = await rows.aget()
    assert (stored.total, stored.version) == (9, 5)


@pytest.mark.parametrize("fence", ["1", 3, None])
async def test_afenced_update_refuses_bad_input_before_any_query(fence):
    # Checked before the first query, by the code fenced_update shares (whose tests
    # above count the queries).
    with pytest.raises(InvalidArgument):
        await afenced_update(Account.objects.all(), fence, balance=1)
    with pytest.raises(InvalidArgument, match="no field 'nope'"):
        await afenced_update(Account.objects.all(), F3, field="nope")


@pytest.mark.django_db(transaction=True)
async def test_an_async_view_pays_with_afenced_update(async_client):
    account = await Account.objects.acreate(name="async-view", balance=10)
    url = f"/async/accounts/default/{account.pk}/deposit/"
    first = await async_client.post(url)
    second = await async_client.post(url)
    assert [first.status_code, second.status_code] == [200, 200]
    assert int(second.json()["fence"]) == int(first.json()["fence"]) + 1
    stored = await Account.objects.aget(pk=account.pk)
    assert (stored.balance, stored.fence) == (12, second.json()["fence"])
    # A holder whose lease has passed to a newer one: its fenced write is refused.
    with pytest.raises(StaleFenceError):
        await afenced_update(Account.objects.filter(pk=account.pk), first.json()["fence"])
