"""The outbox in the admin, in the metrics and in ``idempotency_stats``."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.db import transaction
from django.test import Client, override_settings
from django.utils import timezone

from django_idempotency import outbox
from django_idempotency.models import OutboxMessage, OutboxStatus
from tests.factories import UserFactory
from tests.helpers import logged_in, staff_with
from tests.testapp.outbox import BROKEN, UNDELIVERABLE

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

URL = "/admin/django_idempotency/outboxmessage/"
RECORD = override_settings(IDEMPOTENCY={"OUTBOX_SENDER": "tests.testapp.outbox.record"})


def enqueued(task: str, *args: Any) -> uuid.UUID:
    with transaction.atomic():
        return outbox.enqueue(task, *args)


@pytest.fixture
def messages() -> dict[str, uuid.UUID]:
    """One message of each status, two tasks."""
    with RECORD:
        ids = {
            "sent": enqueued("tests.a", 1),
            "dead": enqueued(UNDELIVERABLE, 2),
        }
        outbox.relay(once=True)
        ids["pending"] = enqueued("tests.b", 3)
    return ids


@pytest.fixture
def admin_client() -> Client:
    return logged_in(UserFactory(is_staff=True, is_superuser=True))


def listed(response: Any) -> set[str]:
    html = response.content.decode()
    return {str(i) for i in OutboxMessage.objects.values_list("pk", flat=True) if str(i) in html}


def test_changelist_lists_every_message(admin_client, messages):
    response = admin_client.get(URL)
    assert response.status_code == 200
    assert listed(response) == {str(i) for i in messages.values()}


@pytest.mark.parametrize("status", ["pending", "sent", "dead"])
def test_filter_by_status(admin_client, messages, status):
    response = admin_client.get(URL, {"status__exact": status})
    assert listed(response) == {str(messages[status])}


def test_filter_by_task(admin_client, messages):
    response = admin_client.get(URL, {"task": "tests.b"})
    assert listed(response) == {str(messages["pending"])}
    # Any task through the URL, the sent ones too.
    assert listed(admin_client.get(URL, {"task": "tests.a"})) == {str(messages["sent"])}


def test_task_choices_are_the_tasks_still_waiting(admin_client, messages):
    html = admin_client.get(URL).content.decode()
    assert "?task=tests.b" in html
    assert f"?task={UNDELIVERABLE}" in html
    assert "?task=tests.a" not in html  # sent only: not worth a choice on a big table


def test_search_by_exact_id(admin_client, messages):
    response = admin_client.get(URL, {"q": str(messages["dead"])})
    assert listed(response) == {str(messages["dead"])}


def test_detail_is_read_only_with_the_last_error(admin_client, messages):
    response = admin_client.get(f"{URL}{messages['dead']}/change/")
    html = response.content.decode()
    assert response.status_code == 200
    assert "Undeliverable: no such topic" in html
    assert 'name="_save"' not in html
    assert admin_client.get(f"{URL}add/").status_code == 403
    assert admin_client.post(f"{URL}{messages['dead']}/delete/").status_code == 403
    assert OutboxMessage.objects.count() == 3


def test_requeue_action_makes_only_the_dead_messages_pending(admin_client, messages):
    response = admin_client.post(
        URL,
        {"action": "requeue", "_selected_action": [str(i) for i in messages.values()]},
        follow=True,
    )
    assert "1 of 3 selected messages requeued." in response.content.decode()
    dead = OutboxMessage.objects.get(pk=messages["dead"])
    assert (dead.status, dead.attempts) == (OutboxStatus.PENDING, 0)
    assert dead.available_at <= timezone.now()
    assert OutboxMessage.objects.get(pk=messages["sent"]).status == OutboxStatus.SENT


def test_requeue_is_offered_to_an_operator(admin_client, messages):
    assert 'value="requeue"' in admin_client.get(URL).content.decode()


def test_requeue_needs_the_change_permission(messages):
    viewer = logged_in(staff_with("view_outboxmessage"))
    page = viewer.get(URL)
    assert page.status_code == 200
    assert 'value="requeue"' not in page.content.decode()
    viewer.post(URL, {"action": "requeue", "_selected_action": [str(messages["dead"])]})
    assert OutboxMessage.objects.get(pk=messages["dead"]).status == OutboxStatus.DEAD
    operator = logged_in(staff_with("view_outboxmessage", "change_outboxmessage"))
    operator.post(URL, {"action": "requeue", "_selected_action": [str(messages["dead"])]})
    assert OutboxMessage.objects.get(pk=messages["dead"]).status == OutboxStatus.PENDING


# -- idempotency_stats --------------------------------------------------------------------------


def test_stats_show_the_outbox(messages):
    OutboxMessage.objects.filter(pk=messages["pending"]).update(
        created_at=timezone.now() - timedelta(minutes=5)
    )
    out = StringIO()
    call_command("idempotency_stats", "--json", stdout=out)
    data = json.loads(out.getvalue())["outbox"]
    assert data["by_status"] == {"pending": 1, "sent": 1, "dead": 1}
    assert data["due"] == 1
    assert data["oldest_pending_seconds"] == pytest.approx(300, abs=5)
    out = StringIO()
    call_command("idempotency_stats", stdout=out)
    lines = {
        label.strip(): value.strip()
        for label, value in (line.rsplit("  ", 1) for line in out.getvalue().splitlines())
    }
    assert (lines["pending"], lines["sent"], lines["dead"], lines["due now"]) == (
        "1",
        "1",
        "1",
        "1",
    )
    assert lines["oldest pending"].startswith("5 min")


# -- metrics ------------------------------------------------------------------------------------


def test_metrics_count_the_relay_and_read_the_backlog():
    prometheus_client = pytest.importorskip("prometheus_client")
    from django_idempotency import metrics

    def counted(outcome: str) -> float:
        for family in metrics.outbox_relayed.collect():
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels == {"outcome": outcome}:
                    return float(sample.value)
        return 0.0

    registry = prometheus_client.REGISTRY
    before = {outcome: counted(outcome) for outcome in ("sent", "failed", "dead")}
    with RECORD:
        enqueued("tests.a"), enqueued(BROKEN), enqueued(UNDELIVERABLE)
        outbox.relay(once=True)
    after = {outcome: counted(outcome) - before[outcome] for outcome in before}
    assert after == {"sent": 1.0, "failed": 1.0, "dead": 1.0}
    assert registry.get_sample_value("django_idempotency_outbox_pending") == 1.0
    OutboxMessage.objects.filter(status=OutboxStatus.PENDING).update(
        created_at=timezone.now() - timedelta(seconds=90)
    )
    age = registry.get_sample_value("django_idempotency_outbox_oldest_pending_seconds")
    assert age == pytest.approx(90, abs=5)
    OutboxMessage.objects.all().delete()
    assert registry.get_sample_value("django_idempotency_outbox_oldest_pending_seconds") == 0.0
