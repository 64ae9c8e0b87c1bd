"""Hostile input, fuzzed with hypothesis: the key header, bodies and content types.

Every answer is a well-formed response, never a 500 from this package, and a request the
package refuses stores nothing (no record, no effect). Through the Django test client on
every database; raw bytes on the wire (control characters, repeated header lines, header
names that collide after WSGI's mapping) through a raw socket to gunicorn on PostgreSQL.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from hypothesis import HealthCheck, event, example, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from django_idempotency.models import IdempotencyRecord
from tests.helpers import NO_TEXT_CHARSETS, examples, needs_drf, new_key, postgres_only
from tests.live import gunicorn
from tests.testapp.models import Charge, ProviderCall

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

CHARGE = {"amount": 100, "currency": "EUR"}
FUZZ = hypothesis_settings(
    max_examples=examples(120),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# The contract of the README, written independently of keys.parse_key: surrounding spaces
# and tabs are ignored; a value in double quotes is an RFC 9651 sf-string; the key is 1 to
# 255 characters of printable ASCII without space.
SF_STRING = re.compile(r'"((?:[\x20\x21\x23-\x5B\x5D-\x7E]|\\["\\])*)"')
KEY = re.compile(r"[\x21-\x7E]{1,255}")


def contract_key(raw: str) -> str | None:
    """The key a header value carries according to the README, or ``None`` for a 400."""
    value = raw.strip(" \t")
    sf = SF_STRING.fullmatch(value)
    if sf:
        value = re.sub(r'\\(["\\])', r"\1", sf.group(1))
    elif len(value) >= 2 and value[0] == value[-1] == '"':
        return None  # a broken sf-string
    elif "," in value and len(set(value.split(","))) == 1 and value[0] != ",":
        return None  # one key sent twice, joined by the server
    return value if KEY.fullmatch(value) else None


def assert_problem(response, code: str, status: int = 400) -> None:
    assert response.status_code == status, response.content[:300]
    assert response["Content-Type"] == "application/problem+json"
    assert json.loads(response.content)["code"] == code


def counts() -> tuple[int, int, int]:
    return (
        IdempotencyRecord.objects.count(),
        Charge.objects.count(),
        ProviderCall.objects.count(),
    )


# -- the header, through the test client ---------------------------------------------------

EDGE_KEYS = [
    "",
    " ",
    "\t",
    '"',
    '""',
    '"\\"',
    '"a\\b"',
    '"a\\"b"',
    '"a"b"',
    '"a""',
    '" a"',
    " \t k \t ",
    "a b",
    "a,b",
    "k,k",
    "k,k,k",
    ",",
    "a\x00b",
    "a\x7fb",
    "caf\u00e9",
    "\u2028",
    "\ufeffkey",
    "k\r\n",
    "a" * 255,
    "a" * 256,
    '"' + "a" * 255 + '"',
    '"' + "a" * 256 + '"',
    "x" * 100_000,
]

header_values = st.one_of(
    st.sampled_from(EDGE_KEYS),
    st.text(max_size=40),
    st.text(st.characters(min_codepoint=0x09, max_codepoint=0x7F), max_size=60),
    st.from_regex(r'[ \t]{0,2}"([\x20-\x7e]|\\.){0,20}"[ \t]{0,2}', fullmatch=True),
    st.builds(lambda n, c: c * n, st.integers(250, 260), st.sampled_from(["a", '"', "\\", " "])),
)


@FUZZ
@given(raw=header_values)
def test_any_header_value_is_a_key_or_a_400_that_stores_nothing(api, raw):
    before = counts()
    key = contract_key(raw)
    known = key is not None and IdempotencyRecord.objects.filter(key=key).exists()
    response = api.post("/charges/", CHARGE, key=raw)
    event("refused" if key is None else "replayed" if known else "ran")
    if key is None:
        assert_problem(response, "idempotency_key_invalid")
        assert counts() == before
        return
    assert response.status_code == 201, (raw, response.content[:200])
    assert IdempotencyRecord.objects.filter(key=key).count() == 1
    if known:
        assert response["Idempotent-Replayed"] == "true"
        assert counts() == before
    else:
        assert "Idempotent-Replayed" not in response
        assert counts() == (before[0] + 1, before[1] + 1, before[2] + 1)


@pytest.mark.parametrize("bare", ["k-1", " k-1", "k-1\t", '"k-1"', ' "k-1" '])
def test_spellings_of_one_key_are_one_operation(api, bare):
    first = api.post("/charges/", CHARGE, key="k-1")
    again = api.post("/charges/", CHARGE, key=bare)
    assert again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert Charge.objects.count() == 1


def test_a_header_under_another_name_is_not_the_key(api):
    response = api.client.post(
        "/charges/", CHARGE, content_type="application/json", HTTP_X_IDEMPOTENCY_KEY="abc"
    )
    assert_problem(response, "idempotency_key_missing")
    assert counts() == (0, 0, 0)


# -- bodies and content types, through the test client -------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=16,
)

BROKEN_BODIES = [
    b"",
    b"{",
    b'{"a":',
    b"[1,]",
    b"\xff\xfe\x00",
    b"\xef\xbb\xbf{}",
    b'{"a": 1, "a": 2}',
    b"NaN",
    b"1" * 5000,  # more digits than int() converts
    b"1e999999",
    b"\x00" * 64,
    b"--x\r\nContent-Disposition: form-data; name=a\r\n\r\nb\r\n--x--\r\n",
    b"--x\r\nbroken",
    b"a=1&a=2&b=%ff&c",
    "{}".encode("utf-16"),
]

bodies = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    json_values.map(lambda v: json.dumps(v, ensure_ascii=False).encode()),
    st.integers(1, 200).map(lambda n: b"[" * n + b"]" * n),
    st.sampled_from(BROKEN_BODIES),
    st.binary(max_size=300),
)

CONTENT_TYPES = [
    "application/json",
    "application/json; charset=utf-8",
    "application/json; charset=utf-16",
    "application/json; charset=latin-1",
    "application/vnd.api+json",
    "APPLICATION/JSON",
    "application/x-www-form-urlencoded",
    "application/x-www-form-urlencoded; charset=latin-1",
    "application/x-www-form-urlencoded; charset=no-such-charset",
    "multipart/form-data",
    "multipart/form-data; boundary=",
    "multipart/form-data; boundary=x",
    "multipart/form-data; boundary=" + "b" * 300,
    "text/plain",
    "text/plain; charset=utf-8; charset=latin-1",
    "application/octet-stream",
    "",
    ";",
    'a/b; c="\\',
]

content_types = st.one_of(
    st.sampled_from(CONTENT_TYPES),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=50),
)


def post_raw(client: Client, path: str, body: bytes, content_type: str, key: str):
    # generic() sends the bytes as they are; post() would re-encode them by the charset.
    return client.generic(
        "POST", path, body, content_type=content_type, headers={"Idempotency-Key": key}
    )


@FUZZ
@given(body=bodies, content_type=content_types)
def test_any_body_is_answered_and_a_retry_replays_it(api, body, content_type):
    """``/uploads/`` runs no parser of its own on a JSON body: any 500 would be ours.

    A body Django refuses (a broken multipart stream) is a 400 before any claim; every
    other body runs the view once, and the retry with the same bytes replays it, so the
    fingerprint of hostile input is deterministic.
    """
    key = new_key()
    before = counts()
    first = post_raw(api.client, "/uploads/", body, content_type, key)
    event(f"answered {first.status_code}")
    assert first.status_code in (201, 400), first.content[:300]
    if first.status_code == 400:
        assert counts() == before
        return
    assert IdempotencyRecord.objects.filter(key=key).count() == 1
    again = post_raw(api.client, "/uploads/", body, content_type, key)
    assert again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert Charge.objects.count() == before[1] + 1


BODIES_HARD_TO_CANONICALISE = [
    pytest.param(
        b"[" * 5000 + b"]" * 5000,
        "application/json",
        "/uploads/",
        201,
        id="json-nested-deeper-than-the-recursion-limit",
    ),
    pytest.param(
        b'{"a": "\\ud800"}', "application/json", "/uploads/", 201, id="json-lone-surrogate-escape"
    ),
    # /charges/ reads the raw body (Django's own request.POST fails on such a charset):
    # its answer is a deterministic 400 of the view, stored and replayed.
    pytest.param(
        b"a=1",
        "application/x-www-form-urlencoded; charset=rot13",
        "/charges/",
        400,
        id="form-non-text-charset",
    ),
]


@pytest.mark.parametrize(("body", "content_type", "path", "status"), BODIES_HARD_TO_CANONICALISE)
def test_bodies_the_fingerprint_cannot_canonicalise_still_run_once(
    api, body, content_type, path, status
):
    key = new_key()
    api.client.raise_request_exception = False
    first = post_raw(api.client, path, body, content_type, key)
    assert first.status_code == status, first.content[:200]
    again = post_raw(api.client, path, body, content_type, key)
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert IdempotencyRecord.objects.count() == 1
    assert Charge.objects.count() == (1 if status == 201 else 0)


@pytest.mark.parametrize("charset", NO_TEXT_CHARSETS)
@pytest.mark.parametrize(
    "form", ["multipart/form-data; boundary=x", "application/x-www-form-urlencoded"]
)
@pytest.mark.parametrize("method", ["POST", "PATCH"])
def test_a_form_charset_that_reads_no_text_is_fingerprinted_by_its_bytes(
    api, method, form, charset
):
    """``/charges/`` reads the raw body as JSON, whatever the Content-Type says: it runs
    once, a retry replays it, and the same key with other bytes is a ``422``."""
    runs_once_and_tells_other_bytes_apart(api, method, f"{form}; charset={charset}")


def runs_once_and_tells_other_bytes_apart(api, method: str, content_type: str) -> None:
    """JSON sent to ``/charges/`` (which reads the raw body) as ``content_type``: it runs
    once, a retry replays it, and the same key with other bytes is a ``422``."""
    key = new_key()

    def send(payload):
        body = json.dumps(payload).encode()
        return api.client.generic(
            method, "/charges/", body, content_type=content_type, headers={"Idempotency-Key": key}
        )

    first = send(CHARGE)
    assert first.status_code == 201, first.content[:300]
    again = send(CHARGE)
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert_problem(send({**CHARGE, "amount": 7}), "idempotency_key_reused", 422)
    assert counts() == (1, 1, 1)


def test_a_body_over_the_upload_limit_is_refused_before_the_claim(api, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1024
    body = json.dumps({"amount": 1, "pad": "x" * 2048}).encode()
    response = post_raw(api.client, "/uploads/", body, "application/json", new_key())
    assert response.status_code == 400  # Django's RequestDataTooBig
    assert counts() == (0, 0, 0)


# -- multipart with files ------------------------------------------------------------------


def upload(client: Client, path: str, key: str, files: dict[str, bytes], **form: str):
    data = {name: SimpleUploadedFile(f"{name}.bin", content) for name, content in files.items()}
    return client.post(path, {**form, **data}, headers={"Idempotency-Key": key})


def test_the_view_reads_every_uploaded_byte_after_the_fingerprint(api, settings):
    """The fingerprint hashes uploads (in memory and on disk) and rewinds them for the view."""
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 1024  # the large file goes to a temporary file
    small, large = b"small\x00\xff", bytes(range(256)) * 64
    key = new_key()
    first = upload(api.client, "/uploads/", key, {"small": small, "large": large}, note="n")
    assert first.status_code == 201, first.content
    assert json.loads(first.content)["files"] == {
        "small": [hashlib.sha256(small).hexdigest()],
        "large": [hashlib.sha256(large).hexdigest()],
    }
    again = upload(api.client, "/uploads/", key, {"small": small, "large": large}, note="n")
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    other = upload(api.client, "/uploads/", key, {"small": small, "large": large + b"!"}, note="n")
    assert_problem(other, "idempotency_key_reused", 422)
    assert Charge.objects.count() == 1


@needs_drf
def test_multipart_through_drf_with_a_file(api):
    key = new_key()

    def charge(receipt: bytes):
        form = {"amount": "5", "currency": "EUR"}
        return upload(api.client, "/api/charges/", key, {"receipt": receipt}, **form)

    first = charge(b"%PDF-1.4")
    assert first.status_code == 201, first.content
    again = charge(b"%PDF-1.4")
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert_problem(charge(b"%PDF-1.5"), "idempotency_key_reused", 422)
    assert Charge.objects.count() == 1
    assert ProviderCall.objects.count() == 1


# -- raw bytes on the wire, through gunicorn -----------------------------------------------


@dataclass
class RawAnswer:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3}) [^\r\n]*")


def raw_post(url: str, header_lines: list[bytes], body: bytes = b"") -> RawAnswer:
    """One POST to /faults/charges/ with header lines sent exactly as given."""
    target = urlsplit(url)
    body = body or json.dumps(CHARGE).encode()
    head = b"".join(
        [
            b"POST /faults/charges/ HTTP/1.1\r\nHost: test\r\nConnection: close\r\n",
            b"Content-Type: application/json\r\n",
            b"Content-Length: %d\r\n" % len(body),
            *(line + b"\r\n" for line in header_lines),
            b"\r\n",
        ]
    )
    with socket.create_connection((target.hostname, target.port), timeout=20) as sock:
        sock.sendall(head + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head_part, _, content = data.partition(b"\r\n\r\n")
    lines = head_part.split(b"\r\n")
    match = STATUS_LINE.fullmatch(lines[0])
    assert match, f"not an HTTP response: {data[:200]!r}"
    headers = {}
    for line in lines[1:]:
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return RawAnswer(int(match.group(1)), headers, content)


@pytest.fixture(scope="module")
def server(django_db_setup, django_db_blocker) -> Iterator[str]:
    with django_db_blocker.unblock(), gunicorn(workers=2) as url:
        yield url


def tenant_line() -> tuple[str, bytes]:
    tenant = f"raw-{uuid.uuid4().hex[:12]}"
    return tenant, f"X-Tenant: {tenant}".encode()


def records_of(tenant: str) -> list[str]:
    return list(IdempotencyRecord.objects.filter(account=tenant).values_list("key", flat=True))


@postgres_only
@FUZZ
@given(value=st.binary(max_size=60).filter(lambda v: b"\r" not in v and b"\n" not in v))
@example(value=b"a\x00b")
@example(value=b"caf\xc3\xa9")
@example(value=b"\x80\xff")
@example(value=b' "k" ')
def test_raw_header_bytes_through_gunicorn(server, value):
    """The server refuses what HTTP forbids (its own 400); what reaches us is a key by the
    contract or our 400; either way a refusal stores nothing and nothing answers 5xx."""
    tenant, tenant_header = tenant_line()
    answer = raw_post(server, [tenant_header, b"Idempotency-Key: " + value])
    event(f"{answer.status} {answer.headers.get('content-type')}")
    assert answer.status in (201, 400), answer
    stored = records_of(tenant)
    if answer.status == 400:
        assert stored == []
        assert not Charge.objects.filter(account=tenant).exists()
        if answer.headers.get("content-type") == "application/problem+json":
            assert contract_key(value.decode("latin-1")) is None
        return
    assert stored == [contract_key(value.decode("latin-1"))]


@postgres_only
def test_oversized_and_folded_headers_are_refused_by_the_server(server):
    for lines in (
        [b"Idempotency-Key: " + b"a" * 10_000],
        [b"Idempotency-Key: a", b" folded"],
        [b"Idempotency-Key : a"],
        [b"X-Pad-%d: x" % i for i in range(150)] + [b"Idempotency-Key: a"],
    ):
        tenant, tenant_header = tenant_line()
        answer = raw_post(server, [tenant_header, *lines])
        assert 400 <= answer.status < 500, (lines[0][:40], answer.status)
        assert records_of(tenant) == []


@postgres_only
def test_a_header_with_an_underscore_cannot_smuggle_a_key(server):
    """WSGI maps ``Idempotency_Key`` and ``Idempotency-Key`` to one environ name; gunicorn
    drops the underscore spelling, so it can neither stand in for nor replace the key."""
    tenant, tenant_header = tenant_line()
    alone = raw_post(server, [tenant_header, b"Idempotency_Key: smuggled"])
    assert alone.status == 400
    assert json.loads(alone.body)["code"] == "idempotency_key_missing"
    for order in (
        [b"Idempotency_Key: smuggled", b"Idempotency-Key: real"],
        [
            b"Idempotency-Key: real",
            b"Idempotency_Key: smuggled",
        ],
    ):
        assert raw_post(server, [tenant_header, *order]).status == 201
    assert records_of(tenant) == ["real"]
    assert Charge.objects.filter(account=tenant).count() == 1


@postgres_only
def test_repeated_structured_field_strings_are_refused(server):
    tenant, tenant_header = tenant_line()
    answer = raw_post(server, [tenant_header, b'Idempotency-Key: "k"', b'Idempotency-Key: "k"'])
    assert answer.status == 400
    assert json.loads(answer.body)["code"] == "idempotency_key_invalid"
    assert records_of(tenant) == []


@postgres_only
def test_a_repeated_bare_header_is_refused_not_taken_for_another_key(server):
    tenant, tenant_header = tenant_line()
    first = raw_post(server, [tenant_header, b"Idempotency-Key: k"])
    assert first.status == 201
    # A proxy or client library that appends the header again on the retry:
    retry = raw_post(server, [tenant_header, b"Idempotency-Key: k", b"Idempotency-Key: k"])
    assert retry.status == 400
    assert Charge.objects.filter(account=tenant).count() == 1


def test_a_multipart_body_that_holds_no_part_is_fingerprinted_by_its_bytes(api):
    """A body sent as ``multipart/form-data`` that holds no part (the boundary is never in
    it: JSON under a wrong content type) parses to an empty form, whatever its bytes: two
    such bodies are two requests to the view that reads them, so the same key with other
    bytes is a ``422``, never the first one's answer."""
    runs_once_and_tells_other_bytes_apart(api, "PATCH", "multipart/form-data; boundary=x")
