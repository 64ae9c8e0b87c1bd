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
  cost, the floor of any sender (the Celery sender adds its broker round trip to it);
- ``celery`` (with ``--celery``): as many messages written with ``outbox.enqueue`` for a
  Celery task, drained by the default Celery sender into Redis (a private ``redis-server``
  when it is installed, else ``TASKS_BENCH_BROKER``, default ``redis://127.0.0.1:6379/15``),
  one publish per message; every message is counted in the queue afterwards.

The figures are medians over the rounds; each ratio is a path's throughput against the no-op
sender's in the same round, within one interleaved run. Nothing runs the tasks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

DATABASE = "django_idempotency_bench_tasks"
# The Celery path's task and queue: registered in this process, never consumed.
CELERY_TASK = "benchmarks.tasks_bench.celery_consume"
QUEUE = f"bench-tasks-{os.getpid()}"


def configure() -> None:
    import importlib.util

    import django
    from django.conf import settings

    from benchmarks.site_setup import ensure_database, postgres_database

    ensure_database(DATABASE)
    apps = ["django.contrib.auth", "django.contrib.contenttypes", "django_idempotency"]
    if importlib.util.find_spec("django.tasks") is None:
        apps.append("django_tasks")
    apps.append("django_tasks_db")
    settings.configure(
        DATABASES={"default": postgres_database(DATABASE)},
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


def celery_app(broker: str) -> Any:
    """The current Celery app: ``broker``, one queue of this run's own, no result backend."""
    from celery import Celery

    app = Celery("tasks_bench", set_as_current=True)
    app.conf.update(broker_url=broker, task_default_queue=QUEUE, result_backend=None)
    from celery import shared_task

    shared_task(name=CELERY_TASK)(celery_consume)
    app.finalize()
    return app


def celery_consume(seq: int) -> None:
    """The Celery path's task: never run."""


@contextmanager
def broker() -> Iterator[str]:
    """A private redis-server when one is installed, else ``TASKS_BENCH_BROKER``."""
    from benchmarks.run import redis_server

    with redis_server() as private:
        yield private or os.environ.get("TASKS_BENCH_BROKER", "redis://127.0.0.1:6379/15")


def queued(app: Any) -> int:
    """Messages in this run's queue; the queue emptied."""
    import redis

    client = redis.Redis.from_url(app.conf.broker_url)
    count = int(client.llen(QUEUE))
    client.delete(QUEUE)
    return count


def reset() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE django_idempotency_outbox_key, django_idempotency_outbox, "
            "django_tasks_database_dbtaskresult"
        )


def enqueue(messages: int, path: str = "tasks") -> float:
    """Seconds to enqueue ``messages`` tasks (Celery tasks for ``path="celery"``) in one
    transaction."""
    from django.db import transaction

    from benchmarks.tasks_consumer import consume
    from django_idempotency import outbox

    started = time.perf_counter()
    with transaction.atomic():
        for seq in range(messages):
            if path == "celery":
                outbox.enqueue(CELERY_TASK, seq)
            else:
                consume.enqueue(seq)
    return time.perf_counter() - started


def noop(message: Any) -> None:
    """A sender that sends nowhere."""


def drain(path: str, messages: int, batch_size: int, app: Any = None) -> float:
    """Messages/s of one drain of the backlog by ``path``."""
    from django_tasks_db.models import DBTaskResult

    from django_idempotency import outbox

    started = time.perf_counter()
    if path == "noop":
        result = outbox.drain(batch_size=batch_size, sender=noop)
    else:  # the configured sender: the Tasks backend, or Celery
        result = outbox.drain(batch_size=batch_size)
    elapsed = time.perf_counter() - started
    assert (result.sent, result.failed, result.dead) == (messages, 0, 0), result
    handed = DBTaskResult.objects.count()
    assert handed == (messages if path == "tasks" else 0), handed
    if path == "celery":
        in_queue = queued(app)
        assert in_queue == messages, in_queue
    return messages / elapsed


def run(messages: int, rounds: int, batch_size: int, app: Any = None) -> dict[str, Any]:
    paths = ["tasks", "noop"] + (["celery"] if app is not None else [])
    throughput: dict[str, list[float]] = {path: [] for path in paths}
    enqueue_rates: list[float] = []
    ratios: dict[str, list[float]] = {path: [] for path in paths if path != "noop"}
    for round_ in range(rounds):
        shift = round_ % len(paths)
        figures = {}
        for path in paths[shift:] + paths[:shift]:
            reset()
            enqueue_rates.append(messages / enqueue(messages, path))
            figures[path] = drain(path, messages, batch_size, app)
            throughput[path].append(figures[path])
        for path, values in ratios.items():
            values.append(figures[path] / figures["noop"])
    results: dict[str, Any] = {
        "messages": messages,
        "rounds": rounds,
        "batch_size": batch_size,
        "enqueue_per_s": round(statistics.median(enqueue_rates)),
        "relay_per_s": {k: round(statistics.median(v)) for k, v in throughput.items()},
    }
    for path, values in ratios.items():
        results[f"{path}_vs_noop"] = round(statistics.median(values), 3)
        results[f"{path}_vs_noop_range"] = [round(min(values), 3), round(max(values), 3)]
    results["load_average"] = os.getloadavg()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--celery", action="store_true", help="also the Celery sender, into Redis")
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    configure()
    if not args.celery:
        results = run(args.messages, args.rounds, args.batch_size)
    else:
        with broker() as url:
            results = run(args.messages, args.rounds, args.batch_size, celery_app(url))
            results["broker"] = "Redis (a private redis-server)" if "6379" not in url else url
    print(json.dumps(results))
    if args.write:
        from benchmarks import report

        report.write_section(report.tasks_relay(results), report.SECTION_TASKS)


if __name__ == "__main__":
    main()
