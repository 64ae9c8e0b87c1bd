"""Django's Tasks framework, wherever it comes from: ``django.tasks`` on Django 6.0 and
later, the ``django-tasks`` backport on Django 5.2 (the ``tasks`` extra).

The same choice as the database backend's (``django_tasks_db``): ``django.tasks`` whenever
Django has it, so that a task, its backend and its worker agree on one ``Task`` class.
Importing this module without either raises ``ImportError``.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING or importlib.util.find_spec("django.tasks") is not None:
    from django.tasks import task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskError, TaskResult, TaskResultStatus
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.tasks.signals import task_finished, task_started
else:  # Django 5.2 with the backport
    from django_tasks import task_backends
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import Task, TaskError, TaskResult, TaskResultStatus
    from django_tasks.exceptions import InvalidTaskError as InvalidTask
    from django_tasks.exceptions import TaskResultDoesNotExist
    from django_tasks.signals import task_finished, task_started

__all__ = [
    "BaseTaskBackend",
    "InvalidTask",
    "Task",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultStatus",
    "task_backends",
    "task_finished",
    "task_started",
]
