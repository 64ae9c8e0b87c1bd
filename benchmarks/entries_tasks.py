"""The tasks of Django's Tasks framework of ``benchmarks/entries_bench.py``: the framework
wants them at a module's top level, imported once Django is configured."""

from __future__ import annotations

import importlib.util

from benchmarks.connections_bench import write
from django_idempotency.tasks import idempotent_task

if importlib.util.find_spec("django.tasks") is not None:
    from django.tasks import task
else:  # Django 5.2 with the backport
    from django_tasks import task


@task()
def twin(n: int) -> int:
    """The unprotected twin: the INSERT."""
    return write()


@task()
@idempotent_task()
def ours(n: int) -> int:
    """The same, once per delivery."""
    return write()
