"""A queue consumer that ships each order once, however often its message is delivered.

Kafka, SQS and RabbitMQ deliver at least once: a consumer that dies before it acknowledges
gets the message again, and so may another consumer after a visibility timeout. Here a
plain loop over messages stands for the broker's client; each message is handled under
``run_once``, keyed by the message's id, so a redelivery returns the stored result instead
of shipping again. The shipment and the completion of the record commit together.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django_idempotency import InProgress, KeyReused, OutcomeUnknown, current, run_once
from django_idempotency.keys import InvalidKey
from example_project.recipes.models import Shipment


@dataclass(frozen=True)
class Message:
    """One delivery of a message: its id (the same on every redelivery) and its body."""

    id: str
    body: dict[str, Any]


@dataclass
class Outcome:
    """What the loop did with each delivery, by message id."""

    acked: list[str] = field(default_factory=list)
    #: Another consumer is handling it right now: leave it to the broker to redeliver.
    requeued: list[str] = field(default_factory=list)
    #: Needs a person: an id that cannot be a key, a reused id with another body, or an
    #: earlier attempt that stopped midway under the "fail" recovery policy.
    dead: list[str] = field(default_factory=list)


def ship_order(order_id: int) -> dict[str, Any]:
    """The side effect: one shipment for the order. Its result is stored as JSON."""
    context = current()  # the running operation: its key, account, downstream_key(name)
    assert context is not None
    shipment = Shipment.objects.create(order_id=order_id, message_id=context.key)
    return {"shipment": shipment.pk, "order": order_id}


def consume(messages: Iterable[Message]) -> Outcome:
    """Handle each delivery at most once per message id; acknowledge what is done."""
    outcome = Outcome()
    for message in messages:
        try:
            run_once(
                ship_order,
                message.body["order_id"],
                account="consumer:shipping",
                operation="orders.ship",
                key=message.id,
                fingerprint=message.body,  # the same id with another body is refused
                ttl=timedelta(days=7),  # longer than the broker keeps redelivering
            )
        except InProgress:
            outcome.requeued.append(message.id)
        except (InvalidKey, KeyReused, OutcomeUnknown):
            outcome.dead.append(message.id)
        else:
            outcome.acked.append(message.id)
    return outcome
