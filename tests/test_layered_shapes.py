"""One endpoint protected by two layers of the package, or by the decorator on a DRF view's
``dispatch``: each shape protects (one run per key, the retry replayed, as the audit says)
or is refused.

- ``IdempotencyMixin`` with ``method_decorator(idempotent, name="post")`` besides, and
  ``method_decorator(idempotent)`` on both ``dispatch`` and ``post`` of a Django view: the
  inner layer claimed the record the outer layer held for the same request, and every
  request, first or retry, answered ``409 idempotency_key_in_use`` (never stored, so for
  ever), the handler never ran, while the audit listed the endpoint as protected.
- ``method_decorator(idempotent, name="dispatch")`` on a DRF ``APIView``: the claim came
  before DRF's authentication, so a caller DRF authenticates by a header (Basic, a token)
  was refused on every request (``403 idempotency_account_missing``) while the audit
  called the endpoint protected.
"""

from __future__ import annotations

import base64
import io
import json

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.test import Client

pytest.importorskip("rest_framework")

from django_idempotency.models import IdempotencyRecord, RecordStatus
from tests.helpers import new_key
from tests.testapp.models import Charge

pytestmark = [
    pytest.mark.django_db(transaction=True, databases="__all__"),
    pytest.mark.urls("tests.testapp.layered_urls"),
]

LAYERED = {
    "/mixin-and-decorator/": "mixin_and_decorator",
    "/dispatch-and-handler/": "dispatch_and_handler",
}


def _audit() -> dict[str, dict[str, object]]:
    out = io.StringIO()
    call_command("idempotency_audit", "--format", "json", stdout=out)
    return {e["url"]: e for e in json.loads(out.getvalue())["endpoints"] if e["method"] == "POST"}


@pytest.mark.parametrize("path", LAYERED)
def test_two_layers_on_one_endpoint_run_it_once_and_replay_the_retry(user, path):
    client = Client()
    client.force_login(user)
    key = new_key()
    first, retry = (
        client.post(path, {}, content_type="application/json", headers={"Idempotency-Key": key})
        for _ in range(2)
    )
    assert (first.status_code, retry.status_code) == (201, 201), first.content
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.filter(account=LAYERED[path]).count() == 1
    record = IdempotencyRecord.objects.get()
    assert record.status == RecordStatus.COMPLETED
    # The record is the one the audit names.
    assert _audit()[path]["operation"] == record.operation


@pytest.mark.parametrize("path", LAYERED)
def test_two_layers_with_another_key_run_again(user, path):
    client = Client()
    client.force_login(user)
    for _ in range(2):
        answer = client.post(
            path, {}, content_type="application/json", headers={"Idempotency-Key": new_key()}
        )
        assert answer.status_code == 201
    assert Charge.objects.filter(account=LAYERED[path]).count() == 2
    assert IdempotencyRecord.objects.filter(status=RecordStatus.COMPLETED).count() == 2


def test_the_decorator_on_a_drf_views_dispatch_is_refused_and_listed_unprotected(user):
    user.set_password("secret")
    user.save()
    basic = base64.b64encode(f"{user.get_username()}:secret".encode()).decode()
    client = Client(raise_request_exception=True)
    with pytest.raises(ImproperlyConfigured, match="IdempotencyMixin"):
        client.post(
            "/drf-dispatch/",
            {},
            content_type="application/json",
            headers={"Idempotency-Key": new_key(), "Authorization": f"Basic {basic}"},
        )
    assert not Charge.objects.exists()
    assert not IdempotencyRecord.objects.exists()
    row = _audit()["/drf-dispatch/"]
    assert (row["protected"], row["by"]) == (False, None)


@pytest.mark.parametrize("mode", ["operation", "view"])
@pytest.mark.parametrize("bare", [True, False], ids=["bare", "with-arguments"])
def test_ninja_add_decorator_with_idempotent_is_refused_where_the_urls_are_built(mode, bare):
    """ninja applies a router's (or the API's) decorators to the copy of each operation it
    serves, after the operation was built: the package's ``@idempotent`` then protected the
    router's template operation, never the one served (two POSTs with one key ran twice,
    and nothing said so), or failed with an unclear ``AttributeError`` (``mode="view"``).
    It is refused when ninja builds the URLs, saying where to put it."""
    ninja = pytest.importorskip("ninja")
    from django_idempotency.ninja import idempotent as ninja_idempotent

    api = ninja.NinjaAPI(urls_namespace=f"add-decorator-{mode}-{bare}")
    router = ninja.Router()
    router.add_decorator(ninja_idempotent if bare else ninja_idempotent(ttl=60), mode=mode)
    ran = []

    @router.post("/charges")
    def create_charge(request: object) -> dict[str, int]:
        ran.append(request)
        return {"id": 1}

    api.add_router("/r", router)
    with pytest.raises(ImproperlyConfigured, match="beneath each operation's route decorator"):
        api.urls  # noqa: B018
    assert ran == []


def test_a_viewsets_decorated_action_runs_once_and_the_audit_says_so(user):
    # method_decorator(idempotent, name="create") on a ViewSet without the mixin: the claim
    # comes when DRF calls the action, after its checks. The audit followed the handler of
    # the HTTP method (a viewset has no post) and listed it unprotected.
    client = Client()
    client.force_login(user)
    key = new_key()
    first, retry = (
        client.post(
            "/decorated-action/", {}, content_type="application/json",
            headers={"Idempotency-Key": key},
        )
        for _ in range(2)
    )  # fmt: skip
    assert (first.status_code, retry.status_code) == (201, 201), first.content
    assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.filter(account="decorated_action").count() == 1
    row = _audit()["/decorated-action/"]
    assert (row["protected"], row["by"]) == (True, "decorator")


def test_the_decorator_on_a_drf_views_dispatch_is_a_check_error():
    # Refused where the project is checked (runserver, migrate, the test runner), not only
    # at the view's first request.
    from django.core.checks import run_checks

    from django_idempotency import _check_ids

    errors = [
        m
        for m in run_checks(tags=["urls"])
        if m.id == _check_ids.error("DECORATOR_ON_DRF_DISPATCH")
    ]
    assert [e.level for e in errors] == [40]  # Error
    assert "tests.testapp.layered_urls.DrfDispatch" in errors[0].msg
    assert "IdempotencyMixin" in errors[0].hint


@pytest.mark.urls("tests.testapp.urls")
def test_no_other_shape_of_the_test_project_is_reported_as_the_decorator_on_dispatch():
    from django.core.checks import run_checks

    from django_idempotency import _check_ids

    ids = {m.id for m in run_checks(tags=["urls"])}
    assert _check_ids.error("DECORATOR_ON_DRF_DISPATCH") not in ids
