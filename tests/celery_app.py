"""The tests' Celery app: a Redis broker, no result backend, the tests' Django settings.

Workers started by ``tests.test_tasks`` run ``celery -A tests.celery_app worker``. Each test
run gets a queue of its own (``TEST_CELERY_QUEUE``), so runs never take each other's
messages, and its own set of unacknowledged messages (``UNACKED``), so that a run waiting for
its queue to drain never waits on another run's worker (CI runs two suites side by side on
one broker), and no run's restore sweep hands back another's messages.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

BROKER_URL = os.environ.get("TEST_CELERY_BROKER", "redis://127.0.0.1:6379/13")
QUEUE = os.environ.setdefault("TEST_CELERY_QUEUE", f"django-idempotency-tests-{os.getpid()}")
# An unacknowledged message (its worker was killed) is handed out again this long after its
# delivery; the restore sweep runs every second so a new worker finds it promptly.
VISIBILITY_TIMEOUT = 8
UNACKED = f"unacked-{QUEUE}"

app = Celery("tests", include=["django_idempotency.tasks", "tests.testapp.tasks"])
app.conf.update(
    broker_url=BROKER_URL,
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        "visibility_timeout": VISIBILITY_TIMEOUT,
        "unacked_key": UNACKED,
        "unacked_index_key": f"{UNACKED}-index",
        "unacked_mutex_key": f"{UNACKED}-mutex",
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    task_default_queue=QUEUE,
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
)
