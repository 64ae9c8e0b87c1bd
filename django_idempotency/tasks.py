"""Task consumers run once per delivery, and Celery's periodic maintenance tasks.

``@idempotent_task()`` serves Celery tasks and tasks of Django's Tasks framework delivered
through the outbox (``tasks_backend.OutboxBackend``); it imports and works without Celery.
The Celery tasks (``purge_expired``, ``recover_stale_leases``, ``relay_outbox``) exist when
Celery is installed; without it, reading one raises ``ImportError`` saying so. The module
never imports a project's Celery app: ``shared_task`` binds to whichever app the project
configures.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import traceback
import uuid
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import asdict
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

from asgiref.sync import async_to_sync
from django.core.exceptions import ImproperlyConfigured
from django.db import InterfaceError, OperationalError, connections

from django_idempotency import (
    _http,
    _options,
    _protection,
    _threads,
    _unique,
    _validation,
    maintenance,
    outbox,
)
from django_idempotency._once import LeaseTakenOver, call_once, stored_result
from django_idempotency._policies import RETRY
from django_idempotency._unique import TASK_ACCOUNT, task_operation
from django_idempotency.conf import app_settings
from django_idempotency.exceptions import (
    IdempotencyError,
    InProgress,
    OutcomeTooLarge,
    OutcomeUnknown,
    StoreUnavailable,
)
from django_idempotency.keys import InvalidKey

logger = logging.getLogger("django_idempotency")

F = TypeVar("F", bound=Callable[..., Any])
DeliveryKey = Callable[..., object]

TASK_FINGERPRINT_VERSION = "task-v1"
#: The keyword argument that carries an outbox message's id to a task of Django's Tasks
#: framework under ``@idempotent_task()``; the decorator takes it away before the body.
MESSAGE_ARGUMENT = "_outbox_message_id"
# Waiting out another delivery's lease: a moment more than the lease itself.
_LEASE_MARGIN = timedelta(seconds=1)

CELERY = importlib.util.find_spec("celery") is not None
_MARK = "idempotent_task"
# How many decorators' layers between a Celery task's run and the body are followed.
_WRAPPERS_FOLLOWED = 16
_CELERY_TASKS = ("purge_expired", "recover_stale_leases", "relay_outbox")

if TYPE_CHECKING or CELERY:
    from celery import current_task, shared_task
    from celery.app.task import Task

    @shared_task(name="django_idempotency.purge_expired")
    def purge_expired(
        batch_size: int | None = None, max_batches: int | None = None, using: str | None = None
    ) -> dict[str, Any]:
        """Celery beat task: :func:`django_idempotency.maintenance.purge_expired`."""
        result = maintenance.purge_expired(
            using=using, batch_size=batch_size, max_batches=max_batches
        )
        return asdict(result)

    @shared_task(name="django_idempotency.recover_stale_leases")
    def recover_stale_leases(limit: int | None = None, using: str | None = None) -> dict[str, Any]:
        """Celery beat task: :func:`django_idempotency.maintenance.recover_stale_leases`."""
        return asdict(maintenance.recover_stale_leases(using=using, limit=limit))

    @shared_task(name="django_idempotency.relay_outbox")
    def relay_outbox(batch_size: int | None = None, using: str | None = None) -> dict[str, Any]:
        """Celery beat task: drain the outbox once (:func:`django_idempotency.outbox.relay`)."""
        return asdict(outbox.relay(using=using, batch_size=batch_size, once=True))

else:

    def __getattr__(name: str) -> Any:
        if name in _CELERY_TASKS:
            raise ImportError(
                f"django_idempotency.tasks.{name} is a Celery task, and Celery is not "
                "installed: pip install 'django-idempotency[celery]'"
            )
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class DeliveryInProgress(Exception):
    """Another delivery holds the key's live lease, and this run cannot be retried later.

    Raised only outside a worker (an eager ``apply()`` or a plain call with a key callable);
    a worker's delivery is retried instead.
    """


def idempotent_task(
    misplaced: object = None,
    /,
    *,
    key: DeliveryKey | None = None,
    ttl: timedelta | int | None = None,
    lease: timedelta | int | None = None,
    recovery: str | Callable[[Any], Any] | None = None,
) -> Callable[[F], F]:
    """Run a task's body at most once per delivery key, however often it is delivered.

    Put it directly beneath ``@shared_task`` (or ``@app.task``) of Celery, or beneath
    ``@task`` of Django's Tasks framework, with parentheses. The key is the Celery task id,
    or the outbox message's id for a task enqueued on ``tasks_backend.OutboxBackend`` (the
    relay passes it as the keyword argument ``MESSAGE_ARGUMENT``, taken away before the
    body runs, so the task's own signature stays as written), or the backend's task result
    id for a task of Django's Tasks framework enqueued on a real backend directly, or
    ``key(*args, **kwargs)``. A function merely called inside a running task is no delivery
    of it: it never takes that task's id or name.
    A delivery of a Django task that meets another delivery's live lease waits for its
    outcome, at most the lease (Django's Tasks framework has no retry to come back with).
    A thin adapter over
    ``django_idempotency.run_once``: the record lives in the idempotency table under
    account ``"task"`` and operation ``"task:<task name>"``, for ``ttl`` (default ``TTL``).

    - The body and the completion of the record commit in one transaction: a delivery that
      dies midway leaves neither, and the next delivery runs the body afresh.
    - Completed already: the body is skipped and the stored return value (JSON) returned.
    - In progress under a live lease: the delivery is retried once that lease has run out
      (``lease``, default ``LEASE``: make it longer than the task ever runs).
    - The body raises: the claim is released, so a redelivery or a retry runs again.
    - A delivery that outlived its lease while another took over: its work is rolled back
      and it returns ``None``. A record closed as failed (by ``recovery="fail"`` after a
      worker died, or the admin's "mark as failed"): never run again, and ``None`` is
      returned.
    - Completed, but its stored return value cannot be read back (sealed with a key that
      ``ENCRYPTION_KEYS`` no longer holds, or damaged): ``RecordUnreadable`` is raised and
      the body does not run.
    - ``recovery``: what a redelivery does with a dead worker's stale lease, as for
      ``run_once`` (``"retry"`` by default, ``"fail"``, or a callable).

    A wrong argument (``ttl=0``, a ``key`` that is not callable) raises
    ``ImproperlyConfigured`` here, when the task is decorated. So does a shape that would
    not protect the task the worker runs: ``@idempotent_task`` without its parentheses (or
    anything given positionally: its options are keywords), ``@idempotent_task()``
    above ``@shared_task`` or ``@task`` instead of beneath it, and ``@idempotent_task()``
    written twice (whose body would never run).
    """
    where = _validation.caller()
    if misplaced is not None:
        _refuse_bare(misplaced, where)
    checked = _options.validated(
        f"@idempotent_task(...) at {where}",
        {"key": key, "ttl": ttl, "lease": lease, "recovery": recovery},
        accepted=_options.TaskOptions.__optional_keys__,
    )
    delivery_key: DeliveryKey | None = checked["key"]
    ttl, lease = checked["ttl"], checked["lease"]

    def decorate(func: F) -> F:
        _refuse_a_task(func, where)
        _refuse_twice(func, where)

        def deliver(body: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            message = kwargs.pop(MESSAGE_ARGUMENT, None)
            # A run of Django's Tasks framework enqueued on its backend directly (no
            # outbox message): a delivery of that backend's task result.
            run = _django_run(wrapper)
            django = message is not None or run is not None
            task = None if django else _delivering(wrapper)
            # An item of task.map()/starmap()/chunks(): a call of the task that a delivery
            # of Celery's map makes (that delivery's message, and the item's key).
            item = _item_of_a_map(task)
            delivery = (
                delivery_key(*args, **kwargs)
                if delivery_key is not None
                else message
                if message is not None
                else run
                if run is not None
                else _task_key(task) or (item[1] if item is not None else None)
            )
            name = task.name if task is not None else f"{func.__module__}.{func.__qualname__}"
            if delivery is None:
                if delivery_key is not None:
                    # A key callable that finds no key must not run the body unprotected,
                    # as a request without its key does not.
                    raise InvalidKey(
                        f"the key= of @idempotent_task() on {name} answered None for these "
                        "arguments; the body was not run"
                    )
                # A plain call of the task's function is not a delivery: nothing to dedupe.
                return body(*args, **kwargs)
            running = (name, str(delivery))
            if running in _RUNNING.get():
                # Inside this very run (the task calling itself, whose Task.__call__ copies
                # the running request, task id included; eagerly, a replacement run in
                # it): a plain call, its work part of the run's.
                return body(*args, **kwargs)
            if task is not None:
                _steady_callbacks(task, f"{name}:{delivery}")
                body = _handing_over(body)
            token = _RUNNING.set(_RUNNING.get() | {running})
            body, raised = _noting_errors(body)
            try:
                value = call_once(
                    body,
                    args,
                    kwargs,
                    account=TASK_ACCOUNT,
                    operation=task_operation(name),
                    key=str(delivery),
                    ttl=ttl,
                    lease=lease,
                    # Every delivery of a key is the same request: after a worker died, a
                    # redelivery takes its stale lease over and applies the policy
                    # (by default it runs the body again).
                    recovery=checked["recovery"] or RETRY.name,
                    # Django's Tasks framework has no retry to come back with: a delivery
                    # that meets another's live lease waits for its outcome, or for the
                    # lease to run out and then takes it over.
                    wait=_waited_out(checked["lease"]) if django else None,
                    encode=_stored_unless_replaced,
                ).value
            except Exception as exc:
                # What the body raised is the body's error, whatever its class: an
                # InProgress or an OutcomeUnknown of a run_once inside it is no answer
                # about this delivery's own record.
                by_body = any(exc is error for error in raised)
                if not by_body and isinstance(exc, LeaseTakenOver):
                    logger.warning("a task delivery lost its lease; its work was rolled back")
                    return None
                if not by_body and isinstance(exc, OutcomeUnknown):
                    logger.warning("skipped a delivery of %s: its record was marked failed", name)
                    return None
                if not by_body and isinstance(exc, InProgress):
                    return _in_progress(
                        item[0] if item is not None else task, name, exc.retry_after
                    )
                # The run ended with an error: a key of enqueue_once it holds is free. Not
                # when Celery retries it: self.retry() inside the body, or autoretry_for
                # around this wrapper.
                if (by_body or _ended(exc)) and not _retried(task, exc):
                    _run_failed(message if message is not None else _task_id(task))
                raise
            finally:
                _RUNNING.reset(token)
            if isinstance(value, _Replaced):
                # Its work and its record committed; Celery learns that it was replaced.
                raise value.signal
            return value

        if inspect.iscoroutinefunction(func):
            # The engine is synchronous: the coroutine runs on an event loop from the
            # engine's thread, its ORM calls back in that thread, inside the record's
            # transaction (as for an async view).
            # The engine runs on one of the loop's engine threads (_threads), a thread to
            # itself for the delivery, never one of the event loop's default executor, which
            # the body's own asyncio.to_thread waits for: as many deliveries at once as
            # that executor has threads would fill it for good (as for a tool call).
            body = async_to_sync(_threads.watched(func))

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                return await _http.run_to_the_end(
                    functools.partial(deliver, body, args, kwargs), own_thread=True
                )

            wrapper: Callable[..., Any] = async_wrapper
        else:

            @functools.wraps(func)
            def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
                return deliver(func, args, kwargs)

            wrapper = sync_wrapper
        wrapper.__dict__[_MARK] = True
        # Its record is found by the message's id (enqueue_once's "started"/"finished").
        wrapper.__dict__[_unique.BY_MESSAGE] = delivery_key is None
        wrapper.__dict__[_unique.RECORD_TTL] = ttl
        return cast(F, wrapper)

    return decorate


#: What the right shape looks like, in every refusal of a wrong one.
_RIGHT_SHAPE = (
    "write @idempotent_task() (its options as keywords: key=..., ttl=...) directly "
    "beneath @shared_task (or @app.task, or @task of Django's Tasks framework), just "
    "above the function"
)


def _task_decorator(obj: object) -> str | None:
    """``"@shared_task"`` when ``obj`` is a Celery task (or the proxy ``@shared_task``
    returns), ``"@task"`` for a task of Django's Tasks framework, else ``None``.

    Read from the object's own type (``type()`` does not evaluate Celery's proxy, which
    would finalize the app at import time), by name, so neither framework is imported."""
    for klass in type(obj).__mro__:
        where = (klass.__module__, klass.__name__)
        if where in {("celery.local", "Proxy"), ("celery.app.task", "Task")}:
            return "@shared_task"
        if where in {("django.tasks.base", "Task"), ("django_tasks.base", "Task")}:
            return "@task"
    return None


def _refuse_bare(misplaced: object, where: str) -> None:
    # @idempotent_task without parentheses hands the decorator the function (or, above the
    # task decorator, the task) as if it were an option: the task would run the decorator
    # and return its inner function, reporting SUCCESS without ever running the body.
    what = (
        "a task"
        if _task_decorator(misplaced)
        else f"the positional {_validation.describe(misplaced)}"
    )
    raise ImproperlyConfigured(
        f"@idempotent_task needs its parentheses: write @idempotent_task() at {where} "
        f"(it was given {what}). Then {_RIGHT_SHAPE}. Without them the task would report "
        "success without ever running its body."
    )


def _refuse_a_task(func: object, where: str) -> None:
    # The object given, or one a decorator made with functools.wraps wraps: the worker
    # runs the task beneath either way, under its name.
    found = (_task_decorator(f) for f in _protection.wrapped_by(func, closures=False))
    decorator = next((d for d in found if d is not None), None)
    if decorator is None:
        return
    framework = (
        "a Celery task" if decorator == "@shared_task" else "a task of Django's Tasks framework"
    )
    raise ImproperlyConfigured(
        f"@idempotent_task() at {where} is above the task decorator: what it decorates is "
        f"already {framework}, and the worker would run that task unprotected. Put "
        f"@idempotent_task() beneath {decorator}: {_RIGHT_SHAPE}."
    )


def _refuse_twice(func: object, where: str) -> None:
    # Both layers would claim the delivery's one key: the inner one would always meet the
    # outer one's claim, and the body never run (a worker retrying it after every lease).
    # Followed through functools.wraps (which copies the mark too), not through closures:
    # a body may well close over another function under @idempotent_task() that it calls.
    if not any(is_idempotent_task(f) for f in _protection.wrapped_by(func, closures=False)):
        return
    raise ImproperlyConfigured(
        f"@idempotent_task() at {where} decorates a function already under "
        "@idempotent_task(): written twice, every delivery would meet its own claim and "
        f"the body never run. Write it once, directly beneath @shared_task: {_RIGHT_SHAPE}."
    )


def _waited_out(lease: timedelta | None) -> timedelta:
    return (lease or app_settings.LEASE) + _LEASE_MARGIN


def is_idempotent_task(func: Callable[..., Any]) -> bool:
    """Whether ``func`` is under ``@idempotent_task()``: the relay then hands it the
    message's id (``MESSAGE_ARGUMENT``)."""
    return bool(getattr(func, _MARK, False))


def _noting_errors(
    body: Callable[..., Any],
) -> tuple[Callable[..., Any], list[BaseException]]:
    """``body``, and the list of what it raised: told apart from what the engine raises
    about the delivery's own record (an error of the body's may be of any class)."""
    raised: list[BaseException] = []

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return body(*args, **kwargs)
        except BaseException as exc:
            raised.append(exc)
            raise

    return run, raised


def _ended(exc: BaseException) -> bool:
    """Whether a run that raised ``exc`` ended (rather than meeting another's record): a
    result too large to store ends every run of it the same way, as an error; so does a
    body that ran and whose work the store refused or lost (``StoreUnavailable`` with
    ``ran``: a deadlock, a serialization failure, the connection lost), its claim released
    or its lease given back."""
    if isinstance(exc, StoreUnavailable):
        return exc.ran
    return isinstance(exc, OutcomeTooLarge) or not isinstance(exc, IdempotencyError)


def _retried(task: Task[Any, Any] | None, exc: BaseException) -> bool:
    """Whether Celery runs the message again after this run raised ``exc``: its run has
    not ended. ``self.retry()`` raises ``Retry`` through the body; ``Reject(requeue=True)``
    hands an ``acks_late`` message back to the broker (in a worker: an eager run has no
    message); ``autoretry_for`` turns ``exc`` into a retry around this wrapper, until
    ``max_retries``."""
    if task is None:
        return False
    from celery.exceptions import Ignore, Reject, Retry

    if isinstance(exc, Retry):
        return True
    # (Reject keeps requeue as an attribute; celery-types does not declare it.)
    requeued = isinstance(exc, Reject) and getattr(exc, "requeue", False)
    if requeued and task.acks_late and not task.request.is_eager:
        return True
    if not hasattr(task, "_orig_run") or isinstance(exc, Ignore):  # no autoretry wrapper
        return False
    autoretry = tuple(getattr(task, "autoretry_for", ()))
    spared = tuple(getattr(task, "dont_autoretry_for", ()))
    if not autoretry or not isinstance(exc, autoretry) or (spared and isinstance(exc, spared)):
        return False
    limit = getattr(task, "retry_kwargs", {}).get("max_retries", task.max_retries)
    return limit is None or task.request.retries < limit


def revoked(
    sender: object = None, request: Any = None, terminated: object = False, **kwargs: Any
) -> None:
    """Celery's ``task_revoked``: a message revoked (or past its ``expires``) that a worker
    discarded ends there, a terminal state: its ``enqueue_once`` key is free. A run it
    stopped (``revoke(terminate=True)``: the worker signals the run's process and says so
    at once, while the run may go on) keeps its lease, which decides as after a crash: its
    record's, or the run's reported on the key (``_unique.finished``)."""
    task_id = getattr(request, "id", None)
    _run_failed(task_id if isinstance(task_id, str) else None, stopped=bool(terminated))


def run_started(
    sender: object = None, task_id: object = None, task: Any = None, **kwargs: Any
) -> None:
    """Celery's ``task_prerun``: a run of a message whose run is reported on its
    ``enqueue_once`` key (the relay sent it with ``RUN_HEADER``, or it replaces such a run
    under its task id) starts; the key holds until it ends, or at most its lease from now:
    the task's hard time limit in a process of the prefork pool, else ``LEASE``."""
    reported = _reported(task)
    if reported is None:
        return
    try:
        _reporting(
            functools.partial(
                _unique.run_started,
                app_settings.DATABASE,
                _reported_lease(task),
                message_id=task_id,
                reported_only=reported == _REPLACEMENT,
            )
        )
    except Exception:  # the task runs whatever: its key stays held until its run's TTL
        logger.exception("could not report the start of message %s on its key", task_id)


def run_ended(
    sender: object = None,
    task_id: object = None,
    task: Any = None,
    state: object = None,
    retval: object = None,
    **kwargs: Any,
) -> None:
    """Celery's ``task_postrun``: the reported run has ended (its key is free), unless the
    message runs again (:func:`_runs_again`): then that run reports."""
    reported = _reported(task)
    if reported is None or _runs_again(task, state, retval):
        return
    try:
        _reporting(
            functools.partial(
                _unique.run_ended,
                app_settings.DATABASE,
                message_id=task_id,
                reported_only=reported == _REPLACEMENT,
            )
        )
    except Exception:  # its key stays held until the run's lease runs out
        logger.exception("could not report the end of message %s on its key", task_id)


def _reporting(report: Callable[[], object]) -> None:
    """``report()``, one statement; once more on a new connection when the server had
    dropped this one (an idle timeout, a restart): a worker keeps its connection between
    tasks (``CONN_MAX_AGE``), and a run's report is the first statement to find out. Not
    inside a transaction (an eager run's), which a new connection would not continue."""
    connection = connections[app_settings.DATABASE]
    try:
        report()
    except (OperationalError, InterfaceError):
        if connection.in_atomic_block:
            raise
        connection.close()
        report()


def published_again(sender: object = None, headers: object = None, **kwargs: Any) -> None:
    """Celery's ``after_task_publish``: a reported run that published its own message again
    has not ended when it stops. ``Task.replace`` publishes the replacement one level
    deeper in ``replaced_task_nesting``, then raises ``Ignore``: the replacement, under its
    task id, reports the rest of the message's run. ``Task.retry`` publishes the message
    under its task id with ``retries`` one more (a replacement's retry at its own nesting),
    then raises ``Retry`` (the run ends in ``RETRY``), or with ``throw=False`` hands the
    body the exception to return (the run ends in ``SUCCESS``): the retry reports the rest.
    After the publish, not before: a retry or a replacement the broker (or the serializer)
    refused is no run to come, and the run that tried it ends the message's run."""
    if not isinstance(headers, dict):
        return
    nesting = headers.get("replaced_task_nesting")
    nesting = nesting if isinstance(nesting, int) else 0
    retries = headers.get("retries")
    retries = retries if isinstance(retries, int) else 0
    if nesting <= 0 and retries <= 0:
        return  # a first publish: every other message published anywhere
    from celery import current_task

    running: Any = current_task if current_task else None  # the run publishing, if any
    if _reported(running) is None:
        return
    request = running.request
    deeper = nesting > (getattr(request, "replaced_task_nesting", 0) or 0)
    retried = headers.get("id") == request.id and retries > (request.retries or 0)
    if deeper or retried:
        setattr(request, _AGAIN, True)


def worker_starting(sender: object = None, **kwargs: Any) -> None:
    """Celery's ``worker_init``: whether the worker's pool kills a run at its hard time
    limit, which is then a reported run's lease. The prefork pool does (its processes,
    forked from this one, inherit the answer); the threads, solo, gevent and eventlet pools
    let a run go on past it."""
    from celery.concurrency import get_implementation
    from celery.concurrency.prefork import TaskPool

    pool = getattr(sender, "pool_cls", None)
    try:
        chosen = get_implementation(pool) if pool is not None else None
    except Exception:  # a pool Celery will refuse itself: no limit known to be enforced
        chosen = None
    _Pool.kills_at_time_limit = isinstance(chosen, type) and issubclass(chosen, TaskPool)


class _Pool:
    #: This process runs tasks in Celery's prefork pool, which kills a run at its hard time
    #: limit (:func:`worker_starting`).
    kills_at_time_limit = False


# How a Celery run is reported on its key: the relay sent its message with RUN_HEADER; or
# it replaces such a run under its task id (Task.replace), the header not carried over.
_SENT, _REPLACEMENT = "sent", "replacement"
#: Set on the request of a reported run that published its message again: a replacement or
#: a retry (:func:`published_again`).
_AGAIN = "django_idempotency_again"


def _reported(task: Any) -> str | None:
    request = getattr(task, "request", None)
    if request is None:
        return None
    headers = getattr(request, "headers", None)
    if isinstance(headers, dict) and headers.get(_unique.RUN_HEADER):
        return _SENT
    if getattr(request, _unique.RUN_HEADER, None):
        return _SENT
    # A replacement: reported when its task id is a reported message's (one UPDATE).
    return _REPLACEMENT if getattr(request, "replaced_task_nesting", 0) else None


def _runs_again(task: Any, state: object, retval: object) -> bool:
    """Whether Celery runs the message again after this run stopped in ``state``: a retry
    (``RETRY``; or ``SUCCESS`` after ``self.retry(throw=False)``), a
    ``Reject(requeue=True)`` of an ``acks_late`` message (``REJECTED``), or a replacement
    under the same task id (``IGNORED``): those that publish the message again say so
    (:func:`published_again`). The key holds for this run's lease meanwhile, and the next
    run reports again."""
    if state == "RETRY" or getattr(task.request, _AGAIN, False):
        return True
    if state == "REJECTED":
        return isinstance(retval, BaseException) and _retried(task, retval)
    return False


def _reported_lease(task: Any) -> timedelta:
    # A hard time limit ends the run where the pool kills it there (prefork): the run holds
    # the key no longer. Elsewhere a run may go on past it: LEASE.
    if not _Pool.kills_at_time_limit or task.request.is_eager:
        return app_settings.LEASE
    limits = getattr(task.request, "timelimit", None) or (None, None)
    hard = limits[0] or getattr(task, "time_limit", None) or task.app.conf.task_time_limit
    if isinstance(hard, int | float) and hard > 0:
        return timedelta(seconds=hard) + _LEASE_MARGIN
    return app_settings.LEASE


def _run_failed(message_id: str | None, *, stopped: bool = False) -> None:
    if message_id is None:
        return
    try:
        _unique.finished(app_settings.DATABASE, message_id, stopped=stopped)
    except Exception:  # the task's own error is what the caller must see
        logger.exception("could not free the unique key of message %s", message_id)


#: The deliveries running here, as ``(task name, key)``: a call of the task made inside
#: its own run is not another delivery of it.
_RUNNING: ContextVar[frozenset[tuple[str, str]]] = ContextVar(
    "django_idempotency_task_running", default=frozenset()
)

#: The run of Django's Tasks framework going on here: its task's function and its result
#: id, from the framework's ``task_started`` signal to its ``task_finished``
#: (``tasks_backend.register`` connects them). A context variable: an ``async def``
#: task's body runs in other threads, with this context.
_DJANGO_RUN: ContextVar[tuple[Callable[..., Any], str] | None] = ContextVar(
    "django_idempotency_task_run", default=None
)


def django_run_started(func: Callable[..., Any], result_id: object) -> None:
    """A worker of Django's Tasks framework starts running ``func`` for ``result_id``."""
    _DJANGO_RUN.set((func, str(result_id)))


def django_run_finished() -> None:
    """The run that :func:`django_run_started` announced has ended."""
    _DJANGO_RUN.set(None)


def _django_run(wrapper: Callable[..., Any]) -> str | None:
    """The result id of the run of Django's Tasks framework whose task is ``wrapper``."""
    run = _DJANGO_RUN.get()
    return run[1] if run is not None and run[0] is wrapper else None


def _delivering(wrapper: Callable[..., Any]) -> Task[Any, Any] | None:
    """The Celery task whose delivery runs ``wrapper``, if any.

    Celery's ``current_task`` is whichever task is running in this worker: a function
    under ``@idempotent_task()`` that such a task merely calls (a helper, a Django task's
    function) is no delivery of it, and must not take its id and name, which would make it
    share that task's record (meet it in progress, or replay another function's result).
    """
    if not CELERY:
        return None
    task: Task[Any, Any] | None = current_task or None
    if task is None:
        return None
    # The task's ``run`` is the wrapper, or (bind=True, a class's method) its bound form, or
    # a decorator's wrapper around it (functools.wraps's __wrapped__, else its closure).
    run = getattr(task, "run", None)
    reached = _protection.wrapped_by(getattr(run, "__func__", run), _WRAPPERS_FOLLOWED)
    return task if any(found is wrapper for found in reached) else None


#: The namespace of the task ids a delivery's link callbacks are sent with.
_CALLBACK_IDS = uuid.UUID("5b0c3a57-3f4e-4d1e-9a7e-6c1d2f0b8e41")


def _steady_callbacks(task: Task[Any, Any], record: str) -> None:
    """Give the delivery's ``link`` callbacks task ids derived from its record.

    Celery sends them after every delivery that succeeds, a replay too, each under a new
    task id unless the signature has one: a message delivered twice would send its
    callbacks twice, as two messages. Derived from the record (the task's name and its
    key) and the callback's place, they are sent under the same ids by every delivery of
    it, so a callback under ``@idempotent_task()`` runs once. A callback that has a task
    id of its own, or is a group, chain or chord, is left as it is; so are ``link_error``
    callbacks (each failed run is a run of its own)."""
    callbacks = getattr(task.request, "callbacks", None)
    if not callbacks:
        return
    steady: list[Any] = []
    for place, callback in enumerate(callbacks):
        options = callback.get("options") if isinstance(callback, dict) else None
        if (
            not isinstance(callback, dict)
            or callback.get("subtask_type")
            or (options and options.get("task_id"))
        ):
            steady.append(callback)
            continue
        callback_id = str(uuid.uuid5(_CALLBACK_IDS, f"{record}:{place}"))
        # A copy: an eager caller may hand the same signature to several messages.
        steady.append({**callback, "options": {**(options or {}), "task_id": callback_id}})
    task.request.callbacks = steady


#: Celery's own tasks that run another task's items as calls of it: ``task.map``,
#: ``task.starmap``, and ``task.chunks`` (a group of ``celery.starmap``).
_MAPS = frozenset({"celery.map", "celery.starmap"})
# Set on the request of a map's delivery: how many of its items were called so far.
_PLACE = "idempotent_task_items"


def _item_of_a_map(task: Task[Any, Any] | None) -> tuple[Task[Any, Any], str] | None:
    """For a call of ``task`` that a delivery of ``celery.map``/``celery.starmap`` makes
    for one of its items: that map task (whose message a wait for another delivery's lease
    retries) and the item's key, the map message's id and the item's place (the items are
    called in their order, the same in every delivery of the message). ``None`` for any
    other call (a delivery of ``task`` itself, a plain call)."""
    if task is None or task.request.id is not None:
        return None
    # Celery's stack of the tasks running in this thread (celery-types leaves it out).
    from celery._state import _task_stack  # type: ignore[attr-defined]

    # ``task`` may be Celery's proxy of the current task: the top of this stack.
    stack: list[Any] = _task_stack.stack
    outer = stack[-2] if len(stack) >= 2 and stack[-1].name == task.name else None
    if outer is None or outer.name not in _MAPS or outer.request.called_directly:
        return None
    request = outer.request
    if request.id is None:
        return None
    place: int = getattr(request, _PLACE, 0)
    setattr(request, _PLACE, place + 1)
    return outer, f"{request.id}:{place}"


class _Replaced:
    """What a body under ``@idempotent_task()`` that ``self.replace()`` ended answers the
    engine: it handed its work over to its replacement."""

    def __init__(self, signal: BaseException) -> None:
        self.signal = signal


def _handing_over(body: Callable[..., Any]) -> Callable[..., Any]:
    """``body``, answering :class:`_Replaced` when Celery's ``self.replace()`` ends it.

    ``replace`` sends the replacement (under this task's id) and raises ``Ignore`` from
    ``Task.on_replace``: the run is over, not failed. Its work commits with its record
    (stored as ``None``), as a return would; the ``Ignore`` is raised again afterwards."""

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return body(*args, **kwargs)
        except Exception as exc:
            if _replaced(exc):
                return _Replaced(exc)
            raise

    return run


def _replaced(exc: BaseException) -> bool:
    from celery.exceptions import Ignore

    if not isinstance(exc, Ignore):
        return False
    return any(
        frame.f_code.co_name == "on_replace" for frame, _ in traceback.walk_tb(exc.__traceback__)
    )


def _stored_unless_replaced(result: Any) -> Any:
    return stored_result(None if isinstance(result, _Replaced) else result)


def _task_key(task: Task[Any, Any] | None) -> str | None:
    """The key of a Celery delivery: its task id. ``self.replace()`` sends the replacement
    under the replaced task's id: its deliveries are keyed by the id and how deep the
    replacement is (``replaced_task_nesting``), so they never meet the replaced run's
    record. (Eagerly, the replacement runs inside the replaced run: see ``_RUNNING``.)"""
    task_id = _task_id(task)
    if task is None or task_id is None:
        return task_id
    nesting = getattr(task.request, "replaced_task_nesting", 0) or 0
    return f"{task_id}:replaced:{nesting}" if nesting else task_id


def _task_id(task: Task[Any, Any] | None) -> str | None:
    if task is None:
        return None
    task_id: str | None = task.request.id
    return task_id


def _in_progress(task: Task[Any, Any] | None, name: str, countdown: int) -> Any:
    # The other delivery may die: come back when its lease has run out, and either find its
    # result or take its lease over.
    if task is None or task.request.is_eager or task.request.called_directly:
        raise DeliveryInProgress(f"a delivery of {name} holds the lease for {countdown} s more")
    logger.info("delivery of %s in progress elsewhere; retrying in %s s", name, countdown)
    # Waiting on a live lease is not a failure of this task: it does not use up its retries.
    raise task.retry(countdown=countdown, max_retries=task.request.retries + 1)
