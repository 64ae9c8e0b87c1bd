"""Receipts through Django's Tasks framework: the same receipt as the Celery task, no Celery.

With ``EXAMPLE_TASKS_RECEIPTS=1`` the charges endpoint also enqueues :func:`mail_receipt`
with ``task.enqueue()`` in the charge's transaction. The default backend of the example's
``TASKS`` is ``django_idempotency.tasks_backend.OutboxBackend``: the enqueue is an outbox
message, ``manage.py relay_outbox`` hands it to the database backend ``worker``, and
``manage.py db_worker --backend worker`` runs it, once per charge however often it is
delivered (docs/tasks.md).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from django.core.mail import send_mail

from django_idempotency.tasks import idempotent_task
from example_project.payments.models import Charge

if TYPE_CHECKING or importlib.util.find_spec("django.tasks") is None:
    from django_tasks import task
else:  # Django 6
    from django.tasks import task


@task()
@idempotent_task()
def mail_receipt(charge_id: int) -> str | None:
    """E-mail the receipt of one charge to its customer, once per enqueue."""
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
