"""Errors PostgreSQL asks the client to retry (a serialization failure, a deadlock victim),
raised by the server itself: the engine's short transactions run again, a few times at
most; any other error propagates at once. Counted: the attempts made."""

from __future__ import annotations

import pytest
from django.db import OperationalError, connection, transaction

from django_idempotency import _retry

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's SQLSTATEs"),
]


def fail_with(errcode: str) -> None:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"DO $$ BEGIN RAISE EXCEPTION 'asked' USING ERRCODE = '{errcode}'; END $$")


@pytest.mark.parametrize("errcode", ["serialization_failure", "deadlock_detected"])
def test_a_failure_the_server_asks_to_retry_runs_again(errcode):
    attempts: list[int] = []

    def short_transaction() -> str:
        attempts.append(len(attempts))
        if len(attempts) < 3:
            fail_with(errcode)
        return "done"

    assert _retry.retrying(short_transaction) == "done"
    assert attempts == [0, 1, 2]


def test_retries_are_few_and_other_errors_are_not_retried():
    attempts: list[str] = []

    def always(errcode: str) -> None:
        attempts.append(errcode)
        fail_with(errcode)

    with pytest.raises(OperationalError):
        _retry.retrying(lambda: always("serialization_failure"))
    assert len(attempts) == _retry.ATTEMPTS
    attempts.clear()
    with pytest.raises(OperationalError):
        _retry.retrying(lambda: always("lock_not_available"))
    assert attempts == ["lock_not_available"]
