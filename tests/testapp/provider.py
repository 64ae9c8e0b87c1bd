"""A fake payment provider that honours idempotency keys, as real ones do.

It writes through its own connection (the ``provider`` alias, autocommit), so its ledger
survives a rollback of the caller's transaction, like an external system's would.
"""

from __future__ import annotations

from django.db import IntegrityError, transaction

from tests.testapp.models import ProviderCall, ProviderCharge

ALIAS = "provider"


def charge(key: str, amount: int, currency: str) -> int:
    ProviderCall.objects.using(ALIAS).create(key=key)
    try:
        with transaction.atomic(using=ALIAS):
            return (
                ProviderCharge.objects.using(ALIAS)
                .create(key=key, amount=amount, currency=currency)
                .pk
            )
    except IntegrityError:
        return ProviderCharge.objects.using(ALIAS).get(key=key).pk
