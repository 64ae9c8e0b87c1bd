"""A batch of tasks handed to a Tasks backend in as few statements as it allows.

django-tasks-db's ``DatabaseBackend`` enqueues one row per task with ``objects.create``; its
model takes a batch in one multi-row ``INSERT`` (``bulk_create``). :func:`enqueue_many`
writes the rows ``DatabaseBackend.enqueue`` would write, in one statement, and then sends
``task_enqueued`` for each task, as that backend does. Any other backend, a subclass that
changes how a task becomes a row, or an ``id_function`` that is a database expression: the
backend's own ``enqueue``, task after task, in the caller's transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db.models import Expression

from django_idempotency._tasks_compat import BaseTaskBackend, Task

# (the task, bound to the backend with its options; its args; its kwargs)
Handed = tuple[Task[Any, Any], list[Any], dict[str, Any]]

# What DatabaseBackend.enqueue does through these: a subclass that overrides one of them
# writes its rows its own way, so it gets its own enqueue.
_ENQUEUE_PATH = ("enqueue", "_task_to_db_task", "validate_task")


def enqueue_many(target: BaseTaskBackend, handed: Sequence[Handed]) -> list[str]:
    """Enqueue every task of ``handed`` on ``target``; their result ids, in order.

    Raises whatever a task's enqueue raises; the caller's transaction (or its savepoint)
    then holds rows of the tasks before it, which the caller rolls back.
    """
    bulk = _database_rows(target, handed)
    if bulk is None:
        return [str(task.enqueue(*args, **kwargs).id) for task, args, kwargs in handed]
    model, rows, signal, result_id = bulk
    model.objects.bulk_create(rows)
    # A task's result is built only for a receiver of the signal (it imports the task).
    if signal.has_listeners(type(target)):
        for row in rows:
            signal.send(type(target), task_result=row.task_result)
    return [result_id(row.id) for row in rows]


def _database_rows(target: BaseTaskBackend, handed: Sequence[Handed]) -> Any:
    """django-tasks-db's model, its rows for ``handed``, its ``task_enqueued`` signal and
    how it writes a row's id as a result id; ``None`` when ``target`` is no plain
    ``DatabaseBackend``."""
    try:
        from django_tasks_db.backend import DatabaseBackend
        from django_tasks_db.compat import normalize_json, task_enqueued
        from django_tasks_db.models import DBTaskResult, get_date_max
        from django_tasks_db.utils import normalize_uuid
    except ImportError:
        return None
    kind = type(target)
    if not isinstance(target, DatabaseBackend) or not hasattr(target, "_get_id"):
        return None
    if any(getattr(kind, name) is not getattr(DatabaseBackend, name) for name in _ENQUEUE_PATH):
        return None
    rows: list[Any] = []
    valid: set[int] = set()  # the tasks validated: a batch's messages mostly share one
    for task, args, kwargs in handed:
        if id(task) not in valid:
            target.validate_task(task)
            valid.add(id(task))
        result_id = target._get_id()
        if isinstance(result_id, Expression):  # computed by the INSERT: one row at a time
            return None
        rows.append(
            DBTaskResult(
                id=result_id,
                args_kwargs=normalize_json({"args": args, "kwargs": kwargs}),
                priority=task.priority,
                task_path=task.module_path,
                queue_name=task.queue_name,
                # What its pre_save receiver does (bulk_create sends no pre_save).
                run_after=task.run_after if task.run_after is not None else get_date_max(),
                backend_name=target.alias,
            )
        )
    return DBTaskResult, rows, task_enqueued, normalize_uuid
