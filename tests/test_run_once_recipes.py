"""The ``run_once`` recipes (``example_project/recipes/``): a queue consumer that ships each
order once however often its message is redelivered, and a management command that is safe
to run twice. Effects are counted: shipments, statements and e-mails."""

from __future__ import annotations

from io import StringIO
from typing import Any

import pytest

pytest.importorskip(
    "example_project.recipes", reason="the example project is not here (tox tests the wheel)"
)

from django.apps import apps
from django.core import mail
from django.core.management import CommandError, call_command

from django_idempotency import run_once
from django_idempotency.models import IdempotencyRecord
from tests.factories import UserFactory

if not apps.is_installed("example_project.recipes"):
    pytest.skip("the recipes app is installed with DRF only", allow_module_level=True)

from example_project.payments.models import Charge
from example_project.recipes.management.commands import send_statements
from example_project.recipes.models import Shipment, Statement
from example_project.recipes.queue_consumer import Message, consume, ship_order

pytestmark = pytest.mark.django_db


# -- the queue consumer --------------------------------------------------------------------


def test_redelivered_messages_ship_once() -> None:
    m1 = Message("msg-1", {"order_id": 1})
    m2 = Message("msg-2", {"order_id": 2})
    outcome = consume([m1, m1, m2, m1, m2])
    assert outcome.acked == ["msg-1", "msg-1", "msg-2", "msg-1", "msg-2"]
    assert outcome.requeued == outcome.dead == []
    assert sorted(Shipment.objects.values_list("order_id", flat=True)) == [1, 2]
    assert Shipment.objects.get(order_id=1).message_id == "msg-1"
    # A later redelivery, from another consumer run: still no second shipment.
    assert consume([m1]).acked == ["msg-1"]
    assert Shipment.objects.count() == 2


def test_a_reused_message_id_with_another_body_is_dead_lettered() -> None:
    outcome = consume([Message("msg-1", {"order_id": 1}), Message("msg-1", {"order_id": 9})])
    assert outcome.acked == ["msg-1"]
    assert outcome.dead == ["msg-1"]
    assert list(Shipment.objects.values_list("order_id", flat=True)) == [1]


def test_a_message_being_handled_elsewhere_is_requeued() -> None:
    # Another consumer holds the message's live lease: here, the handler of the same
    # message, which sees its own redelivery arrive while it runs.
    seen: list[Any] = []

    def ship_and_see_redelivery(order_id: int) -> dict[str, Any]:
        seen.append(consume([Message("msg-1", {"order_id": order_id})]))
        return ship_order(order_id)

    run_once(
        ship_and_see_redelivery,
        1,
        account="consumer:shipping",
        operation="orders.ship",
        key="msg-1",
        fingerprint={"order_id": 1},
    )
    assert [o.requeued for o in seen] == [["msg-1"]]
    assert Shipment.objects.count() == 1


def test_a_message_whose_id_cannot_be_a_key_is_dead_lettered() -> None:
    outcome = consume([Message("", {"order_id": 1}), Message("x" * 256, {"order_id": 2})])
    assert outcome.dead == ["", "x" * 256]
    assert not Shipment.objects.exists()
    assert not IdempotencyRecord.objects.exists()


# -- the management command ------------------------------------------------------------------


def run_command(*args: str) -> str:
    out = StringIO()
    call_command("send_statements", *args, stdout=out, stderr=StringIO())
    return out.getvalue()


def test_send_statements_twice_sends_each_once() -> None:
    users = UserFactory.create_batch(3)
    Charge.objects.create(user=users[0], amount=500, currency="EUR", provider_charge_id="ch_1")
    month = Charge.objects.get().created_at.strftime("%Y-%m")
    assert run_command("--month", month) == f"{month}: 3 sent, 0 already sent, 0 not sent\n"
    assert run_command("--month", month) == f"{month}: 0 sent, 3 already sent, 0 not sent\n"
    assert Statement.objects.count() == 3
    assert len(mail.outbox) == 3
    assert Statement.objects.get(user=users[0]).charges_total == 500
    # A new customer since: the next run sends theirs only.
    UserFactory()
    assert run_command("--month", month).startswith(f"{month}: 1 sent, 3 already sent")
    assert len(mail.outbox) == 4


def test_a_run_that_failed_halfway_is_finished_by_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    users = UserFactory.create_batch(3)
    real = send_statements.send_statement

    def fail_on_second(user_id: int, month: str) -> dict[str, Any]:
        if user_id == users[1].pk:
            raise ConnectionError("mail server down")
        return real(user_id, month)

    monkeypatch.setattr(send_statements, "send_statement", fail_on_second)
    with pytest.raises(ConnectionError):
        run_command("--month", "2026-11")
    assert Statement.objects.count() == 1
    monkeypatch.setattr(send_statements, "send_statement", real)
    assert run_command("--month", "2026-11").startswith("2026-11: 2 sent, 1 already sent")
    assert Statement.objects.count() == 3
    assert len(mail.outbox) == 3
    assert set(Statement.objects.values_list("user_id", flat=True)) == {u.pk for u in users}


@pytest.mark.parametrize("month", ["2026-13", "26-11", "2026-1", "november"])
def test_send_statements_refuses_a_wrong_month(month: str) -> None:
    UserFactory()
    with pytest.raises(CommandError, match="YYYY-MM"):
        run_command("--month", month)
    assert not Statement.objects.exists()
    assert not IdempotencyRecord.objects.exists()
