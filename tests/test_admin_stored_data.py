"""The admin renders every record and every outbox message, whatever they hold.

Bodies nested 30,000 levels deep, a megabyte of JSON, JSON whose indented form is huge,
invalid JSON, bytes that are not UTF-8, NUL bytes, lone surrogates; headers that are not a
list of pairs; outbox arguments that Python cannot decode. Through the Django test client as
a superuser, on every database: each page answers 200, shows what it can with a note for
what it cannot, stays bounded in size, and changes nothing that is stored.
"""

from __future__ import annotations

import json
import uuid
from io import StringIO
from typing import Any, cast

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.db.models import TextField
from django.db.models.functions import Cast
from django.test import Client

from django_idempotency import _display, outbox
from django_idempotency.models import IdempotencyRecord, OutboxMessage
from tests.factories import RecordFactory, UserFactory, store_raw_json
from tests.helpers import logged_in, staff_with

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

RECORDS = "/admin/django_idempotency/idempotencyrecord/"
MESSAGES = "/admin/django_idempotency/outboxmessage/"
JSON = [["Content-Type", "application/json"]]
# The page around a shown body, and the body shown: escaping may make each character of it
# six (&quot;), and notes are short.
PAGE_LIMIT = 64 * 1024 + 6 * _display.PREVIEW_CHARS


@pytest.fixture
def admin_client() -> Client:
    return logged_in(UserFactory(is_staff=True, is_superuser=True))


