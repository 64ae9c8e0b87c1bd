from __future__ import annotations

from datetime import timedelta

import factory
from django.contrib.auth.models import User
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
