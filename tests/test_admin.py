"""The records admin through Django's test client: list, search, filters, detail, actions."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from typing import Any, cast

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django.utils.html import escape

from django_idempotency import _display, states
from django_idempotency import admin as records_admin
from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.factories import RecordFactory, UserFactory
from tests.helpers import logged_in, staff_with

pytestmark = pytest.mark.django_db

URL = "/admin/django_idempotency/idempotencyrecord/"


def make(**kwargs: Any) -> IdempotencyRecord:
    return cast(IdempotencyRecord, RecordFactory(**kwargs))


def detail_url(record: IdempotencyRecord) -> str:
    return f"{URL}{record.pk}/change/"


@pytest.fixture
def admin_client() -> Client:
    return logged_in(UserFactory(is_staff=True, is_superuser=True))


def listed_keys(response) -> set[str]:
    """The keys in the changelist's rows (each row links its key to the detail page)."""
    html = response.content.decode()
    return set(
        re.findall(r'<th class="field-key_cell"><a href="[^"]*"><span [^>]*>([^<]*)</span>', html)
    )


def stale(**kwargs) -> IdempotencyRecord:
    now = timezone.now()
    return make(
        status=RecordStatus.IN_PROGRESS,
        lease_token="3f1b0e9c-9a57-4f2e-8a3c-0d7c1f0b2a11",
        lease_expires_at=now - timedelta(minutes=5),
        response_status=None,
        response_headers=[],
        response_body=None,
        created_at=now - timedelta(minutes=6),
        **kwargs,
    )


def live(**kwargs) -> IdempotencyRecord:
    now = timezone.now()
    return make(
        status=RecordStatus.IN_PROGRESS,
        lease_token="6c3f4d1e-2b8a-4c9d-9e0f-1a2b3c4d5e6f",
        lease_expires_at=now + timedelta(seconds=45),
        response_status=None,
        response_headers=[],
        response_body=None,
        **kwargs,
    )


def expired(**kwargs) -> IdempotencyRecord:
    now = timezone.now()
    return make(created_at=now - timedelta(hours=30), expires_at=now - timedelta(hours=6), **kwargs)


# -- the changelist ---------------------------------------------------------------------


def test_changelist_lists_records_with_their_columns(admin_client):
    done = make(key="done-1", account="user:7", operation="charges.create")
    running = live(key="running-1")
    old = stale(key="stale-1")
    response = admin_client.get(URL)
    assert response.status_code == 200
    assert listed_keys(response) == {done.key, running.key, old.key}
    html = response.content.decode()
    for column in ("key_cell", "account_cell", "operation_cell", "state", "age", "expiry"):
        assert f'column-{column}"' in html, column
    assert 'title="done-1">done-1<' in html  # a key: cut short to its column, whole in its title
    # Accounts and operations whole (a cut one could read as another), wrapped if need be.
    assert '<span class="idempotency-whole">user:7</span>' in html
    assert '<span class="idempotency-whole">charges.create</span>' in html
    assert "completed, 201" in html
    assert "in progress, live, " in html
    assert "in progress, stale for 5" in html
    assert "in 23" in html  # hours left of the default 24 h TTL
    # The full count is never taken on a big table: no "(N total)" link.
    assert "total)" not in html


def test_a_finished_record_without_a_response_shows_its_status_alone(admin_client):
    # A record the "fail" policy closed: it stores no response.
    make(key="failed-1", status=RecordStatus.FAILED, response_status=None)
    make(key="done-2")
    html = admin_client.get(URL).content.decode()
    assert sorted(re.findall(r'class="field-state">([^<]*)<', html)) == ["completed, 201", "failed"]


