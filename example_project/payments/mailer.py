"""A fake mail service, without idempotency keys, as most are: every call sends one mail.

It writes through the ``provider`` connection, as the fake payment provider does, so what it
sent survives a rollback of the caller's transaction and a crash of the caller, like a mail
that left the building. ``SentMail`` counts the mails.
"""

from __future__ import annotations

from example_project.payments.models import SentMail
from example_project.payments.provider import ALIAS


def send(recipient: str, subject: str, body: str) -> int:
    """Send one mail; its id at the mail service."""
    return SentMail.objects.using(ALIAS).create(recipient=recipient, subject=subject, body=body).pk
