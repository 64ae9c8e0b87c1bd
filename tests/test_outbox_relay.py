"""The outbox with a real Redis broker, real Celery workers and relays killed for real.

Every consumer is ``tests.record_effect`` under ``@idempotent_task()``: its runs are counted
(``start:`` rows survive a crash, ``effect:`` rows commit with the run), and every send by
a relay is counted by the senders of ``tests.testapp.outbox``.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("celery", reason="Celery is an optional dependency")

from django.db import connection, transaction
from django.test import override_settings

from django_idempotency import outbox
from django_idempotency.models import IdempotencyRecord, OutboxMessage, OutboxStatus
from tests import celery_app
from tests.helpers import (
    celery_worker,
    postgres_only,
    stop_process,
    task_effects,
    task_starts,
    wait_drained,
    wait_until,
)
from tests.live import ROOT, finished, free_port, server_env, starting_a_server
from tests.ready import release
from tests.testapp.models import ProviderCall
from tests.testapp.outbox import sends
from tests.testapp.tasks import record_effect

pytestmark = [pytest.mark.django_db(transaction=True, databases="__all__"), postgres_only]

needs_listen = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="LISTEN/NOTIFY is PostgreSQL's"
)

CELERY_SENDER = {"OUTBOX_SENDER": "tests.testapp.outbox.celery_and_record"}
TIMEOUT = 60  # seconds: a bound on every wait for a process


@pytest.fixture(scope="module")
def worker(django_db_setup: Any, run_queue: None) -> Iterator[None]:
    """One worker on the tests' Redis for the whole module (two pool processes)."""
    with celery_worker(concurrency=2):
        yield


def enqueued(tag: str) -> uuid.UUID:
    with transaction.atomic():
        return outbox.enqueue(record_effect, tag)


