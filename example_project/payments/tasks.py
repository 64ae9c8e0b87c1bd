"""Receipts: a task the charges endpoint enqueues once its charge has committed.

The view enqueues it with ``enqueue_on_commit``, whose task id is derived from the charge's
idempotency key: a retried charge request that runs again (after a crash) sends the same task
id, and ``idempotent_task`` (keyed by the task id) lets only one delivery run.
"""

from __future__ import annotations

from celery import shared_task
from django.core.mail import send_mail

from django_idempotency.tasks import idempotent_task
from example_project.payments.models import Charge


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
