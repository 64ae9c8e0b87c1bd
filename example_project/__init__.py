"""The example project. Its Celery app is loaded with Django, so ``shared_task`` uses it."""

from __future__ import annotations

from example_project.celery import app as celery_app

__all__ = ("celery_app",)
