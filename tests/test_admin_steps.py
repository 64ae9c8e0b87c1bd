"""The admin and resumable records: the record page lists the recorded steps (results only
under ``view_response_body``, bounded and escaped whatever they hold), *Release stale
claims* leaves resumable records alone, *Mark as failed* closes them, and the changelist,
the purge and ``idempotency_stats`` work with steps present."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO
from typing import Any, cast

import pytest
from django.contrib.auth.models import Permission
from django.core.management import call_command
from django.test import Client
from django.utils import timezone
from django.utils.html import escape

from django_idempotency import _display, run_once, step
from django_idempotency.exceptions import SimulatedCrash
from django_idempotency.maintenance import purge_expired
from django_idempotency.models import IdempotencyRecord, IdempotencyStep, RecordStatus
from tests.factories import RecordFactory, UserFactory
from tests.testapp.models import Charge

URL = "/admin/django_idempotency/idempotencyrecord/"
SECRET = "Ada Lovelace, 12 Marylebone Road"


def client_of(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


def superuser() -> Client:
    return client_of(UserFactory(is_staff=True, is_superuser=True))


def staff(*codenames: str) -> Client:
    user = UserFactory(is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(
            content_type__app_label="django_idempotency", codename__in=codenames
        )
    )
    return client_of(user)


def page(client: Client, record: IdempotencyRecord) -> str:
    response = client.get(f"{URL}{record.pk}/change/")
    assert response.status_code == 200
    return str(response.content.decode())


def resumable(**kwargs: Any) -> IdempotencyRecord:
    return cast(IdempotencyRecord, RecordFactory(recovery_policy="resume", **kwargs))


def record_step(record: IdempotencyRecord, name: str, result: str, seconds: float = 0) -> None:
    IdempotencyStep.objects.create(
        record=record,
        name=name,
        result=result,
        created_at=timezone.now() + timedelta(seconds=seconds),
    )


# -- the record page ----------------------------------------------------------------------


@pytest.mark.django_db
def test_the_page_lists_the_steps_in_order_with_their_results_escaped():
    record = resumable()
    record_step(record, "charge", json.dumps({"id": "ch_1", "note": "<b>paid</b>"}), 1)
    record_step(record, "ride", json.dumps({"id": 7, "customer": SECRET}), 0)
    record_step(record, "<script>receipt</script>", "true", 2)
    html = page(superuser(), record)
    assert "Recorded steps" in html
    ride, charge, receipt = (html.index(n) for n in ("ride", "ch_1", "&lt;script&gt;receipt"))
    assert ride < charge < receipt
    assert escape(json.dumps({"id": "ch_1", "note": "<b>paid</b>"}, indent=2)) in html
    assert "<b>paid</b>" not in html
    assert "<script>receipt" not in html
    assert SECRET in html


@pytest.mark.django_db
@pytest.mark.parametrize("who", ["superuser", "permitted staff"])
def test_users_with_the_permission_see_the_results(who):
    record = resumable()
    record_step(record, "ride", json.dumps({"customer": SECRET}))
    client = (
        superuser() if who == "superuser" else staff("view_idempotencyrecord", "view_response_body")
    )
    html = page(client, record)
    assert SECRET in html
    assert "view_response_body permission" not in html


@pytest.mark.django_db
def test_staff_without_the_permission_see_names_times_and_sizes_only():
    record = resumable()
    result = json.dumps({"customer": SECRET, "city": "Zürich"})
    record_step(record, "ride", result)
    html = page(staff("view_idempotencyrecord"), record)
    assert SECRET not in html
    assert "Zürich" not in html
    assert ">ride<" in html
    assert f"{len(result.encode())} bytes" in html  # bytes, not characters
    assert "Step results are shown to users with the view_response_body permission." in html
    (created,) = IdempotencyStep.objects.values_list("created_at", flat=True)
    assert str(created.year) in html


@pytest.mark.django_db
def test_a_long_result_is_cut_in_the_query_and_on_the_page():
    record = resumable()
    long = json.dumps(["x" * 100] * 1000)
    record_step(record, "big", long)
    html = page(superuser(), record)
    shown = _display.STEP_PREVIEW_CHARS
    assert f"first {shown} characters of {len(long.encode())} bytes shown" in html
    assert long[: shown + 1] not in html


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("result", "shown"),
    [
        pytest.param("[" * 1500 + "]" * 1500, "[" * 1500, id="nested-past-the-recursion-limit"),
        pytest.param('{"a": "\\ud800"}', escape('"\\ud800"'), id="lone-surrogate"),
        pytest.param("[" * 60 + "1" + "]" * 60, "[" * 60, id="deep-enough-to-grow-when-indented"),
    ],
)
def test_any_result_renders(result, shown):
    record = resumable()
    record_step(record, "odd", result)
    assert shown in page(superuser(), record)


@pytest.mark.django_db
def test_many_steps_are_bounded():
    record = resumable()
    IdempotencyStep.objects.bulk_create(
        IdempotencyStep(record=record, name=f"ship:{n}", result=str(n))
        for n in range(_display.STEPS_SHOWN + 20)
    )
    html = page(superuser(), record)
    assert f"The first {_display.STEPS_SHOWN} of {_display.STEPS_SHOWN + 20} steps" in html
    assert html.count('<pre class="idempotency-step">') == _display.STEPS_SHOWN


@pytest.mark.django_db
def test_a_resumable_record_without_steps_says_so_and_other_records_show_no_steps():
    assert "no step recorded" in page(superuser(), resumable(status=RecordStatus.IN_PROGRESS))
    assert "Recorded steps" not in page(superuser(), RecordFactory())


@pytest.mark.django_db
def test_a_response_body_nested_past_the_recursion_limit_renders():
    # Deeper than any Python's JSON decoder goes (3.13 reads a few thousand levels).
    body = b"[" * 50000 + b"]" * 50000
    record = RecordFactory(response_body=body)
    assert "[" * 5000 in page(superuser(), record)


@pytest.mark.django_db
def test_a_response_body_with_a_lone_surrogate_escape_renders():
    record = RecordFactory(response_body=b'{"name": "\\ud800"}')
    assert escape('"\\ud800"') in page(superuser(), record)


# -- the actions, with real crashed operations ------------------------------------------------


def write(label: str) -> int:
    return Charge.objects.create(account=label, amount=1, currency="EUR").pk


def crashed(key: str) -> IdempotencyRecord:
    """A resumable operation that recorded one step, then died; its lease ran out."""

    def body() -> None:
        step("ride", write, key)
        raise SimulatedCrash

    with pytest.raises(SimulatedCrash):
        run_once(body, account="a", operation="rides.book", key=key, recovery="resume")
    IdempotencyRecord.objects.filter(key=key).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    return IdempotencyRecord.objects.get(key=key)


def act(client: Client, action: str, *records: IdempotencyRecord) -> list[Any]:
    data = {"action": action, "_selected_action": [r.pk for r in records]}
    response = client.post(URL, data, follow=True)
    assert response.status_code == 200
    return list(response.context["messages"])


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_release_leaves_a_resumable_record_and_its_steps_and_says_why():
    record = crashed("k-1")
    other = RecordFactory(
        status=RecordStatus.IN_PROGRESS,
        response_status=None,
        lease_token="00000000-0000-0000-0000-000000000001",
        lease_expires_at=timezone.now() - timedelta(seconds=1),
    )
    first, second = act(superuser(), "release_stale_claims", record, other)
    assert str(first) == "1 of 2 selected records released."
    assert second.level_tag == "warning"
    assert str(second).startswith("1 selected record is resumable and was not released")
    assert not IdempotencyRecord.objects.filter(pk=other.pk).exists()
    assert IdempotencyRecord.objects.get(pk=record.pk).status == RecordStatus.IN_PROGRESS
    assert IdempotencyStep.objects.filter(record=record).count() == 1
    # Its next attempt resumes it: the recorded step is not run again.
    assert (
        run_once(
            lambda: step("ride", write, "k-1"),
            account="a",
            operation="rides.book",
            key="k-1",
            recovery="resume",
        )
        == Charge.objects.get(account="k-1").pk
    )
    assert Charge.objects.filter(account="k-1").count() == 1


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_mark_as_failed_closes_a_resumable_record_and_keeps_its_steps():
    record = crashed("k-1")
    (message,) = act(superuser(), "mark_as_failed", record)
    assert str(message) == "1 of 1 selected records marked as failed."
    record.refresh_from_db()
    assert record.status == RecordStatus.FAILED
    assert IdempotencyStep.objects.filter(record=record).count() == 1
    assert ">ride<" in page(superuser(), record)


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_the_changelist_stats_and_purge_work_with_steps_present():
    records = [crashed("k-1"), crashed("k-2")]
    IdempotencyRecord.objects.filter(pk=records[0].pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    response = superuser().get(URL)
    assert response.status_code == 200
    assert "k-1" in response.content.decode()
    out = StringIO()
    call_command("idempotency_stats", stdout=out)
    assert "resumable" in out.getvalue()
    assert purge_expired().deleted == 1
    assert list(IdempotencyStep.objects.values_list("record__key", flat=True)) == ["k-2"]
    assert superuser().get(URL).status_code == 200


def test_step_times_show_milliseconds_with_and_without_time_zones():
    from datetime import datetime, timezone

    moment = datetime(2026, 1, 2, 3, 4, 5, 678901)
    assert _display._when(moment) == "2026-01-02 03:04:05.678"
    assert _display._when(moment.replace(tzinfo=timezone.utc)).startswith("2026-01-02 03:04:05.678")
