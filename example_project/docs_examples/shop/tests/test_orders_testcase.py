"""Two more scenarios, in Django's ``TestCase`` style: a retry after the TTL, and a queue
that delivers the confirmation twice. The helpers are the same as under pytest."""

from __future__ import annotations

from unittest import mock

from django.contrib.auth.models import User
from django.core import mail
from django.test import TestCase

from django_idempotency.models import OutboxMessage
from django_idempotency.testing import FakeProvider, assert_replay, expire_ttl, new_key, redeliver
from example_project.docs_examples.shop.models import Order
from example_project.docs_examples.shop.tasks import send_confirmation

GATEWAY = "example_project.docs_examples.shop.payments.charge"


# --8<-- [start:testcase]
class OrderRetryTests(TestCase):
    def setUp(self) -> None:
        self.gateway = FakeProvider(answer=lambda n: f"pay_{n}")
        patcher = mock.patch(GATEWAY, self.gateway)
        patcher.start()
        self.addCleanup(patcher.stop)
        self.client.force_login(User.objects.create_user("carol", "carol@example.com"))

    def order(self, key: str):
        return self.client.post(
            "/shop/orders/",
            {"item": "kettle", "amount": 4000, "currency": "EUR"},
            content_type="application/json",
            headers={"Idempotency-Key": key},
        )

    # --8<-- [end:testcase]

    # --8<-- [start:ttl]
    def test_a_retry_after_the_ttl_is_a_new_order(self) -> None:
        key = new_key()
        first = self.order(key)
        assert_replay(first, self.order(key))  # within the TTL: the same order
        expire_ttl(key)  # no sleeping: the TTL (a day by default) went by
        again = self.order(key)
        assert again.status_code == 201
        assert not again.has_header("Idempotent-Replayed")
        assert Order.objects.count() == 2  # a new order, as documented
        # The payment key is derived from the client's key: the gateway's own window, if
        # it still holds that key, answers the first payment again.
        assert len(self.gateway.effects) == 1
        # --8<-- [end:ttl]

    # --8<-- [start:queue]
    def test_a_duplicate_delivery_sends_one_confirmation(self) -> None:
        self.order(new_key())
        message = OutboxMessage.objects.get(task="shop.send_confirmation")
        # As the relay sends it (the message id is the task id), delivered twice:
        results = redeliver(send_confirmation, *message.args, task_id=str(message.id))
        assert results == ["carol@example.com", "carol@example.com"]
        assert len(mail.outbox) == 1
        # --8<-- [end:queue]
