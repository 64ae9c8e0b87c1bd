from __future__ import annotations

from django.apps import AppConfig


class BenchsiteConfig(AppConfig):
    name = "benchmarks.benchsite"
    label = "benchsite"
    default_auto_field = "django.db.models.BigAutoField"
