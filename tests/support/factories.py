"""factory-boy factories for the ORM rows the tests use."""

from __future__ import annotations

import factory

from tests.testapp.models import Account, Ledger


class AccountFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Account

    name = factory.Sequence(lambda n: f"account-{n}")
    balance = 100
    fence = None


class LedgerFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Ledger

    total = 0
    version = None