def test_only_indexed_columns_are_sortable(admin_client):
    make()
    html = admin_client.get(URL).content.decode()
    sortable = set(re.findall(r'class="sortable column-(\w+)', html))
    assert sortable == {"account_cell", "age", "expiry"}
    older = make(created_at=timezone.now() - timedelta(hours=1))
    newest_first = admin_client.get(URL).content.decode()
    age_column = list(records_admin.IdempotencyRecordAdmin.list_display).index("age") + 1
    oldest_first = admin_client.get(URL, {"o": f"-{age_column}"}).content.decode()
    assert newest_first.index(older.key) > oldest_first.index(older.key)


def test_changelist_never_loads_stored_bodies(admin_client):
    [make() for _ in range(3)]
    with CaptureQueriesContext(connection) as queries:
        assert admin_client.get(URL).status_code == 200
    listing = [q["sql"] for q in queries if "response_status" in q["sql"]]
    assert listing
    assert all("response_body" not in sql for sql in listing)


def test_changelist_runs_no_select_distinct_over_the_rows(admin_client):
    make(created_at=timezone.now() - timedelta(days=40))
    make()
    with CaptureQueriesContext(connection) as queries:
        assert admin_client.get(URL).status_code == 200
        assert admin_client.get(f"{URL}?status__exact=completed").status_code == 200
    distinct = [q["sql"] for q in queries if "DISTINCT" in q["sql"].upper()]
    if connection.vendor == "postgresql":
        # The operation choices hop through the index instead (stats.operations).
        assert distinct == []
    else:
        assert all("operation" in sql and "LIMIT" in sql for sql in distinct)
    assert not any("TRUNC" in q["sql"].upper() for q in queries)


# -- search -----------------------------------------------------------------------------


def test_search_by_exact_key(admin_client):
    wanted = make(key="Key-ABC")
    make(key="Key-ABCD")
    make(key="key-abc")
    response = admin_client.get(URL, {"q": "Key-ABC"})
    assert listed_keys(response) == {wanted.key}


def test_search_by_exact_account(admin_client):
    mine = [make(account="user:42") for _ in range(2)]
    make(account="user:420")
    response = admin_client.get(URL, {"q": " user:42 "})
    assert listed_keys(response) == {r.key for r in mine}


@pytest.mark.parametrize(
    "account",
    ["tenant:" + "x" * 300, "team: night shift ", "sha256:not-a-digest"],
    ids=["longer than a column", "ending in a space", "spelling a digest"],
)
def test_search_by_an_account_stored_by_its_hash(admin_client, account):
    """An account the records table cannot keep apart as it is (over 255 characters, ending
    in whitespace, beginning with ``sha256:``) is stored by its hash. Before, the search
    compared the term with the column as it is, and found none of its records."""
    from django_idempotency import run_once

    run_once(lambda: 1, account=account, operation="reports.build", key="hashed-1")
    make(key="other", account="user:42")
    assert listed_keys(admin_client.get(URL, {"q": account})) == {"hashed-1"}


def test_search_without_match_lists_nothing(admin_client):
    make(key="abc")
    assert listed_keys(admin_client.get(URL, {"q": "ab"})) == set()


# -- filters ----------------------------------------------------------------------------


@pytest.mark.parametrize("status", RecordStatus.values)
def test_filter_by_status(admin_client, status):
    records = {
        RecordStatus.COMPLETED: make(),
        RecordStatus.FAILED: make(status=RecordStatus.FAILED, response_status=500),
        RecordStatus.IN_PROGRESS: live(),
    }
    response = admin_client.get(URL, {"status__exact": status})
    assert listed_keys(response) == {records[status].key}


def test_filter_by_operation_offers_each_operation_once(admin_client):
    [make(operation="charges.create") for _ in range(2)]
    refund = make(operation="refunds.create")
    response = admin_client.get(URL)
    html = response.content.decode()
    assert html.count("?operation=charges.create") == 1
    assert html.count("?operation=refunds.create") == 1
    assert listed_keys(admin_client.get(URL, {"operation": "refunds.create"})) == {refund.key}


