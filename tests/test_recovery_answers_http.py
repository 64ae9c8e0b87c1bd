"""What a recovery callable answers over HTTP when its answer cannot be stored (a ``5xx``).

The attempt that crashed after its external call left its claim in progress; once its lease
ran out, the next request meets the recovery callable. A callable that answers a ``5xx``
("the provider cannot be asked now") has not decided: the client gets that answer, and the
record is left to the policy, so the next request asks the callable again, as ``run_once``,
tasks and tool calls do. The view never runs again behind the policy's back (it did: the
claim was released, and the next request ran the view, and its external call, afresh).
Effects counted: the view's runs (its external calls), the callable's calls.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import Client, override_settings
from django.urls import path

from django_idempotency.decorators import idempotent
from django_idempotency.exceptions import SimulatedCrash
from django_idempotency.models import IdempotencyRecord, RecordStatus
from django_idempotency.testing import crash, expire_lease
from tests.helpers import new_key

pytestmark = pytest.mark.django_db(transaction=True)

#: The view's external calls, and the recovery callable's answers to give, in order.
CALLS: list[str] = []
ANSWERS: list[int] = []
ASKED: list[str] = []


def ask_the_provider(record: IdempotencyRecord) -> HttpResponse:
    ASKED.append(record.key)
    status = ANSWERS.pop(0)
    return JsonResponse({"provider": "asked"}, status=status)


@idempotent(operation="provider.charge", recovery=ask_the_provider)
def charge(request: HttpRequest) -> HttpResponse:
    CALLS.append("charged")  # the external call: no key makes it safe to repeat
    if len(CALLS) == 1:
        crash()  # the process dies after the call
    return JsonResponse({"charged": len(CALLS)}, status=201)


urlpatterns = [path("charge/", charge)]


@override_settings(ROOT_URLCONF=__name__)
def test_a_5xx_from_the_recovery_callable_leaves_the_record_to_it(user: Any) -> None:
    CALLS.clear()
    ASKED.clear()
    ANSWERS[:] = [503, 503, 200]
    client = Client()
    client.force_login(user)
    key = new_key()
    headers = {"Idempotency-Key": key}
    with pytest.raises(SimulatedCrash):
        client.post("/charge/", {}, headers=headers)
    assert CALLS == ["charged"]
    expire_lease(key)
    for asked in (1, 2):
        down = client.post("/charge/", {}, headers=headers)
        assert CALLS == ["charged"]  # the view did not run again
        assert len(ASKED) == asked  # the callable was asked, every time
        assert down.status_code == 503
    answered = client.post("/charge/", {}, headers=headers)
    assert answered.status_code == 200
    assert client.post("/charge/", {}, headers=headers).content == answered.content
    assert len(ASKED) == 3
    assert CALLS == ["charged"]
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED
