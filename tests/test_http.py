"""The HTTP contract, request by request, counting side effects every time."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django import db
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpResponse
from django.test import override_settings
from django.utils import timezone
from freezegun import freeze_time

from django_idempotency import _problems
from django_idempotency.models import IdempotencyRecord, RecordStatus
from django_idempotency.testing import assert_replay
from tests.helpers import ApiClient, needs_drf, needs_ninja, new_key, says_nothing_of_the_server
from tests.testapp.models import Charge, ProviderCall, ProviderCharge

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

CHARGE = {"amount": 100, "currency": "EUR"}


def drf(path: str):
    return pytest.param(path, marks=needs_drf)


def ninja(path: str):
    return pytest.param(path, marks=needs_ninja)


def problem(response, code: str, status: int) -> dict:
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/problem+json"
    body = json.loads(response.content)
    assert body["code"] == code
    assert body["status"] == status
    assert {"type", "title", "detail"} <= set(body)
    return body


# -- first request and replay ---------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/charges/",
        "/cbv/charges/",
        drf("/api/charges/"),
        drf("/api/generic-charges/"),
        ninja("/ninja/charges"),
    ],
)
def test_retry_replays_identical_bytes_and_runs_once(api, path):
    key = new_key()
    first = api.post(path, CHARGE, key=key)
    assert first.status_code == 201, first.content
    for _ in range(3):
        # Status, body bytes, Content-Type and Location; marked replayed, the first not.
        assert_replay(first, api.post(path, CHARGE, key=key))
    assert Charge.objects.count() == 1
    assert ProviderCharge.objects.count() == 1
    assert ProviderCall.objects.count() == 1  # replays never reach the view


def test_location_is_replayed_but_other_headers_are_not(api):
    key = new_key()
    first = api.post("/charges/", CHARGE, key=key)
    retry = api.post("/charges/", CHARGE, key=key)
    assert first["Location"].startswith("/charges/")
    assert retry["Location"] == first["Location"]
    assert "X-Request-Trace" in first
    assert "X-Request-Trace" not in retry


@override_settings(IDEMPOTENCY={"REPLAY_HEADERS": ["X-Request-Trace"]})
def test_allow_listed_headers_are_replayed(api):
    key = new_key()
    first = api.post("/charges/", CHARGE, key=key)
    retry = api.post("/charges/", CHARGE, key=key)
    assert retry["X-Request-Trace"] == first["X-Request-Trace"]


def test_set_cookie_is_never_stored_or_replayed(api):
    key = new_key()
    payload = {"cookie": True, "headers": {"X-Keep": "1"}}
    first = api.post("/outcome/", payload, key=key)
    assert "session-ish" in first.cookies
    record = IdempotencyRecord.objects.get()
    assert all(name.lower() != "set-cookie" for name, _ in record.response_headers)
    retry = api.post("/outcome/", payload, key=key)
    assert "session-ish" not in retry.cookies
    assert Charge.objects.count() == 1


@override_settings(IDEMPOTENCY={"REPLAY_HEADERS": ["Set-Cookie", "Date"]})
def test_allow_listing_a_never_stored_header_refuses_the_request(api):
    # Not silently dropped from the allow-list: the setting is wrong (check E009), and no
    # request runs on it.
    with pytest.raises(ImproperlyConfigured, match="date, set-cookie are never stored"):
        api.post("/outcome/", {"cookie": True}, key=new_key())
    assert IdempotencyRecord.objects.count() == 0
    assert Charge.objects.count() == 0


# -- the payload check ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/charges/", ninja("/ninja/charges")])
def test_same_key_different_payload_is_422_without_effect(api, path):
    key = new_key()
    api.post(path, CHARGE, key=key)
    response = api.post(path, {"amount": 999, "currency": "EUR"}, key=key)
    problem(response, "idempotency_key_reused", 422)
    assert Charge.objects.count() == 1
    assert ProviderCall.objects.count() == 1


def test_json_is_compared_canonically(api):
    key = new_key()
    api.post("/charges/", '{"amount":100,"currency":"EUR"}', key=key)
    retry = api.post("/charges/", '{ "currency": "EUR",\n  "amount": 100 }', key=key)
    assert retry.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


def test_url_kwargs_are_part_of_the_request(api):
    key = new_key()
    api.post("/charges/1/items/", CHARGE, key=key)
    # Another shop: same route (so the same operation), another request.
    problem(api.post("/charges/2/items/", CHARGE, key=key), "idempotency_key_reused", 422)
    assert Charge.objects.count() == 1


def test_mismatch_is_not_confused_with_a_validation_422(api):
    key = new_key()
    response = api.post("/charges/", {"amount": 0, "currency": "EUR"}, key=key)
    assert response.status_code == 422
    assert response["Content-Type"] == "application/json"
    assert "code" not in json.loads(response.content)


# -- which outcomes are stored ---------------------------------------------------------


OUTCOMES = ["/outcome/", ninja("/ninja/outcome")]


@pytest.mark.parametrize("path", OUTCOMES)
@pytest.mark.parametrize("status", [200, 201, 202, 204, 400, 402, 404, 410, 422])
def test_deterministic_outcomes_are_stored_and_replayed(api, status, path):
    key = new_key()
    payload = {"status": status, "body": "" if status == 204 else f"outcome {status}"}
    first = api.post(path, payload, key=key)
    retry = api.post(path, payload, key=key)
    assert first.status_code == retry.status_code == status
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


@pytest.mark.parametrize("path", OUTCOMES)
@pytest.mark.parametrize("status", [500, 502, 503, 409, 429])
def test_transient_and_server_errors_roll_back_and_release(api, status, path):
    key = new_key()
    payload = {"status": status, "body": "try later"}
    first = api.post(path, payload, key=key)
    assert first.status_code == status
    assert Charge.objects.count() == 0  # the view's write was rolled back
    assert not IdempotencyRecord.objects.exists()  # the claim was released
    again = api.post(path, payload, key=key)
    assert again.status_code == status
    assert "Idempotent-Replayed" not in again  # it ran afresh


@pytest.mark.parametrize("path", OUTCOMES)
def test_exception_rolls_back_and_releases(api, path):
    key = new_key()
    api.client.raise_request_exception = True
    with pytest.raises(RuntimeError):
        api.post(path, {"raise": True}, key=key)
    assert Charge.objects.count() == 0
    assert not IdempotencyRecord.objects.exists()


@needs_drf
def test_drf_validation_error_is_a_stored_outcome(api):
    key = new_key()
    first = api.post("/api/charges/", {"amount": -5, "currency": "EUR"}, key=key)
    assert first.status_code == 400
    retry = api.post("/api/charges/", {"amount": -5, "currency": "EUR"}, key=key)
    assert retry.status_code == 400
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 0
    assert ProviderCall.objects.count() == 0


def test_view_that_marks_rollback_keeps_its_answer_but_not_its_writes(api):
    key = new_key()
    first = api.post("/outcome/", {"rollback": True, "status": 400}, key=key)
    assert first.status_code == 400
    assert Charge.objects.count() == 0
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED
    assert api.post("/outcome/", {"rollback": True, "status": 400}, key=key).content == (
        first.content
    )


@override_settings(IDEMPOTENCY={"MAX_RESPONSE_BYTES": 100})
def test_response_over_the_size_limit_is_rolled_back_not_truncated(api):
    key = new_key()
    response = api.post("/outcome/", {"size": 101}, key=key)
    problem(response, "idempotency_response_not_storable", 500)
    assert Charge.objects.count() == 0
    assert not IdempotencyRecord.objects.exists()
    ok = api.post("/outcome/", {"size": 100}, key=new_key())
    assert ok.status_code == 200
    assert len(IdempotencyRecord.objects.get().response_body) == 100


def test_streaming_response_cannot_be_kept(api):
    response = api.post("/outcome/", {"stream": True}, key=new_key())
    problem(response, "idempotency_response_not_storable", 500)
    assert Charge.objects.count() == 0
    assert not IdempotencyRecord.objects.exists()


# -- the key ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["/charges/", drf("/api/charges/"), drf("/api/fn-charges/"), ninja("/ninja/charges")],
)
def test_missing_key_is_400(api, path):
    problem(api.post(path, CHARGE), "idempotency_key_missing", 400)
    assert Charge.objects.count() == 0
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.parametrize("path", ["/charges/", ninja("/ninja/charges")])
@pytest.mark.parametrize("key", ["", " ", "x" * 256, "caf\u00e9".encode().decode("latin-1"), "a b"])
def test_malformed_key_is_400(api, key, path):
    problem(api.post(path, CHARGE, key=key), "idempotency_key_invalid", 400)
    assert Charge.objects.count() == 0
    assert not IdempotencyRecord.objects.exists()


def test_structured_field_string_is_the_same_key(api):
    api.post("/charges/", CHARGE, key="abc-123")
    retry = api.post("/charges/", CHARGE, key='"abc-123"')
    assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


@pytest.mark.parametrize("path", ["/charges/optional/", ninja("/ninja/charges/optional")])
def test_key_not_required_runs_unprotected_without_a_record(api, path):
    assert api.post(path, CHARGE).status_code == 201
    assert api.post(path, CHARGE).status_code == 201
    assert Charge.objects.count() == 2
    assert not IdempotencyRecord.objects.exists()
    key = new_key()
    api.post(path, CHARGE, key=key)
    api.post(path, CHARGE, key=key)
    assert Charge.objects.count() == 3


@override_settings(IDEMPOTENCY={"REQUIRED": False})
def test_required_setting(api):
    assert api.post("/charges/", CHARGE).status_code == 201
    assert not IdempotencyRecord.objects.exists()


@override_settings(IDEMPOTENCY={"HEADER": "X-Request-Key"})
def test_header_name_setting(api):
    key = new_key()
    api.post("/charges/", CHARGE, headers={"X-Request-Key": key})
    retry = api.post("/charges/", CHARGE, headers={"X-Request-Key": key})
    assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


# -- methods ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/charges/", "/cbv/charges/", drf("/api/charges/"), ninja("/ninja/charges")]
)
def test_get_is_untouched(api, path):
    response = api.client.get(path)
    assert response.status_code == 200
    assert not IdempotencyRecord.objects.exists()


@needs_drf
def test_put_and_delete_are_untouched_unless_configured(api, user):
    response = api.send("put", "/api/custom/", {}, None, headers={"X-Tenant": "t"})
    # CustomOperationAPIView protects PUT explicitly
    problem(response, "idempotency_key_missing", 400)
    charge = Charge.objects.create(account=f"user:{user.pk}", amount=1, currency="EUR")
    assert api.client.delete(f"/api/charges/{charge.pk}/").status_code == 204
    assert api.send("put", f"/api/charges/{charge.pk}/", CHARGE, None).status_code == 404
    assert not IdempotencyRecord.objects.exists()


@needs_drf
def test_patch_is_protected(api, user):
    charge = Charge.objects.create(account=f"user:{user.pk}", amount=1, currency="EUR")
    problem(api.patch(f"/api/charges/{charge.pk}/", {"amount": 5}), "idempotency_key_missing", 400)
    key = new_key()
    first = api.patch(f"/api/charges/{charge.pk}/", {"amount": 5}, key=key)
    assert first.status_code == 200
    assert api.patch(f"/api/charges/{charge.pk}/", {"amount": 5}, key=key).content == (
        first.content
    )
    assert IdempotencyRecord.objects.get().operation == "charge.partial_update"


# -- identity --------------------------------------------------------------------------


def test_anonymous_is_refused(anon_api):
    problem(anon_api.post("/charges/", CHARGE, key=new_key()), "idempotency_account_missing", 403)
    assert Charge.objects.count() == 0
    assert ProviderCall.objects.count() == 0
    assert not IdempotencyRecord.objects.exists()


@needs_drf
def test_anonymous_is_refused_even_where_drf_allows_anyone(anon_api):
    response = anon_api.post("/api/open-charges/", CHARGE, key=new_key())
    problem(response, "idempotency_account_missing", 403)
    assert Charge.objects.count() == 0
    assert ProviderCall.objects.count() == 0
    assert not IdempotencyRecord.objects.exists()


@needs_drf
def test_drf_authentication_runs_before_the_claim(anon_api):
    response = anon_api.post("/api/charges/", CHARGE, key=new_key())
    assert response.status_code in (401, 403)
    assert response["Content-Type"] != "application/problem+json"
    assert not IdempotencyRecord.objects.exists()


def test_cross_tenant_key_collision(user, other_user):
    alice, bob = ApiClient(user), ApiClient(other_user)
    key = "shared-key"
    a = alice.post("/charges/", {"amount": 100, "currency": "EUR"}, key=key)
    b = bob.post("/charges/", {"amount": 100, "currency": "EUR"}, key=key)
    assert a.status_code == b.status_code == 201
    assert "Idempotent-Replayed" not in b
    assert a.content != b.content
    assert Charge.objects.count() == 2
    assert ProviderCharge.objects.count() == 2  # downstream keys differ per account too
    assert alice.post("/charges/", {"amount": 100, "currency": "EUR"}, key=key).content == (
        a.content
    )
    assert bob.post("/charges/", {"amount": 100, "currency": "EUR"}, key=key).content == (b.content)
    # A different payload from Bob is Bob's own mismatch, not a view of Alice's record.
    problem(
        bob.post("/charges/", {"amount": 5, "currency": "EUR"}, key=key),
        "idempotency_key_reused",
        422,
    )


def test_another_models_principal_is_named_by_its_model(user):
    """``request.user`` set to an authenticated instance of another model than the user
    model (a service account) with the primary key of a user: the default resolver never
    names both ``user:<pk>``."""
    from types import SimpleNamespace

    from django.contrib.auth.models import AnonymousUser

    from django_idempotency.accounts import user_account
    from tests.testapp.models import ProviderCall

    service = ProviderCall(pk=user.pk, key="service")
    service.is_authenticated = True  # type: ignore[attr-defined]
    assert user_account(SimpleNamespace(user=user)) == f"user:{user.pk}"
    assert user_account(SimpleNamespace(user=service)) == f"testapp.providercall:{user.pk}"
    assert user_account(SimpleNamespace(user=AnonymousUser())) is None
    # An object that stands for a user without a model of its own (a token's user) is one.
    token_user = SimpleNamespace(pk=user.pk, is_authenticated=True)
    assert user_account(SimpleNamespace(user=token_user)) == f"user:{user.pk}"


def test_a_principal_without_a_primary_key_is_no_account():
    """A stateless authentication that sets an unsaved user (built from a token's claims,
    never stored) or an unsaved instance of another model: ``user:None`` would be every such
    caller's account, and one key sent by two of them would replay the first one's outcome
    to the other. Refused as without an account, and nothing runs."""
    from django.contrib.auth import get_user_model
    from django.test import RequestFactory

    from tests.testapp import views

    key = new_key()
    service = ProviderCall(key="service")
    service.is_authenticated = True  # type: ignore[attr-defined]
    for principal in (
        get_user_model()(username="alice"),
        get_user_model()(username="bob"),
        service,
    ):
        request = RequestFactory().post(
            "/charges/",
            json.dumps(CHARGE),
            content_type="application/json",
            HTTP_IDEMPOTENCY_KEY=key,
        )
        request.user = principal  # type: ignore[assignment]
        problem(views.charges(request), "idempotency_account_missing", 403)
    assert Charge.objects.count() == 0
    assert ProviderCall.objects.count() == 0
    assert not IdempotencyRecord.objects.exists()


def test_account_from_a_custom_resolver(anon_api):
    key = new_key()
    a = anon_api.post("/charges/tenant/", CHARGE, key=key, headers={"X-Tenant": "t1"})
    b = anon_api.post("/charges/tenant/", CHARGE, key=key, headers={"X-Tenant": "t2"})
    assert "Idempotent-Replayed" not in b
    assert a.content != b.content
    assert set(IdempotencyRecord.objects.values_list("account", flat=True)) == {"t1", "t2"}


def test_operations_scope_keys(api):
    key = new_key()
    api.post("/charges/", CHARGE, key=key)
    other = api.post("/cbv/charges/", CHARGE, key=key)
    assert "Idempotent-Replayed" not in other
    assert Charge.objects.count() == 2
    assert set(IdempotencyRecord.objects.values_list("operation", flat=True)) == {
        "POST charges/",
        "cbv.charges",
    }


@needs_drf
def test_operation_names(api):
    api.post("/api/charges/", CHARGE, key=new_key())
    api.post("/api/fn-charges/", CHARGE, key=new_key())
    api.post("/api/custom/", {}, key=new_key(), headers={"X-Tenant": "t"})
    api.post("/api/generic-charges/", CHARGE, key=new_key())
    assert set(IdempotencyRecord.objects.values_list("operation", flat=True)) == {
        "charge.create",
        "POST api/generic-charges/",
        "POST api/fn-charges/",
        "custom.op",
    }


def test_downstream_key_is_stable_and_keyed(api):
    key = new_key()
    api.post("/charges/", CHARGE, key=key)
    provider_key = ProviderCharge.objects.get().key
    assert key not in provider_key
    assert len(provider_key) == 64


# -- expiry ----------------------------------------------------------------------------


def test_retry_after_ttl_runs_again(api):
    key = new_key()
    start = timezone.now()
    with freeze_time(start):
        api.post("/charges/", CHARGE, key=key)
    with freeze_time(start + timedelta(hours=24) - timedelta(seconds=1)):
        assert api.post("/charges/", CHARGE, key=key)["Idempotent-Replayed"] == "true"
    with freeze_time(start + timedelta(hours=24, seconds=1)):
        again = api.post("/charges/", CHARGE, key=key)
        assert again.status_code == 201
        assert "Idempotent-Replayed" not in again
    assert Charge.objects.count() == 2
    assert IdempotencyRecord.objects.count() == 1


def test_after_ttl_a_different_payload_is_a_new_request(api):
    key = new_key()
    start = timezone.now()
    with freeze_time(start):
        api.post("/charges/", CHARGE, key=key)
    with freeze_time(start + timedelta(days=2)):
        assert api.post("/charges/", {"amount": 7, "currency": "EUR"}, key=key).status_code == 201
    assert Charge.objects.count() == 2


# -- the store -------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/charges/tenant/", ninja("/ninja/charges/tenant")])
def test_store_unavailable_is_503_and_nothing_runs(anon_api, unreachable_store, path):
    response = anon_api.post(path, CHARGE, key=new_key(), headers={"X-Tenant": "t"})
    body = problem(response, "idempotency_store_unavailable", 503)
    assert response["Retry-After"]
    assert body["status"] == 503
    assert ProviderCall.objects.using("provider").count() == 0


@pytest.mark.parametrize("path", ["/charges/", "/cbv/charges/"])
def test_store_unavailable_for_a_logged_in_caller_is_503_and_nothing_runs(
    api, unreachable_store, path
):
    """The default resolver names the caller from the session's user, which the database
    holds: when it cannot be reached, that read fails before the claim, and the answer is
    the store's ``503`` (never the ``500`` of an unhandled error), nothing run."""
    response = api.post(path, CHARGE, key=new_key())
    body = problem(response, "idempotency_store_unavailable", 503)
    assert int(response["Retry-After"]) >= 1
    assert body["detail"] == _problems.NOT_RUN
    says_nothing_of_the_server(body)
    assert ProviderCall.objects.using("provider").count() == 0


