"""django-ninja: what only ninja operations do (the shared HTTP contract is parametrized into
test_http.py, test_concurrency.py and test_async.py). Skipped where ninja is not installed."""

from __future__ import annotations

import inspect
import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

pytest.importorskip("ninja")

from django.core.cache import cache
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.http import HttpRequest
from django.test import override_settings
from ninja import NinjaAPI, Router
from ninja.security import django_auth

from django_idempotency import _problems
from django_idempotency.models import IdempotencyRecord, RecordStatus
from django_idempotency.ninja import idempotent
from tests.helpers import ApiClient, new_key, postgres_only
from tests.testapp import ninja_api
from tests.testapp.models import Charge, ProviderCall

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

CHARGE = {"amount": 100, "currency": "EUR"}


def problem(response: Any, code: str, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.content
    assert response["Content-Type"] == _problems.PROBLEM_CONTENT_TYPE
    body: dict[str, Any] = json.loads(response.content)
    assert body["code"] == code
    return body


# -- authentication comes first --------------------------------------------------------


def test_unauthenticated_request_is_refused_by_ninja_before_any_claim(anon_api):
    response = anon_api.post("/ninja/charges", CHARGE, key=new_key())
    assert response.status_code == 401
    assert json.loads(response.content) == {"detail": "Unauthorized"}  # ninja's own answer
    assert not IdempotencyRecord.objects.exists()
    assert Charge.objects.count() == 0
    assert ProviderCall.objects.count() == 0


def test_wrong_password_is_refused_before_any_claim(user):
    client = ApiClient(None)
    auth = {"Authorization": "Basic " + "d3Jvbmc6d3Jvbmc="}  # wrong:wrong
    response = client.post("/ninja/charges", CHARGE, key=new_key(), headers=auth)
    assert response.status_code == 401
    assert not IdempotencyRecord.objects.exists()
    assert ProviderCall.objects.count() == 0


def test_a_throttled_request_never_claims(api):
    throttling = pytest.importorskip("ninja.throttling")
    cache.clear()
    router = Router()

    @router.post("/throttled", throttle=throttling.UserRateThrottle("1/h"))
    @idempotent(operation="throttled")
    def throttled(request: Any) -> dict[str, bool]:
        Charge.objects.create(account="throttled", amount=1, currency="EUR")
        return {"ok": True}

    with served(router, auth=django_auth):
        first = api.post("/throttled", {}, key=new_key())
        second = api.post("/throttled", {}, key=new_key())
    assert first.status_code == 200
    assert second.status_code == 429  # ninja's answer, before any claim
    assert IdempotencyRecord.objects.count() == 1
    assert Charge.objects.count() == 1


def test_account_is_the_user_ninja_authenticated(user):
    """A bearer class that answers a user: ``request.user`` is anonymous, the account is
    ``user:<pk>`` of ``request.auth``."""
    client = ApiClient(None)
    headers = {"Authorization": f"Bearer user-{user.pk}"}
    key = new_key()
    first = client.post("/ninja/charges/token", CHARGE, key=key, headers=headers)
    retry = client.post("/ninja/charges/token", CHARGE, key=key, headers=headers)
    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().account == f"user:{user.pk}"
    assert Charge.objects.count() == 1


def test_another_models_principal_never_shares_the_users_account_of_its_primary_key(user):
    """A service account (an authenticated instance of another model) whose primary key is a
    user's: one key sent by both runs twice, each under an account of its own."""
    client = ApiClient(None)
    key = new_key()
    for token in (f"user-{user.pk}", f"service-{user.pk}", f"service-{user.pk}"):
        answer = client.post(
            "/ninja/charges/service", CHARGE, key=key, headers={"Authorization": f"Bearer {token}"}
        )
        assert answer.status_code == 201
    assert answer["Idempotent-Replayed"] == "true"  # the service's own retry
    assert Charge.objects.count() == 2
    assert set(IdempotencyRecord.objects.values_list("account", flat=True)) == {
        f"user:{user.pk}",
        f"testapp.providercall:{user.pk}",
    }


def test_an_authentication_result_that_is_no_user_names_no_account(db):
    client = ApiClient(None)
    response = client.post(
        "/ninja/charges/opaque", CHARGE, key=new_key(), headers={"Authorization": "Bearer opaque"}
    )
    problem(response, "idempotency_account_missing", 403)
    assert not IdempotencyRecord.objects.exists()
    assert ProviderCall.objects.count() == 0


@override_settings(IDEMPOTENCY={"ACCOUNT_RESOLVER": "tests.testapp.views.tenant_account"})
def test_a_project_account_resolver_decides_by_itself(api):
    key = new_key()
    api.post("/ninja/charges", CHARGE, key=key, headers={"X-Tenant": "acme"})
    assert IdempotencyRecord.objects.get().account == "acme"


# -- methods, names and keys -----------------------------------------------------------


def test_patch_is_protected(api, user):
    charge = Charge.objects.create(account="seed", amount=1, currency="EUR", provider_charge="7")
    path = f"/ninja/charges/{charge.pk}"
    problem(api.patch(path, {"amount": 5}), "idempotency_key_missing", 400)
    assert Charge.objects.filter(account="patch").count() == 0
    key = new_key()
    first = api.patch(path, {"amount": 5}, key=key)
    retry = api.patch(path, {"amount": 5}, key=key)
    assert first.status_code == 200, first.content
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.filter(account="patch").count() == 1  # the operation ran once
    problem(api.patch(path, {"amount": 6}, key=key), "idempotency_key_reused", 422)
    assert IdempotencyRecord.objects.get().operation == "PATCH ninja/charges/<int:charge_id>"


def test_get_needs_no_key_and_stores_nothing(api):
    for _ in range(2):
        response = api.client.get("/ninja/charges")
        assert response.status_code == 200
    assert not IdempotencyRecord.objects.exists()


def test_operation_names(api):
    api.post("/ninja/charges", CHARGE, key=new_key())
    api.post("/ninja/charges/named", CHARGE, key=new_key())
    api.post("/ninja/async/charges", CHARGE, key=new_key())
    assert set(IdempotencyRecord.objects.values_list("operation", flat=True)) == {
        "POST ninja/charges",  # the route and the method, as for Django views
        "charges_create",  # the route's own operation_id
        "ninja.async-charges",  # @idempotent(operation=...)
    }


def test_key_from_a_source_instead_of_the_header(api):
    headers = {"X-Event-Id": "evt_1"}
    first = api.post("/ninja/charges/by-id", CHARGE, headers=headers)
    retry = api.post("/ninja/charges/by-id", CHARGE, headers=headers, key="ignored")
    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().key == "evt_1"
    assert Charge.objects.count() == 1
    problem(api.post("/ninja/charges/by-id", CHARGE, key=new_key()), "idempotency_key_missing", 400)
    assert Charge.objects.count() == 1


# -- what ninja answers inside the claim -----------------------------------------------


def test_ninja_validation_error_is_a_stored_outcome(api):
    key = new_key()
    first = api.post("/ninja/charges", {"amount": "lots"}, key=key)
    assert first.status_code == 422
    assert "code" not in json.loads(first.content)  # ninja's 422, not the reused-key problem
    retry = api.post("/ninja/charges", {"amount": "lots"}, key=key)
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"
    assert ProviderCall.objects.count() == 0


def test_http_error_from_the_operation_is_a_stored_outcome(api):
    key = new_key()
    first = api.post("/ninja/charges", {"amount": 0, "currency": "EUR"}, key=key)
    assert first.status_code == 422
    retry = api.post("/ninja/charges", {"amount": 0, "currency": "EUR"}, key=key)
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert IdempotencyRecord.objects.get().status == RecordStatus.COMPLETED


@pytest.mark.parametrize("status", [500, 503])
def test_http_error_5xx_rolls_back_and_releases(api, status):
    key = new_key()
    for _ in range(2):
        response = api.post("/ninja/outcome", {"http_error": status}, key=key)
        assert response.status_code == status
        assert "Idempotent-Replayed" not in response  # it ran afresh
        assert Charge.objects.count() == 0  # the write before the HttpError was rolled back
        assert not IdempotencyRecord.objects.exists()


def test_streamed_response_is_not_kept(api):
    problem(
        api.post("/ninja/outcome", {"stream": True}, key=new_key()),
        "idempotency_response_not_storable",
        500,
    )
    assert Charge.objects.count() == 0
    assert not IdempotencyRecord.objects.exists()


@postgres_only  # the fake provider writes on a connection of its own: SQLite has one writer
def test_atomic_requests_runs_protected_operations(api):
    # ninja's views cannot be taken out of ATOMIC_REQUESTS: the claim commits on a connection
    # of its own (tests/test_callers_transaction.py shows it from another connection).
    connection.settings_dict["ATOMIC_REQUESTS"] = True
    key = new_key()
    try:
        first = api.post("/ninja/charges", CHARGE, key=key)
        retry = api.post("/ninja/charges", CHARGE, key=key)
        # Unprotected methods keep the request transaction.
        assert api.client.get("/ninja/charges").status_code == 200
    finally:
        connection.settings_dict["ATOMIC_REQUESTS"] = False
    assert first.status_code == 201
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1
    assert ProviderCall.objects.count() == 1


def test_ninja_test_client(user):
    """ninja's own TestClient (it calls the operation without Django's handler)."""
    from ninja.testing import TestClient

    client = TestClient(ninja_api.router)
    if type(client._build_request("GET", "/", {}, {})) is not HttpRequest:
        pytest.skip("this ninja's TestClient makes a Mock, not a request")
    headers = {"Idempotency-Key": new_key()}
    first = client.post("/charges", json=CHARGE, headers=headers, user=user)
    retry = client.post("/charges", json=CHARGE, headers=headers, user=user)
    assert first.status_code == 201, first.content
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


# -- how it is put on an operation -----------------------------------------------------


def test_above_the_route_decorator_too(api):
    router = Router()

    @idempotent(operation="above")
    @router.post("/above")
    def above(request: Any) -> dict[str, int]:
        Charge.objects.create(account="above", amount=1, currency="EUR")
        return {"charges": Charge.objects.count()}

    with served(router):
        key = new_key()
        first = api.post("/above", {}, key=key)
        retry = api.post("/above", {}, key=key)
    assert first.status_code == 200, first.content
    assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.get().operation == "above"


def _stacked_calls(api: ApiClient) -> dict[str, list[Any]]:
    """Two requests with one key to each of ``/a`` and ``/b``: what each answered."""
    answers: dict[str, list[Any]] = {}
    for route in ("/a", "/b"):
        key = new_key()
        answers[route] = [api.post(route, {}, key=key).get("Idempotent-Replayed") for _ in "12"]
    return answers


def test_a_route_decorator_above_idempotent_above_another_protects_both(api):
    """``@router.post("/a")`` above ``@idempotent`` above ``@router.post("/b")``: ninja builds
    ``/b``'s operation before ``@idempotent`` and ``/a``'s after it. Both are protected."""
    router = Router()

    @router.post("/a")
    @idempotent
    @router.post("/b")
    def stacked(request: Any) -> dict[str, int]:
        return {"id": Charge.objects.create(account="stacked", amount=1, currency="EUR").pk}

    with served(router):
        answers = _stacked_calls(api)
        rows = {e["url"]: e["protected"] for e in _audit()["endpoints"]}
    assert answers == {"/a": [None, "true"], "/b": [None, "true"]}
    assert Charge.objects.count() == 2  # one run per key
    assert rows == {"/a": True, "/b": True}


def test_idempotent_above_two_route_decorators_is_a_check_error(api):
    """``@idempotent`` above two route decorators reaches the operation of the one right
    beneath it only (ninja keeps no other): the other route runs unprotected, and ``check``
    names it rather than letting the function look protected."""
    from django.core import checks

    from django_idempotency import _check_ids

    router = Router()

    @idempotent
    @router.post("/a")
    @router.post("/b")
    def stacked(request: Any) -> dict[str, int]:
        return {"id": Charge.objects.create(account="stacked", amount=1, currency="EUR").pk}

    with served(router):
        answers = _stacked_calls(api)
        errors = [
            m
            for m in checks.run_checks(tags=[checks.Tags.urls])
            if m.id == _check_ids.error("NINJA_IDEMPOTENT_ABOVE_ROUTES")
        ]
    assert answers == {"/a": [None, "true"], "/b": [None, None]}
    assert Charge.objects.count() == 3  # /b ran for each request: what the check reports
    assert len(errors) == 1
    assert "POST /b" in errors[0].msg
    assert "stacked" in errors[0].msg


KEYED = {"Idempotency-Key": "k-on-a-django-view"}


def test_ninjas_idempotent_on_a_django_view_is_a_check_error(user):
    """ninja's ``@idempotent`` on a plain Django view (the wrong import): ninja never builds
    an operation of it, so nothing protects it and two POSTs with one key run twice. The
    audit lists it unprotected; ``check`` names it and the decorator to use (E063)."""
    from types import ModuleType

    from django.core import checks
    from django.http import JsonResponse
    from django.test import Client
    from django.urls import path

    from django_idempotency import _check_ids

    @idempotent
    def charge(request: Any) -> Any:
        Charge.objects.create(account="django-view", amount=1, currency="EUR")
        return JsonResponse({"id": 1}, status=201)

    urlconf = ModuleType("ninja_decorator_on_a_django_view")
    urlconf.urlpatterns = [path("charge/", charge)]  # type: ignore[attr-defined]
    client = Client()
    client.force_login(user)
    with override_settings(ROOT_URLCONF=urlconf):
        for _ in range(2):
            client.post("/charge/", "{}", content_type="application/json", headers=KEYED)
        errors = [
            m
            for m in checks.run_checks(tags=[checks.Tags.urls])
            if m.id == _check_ids.error("NINJA_IDEMPOTENT_OFF_NINJA")
        ]
    assert Charge.objects.count() == 2  # unprotected: what the check reports
    assert len(errors) == 1
    assert "charge" in errors[0].msg
    assert "django_idempotency.decorators.idempotent" in (errors[0].hint or "")


def test_one_operation_id_on_two_apis_is_a_check_error(api):
    """Two API versions, each with its own function under ``operation_id="create_charge"``
    (OpenAPI wants it unique per document, and each API is a document of its own): both
    routes derive the one operation, so a key sent to v1 is replayed by v2, whose function
    never runs. ``check`` names both (E060), as for a basename under two routers."""
    from types import ModuleType

    from django.core import checks
    from django.urls import path

    from django_idempotency import _check_ids

    apis = []
    for version in ("1", "2"):
        router = Router()

        @router.post("/charges", operation_id="create_charge")
        @idempotent
        def create(request: Any, version: str = version) -> dict[str, Any]:
            pk = Charge.objects.create(account=f"v{version}", amount=1, currency="EUR").pk
            return {"version": version, "id": pk}

        local = NinjaAPI(urls_namespace=f"tests-ninja-v{version}-{uuid.uuid4().hex}")
        local.add_router("/", router)
        apis.append(path(f"v{version}/", local.urls))
    urlconf = ModuleType("ninja_versions_urls")
    urlconf.urlpatterns = apis  # type: ignore[attr-defined]
    with override_settings(ROOT_URLCONF=urlconf):
        key = new_key()
        first = api.post("/v1/charges", {}, key=key)
        other = api.post("/v2/charges", {}, key=key)
        shared = _audit()["shared_operations"]
        errors = [
            m
            for m in checks.run_checks(tags=[checks.Tags.urls])
            if m.id == _check_ids.error("OPERATION_SHARED")
        ]
    assert other.content == first.content  # v2 answered v1's outcome ...
    assert list(Charge.objects.values_list("account", flat=True)) == ["v1"]  # ... unrun
    assert shared == [
        {"operation": "create_charge", "endpoints": ["POST /v1/charges", "POST /v2/charges"]}
    ]
    assert len(errors) == 1
    assert "POST /v1/charges" in errors[0].msg
    assert "POST /v2/charges" in errors[0].msg


def test_the_audit_lists_an_apis_urls_included_twice(api):
    """``api.urls`` under two prefixes (``v1/`` and ``latest/``): both serve every operation,
    one of them unprotected. The audit lists both mounts; it listed the first one only, so
    the unprotected route under ``latest/`` went unreported."""
    from types import ModuleType

    from django.urls import path

    router = Router()

    @router.post("/protected")
    @idempotent
    def protected(request: Any) -> dict[str, int]:
        return {"id": Charge.objects.create(account="protected", amount=1, currency="EUR").pk}

    @router.post("/plain")
    def plain(request: Any) -> dict[str, int]:
        return {"id": Charge.objects.create(account="plain", amount=1, currency="EUR").pk}

    local = NinjaAPI(urls_namespace=f"tests-ninja-{uuid.uuid4().hex}")
    local.add_router("/", router)
    urls = local.urls
    urlconf = ModuleType("ninja_twice_urls")
    urlconf.urlpatterns = [path("v1/", urls), path("latest/", urls)]  # type: ignore[attr-defined]
    with override_settings(ROOT_URLCONF=urlconf):
        answers = [api.post(f"/{prefix}/plain", {}, key=new_key()) for prefix in ("v1", "latest")]
        rows = [(e["url"], e["protected"]) for e in _audit()["endpoints"]]
    assert [a.status_code for a in answers] == [200, 200]
    assert Charge.objects.filter(account="plain").count() == 2  # both mounts serve it
    assert rows == [
        ("/v1/protected", True),
        ("/v1/plain", False),
        ("/latest/protected", True),
        ("/latest/plain", False),
    ]


def _audit() -> dict[str, Any]:
    import io

    from django.core.management import call_command

    out = io.StringIO()
    call_command("idempotency_audit", "--format", "json", stdout=out)
    found: dict[str, Any] = json.loads(out.getvalue())
    return found


def test_twice_is_refused():
    router = Router()
    with pytest.raises(ImproperlyConfigured, match="twice"):

        @router.post("/twice")
        @idempotent
        @idempotent
        def twice(request: Any) -> None: ...


def test_view_decorators_go_above(api):
    from ninja.decorators import decorate_view

    def traced(run: Any) -> Any:
        def wrapper(request: Any, **kw: Any) -> Any:
            response = run(request, **kw)
            response["X-Traced"] = "1"
            return response

        return wrapper

    router = Router()
    with pytest.raises(ImproperlyConfigured, match="view decorator beneath"):

        @router.post("/beneath")
        @idempotent
        @decorate_view(traced)
        def beneath(request: Any) -> None: ...

    @router.post("/above-view-decorator")
    @decorate_view(traced)
    @idempotent(operation="traced")
    def above(request: Any) -> dict[str, int]:
        Charge.objects.create(account="traced", amount=1, currency="EUR")
        return {"charges": Charge.objects.count()}

    with served(router):
        key = new_key()
        first = api.post("/above-view-decorator", {}, key=key)
        retry = api.post("/above-view-decorator", {}, key=key)
    assert first["X-Traced"] == retry["X-Traced"] == "1"
    assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


def test_a_streamed_operation_is_refused():
    streaming = pytest.importorskip("ninja.streaming", reason="needs ninja's streamed responses")
    router = Router()
    with pytest.raises(ImproperlyConfigured, match="stream"):

        @router.post("/stream", response=streaming.JSONL[int])
        @idempotent
        def stream(request: Any) -> Any:
            yield 1


@contextmanager
def served(router: Router, **api_options: Any) -> Iterator[None]:
    """``router`` on an API of its own, at the root of the URLs while the block runs."""
    from types import ModuleType

    from django.urls import path

    api = NinjaAPI(urls_namespace=f"tests-ninja-{uuid.uuid4().hex}", **api_options)
    api.add_router("/", router)
    urlconf = ModuleType("ninja_test_urls")
    urlconf.urlpatterns = [path("", api.urls)]  # type: ignore[attr-defined]
    with override_settings(ROOT_URLCONF=urlconf):
        yield


# -- the OpenAPI schema ----------------------------------------------------------------


def schema(api: NinjaAPI = ninja_api.api) -> dict[str, Any]:
    generated: dict[str, Any] = api.get_openapi_schema(path_prefix="/ninja/")
    # What ninja serves: JSON all the way down.
    parsed: dict[str, Any] = json.loads(json.dumps(generated))
    return parsed


def key_parameters(operation: dict[str, Any], header: str = "Idempotency-Key") -> list[Any]:
    return [
        p
        for p in operation.get("parameters", [])
        if p["in"] == "header" and p["name"].lower() == header.lower()
    ]


def test_schema_documents_every_protected_operation():
    paths = schema()["paths"]
    create = paths["/ninja/charges"]["post"]
    (header,) = key_parameters(create)
    assert header["required"] is True
    assert header["schema"]["maxLength"] == 255
    responses = create["responses"]
    assert set(responses) == {"201", "400", "409", "422", "503"}
    # The operation's own answer is replayed with the marker header, its schema untouched.
    assert responses["201"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChargeOut"
    }
    assert responses["201"]["headers"]["Idempotent-Replayed"]["schema"]["enum"] == ["true"]
    for status in ("400", "409", "422", "503"):
        problem_schema = responses[status]["content"]["application/problem+json"]["schema"]
        assert problem_schema["title"] == "IdempotencyProblem"
        assert problem_schema["required"] == ["type", "title", "status", "detail", "code"]
        assert problem_schema["properties"]["code"]["enum"] == [
            p.code for p in _problems.ALL_PROBLEMS
        ]
    assert "idempotency_key_missing" in responses["400"]["description"]
    assert "idempotency_key_in_use" in responses["409"]["description"]
    assert "idempotency_key_reused" in responses["422"]["description"]
    assert "idempotency_store_unavailable" in responses["503"]["description"]
    assert "Retry-After" in responses["409"]["headers"]
    assert "Retry-After" in responses["503"]["headers"]
    # PATCH is protected; the async operation is documented like the sync one.
    assert key_parameters(paths["/ninja/charges/{charge_id}"]["patch"])
    assert "409" in paths["/ninja/async/charges"]["post"]["responses"]


def test_schema_leaves_unprotected_operations_alone():
    get = schema()["paths"]["/ninja/charges"]["get"]
    assert not key_parameters(get)
    assert set(get["responses"]) == {"200"}
    assert "headers" not in get["responses"]["200"]


def test_schema_follows_the_operation_options():
    paths = schema()["paths"]
    (optional,) = key_parameters(paths["/ninja/charges/optional"]["post"])
    assert optional["required"] is False
    assert (
        "idempotency_key_missing"
        not in (paths["/ninja/charges/optional"]["post"]["responses"]["400"]["description"])
    )
    # A key taken from elsewhere is no header parameter; the problems are still documented.
    by_id = paths["/ninja/charges/by-id"]["post"]
    assert not key_parameters(by_id)
    assert "422" in by_id["responses"]


@override_settings(IDEMPOTENCY={"HEADER": "X-Request-Key", "REQUIRED": False})
def test_schema_reads_the_settings_when_it_is_generated():
    create = schema()["paths"]["/ninja/charges"]["post"]
    assert not key_parameters(create)
    (header,) = key_parameters(create, "X-Request-Key")
    assert header["required"] is False


def test_schema_keeps_the_operations_own_openapi_extra():
    router = Router()

    @router.post(
        "/extra",
        response={200: dict, 422: dict},
        openapi_extra={
            "parameters": [{"in": "header", "name": "X-Trace", "schema": {"type": "string"}}],
            "responses": {422: {"description": "Invalid input."}},
        },
    )
    @idempotent
    def extra(request: Any) -> dict[str, Any]:
        return {}

    local = NinjaAPI(urls_namespace="tests-ninja-extra")
    local.add_router("/", router)
    operation = schema(local)["paths"]["/ninja/extra"]["post"]
    names = [p["name"] for p in operation["parameters"]]
    assert names == ["Idempotency-Key", "X-Trace"]
    unprocessable = operation["responses"]["422"]
    assert unprocessable["description"] == "Invalid input."  # the operation's own words win
    assert set(unprocessable["content"]) == {"application/json", "application/problem+json"}


def test_schema_of_a_router_mounted_twice():
    """ninja clones a router's operations for each mount: both copies are protected."""
    if "url_name_prefix" not in inspect.signature(NinjaAPI.add_router).parameters:
        pytest.skip("this ninja mounts a router only once")
    router = Router()

    @router.post("/twice-mounted")
    @idempotent
    def mounted(request: Any) -> dict[str, Any]:
        return {}

    local = NinjaAPI(urls_namespace="tests-ninja-mounts")
    local.add_router("/a", router, url_name_prefix="a")
    local.add_router("/b", router, url_name_prefix="b")
    paths = schema(local)["paths"]
    for prefix in ("a", "b"):
        assert key_parameters(paths[f"/ninja/{prefix}/twice-mounted"]["post"])
