from __future__ import annotations

from django.urls import path

from tests.tenants import views

urlpatterns = [path("charges/", views.create_charge)]
