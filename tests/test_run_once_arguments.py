"""``run_once`` checks its arguments like the decorator does, before anything runs.

Each wrong value raises ``ImproperlyConfigured`` naming the argument; the callable is never
called and nothing is stored, however often it is called with the same key. The same rules
as ``@idempotent(...)`` and ``@idempotent_task(...)``: one validation, one place
(``validation.view_arguments``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from django_idempotency import run_once
from django_idempotency.decorators import idempotent
from django_idempotency.models import IdempotencyRecord

pytestmark = pytest.mark.django_db

IDENTITY: dict[str, Any] = {"account": "consumer:args", "operation": "args.run", "key": "k-1"}

WRONG = [
    ("ttl", 0),
    ("ttl", -60),
    ("ttl", True),
    ("ttl", timedelta(0)),
    ("ttl", timedelta(seconds=-1)),
    ("ttl", "3600"),
    ("ttl", float("nan")),
    ("ttl", 10**20),
    ("lease", -1),
    ("lease", 0),
    ("lease", False),
    ("lease", [60]),
    ("recovery", "Fail"),
    ("recovery", "RETRY"),
    ("recovery", 42),
    ("recovery", "no.such.module.policy"),
    ("recovery", True),
]


@pytest.mark.parametrize(("name", "value"), WRONG)
def test_a_wrong_argument_raises_before_anything_runs(name, value):
    calls: list[int] = []
    for _attempt in range(3):
        with pytest.raises(ImproperlyConfigured, match=name):
            run_once(lambda: calls.append(1), **IDENTITY, **{name: value})
    assert calls == []
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.parametrize(("name", "value"), WRONG)
def test_the_decorator_refuses_the_same_values(name, value):
    with pytest.raises(ImproperlyConfigured, match=name):
        idempotent(**{name: value})


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"ttl": 60, "lease": 60}, "ttl"),
        ({"ttl": 30, "lease": 60}, "ttl"),
        ({"account": ""}, "account"),
        ({"account": None}, "account"),
        ({"account": 42}, "account"),
        ({"operation": ""}, "operation"),
        ({"operation": "   "}, "operation"),
        ({"operation": None}, "operation"),
        ({"fingerprint": object()}, "fingerprint"),
        ({"fingerprint": {"amount": float("nan")}}, "fingerprint"),
    ],
)
def test_identity_terms_and_fingerprints_are_checked_too(arguments, match):
    calls: list[int] = []
    with pytest.raises(ImproperlyConfigured, match=match):
        run_once(lambda: calls.append(1), **{**IDENTITY, **arguments})
    assert calls == []
    assert not IdempotencyRecord.objects.exists()


def test_right_values_run_once():
    calls: list[int] = []

    def effect() -> int:
        calls.append(1)
        return len(calls)

    terms = {"ttl": timedelta(days=7), "lease": 30, "recovery": "fail", "fingerprint": {"a": 1}}
    assert [run_once(effect, **IDENTITY, **terms) for _ in range(3)] == [1, 1, 1]
    assert calls == [1]


@pytest.mark.parametrize(("name", "right", "wrong"), [("ttl", 1, True), ("lease", 1, True)])
def test_a_value_checked_once_lets_no_equal_wrong_value_through(name, right, wrong):
    # The values are validated once per combination and remembered: a boolean, equal to
    # the number of seconds it spells (True == 1), is checked as itself.
    calls: list[int] = []
    terms = {"ttl": 3600} if name == "lease" else {}
    run_once(lambda: calls.append(1), **IDENTITY, **terms, **{name: right})
    for _attempt in range(2):
        with pytest.raises(ImproperlyConfigured, match=name):
            run_once(lambda: calls.append(2), **{**IDENTITY, "key": "k-2"}, **{name: wrong})
    assert calls == [1]
    assert IdempotencyRecord.objects.count() == 1


class _Unhashable:
    """A recovery callable that cannot be remembered (equality without a hash)."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self) -> None:
        self.__qualname__ = "unhashable_recovery"  # the policy's name, as a function's

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Unhashable)

    def __call__(self, record: IdempotencyRecord) -> None:
        return None


def test_an_unhashable_recovery_callable_is_checked_on_every_call():
    calls: list[int] = []
    for n in range(3):
        run_once(lambda: calls.append(1), **{**IDENTITY, "key": f"k-{n}"}, recovery=_Unhashable())
    assert calls == [1, 1, 1]
    assert IdempotencyRecord.objects.count() == 3
