from __future__ import annotations

from django.apps import AppConfig


class PaymentsConfig(AppConfig):
    """A small payments API that charges through a fake, idempotent payment provider."""

    name = "example_project.payments"
    label = "payments"
    default_auto_field = "django.db.models.BigAutoField"
