"""The OpenAPI description of every answer a client following the protocol can meet, on
exactly the operations that answer it: drf-spectacular and django-ninja alike."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.urls import include, path

PROBLEM = "application/problem+json"


def spectacular(view: Any) -> dict[str, Any]:
    pytest.importorskip("drf_spectacular")
    from django.test import override_settings
    from drf_spectacular.generators import SchemaGenerator
    from drf_spectacular.validation import validate_schema
    from rest_framework import routers

    router = routers.SimpleRouter()
    router.register("things", view, basename="things")
    rest = {"DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema"}
    with override_settings(REST_FRAMEWORK=rest):
        schema: dict[str, Any] = SchemaGenerator(
            patterns=[path("", include(router.urls))]
        ).get_schema(request=None, public=True)
    validate_schema(schema)
    return json.loads(json.dumps(schema))


def viewset(**attributes: Any) -> type:
    pytest.importorskip("rest_framework")
    from rest_framework import serializers, viewsets
    from rest_framework.response import Response

    from django_idempotency.drf import IdempotencyMixin

    class Amount(serializers.Serializer[Any]):
        amount = serializers.IntegerField()

    def create(self: Any, request: Any) -> Any:
        return Response({"amount": 1}, status=201)

    return type(
        "ThingViewSet",
        (IdempotencyMixin, viewsets.GenericViewSet),
        {"serializer_class": Amount, "create": create, "__module__": __name__, **attributes},
    )


def ninja_schema(**options: Any) -> dict[str, Any]:
    ninja = pytest.importorskip("ninja")
    from django_idempotency.ninja import idempotent

    router = ninja.Router()

    @router.post("/things", response={201: dict})
    @idempotent(**options)
    def create(request: Any) -> Any:
        return 201, {}

    api = ninja.NinjaAPI(urls_namespace=f"tests-openapi-answers-{len(options)}-{id(router)}")
    api.add_router("/", router)
    return json.loads(json.dumps(api.get_openapi_schema(path_prefix="/")))


# -- "fail": a retry after a crash gets the stored 500 idempotency_outcome_unknown ---------------


def test_spectacular_documents_the_unknown_outcome_of_the_fail_policy() -> None:
    responses = spectacular(viewset(idempotency_recovery="fail"))["paths"]["/things/"]["post"][
        "responses"
    ]
    assert "idempotency_outcome_unknown" in responses["500"]["description"]
    assert PROBLEM in responses["500"]["content"]
    # Only the code a client meets: no server misconfiguration is advertised.
    assert "idempotency_account_invalid" not in responses["500"]["description"]


def test_spectacular_documents_no_500_where_the_policy_runs_again() -> None:
    responses = spectacular(viewset())["paths"]["/things/"]["post"]["responses"]
    assert "500" not in responses


@pytest.mark.django_db
def test_the_fail_policy_from_the_settings_is_documented(settings: Any) -> None:
    settings.IDEMPOTENCY = {"RECOVERY": "fail"}
    responses = spectacular(viewset())["paths"]["/things/"]["post"]["responses"]
    assert "idempotency_outcome_unknown" in responses["500"]["description"]


def test_ninja_documents_the_unknown_outcome_of_the_fail_policy() -> None:
    failing = ninja_schema(recovery="fail")["paths"]["/things"]["post"]["responses"]
    assert "idempotency_outcome_unknown" in failing["500"]["description"]
    assert PROBLEM in failing["500"]["content"]
    retrying = ninja_schema()["paths"]["/things"]["post"]["responses"]
    assert "500" not in retrying
