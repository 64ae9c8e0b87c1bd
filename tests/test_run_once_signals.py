"""``run_once`` announces what a recovery policy did with a stale lease, as the request path
does: ``lease_recovered`` with the outcome (``retried``, ``failed``, ``completed``,
``resumed``)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from django_idempotency import OutcomeUnknown, run_once, signals
from django_idempotency.exceptions import SimulatedCrash
from django_idempotency.models import IdempotencyRecord

pytestmark = pytest.mark.django_db(transaction=True)


def answer_from_the_provider(record: Any) -> dict[str, str]:
    return {"from": "provider"}


@pytest.mark.parametrize(
    ("policy", "outcome"),
    [
        ("retry", "retried"),
        ("fail", "failed"),
        ("resume", "resumed"),
        ("tests.test_run_once_signals.answer_from_the_provider", "completed"),
    ],
)
def test_a_recovered_stale_lease_is_announced(policy, outcome):
    seen: list[tuple[str, str]] = []

    def receiver(**kwargs: Any) -> None:
        seen.append((kwargs["policy"], kwargs["outcome"]))

    identity = {"account": "consumer:s", "operation": "s.op", "key": "k", "recovery": policy}
    crash = [True]

    def body() -> str:
        if crash.pop():
            raise SimulatedCrash
        return "ran"

    with pytest.raises(SimulatedCrash):
        run_once(body, **identity)
    crash.append(False)
    IdempotencyRecord.objects.update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    signals.lease_recovered.connect(receiver)
    try:
        if outcome == "failed":
            with pytest.raises(OutcomeUnknown):
                run_once(body, **identity)
        else:
            run_once(body, **identity)
    finally:
        signals.lease_recovered.disconnect(receiver)
    assert seen == [(policy, outcome)]
