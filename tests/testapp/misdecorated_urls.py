"""A class-based view whose ``async def`` handlers carry ``@idempotent`` straight, not
through ``method_decorator``: refused when it is called (tests/test_async.py). Kept out of
the project's URLconf, whose every endpoint answers."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path
from django.views import View

from django_idempotency.decorators import idempotent
from tests.testapp.models import Charge


class AsyncMisdecoratedView(View):
    @idempotent
    async def get(self, request: HttpRequest) -> HttpResponse:
        await Charge.objects.acreate(account="misdecorated", amount=1, currency="EUR")
        return JsonResponse({})

    @idempotent
    async def post(self, request: HttpRequest) -> HttpResponse:
        await Charge.objects.acreate(account="misdecorated", amount=1, currency="EUR")
        return JsonResponse({}, status=201)


urlpatterns = [path("misdecorated/", AsyncMisdecoratedView.as_view())]
