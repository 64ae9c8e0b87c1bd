from __future__ import annotations

import importlib.util

from django.apps import AppConfig


class IdempotencyConfig(AppConfig):
    """Registers the model, the system checks and the signal receivers."""

    name = "django_idempotency"
    verbose_name = "Idempotency"
    # Pinned so a project's DEFAULT_AUTO_FIELD never produces a migration for this app.
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core.signals import request_finished, request_started

        from django_idempotency import (
            _atomic_requests,
            checks,  # noqa: F401  (registers the checks)
        )
        from django_idempotency._autonomous import close_idle

        # Protected views leave ATOMIC_REQUESTS (views marked when the first request comes).
        request_started.connect(
            _atomic_requests.request_started, dispatch_uid="django_idempotency._atomic_requests"
        )
        request_finished.connect(
            _atomic_requests.request_finished, dispatch_uid="django_idempotency.atomic_end"
        )
        # The claims' second connections are closed when Django closes its own.
        request_started.connect(close_idle, dispatch_uid="django_idempotency.close_idle")
        request_finished.connect(close_idle, dispatch_uid="django_idempotency.close_idle_end")

        if _tasks_framework():
            # The outbox carries Django's Tasks framework's messages; it imports nothing of
            # it: the Tasks side registers its tasks and its hand-over.
            from django_idempotency import tasks_backend

            tasks_backend.register()

        if importlib.util.find_spec("celery") is not None:
            # A revoked message is a terminal state of its run: its enqueue_once key frees.
            # A run the relay asked to report (a task not under @idempotent_task()) says on
            # its key when it starts and ends (or that the message runs again: a retry, a
            # requeue, a replacement), under a lease the pool may enforce.
            from celery.signals import (
                after_task_publish,
                task_postrun,
                task_prerun,
                task_revoked,
                worker_init,
            )

            from django_idempotency import tasks

            task_revoked.connect(
                tasks.revoked, weak=False, dispatch_uid="django_idempotency.task_revoked"
            )
            task_prerun.connect(
                tasks.run_started, weak=False, dispatch_uid="django_idempotency.task_prerun"
            )
            task_postrun.connect(
                tasks.run_ended, weak=False, dispatch_uid="django_idempotency.task_postrun"
            )
            after_task_publish.connect(
                tasks.published_again,
                weak=False,
                dispatch_uid="django_idempotency.published_again",
            )
            worker_init.connect(
                tasks.worker_starting, weak=False, dispatch_uid="django_idempotency.worker_init"
            )

        if importlib.util.find_spec("prometheus_client") is not None:
            from django_idempotency import metrics  # noqa: F401  (connects the receivers)

        if importlib.util.find_spec("drf_spectacular") is not None:
            from django_idempotency import openapi  # noqa: F401  (registers the extension)


def _tasks_framework() -> bool:
    """``django.tasks`` (Django 6) or the ``django-tasks`` backport can be imported."""
    return any(
        importlib.util.find_spec(name) is not None for name in ("django.tasks", "django_tasks")
    )
