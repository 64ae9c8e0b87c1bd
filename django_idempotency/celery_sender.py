"""The default outbox sender: Celery's ``apply_async``, with the message id as the task id.

Imported only when ``OUTBOX_SENDER`` names it, so the rest of the app needs no Celery. It
sends through the current Celery app (the one the project configures), never a new one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

from amqp.exceptions import MessageNacked
from celery import current_app
from celery.exceptions import NotRegistered
from kombu import pools
from kombu.exceptions import OperationalError

from django_idempotency._unique import RUN_HEADER
from django_idempotency.models import OutboxMessage
from django_idempotency.outbox import UnknownTask

# Apps whose task modules were imported already, once per process (by id).
_loaded: set[int] = set()

#: Seconds the sender waits on the broker for one answer (its connection's handshake, one
#: publish or its confirmation) before the send fails, where the project's
#: ``broker_transport_options`` set no bound of their own: a broker that accepts the
#: connection and never answers (stalled, or behind a proxy whose other side is gone) would
#: otherwise hold the batch's row locks, and the relay past SIGTERM, for ever.
BROKER_TIMEOUT = 10.0

# Per transport (its module), the transport options the sender's connection takes where the
# project set none: waits on the broker bounded, and on AMQP each publish confirmed by the
# broker (without a confirmation, a publish into a connection that a partition cut without
# a FIN or a RST is written to the socket and lost, and the message was marked sent).
_OPTIONS: dict[str, dict[str, Any]] = {
    "kombu.transport.redis": {
        "socket_timeout": BROKER_TIMEOUT,
        "socket_connect_timeout": BROKER_TIMEOUT,
    },
    "kombu.transport.pyamqp": {
        "read_timeout": BROKER_TIMEOUT,
        "write_timeout": BROKER_TIMEOUT,
        "confirm_publish": True,
    },
}

# Per (app, process): the producers on a connection with the options the project left unset.
_bounded: dict[tuple[int, int], Any] = {}


class CelerySender:
    """The sender ``send``: one message (``send(message)``), or a batch through one
    producer (``send_batch``), which the relay uses for the messages of a batch."""

    def __call__(self, message: OutboxMessage) -> None:
        """Send ``message`` with ``apply_async(task_id=str(message.id))``; raise on failure.

        The task is looked up by name in the current app's registry, after importing its
        task modules (``include``, ``imports``, autodiscovery) the way a worker does: a
        relay process may not have imported them yet. A name still unknown raises
        :class:`UnknownTask`, and the message is dead at once.

        Nothing here waits for the broker: a broker that cannot be reached fails the send
        at once (no connection retries, ``retry=False``), and the outbox retries it with its
        own backoff instead of holding the batch's row locks meanwhile.
        """
        (outcome,) = self.send_batch([message])
        if outcome is not None:
            raise outcome

    def send_batch(self, messages: Sequence[OutboxMessage]) -> list[Exception | None]:
        """Send each message as ``send`` does, all through one producer and one connection
        check, waiting on the broker once for the batch where it allows: into Redis the
        batch's pushes go in one pipeline (kombu's ``Producer.batch``, kombu 5.7 and later),
        into RabbitMQ the publishes go out one after another and the broker's confirmations
        are awaited together. Per message, in order, what its send raised, or ``None``.
        Never raises: a broker that cannot be reached, or a connection lost in the middle,
        fails every message not yet confirmed."""
        outcomes: list[Exception | None] = []
        try:
            app = current_app._get_current_object()  # type: ignore[attr-defined]
            if app.conf.task_always_eager:
                for message in messages:
                    outcomes.append(_published(message, None))
                return outcomes
            with _producers(app).acquire(block=True) as producer:
                producer.connection.ensure_connection(max_retries=0)
                _publish_all(app, producer, messages, outcomes)
        except Exception as exc:  # the producer or its connection: the rest fail with it
            outcomes += [exc] * (len(messages) - len(outcomes))
        return outcomes


def _publish_all(
    app: Any, producer: Any, messages: Sequence[OutboxMessage], outcomes: list[Exception | None]
) -> None:
    """Publish ``messages`` through ``producer`` into ``outcomes``; a failure that ends
    the batch (its connection lost, its pipeline or its confirmations) fails every message
    that the broker had not confirmed and whose publish had not failed on its own, and is
    raised for the rest."""
    connection = producer.connection
    confirms = _Confirms.on(app, connection)
    if confirms is not None:
        _confirmed_all(app, connection, confirms, messages, outcomes)
        return
    batch = getattr(producer, "batch", lambda **_: contextlib.nullcontext())(
        max_size=_PIPELINE_COMMANDS
    )
    try:
        with batch:
            for message in messages:
                outcome = _published(message, producer)
                outcomes.append(outcome)
                if outcome is not None and _cut(connection, outcome):
                    raise outcome
    except Exception as exc:
        if _cut(connection, exc) or _cut(connection, exc.__cause__):
            # The connection is gone or stalled past the bound: each publish after it
            # would wait as long again, holding the batch's locks, and so would closing it
            # politely (a channel's and its own close, each awaiting an answer). Dropped
            # without a word instead.
            connection.collect()
        elif len(outcomes) == len(messages):
            # The broker answered the pipeline, refusing some of its commands (a push
            # onto a key of another type than a queue's): which ones, the pipeline does not
            # tell. Each message it held is pushed again on its own, so that only those
            # the broker refuses fail (the others, pushed with the pipeline too, arrive
            # twice: at least once).
            for place, outcome in enumerate(outcomes):
                if outcome is None:
                    outcome = outcomes[place] = _published(messages[place], producer)
                    if outcome is not None and _cut(connection, outcome):
                        connection.collect()
                        outcomes[place:] = [
                            outcome if each is None else each for each in outcomes[place:]
                        ]
                        raise outcome from exc
            return
        # Published, but never known to have reached the broker: sent again later.
        outcomes[:] = [exc if outcome is None else outcome for outcome in outcomes]
        raise


def _cut(connection: Any, error: BaseException | None) -> bool:
    """Whether ``error`` says the connection is lost or stalled past its bound. Celery
    reports a channel's errors (a queue the broker refuses to declare) as
    ``OperationalError`` too, raised from the broker's own error: those leave the
    connection usable, and fail only their message."""
    if error is None:
        return False
    if isinstance(error, connection.connection_errors):
        return True
    if isinstance(error, OperationalError):
        cause = error.__cause__
        return cause is None or isinstance(cause, connection.connection_errors)
    return False


def _confirmed_all(
    app: Any,
    connection: Any,
    confirms: _Confirms,
    messages: Sequence[OutboxMessage],
    outcomes: list[Exception | None],
) -> None:
    """:func:`_publish_all` through a confirming channel. Where the broker closes that
    channel (a channel error, raised for one message: routed to an exchange that does not
    exist, or to a queue that exists with other arguments; every publish after it on that
    channel is dropped), the messages it did not confirm are sent again one at a time, each
    awaiting its confirmation: the one the broker refuses fails alone, with its error."""
    alone = confirms.send(messages, outcomes, connection)
    for number, place in enumerate(alone):
        single: list[Exception | None] = []
        try:
            confirms = _Confirms.on(app, connection) or confirms
            refused = confirms.send([messages[place]], single, connection)
        except Exception as exc:
            # The connection is lost: this message and those still to be sent alone fail.
            for later in alone[number:]:
                outcomes[later] = exc
            raise
        outcomes[place] = confirms.closed_by if refused else single[0]


# The most Redis commands kombu's pipeline holds before it sends them: more than a batch of
# the relay sends (one push per message, and a few more for a queue with an expiry), so
# that a batch is one round trip.
_PIPELINE_COMMANDS = 100_000


_ON_CONNECTION = "_django_idempotency_confirms"


class _Confirms:
    """The sender's own channel on one AMQP connection (py-amqp) whose publishes the broker
    confirms: a batch's publishes go out one after another and their confirmations are
    awaited once, for the batch, in place of py-amqp's wait after each publish. Only where
    that connection asks for confirmations (``confirm_publish``)."""

    @classmethod
    def on(cls, app: Any, connection: Any) -> _Confirms | None:
        raw = connection.connection
        if not getattr(raw, "confirm_publish", False) or not hasattr(raw, "drain_events"):
            return None
        # Kept on the connection itself, so that it ends with it (a mapping of its own
        # would keep every connection alive through its channel).
        confirms: _Confirms | None = getattr(raw, _ON_CONNECTION, None)
        if confirms is None or not confirms.channel.is_open or confirms.unsettled:
            confirms = cls(app, connection)
            setattr(raw, _ON_CONNECTION, confirms)
        return confirms

    def __init__(self, app: Any, connection: Any) -> None:
        self.channel = channel = connection.channel()
        self.raw = connection.connection
        channel.confirm_select()
        channel._confirm_selected = True  # py-amqp's own confirmed publish: not again
        channel.basic_publish = self._publish
        # A channel the broker closes (a channel error) is not opened again in its place
        # without confirmations, as py-amqp would: it ends, and the next send opens another.
        channel._do_revive = self._closed
        channel.events["basic_ack"].add(self._acked)
        channel.events["basic_nack"].add(self._nacked)
        self.producer = app.amqp.Producer(channel, auto_declare=False)
        self.tags = 0  # the delivery tags the broker gave this channel's publishes
        self.unsettled: dict[int, int] = {}  # tag: its message's place in the batch
        self.outcomes: list[Exception | None] = []
        self.refused: set[int] = set()  # the places of the messages the broker refused
        #: The broker's error that closed the channel, once it did.
        self.closed_by: Exception | None = None

    def _closed(self) -> None:
        self.closed_by = _ChannelClosed("the broker closed the channel")
        self.channel.collect()

    def _publish(self, *args: Any, **kwargs: Any) -> Any:
        if self.closed_by is not None:
            raise self.closed_by
        kwargs.pop("confirm_timeout", None)  # confirmations are awaited in send()
        sent = self.channel._basic_publish(*args, **kwargs)
        self.tags += 1
        # Celery may publish more than the message (its task-sent event): each publish
        # counts for the message being sent.
        self.unsettled[self.tags] = len(self.outcomes)
        return sent

    def _settled(self, tag: int, multiple: bool) -> list[int]:
        tags = [each for each in self.unsettled if each <= tag] if multiple else [tag]
        return [self.unsettled.pop(each) for each in tags if each in self.unsettled]

    def _acked(self, tag: int, multiple: bool) -> None:
        self._settled(tag, multiple)

    def _nacked(self, tag: int, multiple: bool) -> None:
        # Recorded on the message once its publish returned: a refusal can come while the
        # message is still being published (its task-sent event's exchange declared, a
        # round trip, after the message itself).
        self.refused.update(self._settled(tag, multiple))

    def send(
        self, messages: Sequence[OutboxMessage], outcomes: list[Exception | None], connection: Any
    ) -> list[int]:
        """Publish ``messages`` into ``outcomes`` (empty) and await their confirmations.
        Where the broker closed the channel, the places of the messages it neither
        confirmed nor refused (to be sent again), in order; none where it did not. A
        connection lost drops the connection, fails the messages not confirmed and is
        raised."""
        self.outcomes = outcomes
        alone: list[int] = []
        try:
            for place, message in enumerate(messages):
                if self.closed_by is not None:
                    # Each publish after the channel's close would be dropped.
                    outcomes.append(None)
                    alone.append(place)
                    continue
                outcome = _published(message, self.producer)
                outcomes.append(outcome)
                if self.closed_by is not None:
                    # This publish, or one before it, made the broker close the channel.
                    self.closed_by = outcome or self.closed_by
                    outcomes[place] = None
                    alone.append(place)
                elif outcome is not None and _cut(connection, outcome):
                    raise outcome
            # Each wait is bounded by the connection's read_timeout (BROKER_TIMEOUT
            # where the project set none).
            while self.unsettled and self.closed_by is None:
                try:
                    self.raw.drain_events()
                except Exception as exc:
                    if self.closed_by is None:
                        raise
                    self.closed_by = exc
        except Exception as exc:
            # The connection is gone, stalled past the bound or its confirmations are
            # unaccounted for: each publish after it would wait as long again, holding
            # the batch's locks, and so would closing it politely (a channel's and its own
            # close, each awaiting an answer). Dropped without a word instead.
            connection.collect()
            # Published, but never known to have reached the broker: sent again later.
            for place in set(self.unsettled.values()):
                if outcomes[place] is None:
                    outcomes[place] = exc
            self.unsettled.clear()
            raise
        finally:
            for place in self.refused:
                if place < len(outcomes) and outcomes[place] is None:
                    outcomes[place] = MessageNacked("the broker refused the message")
            self.refused.clear()
            self.outcomes = []
        if self.closed_by is None:
            return []
        # The broker sends no confirmation on a closed channel.
        alone += [place for place in self.unsettled.values() if outcomes[place] is None]
        self.unsettled.clear()
        return sorted(set(alone))


class _ChannelClosed(Exception):
    """The broker closed the sender's channel while a batch was published on it."""


