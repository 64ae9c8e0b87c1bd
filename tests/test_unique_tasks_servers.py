"""One live task per key with real processes: a worker, a relay, a beat, racing writers.

For each framework (Celery with the tests' Redis broker; Django's Tasks framework through
``OutboxBackend`` with django-tasks-db's ``db_worker``) a relay process runs ``relay_outbox``
and a worker (one at a time) runs what it hands over, for the whole module. Runs are read
from the ``@idempotent_task`` records the worker writes (one per message: when it started,
when it finished) and counted by the task's effects. A killed worker:
tests/test_unique_tasks_kill.py.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import transaction

from django_idempotency import outbox
from django_idempotency.models import OutboxMessage
from tests.helpers import postgres_only, wait_until
from tests.live import ROOT, finished, server_env, starting_a_server
from tests.ready import release

pytest.importorskip("celery", reason="Celery is an optional dependency")

from tests.testapp.tasks import UNIQUE_LEASE_SECONDS
from tests.unique_servers import (
    FRAMEWORKS,
    Framework,
    effects,
    enqueue_once,
    framework_named,
    running,
    runs,
    starts,
)

pytestmark = [
    pytest.mark.servers,
    pytest.mark.django_db(transaction=True, databases="__all__"),
    postgres_only,
]

TIMEOUT = 30  # seconds: a bound on every wait for a process
RUN = 2.0  # seconds each run of the beat's task takes
BEAT = 0.1  # seconds between two enqueues of the beat
BEATING = 3.5  # seconds the beat goes on
# Clocks of two processes on one machine, and the database's: a little room.
SKEW = timedelta(milliseconds=50)


@pytest.fixture(scope="module", params=FRAMEWORKS)
def steady(
    request: pytest.FixtureRequest, django_db_setup: None, run_queue: None
) -> Iterator[Framework]:
    """A worker and a relay of one framework, for the module's tests of that framework."""
    framework = framework_named(request.param)
    with running(framework):
        yield framework


# -- a beat every 100 ms, a task of 2 s ------------------------------------------------------------


@pytest.mark.parametrize(
    ("until", "plain"),
    [
        ("started", False),
        ("finished", False),
        (timedelta(seconds=1.5), False),
        # A task not under @idempotent_task(): its worker reports the run on the key.
        ("started", True),
        ("finished", True),
    ],
    ids=["started", "finished", "duration", "started-plain", "finished-plain"],
)
def test_a_beat_every_100_ms_gives_one_run_at_a_time(steady: Framework, until: Any, plain: bool):
    framework = steady
    task = framework.plain_task if plain else framework.task
    tag = f"beat-{framework.name}-{uuid.uuid4().hex[:6]}"
    answers = []
    began = time.monotonic()
    # BEATING seconds, and on until a second run started (a loaded machine's worker may be
    # slow to take the first), within TIMEOUT.
    while time.monotonic() - began < BEATING or starts(tag) < 2:
        assert time.monotonic() - began < TIMEOUT, "the worker never ran a second message"
        answers.append(enqueue_once("beat", task, tag, RUN, unique_until=until))
        time.sleep(BEAT)
    elapsed = time.monotonic() - began
    written = OutboxMessage.objects.count()
    wait_until(lambda: effects(tag) == written, "the last run", timeout=TIMEOUT)
    time.sleep(0.3)
    assert len(answers) >= 20
    ran = runs(framework, task, tag)
    # Every message written ran once; each enqueue answered one of them.
    assert len(ran) == written == effects(tag) == len(set(answers))
    # Without a key the beat would have written one message per enqueue.
    assert 2 <= written <= elapsed / 1.5 + 2, (written, elapsed)
    for before, after in itertools.pairwise(ran):
        if not plain:  # a run that outlives its lease frees its key: not this test's case
            assert before.finished - before.started < timedelta(seconds=UNIQUE_LEASE_SECONDS)
        assert after.started >= before.finished - SKEW  # one run at a time
        if until == "finished":
            assert after.enqueued >= before.finished - SKEW
        elif until == "started":
            assert after.enqueued >= before.started - SKEW
        else:
            assert after.enqueued >= before.enqueued + until - SKEW


# -- two processes, one key, at once ---------------------------------------------------------------


def test_two_processes_enqueuing_one_key_at_once_give_one_message(
    steady: Framework, tmp_path: Path
):
    framework = steady
    tag = f"race-{framework.name}-{uuid.uuid4().hex[:6]}"
    go = tmp_path / "go"
    starting_a_server("two enqueuing processes")
    writers = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "tests.outbox_proc", "enqueue-once"),
                *("race", f"{framework.module}.hold_unique", tag),
            ],
            cwd=ROOT,
            env=server_env({"OUTBOX_GO_FILE": str(go)}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for _ in range(2)
    ]
    # Both set up and waiting (a loaded machine starts a process in seconds): one that came
    # late would find the first message's run finished and the key rightly free.
    release(go, writers, timeout=TIMEOUT)
    answers = {finished(writer, timeout=TIMEOUT).strip() for writer in writers}
    assert OutboxMessage.objects.count() == 1
    assert answers == {str(OutboxMessage.objects.get().pk)}
    wait_until(lambda: effects(tag) == 1, "the run", timeout=TIMEOUT)
    time.sleep(0.3)
    assert effects(tag) == 1


# -- a rollback ------------------------------------------------------------------------------------


def test_an_enqueue_rolled_back_leaves_the_key_free(steady: Framework):
    framework = steady

    undone: list[uuid.UUID] = []

    def enqueue_then_roll_back() -> None:
        with transaction.atomic():
            undone.append(outbox.enqueue_once("k", framework.task, rolled_back, 0.1))
            raise ZeroDivisionError

    rolled_back = f"rolled-back-{framework.name}"
    with pytest.raises(ZeroDivisionError):
        enqueue_then_roll_back()
    kept = enqueue_once("k", framework.task, f"kept-{framework.name}", 0.1)
    wait_until(lambda: effects(f"kept-{framework.name}") == 1, "the run", timeout=TIMEOUT)
    time.sleep(0.3)
    assert [kept] != undone
    assert (effects(f"kept-{framework.name}"), effects(rolled_back)) == (1, 0)
    assert list(OutboxMessage.objects.values_list("pk", flat=True)) == [kept]
