"""The example project's Celery app: ``celery -A example_project worker --beat``.

Configured from Django settings prefixed ``CELERY_`` (the broker), and finds the ``tasks``
module of every installed app: ``django_idempotency.tasks`` (purge, recovery and the outbox
relay) and ``example_project.payments.tasks`` (receipts). Loaded with Django by the
project's ``__init__.py``, so that ``shared_task`` uses it.
"""

from __future__ import annotations

# --8<-- [start:celery-app]
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")

app = Celery("example_project")
# Every Django setting named CELERY_...: CELERY_BROKER_URL is Celery's broker_url.
app.config_from_object("django.conf:settings", namespace="CELERY")
# The tasks module of every installed app: django_idempotency.tasks among them.
app.autodiscover_tasks()

# The package's tasks on beat (`celery -A example_project beat`): the purge every hour,
# recovery every minute, and a drain of the outbox every minute as a floor under the
# `relay_outbox` process (or instead of it).
app.conf.beat_schedule = {
    "purge-idempotency-records": {
        "task": "django_idempotency.purge_expired",
        "schedule": 3600.0,  # every hour
        "kwargs": {"max_batches": 500},  # optional: bound one run
    },
    "recover-stale-idempotency-leases": {
        "task": "django_idempotency.recover_stale_leases",
        "schedule": 60.0,  # every minute
    },
    "relay-outbox": {
        "task": "django_idempotency.relay_outbox",
        "schedule": 60.0,
    },
}
# --8<-- [end:celery-app]
