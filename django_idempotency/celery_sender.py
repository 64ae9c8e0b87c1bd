"""The default outbox sender: Celery's ``apply_async``, with the message id as the task id.

Imported only when ``OUTBOX_SENDER`` names it, so the rest of the app needs no Celery. It
sends through the current Celery app (the one the project configures), never a new one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

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
        """Send each message as ``send`` does, one publish each, all through one producer
        and one connection check; per message, in order, what its send raised, or ``None``.
        Never raises: a broker that cannot be reached, or a connection lost in the middle,
        fails every message not yet sent."""
        outcomes: list[Exception | None] = []
        try:
            app = current_app._get_current_object()  # type: ignore[attr-defined]
            if app.conf.task_always_eager:
                for message in messages:
                    outcomes.append(_published(message, None))
                return outcomes
            with _producers(app).acquire(block=True) as producer:
                producer.connection.ensure_connection(max_retries=0)
                cut = (OperationalError, *producer.connection.connection_errors)
                for message in messages:
                    outcome = _published(message, producer)
                    outcomes.append(outcome)
                    if isinstance(outcome, cut):
                        # The connection is gone (or stalled past the bound): each publish
                        # after it would wait as long again, holding the batch's locks, and
                        # so would closing it politely (a channel's and its own close,
                        # each awaiting an answer). Dropped without a word instead.
                        producer.connection.collect()
                        raise outcome
        except Exception as exc:  # the producer or its connection: the rest fail with it
            outcomes += [exc] * (len(messages) - len(outcomes))
        return outcomes


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
