"""The order confirmation: an e-mail sent by a Celery task, through the outbox."""

from __future__ import annotations

from celery import shared_task
from django.core.mail import send_mail

from django_idempotency.tasks import idempotent_task
from example_project.docs_examples.shop.models import Order


# --8<-- [start:task]
@shared_task(name="shop.send_confirmation", acks_late=True, reject_on_worker_lost=True)
@idempotent_task()
def send_confirmation(order_id: int) -> str:
    """E-mail the customer that the order is paid; once per delivery, however often the
    broker (or the outbox relay) delivers it."""
    order = Order.objects.select_related("customer").get(pk=order_id)
    send_mail(
        subject=f"Your order: {order.item}",
        message=f"We received {order.amount} {order.currency} (payment {order.payment}).",
        from_email=None,
        recipient_list=[order.customer.email],
    )
    return order.customer.email
    # --8<-- [end:task]
