from __future__ import annotations

import importlib.util

from django.apps import AppConfig


class IdempotencyConfig(AppConfig):
    """Registers the model, the system checks and the signal receivers."""

    name = "django_idempotency"
    verbose_name = "Idempotency"
    # Pinned so a project's DEFAULT_AUTO_FIELD never produces a migration for this app.
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django_idempotency import checks  # noqa: F401  (registers the checks)

        if importlib.util.find_spec("prometheus_client") is not None:
            from django_idempotency import metrics  # noqa: F401  (connects the receivers)

        if importlib.util.find_spec("drf_spectacular") is not None:
            from django_idempotency import openapi  # noqa: F401  (registers the extension)
