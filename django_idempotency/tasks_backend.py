"""Django's Tasks framework through the outbox: an enqueue that commits with the
transaction, delivered to a real backend by the relay.

::

    TASKS = {
        "default": {
            "BACKEND": "django_idempotency.tasks_backend.OutboxBackend",
            "OPTIONS": {"DELIVER_TO": "worker"},
        },
        "worker": {"BACKEND": "django_tasks_db.DatabaseBackend"},  # any real backend
    }

``task.enqueue(...)`` inside ``transaction.atomic`` writes an outbox message (the task's
``module_path``, its arguments, and in ``delivery`` this backend's alias, the priority,
the queue and ``run_after``) that commits or rolls back with the caller's work. The relay
(``relay_outbox``, or the beat task) hands each message to the ``DELIVER_TO`` backend with
``task.using(backend=..., priority=..., queue_name=..., run_after=...).enqueue(...)``: at
least once, never before the commit, never lost after it. Under ``@idempotent_task()`` the
message's id reaches the task function as a keyword argument that the decorator takes
away, so its body runs once per message however often it is delivered.

Works with ``django.tasks`` (Django 6.0+) and with the ``django-tasks`` backport on
Django 5.2 (the ``tasks`` extra).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core import checks
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.module_loading import import_string

from django_idempotency import _senders, _unique, conf, outbox
from django_idempotency._check_ids import error
from django_idempotency._tasks_bulk import Handed, database_of, enqueue_many
from django_idempotency._tasks_compat import (
    BaseTaskBackend,
    InvalidTask,
    Task,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_backends,
    task_finished,
    task_started,
)
from django_idempotency._unique import records_by_message
from django_idempotency.conf import app_settings
from django_idempotency.models import OutboxMessage, OutboxStatus
from django_idempotency.tasks import (
    MESSAGE_ARGUMENT,
    django_run_finished,
    django_run_started,
    is_idempotent_task,
)

__all__ = [
    "BACKEND_PATH",
    "DELIVER_TO",
    "OutboxBackend",
    "enqueue_once",
    "outbox_backend",
    "register",
]

logger = logging.getLogger("django_idempotency")

#: The dotted path of the backend, as ``TASKS`` names it.
BACKEND_PATH = conf.TASKS_OUTBOX_BACKEND
#: The option naming the backend the relay hands each message to.
DELIVER_TO = "DELIVER_TO"


class OutboxBackend(BaseTaskBackend):
    """A ``TASKS`` backend that writes each enqueued task to the transactional outbox.

    Its capabilities (``supports_defer``, ``supports_priority``, ``supports_async_task``)
    and its ``queues`` are those of the ``DELIVER_TO`` backend (it always answers
    ``get_result``: the message's own state until it is handed over), and a
    task that backend cannot run is refused with ``InvalidTask`` at enqueue, as Django's
    backends refuse. ``enqueue`` outside ``transaction.atomic`` on the idempotency
    database raises ``TransactionManagementError``; arguments that cannot be stored as
    JSON raise ``TypeError``. The ``TaskResult`` has the message's id; until the message
    is handed over it is ``READY`` (``FAILED`` once the message is dead), and after that
    it follows the result of the ``DELIVER_TO`` backend where that backend keeps results.
    """

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.deliver_to: Any = self.options.get(DELIVER_TO)

    # -- the target ------------------------------------------------------------------------

    @property
    def target(self) -> BaseTaskBackend:
        """The backend the relay hands messages to; ``InvalidTask`` when it is unusable."""
        problem = self._target_problem()
        if problem is not None:
            raise InvalidTask(problem)
        return task_backends[self.deliver_to]

    def _target_problem(self) -> str | None:
        if not isinstance(self.deliver_to, str) or not self.deliver_to:
            return (
                f"TASKS[{self.alias!r}]['OPTIONS']['DELIVER_TO'] must name the backend that "
                f"the outbox relay hands its tasks to; got {self.deliver_to!r}"
            )
        try:
            target = task_backends[self.deliver_to]
        except Exception as exc:  # InvalidTaskBackend(Error): not in TASKS, or no import
            return f"TASKS[{self.alias!r}]['OPTIONS']['DELIVER_TO'] is unusable: {exc}"
        if isinstance(target, OutboxBackend):
            return (
                f"TASKS[{self.alias!r}]['OPTIONS']['DELIVER_TO'] names {self.deliver_to!r}, "
                "another outbox backend: it must name a backend that runs tasks"
            )
        return None

    @property
    def supports_defer(self) -> bool:  # type: ignore[override]
        return bool(self.target.supports_defer)

    @property
    def supports_priority(self) -> bool:  # type: ignore[override]
        return bool(self.target.supports_priority)

    @property
    def supports_async_task(self) -> bool:  # type: ignore[override]
        return bool(self.target.supports_async_task)

    @property
    def queues(self) -> set[str]:
        """The queues of the ``DELIVER_TO`` backend: those a task may name."""
        return set(self.target.queues)

    @queues.setter
    def queues(self, value: set[str]) -> None:
        # ``BaseTaskBackend.__init__`` sets this entry's own ``QUEUES``: the target's decide.
        pass

    @property
    def supports_get_result(self) -> bool:  # type: ignore[override]
        return True  # the message's state at least; the target's result once delivered

    def validate_task(self, task: Task[Any, Any]) -> None:
        """What the ``DELIVER_TO`` backend would refuse, refused now."""
        self.target.validate_task(task)

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        problem = self._target_problem()
        if problem is None:
            return []
        return [
            checks.Error(
                problem,
                hint=(
                    "Add a TASKS entry for a backend that runs tasks (a database or broker "
                    "backend) and name it in OPTIONS['DELIVER_TO']."
                ),
                id=error("TASKS_DELIVER_TO"),
            )
        ]

    # -- enqueue ---------------------------------------------------------------------------

    def enqueue(self, task: Task[Any, Any], args: Any, kwargs: Any) -> TaskResult[Any, Any]:
        """Write the task as an outbox message in the caller's transaction."""
        message = outbox.write(task.module_path, list(args), dict(kwargs), self.delivery(task))
        return self._result(task, message)

    def enqueue_once(
        self,
        key: str,
        task: Task[Any, Any],
        args: Any,
        kwargs: Any,
        *,
        unique_until: str | timedelta | float = "finished",
        on_conflict: str = "return",
    ) -> TaskResult[Any, Any]:
        """``outbox.enqueue_once`` for a task of this backend: the result of the new
        message, or of the live message that holds ``key`` (``TaskAlreadyQueued`` with
        ``on_conflict="raise"``)."""
        message_id = str(
            outbox.enqueue_once(
                key, task, *args, unique_until=unique_until, on_conflict=on_conflict, **kwargs
            )
        )
        try:
            return self.get_result(message_id)
        except TaskResultDoesNotExist:
            # The key's scope is the task's name: the live message may be another outbox
            # backend's (the task enqueued ``using(backend=...)``), answered by that backend.
            message = OutboxMessage.objects.using(app_settings.DATABASE).get(pk=message_id)
            return outbox_backend(message.delivery.get("backend")).get_result(message_id)

    def delivery(self, task: Task[Any, Any]) -> dict[str, Any]:
        """What a message of ``task`` carries for the relay's hand-over (``InvalidTask``
        for a task the ``DELIVER_TO`` backend cannot run)."""
        self.validate_task(task)
        delivery: dict[str, Any] = {
            "backend": self.alias,
            "priority": task.priority,
            "queue_name": task.queue_name,
        }
        if task.run_after is not None:
            delivery["run_after"] = task.run_after.isoformat()
        return delivery

    # -- results ---------------------------------------------------------------------------

    def get_result(self, result_id: str) -> TaskResult[Any, Any]:
        """The result of a message: its own state until it was handed over, then the
        ``DELIVER_TO`` backend's result (where that backend keeps results), under the
        message's id. ``TaskResultDoesNotExist`` for an id that is no message."""
        try:
            message = (
                OutboxMessage.objects.using(app_settings.DATABASE)
                .filter(pk=uuid.UUID(str(result_id)))
                .first()
            )
        except ValueError:
            message = None
        if message is None:
            raise TaskResultDoesNotExist(result_id)
        task = self._task_of(message)
        handed_over = message.delivery.get("result_id")
        if handed_over and message.status == OutboxStatus.SENT and self.target.supports_get_result:
            try:
                delivered = self.target.get_result(handed_over)
            except TaskResultDoesNotExist:  # pruned by the target: the message's own state
                pass
            else:
                return self._as_ours(delivered, task, message)
        return self._result(task, message)

    def _task_of(self, message: OutboxMessage) -> Task[Any, Any]:
        if message.delivery.get("backend") != self.alias:  # enqueue()'s, or another's
            raise TaskResultDoesNotExist(f"{message.id} is no task result of {self.alias!r}")
        try:
            task = import_string(message.task)
        except ImportError:
            task = None
        if not isinstance(task, Task):
            raise TaskResultDoesNotExist(
                f"{message.task} is no task of Django's Tasks framework (any longer)"
            )
        run_after = message.delivery.get("run_after")
        return task.using(
            priority=message.delivery.get("priority", task.priority),
            queue_name=message.delivery.get("queue_name", task.queue_name),
            run_after=_moment(run_after) if run_after else None,
            backend=self.alias,
        )

    def _result(self, task: Task[Any, Any], message: OutboxMessage) -> TaskResult[Any, Any]:
        dead = message.status == OutboxStatus.DEAD
        errors = (
            [TaskError(exception_class_path=_UNDELIVERED, traceback=message.last_error)]
            if dead
            else []
        )
        return TaskResult(
            task=task,
            id=str(message.id),
            status=TaskResultStatus.FAILED if dead else TaskResultStatus.READY,
            enqueued_at=message.created_at,
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=list(message.args),
            kwargs=dict(message.kwargs),
            backend=self.alias,
            errors=errors,
            worker_ids=[],
        )

    def _as_ours(
        self, delivered: TaskResult[Any, Any], task: Task[Any, Any], message: OutboxMessage
    ) -> TaskResult[Any, Any]:
        kwargs = {k: v for k, v in delivered.kwargs.items() if k != MESSAGE_ARGUMENT}
        ours = dataclasses.replace(
            delivered, task=task, id=str(message.id), backend=self.alias, kwargs=kwargs
        )
        # The return value is no field of the constructor (a slot): carried over as set.
        object.__setattr__(ours, "_return_value", getattr(delivered, "_return_value", None))
        return ours

    # -- the relay's side ------------------------------------------------------------------

    def databases(self) -> list[str]:
        """The databases a hand-over to the ``DELIVER_TO`` backend writes to, where they can
        be known (django-tasks-db's): the relay holds a transaction open on each of them
        that commits just before its batch does, and rolls back with it."""
        if self._target_problem() is not None:
            return []
        alias = database_of(self.target)
        return [alias] if alias is not None else []

    def deliver(self, message: OutboxMessage) -> None:
        """Hand one message to the ``DELIVER_TO`` backend (called by the relay, inside its
        batch's transaction); raises when the hand-over failed, so the relay records it.
        The target's result id goes into ``message.delivery``, which the relay saves when
        it marks the message sent."""
        result_id = _enqueued(message, self._handing(message))
        message.delivery = {**message.delivery, "result_id": result_id}
        _runs_known_by([(message, result_id)])

    def deliver_batch(self, messages: Sequence[OutboxMessage]) -> list[Exception | None]:
        """Hand a batch of messages to the ``DELIVER_TO`` backend together: one multi-row
        ``INSERT`` into django-tasks-db's ``DatabaseBackend``, the backend's ``enqueue``
        task after task into any other. Per message, in order: the exception that makes
        it unsendable before anything was written (an unknown task, say), else ``None``.
        Raises when the hand-over itself failed; the relay then rolls it back and hands
        the messages over one by one, so that the failure is recorded on its own message.
        """
        outcomes: list[Exception | None] = []
        ready: list[tuple[OutboxMessage, Handed]] = []
        bound: dict[tuple[Any, ...], Task[Any, Any]] = {}
        for message in messages:
            try:
                ready.append((message, self._handing(message, bound)))
            except Exception as exc:  # recorded on its message by the relay
                outcomes.append(exc)
            else:
                outcomes.append(None)
        if database_of(self.target) is None:  # a backend that may run a task at once
            result_ids = [_enqueued(message, handed) for message, handed in ready]
        else:
            result_ids = enqueue_many(self.target, [handed for _, handed in ready])
        handed_over = [
            (message, result_id) for (message, _), result_id in zip(ready, result_ids, strict=True)
        ]
        for message, result_id in handed_over:
            message.delivery = {**message.delivery, "result_id": result_id}
        _runs_known_by(handed_over)
        return outcomes

    def _handing(
        self, message: OutboxMessage, bound: dict[tuple[Any, ...], Task[Any, Any]] | None = None
    ) -> Handed:
        """The message's task bound to the ``DELIVER_TO`` backend with its delivery
        options, and the arguments it is enqueued with. ``bound``: the tasks bound so far
        in this batch, by task and options (messages of a batch mostly share them)."""
        delivery = message.delivery
        run_after = delivery.get("run_after")
        options = (message.task, delivery.get("priority"), delivery.get("queue_name"), run_after)
        handed = bound.get(options) if bound is not None else None
        if handed is None:
            handed = self._bind(message.task, delivery, run_after)
            if bound is not None:
                bound[options] = handed
        kwargs = dict(message.kwargs)
        if is_idempotent_task(handed.func):
            kwargs[MESSAGE_ARGUMENT] = str(message.id)
        return handed, list(message.args), kwargs

    def _bind(self, path: str, delivery: dict[str, Any], run_after: Any) -> Task[Any, Any]:
        task = import_string(path)
        if not isinstance(task, Task):
            raise outbox.UnknownTask(f"{path} is no task of Django's Tasks framework")
        return task.using(
            backend=self.target.alias,
            priority=delivery.get("priority", task.priority),
            queue_name=delivery.get("queue_name", task.queue_name),
            run_after=_moment(run_after) if run_after else None,
        )


_UNDELIVERED = "django_idempotency.outbox.Undeliverable"

#: The message the relay is handing over here: its task's function, and its id where its
#: run is reported on its ``enqueue_once`` key (``run_reported``). A backend that runs a
#: task inside its ``enqueue`` (Django's ``ImmediateBackend``) starts it before its result
#: id is known. Taken by that run's start: a run started inside it (a task its body
#: enqueues on such a backend) is another run.
_HANDING: ContextVar[tuple[Callable[..., Any], uuid.UUID | None] | None] = ContextVar(
    "django_idempotency_handing", default=None
)
#: The reported runs going on here, innermost last: each run's result id, and how it is
#: reported (``("message", id)`` or ``("run", result id)``), from the framework's
#: ``task_started`` to its ``task_finished``. A run nests in another where a backend runs
#: a task inside its ``enqueue``.
_REPORTING: ContextVar[tuple[tuple[str, tuple[str, str]], ...]] = ContextVar(
    "django_idempotency_reporting", default=()
)
#: The most runs kept in ``_REPORTING``: a run whose end never came (a backend that sent
#: no ``task_finished``) is not kept forever.
_MOST_REPORTING = 32


def _enqueued(message: OutboxMessage, handed: Handed) -> str:
    """Enqueue one handed-over task on the target; its result id."""
    task, args, kwargs = handed
    handing = _HANDING.set((task.func, message.id if message.run_reported else None))
    try:
        return str(task.enqueue(*args, **kwargs).id)
    finally:
        _HANDING.reset(handing)


def _runs_known_by(handed: Sequence[tuple[OutboxMessage, str]]) -> None:
    """For the messages whose run is reported on their key: the id the target's worker
    will know the run by, written on the key in the relay's transaction (so a worker of a
    target in the same database never sees the task before its key knows it)."""
    _unique.runs_known_by(
        app_settings.DATABASE,
        [(message.id, result_id) for message, result_id in handed if message.run_reported],
    )


def enqueue_once(
    key: str,
    task: Task[Any, Any],
    /,
    *args: Any,
    unique_until: str | timedelta | float = "finished",
    on_conflict: str = "return",
    **kwargs: Any,
) -> TaskResult[Any, Any]:
    """``outbox.enqueue_once`` for a task of Django's Tasks framework, answered as
    ``task.enqueue`` answers: the ``TaskResult`` of the new message, or of the live one
    that holds ``key``. The task's backend must be an ``OutboxBackend``."""
    return _outbox_backend(task).enqueue_once(
        key, task, args, kwargs, unique_until=unique_until, on_conflict=on_conflict
    )


def _outbox_backend(task: Task[Any, Any]) -> OutboxBackend:
    if not isinstance(task, Task):
        raise TypeError(
            f"enqueue_once() of tasks_backend takes a task of Django's Tasks framework, not "
            f"{task!r}; for a Celery task or a task name, use outbox.enqueue_once()"
        )
    backend = task.get_backend()
    if not isinstance(backend, OutboxBackend):
        raise TypeError(
            f"the outbox takes a task on an outbox backend ({BACKEND_PATH}); "
            f"{task.module_path} is on {task.backend!r}, a {type(backend).__name__}"
        )
    return backend


def _recognized(task: object) -> outbox.Target | None:
    # outbox.enqueue_once's view of a task of Django's Tasks framework.
    if not isinstance(task, Task):
        return None
    return outbox.Target(
        task.module_path, _outbox_backend(task).delivery(task), task.func, task.run_after
    )


def outbox_backend(alias: Any) -> OutboxBackend:
    """The outbox backend ``alias`` of ``TASKS``, which a message of Django's Tasks
    framework names; ``UnknownTask`` when there is none. Registered with the relay's
    sender when the app is ready: it hands such messages to it, one by one
    (:meth:`OutboxBackend.deliver`) or in batches (``deliver_batch``)."""
    try:
        backend = task_backends[alias]
    except Exception as exc:  # InvalidTaskBackend: no longer in TASKS
        raise outbox.UnknownTask(f"the Tasks backend {alias!r} cannot be had: {exc}") from exc
    if not isinstance(backend, OutboxBackend):
        raise outbox.UnknownTask(f"the Tasks backend {alias!r} is no outbox backend")
    return backend


def register() -> None:
    """What the outbox needs of Django's Tasks framework: its tasks for ``enqueue_once``,
    the hand-over of its messages for the relay, and the runs its workers announce (the
    key of a task enqueued on a backend directly). Called when the app is ready."""
    outbox.register_task_kind(_recognized)
    _senders.register_delivery(outbox_backend)
    # A task under @idempotent_task() enqueued on a backend directly (no outbox message)
    # is keyed by the backend's task result, whose run these signals announce.
    task_started.connect(_run_started, dispatch_uid="django_idempotency.task_started")
    task_finished.connect(_run_finished, dispatch_uid="django_idempotency.task_finished")


def _run_started(sender: object, task_result: TaskResult[Any, Any], **kwargs: Any) -> None:
    func = task_result.task.func
    django_run_started(func, task_result.id)
    reported: tuple[str, str] | None = None
    handing = _HANDING.get()
    if handing is not None and handing[0] is func:
        # The run of the message the relay hands over, inside its hand-over; by the
        # message where its run is reported, else not at all.
        _HANDING.set(None)
        if handing[1] is not None:
            reported = ("message", str(handing[1]))
    elif task_result.backend in _delivered_to() and not records_by_message(func):
        reported = ("run", str(task_result.id))
    if reported is None:
        return
    try:
        found = _unique.run_started(app_settings.DATABASE, app_settings.LEASE, **_by(reported))
        # A run whose key did not know it yet may be a message's whose hand-over had not
        # committed: its end is reported once it comes (one UPDATE more).
        known_later = not found and reported[0] == "run" and _seen_first(task_result.backend)
    except Exception:  # the task runs whatever: its key stays held until its run's TTL
        logger.exception("could not report the start of task run %s on its key", reported[1])
        return
    if found or known_later:
        running = (*_REPORTING.get(), (str(task_result.id), reported))
        _REPORTING.set(running[-_MOST_REPORTING:])


def _run_finished(sender: object, task_result: Any = None, **kwargs: Any) -> None:
    django_run_finished()
    running = _REPORTING.get()
    result_id = str(getattr(task_result, "id", None))
    # This run's report, and those of runs started inside it whose end never came.
    ended = next((i for i in reversed(range(len(running))) if running[i][0] == result_id), None)
    if ended is None:
        return
    reported = running[ended][1]
    _REPORTING.set(running[:ended])
    try:
        _unique.run_ended(app_settings.DATABASE, **_by(reported))
    except Exception:  # its key stays held until the run's lease runs out
        logger.exception("could not report the end of task run %s on its key", reported[1])


def _by(reported: tuple[str, str]) -> dict[str, Any]:
    kind, value = reported
    return {"message_id": value} if kind == "message" else {"run_id": value}


def _seen_first(alias: str) -> bool:
    """Whether a worker of the backend ``alias`` may start a task before the relay's
    transaction that handed it over (and wrote the run's id on its key) has committed: the
    backend keeps its tasks outside the outbox's database (a broker's backend; a
    django-tasks-db routed to another database), not in it, where both commit together."""
    return database_of(task_backends[alias]) != app_settings.DATABASE


def _delivered_to() -> set[str]:
    """The backends the outbox backends of ``TASKS`` hand their messages to: a run of
    theirs may be one a message's key awaits the report of."""
    return {
        str(entry.get("OPTIONS", {}).get(DELIVER_TO))
        for entry in getattr(settings, "TASKS", {}).values()
        if isinstance(entry, dict) and entry.get("BACKEND") == BACKEND_PATH
    }


def _moment(text: str) -> datetime:
    moment = parse_datetime(text)
    if moment is None:
        raise outbox.Unreadable(f"the stored run_after is no moment: {text!r}")
    if not settings.USE_TZ:  # as Django's DateTimeField takes it: naive, local time
        return timezone.make_naive(moment) if timezone.is_aware(moment) else moment
    return moment if timezone.is_aware(moment) else timezone.make_aware(moment)
