"""Consumers and senders shown in the documentation: Celery tasks, ``run_once``, the outbox."""

from __future__ import annotations

import json
from typing import Any

from celery import shared_task
from django.db import transaction

from django_idempotency.models import OutboxMessage
from example_project.payments.models import Charge
from example_project.payments.tasks import send_receipt


# --8<-- [start:idempotent-task]
from django_idempotency.tasks import idempotent_task


@shared_task(acks_late=True)
@idempotent_task(key=lambda order_id, **kw: f"order:{order_id}", lease=300, ttl=7 * 86400)
def ship_order(order_id: int, carrier: str = "ups") -> dict[str, Any]:
    return {"order": order_id, "carrier": carrier}


# --8<-- [end:idempotent-task]


# --8<-- [start:run-once]
from django_idempotency import InProgress, run_once


def handle_delivery(event_id: str, charge_id: int) -> str:
    """A queue consumer: the same event twice (a redelivery) sends one receipt."""
    try:
        return run_once(
            send_receipt_once,
            charge_id,
            account="consumer:receipts",
            operation="receipts.send",
            key=event_id,
        )
    except InProgress as busy:  # another delivery of this event is running right now
        raise RuntimeError(f"redeliver in {busy.retry_after} s") from busy


def send_receipt_once(charge_id: int) -> str:
    charge = Charge.objects.get(pk=charge_id)
    charge.description = f"{charge.description} (receipt sent)".strip()
    charge.save(update_fields=["description"])  # commits with the record, or not at all
    return charge.description


# --8<-- [end:run-once]


# --8<-- [start:enqueue]
from django_idempotency.outbox import enqueue


def refund_and_notify(charge: Charge) -> None:
    with transaction.atomic():  # or inside a protected view, already in its transaction
        charge.description = "refunded"
        charge.save(update_fields=["description"])
        enqueue(send_receipt, charge.pk)  # a Celery task, or its registered name


# --8<-- [end:enqueue]


class Producer:
    """A stand-in for a message broker's client (Kafka's, SNS'): it keeps what it got."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, str]] = []

    def produce(self, topic: str, key: str, value: str) -> None:
        self.sent.append((topic, key, value))

    def flush(self, timeout: float) -> int:
        return 0  # messages still waiting


producer = Producer()
TOPICS = {"payments.send_receipt": "receipts"}


# --8<-- [start:sender]
from django_idempotency.outbox import Undeliverable


def send(message: OutboxMessage) -> None:
    if message.task not in TOPICS:
        raise Undeliverable(f"no topic for {message.task}")  # dead at once
    producer.produce(
        TOPICS[message.task],
        key=str(message.id),
        value=json.dumps({"args": message.args, "kwargs": message.kwargs}),
    )
    if producer.flush(5):  # raise if not delivered: the relay retries it later
        raise RuntimeError("not delivered")


# --8<-- [end:sender]
