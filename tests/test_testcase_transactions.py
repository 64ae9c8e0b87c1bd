"""Django's ``TestCase`` (and pytest-django's ``db``) is not a caller's transaction.

A project's own tests behave as they always did: inside the test's transaction a retry
replays, the claim is the test's own (no second connection is used), and nothing a test
claimed outlives it. ``tests/test_callers_transaction.py`` covers real callers'
transactions.
"""

from __future__ import annotations

import io
import unittest

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.test import TestCase

from django_idempotency import _autonomous, run_once
from django_idempotency.models import IdempotencyRecord
from tests.testapp.models import Charge

IDENTITY = {"account": "consumer:tests", "operation": "tests.ship", "key": "msg-1"}


def ship() -> int:
    return Charge.objects.create(account="consumer", amount=1, currency="EUR").pk


class ProjectTests(TestCase):
    """A project's own test case, run by the tests below (not collected on its own)."""

    __test__ = False

    def test_run_once_inside_atomic(self) -> None:
        with transaction.atomic():
            # The test's own blocks are marked; this one is the test's code, inside them.
            assert not _autonomous.separate("default")
            first = run_once(ship, **IDENTITY, recovery="fail")
            assert run_once(ship, **IDENTITY, recovery="fail") == first
        assert run_once(ship, **IDENTITY) == first
        assert Charge.objects.count() == 1
        assert IdempotencyRecord.objects.count() == 1

    def test_a_view_under_atomic_requests(self) -> None:
        from django.contrib.auth.models import User

        self.client.force_login(User.objects.create_user("tester"))
        connection.settings_dict["ATOMIC_REQUESTS"] = True
        try:
            headers = {"Idempotency-Key": "order-1"}
            first = self.client.post("/txn/local/fail/", {}, headers=headers)
            retry = self.client.post("/txn/local/fail/", {}, headers=headers)
        finally:
            connection.settings_dict["ATOMIC_REQUESTS"] = False
        assert first.status_code == 201
        assert retry.content == first.content
        assert retry["Idempotent-Replayed"] == "true"
        assert Charge.objects.count() == 1
        assert IdempotencyRecord.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_nothing_a_test_case_claimed_outlives_it():
    for _run in range(2):  # the same keys twice: the second run meets nothing of the first
        result = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(
            unittest.defaultTestLoader.loadTestsFromTestCase(ProjectTests)
        )
        assert result.wasSuccessful(), result.failures + result.errors
        assert result.testsRun == 2
        assert not IdempotencyRecord.objects.exists()
        assert not Charge.objects.exists()


@pytest.mark.django_db
def test_pytest_django_db_is_the_tests_transaction_too():
    with transaction.atomic():
        assert not _autonomous.separate("default")
        first = run_once(ship, **IDENTITY)
    assert run_once(ship, **IDENTITY) == first
    assert Charge.objects.count() == 1


sqlite_only = pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's refusal")


@sqlite_only
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("policy", ["fail", "tests.test_testcase_transactions.ship"])
def test_sqlite_refuses_policies_that_must_outlive_a_crash_inside_a_transaction(policy):
    with (
        pytest.raises(ImproperlyConfigured, match="SQLite cannot commit the claim"),
        transaction.atomic(),
    ):
        run_once(ship, **IDENTITY, recovery=policy)
    assert not IdempotencyRecord.objects.exists()
    assert not Charge.objects.exists()
    # Outside a transaction the policy runs as everywhere.
    first = run_once(ship, **IDENTITY, recovery=policy)
    assert run_once(ship, **IDENTITY, recovery=policy) == first
    assert Charge.objects.count() == 1


@sqlite_only
@pytest.mark.django_db(transaction=True)
def test_sqlite_keeps_retry_claims_in_the_callers_transaction():
    with transaction.atomic():
        first = run_once(ship, **IDENTITY)
        assert run_once(ship, **IDENTITY) == first
    assert run_once(ship, **IDENTITY) == first
    assert Charge.objects.count() == 1

    def then_roll_back() -> None:
        with transaction.atomic():
            run_once(ship, **{**IDENTITY, "key": "msg-2"})
            raise RuntimeError("rolled back: the claim with it")

    with pytest.raises(RuntimeError):
        then_roll_back()
    assert not IdempotencyRecord.objects.filter(key="msg-2").exists()