@pytest.mark.parametrize(
    "path",
    [
        drf("/api/charges/"),
        drf("/api/generic-charges/"),
        drf("/api/custom/"),
        ninja("/ninja/charges"),
        ninja("/ninja/async/charges"),
    ],
)
def test_store_unavailable_while_the_framework_authenticates_is_503_and_nothing_runs(
    api, unreachable_store, path
):
    """DRF's and django-ninja's authentication of a protected request read the session's
    user before the claim: when the database cannot be reached, the answer is the store's
    ``503`` saying nothing ran, as for the decorator (never the ``500`` of an unhandled
    error)."""
    response = api.post(path, CHARGE, key=new_key(), headers={"X-Tenant": "t"})
    body = problem(response, "idempotency_store_unavailable", 503)
    assert int(response["Retry-After"]) >= 1
    assert body["detail"] == _problems.NOT_RUN
    says_nothing_of_the_server(body)
    assert ProviderCall.objects.using("provider").count() == 0


@needs_ninja
@pytest.mark.skipif(
    settings.TEST_DB == "sqlite", reason="SQLite's unreachable store is its records' table"
)
def test_a_request_without_a_key_where_keys_are_optional_keeps_its_own_database_error(
    api, unreachable_store
):
    """Without a key where keys are optional the operation runs unprotected: a database
    error of ninja's authentication is ninja's own, as without the decorator."""
    with pytest.raises(db.OperationalError):
        api.post("/ninja/charges/optional", CHARGE)
    assert ProviderCall.objects.using("provider").count() == 0


