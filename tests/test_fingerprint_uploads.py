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
from django.test.client import BOUNDARY, MULTIPART_CONTENT, encode_multipart

from tests.helpers import needs_drf, new_key
from tests.testapp.models import Charge

pytestmark = [
    pytest.mark.django_db(transaction=True, databases="__all__"),
    pytest.mark.urls("tests.testapp.upload_urls"),
    needs_drf,
]

PATH = "/uploads/read-first/"


def upload(api: Any, method: str, key: str, content: bytes, note: str = "n") -> Any:
    body = encode_multipart(
        BOUNDARY, {"note": note, "file": SimpleUploadedFile("invoice.txt", content)}
    )
    return api.client.generic(
        method.upper(), PATH, body, content_type=MULTIPART_CONTENT, headers={"Idempotency-Key": key}
    )


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
