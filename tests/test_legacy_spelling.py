"""A record an earlier release wrote under its spelling of a name, beside one of today's.

Release 0.1.4 stored an operation ending in whitespace as it is; this one stores it by its
hash, and adopts an earlier release's record on its first claim of that name (see
tests/test_upgrade.py). Where both are there (an earlier release's server writing beside
this one's during a rolling upgrade), today's record keeps its place: the claim replays it,
the earlier one is left to its expiry, and the body runs no more. Effects are counted.
"""

from __future__ import annotations

import logging

import pytest

from django_idempotency import run_once_result
from django_idempotency.models import IdempotencyRecord
from tests.helpers import new_key

pytestmark = pytest.mark.django_db(transaction=True)

OPERATION = "invoices.send "  # ends in whitespace: 0.1.4 stored it as it is


def test_a_record_of_todays_spelling_keeps_its_place_beside_an_earlier_releases(caplog):
    calls: list[str] = []

    def send() -> str:
        calls.append("sent")
        return f"invoice {len(calls)}"

    key = new_key()
    first = run_once_result(send, account="billing", operation=OPERATION, key=key)
    (today,) = IdempotencyRecord.objects.all()
    assert today.operation != OPERATION  # stored by its hash
    # The earlier release's copy of it, under its own spelling.
    earlier = IdempotencyRecord.objects.get(pk=today.pk)
    earlier.pk, earlier.operation = None, OPERATION
    earlier.save(force_insert=True)
    with caplog.at_level(logging.WARNING, logger="django_idempotency"):
        again = run_once_result(send, account="billing", operation=OPERATION, key=key)
    assert (first.value, again.value, again.replayed) == ("invoice 1", "invoice 1", True)
    assert calls == ["sent"]
    assert sorted(IdempotencyRecord.objects.values_list("operation", flat=True)) == sorted(
        [today.operation, OPERATION]
    )
    assert [r.getMessage() for r in caplog.records if "earlier release" in r.getMessage()] == [
        f"a record of {today.operation} written by an earlier release was left under its "
        "old spelling: a record of today's spelling is in its way"
    ]