def test_operation_choices_are_bounded_and_keep_the_chosen_one(admin_client, monkeypatch):
    monkeypatch.setattr(records_admin.OperationFilter, "max_choices", 2)
    for name in ("a.op", "b.op", "c.op", "d.op"):
        make(operation=name)
    html = admin_client.get(URL).content.decode()
    assert "?operation=a.op" in html
    assert "?operation=b.op" in html
    assert "?operation=c.op" not in html
    response = admin_client.get(URL, {"operation": "d.op"})
    assert "?operation=d.op" in response.content.decode()
    assert len(listed_keys(response)) == 1


def test_filter_expired(admin_client):
    gone = expired()
    fresh = make()
    assert listed_keys(admin_client.get(URL, {"expired": "yes"})) == {gone.key}
    assert listed_keys(admin_client.get(URL, {"expired": "no"})) == {fresh.key}


def test_expiry_column_says_how_long_ago_a_record_expired(admin_client):
    expired()
    assert "expired 6" in admin_client.get(URL).content.decode()


def test_expired_claim_with_a_live_lease_is_not_listed_as_expired(admin_client):
    # Same rule as the purge: its owner may still complete it.
    held = live(expires_at=timezone.now() - timedelta(seconds=1))
    assert listed_keys(admin_client.get(URL, {"expired": "yes"})) == set()
    assert listed_keys(admin_client.get(URL, {"expired": "no"})) == {held.key}


def test_filter_expired_lists_by_expiry_most_recent_first(admin_client):
    now = timezone.now()
    older = make(expires_at=now - timedelta(hours=2))
    newer = make(expires_at=now - timedelta(hours=1))
    html = admin_client.get(URL, {"expired": "yes"}).content.decode()
    assert html.index(f">{newer.key}<") < html.index(f">{older.key}<")


def test_filter_by_lease(admin_client):
    running = live()
    old = stale()
    make()
    assert listed_keys(admin_client.get(URL, {"lease": "live"})) == {running.key}
    assert listed_keys(admin_client.get(URL, {"lease": "stale"})) == {old.key}


def test_filters_combine(admin_client):
    wanted = stale(operation="refunds.create")
    stale(operation="charges.create")
    live(operation="refunds.create")
    response = admin_client.get(URL, {"lease": "stale", "operation": "refunds.create"})
    assert listed_keys(response) == {wanted.key}


def test_date_hierarchy_drills_down_from_the_table_range(admin_client):
    now = timezone.now()
    last_year = make(created_at=now - timedelta(days=400))
    recent = make(created_at=now)
    html = admin_client.get(URL).content.decode()
    assert f"created_at__year={now.year}" in html
    assert f"created_at__year={(now - timedelta(days=400)).year}" in html
    response = admin_client.get(URL, {"created_at__year": now.year})
    assert f"created_at__month={now.month}" in response.content.decode()
    assert recent.key in listed_keys(response)
    assert last_year.key not in listed_keys(response)
    by_day = {"created_at__year": now.year, "created_at__month": now.month}
    response = admin_client.get(URL, by_day)
    assert f"created_at__day={now.day}" in response.content.decode()
    response = admin_client.get(URL, {**by_day, "created_at__day": now.day})
    assert listed_keys(response) == {recent.key}


def test_date_hierarchy_hidden_on_an_empty_table(admin_client):
    assert "toplinks" not in admin_client.get(URL).content.decode()


# -- the detail page --------------------------------------------------------------------


def test_detail_shows_a_json_body_indented(admin_client):
    record = make(response_body=b'{"id":7,"note":"<b>hi</b>","items":[1,2]}')
    response = admin_client.get(detail_url(record))
    assert response.status_code == 200
    html = response.content.decode()
    pretty = json.dumps(json.loads(record.response_body), indent=2)
    assert escape(pretty) in html
    assert "<b>hi</b>" not in html
    assert "Content-Type: application/json" in html


