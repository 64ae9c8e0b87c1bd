"""Keys from other places than the ``Idempotency-Key`` header: ``django_idempotency.sources``,
``@idempotent(key=...)`` and the mixin's ``idempotency_key`` / ``get_idempotency_key``.

Every test counts the view's effect (``Charge`` rows of the view) and the records."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.http import JsonResponse, QueryDict
from django.test import Client, RequestFactory

from django_idempotency import fingerprint, sources
from django_idempotency.decorators import idempotent
from django_idempotency.keys import InvalidKey
from django_idempotency.models import IdempotencyRecord
from tests.helpers import NO_TEXT_CHARSETS, needs_drf, new_key
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.testapp.source_urls")]


def runs(view: str) -> int:
    return Charge.objects.filter(account=view).count()


def problem(response: Any, code: str, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/problem+json"
    body: dict[str, Any] = json.loads(response.content)
    assert body["code"] == code
    assert body["status"] == status
    return body


def post_json(path: str, payload: Any, client: Client | None = None, **extra: Any) -> Any:
    body = payload if isinstance(payload, (bytes, str)) else json.dumps(payload)
    return (client or Client()).post(path, body, content_type="application/json", **extra)


def event(event_id: Any) -> dict[str, Any]:
    return {"type": "charge.succeeded", "data": {"object": {"id": event_id, "amount": 5}}}


# -- the sources on their own -----------------------------------------------------------


def json_request(body: bytes | str, content_type: str = "application/json") -> Any:
    return RequestFactory().post("/", body, content_type=content_type)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"id": "evt_1"}, "evt_1"),
        ({"id": 123456789012345678901234567890}, "123456789012345678901234567890"),
        ({"id": -7}, "-7"),
        ({"other": "x"}, None),
        ({"id": {"nested": 1}}, InvalidKey),
        ({"id": True}, InvalidKey),
        ({"id": 1.5}, InvalidKey),
        ({"id": None}, InvalidKey),
        ({"id": ["a"]}, InvalidKey),
        (["id"], None),
        ("id", None),
    ],
)
def test_json_source_values(body: Any, expected: Any) -> None:
    source = sources.json("id")
    request = json_request(json.dumps(body))
    if expected is InvalidKey:
        with pytest.raises(InvalidKey):
            source(request)
    else:
        assert source(request) == expected


def test_json_source_dotted_path() -> None:
    source = sources.json("data.object.id")
    assert source(json_request(json.dumps(event("evt_9")))) == "evt_9"
    assert source(json_request(json.dumps({"data": "flat"}))) is None
    assert source(json_request(json.dumps({"data": {"object": {}}}))) is None


@pytest.mark.parametrize("body", [b"", b"not json", b'{"id": ', b"\xff\xfe{", b"[" * 100_000])
def test_json_source_body_not_json(body: bytes) -> None:
    with pytest.raises(InvalidKey, match="not JSON"):
        sources.json("id")(json_request(body))


def test_json_body_parsed_once_for_source_and_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real_loads = json.loads

    def counting_loads(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real_loads(*args, **kwargs)

    monkeypatch.setattr(fingerprint.json, "loads", counting_loads)
    request = json_request(json.dumps({"id": "evt_1", "b": 2}))
    assert sources.json("id")(request) == "evt_1"
    fingerprint.canonical_request(request)
    sources.json("b")(request)
    assert len(calls) == 1


def test_header_source() -> None:
    source = sources.header("X-GitHub-Delivery")
    factory = RequestFactory()
    assert source(factory.post("/", headers={"X-GitHub-Delivery": "d-1"})) == "d-1"
    assert source(factory.post("/", headers={"x-github-delivery": '"d-2"'})) == "d-2"
    assert source(factory.post("/")) is None
    assert source(factory.post("/", headers={"X-GitHub-Delivery": "a,b"})) == "a,b"
    with pytest.raises(InvalidKey):  # one id sent twice, joined by the server
        source(factory.post("/", headers={"X-GitHub-Delivery": "d-3,d-3"}))


def test_form_source() -> None:
    source = sources.form("idempotency_key")
    factory = RequestFactory()
    assert source(factory.post("/", {"idempotency_key": "k1", "x": "y"})) == "k1"
    assert source(factory.post("/", {"x": "y"})) is None
    with pytest.raises(InvalidKey, match="2 times"):
        source(factory.post("/", {"idempotency_key": ["k1", "k2"]}))
    patch = factory.patch(
        "/", "idempotency_key=k3", content_type="application/x-www-form-urlencoded"
    )
    assert source(patch) == "k3"
    # Something read request.POST of a PATCH (Django answers an empty form for it): the
    # key is still read from the body.
    seen = factory.patch(
        "/", "idempotency_key=k4", content_type="application/x-www-form-urlencoded"
    )
    assert not seen.POST
    assert source(seen) == "k4"
    # The stream read by something that kept no form: the form cannot be read.
    gone = factory.patch(
        "/", "idempotency_key=k5", content_type="application/x-www-form-urlencoded"
    )
    gone.read()
    with pytest.raises(InvalidKey, match="could not be read"):
        source(gone)
    broken = factory.post("/", b"--x\r\nnonsense", content_type="multipart/form-data; boundary=x")
    broken.META["CONTENT_LENGTH"] = "-1"
    with pytest.raises(InvalidKey):
        source(broken)


def test_fixed_source() -> None:
    resolver = sources.fixed("webhook:stripe")
    assert resolver(RequestFactory().post("/")) == "webhook:stripe"
    assert repr(resolver) == "sources.fixed('webhook:stripe')"


@pytest.mark.parametrize(
    ("source", "spelled"),
    [
        (sources.header("X-Order-Id"), "sources.header('X-Order-Id')"),
        (sources.json("data.object.id"), "sources.json('data.object.id')"),
        (sources.form("order"), "sources.form('order')"),
    ],
)
def test_each_source_is_spelled_as_it_was_made(source: Any, spelled: str) -> None:
    assert repr(source) == spelled


@pytest.mark.parametrize(
    ("make", "argument"),
    [
        (sources.header, ""),
        (sources.header, None),
        # No header has such a name: the source would never find a key.
        (sources.header, "X-GitHub-Delivery "),
        (sources.header, "X GitHub Delivery"),
        (sources.header, "X-GitHub-Delivery:"),
        (sources.header, "X-Delivery\r\nX-Other"),
        (sources.header, "X-GitHub-Delivery\n"),  # a name read from a file, newline kept
        (sources.json, ""),
        (sources.json, "data..id"),
        (sources.json, ".id"),
        (sources.form, ""),
        (sources.fixed, ""),
        (sources.fixed, 42),
    ],
)
def test_sources_refuse_wrong_arguments(make: Any, argument: Any) -> None:
    with pytest.raises(ImproperlyConfigured):
        make(argument)


def test_same_delivery_is_public_and_one_fingerprint_for_every_delivery() -> None:
    assert "same_delivery" in sources.__all__
    factory = RequestFactory()
    first = factory.post("/", {"id": "evt_1", "pending_webhooks": 2}, "application/json")
    again = factory.post("/", {"id": "evt_1", "pending_webhooks": 1}, "application/json")
    assert sources.same_delivery(first) == sources.same_delivery(again)
    assert fingerprint.default_fingerprint(first) != fingerprint.default_fingerprint(again)
    # The value and version stored with the example project's records before it moved here.
    assert sources.same_delivery(first) == "sender-id"
    assert fingerprint.fingerprint_version(sources.same_delivery) == "sender-id"


def test_a_redelivery_with_other_bookkeeping_is_replayed_with_same_delivery() -> None:
    @idempotent(
        key=sources.json("id"),
        account=sources.fixed("webhook:test"),
        fingerprint=sources.same_delivery,
    )
    def webhook(request: Any) -> Any:
        Charge.objects.create(account="same-delivery", amount=1, currency="EUR")
        return JsonResponse({"received": json.loads(request.body)["id"]})

    def deliver(pending: int) -> Any:
        body = json.dumps({"id": "evt_same", "pending_webhooks": pending})
        return webhook(RequestFactory().post("/", body, content_type="application/json"))

    first, again = deliver(2), deliver(1)
    assert (first.status_code, again.status_code) == (200, 200)
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert runs("same-delivery") == 1


@pytest.mark.parametrize("key", [42, "nodots", "", b"a.b", ["a.b"]])
def test_idempotent_refuses_a_wrong_key_when_decorating(key: Any) -> None:
    with pytest.raises(ImproperlyConfigured, match="key"):
        idempotent(key=key)


# -- @idempotent(key=...) over HTTP ------------------------------------------------------


def test_json_key_runs_once_and_replays() -> None:
    first = post_json("/sources/json/", event("evt_1"))
    again = post_json("/sources/json/", event("evt_1"))
    assert first.status_code == 201
    assert again.status_code == 201
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert runs("json") == 1
    record = IdempotencyRecord.objects.get()
    assert (record.account, record.key) == ("sender:json", "evt_1")


def test_json_integer_id_is_its_decimal_string() -> None:
    post_json("/sources/json/", event(1234))
    again = post_json("/sources/json/", event(1234))
    assert again["Idempotent-Replayed"] == "true"
    assert runs("json") == 1
    assert IdempotencyRecord.objects.get().key == "1234"


def test_missing_id_is_a_missing_key() -> None:
    body = problem(post_json("/sources/json/", {"data": {"object": {}}}), "idempotency_key_missing")
    assert "data.object.id member of the JSON body" in body["detail"]
    # The title is shared by every source: it names no header the client never had to send.
    assert "header" not in body["title"].lower()
    assert runs("json") == 0
    assert not IdempotencyRecord.objects.exists()


def test_missing_id_when_not_required_runs_untouched() -> None:
    for _ in range(2):
        assert post_json("/sources/json-optional/", {"no": "id"}).status_code == 201
    assert runs("json-optional") == 2
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.parametrize(
    "payload",
    [
        event("x" * 256),
        event("caf\u00e9"),
        event("has space"),
        event("tab\there"),
        event(""),
        event(True),
        event(2.5),
        event(None),
        event({"id": "x"}),
        b"this is not json",
        b"",
    ],
)
def test_invalid_id_is_refused_without_a_record(payload: Any) -> None:
    problem(post_json("/sources/json/", payload), "idempotency_key_invalid")
    assert runs("json") == 0
    assert not IdempotencyRecord.objects.exists()


def test_a_source_that_returns_no_string_is_an_invalid_key() -> None:
    body = problem(post_json("/sources/wrong-type/", {}), "idempotency_key_invalid")
    assert "int" in body["detail"]
    assert runs("wrong-type") == 0
    assert not IdempotencyRecord.objects.exists()


def test_the_key_source_as_a_dotted_path() -> None:
    post_json("/sources/dotted/?id=q-1", {})
    again = post_json("/sources/dotted/?id=q-1", {})
    assert again["Idempotent-Replayed"] == "true"
    assert runs("dotted") == 1


def test_the_same_id_from_two_senders_runs_twice() -> None:
    delivery = new_key()
    answers = [
        post_json(path, {}, headers={"webhook-id": delivery})
        for path in ("/sources/sender-a/", "/sources/sender-b/", "/sources/sender-a/")
    ]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert [a.get("Idempotent-Replayed") for a in answers] == [None, None, "true"]
    assert (runs("sender:a"), runs("sender:b")) == (1, 1)
    records = IdempotencyRecord.objects.filter(key=delivery)
    assert sorted(records.values_list("account", flat=True)) == ["sender:a", "sender:b"]
    assert set(records.values_list("operation", flat=True)) == {"webhooks.shared"}


def test_a_double_submitted_form_runs_once(user: Any) -> None:
    client = Client()
    client.force_login(user)
    token = new_key()
    form = {"idempotency_key": token, "amount": "10"}
    first = client.post("/sources/form/", form)
    second = client.post("/sources/form/", form)
    assert first.status_code == second.status_code == 302
    assert second["Location"] == first["Location"]
    assert second["Idempotent-Replayed"] == "true"
    assert runs("form") == 1
    # Another rendering of the form carries another key: a new submission.
    client.post("/sources/form/", {**form, "idempotency_key": new_key()})
    assert runs("form") == 2


def test_a_form_without_its_key_field_is_refused(user: Any) -> None:
    client = Client()
    client.force_login(user)
    problem(client.post("/sources/form/", {"amount": "10"}), "idempotency_key_missing")
    assert runs("form") == 0


def multipart(*fields: tuple[str, str], boundary: str = "x") -> bytes:
    """A ``multipart/form-data`` body of ``fields``, in their order (a name may repeat)."""
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
        for name, value in fields
    ]
    return ("".join(parts) + f"--{boundary}--\r\n").encode()


def test_a_multipart_patch_carries_its_form_key(user: Any) -> None:
    """Django parses a form for POST only; the source reads a multipart PATCH too, as the
    fingerprint does: the key in its field runs the view once."""
    client = Client()
    client.force_login(user)
    token = new_key()
    body = multipart(("idempotency_key", token), ("amount", "10"))
    content_type = "multipart/form-data; boundary=x"
    first = client.generic("PATCH", "/sources/form/", body, content_type=content_type)
    again = client.generic("PATCH", "/sources/form/", body, content_type=content_type)
    assert first.status_code == again.status_code == 302, first.content
    assert again["Idempotent-Replayed"] == "true"
    assert again["Location"] == first["Location"]
    assert runs("form") == 1
    assert IdempotencyRecord.objects.filter(key=token).count() == 1
    twice = multipart(("idempotency_key", "k1"), ("idempotency_key", "k2"))
    refused = client.generic("PATCH", "/sources/form/", twice, content_type=content_type)
    assert "2 times" in problem(refused, "idempotency_key_invalid")["detail"]
    missing = client.generic(
        "PATCH", "/sources/form/", multipart(("amount", "10")), content_type=content_type
    )
    problem(missing, "idempotency_key_missing")
    assert runs("form") == 1
    assert IdempotencyRecord.objects.count() == 1


@pytest.mark.parametrize("charset", NO_TEXT_CHARSETS)
@pytest.mark.parametrize(
    "form", ["multipart/form-data; boundary=x", "application/x-www-form-urlencoded"]
)
@pytest.mark.parametrize("method", ["POST", "PATCH"])
def test_a_form_in_a_charset_that_reads_no_text_is_an_invalid_key(
    user: Any, method: str, form: str, charset: str
) -> None:
    client = Client()
    client.force_login(user)
    fields = (("idempotency_key", "k-1"), ("amount", "10"))
    body = multipart(*fields) if form.startswith("multipart") else b"idempotency_key=k-1&amount=10"
    response = client.generic(
        method, "/sources/form/", body, content_type=f"{form}; charset={charset}"
    )
    assert "the form could not be read" in problem(response, "idempotency_key_invalid")["detail"]
    assert runs("form") == 0
    assert IdempotencyRecord.objects.count() == 0


def test_a_posted_form_django_refuses_to_read_is_an_invalid_key(user: Any) -> None:
    """Django reads an urlencoded POST in UTF-8 only and refuses another charset: the key
    cannot be read, which the problem answer says (not Django's bare 400 page)."""
    client = Client()
    client.force_login(user)
    response = client.generic(
        "POST",
        "/sources/form/",
        b"idempotency_key=k-1&amount=10",
        content_type="application/x-www-form-urlencoded; charset=latin-1",
    )
    assert "UTF-8" in problem(response, "idempotency_key_invalid")["detail"]
    assert runs("form") == 0
    assert IdempotencyRecord.objects.count() == 0


# -- the DRF mixin and @api_view ---------------------------------------------------------


def drf_client(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


@needs_drf
@pytest.mark.parametrize(
    ("path", "view"),
    [
        ("/api/sources/function/", "drf-function"),
        ("/api/sources/lambda/", "drf-lambda"),
        ("/api/sources/static/", "drf-static"),
        ("/api/sources/dotted/", "drf-dotted"),
    ],
)
def test_mixin_key_attribute_is_called_with_the_request_alone(
    user: Any, path: str, view: str
) -> None:
    client = drf_client(user)
    delivery = new_key()
    first = post_json(path, {"a": 1}, client, headers={"X-Delivery": delivery})
    again = post_json(path, {"a": 1}, client, headers={"X-Delivery": delivery})
    assert first.status_code == again.status_code == 201, first.content
    assert again["Idempotent-Replayed"] == "true"
    assert runs(view) == 1
    assert IdempotencyRecord.objects.get().key == delivery
    # The Idempotency-Key header is not where this view's key comes from.
    problem(
        post_json(path, {"a": 1}, client, headers={"Idempotency-Key": new_key()}),
        "idempotency_key_missing",
    )
    assert runs(view) == 1


@needs_drf
def test_mixin_key_attribute_from_sources(user: Any) -> None:
    client = drf_client(user)
    post_json("/api/sources/source/", {"id": 7}, client)
    again = post_json("/api/sources/source/", {"id": 7}, client)
    assert again["Idempotent-Replayed"] == "true"
    assert runs("drf-source") == 1
    broken = post_json("/api/sources/source/", b"{oops", client)
    invalid = problem(broken, "idempotency_key_invalid")
    assert "header" not in invalid["title"].lower()
    assert IdempotencyRecord.objects.count() == 1


@needs_drf
def test_json_key_after_a_permission_parsed_the_body(user: Any) -> None:
    client = drf_client(user)
    first = post_json("/api/sources/data-first/", {"id": "p-1"}, client)
    again = post_json("/api/sources/data-first/", {"id": "p-1"}, client)
    assert first.status_code == 201, first.content
    assert again["Idempotent-Replayed"] == "true"
    assert runs("drf-data-first") == 1
    assert IdempotencyRecord.objects.get().key == "p-1"
    missing = post_json("/api/sources/data-first/", {"no": "id"}, client)
    problem(missing, "idempotency_key_missing")
    assert runs("drf-data-first") == 1


@needs_drf
def test_json_key_from_what_drf_parsed_when_the_stream_is_consumed() -> None:
    # Older DRF versions, and multipart parsers, read the stream without keeping the body.
    from rest_framework.parsers import JSONParser
    from rest_framework.request import Request

    def consumed(payload: bytes, parsed: Any) -> Request:
        raw = RequestFactory().post("/", payload, content_type="application/json")
        request = Request(raw, parsers=[JSONParser()])
        request._full_data = parsed
        raw.read()
        return request

    assert sources.json("id")(consumed(b'{"id": "u-1"}', {"id": "u-1"})) == "u-1"
    with pytest.raises(InvalidKey, match="not JSON"):
        sources.json("id")(consumed(b"id=u-1", QueryDict("id=u-1")))


@needs_drf
def test_get_idempotency_key_override_wins(user: Any) -> None:
    client = drf_client(user)
    first = post_json("/api/sources/method/?delivery=m-1", {}, client, headers={"X-Ignored": "z"})
    again = post_json("/api/sources/method/?delivery=m-1", {}, client, headers={"X-Ignored": "y"})
    assert again["Idempotent-Replayed"] == "true", again.content
    assert first.content == again.content
    assert runs("drf-method") == 1
    assert IdempotencyRecord.objects.get().key == "m-1"


@needs_drf
def test_default_get_idempotency_key_reads_attribute_else_header() -> None:
    from django_idempotency.drf import IdempotencyMixin
    from tests.testapp.source_drf_views import Created, FunctionKeyView

    class HeaderView(IdempotencyMixin, Created):
        pass

    request = RequestFactory().post("/", headers={"X-Delivery": "d-1", "Idempotency-Key": "h-1"})
    assert FunctionKeyView().get_idempotency_key(request) == "d-1"
    assert HeaderView().get_idempotency_key(request) == "h-1"


@needs_drf
def test_mixin_wrong_key_attribute_is_improperly_configured(user: Any) -> None:
    client = drf_client(user)
    client.raise_request_exception = True
    with pytest.raises(ImproperlyConfigured, match=r"WrongKeyView: idempotency_key"):
        post_json("/api/sources/wrong/", {}, client, headers={"Idempotency-Key": new_key()})
    assert runs("drf-wrong") == 0
    assert not IdempotencyRecord.objects.exists()


@needs_drf
def test_api_view_with_key_source(user: Any) -> None:
    client = drf_client(user)
    post_json("/api/sources/api-view/", {"id": "a-1"}, client)
    again = post_json("/api/sources/api-view/", {"id": "a-1"}, client)
    assert again["Idempotent-Replayed"] == "true"
    assert runs("drf-api-view") == 1
    problem(
        post_json("/api/sources/api-view/", {"id": "a" * 256}, client), "idempotency_key_invalid"
    )
    assert IdempotencyRecord.objects.count() == 1


# -- OpenAPI ------------------------------------------------------------------------------


@needs_drf
def test_openapi_documents_a_key_header_only_where_the_key_is_one(settings: Any) -> None:
    pytest.importorskip("drf_spectacular")
    from django.urls import path
    from drf_spectacular.generators import SchemaGenerator

    from django_idempotency.drf import IdempotencyMixin
    from tests.testapp import source_drf_views as sd

    class Documented(IdempotencyMixin, sd.Created):
        idempotency_key = sources.header("X-GitHub-Delivery")

    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    }
    patterns = [
        path("json/", sd.SourceKeyView.as_view()),
        path("function/", sd.FunctionKeyView.as_view()),
        path("delivery/", Documented.as_view()),
    ]
    schema = SchemaGenerator(patterns=patterns).get_schema(request=None, public=True)

    def headers(route: str) -> list[str]:
        operation = schema["paths"][route]["post"]
        return [p["name"] for p in operation.get("parameters", []) if p["in"] == "header"]

    assert headers("/json/") == []
    assert headers("/function/") == []
    assert headers("/delivery/") == ["X-GitHub-Delivery"]
    (parameter,) = schema["paths"]["/delivery/"]["post"]["parameters"]
    assert parameter["description"].startswith("The sender's id of this delivery")
    for route in ("/json/", "/delivery/"):
        # The problem answers stay documented whatever the key's source.
        assert {"400", "409", "422"} <= set(schema["paths"][route]["post"]["responses"])
