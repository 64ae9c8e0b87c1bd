"""The shop's payment gateway client: one call per payment.

The gateway deduplicates calls by their idempotency key, as Stripe's and Adyen's APIs do;
here the example project's fake provider stands for it. The shop's tests put a
``django_idempotency.testing.FakeProvider`` in its place, which counts calls and payments.
"""

from __future__ import annotations

import uuid

from example_project.payments import provider


def charge(amount: int, currency: str, *, idempotency_key: str | None) -> str:
    """Take ``amount`` from the customer; the gateway's reference of the payment.

    A call with a key the gateway has seen returns that payment again. Without a key the
    gateway cannot tell a retry from a new payment, and pays again.
    """
    key = idempotency_key or f"no-key:{uuid.uuid4()}"
    return provider.charge(key=key, amount=amount, currency=currency).reference
