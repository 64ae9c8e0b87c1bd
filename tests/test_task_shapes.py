"""Every way a task decorator can be written wrong is refused where it is written.

Before these were refused, ``@idempotent_task`` without its parentheses under
``@shared_task`` made a task whose every delivery reported SUCCESS while its body never ran
(the task returned the decorator's inner function), and ``@idempotent_task()`` above
``@shared_task`` (or above ``@task`` of Django's Tasks framework) left the task the worker
runs unprotected: one message delivered twice ran its body twice. Each shape is tried with
the tests' real Celery app and a real Tasks framework ``@task``; each test counts the runs
that a delivery of the refused shape would have made (none), and the right shape beside it
runs its body once for two deliveries of one message.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("celery", reason="Celery is an optional dependency")

from celery import shared_task
from django.core.exceptions import ImproperlyConfigured

from django_idempotency.tasks import idempotent_task
from tests.celery_app import app
from tests.helpers import task_effects
from tests.testapp.models import ProviderCall

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


def count(tag: str) -> Callable[..., str]:
    def body(*args: Any) -> str:
        ProviderCall.objects.create(key=f"effect:{tag}")
        return "ran"

    body.__name__ = body.__qualname__ = f"run_{tag.replace('-', '_')}"
    body.__module__ = __name__
    return body


def delivered_twice(task: Any) -> list[Any]:
    """Two deliveries of one message (one task id), run as a worker runs them."""
    task_id = str(uuid.uuid4())
    return [task.apply(("x",), task_id=task_id).get() for _ in range(2)]


BARE = r"@idempotent_task needs its parentheses: write @idempotent_task\(\)"


@pytest.mark.parametrize("register", ["shared_task", "app.task"])
def test_idempotent_task_without_parentheses_is_refused_where_it_is_written(register):
    name = f"tests.shapes.bare_{register.replace('.', '_')}"
    outer = shared_task(name=name) if register == "shared_task" else app.task(name=name)
    with pytest.raises(ImproperlyConfigured, match=BARE) as refused:
        outer(idempotent_task(count("bare")))
    assert "beneath @shared_task" in str(refused.value)
    assert name not in app.tasks  # nothing a worker could run and call a SUCCESS
    assert task_effects("bare") == 0


def test_a_key_given_positionally_is_refused_the_same_way():
    # The same spelling as the bare decorator: a callable where the task's body would be.
    with pytest.raises(ImproperlyConfigured, match=BARE):
        idempotent_task(lambda order_id: f"order:{order_id}")


@pytest.mark.parametrize("register", ["shared_task", "app.task", "app.task bare"])
def test_idempotent_task_above_celerys_decorator_is_refused(register):
    name = f"tests.shapes.above_{register.replace('.', '_').replace(' ', '_')}"
    outer = {
        "shared_task": shared_task(name=name),
        "app.task": app.task(name=name),
        "app.task bare": app.task,
    }[register]
    with pytest.raises(ImproperlyConfigured, match="beneath @shared_task") as refused:
        idempotent_task()(outer(count("above")))
    assert "above the task decorator" in str(refused.value)


def test_the_bare_decorator_above_celerys_is_refused_too():
    with pytest.raises(ImproperlyConfigured, match=BARE):
        idempotent_task(shared_task(name="tests.shapes.bare_above")(count("bare-above")))


def test_the_right_shape_beside_them_runs_once_per_message():
    task = app.task(name="tests.shapes.right")(idempotent_task()(count("right")))
    assert delivered_twice(task) == ["ran", "ran"]
    assert task_effects("right") == 1


def test_idempotent_task_above_the_tasks_frameworks_task_is_refused():
    # django.tasks on Django 6, the django-tasks backport on 5.2.
    task = pytest.importorskip("tests.testapp.tasks_framework").task
    with pytest.raises(ImproperlyConfigured, match="beneath @task"):
        idempotent_task()(task()(count("django-task")))
    with pytest.raises(ImproperlyConfigured, match=BARE):
        task()(idempotent_task(count("django-task-bare")))


def logged(func: Callable[..., Any]) -> Callable[..., Any]:
    """A project's own decorator, made with functools.wraps."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("between", ["nothing", "a functools.wraps decorator"])
def test_idempotent_task_written_twice_is_refused_where_it_is_written(between):
    # Before, both layers claimed the delivery's one key: the inner one always met the
    # outer one's claim, so the body never ran (eagerly DeliveryInProgress; in a worker a
    # retry after the lease, again and again, for ever).
    inner = idempotent_task()(count("twice"))
    if between != "nothing":
        inner = logged(inner)
    with pytest.raises(ImproperlyConfigured, match="twice") as refused:
        app.task(name="tests.shapes.twice")(idempotent_task()(inner))
    assert "once, directly beneath @shared_task" in str(refused.value)
    assert "tests.shapes.twice" not in app.tasks
    assert task_effects("twice") == 0


@pytest.mark.parametrize("register", ["shared_task", "app.task", "task"])
def test_idempotent_task_above_a_decorator_above_the_task_decorator_is_refused(register):
    # A project's decorator (functools.wraps) between them: the worker runs the task
    # registered beneath, unprotected (beat or the outbox send it by its name), and the
    # module's name is left a plain function that no worker runs.
    name = f"tests.shapes.above_wrapped_{register.replace('.', '_')}"
    if register == "task":  # Django's Tasks framework
        outer = pytest.importorskip("tests.testapp.tasks_framework").task()
    else:
        outer = shared_task(name=name) if register == "shared_task" else app.task(name=name)
    with pytest.raises(ImproperlyConfigured, match="beneath @") as refused:
        idempotent_task()(logged(outer(count("above-wrapped"))))
    assert "above the task decorator" in str(refused.value)