def test_overlong_or_nul_accounts_are_stored_by_their_hash(anon_api):
    key = new_key()
    long_tenant = "t" * 300
    first = anon_api.post("/charges/tenant/", CHARGE, key=key, headers={"X-Tenant": long_tenant})
    retry = anon_api.post("/charges/tenant/", CHARGE, key=key, headers={"X-Tenant": long_tenant})
    other = anon_api.post("/charges/tenant/", CHARGE, key=key, headers={"X-Tenant": "t" * 301})
    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in other
    accounts = set(IdempotencyRecord.objects.values_list("account", flat=True))
    assert len(accounts) == 2
    assert all(a.startswith("sha256:") and len(a) == 71 for a in accounts)
    assert Charge.objects.count() == 2


def test_keys_and_accounts_are_case_sensitive(anon_api):
    """On MySQL/MariaDB too, where default collations ignore case."""
    key = "Case-" + new_key()
    lower = anon_api.post("/charges/tenant/", CHARGE, key=key, headers={"X-Tenant": "acme"})
    upper_key = anon_api.post(
        "/charges/tenant/", CHARGE, key=key.upper(), headers={"X-Tenant": "acme"}
    )
    upper_account = anon_api.post("/charges/tenant/", CHARGE, key=key, headers={"X-Tenant": "ACME"})
    for response in (lower, upper_key, upper_account):
        assert response.status_code == 201
        assert "Idempotent-Replayed" not in response
    assert Charge.objects.count() == 3
    assert IdempotencyRecord.objects.count() == 3


def test_context_of_is_the_typed_request_idempotency(rf):
    from django_idempotency import IdempotencyContext, context_of
    from django_idempotency.decorators import idempotent

    seen: list[IdempotencyContext | None] = []

    @idempotent(account=lambda request: "tenant:1", operation="typed")
    def view(request):
        seen.append(context_of(request))
        return HttpResponse(status=201)

    request = rf.post("/typed/", b"{}", content_type="application/json")
    request.META["HTTP_IDEMPOTENCY_KEY"] = "typed-1"
    assert view(request).status_code == 201
    (context,) = seen
    assert context is request.idempotency
    assert (context.key, context.operation, context.account) == ("typed-1", "typed", "tenant:1")
    assert context_of(rf.post("/typed/")) is None  # not protected
