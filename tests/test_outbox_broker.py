"""The Celery sender against a broker that stops answering: one that accepts connections and
never answers, and RabbitMQ cut off by a network partition that no FIN or RST reports.

Relays run in processes of their own (``relay_outbox``); what reached the broker is read from
the broker itself, never inferred from a status.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

pytest.importorskip("celery", reason="Celery is an optional dependency")

from django.db import transaction

from django_idempotency import celery_sender, outbox
from django_idempotency.models import OutboxMessage, OutboxStatus
from tests.helpers import postgres_only, task_starts, wait_until
from tests.live import finished
from tests.test_outbox_relay import TIMEOUT, enqueued, relay_process, summary
from tests.testapp.tasks import record_effect

pytestmark = [pytest.mark.django_db(transaction=True, databases="__all__"), postgres_only]


@contextmanager
def silent_broker() -> Iterator[int]:
    """A port that accepts connections and never answers: a broker that hangs (stalled,
    or behind a proxy whose other side is gone). Its connections are closed at the end."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    accepted: list[socket.socket] = []
    stopping = threading.Event()

    def accept() -> None:
        while not stopping.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stopping.set()
        thread.join(timeout=5)
        for accepted_connection in accepted:
            accepted_connection.close()
        listener.close()


@pytest.mark.servers
@pytest.mark.parametrize("scheme", ["redis", "amqp"])
def test_a_broker_that_never_answers_fails_the_sends_and_the_relay_still_stops(scheme):
    # The default sender itself (its batches), not a counting wrapper.
    settings = {"OUTBOX_BACKOFF": 600, "OUTBOX_BACKOFF_MAX": 600, "OUTBOX_POLL_INTERVAL": 0.2}
    with silent_broker() as port:
        url = f"{scheme}://127.0.0.1:{port}/" + ("0" if scheme == "redis" else "")
        ids = [enqueued(f"silent-{scheme}-{n}") for n in range(3)]
        relay = relay_process(settings, extra_env={"TEST_CELERY_BROKER": url})
        try:
            waiting = OutboxMessage.objects.filter(pk__in=ids)
            # Each send fails within the sender's bound on the broker, and is recorded.
            wait_until(
                lambda: all(n == 1 for n in waiting.values_list("attempts", flat=True)),
                "every send to fail while the broker never answers",
                timeout=TIMEOUT,
            )
            assert waiting.filter(status=OutboxStatus.PENDING).count() == 3
            assert all(waiting.values_list("last_error", flat=True))
            assert task_starts(f"silent-{scheme}-0") == 0
        finally:
            relay.send_signal(signal.SIGTERM)
            out = finished(relay, timeout=TIMEOUT)
    assert summary(out) == (0, 3, 0)


@contextmanager
def partitioned_proxy(target_port: int) -> Iterator[tuple[int, threading.Event]]:
    """A TCP proxy to ``127.0.0.1:target_port``; while the event is set it forwards nothing
    and drops what it reads, keeping both sides open: a network partition, or the broker's
    host powered off, that no FIN or RST tells the client about."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    dropping = threading.Event()
    stopping = threading.Event()
    sockets: list[socket.socket] = []

    def pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if not dropping.is_set():
                    sink.sendall(data)

    def accept() -> None:
        while not stopping.is_set():
            try:
                client = listener.accept()[0]
            except TimeoutError:
                continue
            upstream = socket.create_connection(("127.0.0.1", target_port))
            sockets.extend((client, upstream))
            for ends in ((client, upstream), (upstream, client)):
                threading.Thread(target=pipe, args=ends, daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], dropping
    finally:
        stopping.set()
        thread.join(timeout=5)
        for each in sockets:
            with contextlib.suppress(OSError):
                each.shutdown(socket.SHUT_RDWR)
            each.close()
        listener.close()


def queued_task_ids(queue: str) -> set[str]:
    """The task ids of the messages waiting in ``queue`` on the tests' RabbitMQ (taken)."""
    from kombu import Connection

    found: set[str] = set()
    with Connection("amqp://guest:guest@127.0.0.1:5672//") as broker_connection:
        channel = broker_connection.channel()
        while (message := channel.basic_get(queue, no_ack=True)) is not None:
            found.add(message.headers["id"])
        channel.queue_delete(queue)
    return found


