"""The ★ sentences of the design that no other test pins, checked as a user would: imported
from where the design says, called as it spells them, through the public surface only."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

# -- ★ Agents' tool calls ------------------------------------------------------------------------

#: ``idempotent_tool(*, account=None, operation=None, ttl=None, lease=None, recovery=None,
#: wait=None, required=True)``, as the design spells it, for every framework.
TOOL_OPTIONS = {
    "account": None,
    "operation": None,
    "ttl": None,
    "lease": None,
    "recovery": None,
    "wait": None,
    "required": True,
}


@pytest.mark.parametrize("module", ["mcp", "fastmcp"])
def test_idempotent_tool_takes_the_designs_keyword_options_with_their_defaults(module: str) -> None:
    pytest.importorskip(module)
    from importlib import import_module

    idempotent_tool = import_module(f"django_idempotency.{module}").idempotent_tool
    parameters = inspect.signature(idempotent_tool).parameters
    keywords = {
        name: parameter.default
        for name, parameter in parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert keywords == TOOL_OPTIONS
    # As the design writes it, (*, account=None, ...): options only, by keyword.
    assert list(parameters) == list(TOOL_OPTIONS)
    assert not [p for p in parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    # Every default spelled out is the default: the decorator takes them all.
    idempotent_tool(**TOOL_OPTIONS)


# -- ★ Public API: the claim follows DRF's authentication, permission and throttle checks -------


def _throttled_views() -> list[Any]:
    """A mixin view and an ``@api_view`` over ``@idempotent``, each allowing one request an
    hour per user, each writing one charge when it runs."""
    from rest_framework.decorators import api_view, throttle_classes
    from rest_framework.response import Response
    from rest_framework.throttling import UserRateThrottle
    from rest_framework.views import APIView

    from django_idempotency.decorators import idempotent
    from django_idempotency.drf import IdempotencyMixin
    from tests.testapp.models import Charge

    class OncePerHour(UserRateThrottle):
        rate = "1/hour"
        scope = "contract-audit"

    class ThrottledCharges(IdempotencyMixin, APIView):
        throttle_classes = [OncePerHour]
        idempotency_operation = "audit.throttled-mixin"

        def post(self, request: Any) -> Any:
            Charge.objects.create(account="throttled", amount=1, currency="EUR")
            return Response({"ok": True}, status=201)

    @api_view(["POST"])
    @throttle_classes([OncePerHour])
    @idempotent(operation="audit.throttled-api-view")
    def throttled_charge(request: Any) -> Any:
        Charge.objects.create(account="throttled", amount=1, currency="EUR")
        return Response({"ok": True}, status=201)

    return [ThrottledCharges.as_view(), throttled_charge]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("shape", [0, 1], ids=["mixin", "api_view"])
def test_a_throttled_request_never_claims_and_runs_nothing(user: Any, shape: int) -> None:
    pytest.importorskip("rest_framework")
    from django.core.cache import cache
    from rest_framework.test import APIRequestFactory, force_authenticate

    from django_idempotency.models import IdempotencyRecord
    from tests.helpers import new_key
    from tests.testapp.models import Charge

    cache.clear()
    view = _throttled_views()[shape]
    factory = APIRequestFactory()

    def post(key: str) -> Any:
        request = factory.post("/t/", {"a": 1}, format="json", HTTP_IDEMPOTENCY_KEY=key)
        force_authenticate(request, user=user)
        return view(request)

    assert post(new_key()).status_code == 201
    throttled_key = new_key()
    answer = post(throttled_key)
    assert answer.status_code == 429, answer.content
    # The throttle answered before the claim: no record of the key, nothing ran, and the
    # key is free for the client's retry once the throttle lets it through.
    assert not IdempotencyRecord.objects.filter(key=throttled_key).exists()
    assert Charge.objects.count() == 1
    cache.clear()
    assert post(throttled_key).status_code == 201
    assert Charge.objects.count() == 2
