"""Step names the database cannot keep apart or store (found while building the admin's and
the operations' side of recovery points): refused by ``step()`` before the step's function
runs, on every database; the database alone refused them after the function ran, so every
retry ran that function again and failed again at the same place."""

from __future__ import annotations

from typing import Any

import pytest

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


def test_a_name_no_database_can_store_is_refused_before_the_step_runs():
    for _ in range(2):  # a retry meets the same name
        with pytest.raises(ValueError, match="step name"):
            attempt(lambda: step("line:\ud800", call, "mail"))
    assert CALLS == []


def test_names_that_differ_by_whitespace_at_an_end_are_refused_before_the_step_runs():
    # MariaDB's binary collation ignores trailing spaces ("ride" and "ride " would be one
    # step there): a name with whitespace at either end is refused on every database.
    def body() -> list[str]:
        return [step("ride", call, "first"), step("ride ", call, "second")]

    for _ in range(2):
        with pytest.raises(ValueError, match="step name"):
            attempt(body)
    assert CALLS == ["first"]  # the first step ran once; the refused name never ran
    assert IdempotencyStep.objects.count() == 1
