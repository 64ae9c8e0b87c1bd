"""URLs of the example project: the payments API under ``/api/`` and the admin."""

from __future__ import annotations

from django.contrib import admin
from django.urls import include, path
from rest_framework.routers import DefaultRouter

from example_project.payments import views

router = DefaultRouter()
router.register("charges", views.ChargeViewSet, basename="charge")

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/refunds/", views.create_refund, name="refund-create"),
    path("api/", include(router.urls)),
    path("api-auth/", include("rest_framework.urls")),
]
