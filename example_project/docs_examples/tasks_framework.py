"""The code of docs/tasks.md ("Django's Tasks framework"), run by tests/test_docs_tasks.py.

``task`` is Django 6's ``django.tasks.task``, or the django-tasks backport's on Django 5.2.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from django.contrib.auth.models import User
from django.core.mail import send_mail
from django.db import transaction

from django_idempotency.tasks import idempotent_task

if TYPE_CHECKING or importlib.util.find_spec("django.tasks") is None:
    from django_tasks import task
else:  # Django 6
    from django.tasks import task

# --8<-- [start:settings]
TASKS = {
    "default": {
        "BACKEND": "django_idempotency.tasks_backend.OutboxBackend",
        "OPTIONS": {"DELIVER_TO": "worker"},
    },
    "worker": {"BACKEND": "django_tasks_db.DatabaseBackend"},
}
# --8<-- [end:settings]

# For the backport on Django 5.2 (Django 6 needs neither of the first two lines' apps):
# --8<-- [start:installed-apps]
INSTALLED_APPS = [
    # ...
    "django_tasks",  # the django-tasks backport only; not on Django 6
    "django_tasks_db",  # the database backend and its `manage.py db_worker`
    "django_idempotency",
]
# --8<-- [end:installed-apps]


# --8<-- [start:task]
@task()
@idempotent_task()
def send_welcome(user_id: int) -> str:
    """Runs once per enqueue, however often the relay or a worker delivers it."""
    user = User.objects.get(pk=user_id)
    send_mail("Welcome", f"Hello {user.username}!", None, [user.email])
    return user.email
    # --8<-- [end:task]


# --8<-- [start:enqueue]
def sign_up(username: str, email: str) -> Any:
    with transaction.atomic():
        user = User.objects.create_user(username, email)
        # An outbox message, committed with the user or rolled back with it.
        result = send_welcome.enqueue(user.pk)
    return user, result.id
    # --8<-- [end:enqueue]


@task()
@idempotent_task()
def rebuild_search_index() -> int:
    """A periodic task of Django's Tasks framework."""
    return 0


# --8<-- [start:enqueue-once]
from django_idempotency.tasks_backend import enqueue_once


def every_minute() -> Any:
    with transaction.atomic():
        # The TaskResult of the new message, or of the live one that holds the key.
        result = enqueue_once("search-index", rebuild_search_index)
    return result.id
    # --8<-- [end:enqueue-once]
