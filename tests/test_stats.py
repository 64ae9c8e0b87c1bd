"""``idempotency_stats`` and the queries behind it (``django_idempotency._stats``)."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.db.models import Count, Q
from django.utils import timezone

from django_idempotency import _stats
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.factories import RecordFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def table():
    """Two completed, one failed, one live claim (claimed 30 s ago), one stale claim
    (claimed 10 min ago), and one completed record past its TTL."""
    now = timezone.now()
    RecordFactory.create_batch(2)
    RecordFactory(status=RecordStatus.FAILED, response_status=200)
    in_progress = {"status": RecordStatus.IN_PROGRESS, "response_status": None}
    RecordFactory(
        **in_progress,
        created_at=now - timedelta(seconds=30),
        lease_expires_at=now + timedelta(seconds=30),
    )
    RecordFactory(
        **in_progress,
        created_at=now - timedelta(minutes=10),
        lease_expires_at=now - timedelta(minutes=9),
    )
    RecordFactory(created_at=now - timedelta(days=2), expires_at=now - timedelta(days=1))
    return now


def test_collect(table):
    snapshot = _stats.collect(now=table)
    assert snapshot.database == "default"
    assert snapshot.rows == 6
    assert snapshot.by_status == {"in_progress": 2, "completed": 3, "failed": 1}
    assert snapshot.oldest_in_progress_seconds == pytest.approx(600, abs=1)
    assert snapshot.stale_leases == 1
    assert snapshot.expired == 1
    if connection.vendor == "postgresql":
        assert snapshot.table_bytes > 0
    else:
        assert snapshot.table_bytes is None


def test_collect_on_an_empty_table():
    snapshot = _stats.collect()
    assert snapshot.rows == 0
    assert snapshot.by_status == {"in_progress": 0, "completed": 0, "failed": 0}
    assert snapshot.oldest_in_progress_seconds is None
    assert snapshot.stale_leases == 0
    assert snapshot.expired == 0


def test_an_expired_claim_with_a_live_lease_is_not_counted_as_expired():
    # The purge leaves it to its owner, so it is not "waiting for the purge".
    now = timezone.now()
    RecordFactory(
        status=RecordStatus.IN_PROGRESS,
        lease_expires_at=now + timedelta(seconds=30),
        expires_at=now - timedelta(seconds=1),
    )
    assert _stats.collect(now=now).expired == 0


def labelled(output: str, section: str | None = None) -> dict[str, str]:
    """The command's lines by label, the first of a repeated label winning (the records'
    statuses come before the resumable ones); ``section``: the lines indented under it."""
    lines: dict[str, str] = {}
    heading = ""
    for line in output.splitlines():
        label, value = (part.strip() for part in line.rsplit("  ", 1))
        if not line.startswith(" "):
            heading = label
        elif section is not None and heading != section:
            continue
        if section is None or line.startswith(" "):
            lines.setdefault(label, value)
    return lines


def test_command_prints_a_table(table):
    out = StringIO()
    call_command("idempotency_stats", stdout=out)
    lines = labelled(out.getvalue())
    assert lines["database"] == "default"
    assert lines["rows"] == "6"
    assert lines["in progress"] == "2"
    assert lines["completed"] == "3"
    assert lines["failed"] == "1"
    assert lines["oldest in progress"].startswith("10 min")
    assert lines["stale leases"] == "1"
    assert lines["expired, not purged"] == "1"
    if connection.vendor == "postgresql":
        assert lines["table size"].endswith(("KiB", "MiB"))
    else:
        assert lines["table size"] == "n/a"


def test_command_json(table):
    out = StringIO()
    call_command("idempotency_stats", "--json", stdout=out)
    data = json.loads(out.getvalue())
    assert data["rows"] == 6
    assert data["by_status"] == {"in_progress": 2, "completed": 3, "failed": 1}
    assert data["stale_leases"] == 1
    assert data["expired"] == 1
    assert data["oldest_in_progress_seconds"] == pytest.approx(600, abs=5)
    assert set(data) == {
        "unique_keys",
        "database",
        "rows",
        "by_status",
        "table_bytes",
        "oldest_in_progress_seconds",
        "stale_leases",
        "expired",
        "resumable",
        "resumable_stale",
        "unreadable",
        "unreadable_by_key",
        "unreadable_steps",
        "unreadable_steps_by_key",
        "taken_at",
        "outbox",
    }
    assert (data["unreadable"], data["unreadable_by_key"]) == (0, {})
    assert (data["unreadable_steps"], data["unreadable_steps_by_key"]) == (0, {})
    assert data["outbox"] == {
        "by_status": {"pending": 0, "sent": 0, "dead": 0},
        "due": 0,
        "oldest_pending_seconds": None,
    }


@pytest.fixture
def resumable(table):
    """Beside the table: resumable records, one completed, one failed, one live claim and
    two stale ones (the recovery job leaves those to their next attempt)."""
    resume = {"recovery_policy": "resume"}
    RecordFactory(**resume)
    RecordFactory(**resume, status=RecordStatus.FAILED)
    for lease in (timedelta(seconds=30), -timedelta(seconds=1), -timedelta(minutes=5)):
        RecordFactory(
            **resume,
            status=RecordStatus.IN_PROGRESS,
            response_status=None,
            lease_expires_at=table + lease,
        )
    return table


def test_collect_counts_resumable_records_by_status(resumable):
    snapshot = _stats.collect(now=resumable)
    assert snapshot.resumable == {"in_progress": 3, "completed": 1, "failed": 1}
    assert snapshot.resumable_stale == 2
    assert snapshot.by_status == {"in_progress": 5, "completed": 4, "failed": 2}


def test_command_prints_the_resumable_records(resumable):
    out = StringIO()
    call_command("idempotency_stats", stdout=out)
    assert labelled(out.getvalue(), "resumable") == {
        "in progress": "3",
        "completed": "1",
        "failed": "1",
        "stale leases": "2",
    }
    assert labelled(out.getvalue())["in progress"] == "5"
    out = StringIO()
    call_command("idempotency_stats", "--json", stdout=out)
    data = json.loads(out.getvalue())
    assert data["resumable"] == {"in_progress": 3, "completed": 1, "failed": 1}
    assert data["resumable_stale"] == 2


def test_the_resumable_records_have_an_index_of_their_own():
    # Only they are in it: a claim of another policy never writes to it.
    (index,) = [i for i in IdempotencyRecord._meta.indexes if i.name == "idempotency_resumable_idx"]
    assert index.condition == Q(recovery_policy="resume")
    # Not over status: the completion changes it, and would no longer be a HOT update.
    assert index.fields == ["recovery_policy"]


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's planner")
def test_the_resumable_count_reads_its_index_on_a_large_table():
    now = timezone.now()
    # 20,000 completed records, one in 5,000 under "resume", written by the server (building
    # them in Python took 15 s of the suite).
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO django_idempotency_record (account, operation, key, request_hash,"
            " fingerprint_version, status, recovery_policy, recovery_attempts, response_status,"
            " response_headers, response_body, created_at, completed_at, expires_at)"
            " SELECT 'user:bulk', 'bulk.create', 'bulk-' || n, repeat('0', 64), 'v1',"
            " 'completed', CASE WHEN n %% 5000 = 0 THEN 'resume' ELSE 'retry' END, 0, 201,"
            " '[]'::jsonb, ''::bytea, %s, %s, %s FROM generate_series(0, 19999) AS n",
            [now, now, now + timedelta(hours=1)],
        )
        cursor.execute("ANALYZE django_idempotency_record")
    assert IdempotencyRecord.objects.filter(recovery_policy="resume").count() == 4
    queryset = _stats.resumable_records().order_by().values_list("status").annotate(n=Count("*"))
    assert "idempotency_resumable_idx" in queryset.explain()
    assert _stats.resumable_by_status()["completed"] == 4


@pytest.mark.django_db(transaction=True, databases=["default", "provider"])
def test_command_database_option():
    # "provider" mirrors "default" in the tests: same tables, same rows.
    RecordFactory()
    out = StringIO()
    call_command("idempotency_stats", "--json", "--database", "provider", stdout=out)
    data = json.loads(out.getvalue())
    assert data["database"] == "provider"
    assert data["rows"] == 1


@pytest.mark.django_db(transaction=True, databases=["default", "provider"])
def test_command_follows_the_idempotency_database_setting(settings):
    settings.IDEMPOTENCY = {"DATABASE": "provider"}
    out = StringIO()
    call_command("idempotency_stats", "--json", stdout=out)
    assert json.loads(out.getvalue())["database"] == "provider"


def test_command_rejects_an_unknown_database():
    with pytest.raises(CommandError, match="Unknown database 'nope'"):
        call_command("idempotency_stats", "--database", "nope")


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(None, "-"), (4.25, "4.2 s"), (125, "2 min 5 s"), (3 * 3600 + 60, "3 h 1 min")],
)
def test_durations(seconds, shown):
    from django_idempotency.management.commands.idempotency_stats import _duration

    assert _duration(seconds) == shown


@pytest.mark.parametrize(
    ("size", "shown"), [(512, "512 B"), (2048, "2.0 KiB"), (5 * 1024**3, "5.0 GiB")]
)
def test_sizes(size, shown):
    from django_idempotency.management.commands.idempotency_stats import _size

    assert _size(size) == shown


def test_operations_are_distinct_sorted_and_bounded():
    for name in ("refunds.create", "charges.create", "charges.create", "b.op", "a.op"):
        RecordFactory(operation=name)
    assert _stats.operations() == ["a.op", "b.op", "charges.create", "refunds.create"]
    assert _stats.operations(limit=2) == ["a.op", "b.op"]


def test_operations_of_an_empty_table():
    assert _stats.operations() == []
