"""The purge's batch size follows a time budget: ``batch_size`` is a ceiling, not a fixed size."""

from __future__ import annotations

from datetime import timedelta
from itertools import pairwise

import pytest

from django_idempotency import _purge as purge_module
from django_idempotency import maintenance
from django_idempotency.models import IdempotencyRecord
from tests.factories import RecordFactory
from tests.helpers import NOW, bulk_records

pytestmark = pytest.mark.django_db

ROWS = 2100


@pytest.fixture
def expired() -> None:
    # Created 30 hours before NOW, as bulk_records makes them (a day before they expire).
    bulk_records(ROWS, expires_at=NOW - timedelta(hours=6), prefix="expired")
    RecordFactory(created_at=NOW, expires_at=NOW + timedelta(hours=1), key="young")


def batch_sizes(progress=None) -> list[int]:
    """Purge with a ceiling of 1000 rows; the size of every batch, in order."""
    totals: list[int] = []

    def seen(batches: int, rows: int) -> None:
        totals.append(rows)
        if progress:
            progress(batches)

    result = maintenance.purge_expired(batch_size=1000, now=NOW, progress=seen)
    assert result.deleted == ROWS
    assert list(IdempotencyRecord.objects.values_list("key", flat=True)) == ["young"]
    return [b - a for a, b in pairwise([0, *totals])]


def test_batches_within_the_budget_keep_the_ceiling(expired, monkeypatch):
    monkeypatch.setattr(purge_module, "BATCH_BUDGET_SECONDS", 60.0)
    assert batch_sizes() == [1000, 1000, 100]


def test_batches_over_the_budget_halve_down_to_the_floor(expired, monkeypatch):
    monkeypatch.setattr(purge_module, "BATCH_BUDGET_SECONDS", 0.0)  # every batch is too slow
    assert batch_sizes() == [1000, 500, 250, 125, 100, 100, 25]


def test_batches_grow_back_when_the_server_is_quick_again(expired, monkeypatch):
    monkeypatch.setattr(purge_module, "BATCH_BUDGET_SECONDS", 0.0)

    def quick_after_two(batches: int) -> None:
        if batches == 2:
            monkeypatch.setattr(purge_module, "BATCH_BUDGET_SECONDS", 60.0)

    assert batch_sizes(quick_after_two) == [1000, 500, 600]
