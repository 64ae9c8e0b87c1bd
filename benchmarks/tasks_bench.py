"""The outbox relay into Django's Tasks framework: messages/s handed to django-tasks-db.

``python -m benchmarks.tasks_bench [--messages N] [--rounds R] [--batch-size B] [--celery]
[--broker URL]...`` prints one JSON object. It uses the PostgreSQL database
``django_idempotency_bench_tasks`` (created when missing) with ``TASKS`` as docs/tasks.md
shows it: ``OutboxBackend`` delivering to django-tasks-db's ``DatabaseBackend`` on the same
database.

Each round enqueues ``--messages`` messages for each of these ways in one transaction (timed:
the cost of the outbox's enqueue), in blocks of one batch, and relays them with
``outbox.relay_batch`` (one batch of ``outbox.drain``, the function behind ``relay_outbox
--once``), the ways taking turns batch after batch, so that each sees the machine's load of
the same moment (the order of the ways rotating, and reversed every other round):

- ``tasks``: the relay's default path for these messages, a hand-over to the database
  backend (one multi-row ``INSERT`` of the task rows per batch, in the relay's batch
  transaction);
- ``noop``: the same messages, the same relay, a sender that does nothing: the relay's own
  cost, the floor of any sender (the Celery sender adds its broker round trip to it);
- ``celery`` (with ``--celery``): as many messages written with ``outbox.enqueue`` for a
  Celery task, drained by the default Celery sender into Redis (a private ``redis-server``
  when it is installed, else ``TASKS_BENCH_BROKER``, default ``redis://127.0.0.1:6379/15``),
  one publish per message; every message is counted in the queue afterwards;
- ``celery-<scheme>`` (with ``--broker URL``, once per broker): the same into that broker,
  for instance RabbitMQ (``--broker amqp://guest:guest@127.0.0.1:5672//``), each broker
  with a Celery app of its own, made the current app for its drain.

The figures are medians over the rounds; each ratio is a path's throughput against the no-op
sender's in the same round, within one interleaved run. Nothing runs the tasks.
"""

from __future__ import annotations

import argparse
import contextlib
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
    """A Celery app, made current: ``broker``, one queue of this run's own, no result
    backend."""
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


def queued(app: Any, expected: int) -> int:
    """Messages in this run's queue on ``app``'s broker, once ``expected`` are there or
    after 30 s (a broker may route a publish after the sender has returned); the queue
    emptied."""
    deadline = time.monotonic() + 30
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        while True:
            _, count, _ = channel.queue_declare(queue=QUEUE, passive=True)
            if count >= expected or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        channel.queue_purge(QUEUE)
    return int(count)


def drop_queue(app: Any) -> None:
    """This run's queue deleted from ``app``'s broker (RabbitMQ keeps a durable one)."""
    with app.connection_for_write() as connection:
        connection.default_channel.queue_delete(QUEUE)


def reset() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE django_idempotency_outbox_key, django_idempotency_outbox, "
            "django_tasks_database_dbtaskresult"
        )


def enqueue(blocks: int, batch_size: int, order: list[str]) -> float:
    """Seconds to enqueue, in one transaction, ``blocks`` times a batch of messages for
    each path of ``order`` in turn (Celery tasks for a Celery path, tasks of Django's Tasks
    framework otherwise): oldest first, the relay takes them back block by block."""
    from django.db import transaction

    from benchmarks.tasks_consumer import consume
    from django_idempotency import outbox

    started = time.perf_counter()
    with transaction.atomic():
        for block in range(blocks):
            for path in order:
                for seq in range(block * batch_size, (block + 1) * batch_size):
                    if path.startswith("celery"):
                        outbox.enqueue(CELERY_TASK, seq)
                    else:
                        consume.enqueue(seq)
    return time.perf_counter() - started


def noop(message: Any) -> None:
    """A sender that sends nowhere."""


def relay_round(
    blocks: int, batch_size: int, order: list[str], apps: dict[str, Any]
) -> dict[str, float]:
    """Messages/s of each path of ``order``: the backlog ``enqueue`` wrote, relayed batch
    by batch with ``outbox.relay_batch`` (one batch of ``drain``), the paths taking turns
    batch after batch, so that each sees the machine's load of the same moment."""
    from django_tasks_db.models import DBTaskResult

    from django_idempotency import outbox
    from django_idempotency._senders import configured_sender

    configured = configured_sender()  # the Tasks backend, or Celery: as drain takes it
    elapsed = dict.fromkeys(order, 0.0)
    for _ in range(blocks):
        for path in order:
            if path in apps:
                apps[path].set_current()
            started = time.perf_counter()
            result = outbox.relay_batch(
                batch_size=batch_size, sender=noop if path == "noop" else configured
            )
            elapsed[path] += time.perf_counter() - started
            assert (result.sent, result.failed, result.dead) == (batch_size, 0, 0), result
    messages = blocks * batch_size
    handed = DBTaskResult.objects.count()
    assert handed == (messages if "tasks" in order else 0), handed
    for path, app in apps.items():
        in_queue = queued(app, messages)
        assert in_queue == messages, (path, in_queue)
    return {path: messages / seconds for path, seconds in elapsed.items()}


def run(
    messages: int, rounds: int, batch_size: int, apps: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``apps``: per Celery path (``celery``, ``celery-<scheme>``), its Celery app."""
    apps = apps or {}
    paths = ["tasks", "noop", *apps]
    blocks = max(messages // batch_size, 1)
    throughput: dict[str, list[float]] = {path: [] for path in paths}
    enqueue_rates: list[float] = []
    ratios: dict[str, list[float]] = {path: [] for path in paths if path != "noop"}
    for round_ in range(rounds):
        # Rotated, and reversed every other round: no way always follows the same one.
        shift = round_ // 2 % len(paths)
        order = paths[shift:] + paths[:shift]
        if round_ % 2:
            order.reverse()
        reset()
        seconds = enqueue(blocks, batch_size, order)
        enqueue_rates.append(blocks * batch_size * len(order) / seconds)
        figures = relay_round(blocks, batch_size, order, apps)
        for path in paths:
            throughput[path].append(figures[path])
        for path, values in ratios.items():
            values.append(figures[path] / figures["noop"])
    results: dict[str, Any] = {
        "messages": blocks * batch_size,
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
    parser.add_argument(
        "--broker",
        action="append",
        default=[],
        metavar="URL",
        help="also the Celery sender into this broker (repeatable), e.g. "
        "amqp://guest:guest@127.0.0.1:5672//",
    )
    parser.add_argument("--write", action="store_true", help="update benchmarks/RESULTS.md")
    args = parser.parse_args()
    configure()
    with contextlib.ExitStack() as stack:
        apps: dict[str, Any] = {}
        brokers: dict[str, str] = {}
        if args.celery:
            url = stack.enter_context(broker())
            apps["celery"] = celery_app(url)
            brokers["celery"] = "Redis (a private redis-server)" if "6379" not in url else url
        for url in args.broker:
            path = f"celery-{url.split(':', 1)[0]}"
            apps[path], brokers[path] = celery_app(url), url
        try:
            results = run(args.messages, args.rounds, args.batch_size, apps)
        finally:
            for app in apps.values():
                drop_queue(app)
        if brokers:
            results["brokers"] = brokers
            results["broker"] = brokers.get("celery", "")
    print(json.dumps(results))
    if args.write:
        from benchmarks import report

        report.write_section(report.tasks_relay(results), report.SECTION_TASKS)


if __name__ == "__main__":
    main()
