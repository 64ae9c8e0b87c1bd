"""What a replay needs to mean what the first answer meant.

A body compressed by the view (``@gzip_page`` beneath ``@idempotent``) is bytes that only
its ``Content-Encoding`` makes readable: the replay carries it, or a client gets compressed
bytes it takes for JSON.
"""

from __future__ import annotations

import gzip
import json
from typing import Any

import pytest
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import override_settings
from django.urls import path
from django.views.decorators.gzip import gzip_page

from django_idempotency.decorators import idempotent
from django_idempotency.testing import assert_replay
from tests.helpers import ApiClient, new_key
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True, databases="__all__")]

GZIP = {"Accept-Encoding": "gzip"}


@idempotent(operation="reports.create")
@gzip_page
def compressed(request: HttpRequest) -> HttpResponse:
    Charge.objects.create(account="report", amount=1, currency="EUR")
    return JsonResponse({"rows": ["a row"] * 50}, status=201)


urlpatterns = [
    path("reports/", compressed),
]


def decoded(response: Any) -> Any:
    """The JSON a client reads from ``response``, decoding the body as its headers say."""
    body = response.content
    if response.get("Content-Encoding") == "gzip":
        body = gzip.decompress(body)
    return json.loads(body)


@override_settings(ROOT_URLCONF=__name__)
def test_a_compressed_answer_is_replayed_with_its_content_encoding(api: ApiClient) -> None:
    key = new_key()
    first = api.post("/reports/", {}, key=key, headers=GZIP)
    assert first.status_code == 201
    assert first["Content-Encoding"] == "gzip"
    # A retry by a client that asks for no compression: it gets the first answer's bytes,
    # and the header that says how to read them.
    for headers in (GZIP, {}):
        retry = api.post("/reports/", {}, key=key, headers=headers)
        assert_replay(first, retry)
        assert retry["Content-Encoding"] == "gzip"
        assert decoded(retry) == decoded(first) == {"rows": ["a row"] * 50}
    assert Charge.objects.count() == 1


@override_settings(ROOT_URLCONF=__name__)
def test_assert_replay_compares_the_content_encoding(api: ApiClient) -> None:
    first = api.post("/reports/", {}, key=new_key(), headers=GZIP)
    again = HttpResponse(first.content, status=201, content_type=first["Content-Type"])
    again["Idempotent-Replayed"] = "true"
    with pytest.raises(AssertionError, match="content-encoding"):
        assert_replay(first, again)