def deep_array(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def stored_records() -> list[tuple[Any, ...]]:
    """Every record as stored, JSON as its text: compared before and after the pages."""
    rows = IdempotencyRecord.objects.order_by("pk").values_list(
        "pk", "status", "response_status", Cast("response_headers", TextField()), "response_body"
    )
    return [(*row[:4], bytes(row[4]) if row[4] is not None else None) for row in rows]


def stored_messages() -> list[tuple[Any, ...]]:
    """Every outbox message as stored, JSON as its text."""
    return list(
        OutboxMessage.objects.order_by("pk").values_list(
            "pk",
            "status",
            "attempts",
            "available_at",
            Cast("args", TextField()),
            Cast("kwargs", TextField()),
        )
    )


def pages(client: Client, url: str, pk: Any) -> tuple[str, str]:
    """The changelist and the detail page, both answering 200 within the size bound."""
    listing = client.get(url)
    detail = client.get(f"{url}{pk}/change/")
    assert (listing.status_code, detail.status_code) == (200, 200)
    assert len(detail.content) < PAGE_LIMIT, len(detail.content)
    return listing.content.decode(), detail.content.decode()


# -- records: every body -----------------------------------------------------------------------

BIG_JSON = json.dumps([{"n": n, "pad": "x" * 20} for n in range(40_000)]).encode()
WIDE_JSON = b"[" + b",".join([b"[]"] * 20_000) + b"]"  # indented, more than PREVIEW_CHARS

BODIES: dict[str, tuple[bytes, list[list[str]], str]] = {
    "json-30000-levels-deep": (deep_array(30_000), JSON, "not indented: nested too deeply"),
    "json-100-levels-deep": (deep_array(100), JSON, "\n" + " " * 198 + "[]\n"),
    "json-of-a-megabyte": (BIG_JSON, JSON, f"first {_display.BODY_PREVIEW_BYTES} of"),
    "json-whose-indented-form-is-huge": (WIDE_JSON, JSON, "characters shown"),
    "invalid-json-served-as-json": (b'{"a": 1', JSON, "not indented: "),
    "json-with-a-lone-surrogate": (b'{"a": "\\ud800"}', JSON, "\\ud800"),
    "json-with-an-escaped-nul": (b'{"a": "\\u0000"}', JSON, "\\u0000"),
    "a-5000-digit-number": (b"9" * 5000, JSON, "not indented: "),
    "binary": (bytes(range(256)), [["Content-Type", "image/png"]], "256 bytes of binary data"),
    "not-utf-8-served-as-json": (b'{"a": "\xff\xfe"}', JSON, "bytes of binary data"),
    "nul-bytes-in-text": (b"a\x00b", [["Content-Type", "text/plain"]], "bytes of binary data"),
    "empty": (b"", JSON, "empty body"),
}


@pytest.mark.parametrize(("body", "headers", "shown"), list(BODIES.values()), ids=list(BODIES))
def test_every_stored_body_renders_bounded_and_unchanged(admin_client, body, headers, shown):
    record = cast(IdempotencyRecord, RecordFactory(response_body=body, response_headers=headers))
    before = stored_records()
    listing, detail = pages(admin_client, RECORDS, record.pk)
    assert record.key in listing
    assert shown in detail
    assert stored_records() == before


def test_a_record_without_a_response_renders(admin_client):
    record = cast(IdempotencyRecord, RecordFactory(response_body=None, response_headers=[]))
    _listing, detail = pages(admin_client, RECORDS, record.pk)
    assert "no response stored" in detail


# -- records: broken headers -------------------------------------------------------------------

BROKEN_HEADERS: dict[str, Any] = {
    "a-dict": {"Content-Type": "application/json"},
    "a-string": "Content-Type: application/json",
    "a-number": 42,
    "json-null": None,
    "triples": [["Content-Type", "application/json", "extra"]],
    "not-strings": [[1, None], ["Content-Type", ["application/json"]]],
    "flat-list": ["Content-Type", "application/json"],
}


def python_decodes(text: str) -> bool:
    """Whether this Python's JSON decoder reads ``text`` (its depth limit varies)."""
    try:
        json.loads(text)
    except RecursionError:
        return False
    return True


@pytest.mark.parametrize("headers", list(BROKEN_HEADERS.values()), ids=list(BROKEN_HEADERS))
def test_headers_that_are_not_a_list_of_pairs_render_as_stored(admin_client, headers):
    record = cast(IdempotencyRecord, RecordFactory(response_body=b'{"ok": true}'))
    store_raw_json(IdempotencyRecord, record.pk, "response_headers", json.dumps(headers))
    before = stored_records()
    _listing, detail = pages(admin_client, RECORDS, record.pk)
    assert "not a list of [name, value] pairs of strings" in detail
    if isinstance(headers, str):
        # A string is what sealed headers look like: one the package never wrote cannot be
        # opened, and the claim treats the record as expired (tests/test_crypto.py).
        assert "Cannot be read" in detail
    else:
        # The body is still shown, indented (no usable Content-Type says otherwise).
        assert "&quot;ok&quot;: true" in detail
    assert stored_records() == before


def test_headers_python_cannot_decode_render_as_stored(admin_client):
    if connection.vendor == "mysql":
        pytest.skip("MariaDB's JSON columns refuse more than 31 levels of nesting")
    record = cast(IdempotencyRecord, RecordFactory(response_body=b'{"ok": true}'))
    text = "[" * 1500 + "]" * 1500
    if python_decodes(text):
        pytest.skip("this Python's JSON decoder reads 1500 levels (3.13 and later)")
    store_raw_json(IdempotencyRecord, record.pk, "response_headers", text)
    before = stored_records()
    _listing, detail = pages(admin_client, RECORDS, record.pk)
    assert "nested too deeply to be decoded" in detail
    assert stored_records() == before


def test_stats_read_a_table_of_broken_records():
    for body, headers, _shown in BODIES.values():
        RecordFactory(response_body=body, response_headers=headers)
    record = cast(IdempotencyRecord, RecordFactory())
    store_raw_json(IdempotencyRecord, record.pk, "response_headers", '"not a list"')
    out = StringIO()
    call_command("idempotency_stats", "--json", stdout=out)
    assert json.loads(out.getvalue())["rows"] == len(BODIES) + 1


# -- outbox messages ----------------------------------------------------------------------------

ARGUMENTS: dict[str, tuple[str, str, str]] = {
    "args-1500-levels-deep": ("args", "[" * 1500 + "]" * 1500, "nested too deeply to be decoded"),
    "args-a-5000-digit-number": ("args", "[" + "9" * 5000 + "]", "Stored as shown: "),
    "args-an-object": ("args", '{"a": [1, 2]}', "&quot;a&quot;: ["),
    "kwargs-a-string": ("kwargs", '"just text"', "&quot;just text&quot;"),
    "kwargs-a-lone-surrogate": ("kwargs", '{"a": "\\ud800"}', "\\ud800"),
    "args-of-a-megabyte": ("args", json.dumps(["x" * 100] * 10_000), "characters shown"),
}


@pytest.mark.parametrize(("column", "text", "shown"), list(ARGUMENTS.values()), ids=list(ARGUMENTS))
def test_every_stored_outbox_message_renders(admin_client, column, text, shown):
    if "nested too deeply to be decoded" in shown and python_decodes(text):
        pytest.skip("this Python's JSON decoder reads 1500 levels (3.13 and later)")
    if connection.vendor == "mysql" and text.startswith("[" * 32):
        pytest.skip("MariaDB's JSON columns refuse more than 31 levels of nesting")
    if connection.vendor == "mysql" and "\\ud800" in text:
        pytest.skip("MariaDB's JSON columns refuse a lone surrogate")
    if connection.vendor == "postgresql" and "\\ud800" in text:
        pytest.skip("jsonb refuses a lone surrogate")
    with transaction.atomic():
        message_id = outbox.enqueue("tests.a", 1)
    store_raw_json(OutboxMessage, message_id, column, text)
    before = stored_messages()
    listing, detail = pages(admin_client, MESSAGES, message_id)
    assert str(message_id) in listing
    assert shown in detail
    assert stored_messages() == before


def test_an_unknown_message_id_is_not_found(admin_client):
    response = admin_client.get(f"{MESSAGES}{uuid.uuid4()}/change/")
    assert response.status_code == 302  # the admin's "does not exist" redirect


@pytest.mark.parametrize("may_see", [False, True], ids=["view-only", "view_response_body"])
def test_an_outbox_messages_arguments_are_shown_only_with_view_response_body(may_see):
    """Task arguments are the customers' data as much as stored bodies are: a staff user who
    may view the outbox but not ``view_response_body`` sees their size, not their values."""
    codenames = ["view_outboxmessage", *(["view_response_body"] if may_see else [])]
    client = logged_in(staff_with(*codenames))
    with transaction.atomic():
        message_id = outbox.enqueue("tests.a", "ada@example.com", note="card ending 4242")
    before = stored_messages()
    listing, detail = pages(client, MESSAGES, message_id)
    assert str(message_id) in listing
    assert ("ada@example.com" in detail) is may_see
    assert ("card ending 4242" in detail) is may_see
    assert ("view_response_body permission" in detail) is not may_see
    if not may_see:
        stored = _display.stored_columns(OutboxMessage.objects.get(pk=message_id), "args", "kwargs")
        assert f"{sum(len(text.encode()) for text in stored.values())} bytes" in detail
    assert stored_messages() == before