@pytest.mark.servers
def test_messages_published_during_a_partition_from_rabbitmq_are_not_marked_sent_unreceived():
    queue = f"outbox-partition-{uuid.uuid4().hex[:8]}"
    settings = {"OUTBOX_BACKOFF": 0.5, "OUTBOX_BACKOFF_MAX": 1, "OUTBOX_POLL_INTERVAL": 0.2}
    with partitioned_proxy(5672) as (port, dropping):
        env = {"TEST_CELERY_BROKER": f"amqp://guest:guest@127.0.0.1:{port}//"}
        relay = relay_process(settings, extra_env={**env, "TEST_CELERY_QUEUE": queue})
        try:
            first = enqueued("before-the-partition")
            wait_until(
                lambda: OutboxMessage.objects.get(pk=first).status == OutboxStatus.SENT,
                "the first message to be sent",
                timeout=TIMEOUT,
            )
            dropping.set()
            with transaction.atomic():  # one batch
                during = [outbox.enqueue(record_effect, f"partition-{n}") for n in range(5)]
            started = time.monotonic()
            # Not marked sent while the broker cannot have them: each send fails (no
            # confirmation comes) and is tried again.
            wait_until(
                lambda: all(
                    row.attempts >= 1 or row.status == OutboxStatus.SENT
                    for row in OutboxMessage.objects.filter(pk__in=during)
                ),
                "a send during the partition to fail or be marked sent",
                timeout=TIMEOUT,
            )
            # The batch failed after one wait for the broker, not one per message: the
            # connection was cut, and the rest of the batch fails with it at once.
            assert time.monotonic() - started < 2 * celery_sender.BROKER_TIMEOUT
            dropping.clear()
            everything = OutboxMessage.objects.filter(status=OutboxStatus.SENT)
            wait_until(lambda: everything.count() == 6, "every message sent", timeout=TIMEOUT)
        finally:
            relay.send_signal(signal.SIGTERM)
            finished(relay, timeout=TIMEOUT)
    # Every message marked sent is in the broker's queue (at least once).
    assert queued_task_ids(queue) >= {str(first), *map(str, during)}


# -- one wait on the broker per batch ---------------------------------------------------------


def client_waits(monkeypatch: pytest.MonkeyPatch, scheme: str) -> list[str]:
    """What the broker's client does from now on, in order: ``"send"`` for each write of
    requests (a publish, a pipeline), ``"read"`` for each wait for the broker's answer. The
    client's own methods, wrapped: each still does what it did."""
    if scheme == "amqp":
        import amqp

        sending: list[tuple[Any, str]] = [(amqp.Channel, "_basic_publish")]
        reading: list[tuple[Any, str]] = [(amqp.Connection, "drain_events")]
    else:
        from redis.connection import AbstractConnection

        sending = [(AbstractConnection, "send_packed_command")]
        reading = [(AbstractConnection, "read_response")]
    events: list[str] = []

    def spied(owner: Any, name: str, event: str) -> None:
        original = getattr(owner, name)

        def spy(*args: Any, **kwargs: Any) -> Any:
            # py-amqp polls without waiting before each publish (timeout=0): not a wait.
            if kwargs.get("timeout") != 0:
                events.append(event)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)

    for owner, name in sending:
        spied(owner, name, "send")
    for reader, name in reading:
        spied(reader, name, "read")
    return events


PROBE = "tests.outbox-batch-probe"


def probe(n: int) -> int:
    """The probes' task: registered on the tests' app, never run."""
    return n


