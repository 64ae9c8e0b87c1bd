"""The outbox relay into Django's Tasks framework: messages/s handed to django-tasks-db.

``python -m benchmarks.tasks_bench [--messages N] [--rounds R] [--batch-size B]`` prints one
JSON object. It uses the PostgreSQL database ``django_idempotency_bench_tasks`` (created when
missing) with ``TASKS`` as docs/tasks.md shows it: ``OutboxBackend`` delivering to
django-tasks-db's ``DatabaseBackend`` on the same database.

Each round enqueues ``--messages`` tasks with ``task.enqueue()`` in one transaction (timed:
the cost of the outbox's enqueue), then drains them with ``outbox.drain`` (the function
behind ``relay_outbox --once``) in one of two ways, in turn (A/B, the order rotating from
round to round):

- ``tasks``: the relay's default path for these messages, a hand-over to the database
  backend (one ``INSERT`` of a task row each, in the relay's batch transaction);
- ``noop``: the same messages, the same relay, a sender that does nothing: the relay's own
  cost, the floor of any sender (the Celery sender adds its broker round trip to it).

The figures are medians over the rounds; the ratio is the tasks path's throughput against
the no-op sender's, within the same interleaved run. Nothing runs the tasks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

DATABASE = "django_idempotency_bench_tasks"


def configure() -> None:
    import importlib.util

    import django
    from django.conf import settings

    from benchmarks.site_setup import ensure_database

    ensure_database(DATABASE)
    apps = ["django.contrib.auth", "django.contrib.contenttypes", "django_idempotency"]
    if importlib.util.find_spec("django.tasks") is None:
        apps.append("django_tasks")
    apps.append("django_tasks_db")
    settings.configure(
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": DATABASE,
                "USER": os.environ.get("PGUSER", "postgres"),
                "PASSWORD": os.environ.get("PGPASSWORD", ""),
                "HOST": os.environ.get("PGHOST", "127.0.0.1"),
                "PORT": os.environ.get("PGPORT", "5432"),
                "CONN_MAX_AGE": 600,
            }
        },
        INSTALLED_APPS=apps,
        USE_TZ=True,
        SECRET_KEY="django-idempotency-tasks-bench",
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        IDEMPOTENCY={},
        TASKS={
            "default": {
                "BACKEND": "django_idempotency.tasks_backend.OutboxBackend",
                "OPTIONS": {"DELIVER_TO": "worker"},
            },
            "worker": {"BACKEND": "django_tasks_db.DatabaseBackend"},
        },
    )
    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def reset() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE django_idempotency_outbox, django_tasks_database_dbtaskresult")


def enqueue(messages: int) -> float:
    """Seconds to enqueue ``messages`` tasks in one transaction."""
    from django.db import transaction

    from benchmarks.tasks_consumer import consume

    started = time.perf_counter()
    with transaction.atomic():
        for seq in range(messages):
            consume.enqueue(seq)
    return time.perf_counter() - started


def noop(message: Any) -> None:
    """A sender that sends nowhere."""


def drain(path: str, messages: int, batch_size: int) -> float:
    """Messages/s of one drain of the backlog by ``path``."""
    from django_tasks_db.models import DBTaskResult

    from django_idempotency import outbox

    started = time.perf_counter()
    if path == "tasks":
        result = outbox.drain(batch_size=batch_size)
    else:
        result = outbox.drain(batch_size=batch_size, sender=noop)
    elapsed = time.perf_counter() - started
    assert (result.sent, result.failed, result.dead) == (messages, 0, 0), result
    handed = DBTaskResult.objects.count()
    assert handed == (messages if path == "tasks" else 0), handed
    return messages / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=100)
    args = parser.parse_args()
    configure()
    throughput: dict[str, list[float]] = {"tasks": [], "noop": []}
    enqueue_rates: list[float] = []
    ratios: list[float] = []
    for round_ in range(args.rounds):
        order = ["tasks", "noop"] if round_ % 2 == 0 else ["noop", "tasks"]
        figures = {}
        for path in order:
            reset()
            enqueue_rates.append(args.messages / enqueue(args.messages))
            figures[path] = drain(path, args.messages, args.batch_size)
            throughput[path].append(figures[path])
        ratios.append(figures["tasks"] / figures["noop"])
    print(
        json.dumps(
            {
                "messages": args.messages,
                "rounds": args.rounds,
                "batch_size": args.batch_size,
                "enqueue_per_s": round(statistics.median(enqueue_rates)),
                "relay_per_s": {k: round(statistics.median(v)) for k, v in throughput.items()},
                "tasks_vs_noop": round(statistics.median(ratios), 3),
                "tasks_vs_noop_range": [round(min(ratios), 3), round(max(ratios), 3)],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
