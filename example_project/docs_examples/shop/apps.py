from __future__ import annotations

from django.apps import AppConfig


class ShopConfig(AppConfig):
    """Orders paid through a payment gateway, confirmed by e-mail."""

    name = "example_project.docs_examples.shop"
    label = "shop"
    default_auto_field = "django.db.models.BigAutoField"