def relay_process(
    settings: dict[str, Any], *arguments: str, extra_env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """``relay_outbox`` in a process of its own, on the test database."""
    starting_a_server("a relay process")
    env = server_env({"TEST_CELERY_QUEUE": celery_app.QUEUE, **(extra_env or {})})
    return subprocess.Popen(
        [sys.executable, "-m", "tests.outbox_proc", "relay", json.dumps(settings), *arguments],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def summary(out: str) -> tuple[int, int, int]:
    found = re.search(
        r"Sent (\d+) outbox messages; (\d+) failed \(to be retried\), (\d+) dead", out
    )
    assert found, out
    sent, failed, dead = found.groups()
    return int(sent), int(failed), int(dead)


# -- commit, rollback and crashes -------------------------------------------------------------


@pytest.mark.usefixtures("worker", "clean_queue")
@override_settings(IDEMPOTENCY=CELERY_SENDER)
def test_a_commit_is_sent_once_and_a_rollback_never():
    committed = enqueued("committed")

    def work_that_fails() -> None:
        with transaction.atomic():
            outbox.enqueue(record_effect, "rolled-back")
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        work_that_fails()
    result = outbox.relay(once=True)
    assert (result.sent, result.failed, result.dead) == (1, 0, 0)
    wait_until(lambda: task_effects("committed") == 1, "the consumer")
    wait_drained()
    assert sends(committed) == 1
    assert (task_effects("committed"), task_starts("committed")) == (1, 1)
    assert (task_effects("rolled-back"), task_starts("rolled-back")) == (0, 0)
    assert OutboxMessage.objects.get().status == OutboxStatus.SENT


@pytest.mark.usefixtures("worker", "clean_queue")
@override_settings(IDEMPOTENCY=CELERY_SENDER)
def test_a_process_killed_after_its_commit_loses_no_message():
    writer = subprocess.run(
        [sys.executable, "-m", "tests.outbox_proc", "enqueue-and-die", "writer-killed"],
        cwd=ROOT,
        env=server_env({"TEST_CELERY_QUEUE": celery_app.QUEUE}),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert writer.returncode == -signal.SIGKILL, writer.stderr
    message_id = uuid.UUID(writer.stdout.strip())
    assert OutboxMessage.objects.get(pk=message_id).status == OutboxStatus.PENDING
    assert (sends(message_id), task_starts("writer-killed")) == (0, 0)
    # Later, a relay finds it.
    assert outbox.relay(once=True).sent == 1
    wait_until(lambda: task_effects("writer-killed") == 1, "the consumer")
    wait_drained()
    assert (sends(message_id), task_starts("writer-killed"), task_effects("writer-killed")) == (
        1,
        1,
        1,
    )


@pytest.mark.usefixtures("worker", "clean_queue")
@override_settings(IDEMPOTENCY=CELERY_SENDER)
def test_a_relay_killed_between_the_send_and_marking_it_sent_sends_again_and_it_runs_once():
    message_id = enqueued("relay-killed")
    dying = relay_process({"OUTBOX_SENDER": "tests.testapp.outbox.celery_then_die"}, "--once")
    dying.communicate(timeout=TIMEOUT)
    assert dying.returncode == -signal.SIGKILL
    row = OutboxMessage.objects.get(pk=message_id)
    assert (row.status, row.attempts, sends(message_id)) == (OutboxStatus.PENDING, 0, 1)
    # The send before the crash reached the broker: the consumer ran.
    wait_until(lambda: task_effects("relay-killed") == 1, "the consumer")
    wait_drained()
    assert outbox.relay(once=True).sent == 1
    assert sends(message_id) == 2
    wait_drained()
    # Two deliveries with one task id: the body ran once.
    assert (task_starts("relay-killed"), task_effects("relay-killed")) == (1, 1)
    record = IdempotencyRecord.objects.get(account="task", key=str(message_id))
    assert record.status == "completed"
    assert OutboxMessage.objects.get(pk=message_id).status == OutboxStatus.SENT


def publishes(message_id: object) -> int:
    """How many times a relay process published this message to the broker (counted by
    ``OUTBOX_COUNT_PUBLISHES``)."""
    return ProviderCall.objects.filter(key__startswith=f"published:{message_id}:").count()


COUNT_PUBLISHES = {"OUTBOX_COUNT_PUBLISHES": "1"}


@pytest.mark.usefixtures("worker", "clean_queue")
def test_a_relay_killed_inside_the_default_senders_batch_loses_nothing_and_each_body_runs_once():
    """The default sender publishes a batch one message after another, with no transaction
    of its own: killed after the 3rd of 10, the relay left all 10 pending; the next run
    publishes all 10 (the first 3 again, with the same task id) and each body runs once."""
    tags = [f"batch-killed-{n}" for n in range(10)]
    ids = [enqueued(tag) for tag in tags]
    dying = relay_process(
        {}, "--once", extra_env={**COUNT_PUBLISHES, "OUTBOX_DIE_AFTER_PUBLISHES": "3"}
    )
    dying.communicate(timeout=TIMEOUT)
    assert dying.returncode == -signal.SIGKILL
    assert OutboxMessage.objects.filter(status=OutboxStatus.PENDING).count() == 10
    assert sorted(publishes(i) for i in ids) == [0] * 7 + [1] * 3
    again = relay_process({}, "--once", extra_env=COUNT_PUBLISHES)
    assert summary(finished(again)) == (10, 0, 0)
    assert sorted(publishes(i) for i in ids) == [1] * 7 + [2] * 3
    wait_until(lambda: sum(map(task_effects, tags)) == 10, "the consumers")
    wait_drained()
    assert [(task_starts(tag), task_effects(tag)) for tag in tags] == [(1, 1)] * 10
    assert OutboxMessage.objects.filter(status=OutboxStatus.SENT).count() == 10


@pytest.mark.usefixtures("worker", "clean_queue")
def test_two_relays_with_the_default_senders_batches_publish_each_message_once(tmp_path: Path):
    count = 200
    with transaction.atomic():
        ids = [outbox.enqueue(record_effect, f"batched-pair-{n}") for n in range(count)]
    go = tmp_path / "go"
    relays = [
        relay_process(
            {},
            "--once",
            "--batch-size",
            "20",
            extra_env={**COUNT_PUBLISHES, "OUTBOX_GO_FILE": str(go)},
        )
        for _ in range(2)
    ]
    # Both connected and waiting (a loaded machine starts a process in seconds): one that
    # came late would find the other's batches taken and send nothing.
    release(go, relays, timeout=TIMEOUT)
    figures = [summary(finished(relay)) for relay in relays]
    assert sum(sent for sent, _, _ in figures) == count
    assert all(sent > 0 for sent, _, _ in figures), figures
    assert {publishes(i) for i in ids} == {1}
    consumed = ProviderCall.objects.filter(key__startswith="effect:batched-pair-")
    wait_until(lambda: consumed.count() >= count, "the consumers", timeout=120)
    wait_drained()
    assert consumed.count() == consumed.values("key").distinct().count() == count


@pytest.mark.usefixtures("worker", "clean_queue")
def test_two_relays_share_400_messages_and_every_consumer_body_runs_once(tmp_path: Path):
    # 20 batches of 20 for two relays started at the same instant: enough for both to meet
    # in every batch they race for (1,000 messages took 34 s of the suite, mostly the worker).
    count = 400
    with transaction.atomic():
        ids = [outbox.enqueue(record_effect, f"pair-{n}") for n in range(count)]
    go = tmp_path / "go"
    relays = [
        relay_process(
            CELERY_SENDER, "--once", "--batch-size", "20", extra_env={"OUTBOX_GO_FILE": str(go)}
        )
        for _ in range(2)
    ]
    # Both connected and waiting (a loaded machine starts a process in seconds): one that
    # came late would find the other's batches taken and send nothing.
    release(go, relays, timeout=TIMEOUT)
    figures = [summary(finished(relay)) for relay in relays]
    assert sum(sent for sent, _, _ in figures) == count
    assert all(sent > 0 for sent, _, _ in figures), figures
    assert not [f for f in figures if f[1] or f[2]], figures
    # Each message was sent by one relay, once.
    sent_rows = ProviderCall.objects.filter(key__startswith="sent:").values_list("key", flat=True)
    assert sorted(key.split(":")[1] for key in sent_rows) == sorted(str(i) for i in ids)
    assert OutboxMessage.objects.filter(status=OutboxStatus.SENT).count() == count

    consumed = ProviderCall.objects.filter(key__startswith="effect:pair-")
    wait_until(lambda: consumed.count() >= count, "the consumers", timeout=120)
    wait_drained()
    assert consumed.count() == consumed.values("key").distinct().count() == count
    assert ProviderCall.objects.filter(key__startswith="start:pair-").count() == count


@pytest.mark.usefixtures("worker", "clean_queue")
@override_settings(IDEMPOTENCY={})  # the default sender, django_idempotency.celery_sender.send
def test_the_default_sender_sends_a_batch_each_body_runs_once_and_an_unknown_task_dies_alone():
    tags = [f"batch-{n}" for n in range(6)]
    ids = [enqueued(tag) for tag in tags[:3]]
    with transaction.atomic():
        unknown = outbox.enqueue("tests.no_such_task", 1)
    ids += [enqueued(tag) for tag in tags[3:]]
    result = outbox.relay(once=True, batch_size=10)
    assert (result.sent, result.failed, result.dead, result.batches) == (6, 0, 1, 1)
    wait_until(lambda: sum(map(task_effects, tags)) == 6, "the consumers")
    wait_drained()
    assert [(task_starts(tag), task_effects(tag)) for tag in tags] == [(1, 1)] * 6
    # Each published once, with its message id as the task id.
    keys = IdempotencyRecord.objects.filter(account="task").values_list("key", flat=True)
    assert sorted(keys) == sorted(str(i) for i in ids)
    dead = OutboxMessage.objects.get(pk=unknown)
    assert dead.status == OutboxStatus.DEAD
    assert dead.last_error == "UnknownTask: no task named 'tests.no_such_task' is registered"
    assert OutboxMessage.objects.filter(status=OutboxStatus.SENT).count() == 6


# -- the broker goes away -----------------------------------------------------------------------


@contextmanager
def redis_server(port: int) -> Iterator[subprocess.Popen[bytes]]:
    """A private redis-server on ``port``, without persistence; stopped at the end."""
    starting_a_server("a private redis-server")
    process = subprocess.Popen(
        [
            *("redis-server", "--port", str(port), "--bind", "127.0.0.1"),
            *("--save", "", "--appendonly", "no", "--loglevel", "warning"),
        ],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    import redis

    client = redis.Redis(port=port, socket_connect_timeout=0.5)

    def answers() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    try:
        wait_until(answers, f"redis-server on port {port}", timeout=20)
        yield process
    finally:
        client.close()
        stop_process(process)


@pytest.mark.servers
@pytest.mark.usefixtures("clean_queue")
def test_messages_wait_while_the_broker_is_down_then_all_are_delivered():
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    settings = {
        **CELERY_SENDER,
        "OUTBOX_BACKOFF": 0.5,
        "OUTBOX_BACKOFF_MAX": 1,
        "OUTBOX_POLL_INTERVAL": 0.2,
    }
    relay = relay_process(settings, extra_env={"TEST_CELERY_BROKER": url})
    try:
        with redis_server(port):
            pass  # the relay connected to it, and now it is gone
        ids = [enqueued(f"outage-{n}") for n in range(20)]
        waiting = OutboxMessage.objects.all()
        # Each message tried at least twice (a fixed 10 s once fell short in CI, where the
        # relay shared two cores with seven other processes).
        wait_until(
            lambda: all(n >= 2 for n in waiting.values_list("attempts", flat=True)),
            "every message to be tried twice while the broker is down",
        )
        assert waiting.filter(status=OutboxStatus.PENDING).count() == 20
        assert all(waiting.values_list("last_error", flat=True))
        assert sum(sends(i) for i in ids) == 0
        with redis_server(port), celery_worker(broker_url=url):
            everything = OutboxMessage.objects.filter(status=OutboxStatus.SENT)
            wait_until(lambda: everything.count() == 20, "the relay to send everything")
            consumed = ProviderCall.objects.filter(key__startswith="effect:outage-")
            wait_until(lambda: consumed.count() == 20, "the consumers")
        assert not OutboxMessage.objects.filter(status=OutboxStatus.DEAD).exists()
        assert consumed.values("key").distinct().count() == 20
        assert all(sends(i) == 1 for i in ids)
    finally:
        relay.send_signal(signal.SIGTERM)
        out = finished(relay)
    assert summary(out)[0] == 20


# -- waking up and stopping ---------------------------------------------------------------------


def listening(name: str | None = None) -> bool:
    """Whether a relay listens on this test database (another run's relay, on another
    database of the same server, is not this test's); ``name``: the relay whose
    ``application_name`` it is."""
    query = (
        "SELECT count(*) FROM pg_stat_activity WHERE query = %s AND datname = current_database()"
    )
    params = [f"LISTEN {outbox.CHANNEL}"]
    if name is not None:
        query += " AND application_name = %s"
        params.append(name)
    with connection.cursor() as cursor:
        cursor.execute(query, params)
        (n,) = cursor.fetchone()
    return bool(n)


@pytest.mark.servers
@needs_listen
def test_a_notify_wakes_a_waiting_relay_long_before_its_next_poll():
    settings = {"OUTBOX_SENDER": "tests.testapp.outbox.record", "OUTBOX_POLL_INTERVAL": 60}
    relay = relay_process(settings)
    try:
        # It listens from its first wait on: its first (empty) drain is over.
        wait_until(listening, "the relay to listen", timeout=30)
        message_id = enqueued("notified")
        committed = time.monotonic()
        wait_until(lambda: sends(message_id) == 1, "the notified relay", timeout=10)
        assert time.monotonic() - committed < 5
    finally:
        relay.send_signal(signal.SIGTERM)
        out = finished(relay, timeout=10)
    assert summary(out) == (1, 0, 0)


@override_settings(IDEMPOTENCY={"OUTBOX_SENDER": "tests.testapp.outbox.record"})
def test_polling_alone_finds_new_messages():
    stopping = threading.Event()
    results: list[outbox.RelayResult] = []

    def run() -> None:
        try:
            results.append(outbox.relay(listen=False, poll_interval=0.2, stop=stopping.is_set))
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        message_id = enqueued("polled")
        wait_until(lambda: sends(message_id) == 1, "the polling relay", timeout=10)
    finally:
        stopping.set()
        thread.join(timeout=10)
    assert not thread.is_alive()
    assert results[0].sent == 1


@pytest.mark.servers
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_stop_signal_finishes_the_batch_in_hand(stop_signal: int):
    ids = [enqueued(f"batch-{n}") for n in range(5)]
    relay = relay_process({"OUTBOX_SENDER": "tests.testapp.outbox.slow_record"}, "-v", "1")
    try:
        wait_until(lambda: sends(ids[0]) == 1, "the first send", timeout=30)
        relay.send_signal(stop_signal)
    finally:
        out = finished(relay, timeout=20)
    assert summary(out) == (5, 0, 0)
    assert [sends(i) for i in ids] == [1] * 5
    assert OutboxMessage.objects.filter(status=OutboxStatus.SENT).count() == 5


@pytest.mark.servers
@needs_listen
def test_a_relay_whose_connections_are_killed_carries_on():
    name = f"outbox-relay-{uuid.uuid4().hex[:8]}"
    settings = {"OUTBOX_SENDER": "tests.testapp.outbox.record", "OUTBOX_POLL_INTERVAL": 0.2}
    relay = relay_process(settings, extra_env={"PGAPPNAME": name})
    try:
        wait_until(lambda: listening(name), "the relay to listen", timeout=30)
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = %s",
                [name],
            )
            (killed,) = cursor.fetchone()
        assert killed >= 2  # its own connection and the one that listens (and "provider")
        message_id = enqueued("after-the-kill")
        wait_until(lambda: sends(message_id) == 1, "the relay to send again", timeout=20)
        wait_until(lambda: listening(name), "the relay to listen again", timeout=20)
    finally:
        relay.send_signal(signal.SIGTERM)
        out = finished(relay, timeout=10)
    assert summary(out)[0] == 1
    assert OutboxMessage.objects.get(pk=message_id).status == OutboxStatus.SENT
