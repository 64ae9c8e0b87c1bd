from __future__ import annotations

from django.apps import apps
from django.conf import settings
from django.contrib import admin
from django.urls import include, path

from tests.testapp import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("charges/", views.charges),
    path("charges/short-lease/", views.charges_short_lease),
    path("charges/fail-policy/", views.charges_fail_policy),
    path("charges/callable-policy/", views.charges_callable_policy),
    path("charges/optional/", views.charges_optional),
    path("charges/tenant/", views.tenant_charges),
    path("charges/<int:shop>/items/", views.charges),
    path("cbv/charges/", views.ChargeView.as_view()),
    path("outcome/", views.outcome),
    path("peek/", views.peek),
    path("async/charges/", views.async_charges),
    path("async/charges/short-lease/", views.async_charges_short_lease),
    path("async/where/", views.async_where),
    path("async/where/class/", views.AsyncWhereView.as_view()),
    path("faults/charges/", views.fault_charges),
    path("faults/charges/fail-policy/", views.fault_charges_fail_policy),
    path("faults/charges/short-ttl/", views.fault_charges_short_ttl),
    path("uploads/", views.uploads),
    path("txn/", include("tests.testapp.txn_views")),
    path("steps/", include("tests.testapp.steps")),
    path("peek/", include("tests.testapp.peek_views")),
]

if settings.HAS_DRF:
    from rest_framework.routers import DefaultRouter

    from tests.testapp import drf_views

    router = DefaultRouter()
    router.register("charges", drf_views.ChargeViewSet, basename="charge")
    router.register("open-charges", drf_views.OpenChargeViewSet, basename="open-charge")
    urlpatterns += [
        path("api/", include(router.urls)),
        path("api/custom/", drf_views.CustomOperationAPIView.as_view()),
        path("api/generic-charges/", drf_views.GenericChargeCreateView.as_view()),
        path("api/fn-charges/", drf_views.api_charge),
    ]

if settings.HAS_NINJA:
    from tests.testapp.ninja_api import api

    urlpatterns += [path("ninja/", api.urls)]

# The webhook recipes, for the tests that run a real server.
if apps.is_installed("example_project.recipes"):
    from tests.testapp import webhook_delay  # noqa: F401  (TEST_WEBHOOK_DELAY)

    urlpatterns.append(path("webhooks/", include("example_project.recipes.urls")))
# The user app of the docs' testing page (example_project/docs_examples/shop/).
if apps.is_installed("example_project.docs_examples.shop"):
    urlpatterns.append(path("shop/", include("example_project.docs_examples.shop.urls")))
