"""URLs of the example project: the payments API under ``/api/`` (charges, refunds and rides;
its OpenAPI schema at ``/api/schema/``, Swagger UI at ``/api/docs/``), its charges through
django-ninja under ``/ninja/`` (schema at ``/ninja/openapi.json``, Swagger UI at
``/ninja/docs``) and the admin."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import include, path
from django.views import defaults
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from example_project.payments import ninja_api, rides, views

router = DefaultRouter()
router.register("charges", views.ChargeViewSet, basename="charge")

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/refunds/", views.create_refund, name="refund-create"),
    # A ride in steps that resume after a crash (recovery="resume").
    path("api/rides/", rides.book_ride, name="ride-book"),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="swagger-ui"),
    path("api/", include(router.urls)),
    path("api-auth/", include("rest_framework.urls")),
    path("ninja/", ninja_api.api.urls),
    # Webhook endpoints (Stripe, GitHub, Standard Webhooks), each run once per sender's id.
    path("webhooks/", include("example_project.recipes.urls")),
]


def not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    """A URL that matches nothing: JSON under ``/api/``, as the API's own 404s and its
    schema say; Django's page elsewhere."""
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": "Not found."}, status=404)
    return defaults.page_not_found(request, exception)


handler404 = not_found
