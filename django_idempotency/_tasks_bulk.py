"""A batch of tasks handed to a Tasks backend in as few statements as it allows.

django-tasks-db's ``DatabaseBackend`` enqueues one row per task with ``objects.create``.
:func:`enqueue_many` writes the rows ``DatabaseBackend.enqueue`` would write in one
multi-row ``INSERT`` (on PostgreSQL one statement whatever the batch's size; elsewhere one
per ``bulk_batch_size`` rows), and then sends ``task_enqueued`` for each task, as that
backend does. Nothing per message reaches the database, and nothing per message is done
that can be done once per task: each task is validated once, and its result's ``task``
is built once. Any other backend, a subclass that changes how a task becomes a row, an
``id_function`` that is a database expression, or a model whose columns are not the ones
this module writes: the backend's own ``enqueue``, task after task, in the caller's
transaction.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import connections, router, transaction
from django.db.models import Expression
from django.utils import timezone

from django_idempotency._tasks_compat import BaseTaskBackend, Task
from django_idempotency._vendors import of

# (the task, bound to the backend with its options; its args; its kwargs)
Handed = tuple[Task[Any, Any], list[Any], dict[str, Any]]

# What DatabaseBackend.enqueue does through these: a subclass that overrides one of them
# writes its rows its own way, so it gets its own enqueue.
_ENQUEUE_PATH = ("enqueue", "_task_to_db_task", "validate_task")

# django-tasks-db's columns, in its model's order. Those of _PER_TASK and _PER_ROW are
# written from the task and the message, as _task_to_db_task writes them; the others take
# the model's defaults.
_COLUMNS = (
    "id",
    "status",
    "enqueued_at",
    "started_at",
    "finished_at",
    "args_kwargs",
    "priority",
    "task_path",
    "worker_ids",
    "queue_name",
    "backend_name",
    "run_after",
    "return_value",
    "exception_class_path",
    "traceback",
)
_PER_ROW = ("id", "enqueued_at", "args_kwargs")
_PER_TASK = ("priority", "task_path", "queue_name", "run_after")
_ID, _ENQUEUED_AT, _ARGS_KWARGS = (_COLUMNS.index(name) for name in _PER_ROW)

_MICROSECOND = timedelta(microseconds=1)


def enqueue_many(target: BaseTaskBackend, handed: Sequence[Handed]) -> list[str]:
    """Enqueue every task of ``handed`` on ``target``; their result ids, in order.

    Raises whatever a task's enqueue raises; the caller's transaction (or its savepoint)
    then holds rows of the tasks before it, which the caller rolls back.
    """
    bulk = _database_rows(target, handed)
    if bulk is None:
        return [str(task.enqueue(*args, **kwargs).id) for task, args, kwargs in handed]
    rows, alias, kinds = bulk
    from django_tasks_db.compat import task_enqueued
    from django_tasks_db.utils import normalize_uuid

    _insert(alias, rows)
    # A task's result is built only for a receiver of the signal.
    if task_enqueued.has_listeners(type(target)):
        for result in _results(rows, kinds, normalize_uuid):
            task_enqueued.send(type(target), task_result=result)
    return [normalize_uuid(row.id) for row in rows]


def database_of(target: BaseTaskBackend) -> str | None:
    """The database alias django-tasks-db writes ``target``'s rows to; ``None`` for a
    backend that is no ``DatabaseBackend`` (whose writes the relay cannot know)."""
    try:
        from django_tasks_db.backend import DatabaseBackend
        from django_tasks_db.models import DBTaskResult
    except ImportError:
        return None
    if not isinstance(target, DatabaseBackend):
        return None
    alias: str = router.db_for_write(DBTaskResult)
    return alias


def _database_rows(target: BaseTaskBackend, handed: Sequence[Handed]) -> Any:
    """django-tasks-db's rows for ``handed`` (not written yet), the database they go to,
    and per row which of the batch's tasks it is of; ``None`` when ``target`` is no plain
    ``DatabaseBackend`` or its model has other columns."""
    try:
        from django_tasks_db.backend import DatabaseBackend
        from django_tasks_db.models import DBTaskResult, get_date_max
    except ImportError:
        return None
    kind = type(target)
    if not isinstance(target, DatabaseBackend) or not hasattr(target, "_get_id"):
        return None
    if any(getattr(kind, name) is not getattr(DatabaseBackend, name) for name in _ENQUEUE_PATH):
        return None
    fields = DBTaskResult._meta.concrete_fields
    if tuple(field.attname for field in fields) != _COLUMNS:
        return None
    alias = router.db_for_write(DBTaskResult)
    # The defaults of the columns no enqueue sets; a callable one (a list) called per row.
    defaults: dict[str, Any] = {}
    fresh: list[tuple[int, Callable[[], Any]]] = []
    for index, field in enumerate(fields):
        if field.attname in (*_PER_ROW, *_PER_TASK, "backend_name"):
            continue
        if field.has_default() and callable(field.default):
            fresh.append((index, field.default))
        else:
            defaults[field.attname] = field.get_default()
    date_max = get_date_max()
    # Per task of the batch (mostly one): a row's values in the model's order.
    tasks: dict[int, list[Any]] = {}
    rows: list[Any] = []
    kinds: list[int] = []
    previous: datetime | None = None
    for task, args, kwargs in handed:
        values = tasks.get(id(task))
        if values is None:
            target.validate_task(task)
            columns = {
                **defaults,
                "priority": task.priority,
                "task_path": task.module_path,
                "queue_name": task.queue_name,
                # What its pre_save receiver does (no pre_save is sent here).
                "run_after": task.run_after if task.run_after is not None else date_max,
                "backend_name": target.alias,
                **dict.fromkeys(_PER_ROW),
            }
            values = tasks[id(task)] = [columns.get(name) for name in _COLUMNS]
        values = values.copy()
        result_id = target._get_id()
        if isinstance(result_id, Expression):  # computed by the INSERT: one row at a time
            return None
        # Strictly after the row before it: the worker takes a batch's tasks of equal
        # priority in this order, oldest message first.
        enqueued_at = timezone.now()
        if previous is not None and enqueued_at <= previous:
            enqueued_at = previous + _MICROSECOND
        previous = enqueued_at
        values[_ID], values[_ENQUEUED_AT] = result_id, enqueued_at
        # The relay's arguments are decoded JSON: normalize_json leaves them as they are.
        values[_ARGS_KWARGS] = {"args": args, "kwargs": kwargs}
        for index, default in fresh:
            values[index] = default()
        # As a saved row: from_db takes the values in the model's order.
        rows.append(DBTaskResult.from_db(alias, _COLUMNS, values))
        kinds.append(id(task))
    return rows, alias, kinds


def _insert(alias: str, rows: list[Any]) -> None:
    """The rows, written in one multi-row ``INSERT`` (one per ``bulk_batch_size`` rows
    where the database limits a statement's parameters), in one transaction."""
    if not rows:
        return
    connection = connections[alias]
    with transaction.atomic(using=alias, savepoint=False):
        if of(alias).json_rows:
            _insert_json_rows(connection, rows)
            return
        model = type(rows[0])
        fields = model._meta.concrete_fields
        quote = connection.ops.quote_name
        into = f"INSERT INTO {quote(model._meta.db_table)} "
        into += f"({', '.join(quote(field.column) for field in fields)}) "
        size = max(connection.ops.bulk_batch_size(fields, rows), 1)
        with connection.cursor() as cursor:
            for start in range(0, len(rows), size):
                chunk = rows[start : start + size]
                placeholders = [["%s"] * len(fields)] * len(chunk)
                params = [
                    field.get_db_prep_save(getattr(row, field.attname), connection)
                    for row in chunk
                    for field in fields
                ]
                # Rows of placeholders, as Django's own INSERT passes them (not as typed).
                values = connection.ops.bulk_insert_sql(fields, placeholders)  # type: ignore[arg-type]
                cursor.execute(into + values, params)


# -- the rows as one JSON parameter (Vendor.json_rows: PostgreSQL) --------------------------
# One statement for the whole batch, with two parameters whatever its size: the rows'
# own values as one JSON array (json.dumps, in C), the columns every row shares once.
# A VALUES list or Django's UNNEST arrays carry one parameter per value, each quoted in
# Python by the client and parsed by the server: most of a batch's hand-over.

_JSON_VALUES = {
    "id": "(r->>0)::uuid",
    "enqueued_at": "(r->>1)::timestamptz",
    "args_kwargs": "r->2",
    "priority": "(r->>3)::integer",
    "task_path": "r->>4",
    "queue_name": "r->>5",
    "run_after": "(r->>6)::timestamptz",
}


def _insert_json_rows(connection: Any, rows: list[Any]) -> None:
    model = type(rows[0])
    quote = connection.ops.quote_name
    columns, values, shared = [], [], []
    for field in model._meta.concrete_fields:
        columns.append(quote(field.column))
        if field.attname in _JSON_VALUES:
            values.append(_JSON_VALUES[field.attname])
        else:  # the same in every row
            values.append("%s")
            shared.append(field.get_db_prep_save(getattr(rows[0], field.attname), connection))
    own = json.dumps(
        [
            [
                str(row.id),
                row.enqueued_at.isoformat(),
                row.args_kwargs,
                row.priority,
                row.task_path,
                row.queue_name,
                row.run_after.isoformat(),
            ]
            for row in rows
        ]
    )
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {quote(model._meta.db_table)} ({', '.join(columns)}) "
            f"SELECT {', '.join(values)} FROM jsonb_array_elements(%s::jsonb) AS r",
            [*shared, own],
        )


def _results(rows: list[Any], kinds: list[int], result_id: Any) -> list[Any]:
    """Each row's task result, as ``row.task_result`` gives it: built by the row for the
    first row of each task, copied with each other row's own values for the rest (its
    ``task``, imported and bound again, is the same)."""
    first: dict[int, Any] = {}
    results = []
    for row, kind in zip(rows, kinds, strict=True):
        template = first.get(kind)
        if template is None:
            result = first[kind] = row.task_result
        else:
            result = dataclasses.replace(
                template,
                db_result=row,
                id=result_id(row.id),
                enqueued_at=row.enqueued_at,
                args=row.args_kwargs["args"],
                kwargs=row.args_kwargs["kwargs"],
                errors=[],
                worker_ids=row.worker_ids,
            )
        results.append(result)
    return results
