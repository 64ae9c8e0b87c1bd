"""Uploaded files are fingerprinted by their content, whatever read the body first.

A DRF permission (or authentication) class that reads ``request.data`` before the claim
consumes the request's stream: the fingerprint then reads what DRF parsed. A multipart
``PATCH`` (Django parses no form but a POST's) took that path, and its files were
fingerprinted by their names alone: a retry with the same key and another file of the same
name got the first file's outcome replayed instead of ``422``. Effects counted: the charges
the view writes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import override_settings
from django.test.client import BOUNDARY, MULTIPART_CONTENT, encode_multipart

from tests.helpers import needs_drf, needs_ninja, new_key
from tests.testapp.models import Charge

pytestmark = [
    pytest.mark.django_db(transaction=True, databases="__all__"),
    pytest.mark.urls("tests.testapp.upload_urls"),
]

PATH = "/uploads/read-first/"


def upload(api: Any, method: str, key: str, content: bytes, note: str = "n") -> Any:
    body = encode_multipart(
        BOUNDARY, {"note": note, "file": SimpleUploadedFile("invoice.txt", content)}
    )
    return api.client.generic(
        method.upper(), PATH, body, content_type=MULTIPART_CONTENT, headers={"Idempotency-Key": key}
    )


@needs_drf
@pytest.mark.parametrize("method", ["post", "patch"])
def test_the_same_upload_is_replayed_and_another_file_of_its_name_is_refused(api, method):
    key = new_key()
    first = upload(api, method, key, b"first")
    assert first.status_code == 200, first.content
    assert json.loads(first.content)["content"] == "first"
    again = upload(api, method, key, b"first")
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    other = upload(api, method, key, b"other")
    assert other.status_code == 422, other.content
    assert json.loads(other.content)["code"] == "idempotency_key_reused"
    changed = upload(api, method, key, b"first", note="changed")
    assert changed.status_code == 422, changed.content
    assert Charge.objects.count() == 1


NINJA_FILES = "ninja.compatibility.files.fix_request_files_middleware"


def send(api: Any, path: str, method: str, key: str, content: bytes, note: str = "n") -> Any:
    body = encode_multipart(BOUNDARY, {"note": note, "file": SimpleUploadedFile("a.txt", content)})
    return api.client.generic(
        method.upper(), path, body, content_type=MULTIPART_CONTENT, headers={"Idempotency-Key": key}
    )


def runs_once_and_refuses_another_file(api: Any, path: str, method: str, content: bytes) -> None:
    key = new_key()
    first = send(api, path, method, key, content)
    assert first.status_code == 200, first.content
    assert json.loads(first.content)["content"] == content.decode()
    again = send(api, path, method, key, content)
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    other = send(api, path, method, key, content[:-1] + b"!")
    assert other.status_code == 422, other.content
    changed = send(api, path, method, key, content, note="changed")
    assert changed.status_code == 422, changed.content
    assert Charge.objects.count() == 1


@needs_drf
@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1024)
@pytest.mark.parametrize("path", ["/uploads/drf/", "/uploads/read-first/"])
@pytest.mark.parametrize("method", ["post", "patch", "put"])
def test_an_upload_larger_than_the_in_memory_limit_is_taken_as_unprotected(api, path, method):
    """Django refuses to hold a body over ``DATA_UPLOAD_MAX_MEMORY_SIZE`` in memory
    (``RequestDataTooBig``, a ``400``), and parses the files of a POST from the stream.
    DRF's parsers do so for every method: a view that takes a large upload by ``PATCH``
    unprotected must take it protected. The fingerprint read the whole body of a multipart
    ``PATCH`` or ``PUT`` into memory, and such an upload was refused with ``400``."""
    runs_once_and_refuses_another_file(api, path, method, b"x" * 4096)


@needs_ninja
@pytest.mark.parametrize("method", ["post", "patch", "put"])
def test_a_ninja_upload_filled_in_by_its_files_middleware_is_fingerprinted_by_its_files(
    api, settings, method
):
    """django-ninja fills ``request.FILES`` of a ``PATCH`` or ``PUT`` in a middleware of its
    own (which it asks for where an operation takes files by those methods): the stream is
    read then, and the fingerprint found no body. Every such request had one fingerprint,
    so another file sent with the same key got the first one's outcome replayed."""
    settings.MIDDLEWARE = [*settings.MIDDLEWARE, NINJA_FILES]
    runs_once_and_refuses_another_file(api, "/uploads/ninja/upload", method, b"ninja file")


@needs_drf
@pytest.mark.parametrize("form", ["urlencoded", "multipart"])
@pytest.mark.parametrize("method", ["post", "patch", "put"])
def test_a_form_field_key_is_read_from_what_drf_parsed_before_the_claim(api, form, method):
    """``sources.form`` beside a permission that reads ``request.data`` first: for a
    ``PATCH`` or ``PUT`` (whose form Django does not parse) the stream is consumed, and the
    key is read from what DRF parsed. It answered ``500`` (the body could not be read)."""
    from urllib.parse import urlencode

    def submit(key: str, note: str = "n") -> Any:
        fields = {"idempotency_key": key, "note": note}
        if form == "urlencoded":
            body, content_type = urlencode(fields).encode(), "application/x-www-form-urlencoded"
        else:
            body, content_type = encode_multipart(BOUNDARY, fields), MULTIPART_CONTENT
        return api.client.generic(method.upper(), "/uploads/form-key/", body, content_type)

    key = new_key()
    first = submit(key)
    assert first.status_code == 200, first.content
    again = submit(key)
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    changed = submit(key, note="changed")
    assert changed.status_code == 422, changed.content
    assert submit(new_key()).status_code == 200
    assert Charge.objects.filter(account="form-key").count() == 2
