"""The example project's Celery app: ``celery -A example_project worker --beat``.

Configured from Django settings prefixed ``CELERY_`` (broker, beat schedule), and finds the
``tasks`` module of every installed app: ``django_idempotency.tasks`` (purge and recovery)
and ``example_project.payments.tasks`` (receipts).
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")

app = Celery("example_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