@contextmanager
def current_celery_app(broker: str, queue: Any) -> Iterator[Any]:
    """A Celery app on ``broker`` whose tasks go to ``queue``, current while the block runs;
    the previous app is made current again at the end."""
    from celery import Celery, current_app

    previous = current_app._get_current_object()
    app = Celery("outbox-batch-tests", set_as_current=True)
    app.conf.update(
        broker_url=broker,
        task_default_queue=queue.name,
        task_queues=[queue],
        task_ignore_result=True,
    )
    app.task(name=PROBE)(probe)
    try:
        yield app
    finally:
        # Its producers stay in kombu's pools, which are keyed by the broker's URL.
        celery_sender._bounded.pop((id(app), os.getpid()), None)
        app.close()
        previous.set_current()


def probes(count: int) -> list[OutboxMessage]:
    return [OutboxMessage(task=PROBE, args=[n]) for n in range(count)]


def queued_ids(queue: str, broker: str, *, delete: bool = True) -> list[str]:
    """The task ids of the messages waiting in ``queue`` (taken), in their order; on
    RabbitMQ the queue is deleted after, unless ``delete`` is false."""
    from kombu import Connection

    found: list[str] = []
    with Connection(broker) as broker_connection:
        channel = broker_connection.channel()
        while (message := channel.basic_get(queue, no_ack=True)) is not None:
            found.append(message.headers["id"])
        if delete and broker.startswith("amqp"):
            channel.queue_delete(queue)
    return found


BROKERS = {"redis": "redis://127.0.0.1:6379/14", "amqp": "amqp://guest:guest@127.0.0.1:5672//"}


@pytest.mark.servers
@pytest.mark.parametrize("scheme", sorted(BROKERS))
def test_a_batch_waits_on_the_broker_once_and_every_message_arrives_in_order(scheme, monkeypatch):
    from kombu import Queue

    url = BROKERS[scheme]
    queue = Queue(f"outbox-batch-{uuid.uuid4().hex[:8]}")
    with current_celery_app(url, queue):
        # The first batch opens the connection (and on RabbitMQ the channel, its
        # confirmations and the queue's declaration): not counted.
        first = probes(1)
        assert celery_sender.send.send_batch(first) == [None]
        events = client_waits(monkeypatch, scheme)
        batch = probes(20)
        assert celery_sender.send.send_batch(batch) == [None] * 20
        monkeypatch.undo()
    # Every request of the batch went out before the client first waited for the broker:
    # one wait for the batch (for the pipeline's replies, or the confirmations), not one
    # per message.
    assert "read" in events
    waited_at = events.index("read")
    assert "send" in events[:waited_at]
    assert "send" not in events[waited_at:]
    assert queued_ids(queue.name, url) == [str(message.id) for message in first + batch]


def refusing_queue(length: int) -> Any:
    """A queue that takes ``length`` messages; RabbitMQ refuses (nacks) every publish
    past them."""
    from kombu import Queue

    return Queue(
        f"outbox-refused-{uuid.uuid4().hex[:8]}",
        queue_arguments={"x-max-length": length, "x-overflow": "reject-publish"},
    )


@pytest.mark.servers
def test_messages_rabbitmq_refuses_fail_on_their_own_and_the_rest_are_sent():
    from amqp.exceptions import MessageNacked

    # The queue takes three messages and refuses the rest: the broker confirms three
    # publishes and refuses (nacks) the others.
    queue = refusing_queue(3)
    url = BROKERS["amqp"]
    with current_celery_app(url, queue):
        batch = probes(5)
        outcomes = celery_sender.send.send_batch(batch)
        assert outcomes[:3] == [None] * 3
        assert all(isinstance(outcome, MessageNacked) for outcome in outcomes[3:])
        # The channel goes on: the next batch is sent once the queue has room.
        assert queued_ids(queue.name, url, delete=False) == [
            str(message.id) for message in batch[:3]
        ]
        again = probes(2)
        assert celery_sender.send.send_batch(again) == [None, None]
    assert queued_ids(queue.name, url) == [str(message.id) for message in again]


# -- one message the broker refuses for its routing does not fail its neighbours --------------

MISROUTED = "tests.outbox-batch-misrouted"


