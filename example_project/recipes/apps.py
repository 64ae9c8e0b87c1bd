from __future__ import annotations

from django.apps import AppConfig


class RecipesConfig(AppConfig):
    """Webhook endpoints, a queue consumer and a command that each run once per sender's id."""

    name = "example_project.recipes"
    label = "recipes"
    default_auto_field = "django.db.models.BigAutoField"