def test_detail_shows_a_binary_body_as_its_size(admin_client):
    record = make(
        response_body=bytes(range(256)) * 4,
        response_headers=[["Content-Type", "application/octet-stream"]],
    )
    html = admin_client.get(detail_url(record)).content.decode()
    assert "1024 bytes of binary data" in html


def test_detail_escapes_a_text_body(admin_client):
    record = make(
        response_body=b"<script>alert(1)</script>",
        response_headers=[["Content-Type", "text/html"]],
    )
    html = admin_client.get(detail_url(record)).content.decode()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<script>alert(1)" not in html


def test_detail_shows_json_text_as_text_when_not_served_as_json(admin_client):
    record = make(response_body=b'{"a":1}', response_headers=[["Content-Type", "text/plain"]])
    html = admin_client.get(detail_url(record)).content.decode()
    assert escape('{"a":1}') in html


def test_detail_cuts_a_large_body(admin_client):
    body = b"x" * (_display.BODY_PREVIEW_BYTES + 10)
    record = make(response_body=body, response_headers=[["Content-Type", "text/plain"]])
    html = admin_client.get(detail_url(record)).content.decode()
    assert f"first {_display.BODY_PREVIEW_BYTES} of {len(body)} bytes shown" in html
    assert "x" * (_display.BODY_PREVIEW_BYTES + 1) not in html


def test_detail_of_an_in_progress_record(admin_client):
    record = live()
    html = admin_client.get(detail_url(record)).content.decode()
    assert "no response stored" in html
    assert "live, " in html


def test_detail_is_read_only(admin_client):
    record = make()
    html = admin_client.get(detail_url(record)).content.decode()
    assert 'name="_save"' not in html
    assert "deletelink" not in html
    response = admin_client.post(detail_url(record), {"status": RecordStatus.FAILED})
    assert response.status_code == 403
    record.refresh_from_db()
    assert record.status == states.COMPLETED


def test_no_add_and_no_delete(admin_client):
    record = make()
    assert admin_client.get(f"{URL}add/").status_code == 403
    assert admin_client.post(f"{URL}{record.pk}/delete/", {"post": "yes"}).status_code == 403
    assert IdempotencyRecord.objects.filter(pk=record.pk).exists()
    assert 'href="/admin/django_idempotency/idempotencyrecord/add/"' not in (
        admin_client.get(URL).content.decode()
    )


def test_render_body_handles_a_cut_inside_a_character():
    body = b"a" * (_display.BODY_PREVIEW_BYTES - 1) + "é".encode() + b"tail"
    html = str(_display.render_body(body, [["Content-Type", "text/plain"]]))
    assert "bytes of binary data" not in html
    assert "bytes shown" in html


def test_render_body_of_an_empty_body():
    assert "empty body" in str(_display.render_body(b"", []))


# -- actions ----------------------------------------------------------------------------


def run_action(client: Client, action: str, *records: IdempotencyRecord, **params):
    data = {"action": action, "_selected_action": [r.pk for r in records], **params}
    return client.post(URL, data, follow=True)


