"""Where the claim could not keep its promise, ``run_once`` refuses before anything runs.

Inside a caller's transaction on PostgreSQL the claim commits on a connection of its own
(``CLAIM_DATABASE`` when set). Refused with ``ImproperlyConfigured``, the body never run and
no record written: ``recovery="resume"``, whose steps must each commit as they finish; and a
``CLAIM_DATABASE`` that is itself inside a transaction, whose claims would not commit at
once. The caller's transaction goes on after the refusal.
"""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.test import override_settings

from django_idempotency import run_once
from django_idempotency.models import IdempotencyRecord
from tests.helpers import new_key, postgres_only
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True, databases="__all__"), postgres_only]

IDENTITY = {"account": "consumer", "operation": "orders.ship"}


def ship(calls: list[str]) -> str:
    calls.append("ran")
    Charge.objects.create(account="consumer", amount=1, currency="EUR")
    return "shipped"


def test_resume_inside_the_callers_transaction_is_refused_before_anything_runs():
    calls: list[str] = []
    with transaction.atomic():
        with pytest.raises(ImproperlyConfigured, match="'resume' inside a transaction"):
            run_once(ship, calls, **IDENTITY, key=new_key(), recovery="resume")
        Charge.objects.create(account="caller", amount=1, currency="EUR")
    assert calls == []
    assert list(Charge.objects.values_list("account", flat=True)) == ["caller"]
    assert not IdempotencyRecord.objects.exists()
    # Outside the caller's transaction it runs, once.
    key = new_key()
    for _ in range(2):
        assert run_once(ship, calls, **IDENTITY, key=key, recovery="resume") == "shipped"
    assert calls == ["ran"]


@override_settings(IDEMPOTENCY={"CLAIM_DATABASE": "claims"})
def test_a_claim_database_inside_a_transaction_is_refused_before_anything_runs():
    calls: list[str] = []
    with transaction.atomic(using="claims"), transaction.atomic():
        with pytest.raises(ImproperlyConfigured, match=r"'claims'.*inside a transaction"):
            run_once(ship, calls, **IDENTITY, key=new_key())
        assert connection.in_atomic_block
    assert calls == []
    assert not IdempotencyRecord.objects.exists()
    assert not Charge.objects.exists()
    key = new_key()
    with transaction.atomic():
        assert run_once(ship, calls, **IDENTITY, key=key) == "shipped"
    with transaction.atomic():
        assert run_once(ship, calls, **IDENTITY, key=key) == "shipped"
    assert (calls, Charge.objects.count()) == (["ran"], 1)
