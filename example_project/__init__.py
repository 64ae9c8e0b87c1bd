"""The example project. Its Celery app is loaded with Django, so ``shared_task`` uses it."""

from __future__ import annotations

# --8<-- [start:celery-app]
from example_project.celery import app as celery_app

__all__ = ("celery_app",)
# --8<-- [end:celery-app]
