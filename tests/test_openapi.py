"""The drf-spectacular extension: protected operations document the key, the problems and the
replay header; nothing else changes. Skipped where drf-spectacular is not installed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("drf_spectacular")

from django.test import override_settings
from django.urls import URLPattern, path
from drf_spectacular.drainage import GENERATOR_STATS
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import OpenApiResponse, extend_schema
from drf_spectacular.validation import validate_schema
from hypothesis import given
from hypothesis import strategies as st
from rest_framework import generics, serializers, viewsets
from rest_framework.request import Request
from rest_framework.response import Response

from django_idempotency import _problems, openapi
from django_idempotency.drf import IdempotencyMixin
from django_idempotency.keys import MAX_KEY_LENGTH, parse_key
from tests.live import ROOT
from tests.testapp import drf_views

SPECTACULAR = "drf_spectacular.openapi.AutoSchema"
PROBLEM_REF = {"$ref": f"#/components/schemas/{openapi.PROBLEM_COMPONENT}"}


@pytest.fixture(autouse=True)
def spectacular_schema_class(settings: Any) -> None:
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_SCHEMA_CLASS": SPECTACULAR}


def generate(patterns: list[Any] | None = None, *, api_view: bool = False) -> dict[str, Any]:
    """The schema of ``patterns`` or the test app's URLs, checked against OpenAPI 3.

    The test app's ``@api_view`` function is left out unless asked for: DRF's ``@api_view``
    fixes its schema class when the module is imported (DRF's own, in the test settings),
    unless ``@idempotent`` gives it one that reads ``DEFAULT_SCHEMA_CLASS`` later.
    """
    if patterns is None:
        from tests.testapp.urls import urlpatterns

        patterns = [
            p
            for p in urlpatterns
            if api_view or getattr(p, "callback", None) is not drf_views.api_charge
        ]
    schema: dict[str, Any] = SchemaGenerator(patterns=patterns).get_schema(
        request=None, public=True
    )
    validate_schema(schema)
    return schema


def key_parameters(operation: dict[str, Any], header: str = "Idempotency-Key") -> list[Any]:
    return [
        p
        for p in operation.get("parameters", [])
        if p["in"] == "header" and p["name"].lower() == header.lower()
    ]


def operation_of(schema: dict[str, Any], route: str, method: str) -> dict[str, Any]:
    operation: dict[str, Any] = schema["paths"][route][method]
    return operation


# --- the test app: the mixin on a viewset and on an APIView ----------------------------------


def test_protected_viewset_methods_document_the_key() -> None:
    schema = generate()
    for route, method in [("/api/charges/", "post"), ("/api/charges/{id}/", "patch")]:
        (parameter,) = key_parameters(operation_of(schema, route, method))
        assert parameter["required"] is True
        assert parameter["schema"]["maxLength"] == MAX_KEY_LENGTH


def test_unprotected_methods_are_left_alone() -> None:
    schema = generate()
    for route, method in [
        ("/api/charges/", "get"),
        ("/api/charges/{id}/", "get"),
        ("/api/charges/{id}/", "put"),
        ("/api/charges/{id}/", "delete"),
    ]:
        operation = operation_of(schema, route, method)
        assert key_parameters(operation) == []
        assert not {"409", "422", "503"} & set(operation["responses"]), (route, method)
        for response in operation["responses"].values():
            assert "Idempotent-Replayed" not in response.get("headers", {})


def test_the_views_own_methods_are_protected() -> None:
    # CustomOperationAPIView: idempotency_methods = ("POST", "PUT").
    schema = generate()
    for method in ("post", "put"):
        (parameter,) = key_parameters(operation_of(schema, "/api/custom/", method))
        assert parameter["required"] is True


def test_problem_answers() -> None:
    schema = generate()
    responses = operation_of(schema, "/api/charges/", "post")["responses"]
    for status in ("400", "409", "422", "503"):
        assert responses[status]["content"] == {
            "application/problem+json": {"schema": PROBLEM_REF}
        }, status
    assert "idempotency_key_missing" in responses["400"]["description"]
    assert "idempotency_key_invalid" in responses["400"]["description"]
    assert "idempotency_key_in_use" in responses["409"]["description"]
    assert "idempotency_key_reused" in responses["422"]["description"]
    assert "idempotency_store_unavailable" in responses["503"]["description"]
    for status in ("409", "503"):
        assert responses[status]["headers"]["Retry-After"]["schema"]["type"] == "integer"
    for status in ("400", "422"):
        assert "Retry-After" not in responses[status].get("headers", {})


def test_problem_schema_lists_every_code() -> None:
    components = generate()["components"]["schemas"]
    problem = components[openapi.PROBLEM_COMPONENT]
    assert set(problem["required"]) == {"type", "title", "status", "detail", "code"}
    assert problem["properties"]["code"] == {
        "$ref": f"#/components/schemas/{openapi.CODE_COMPONENT}"
    }
    assert components[openapi.CODE_COMPONENT]["enum"] == [p.code for p in _problems.ALL_PROBLEMS]
    # drf-spectacular's enum hoisting did not take it over under a generic name.
    assert "CodeEnum" not in components


def test_problem_schema_describes_the_real_answers() -> None:
    import jsonschema  # type: ignore[import-untyped]

    components = generate()["components"]["schemas"]
    validator = jsonschema.Draft4Validator(
        {**components[openapi.PROBLEM_COMPONENT], "components": {"schemas": components}}
    )
    for problem in _problems.ALL_PROBLEMS:
        body = problem.response("detail", retry_after=1).content
        validator.validate(json.loads(body))


def test_replayable_responses_carry_the_replay_header() -> None:
    responses = operation_of(generate(), "/api/charges/", "post")["responses"]
    header = responses["201"]["headers"]["Idempotent-Replayed"]
    assert header["schema"] == {"type": "string", "enum": ["true"]}
    for status in ("400", "409", "422", "503"):
        assert "Idempotent-Replayed" not in responses[status].get("headers", {})


def test_the_mixins_docstring_never_describes_a_view() -> None:
    schema = generate()
    mixin_doc = (IdempotencyMixin.__doc__ or "").split("\n")[0]
    for route, methods in schema["paths"].items():
        for method, operation in methods.items():
            assert mixin_doc not in operation.get("description", ""), (route, method)


# --- @api_view + @idempotent ------------------------------------------------------------------


def test_decorated_api_view_documents_the_key() -> None:
    operation = operation_of(generate(api_view=True), "/api/fn-charges/", "post")
    (parameter,) = key_parameters(operation)
    assert parameter["required"] is True
    assert operation["responses"]["409"]["content"] == {
        "application/problem+json": {"schema": PROBLEM_REF}
    }


def test_decorated_api_view_keeps_drf_own_schema_class() -> None:
    # A project on DRF's own schema generation is untouched by drf-spectacular's presence.
    from rest_framework.schemas.openapi import AutoSchema as DrfAutoSchema

    drf_rest = {"DEFAULT_SCHEMA_CLASS": "rest_framework.schemas.openapi.AutoSchema"}
    with override_settings(REST_FRAMEWORK=drf_rest):
        view = drf_views.api_charge.cls()
        assert type(view.schema) is DrfAutoSchema
    view = drf_views.api_charge.cls()
    assert isinstance(view.schema, openapi.IdempotencyAutoSchema)


def test_ready_loads_the_extension() -> None:
    code = "import sys, django; django.setup(); print('django_idempotency.openapi' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == "True"


# --- views of this module: settings, per-view choices, annotations, custom schemas -----------


class AmountSerializer(serializers.Serializer[Any]):
    amount = serializers.IntegerField()


def _created(self: Any, request: Request) -> Response:
    return Response({"amount": 1}, status=201)


class OptionalKeyView(IdempotencyMixin, generics.GenericAPIView[Any]):
    """Charges where the key is optional."""

    serializer_class = AmountSerializer
    idempotency_required = False
    post = _created


class RequiredKeyView(OptionalKeyView):
    """Charges where the key is required whatever the setting says."""

    idempotency_required = True


class TaggingSchema(AutoSchema):
    def get_tags(self) -> list[str]:
        return ["tagged"]


class CustomSchemaView(IdempotencyMixin, generics.GenericAPIView[Any]):
    """A view with a schema class of its own."""

    serializer_class = AmountSerializer
    schema = TaggingSchema()
    post = _created


def generate_views(**views: Any) -> dict[str, Any]:
    patterns: list[URLPattern] = []
    for name, view in views.items():
        as_view: Callable[..., Any] = (
            view.as_view({"post": "create"})
            if issubclass(view, viewsets.ViewSetMixin)
            else view.as_view()
        )
        patterns.append(path(f"{name}/", as_view))
    GENERATOR_STATS.reset()
    schema = generate(patterns)
    # drf-spectacular found nothing to complain about in these views.
    assert not GENERATOR_STATS, (GENERATOR_STATS._warn_cache, GENERATOR_STATS._error_cache)
    return schema


def test_view_and_setting_decide_whether_the_key_is_required(settings: Any) -> None:
    schema = generate_views(optional=OptionalKeyView, required=RequiredKeyView)
    (optional,) = key_parameters(operation_of(schema, "/optional/", "post"))
    (required,) = key_parameters(operation_of(schema, "/required/", "post"))
    assert optional["required"] is False
    assert required["required"] is True
    # Without a required key, a missing key is no error: only a malformed one is a 400.
    description = operation_of(schema, "/optional/", "post")["responses"]["400"]["description"]
    assert "idempotency_key_missing" not in description
    assert "idempotency_key_invalid" in description

    settings.IDEMPOTENCY = {"REQUIRED": False}
    schema = generate_views(charges=CustomSchemaView)
    (parameter,) = key_parameters(operation_of(schema, "/charges/", "post"))
    assert parameter["required"] is False


def test_header_name_from_the_setting(settings: Any) -> None:
    settings.IDEMPOTENCY = {"HEADER": "X-Request-Key"}
    operation = operation_of(generate_views(charges=OptionalKeyView), "/charges/", "post")
    assert key_parameters(operation) == []
    (parameter,) = key_parameters(operation, "X-Request-Key")
    assert parameter["name"] == "X-Request-Key"


def test_methods_from_the_setting(settings: Any) -> None:
    settings.IDEMPOTENCY = {"METHODS": ["PUT"]}
    operation = operation_of(generate_views(charges=OptionalKeyView), "/charges/", "post")
    assert key_parameters(operation) == []
    assert "409" not in operation["responses"]


def test_extend_schema_on_an_action_keeps_both() -> None:
    # Defined here: @extend_schema builds on DEFAULT_SCHEMA_CLASS as it is when it runs.
    class AnnotatedViewSet(IdempotencyMixin, viewsets.GenericViewSet[Any]):
        serializer_class = AmountSerializer

        @extend_schema(
            summary="Create a charge",
            responses={201: AmountSerializer, 400: OpenApiResponse(description="A bad amount.")},
        )
        def create(self, request: Request) -> Response:
            return _created(self, request)

    operation = operation_of(generate_views(charges=AnnotatedViewSet), "/charges/", "post")
    assert operation["summary"] == "Create a charge"
    assert len(key_parameters(operation)) == 1
    bad_request = operation["responses"]["400"]
    # The view's own 400 stays, and ours joins it under its own media type.
    assert bad_request["description"].startswith("A bad amount.")
    assert "idempotency_key_invalid" in bad_request["description"]
    assert bad_request["content"]["application/problem+json"] == {"schema": PROBLEM_REF}
    assert "Idempotent-Replayed" in operation["responses"]["201"]["headers"]


def test_a_views_own_schema_class_keeps_working() -> None:
    schema = generate_views(charges=CustomSchemaView)
    operation = operation_of(schema, "/charges/", "post")
    assert operation["tags"] == ["tagged"]
    assert len(key_parameters(operation)) == 1
    assert operation["description"] == "A view with a schema class of its own."


def test_a_key_parameter_the_view_declared_is_not_repeated() -> None:
    from drf_spectacular.utils import OpenApiParameter

    @extend_schema(parameters=[OpenApiParameter("Idempotency-Key", str, OpenApiParameter.HEADER)])
    class DeclaredKeyView(OptionalKeyView):
        pass

    operation = operation_of(generate_views(charges=DeclaredKeyView), "/charges/", "post")
    assert len(key_parameters(operation)) == 1


@given(st.from_regex(re.compile(openapi.KEY_PATTERN), fullmatch=True))
def test_every_key_the_schema_allows_is_accepted_as_it_is(value: str) -> None:
    value = value[:MAX_KEY_LENGTH]
    assert re.fullmatch(openapi.KEY_PATTERN, value)
    assert parse_key(value) == value
