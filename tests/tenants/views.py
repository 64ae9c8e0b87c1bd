"""A protected view served per tenant: a charge in the tenant's schema, and its receipt
through the tenant's outbox."""

from __future__ import annotations

import json

from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse

from django_idempotency import outbox
from django_idempotency.decorators import idempotent
from django_idempotency.models import OutboxMessage
from tests.tenants.models import Delivery
from tests.testapp.models import Charge

RECEIPT = "tests.tenants.receipt"


def account(request: HttpRequest) -> str:
    """The caller's id inside its tenant (each tenant numbers its users from 1): a stand-in
    for the tenant's own authentication."""
    return f"user:{request.headers['X-Caller']}"


@idempotent(operation="charges.create", account=account)
def create_charge(request: HttpRequest) -> HttpResponse:
    body = json.loads(request.body)
    with transaction.atomic():
        charge = Charge.objects.create(
            account=account(request), amount=body["amount"], currency="EUR"
        )
        outbox.enqueue(RECEIPT, charge.pk, connection.schema_name)
    return JsonResponse({"charge": charge.pk, "schema": connection.schema_name}, status=201)


def record(message: OutboxMessage) -> None:
    """OUTBOX_SENDER: count the send, with the schema the relay runs in."""
    Delivery.objects.create(
        schema=connection.schema_name, message=message.id, task=message.task, args=message.args
    )