def _misrouted_task(app: Any, kind: str, url: str) -> str:
    """Registers on ``app`` a task whose every publish the broker refuses for its routing
    alone, and returns the name of the queue (or key) to clean up: on RabbitMQ, ``exchange``
    publishes into an exchange that does not exist (the broker closes the channel, 404) and
    ``precondition`` into a queue that exists with other arguments than the app declares it
    with (406, when it is declared); on Redis, ``wrongtype`` pushes onto a key that holds a
    string (WRONGTYPE)."""
    from kombu import Connection, Queue

    name = f"outbox-misrouted-{uuid.uuid4().hex[:8]}"
    if kind == "exchange":
        app.conf.task_routes = {MISROUTED: {"exchange": f"{name}-missing", "routing_key": name}}
        app.task(name=MISROUTED)(probe)
    elif kind == "precondition":
        with Connection(url) as broker_connection:
            broker_connection.channel().queue_declare(
                name, durable=True, auto_delete=False, arguments={"x-max-length": 7}
            )
        app.conf.task_queues = [*app.conf.task_queues, Queue(name)]
        app.amqp.queues = app.amqp.Queues(app.conf.task_queues)
        app.conf.task_routes = {MISROUTED: {"queue": name}}
        app.task(name=MISROUTED)(probe)
    else:
        import redis

        redis.Redis.from_url(url).set(name, "not a list")
        app.conf.task_routes = {MISROUTED: {"queue": name}}
        app.task(name=MISROUTED)(probe)
    return name


def _cleaned(kind: str, url: str, name: str) -> None:
    from kombu import Connection

    if kind == "wrongtype":
        import redis

        redis.Redis.from_url(url).delete(name)
    elif kind == "precondition":
        with Connection(url) as broker_connection:
            broker_connection.channel().queue_delete(name)


@pytest.mark.servers
@pytest.mark.parametrize(
    ("scheme", "kind"), [("amqp", "exchange"), ("amqp", "precondition"), ("redis", "wrongtype")]
)
def test_a_message_the_broker_refuses_for_its_route_fails_alone_in_its_batch(scheme, kind):
    from kombu import Queue

    url = BROKERS[scheme]
    queue = Queue(f"outbox-neighbours-{uuid.uuid4().hex[:8]}")
    with current_celery_app(url, queue) as app:
        name = _misrouted_task(app, kind, url)
        try:
            before, after = probes(3), probes(3)
            bad = OutboxMessage(task=MISROUTED, args=[0])
            started = time.monotonic()
            outcomes = celery_sender.send.send_batch([*before, bad, *after])
            took = time.monotonic() - started
            # The misrouted message fails; its neighbours are sent, and are in the queue
            # (some maybe twice: those the broker had not confirmed when it closed the
            # channel are sent again).
            assert outcomes[3] is not None
            assert outcomes[:3] + outcomes[4:] == [None] * 6
            assert set(queued_ids(queue.name, url, delete=False)) == {
                str(message.id) for message in before + after
            }
            # Without waiting on the broker for an answer that cannot come.
            assert took < celery_sender.BROKER_TIMEOUT / 2
            # The next batch goes through the same way.
            again = [*probes(2), OutboxMessage(task=MISROUTED, args=[1]), *probes(2)]
            outcomes = celery_sender.send.send_batch(again)
            assert outcomes[2] is not None
            assert outcomes[:2] + outcomes[3:] == [None] * 4
            assert set(queued_ids(queue.name, url)) == {
                str(message.id) for message in again[:2] + again[3:]
            }
        finally:
            _cleaned(kind, url, name)