def messages_of(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def test_release_stale_claims(admin_client):
    old = stale()
    running = live()
    done = make()
    response = run_action(admin_client, "release_stale_claims", old, running, done)
    assert response.status_code == 200
    assert not IdempotencyRecord.objects.filter(pk=old.pk).exists()
    assert IdempotencyRecord.objects.filter(pk__in=[running.pk, done.pk]).count() == 2
    (message,) = messages_of(response)
    assert message.startswith("1 of 3 selected records released.")
    assert "left alone" in message


def test_mark_as_failed(admin_client):
    old = stale()
    running = live()
    response = run_action(admin_client, "mark_as_failed", old, running)
    old.refresh_from_db()
    running.refresh_from_db()
    assert old.status == states.FAILED
    assert json.loads(old.response_body)["code"] == "idempotency_outcome_unknown"
    assert running.status == states.IN_PROGRESS
    assert messages_of(response)[0].startswith("1 of 2 selected records marked as failed.")


def test_action_that_changes_nothing_warns(admin_client):
    done = make()
    response = run_action(admin_client, "mark_as_failed", done)
    (message,) = response.context["messages"]
    assert message.level_tag == "warning"
    assert str(message).startswith("0 of 1 selected records marked as failed.")


def test_purge_expired_records_purges_all_expired_whatever_the_selection(admin_client):
    gone = [expired(), expired()]
    kept = make()
    response = run_action(admin_client, "purge_expired_records", kept)
    assert list(IdempotencyRecord.objects.values_list("pk", flat=True)) == [kept.pk]
    assert all(not IdempotencyRecord.objects.filter(pk=r.pk).exists() for r in gone)
    assert messages_of(response) == ["Purged 2 expired records."]


def test_purge_is_bounded_per_click(admin_client, settings, monkeypatch):
    settings.IDEMPOTENCY = {"PURGE_BATCH_SIZE": 2}
    monkeypatch.setattr(records_admin.IdempotencyRecordAdmin, "purge_max_batches", 2)
    for _ in range(5):
        expired()
    kept = make()
    response = run_action(admin_client, "purge_expired_records", kept)
    assert IdempotencyRecord.objects.count() == 2
    (message,) = messages_of(response)
    assert message.startswith("Purged 4 expired records. More may remain")


# -- permissions ------------------------------------------------------------------------


def test_anonymous_is_sent_to_the_login_page():
    make()
    response = Client().get(URL)
    assert response.status_code == 302
    assert "/admin/login/" in response["Location"]


def test_non_staff_is_refused_even_with_the_permissions():
    user = UserFactory(is_staff=False)
    user.user_permissions.add(*Permission.objects.filter(codename__endswith="idempotencyrecord"))
    record = make()
    client = logged_in(user)
    for url in (URL, detail_url(record)):
        response = client.get(url)
        assert response.status_code == 302
        assert "/admin/login/" in response["Location"]


def test_staff_without_the_view_permission_is_refused():
    client = logged_in(UserFactory(is_staff=True))
    record = make()
    assert client.get(URL).status_code == 403
    assert client.get(detail_url(record)).status_code == 403
    response = client.post(
        URL, {"action": "purge_expired_records", "_selected_action": [record.pk]}
    )
    assert response.status_code == 403


def test_staff_with_the_view_permission_sees_but_cannot_act():
    client = logged_in(staff_with("view_idempotencyrecord"))
    old = stale()
    gone = expired()
    response = client.get(URL)
    assert response.status_code == 200
    assert 'name="action"' not in response.content.decode()
    assert client.get(detail_url(old)).status_code == 200
    for action in ("release_stale_claims", "mark_as_failed", "purge_expired_records"):
        run_action(client, action, old, gone)
    assert IdempotencyRecord.objects.filter(pk__in=[old.pk, gone.pk]).count() == 2
    old.refresh_from_db()
    assert old.status == states.IN_PROGRESS


def test_change_permission_allows_release_and_mark_failed_but_not_purge():
    client = logged_in(staff_with("view_idempotencyrecord", "change_idempotencyrecord"))
    html = client.get(URL).content.decode()
    assert 'value="release_stale_claims"' in html
    assert 'value="mark_as_failed"' in html
    assert 'value="purge_expired_records"' not in html
    old = stale()
    run_action(client, "release_stale_claims", old)
    assert not IdempotencyRecord.objects.filter(pk=old.pk).exists()


def test_delete_permission_allows_purge_only():
    client = logged_in(staff_with("view_idempotencyrecord", "delete_idempotencyrecord"))
    html = client.get(URL).content.decode()
    assert 'value="purge_expired_records"' in html
    assert 'value="release_stale_claims"' not in html
    expired()
    kept = make()
    run_action(client, "purge_expired_records", kept)
    assert IdempotencyRecord.objects.count() == 1
