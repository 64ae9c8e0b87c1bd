"""ninja's own way to decorate every operation of a router, ``router.add_decorator``, given
the package's ninja ``@idempotent`` (``tests/test_layered_shapes.py``)."""

from __future__ import annotations

from django.urls import path
from ninja import NinjaAPI, Router
from ninja.security import django_auth

from django_idempotency.ninja import idempotent
from tests.testapp.models import Charge

api = NinjaAPI(urls_namespace="layered-ninja", auth=django_auth)
charges = Router()
charges.add_decorator(idempotent)


@charges.post("/charges")
def create_charge(request):
    return {"id": Charge.objects.create(account="router_decorated", amount=1, currency="EUR").pk}


api.add_router("/r", charges)

urlpatterns = [path("n/", api.urls)]
