from __future__ import annotations

import hashlib
import json

from django.core.files.uploadedfile import SimpleUploadedFile
from django.http import QueryDict
from django.test import RequestFactory

from django_idempotency.fingerprint import canonical_request, default_fingerprint

rf = RequestFactory()


def fp(request):
    return default_fingerprint(request)


def test_json_key_order_and_whitespace_do_not_matter():
    a = rf.post("/x/", '{"a":1,"b":2}', content_type="application/json")
    b = rf.post("/x/", '{ "b": 2,\n "a": 1 }', content_type="application/json")
    assert fp(a) == fp(b)


def test_json_values_matter():
    a = rf.post("/x/", json.dumps({"a": 1}), content_type="application/json")
    b = rf.post("/x/", json.dumps({"a": 2}), content_type="application/json")
    c = rf.post("/x/", json.dumps({"a": "1"}), content_type="application/json")
    assert len({fp(a), fp(b), fp(c)}) == 3


def test_query_order_does_not_matter_but_values_do():
    a = rf.post("/x/?b=2&a=1", "{}", content_type="application/json")
    b = rf.post("/x/?a=1&b=2", "{}", content_type="application/json")
    c = rf.post("/x/?a=1&b=3", "{}", content_type="application/json")
    assert fp(a) == fp(b) != fp(c)


def test_form_pairs_are_sorted():
    a = rf.post("/x/", "b=2&a=1&a=0", content_type="application/x-www-form-urlencoded")
    b = rf.post("/x/", "a=0&a=1&b=2", content_type="application/x-www-form-urlencoded")
    c = rf.post("/x/", "a=0&b=2", content_type="application/x-www-form-urlencoded")
    assert fp(a) == fp(b) != fp(c)


def test_multipart_field_order_does_not_matter_file_content_does():
    def upload(content: bytes):
        return rf.post("/x/", {"note": "hi", "file": SimpleUploadedFile("a.txt", content)})

    a = upload(b"hello")
    b = rf.post("/x/", {"file": SimpleUploadedFile("a.txt", b"hello"), "note": "hi"})
    c = upload(b"other")
    assert fp(a) == fp(b) != fp(c)
    # The view can still read the file after the fingerprint read it.
    d = upload(b"hello")
    fp(d)
    assert d.FILES["file"].read() == b"hello"


def test_multipart_patch_is_parsed_too():
    body_a = b'--AAA\r\nContent-Disposition: form-data; name="n"\r\n\r\n1\r\n--AAA--\r\n'
    body_b = b'--BBB\r\nContent-Disposition: form-data; name="n"\r\n\r\n1\r\n--BBB--\r\n'
    a = rf.patch("/x/", body_a, content_type="multipart/form-data; boundary=AAA")
    b = rf.patch("/x/", body_b, content_type="multipart/form-data; boundary=BBB")
    assert fp(a) == fp(b)


def test_transport_headers_are_excluded():
    a = rf.post("/x/", "{}", content_type="application/json", headers={"User-Agent": "a"})
    b = rf.post(
        "/x/",
        "{}",
        content_type="application/json",
        headers={"User-Agent": "b", "traceparent": "00-1-2-01", "Date": "now"},
    )
    assert fp(a) == fp(b)


def test_method_matters():
    a = rf.post("/x/", "{}", content_type="application/json")
    b = rf.patch("/x/", "{}", content_type="application/json")
    assert fp(a) != fp(b)


def test_invalid_json_and_binary_bodies_hash_their_bytes():
    a = rf.post("/x/", b"{not json", content_type="application/json")
    b = rf.post("/x/", b"{not json!", content_type="application/json")
    c = rf.post("/x/", b"\xff\xfe", content_type="application/octet-stream")
    assert len({fp(a), fp(b), fp(c)}) == 3


def test_canonical_form_is_compact_sorted_json():
    request = rf.post("/x/?z=1", '{ "b": 2, "a": 1 }', content_type="application/json")
    form = json.loads(canonical_request(request))
    assert form["body"] == {"json": {"a": 1, "b": 2}}
    assert form["query"] == [["z", "1"]]
    assert b" " not in canonical_request(request)


def test_a_query_a_middleware_assigned_is_read_as_it_is():
    plain = rf.post("/x/", "{}", content_type="application/json")
    assigned = rf.post("/x/", "{}", content_type="application/json")
    assigned.GET = QueryDict("a=1")  # no query string, but a GET of its own
    assert json.loads(canonical_request(assigned))["query"] == [["a", "1"]]
    assert fp(plain) != fp(assigned)
    assert json.loads(canonical_request(plain))["query"] == []


def test_the_canonical_text_is_json_dumps_with_sorted_keys_byte_for_byte():
    # Stored fingerprints depend on these bytes: however they are made, they stay the ones
    # json.dumps makes (sorted keys, no whitespace, text as it is, a lone surrogate escaped).
    body = '{"z": [1, 2.5, null, true, {"é": "\\ud800"}], "a": "x\\"y\\\\", "n": 1e300}'
    request = rf.post("/x/?b=2&a=1", body, content_type="application/json")
    expected = {
        "method": "POST",
        "operation": None,
        "url_kwargs": {},
        "query": [["a", "1"], ["b", "2"]],
        "body": {"json": json.loads(body)},
    }
    text = json.dumps(expected, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert canonical_request(request) == text.encode("utf-8", "surrogatepass")


def nested(depth: int, inner: bytes = b"") -> bytes:
    return b'{"id":"evt_1","x":' + b"[" * depth + inner + b"]" * depth + b"}"


def parsed(body: bytes):
    """A request whose JSON body was parsed here, as a key source parses it; ``None`` when
    it is too deep to parse from this frame."""
    from django_idempotency.fingerprint import NotJSON, json_body

    request = rf.post("/x/", body, content_type="application/json")
    try:
        json_body(request)
    except NotJSON:
        return None
    return request


def below(frames: int, call):
    """``call()``, from ``frames`` Python frames deeper than this one."""
    return call() if frames == 0 else below(frames - 1, call)


def test_a_json_body_parsed_higher_up_the_stack_than_it_can_be_encoded_is_hashed_by_its_bytes():
    """A key source parses the body where the stack is shallow; a custom fingerprint
    calls ``canonical_request`` deeper down. A body nested just within what the parse
    managed is hashed by its bytes there, the same on every retry, never a RecursionError
    (on interpreters whose C recursion limit counts Python frames)."""
    low, high = 1, 100_000  # the deepest nesting parsed from here
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if parsed(nested(middle)) else (low, middle - 1)
    depth = low - 3  # room for one more level in the other body, parsed a frame deeper

    def fingerprint(inner: bytes) -> bytes:
        request = parsed(nested(depth, inner))
        assert request is not None
        return below(40, lambda: canonical_request(request))

    first, again, other = fingerprint(b""), fingerprint(b""), fingerprint(b"[]")
    assert first == again != other
    body = json.loads(first)["body"]
    if "raw" in body:  # too deep to encode down there: its bytes
        raw = hashlib.sha256(nested(depth)).hexdigest()
        assert body == {"raw": raw, "type": "application/json"}
