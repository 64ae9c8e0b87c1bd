"""Processes for the outbox tests: a relay, or a writer that dies right after its commit.

    python -m tests.outbox_proc relay '<IDEMPOTENCY as JSON>' [relay_outbox arguments...]
    python -m tests.outbox_proc enqueue-and-die <tag>
    python -m tests.outbox_proc enqueue-once <key> <dotted path of a task> <tag>

The tests' Celery app is loaded first, so the Celery sender publishes to the broker that
``TEST_CELERY_BROKER`` names. With ``OUTBOX_GO_FILE`` set, a relay connects, says it is ready
(``tests/ready.py``) and waits for that file before it starts: several relays then begin at
the same moment, and the test gives the signal only once all of them wait for it. With
``OUTBOX_FAULT_FILE`` set, a receiver of ``outbox_relayed`` raises after a batch whenever that
file exists (and removes it, so it raises once per file): a fault in the relay's own process.
With ``OUTBOX_COUNT_PUBLISHES=1`` every message Celery publishes (``after_task_publish``) is
counted as a ``ProviderCall`` row ``published:<task id>:<pid>``, through the ``provider``
connection (autocommit); with ``OUTBOX_DIE_AFTER_PUBLISHES=N`` too, the relay is killed
(SIGKILL) right after its Nth publish: in the middle of a batch the default sender hands
over, before the batch is marked sent.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import django

from tests.ready import ready_then_wait


class InjectedFault(Exception):
    """Raised by the relay's faulty receiver: nothing the relay could foresee."""


def connect_fault(path: Path) -> None:
    from django_idempotency import signals

    def faulty_receiver(**kwargs: object) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            return
        raise InjectedFault("a receiver of outbox_relayed failed")

    signals.outbox_relayed.connect(faulty_receiver, weak=False)


def count_publishes(die_after: int | None) -> None:
    from celery.signals import after_task_publish

    from tests.testapp.models import ProviderCall

    published: list[str] = []

    def counted(headers: dict[str, str] | None = None, **kwargs: object) -> None:
        task_id = (headers or {}).get("id", "?")
        ProviderCall.objects.using("provider").create(key=f"published:{task_id}:{os.getpid()}")
        published.append(task_id)
        if die_after is not None and len(published) >= die_after:
            os.kill(os.getpid(), signal.SIGKILL)

    after_task_publish.connect(counted, weak=False)


def relay(settings: str, arguments: list[str]) -> None:
    from django.core.management import call_command
    from django.test import override_settings

    fault = os.environ.get("OUTBOX_FAULT_FILE")
    if fault:
        connect_fault(Path(fault))
    if os.environ.get("OUTBOX_COUNT_PUBLISHES") == "1":
        die_after = os.environ.get("OUTBOX_DIE_AFTER_PUBLISHES")
        count_publishes(int(die_after) if die_after else None)

    go = os.environ.get("OUTBOX_GO_FILE")
    if go:
        ready_then_wait(Path(go))
    with override_settings(IDEMPOTENCY=json.loads(settings)):
        call_command("relay_outbox", *arguments)


def enqueue_and_die(tag: str) -> None:
    from django.db import transaction

    from django_idempotency.outbox import enqueue
    from tests.testapp.tasks import record_effect

    with transaction.atomic():
        message_id = enqueue(record_effect, tag)
    print(message_id, flush=True)
    # After the COMMIT, before anything could send the message.
    os.kill(os.getpid(), signal.SIGKILL)


def enqueue_once(key: str, path: str, tag: str) -> None:
    """At ``OUTBOX_GO_FILE``, ``enqueue_once`` in a transaction that stays open 0.3 s more,
    so that another process's enqueue of the key overlaps it; prints the id it answered.
    Says it is ready to go (``tests/ready.py``) once set up and connected: the test gives
    the signal only when every process waits for it."""
    from django.db import transaction
    from django.utils.module_loading import import_string

    from django_idempotency.outbox import enqueue_once

    task = import_string(path)
    ready_then_wait(Path(os.environ["OUTBOX_GO_FILE"]))
    with transaction.atomic():
        message_id = enqueue_once(key, task, tag, 0.5)
        time.sleep(0.3)
    print(message_id, flush=True)


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    # The tests' app, not the example project's that setup() imported: shared tasks bind to
    # the current app, and the Celery sender publishes through it.
    from tests.celery_app import app

    app.set_current()
    command, *rest = sys.argv[1:]
    if command == "relay":
        relay(rest[0], rest[1:])
    elif command == "enqueue-and-die":
        enqueue_and_die(rest[0])
    elif command == "enqueue-once":
        enqueue_once(*rest)
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