@pytest.mark.servers
def test_a_push_redis_refuses_inside_the_pipeline_fails_alone_and_the_rest_are_sent():
    import redis
    from kombu import Queue

    url = BROKERS["redis"]
    queue = Queue(f"outbox-neighbours-{uuid.uuid4().hex[:8]}")
    name = f"outbox-misrouted-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(url)
    with current_celery_app(url, queue) as app:
        app.conf.task_routes = {MISROUTED: {"queue": name}}
        app.task(name=MISROUTED)(probe)
        try:
            # Declared once (kombu remembers it for the connection), then the key is
            # made a string: the push itself, inside the pipeline, is refused.
            declared = OutboxMessage(task=MISROUTED, args=[9])
            assert celery_sender.send.send_batch([declared]) == [None]
            client.delete(name)
            client.set(name, "not a list")
            batch = [*probes(2), OutboxMessage(task=MISROUTED, args=[0]), *probes(2)]
            outcomes = celery_sender.send.send_batch(batch)
            assert outcomes[2] is not None
            assert outcomes[:2] + outcomes[3:] == [None] * 4
            queued = queued_ids(queue.name, url)
            # Each neighbour arrived (twice at most: with the pipeline, and alone).
            assert set(queued) == {str(message.id) for message in batch[:2] + batch[3:]}
            assert len(queued) <= 8
            # The next batch without it is one pipeline again, each message once.
            again = probes(3)
            assert celery_sender.send.send_batch(again) == [None] * 3
            assert queued_ids(queue.name, url) == [str(message.id) for message in again]
        finally:
            client.delete(name)


@pytest.mark.servers
def test_a_partition_in_the_middle_of_a_batch_fails_only_what_rabbitmq_did_not_confirm():
    from celery.signals import before_task_publish
    from kombu import Queue

    queue = Queue(f"outbox-cut-{uuid.uuid4().hex[:8]}")
    other = Queue(f"outbox-cut-other-{uuid.uuid4().hex[:8]}")
    with partitioned_proxy(5672) as (port, dropping):
        url = f"amqp://guest:guest@127.0.0.1:{port}//"
        with current_celery_app(url, queue) as app:
            app.conf.task_queues = [queue, other]
            app.amqp.queues = app.amqp.Queues(app.conf.task_queues)
            app.conf.task_routes = {MISROUTED: {"queue": other.name}}
            app.task(name=MISROUTED)(probe)
            assert celery_sender.send.send_batch(probes(1)) == [None]
            # The fourth message's queue is declared in the middle of the batch (a round
            # trip, during which the broker's confirmations of the first three are read);
            # the partition starts as the fifth is published.
            batch = [*probes(3), OutboxMessage(task=MISROUTED, args=[1]), *probes(2)]
            fifth = str(batch[4].id)

            def partition(headers: dict[str, Any] | None = None, **_: Any) -> None:
                if headers and headers.get("id") == fifth:
                    dropping.set()

            before_task_publish.connect(partition, weak=False)
            try:
                started = time.monotonic()
                outcomes = celery_sender.send.send_batch(batch)
                took = time.monotonic() - started
            finally:
                before_task_publish.disconnect(partition)
            assert took < 2 * celery_sender.BROKER_TIMEOUT
    # What the partition dropped fails; what is reported sent is in the broker.
    assert outcomes[4] is not None
    assert outcomes[5] is not None
    broker = BROKERS["amqp"]
    queued = {*queued_ids(queue.name, broker), *queued_ids(other.name, broker)}
    sent = [message for message, outcome in zip(batch, outcomes, strict=True) if outcome is None]
    assert {str(message.id) for message in sent} <= queued


@pytest.mark.servers
def test_a_refusal_that_comes_while_its_message_is_still_published_fails_it():
    from amqp.exceptions import MessageNacked

    # A queue that takes nothing: RabbitMQ refuses (nacks) every message. With Celery's
    # task-sent events, each message is two publishes, and the first message on a
    # connection declares the events' exchange after its task's publish (a round trip),
    # while which the broker's refusal of the task's message arrives.
    queue = refusing_queue(0)
    url = BROKERS["amqp"]
    with current_celery_app(url, queue) as app:
        app.conf.task_send_sent_event = True
        outcomes = celery_sender.send.send_batch(probes(3))
        assert [type(outcome) for outcome in outcomes] == [MessageNacked] * 3
        assert queued_ids(queue.name, url) == []
