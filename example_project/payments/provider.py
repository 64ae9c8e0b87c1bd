"""A fake payment provider that honours idempotency keys, as real ones do.

It writes through its own connection (the ``provider`` database alias), so its ledger
survives a rollback of the caller's transaction, like a remote system's would. A second call
with the same key returns the first charge: the unique key lets the database pick it.
"""

from __future__ import annotations

import time

from django.conf import settings
from django.db import IntegrityError, transaction

from example_project.payments.models import ProviderCall, ProviderCharge

ALIAS = "provider"


def charge(*, key: str, amount: int, currency: str, description: str = "") -> ProviderCharge:
    """Charge ``amount`` once per ``key``; a repeated key returns the original charge."""
    ProviderCall.objects.using(ALIAS).create(key=key, description=description)
    # A real provider takes a while to answer; retries pile up meanwhile.
    time.sleep(getattr(settings, "FAKE_PROVIDER_LATENCY", 0))
    try:
        with transaction.atomic(using=ALIAS):
            return ProviderCharge.objects.using(ALIAS).create(
                key=key, amount=amount, currency=currency, description=description
            )
    except IntegrityError:
        return ProviderCharge.objects.using(ALIAS).get(key=key)
