"""Two different accounts or operations never share a record, on every database.

A name that a column cannot hold as it is (longer than 255 characters, a NUL, a lone
surrogate, whitespace at its end, which MariaDB's collations ignore) is stored by its hash,
in a form no name stored as it is can take: a caller who spells a hashed form directly gets
a record of its own. Each test counts the runs of the operation, not only its answers.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from django.test import RequestFactory

from django_idempotency import run_once
from django_idempotency.decorators import idempotent
from django_idempotency.models import IdempotencyRecord
from tests.helpers import new_key
from tests.testapp.models import Charge
from tests.testapp.views import make_charge

pytestmark = pytest.mark.django_db(databases="__all__")

LONG = "org:" + "a" * 300
CHARGE = {"amount": 5, "currency": "EUR"}


def hashed(name: str) -> str:
    """The form the product stored a long name in before names were made unambiguous."""
    return "sha256:" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()


def two_runs(field: str, first: str, second: str) -> tuple[list[str], list[Any]]:
    """``run_once`` twice with one key, the two calls differing only in ``field``."""
    calls: list[str] = []
    identity = {"account": "acct", "operation": "op", "key": "k-1"}

    def effect(tag: str) -> str:
        calls.append(tag)
        return tag

    results = [
        run_once(effect, tag, **{**identity, field: name})
        for tag, name in (("first", first), ("second", second))
    ]
    return calls, results


@pytest.mark.parametrize("field", ["account", "operation"])
@pytest.mark.parametrize(
    "spelled",
    [
        pytest.param(LONG, id="long"),
        pytest.param("org\x00acme", id="nul"),
        pytest.param("org:\ud800", id="lone-surrogate"),
        pytest.param("t1 ", id="trailing-space"),
    ],
)
def test_a_hashed_names_form_spelled_directly_is_another_name(field, spelled):
    calls, results = two_runs(field, spelled, hashed(spelled))
    assert calls == ["first", "second"]
    assert results == ["first", "second"]
    assert IdempotencyRecord.objects.count() == 2


@pytest.mark.parametrize("field", ["account", "operation"])
@pytest.mark.parametrize(
    "other",
    [
        pytest.param("t1 ", id="one-space"),
        pytest.param("t1  ", id="two-spaces"),
        pytest.param("t1\t", id="tab"),
        pytest.param("t1\u3000", id="ideographic-space"),
    ],
)
def test_names_that_differ_by_trailing_whitespace_are_two_names(field, other):
    """MariaDB's collations compare ``'t1'`` and ``'t1 '`` as equal (PAD SPACE)."""
    calls, results = two_runs(field, "t1", other)
    assert calls == ["first", "second"]
    assert results == ["first", "second"]
    # And each is found again by its own retries.
    again_calls, again = two_runs(field, "t1", other)
    assert again_calls == []
    assert again == ["first", "second"]


def test_a_plain_name_is_stored_as_it_is_and_an_odd_one_by_a_hash_no_plain_name_takes():
    run_once(lambda: 1, account="org:acme", operation="op", key="k")
    run_once(lambda: 1, account=LONG, operation="op", key="k")
    run_once(lambda: 1, account=hashed(LONG), operation="op", key="k")
    stored = sorted(IdempotencyRecord.objects.values_list("account", flat=True))
    assert "org:acme" in stored
    assert len(set(stored)) == 3
    assert all(len(name) <= 255 and "\x00" not in name for name in stored)
    assert all(name == name.rstrip() for name in stored)


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_over_http_a_tenant_spelling_anothers_hashed_form_gets_its_own_record(anon_api):
    key = new_key()
    long_tenant = "t" * 300
    first = anon_api.post("/charges/tenant/", CHARGE, key=key, headers={"X-Tenant": long_tenant})
    spelled = anon_api.post(
        "/charges/tenant/", CHARGE, key=key, headers={"X-Tenant": hashed(long_tenant)}
    )
    assert first.status_code == spelled.status_code == 201
    assert "Idempotent-Replayed" not in spelled
    assert spelled.content != first.content
    assert Charge.objects.count() == 2


@pytest.mark.django_db(transaction=True, databases="__all__")
@pytest.mark.parametrize("answer", [42, b"acme", ["acme"], object()], ids=type)
def test_a_resolver_answering_no_string_is_a_500_problem_and_nothing_runs(answer):
    view = idempotent(account=lambda request: answer, operation="charges.odd")(make_charge)
    request = RequestFactory().post(
        "/charges/", CHARGE, content_type="application/json", headers={"Idempotency-Key": "k"}
    )
    response = view(request)
    assert response.status_code == 500
    assert response["Content-Type"] == "application/problem+json"
    assert json.loads(response.content)["code"] == "idempotency_account_invalid"
    assert Charge.objects.count() == 0
    assert IdempotencyRecord.objects.count() == 0


def test_two_operations_whose_names_share_a_joined_spelling_get_two_downstream_keys():
    """``downstream_key`` hashes the names joined by a separator: names holding that
    separator must not make two operations' provider calls one (a provider would take the
    second charge for a repeat of the first). Names without it keep the key they had."""
    from django.utils.crypto import salted_hmac

    from django_idempotency import current

    def downstream(account: str, operation: str) -> str:
        def body() -> str:
            context = current()
            assert context is not None
            return context.downstream_key("charge")

        return run_once(body, account=account, operation=operation, key="k-1")

    first = downstream("t\x1fx", "op")
    second = downstream("t", "x\x1fop")
    assert first != second
    assert IdempotencyRecord.objects.count() == 2
    # A plain spelling's key is the one earlier releases gave: retries across an upgrade
    # reach the provider with the same key.
    before = salted_hmac(
        "django_idempotency.downstream", "acct\x1fop\x1fk-1\x1fcharge", algorithm="sha256"
    ).hexdigest()
    assert downstream("acct", "op") == before
