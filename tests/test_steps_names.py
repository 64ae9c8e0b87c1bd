"""Step names the database cannot keep apart or store: found while building the admin's and
the operations' side of recovery points. Each test fails today (strict ``xfail``): a name
that cannot be recorded is refused only by the database, after the step's function ran, so
every retry runs that function again and fails again at the same place."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection

from django_idempotency import run_once, step
from django_idempotency.models import IdempotencyStep

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

CALLS: list[str] = []


@pytest.fixture(autouse=True)
def _calls() -> Any:
    CALLS.clear()
    yield
    CALLS.clear()


def call(label: str) -> str:
    """An external call: it happens whatever the database does next."""
    CALLS.append(label)
    return label


def attempt(body: Any) -> Any:
    return run_once(
        body, account="consumer:names", operation="names.op", key="k-1", recovery="resume"
    )


@pytest.mark.xfail(
    strict=True,
    reason="step() accepts a name with a lone surrogate, which no database stores: the step's "
    "function runs, then recording it raises UnicodeEncodeError, on every retry",
)
def test_a_name_no_database_can_store_is_refused_before_the_step_runs():
    for _ in range(2):  # a retry meets the same name
        with pytest.raises(ValueError, match="step name"):
            attempt(lambda: step("line:\ud800", call, "mail"))
    assert CALLS == []


@pytest.mark.xfail(
    connection.vendor == "mysql",
    strict=True,
    reason="MariaDB's binary collation pads with spaces: 'ride' and 'ride ' are one name in "
    "the unique (record, name) index, and the second step's record is an IntegrityError after "
    "its function ran, on every retry",
)
def test_names_that_differ_by_a_trailing_space_are_two_steps():
    def body() -> list[str]:
        return [step("ride", call, "first"), step("ride ", call, "second")]

    assert attempt(body) == ["first", "second"]
    assert attempt(body) == ["first", "second"]  # the replay
    assert CALLS == ["first", "second"]
    assert IdempotencyStep.objects.count() == 2
