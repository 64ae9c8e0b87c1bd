"""A relay process for tests/test_tasks_worker.py whose hand-overs are counted, and its worker.

    python -m tests.tasks_proc relay [relay_outbox arguments...]
    python -m tests.tasks_proc db-worker [db_worker arguments...]

It runs ``relay_outbox`` with the tests' settings (no ``OUTBOX_SENDER``: messages of Django's
Tasks framework go to the ``worker`` backend). Every hand-over to the database backend (its
``task_enqueued`` signal) is counted as a ``ProviderCall`` row ``handed:<tag>:<pid>``, written
through the ``provider`` connection (autocommit), so it outlives the relay's transaction and
the relay itself. With ``TASKS_RELAY_DIE=1`` the relay is killed (SIGKILL) right after its
first hand-over: after handing the message over and before marking it sent. With
``TASKS_RELAY_DIE=after-commit`` it is killed once that hand-over has committed: on another
database (below), between the commit there and the batch's own.

With ``TASKS_RELAY_TARGET_DATABASE`` set, the database backend's rows are written through that
connection (a router): a hand-over that commits on a connection of its own, just before the
relay's batch does, as into a backend on another database.

With ``OUTBOX_GO_FILE`` set, it connects, says it is ready (``tests/ready.py``) and waits for
that file before it starts.

``db-worker`` runs django-tasks-db's ``db_worker`` command as it is (as ``manage.py`` would);
with ``TEST_READY_FILE`` set it writes that file when it first connects to the database, just
before its first look for a task: the test knows the worker is polling.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import django

from tests.ready import ready_on_connection, ready_then_wait


def handed(tag: object) -> str:
    return f"handed:{tag}:"


def count_hand_overs(die: str | None) -> None:
    from django.db import router, transaction
    from django_tasks_db.backend import DatabaseBackend
    from django_tasks_db.compat import task_enqueued
    from django_tasks_db.models import DBTaskResult

    from tests.testapp.models import ProviderCall

    def killed() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def counted(sender: type[Any], task_result: Any, **kwargs: object) -> None:
        if not issubclass(sender, DatabaseBackend):
            return
        tag = task_result.args[0] if task_result.args else "?"
        ProviderCall.objects.using("provider").create(key=f"{handed(tag)}{os.getpid()}")
        if die == "1":
            killed()
        elif die == "after-commit":
            transaction.on_commit(killed, using=router.db_for_write(DBTaskResult))

    task_enqueued.connect(counted, weak=False)


class TargetRouter:
    """django-tasks-db's rows through another connection than the relay's."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def db_for_write(self, model: type[Any], **hints: object) -> str | None:
        return self.alias if model._meta.app_label == "django_tasks_database" else None


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from django.core.management import call_command

    command, *arguments = sys.argv[1:]
    if command == "db-worker":
        db_worker(arguments)
        return
    if command != "relay":
        raise SystemExit(f"unknown command {command!r}")
    count_hand_overs(die=os.environ.get("TASKS_RELAY_DIE"))
    target = os.environ.get("TASKS_RELAY_TARGET_DATABASE")
    if target:
        from django.db import router

        router.routers.insert(0, TargetRouter(target))
    go = os.environ.get("OUTBOX_GO_FILE")
    if go:
        ready_then_wait(Path(go))
    call_command("relay_outbox", *arguments)


def db_worker(arguments: list[str]) -> None:
    from django.core.management import execute_from_command_line

    ready = os.environ.get("TEST_READY_FILE")
    if ready:
        ready_on_connection(Path(ready))
    execute_from_command_line(["django-admin", "db_worker", *arguments])


if __name__ == "__main__":
    main()
