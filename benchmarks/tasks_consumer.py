"""The task of ``benchmarks/tasks_bench.py``: imported once Django is configured."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from django_idempotency.tasks import idempotent_task

if TYPE_CHECKING or importlib.util.find_spec("django.tasks") is None:
    from django_tasks import task
else:  # Django 6
    from django.tasks import task


@task()
@idempotent_task()
def consume(seq: int) -> None:
    """Nothing: the benchmark measures the relay's hand-over, not a worker."""
