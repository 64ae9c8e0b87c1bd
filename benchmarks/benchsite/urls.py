from __future__ import annotations

from django.urls import path
from rest_framework.routers import SimpleRouter

from benchmarks.benchsite import views

router = SimpleRouter()
router.register("charges", views.ChargeViewSet, basename="charge")
router.register("storm/charges", views.StormChargeViewSet, basename="storm-charge")
urlpatterns = [path("noop/", views.AuthenticatedNoop.as_view()), *router.urls]
