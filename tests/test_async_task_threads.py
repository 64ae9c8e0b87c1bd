"""``async def`` functions under ``@idempotent_task``, awaited many at once on one event loop.

The engine is synchronous: each call's claim, transaction and completion run in a thread,
and the body runs back on the event loop. That thread must never be one of the loop's
default executor, which the body's own ``asyncio.to_thread`` (or a DNS lookup) waits for:
as many engines as that executor has threads, each waiting for its body, would fill it for
good and no call would ever end. Effects counted: the rows each body writes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from django_idempotency.models import IdempotencyRecord
from django_idempotency.tasks import idempotent_task
from tests.helpers import postgres_only
from tests.testapp.models import ProviderCall

pytestmark = [pytest.mark.django_db(transaction=True, databases="__all__"), postgres_only]

WAIT = 30  # seconds: a bound on the whole burst


@idempotent_task(key=lambda tag: f"threads:{tag}")
async def ship(tag: str) -> str:
    """Waits for a blocking client off the loop, then writes its effect."""
    await asyncio.to_thread(time.sleep, 0.2)
    await sync_to_async(ProviderCall.objects.create)(key=f"effect:{tag}")
    return tag


def test_more_async_calls_than_the_loops_threads_all_run_once():
    threads = 4  # the loop's default executor (min(32, CPUs + 4) threads by default)
    tags = [f"t{number}" for number in range(threads + 2)]
    answers: list[Any] = []

    async def burst() -> None:
        asyncio.get_running_loop().set_default_executor(
            concurrent.futures.ThreadPoolExecutor(threads)
        )
        answers.extend(await asyncio.gather(*(ship(tag) for tag in tags)))
        answers.extend(await asyncio.gather(*(ship(tag) for tag in tags)))  # retries

    # On a thread of its own: were the calls stuck for good, the test fails within WAIT
    # instead of waiting for the stuck threads.
    runner = threading.Thread(target=asyncio.run, args=(burst(),), daemon=True)
    runner.start()
    runner.join(WAIT)
    assert not runner.is_alive(), "the calls never ended: their engines filled the loop's threads"
    assert answers == tags + tags
    assert ProviderCall.objects.filter(key__startswith="effect:").count() == len(tags)
    assert IdempotencyRecord.objects.filter(status="completed").count() == len(tags)