def _published(message: OutboxMessage, producer: Any) -> Exception | None:
    try:
        options: dict[str, Any] = {
            "args": message.args,
            "kwargs": message.kwargs,
            "task_id": str(message.id),
            "retry": False,
        }
        if message.run_reported:  # the worker reports its run on its enqueue_once key
            options["headers"] = {RUN_HEADER: "1"}
        if producer is not None:
            options["producer"] = producer
        _task(message.task).apply_async(**options)
    except Exception as exc:  # recorded on its message by the relay
        return exc
    return None


def _producers(app: Any) -> Any:
    """The producer pool the sender publishes through: the app's own, or where the project
    left a wait on its broker unbounded (or AMQP's publishes unconfirmed), one on a
    connection like the app's with :data:`BROKER_TIMEOUT` as that bound (and publisher
    confirms), the project's own options kept."""
    key = (id(app), os.getpid())  # a forked process opens connections of its own
    found = _bounded.get(key)
    if found is not None:
        return found
    connection = app.connection_for_write()
    configured = app.conf.broker_transport_options or {}
    wanted = _OPTIONS.get(type(connection.transport).__module__, {})
    missing = {name: value for name, value in wanted.items() if configured.get(name) is None}
    connection.release()
    if missing:
        found = pools.producers[app.connection_for_write(transport_options=missing)]
        found.limit = app.pool.limit
    else:
        found = app.amqp.producer_pool
    _bounded[key] = found
    return found


#: ``OUTBOX_SENDER``'s default.
send = CelerySender()


def _task(name: str) -> Any:
    # The app itself, not the proxy: its identity says whether its modules were imported.
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    if name not in app.tasks and id(app) not in _loaded:
        app.loader.import_default_modules()
        _loaded.add(id(app))
    try:
        return app.tasks[name]
    except NotRegistered:
        raise UnknownTask(f"no task named {name!r} is registered") from None
