"""Hostile arguments to the maintenance commands and their Python API: each one is refused
with a clear error before anything is read or changed."""

from __future__ import annotations

import uuid
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import override_settings
from django.utils import timezone
from django.utils.connection import ConnectionDoesNotExist

from django_idempotency import maintenance, outbox
from django_idempotency.models import IdempotencyRecord, OutboxMessage, OutboxStatus
from tests.factories import RecordFactory

pytestmark = pytest.mark.django_db

KEYS = {"ENCRYPTION_KEYS": ["jZ8nXq7eYbVt2XkB3y0n7O9dVb8Qm3cT5q6i0pW1rX4="]}


def run(command: str, *args: str) -> str:
    out = StringIO()
    call_command(command, *args, stdout=out, stderr=StringIO())
    return out.getvalue()


def expired_and_stale() -> None:
    """An expired record (the purge's) and a stale lease (the recovery's)."""
    now = timezone.now()
    RecordFactory(key="expired", expires_at=now - timedelta(days=1))
    RecordFactory(
        key="stale",
        status="in_progress",
        response_status=None,
        response_headers=[],
        response_body=None,
        lease_token=uuid.uuid4(),
        lease_expires_at=now - timedelta(minutes=5),
    )


@pytest.mark.parametrize(
    "command",
    [
        ["purge_idempotency"],
        ["purge_idempotency", "--dry-run"],
        ["purge_idempotency", "-v", "2"],
        ["recover_idempotency"],
        ["rotate_idempotency_encryption"],
        ["idempotency_stats"],
        ["relay_outbox", "--once"],
    ],
)
def test_an_empty_database_alias_is_refused_not_taken_for_the_default(command):
    """``--database "$ALIAS"`` with the variable unset names no database: it is refused,
    as Django's own commands refuse it, instead of purging the default database."""
    expired_and_stale()
    with override_settings(IDEMPOTENCY=KEYS), pytest.raises(CommandError, match="''"):
        run(*command, "--database", "")
    assert set(IdempotencyRecord.objects.values_list("key", "status")) == {
        ("expired", "completed"),
        ("stale", "in_progress"),
    }


@pytest.mark.parametrize(
    "job",
    [
        maintenance.purge_expired,
        maintenance.recover_stale_leases,
        maintenance.rotate_encryption,
    ],
)
def test_the_python_api_refuses_an_empty_alias_too(job):
    expired_and_stale()
    with override_settings(IDEMPOTENCY=KEYS), pytest.raises(ConnectionDoesNotExist, match="''"):
        job(using="")
    assert IdempotencyRecord.objects.count() == 2
    assert IdempotencyRecord.objects.get(key="stale").status == "in_progress"


def test_the_relay_refuses_an_empty_alias_too():
    sent: list[str] = []
    OutboxMessage.objects.create(task="tasks.mail", args=[], kwargs={})
    with pytest.raises(ConnectionDoesNotExist, match="''"):
        outbox.relay(using="", once=True, sender=lambda message: sent.append(message.task))
    assert sent == []
    assert OutboxMessage.objects.get().status == OutboxStatus.PENDING


@pytest.mark.parametrize("value", ["-1", "99999999999999999999", "2147483648", "1.5", "abc"])
def test_stats_refuses_a_unique_keys_count_out_of_range_before_reading(value):
    """``--unique-keys`` takes 0 to 2147483647, as every count of the commands does: a
    larger one was a LIMIT the database refused, with a traceback."""
    with pytest.raises(CommandError, match="--unique-keys"):
        run("idempotency_stats", "--unique-keys", value)


def test_stats_takes_zero_unique_keys():
    assert "unique keys" not in run("idempotency_stats", "--unique-keys", "0")


def test_stats_names_a_status_it_does_not_know_instead_of_failing():
    """A row another program wrote with a status this release does not know (a newer
    release's, a hand edit) is counted under that status, in the text as in the JSON."""
    RecordFactory()
    damaged = RecordFactory()
    IdempotencyRecord.objects.filter(pk=damaged.pk).update(status="archived")
    message = OutboxMessage.objects.create(task="tasks.mail", args=[], kwargs={})
    OutboxMessage.objects.filter(pk=message.pk).update(status="held")

    lines = run("idempotency_stats", "--unique-keys", "0").splitlines()

    assert any(line.split() == ["completed", "1"] for line in lines), lines
    assert any(line.split() == ["archived", "(unknown", "status)", "1"] for line in lines), lines
    assert any(line.split() == ["held", "(unknown", "status)", "1"] for line in lines), lines
    assert any(line.split() == [OutboxStatus.PENDING.label, "0"] for line in lines), lines


#: The audit reads the outbox's unique keys, which SQLite's unreachable store (the records
#: table renamed away) leaves readable.
UNIQUE_KEYS_UNREACHABLE = pytest.mark.skipif(
    connection.vendor == "sqlite", reason="SQLite's fault leaves the unique keys readable"
)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("unreachable_store")
@pytest.mark.parametrize(
    "command",
    [
        ["idempotency_stats"],
        ["idempotency_stats", "--json"],
        ["purge_idempotency"],
        ["recover_idempotency"],
        pytest.param(["idempotency_audit", "--unique-keys"], marks=UNIQUE_KEYS_UNREACHABLE),
        pytest.param(
            ["idempotency_audit", "--unique-keys", "--format", "json"],
            marks=UNIQUE_KEYS_UNREACHABLE,
        ),
    ],
)
def test_a_database_that_cannot_be_read_is_a_command_error(command):
    """Status 1 with the database's message, as the purge's docs say of every maintenance
    command, not a traceback."""
    with pytest.raises(CommandError, match="failed: "):
        run(*command)
