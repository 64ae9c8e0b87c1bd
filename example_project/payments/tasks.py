"""Receipts: a task the charges endpoint puts in the outbox with its charge.

The view calls ``django_idempotency.outbox.enqueue`` in the charge's transaction, so there is
one outbox message per committed charge, and ``manage.py relay_outbox`` sends it with the
message id as the task id. The relay may send a message twice (it died between the send and
marking it sent): ``idempotent_task``, keyed by the task id, lets only one delivery run.
"""

from __future__ import annotations

from celery import shared_task
from django.core.mail import send_mail

from django_idempotency.tasks import idempotent_task
from example_project.payments.models import Charge


# --8<-- [start:send-receipt]
@shared_task(name="payments.send_receipt", acks_late=True, reject_on_worker_lost=True)
@idempotent_task()
def send_receipt(charge_id: int) -> str | None:
    """E-mail the receipt of one charge to its customer, at most once per charge request.

    The mail leaves before the task's record commits: a worker that dies between the two
    sends it again on redelivery. A mail server has no idempotency key to dedupe that one
    case; a provider that has one should get ``downstream_key``-style keys instead.
    """
    charge = Charge.objects.select_related("user").get(pk=charge_id)
    if not charge.user.email:
        return None
    send_mail(
        subject=f"Your receipt: {charge.amount} {charge.currency}",
        message=(
            f"We charged {charge.amount} (minor units) {charge.currency}.\n"
            f"Reference: {charge.provider_charge_id}\n"
            f"{charge.description}"
        ),
        from_email=None,
        recipient_list=[charge.user.email],
    )
    return charge.user.email
    # --8<-- [end:send-receipt]
