from __future__ import annotations

from datetime import timedelta
from typing import Any

import factory
from django.contrib.auth.models import User
from django.db import connection, models
from django.utils import timezone

from django_idempotency.models import IdempotencyRecord, RecordStatus


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = User

    username = factory.Sequence(lambda n: f"user{n}")
    password = factory.django.Password("password")


class RecordFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = IdempotencyRecord

    account = "user:1"
    operation = "charges.create"
    key = factory.Sequence(lambda n: f"key-{n}")
    request_hash = "0" * 64
    status = RecordStatus.COMPLETED
    response_status = 201
    response_headers = factory.LazyFunction(lambda: [["Content-Type", "application/json"]])
    response_body = b'{"ok":true}'
    expires_at = factory.LazyFunction(lambda: timezone.now() + timedelta(hours=24))


def store_raw_json(model: type[models.Model], pk: Any, column: str, text: str) -> None:
    """Write ``text`` into a JSON column of a row as another program could, past the ORM's
    encoder and past every check of this package."""
    table = connection.ops.quote_name(model._meta.db_table)
    value = model._meta.pk.get_db_prep_value(pk, connection)
    cast = "::jsonb" if connection.vendor == "postgresql" else ""
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET {connection.ops.quote_name(column)} = %s{cast} WHERE id = %s",
            [text, value],
        )
