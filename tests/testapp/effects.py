"""Bodies the test tasks of both frameworks share (tests/testapp/tasks.py for Celery,
tests/testapp/tasks_framework.py for Django's Tasks framework)."""

from __future__ import annotations

from tests.testapp.models import ProviderCall


def count_effect(tag: str, fail: bool) -> str:
    """One ``effect:<tag>`` per run, on the default connection; raises after it with
    ``fail``."""
    ProviderCall.objects.create(key=f"effect:{tag}")
    if fail:
        raise RuntimeError("the plain task fails")
    return tag
